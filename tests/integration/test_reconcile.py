"""Reconciliation on the real Redis and PostgreSQL, with no worker consuming: stranded jobs are
sent again exactly once, live ones are left alone, and shard load follows the store."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta

import pytest
import redis
from sqlalchemy import update

from jobsvc import Client
from jobsvc.keys import LOAD_KEY, UNACKED_KEY, queue_name
from jobsvc.reconcile import Reconciler, message_ids
from jobsvc.settings import Settings
from jobsvc.store import Store, utcnow
from jobsvc.store.tables import Job
from jobsvc.transport import make_celery
from jobsvc.wire import JobStatus, QueueMessage
from tests.support.environment import TEST_DATABASE, recreate_database
from tests.support.jobs import record_queued_job

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
    raw = broker.lrange(queue_name(shard), 0, -1)
    return [QueueMessage(shard, [], task_id) for task_id in message_ids(raw)]


def _age(store: Store, job_ids: list[str], seconds: float) -> None:
    with store.engine.begin() as connection:
        connection.execute(update(Job).where(Job.id.in_(job_ids)).values(
            enqueued_at=utcnow() - timedelta(seconds=seconds)))


def test_a_job_recorded_but_never_enqueued_is_sent_again_once_its_grace_has_passed(
        reconciling: tuple[Settings, Store, Reconciler]) -> None:
    settings, store, reconciler = reconciling
    job_id = record_queued_job(store, message_id="never-sent")
    assert reconciler.run_round().requeued == 0  # still within its grace
    _age(store, [job_id], 60)
    assert reconciler.run_round().requeued == 1
    (message,) = _queued_messages(settings, 0)
    # The new message is the job's own now: the lost one could no longer run it.
    with store.engine.connect() as connection:
        owner = connection.execute(
            Job.__table__.select().where(Job.id == job_id)).one().message_id
    assert owner == message.message_id
    _age(store, [job_id], 60)
    assert reconciler.run_round().requeued == 0
    assert len(_queued_messages(settings, 0)) == 1


def test_jobs_whose_message_waits_in_a_queue_or_is_leased_by_a_worker_are_left_alone(
        reconciling: tuple[Settings, Store, Reconciler]) -> None:
    settings, store, reconciler = reconciling
    with Client(settings=settings) as client:
        queued = client.submit_many([{"document": "The keeper's seven cats.", "question": q}
                                     for q in ("How many?", "Whose?")])
    leased = record_queued_job(store, message_id="leased-message")
    envelope = {"body": "", "headers": {"id": "leased-message"}, "properties": {}}
    broker = redis.Redis.from_url(settings.redis_url)
    broker.hset(UNACKED_KEY, "tag", json.dumps([envelope, "", queue_name(0)]))
    _age(store, [*queued, leased], 60)
    assert reconciler.run_round().requeued == 0
    assert {store.get_many([job])[job].status for job in [*queued, leased]} == {
        JobStatus.QUEUED}


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


def test_message_ids_come_from_queued_and_leased_envelopes_and_garbage_names_none() -> None:
    queued = json.dumps({"headers": {"id": "a"}, "body": ""})
    leased = json.dumps([{"headers": {"id": "b"}}, "", "jobs.shard.0"])
    assert message_ids([queued.encode(), leased.encode(), b"not json", b"[1, 2]", b"{}",
                        b'{"headers": {"id": 5}}']) == {"a", "b"}
