"""Reconciliation on the real Redis and PostgreSQL, with no worker consuming: stranded jobs are
sent again exactly once, live ones are left alone, and shard load follows the store."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta

import pytest
import redis
from sqlalchemy import select, update

from jobsvc import Client
from jobsvc.keys import LOAD_KEY, messages_key, queue_name
from jobsvc.reconcile import Reconciler
from jobsvc.settings import Settings
from jobsvc.store import Store, utcnow
from jobsvc.store.tables import Job
from jobsvc.transport import make_celery, message_finished
from jobsvc.wire import JobStatus, QueueMessage
from tests.support.environment import TEST_DATABASE, recreate_database
from tests.support.jobs import TEST_MESSAGE, claim, record_queued_job
from tests.support.queues import queued_jobs, queued_message_ids

pytestmark = pytest.mark.integration


@pytest.fixture()
def reconciling(routing_settings: Settings) -> Iterator[tuple[Settings, Store, Reconciler]]:
    """A database of its own (a round looks at every unfinished job) and a Redis no worker
    consumes, with a short grace."""
    settings = replace(routing_settings, stranded_grace=5, shards=2,
                       database_url=recreate_database(TEST_DATABASE + "_reconcile"))
    store = Store(settings.resolved_database_url)
    broker = redis.Redis.from_url(settings.redis_url)
    broker.flushdb()
    yield settings, store, Reconciler(settings, broker, store, make_celery(settings))
    store.dispose()
    broker.flushdb()


def _queued_messages(settings: Settings, shard: int) -> list[QueueMessage]:
    broker = redis.Redis.from_url(settings.redis_url)
    return [QueueMessage(shard, [], task_id) for task_id in queued_message_ids(broker, shard)]


def _age(store: Store, job_ids: list[str], seconds: float) -> None:
    with store.engine.begin() as connection:
        connection.execute(update(Job).where(Job.id.in_(job_ids)).values(
            enqueued_at=utcnow() - timedelta(seconds=seconds)))


def test_a_job_recorded_but_never_enqueued_is_sent_again_once_its_grace_has_passed(
        reconciling: tuple[Settings, Store, Reconciler]) -> None:
    settings, store, _ = reconciling
    settings = replace(settings, stranded_grace=1)
    reconciler = Reconciler(settings, redis.Redis.from_url(settings.redis_url), store,
                            make_celery(settings))
    assert reconciler.run_round().requeued == 0  # rounds ran before the producer died
    job_id = record_queued_job(store, message_id="never-sent")
    assert reconciler.run_round().requeued == 0  # still within its grace
    time.sleep(settings.stranded_grace + 0.2)
    assert reconciler.run_round().requeued == 1
    # Sent under the message its row names, which the store kept as it was.
    assert [message.message_id for message in _queued_messages(settings, 0)] == ["never-sent"]
    assert store_message_ids(store, [job_id]) == {"never-sent"}
    time.sleep(settings.stranded_grace + 0.2)
    assert reconciler.run_round().requeued == 0
    assert len(_queued_messages(settings, 0)) == 1


def test_jobs_whose_message_redis_holds_are_left_alone_and_checked_once(
        reconciling: tuple[Settings, Store, Reconciler]) -> None:
    settings, store, reconciler = reconciling
    broker = redis.Redis.from_url(settings.redis_url)
    assert reconciler.run_round().requeued == 0  # a fresh Redis: every job is checked
    with Client(settings=settings) as client:
        queued = client.submit_many([{"document": "The keeper's seven cats.", "question": q}
                                     for q in ("How many?", "Whose?")])
    # A message a worker holds stays in its shard's set while it runs, out of the queue.
    leased = record_queued_job(store, message_id="leased-message")
    broker.sadd(messages_key(0), "leased-message")
    _age(store, [*queued, leased], 60)
    assert reconciler.run_round().requeued == 0
    assert {store.get_many([job])[job].status for job in [*queued, leased]} == {
        JobStatus.QUEUED}
    # Checked once: a message lost afterwards is no longer looked for among new ones, only by
    # the sweep of every unfinished job, or at once if its task dropped it.
    message_finished(broker, 0, "leased-message", [leased])
    assert reconciler.run_round().requeued == 1
    assert store.get_many([leased])[leased].status == JobStatus.QUEUED
    (message,) = [message for message in _queued_messages(settings, 0)
                  if message.message_id not in store_message_ids(store, queued)]
    assert store_message_ids(store, [leased]) == {message.message_id}


def test_a_redis_that_lost_its_messages_gets_every_unfinished_job_again_once(
        reconciling: tuple[Settings, Store, Reconciler]) -> None:
    settings, store, reconciler = reconciling
    broker = redis.Redis.from_url(settings.redis_url)
    with Client(settings=settings) as client:
        ids = client.submit_many([{"document": f"Document {n % 3}.", "question": f"Q{n}?"}
                                  for n in range(40)])
    finished = ids[0]
    store.cancel(finished)
    assert reconciler.run_round().requeued == 0
    _age(store, ids, 60)
    broker.flushdb()
    assert reconciler.run_round().requeued == len(ids) - 1
    queued = queued_jobs(broker, range(settings.shards))
    assert sorted(queued) == sorted(ids[1:])
    assert all(store_message_ids(store, [job_id]) == {message}
               for job_id, message in queued.items())
    assert reconciler.run_round().requeued == 0


def test_the_sweep_finds_a_job_whose_message_vanished_after_it_was_checked(
        reconciling: tuple[Settings, Store, Reconciler]) -> None:
    settings, store, reconciler = reconciling
    broker = redis.Redis.from_url(settings.redis_url)
    assert reconciler.run_round().requeued == 0
    job_id = record_queued_job(store, message_id="swept")
    broker.sadd(messages_key(0), "swept")
    _age(store, [job_id], 60)
    assert reconciler.run_round().requeued == 0
    broker.srem(messages_key(0), "swept")  # as if someone deleted the queue's message
    # The sweep reaches its message within one turn of its buckets: with so few jobs
    # unfinished, a round sweeps from where the last stopped to the last bucket, the next
    # from the first on.
    assert sum(reconciler.run_round().requeued for _ in range(2)) == 1
    # Unclaimed: sent again under the message its record names, which the store keeps.
    assert [message.message_id for message in _queued_messages(settings, 0)] == ["swept"]
    assert store_message_ids(store, [job_id]) == {"swept"}
    assert broker.sismember(messages_key(0), "swept")


def test_a_claimed_job_whose_message_was_dropped_gets_a_new_message(
        reconciling: tuple[Settings, Store, Reconciler]) -> None:
    settings, store, reconciler = reconciling
    broker = redis.Redis.from_url(settings.redis_url)
    assert reconciler.run_round().requeued == 0
    job_id = record_queued_job(store)
    claim(store, [job_id])
    message_finished(broker, 0, TEST_MESSAGE, [job_id])
    assert reconciler.run_round().requeued == 1
    (message,) = _queued_messages(settings, 0)
    assert message.message_id != TEST_MESSAGE
    assert store_message_ids(store, [job_id]) == {message.message_id}
    record = store.get_many([job_id])[job_id]
    assert record.status == JobStatus.QUEUED


def test_load_no_unfinished_job_holds_is_returned_once_the_difference_persists(
        reconciling: tuple[Settings, Store, Reconciler]) -> None:
    settings, store, reconciler = reconciling
    record_queued_job(store, load=100)
    broker = redis.Redis.from_url(settings.redis_url)
    # Shard 0 was charged for a submit whose producer died; shard 1 holds a value no jobsvc
    # process wrote.
    broker.hset(LOAD_KEY, mapping={"0": 1100, "1": str(2**70)})
    first = reconciler.run_round().load_corrected
    assert first == {1: 0}  # replaced at once, by the true load
    assert int(broker.hget(LOAD_KEY, "1")) == 0
    assert int(broker.hget(LOAD_KEY, "0")) == 1100  # one reading may be a submit under way
    assert reconciler.run_round().load_corrected == {0: -1000}
    assert int(broker.hget(LOAD_KEY, "0")) == 100


def store_message_ids(store: Store, job_ids: list[str]) -> set[str]:
    with store.engine.connect() as connection:
        return set(connection.scalars(select(Job.message_id).where(Job.id.in_(job_ids))))


def test_a_queue_deleted_by_hand_has_its_jobs_sent_again(
        reconciling: tuple[Settings, Store, Reconciler]) -> None:
    settings, store, reconciler = reconciling
    broker = redis.Redis.from_url(settings.redis_url)
    assert reconciler.run_round().requeued == 0
    with Client(settings=settings) as client:
        ids = client.submit_many([{"document": "The lost queue.", "question": f"Q{n}?"}
                                  for n in range(5)])
        shards = {job_id: client.get(job_id).shard for job_id in ids}
    shard = shards[ids[0]]
    lost = [job_id for job_id in ids if shards[job_id] == shard]
    _age(store, ids, 60)
    assert reconciler.run_round().requeued == 0
    broker.delete(queue_name(shard))
    # One round may catch a message between queue and lease; two in a row do not.
    assert reconciler.run_round().requeued == 0
    assert reconciler.run_round().requeued == len(lost)
    assert sorted(queued_jobs(broker, [shard])) == sorted(lost)
    assert broker.scard(messages_key(shard)) == len(_queued_messages(settings, shard))
