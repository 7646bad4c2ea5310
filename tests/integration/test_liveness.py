"""When a shard counts as dead, on the real Redis and PostgreSQL: only after the shard timeout
without a heartbeat, however its heartbeat went missing; never the shard of the worker that
asks; and a departed shard whose worker is heartbeating rejoins the fleet."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from datetime import timedelta

import pytest
import redis

from jobsvc.health import KEEP_SECONDS, Heartbeat, write_heartbeat
from jobsvc.keys import DEPARTED_KEY, heartbeat_key, queue_name
from jobsvc.reconcile import Reconciler
from jobsvc.settings import Settings
from jobsvc.store import Store, utcnow
from jobsvc.transport import make_celery
from tests.support.jobs import record_queued_job
from tests.support.waiting import until

pytestmark = pytest.mark.integration

SHARD_TIMEOUT = 15


def _beat(client: redis.Redis, shard: int) -> None:
    write_heartbeat(client, Heartbeat(
        shard=shard, worker=f"shard{shard}@test", host="test", pid=os.getpid(), up_s=1.0,
        engine_ready=True, messages_in_flight=0, last_message_finished_s=None, metrics_port=None,
        task="generate", models=["jobsvc"]))


def _long_queued_jobs(store: Store, shard: int, count: int) -> list[str]:
    """Jobs on `shard` sent long before the shard timeout, as a busy shard's backlog is."""
    sent = utcnow() - timedelta(hours=1)
    return [record_queued_job(store, shard=shard, enqueued_at=sent, submitted_at=sent)
            for _ in range(count)]


def _shards(store: Store, job_ids: list[str]) -> set[int]:
    return {record.shard for record in store.get_many(job_ids).values()}


@pytest.fixture()
def timed_settings(routing_settings: Settings) -> Settings:
    return replace(routing_settings, shard_timeout=SHARD_TIMEOUT)


def test_a_shard_whose_heartbeat_key_is_missing_dies_only_after_the_full_timeout(
        timed_settings: Settings, store: Store) -> None:
    broker = redis.Redis.from_url(timed_settings.redis_url)
    # Shard 3 has a backlog and, as after Redis lost its keys, no heartbeat key at all.
    job_ids = _long_queued_jobs(store, 3, 4)
    _beat(broker, 0)
    reconciler = Reconciler(timed_settings, broker, store, make_celery(timed_settings))
    first_seen = time.monotonic()
    # Rounds count other tests' leftover jobs too: only shard 3's jobs are looked at.
    reconciler.run_round()
    assert _shards(store, job_ids) == {3}
    assert not broker.sismember(DEPARTED_KEY, 3)

    def moved_by_a_round() -> bool:
        _beat(broker, 0)  # shard 0 stays alive throughout
        reconciler.run_round()
        return _shards(store, job_ids) == {0}

    until("shard 3's jobs moved", moved_by_a_round, 3 * SHARD_TIMEOUT, every=1.0)
    assert time.monotonic() - first_seen > SHARD_TIMEOUT
    assert broker.sismember(DEPARTED_KEY, 3)


def test_a_workers_own_round_never_moves_its_jobs_off_itself(
        timed_settings: Settings, store: Store) -> None:
    broker = redis.Redis.from_url(timed_settings.redis_url)
    job_ids = _long_queued_jobs(store, 4, 4)
    _beat(broker, 0)
    # Shard 4's heartbeat reads as older than the timeout (its keeper could not reach Redis).
    _beat(broker, 4)
    broker.expire(heartbeat_key(4), KEEP_SECONDS - SHARD_TIMEOUT - 5)
    broker.rpush(queue_name(4), b"a message of shard 4")
    own = Reconciler(timed_settings, broker, store, make_celery(timed_settings), own_shard=4)
    assert own.run_round().moved == 0
    assert _shards(store, job_ids) == {4}
    assert broker.exists(queue_name(4)) and not broker.sismember(DEPARTED_KEY, 4)
    # Any other reconciler counts the shard dead.
    other = Reconciler(timed_settings, broker, store, make_celery(timed_settings))
    assert other.run_round().moved > 0
    assert _shards(store, job_ids) == {0}
    assert broker.sismember(DEPARTED_KEY, 4)


def test_a_departed_shard_whose_worker_is_heartbeating_rejoins(
        timed_settings: Settings, store: Store) -> None:
    broker = redis.Redis.from_url(timed_settings.redis_url)
    broker.sadd(DEPARTED_KEY, 5, 6)
    _beat(broker, 5)
    Reconciler(timed_settings, broker, store, make_celery(timed_settings)).run_round()
    assert not broker.sismember(DEPARTED_KEY, 5)
    # Shard 6 has no worker heartbeating: it stays departed.
    assert broker.sismember(DEPARTED_KEY, 6)
