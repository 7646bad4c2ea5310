"""What the fault tests share: a harness of private servers with real workers, counting how
every job of a scenario ended (a row of the table printed at the end of the run) and killing
a worker with everything it started."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import func, select

from jobsvc import Client, JobStatus
from jobsvc.child_processes import LocalWorkers
from jobsvc.private_redis import PrivateRedis
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.store.tables import Result
from tests.support.environment import FAULT_TABLE, TEST_WORKER_NICE
from tests.support.servers import PrivatePostgres, private_servers


def tally(client: Client, database_url: str, scenario: str, ids: list[str],
          timeout: float) -> dict[str, int]:
    """Wait (bounded) for every job to finish, then count endings and result rows; record a
    table row."""
    deadline = time.monotonic() + timeout
    while client.pending(ids) and time.monotonic() < deadline:
        time.sleep(0.5)
    records = [client.get(job_id) for job_id in ids]
    store = Store(database_url)
    with store.engine.connect() as connection:
        result_rows = connection.execute(
            select(func.count()).select_from(Result).where(Result.job_id.in_(ids))
        ).scalar_one()
    store.dispose()
    counts = {status: sum(r.status is status for r in records) for status in JobStatus}
    row = {
        "scenario": scenario,
        "submitted": len(ids),
        "succeeded": counts[JobStatus.SUCCEEDED],
        "failed": counts[JobStatus.FAILED],
        "cancelled": counts[JobStatus.CANCELLED],
        "lost": counts[JobStatus.QUEUED] + counts[JobStatus.RUNNING],
        # Every succeeded job has exactly one result row and no other job has one.
        "duplicated": result_rows - counts[JobStatus.SUCCEEDED],
    }
    FAULT_TABLE.append(row)
    return row


def kill_tree(process: psutil.Process) -> None:
    """kill -9 of a worker and every process it started (its engine's)."""
    members = [process, *process.children(recursive=True)]
    for member in members:
        member.send_signal(signal.SIGKILL)
    psutil.wait_procs(members, timeout=30)


@dataclass
class Harness:
    """Private Redis and PostgreSQL servers a scenario may stop, the real workers on them, and
    a producer and a store of theirs."""

    settings: Settings
    workers: LocalWorkers
    redis_server: PrivateRedis
    postgres: PrivatePostgres
    client: Client
    store: Store


@contextmanager
def running_harness(redis_port: int, postgres_port: int, log_dir: Path, *,
                    worker_shards: list[int] | None = None, **settings: Any
                    ) -> Iterator[Harness]:
    """Servers on these loopback ports, and workers (of `worker_shards`, by default those the
    settings name) started on them at the tests' CPU priority, until the block ends."""
    with private_servers(redis_port, postgres_port) as (redis_server, postgres):
        config = Settings.from_env({}, redis_url=redis_server.url, database_url=postgres.url,
                                   worker_nice=TEST_WORKER_NICE, **settings)
        workers = LocalWorkers(config, log_dir, shards=worker_shards)
        store = Store(config.resolved_database_url)
        try:
            workers.start()
            with Client(settings=config) as client:
                yield Harness(config, workers, redis_server, postgres, client, store)
        finally:
            workers.stop()
            store.dispose()


def engine_core_of(harness: Harness) -> psutil.Process:
    """The first worker's vLLM engine-core process (a scenario may suspend it to hold work
    back however fast this host generates)."""
    worker = harness.workers.processes[0]
    return next(child for child in psutil.Process(worker.pid).children(recursive=True)
                if "EngineCore" in child.name())
