"""Shards come and go under load, on private servers: a worker killed for good mid-burst, a
new shard joining under another host name, a shard drained. Every job must still end exactly
once. Two workers at a time, one per core: small bursts, short answers, every wait bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import pytest
import redis

from jobsvc import Client
from jobsvc.child_processes import LocalWorkers, settings_environment
from jobsvc.health import read_heartbeats
from jobsvc.keys import DRAINING_KEY
from jobsvc.settings import Settings
from jobsvc.workloads import document_questions
from tests.support.environment import TEST_WORKER_NICE
from tests.support.fault_tally import kill_tree, tally
from tests.support.servers import private_servers
from tests.support.waiting import until

pytestmark = pytest.mark.faults

FINISH_TIMEOUT = 300
SHARD_TIMEOUT = 15
# The shards the fleet starts with, each on a core of its own (vLLM's default binds every
# engine to the first core).
CORES = {0: "0", 1: "1"}


@dataclass
class Fleet:
    settings: Settings
    # The workers started together under the fleet's settings, then any that joined later.
    groups: list[LocalWorkers]
    log_dir: Path
    client: Client

    def process_of(self, shard: int) -> subprocess.Popen[bytes]:
        group = next(group for group in self.groups if shard in group.shards)
        return group.processes[group.shards.index(shard)]

    def live_shards(self) -> list[int]:
        return [shard for group in self.groups for shard, process
                in zip(group.shards, group.processes, strict=True) if process.poll() is None]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with private_servers(6393, 5443) as (redis_server, postgres):
        settings = Settings.from_env(
            {}, redis_url=redis_server.url, database_url=postgres.url, shards=3,
            shard_timeout=SHARD_TIMEOUT, requeue_interval=2, stranded_grace=5, max_attempts=3,
            batch_size=4, worker_concurrency=2, visibility_timeout=8, metrics_port=0,
            worker_nice=TEST_WORKER_NICE)
        log_dir = Path(tmp_path_factory.mktemp("fleet-logs"))
        first = LocalWorkers(settings, log_dir, shards=list(CORES), devices=list(CORES.values()))
        fleet = Fleet(settings, [first], log_dir, Client(settings=settings))
        try:
            fleet.groups[0].start()
            yield fleet
        finally:
            fleet.client.close()
            for group in fleet.groups:
                group.stop()


def _burst(client: Client, documents: int, seed: int, max_tokens: int = 6) -> list[str]:
    work = document_questions(documents, 3, 120, seed=seed)
    return client.submit_many({"document": job.document, "question": job.question,
                               "max_tokens": max_tokens, "ignore_eos": True} for job in work)


def _tally(fleet: Fleet, scenario: str, ids: list[str]) -> dict[str, int]:
    return tally(fleet.client, fleet.settings.resolved_database_url, scenario, ids,
                 FINISH_TIMEOUT)


def _shards(client: Client, ids: list[str]) -> dict[str, int]:
    return {job_id: client.get(job_id).shard for job_id in ids}


def _moved_off(client: Client, routed: dict[str, int], shard: int) -> list[str]:
    """Jobs first routed to `shard` that ended on another."""
    return [job_id for job_id, first in routed.items()
            if first == shard and client.get(job_id).shard != shard]


def test_a_worker_killed_for_good_mid_burst_strands_nothing_and_a_new_shard_joins(
        fleet: Fleet) -> None:
    client = fleet.client
    *others, dead = fleet.live_shards()
    assert others, "a dead shard's jobs need another shard"
    worker = fleet.process_of(dead)
    ids = _burst(client, 16, seed=301, max_tokens=16)
    # Frozen the moment its burst is out (then killed for good), so that the dead worker
    # leaves messages in flight and queued however fast this machine runs them.
    os.kill(worker.pid, signal.SIGSTOP)
    routed = _shards(client, ids)
    assert sum(shard == dead for shard in routed.values()) > 4 * 2
    until("the first results", lambda: client.pending(ids) <= len(ids) - 2, FINISH_TIMEOUT,
          every=0.5)
    kill_tree(psutil.Process(worker.pid))
    row = _tally(fleet, "worker kill -9, never back", ids)
    assert row == {**row, "succeeded": len(ids), "lost": 0, "duplicated": 0}
    # Jobs the dead shard had not finished ran on the others, and their records say so.
    assert _moved_off(client, routed, dead)

    # A new GPU joins as shard 5 on another host (on the dead one's core), and stays.
    host_b = replace(fleet.settings, worker_host="host-b")
    joined = LocalWorkers(host_b, fleet.log_dir / "host-b", shards=[5],
                          devices=[CORES[dead]])
    fleet.groups.append(joined)
    joined.start()
    seen = read_heartbeats(redis.Redis.from_url(fleet.settings.redis_url))[5]
    assert seen.heartbeat.host == "host-b"
    # Shard numbers are unique across the fleet: a worker on a third host may not take 5.
    refused = subprocess.run(
        [sys.executable, "-m", "jobsvc", "worker", "--shard", "5"],
        env={**os.environ, **settings_environment(replace(host_b, worker_host="host-c"))},
        capture_output=True, text=True, timeout=180)
    assert refused.returncode != 0
    assert "shard 5 is held by worker shard5@host-b" in refused.stderr
    with Client(settings=fleet.settings) as producer:
        later = _burst(producer, 8, seed=302)
        shards = {producer.get(job_id).shard for job_id in later}
    assert 5 in shards and dead not in shards
    row = _tally(fleet, "new shard 5 joins on host-b", later)
    assert row == {**row, "succeeded": len(later), "lost": 0, "duplicated": 0}


def test_a_drained_shard_finishes_its_queue_elsewhere_and_its_worker_exits_0(
        fleet: Fleet) -> None:
    client = fleet.client
    drained, *others = fleet.live_shards()
    assert others, "a drain needs a shard to take over"
    worker = fleet.process_of(drained)
    broker = redis.Redis.from_url(fleet.settings.redis_url)
    # The drained worker is paused (for less than a heartbeat's 15 s of grace) while the burst
    # arrives and the drain begins, so its queue holds more batches than it runs and holds at
    # once, however fast this machine runs them.
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        ids = _burst(client, 16, seed=303, max_tokens=32)
        routed = _shards(client, ids)
        assert sum(shard == drained for shard in routed.values()) > 4 * 2 * 2
        drain = subprocess.Popen(
            [sys.executable, "-m", "jobsvc", "drain", "--shard", str(drained),
             "--timeout", "240"], env={**os.environ, **settings_environment(fleet.settings)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        until("the drain flag", lambda: broker.sismember(DRAINING_KEY, drained), 10, every=0.5)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    out, err = drain.communicate(timeout=300)
    assert drain.returncode == 0, err
    assert f"shard {drained} drained" in out
    assert worker.wait(timeout=60) == 0
    row = _tally(fleet, "shard drained mid-burst", ids)
    assert row == {**row, "succeeded": len(ids), "lost": 0, "duplicated": 0}
    assert _moved_off(client, routed, drained)
    with Client(settings=fleet.settings) as producer:
        later = _burst(producer, 4, seed=304)
        assert drained not in {producer.get(job_id).shard for job_id in later}
    row = _tally(fleet, "after the drain", later)
    assert row == {**row, "succeeded": len(later), "lost": 0, "duplicated": 0}
