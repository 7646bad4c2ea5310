"""A restarted Redis declares no live worker dead, on private servers with a real worker: its
heartbeat and queue are gone for a moment, but the shard counts as silent only from then, and
the worker's own reconciler never moves its jobs off itself. Nothing runs twice, nothing
moves, and the worker goes on serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from jobsvc import Client
from jobsvc.health import KEEP_SECONDS, Heartbeat, read_heartbeats, read_silences
from jobsvc.keys import DEPARTED_KEY, heartbeat_key, queue_name
from jobsvc.workloads import document_questions
from tests.support.fault_tally import Harness, engine_core_of, running_harness, tally
from tests.support.waiting import until

pytestmark = pytest.mark.faults

FINISH_TIMEOUT = 300
SHARD_TIMEOUT = 15
# The worker's shard: producers that have seen no worker yet assume shard 0 (the configured
# count is 1), so after Redis restarts, shard 1 is neither heartbeating nor assumed live.
SHARD = 1


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    with running_harness(6404, 5454, Path(tmp_path_factory.mktemp("liveness-logs")),
                         worker_shards=[SHARD], shard_timeout=SHARD_TIMEOUT, requeue_interval=1,
                         stranded_grace=5, max_attempts=3, batch_size=8, worker_concurrency=2,
                         visibility_timeout=8) as running:
        yield running


def _burst(client: Client, jobs: int, seed: int, max_tokens: int) -> list[str]:
    work = document_questions(jobs // 4, 4, 250, seed=seed)
    return client.submit_many({"document": job.document, "question": job.question,
                               "max_tokens": max_tokens, "ignore_eos": True} for job in work)


class DepartureWatch:
    """Samples, until stopped, whether any unfinished job sits on another shard than the
    worker's or the worker's shard is counted departed: either means it was taken for dead."""

    def __init__(self, harness: Harness) -> None:
        self._harness = harness
        self.seen: list[str] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DepartureWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        broker = redis.Redis.from_url(self._harness.settings.redis_url, socket_timeout=2)
        while not self._stopped.wait(0.2):
            elsewhere = set(self._harness.store.active_counts()) - {SHARD}
            if elsewhere:
                self.seen.append(f"unfinished jobs on shards {sorted(elsewhere)}")
            try:
                if broker.sismember(DEPARTED_KEY, SHARD):
                    self.seen.append(f"shard {SHARD} counted departed")
            except redis.RedisError:
                pass  # Redis is restarting
        broker.close()


def test_a_redis_restart_declares_no_live_worker_dead_and_moves_none_of_its_jobs(
        harness: Harness) -> None:
    client = harness.client
    broker = redis.Redis.from_url(harness.settings.redis_url)
    # The engine is frozen while the backlog ages, so it is still there however fast this
    # host generates; the worker itself runs on and sends its heartbeats.
    engine_core = engine_core_of(harness)
    engine_core.suspend()
    try:
        ids = _burst(client, 320, seed=501, max_tokens=24)
        submitted = time.monotonic()
        assert {client.get(job_id).shard for job_id in ids} == {SHARD}
        with DepartureWatch(harness) as watch:
            # Its backlog waited longer than the shard timeout: were the worker taken for
            # dead, it would move at once.
            until("a backlog older than the shard timeout",
                  lambda: time.monotonic() - submitted > SHARD_TIMEOUT + 1, FINISH_TIMEOUT)
            assert client.pending(ids) == len(ids)
            assert broker.llen(queue_name(SHARD)) > 0
            harness.redis_server.stop()
            harness.redis_server.start()
            engine_core.resume()
            row = tally(client, harness.settings.resolved_database_url,
                        "Redis restarted, a backlog older than the shard timeout", ids,
                        FINISH_TIMEOUT)
    finally:
        engine_core.resume()
    assert row == {**row, "succeeded": len(ids), "lost": 0, "duplicated": 0}
    assert watch.seen == []
    assert {client.get(job_id).shard for job_id in ids} == {SHARD}
    # The worker goes on serving, under its shard.
    assert all(process.poll() is None for process in harness.workers.processes)
    later = _burst(client, 8, seed=502, max_tokens=8)
    assert {client.get(job_id).shard for job_id in later} == {SHARD}
    row = tally(client, harness.settings.resolved_database_url, "after the Redis restart",
                later, FINISH_TIMEOUT)
    assert row == {**row, "succeeded": len(later), "lost": 0, "duplicated": 0}
    assert not broker.sismember(DEPARTED_KEY, SHARD)


def test_a_heartbeat_restored_with_an_old_age_counts_no_further_back_than_redis_start(
        harness: Harness) -> None:
    harness.redis_server.stop()
    harness.redis_server.start()
    broker = redis.Redis.from_url(harness.settings.redis_url)
    # As a server restored from a snapshot keeps it: written long ago, its expiry unchanged.
    restored = Heartbeat(shard=7, worker="shard7@elsewhere", host="elsewhere", pid=1,
                         up_s=1.0, engine_ready=True, messages_in_flight=0,
                         last_message_finished_s=None, metrics_port=None, task="generate",
                         models=["jobsvc"])
    broker.set(heartbeat_key(7), restored.to_json(), ex=KEEP_SECONDS - 10 * SHARD_TIMEOUT)
    workers = read_heartbeats(broker)
    assert workers[7].age_s > 9 * SHARD_TIMEOUT
    uptime = float(broker.info("server")["uptime_in_seconds"])
    silences = read_silences(broker, workers, [7])
    assert silences[7] <= uptime < SHARD_TIMEOUT
