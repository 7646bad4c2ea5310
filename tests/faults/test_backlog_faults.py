"""The control plane with a large backlog and no worker, on a private Redis and a database of
its own: a Redis restart that loses a million queued jobs' messages sends every one of them
again, each once; a producer killed in the middle of a 100,000-job `submit_many` leaves every
job it recorded in a queue, once, and no load charged that no job holds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta

import psycopg
import pytest
import redis

from jobsvc import compression
from jobsvc.keys import LOAD_KEY, queue_name
from jobsvc.private_redis import PrivateRedis
from jobsvc.reconcile import Reconciler
from jobsvc.settings import Settings
from jobsvc.store import Store, utcnow
from jobsvc.transport import make_celery, publish
from jobsvc.wire import QueueMessage
from tests.support.environment import TEST_DATABASE, recreate_database
from tests.support.queues import queued_jobs

pytestmark = pytest.mark.faults

SHARDS = 8
BACKLOG = 1_000_000
PRODUCER_JOBS = 100_000


@pytest.fixture()
def backlog(settings: Settings) -> Iterator[tuple[Settings, PrivateRedis, Store]]:
    """A private Redis and an empty database of its own, eight shards, a one-second grace."""
    with PrivateRedis() as broker:
        url = recreate_database(TEST_DATABASE + "_backlog")
        own = replace(settings, redis_url=broker.url, database_url=url, shards=SHARDS,
                      stranded_grace=1)
        store = Store(url)
        try:
            yield own, broker, store
        finally:
            store.dispose()


def test_a_redis_restart_with_a_million_queued_jobs_sends_each_again_once(
        backlog: tuple[Settings, PrivateRedis, Store]) -> None:
    settings, broker, store = backlog
    _record_backlog(settings, BACKLOG)
    recorded = _recorded_messages(settings)
    assert len(recorded) == BACKLOG
    # Queued as their producers sent them, then Redis restarts and keeps nothing.
    client = redis.Redis.from_url(settings.redis_url)
    publish(make_celery(settings), client, _messages(recorded))
    assert sum(client.llen(queue_name(shard)) for shard in range(SHARDS)) > BACKLOG // 256
    broker.stop()
    broker.start()
    assert client.dbsize() == 0
    reconciler = Reconciler(settings, client, store, make_celery(settings))
    assert reconciler.run_round().requeued == BACKLOG
    # Each under the message its record names: the store wrote nothing for them.
    assert _queued_jobs(settings) == recorded == _recorded_messages(settings)
    assert reconciler.run_round().requeued == 0


def test_a_producer_killed_mid_submit_many_leaves_its_recorded_jobs_queued_once(
        backlog: tuple[Settings, PrivateRedis, Store]) -> None:
    settings, _, store = backlog
    producer = subprocess.Popen(
        [sys.executable, "-c", _PRODUCER, str(PRODUCER_JOBS)],
        env={**os.environ, "JOBSVC_REDIS_URL": settings.redis_url,
             "JOBSVC_DATABASE_URL": settings.resolved_database_url,
             "JOBSVC_SHARDS": str(SHARDS)})
    try:
        # Killed the moment its jobs are committed: before or while it sends their messages.
        _await_first_job(settings, producer)
        producer.send_signal(signal.SIGKILL)
    finally:
        producer.kill()
        producer.wait()
    recorded = _recorded_messages(settings)
    assert len(recorded) == PRODUCER_JOBS  # one transaction: all of them
    sent_before_kill = len(_queued_jobs(settings))
    time.sleep(settings.stranded_grace + 0.5)
    broker = redis.Redis.from_url(settings.redis_url)
    reconciler = Reconciler(settings, broker, store, make_celery(settings))
    report = reconciler.run_round()
    assert report.requeued == PRODUCER_JOBS - sent_before_kill
    assert _queued_jobs(settings) == _recorded_messages(settings)
    assert reconciler.run_round().requeued == 0
    # What the dead producer charged and no job holds is given back once a second round
    # sees the same difference.
    true_load = store.active_load()
    assert {int(shard): int(load) for shard, load in broker.hgetall(LOAD_KEY).items()
            if int(load)} == {shard: load for shard, load in true_load.items() if load}


_PRODUCER = """
import sys
from jobsvc import Client
from jobsvc.workloads import document, question
import random

rng = random.Random(5)
documents = [document(rng, 250) for _ in range(100)]
jobs = [{"document": documents[n % 100], "question": f"{n}: " + question(rng),
         "max_tokens": 8} for n in range(int(sys.argv[1]))]
with Client() as client:
    client.submit_many(jobs)
"""


def _await_first_job(settings: Settings, producer: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180
    with psycopg.connect(settings.resolved_database_url, autocommit=True) as connection:
        while connection.execute("SELECT 1 FROM jobs LIMIT 1").fetchone() is None:
            assert producer.poll() is None, "the producer ended before recording a job"
            assert time.monotonic() < deadline, "the producer recorded nothing in 180 s"
            time.sleep(0.001)


def _record_backlog(settings: Settings, count: int) -> None:
    """`count` queued jobs on one document, spread over the shards, sent long ago under
    messages that Redis does not hold: rows as a submit writes them, made by the database."""
    sent = utcnow() - timedelta(minutes=5)
    with psycopg.connect(settings.resolved_database_url) as connection:
        connection.execute(
            "INSERT INTO documents (key, text_zst, tokens_zst, tokens, created_at) "
            "VALUES ('backlog', %s, %s, 3, %s)",
            (compression.compress(b"A document."), compression.pack_tokens([1, 2, 3]), sent))
        connection.execute(
            "INSERT INTO jobs (id, document_key, question, sampling, model, shard, status, "
            "prompt_tokens, estimated_prefill, load, message_id, enqueued_at, submitted_at) "
            # IDs in ascending order: the indexes grow at their ends, as a fast insert.
            "SELECT lpad(to_hex(n), 32, '0'), 'backlog', 'Why?', '{\"max_tokens\": 8}', %s, "
            "n %% %s, 'queued', 8, 8, 16, "
            "lpad(to_hex(n / 2048), 24, '0') || lpad(to_hex(n %% %s), 8, '0'), %s, %s "
            "FROM generate_series(1, %s) AS n",
            (settings.served_model_name, SHARDS, SHARDS, sent, sent, count))
        # As autovacuum would soon after such an insert: plans from fresh statistics.
        connection.execute("ANALYZE jobs")


def _messages(recorded: dict[str, str]) -> list[QueueMessage]:
    """The messages that carry these jobs (job ID to message ID), each on its jobs' shard."""
    with_shard: dict[str, list[str]] = {}
    for job_id, message_id in recorded.items():
        with_shard.setdefault(message_id, []).append(job_id)
    # The backlog's message IDs end with their shard in hexadecimal.
    return [QueueMessage(int(message_id[-8:], 16), job_ids, message_id)
            for message_id, job_ids in with_shard.items()]


def _recorded_messages(settings: Settings) -> dict[str, str]:
    """Each unfinished job's recorded message."""
    with psycopg.connect(settings.resolved_database_url) as connection:
        return dict(connection.execute(
            "SELECT id, message_id FROM jobs WHERE status IN ('queued', 'running')").fetchall())


def _queued_jobs(settings: Settings) -> dict[str, str]:
    return queued_jobs(redis.Redis.from_url(settings.redis_url), range(SHARDS))
