"""What the fault tests share: counting how every job of a scenario ended (a row of the table
printed at the end of the run) and killing a worker with everything it started."""

from __future__ import annotations

import signal
import time

import psutil
from sqlalchemy import func, select

from jobsvc import Client, JobStatus
from jobsvc.store import Result, Store
from tests.conftest import FAULT_TABLE


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
