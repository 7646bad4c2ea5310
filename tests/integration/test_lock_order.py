"""Rows are locked in one order everywhere: cancels and workers' result writes that reach the
same jobs at once, each listing them in its own order, wait for one another and never
deadlock, on the real PostgreSQL test database."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import pytest
from sqlalchemy import func, select

from jobsvc import Client
from jobsvc.settings import Settings
from jobsvc.store import JobOutcome, Store, utcnow
from jobsvc.store.tables import Result
from jobsvc.wire import FINISHED_STATUSES, JobStatus
from tests.support.jobs import record_queued_job

pytestmark = pytest.mark.integration

JOBS = 48
THREADS_EACH = 4
ROUNDS = 3


def _storm(settings: Settings, store: Store, job_ids: list[str], seed: int
           ) -> list[BaseException]:
    """Producers' cancel storms and workers' result writes (admissions, then endings) over
    overlapping shuffled sets of `job_ids`, from several threads at once; returns what any of
    them raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(2 * THREADS_EACH)

    def cancels(rng: random.Random) -> None:
        with Client(settings=settings) as producer:
            for _ in range(6):
                producer.cancel_many(rng.sample(job_ids, len(job_ids) // 2))

    def result_writes(rng: random.Random) -> None:
        for _ in range(6):
            started = rng.sample(job_ids, len(job_ids) // 3)
            ended = rng.sample(job_ids, len(job_ids) // 2)
            store.record_outcomes(
                [JobOutcome(job_id, f"answer {job_id}", None, 1, 0, utcnow())
                 if rng.random() < 0.7 else JobOutcome(job_id, None, "failed", 0, 0, utcnow())
                 for job_id in ended],
                started=dict.fromkeys(started, utcnow()))

    def run(work: Callable[[random.Random], None], rng: random.Random) -> None:
        start.wait()
        try:
            work(rng)
        except BaseException as error:  # every error is the finding, reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(work, random.Random(seed * 100 + n)))
               for n in range(THREADS_EACH) for work in (cancels, result_writes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a storm thread never ended"
    return errors


def test_cancel_storms_against_result_writes_never_deadlock_and_each_job_ends_once(
        routing_settings: Settings, store: Store) -> None:
    for round_number in range(ROUNDS):
        job_ids = [record_queued_job(store) for _ in range(JOBS)]
        errors = _storm(routing_settings, store, job_ids, seed=round_number)
        assert errors == [], [f"{type(error).__name__}: {error}" for error in errors]
        # Whatever came first ended each job; what came later changed nothing.
        store.cancel_many(job_ids)
        records = store.get_many(job_ids)
        assert all(records[job_id].status in FINISHED_STATUSES for job_id in job_ids)
        succeeded = {job_id for job_id in job_ids
                     if records[job_id].status is JobStatus.SUCCEEDED}
        assert all(records[job_id].answer == f"answer {job_id}" for job_id in succeeded)
        with store.engine.connect() as connection:
            answered = set(connection.scalars(
                select(Result.job_id).where(Result.job_id.in_(job_ids))))
            rows = connection.execute(select(func.count()).select_from(Result)
                                      .where(Result.job_id.in_(job_ids))).scalar_one()
        assert answered == succeeded and rows == len(succeeded)
