"""Waiters are woken by the commits that finish jobs, on the real PostgreSQL test database,
and simply wait out their timeout on the embedded SQLite."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from sqlalchemy import update

from jobsvc import Client
from jobsvc.finish_signal import NOTIFIED_CHECK_SECONDS, finished_count
from jobsvc.settings import Settings
from jobsvc.store import JobOutcome, Store, utcnow
from jobsvc.store.tables import Job
from jobsvc.wire import JobStatus
from tests.support.jobs import claim

pytestmark = pytest.mark.integration


def _answer(store: Store, job_id: str) -> None:
    claim(store, [job_id])
    store.record_outcomes([JobOutcome(job_id, "answer", None, 1, 0, utcnow())])


def _fail(store: Store, job_id: str) -> None:
    store.record_outcomes([JobOutcome(job_id, None, "no", 0, 0, utcnow())])


FINISHING = {
    "answered": (_answer, JobStatus.SUCCEEDED),
    "failed": (_fail, JobStatus.FAILED),
    "cancelled": (lambda store, job_id: store.cancel(job_id), JobStatus.CANCELLED),
}


@pytest.mark.parametrize("ending", sorted(FINISHING))
def test_a_waiter_hears_the_commit_that_finishes_a_job_once_it_is_visible(
        store: Store, queued_job: Callable[[], str], ending: str) -> None:
    finish, status = FINISHING[ending]
    job_id = queued_job()
    with store.finish_signal() as signal:
        later = threading.Timer(0.2, finish, [store, job_id])
        asked = time.time()
        later.start()
        heard = signal.wait(10)
        later.join()
        assert heard is not None and asked < heard < asked + 5
        assert store.statuses([job_id])[job_id] is status


def test_jobs_finished_in_a_transaction_that_rolls_back_wake_nobody(
        store: Store, queued_job: Callable[[], str]) -> None:
    job_id = queued_job()
    with store.finish_signal() as signal:
        with pytest.raises(RuntimeError), store.engine.begin() as connection:
            connection.execute(update(Job).where(Job.id == job_id).values(status="failed"))
            raise RuntimeError("roll back")
        assert signal.wait(0.3) is None
    assert store.statuses([job_id])[job_id] is JobStatus.QUEUED


def test_a_claim_that_only_starts_jobs_wakes_nobody(
        store: Store, queued_job: Callable[[], str]) -> None:
    job_id = queued_job()
    with store.finish_signal() as signal:
        assert set(claim(store, [job_id])) == {job_id}
        assert signal.wait(0.3) is None


def test_a_notification_says_how_many_jobs_its_statement_finished() -> None:
    assert finished_count("3 0b6f3c1e-5d0a-4f43-9a4e-1f2a3b4c5d6e") == 3
    # A database before the count was added: the waiter must check at once.
    assert finished_count("") == float("inf")


def test_a_waiter_for_several_jobs_sleeps_through_commits_that_cannot_finish_them_all(
        store: Store, queued_job: Callable[[], str]) -> None:
    first, second, third = queued_job(), queued_job(), queued_job()
    with store.finish_signal() as signal:
        _fail(store, first)
        assert signal.wait(0.5, jobs=2) is None
        # Counts start again after each return: one more finished job is not two.
        _fail(store, second)
        assert signal.wait(0.5, jobs=2) is None
        _fail(store, third)
        assert signal.wait(5, jobs=1) is not None


def test_two_statements_of_one_transaction_that_finish_one_job_each_count_as_two(
        store: Store, queued_job: Callable[[], str]) -> None:
    first, second = queued_job(), queued_job()
    with store.finish_signal() as signal:
        with store.engine.begin() as connection:
            for job_id in (first, second):
                connection.execute(update(Job).where(Job.id == job_id).values(status="failed"))
        asked = time.time()
        heard = signal.wait(5, jobs=2)
        assert heard is not None and heard - asked < 5
        assert signal.last_heard == heard


def test_wait_returns_at_the_commit_not_at_its_next_check(
        routing_settings: Settings, store: Store, queued_job: Callable[[], str]) -> None:
    job_id = queued_job()
    later = threading.Timer(0.3, store.cancel, [job_id])
    with Client(settings=routing_settings) as client:
        asked = time.monotonic()
        later.start()
        (record,) = client.wait([job_id], timeout=60, check_interval=30)
        waited = time.monotonic() - asked
    later.join()
    assert record.status is JobStatus.CANCELLED
    # Checking only every 30 s, it would have returned after 30 s.
    assert waited < 10


def test_a_listening_waiter_checks_by_the_announced_counts_and_rarely_by_the_clock(
        store: Store, embedded: Store) -> None:
    with store.finish_signal() as signal:
        assert signal.check_interval(1.0) == NOTIFIED_CHECK_SECONDS
        assert signal.check_interval(60.0) == 60.0
    with embedded.finish_signal() as signal:
        assert signal.check_interval(1.0) == 1.0


def test_on_the_embedded_sqlite_a_waiter_pauses_longer_each_time_up_to_its_timeout(
        embedded: Store) -> None:
    with embedded.finish_signal() as signal:
        pauses = []
        for _ in range(8):
            asked = time.monotonic()
            assert signal.wait(0.2) is None
            pauses.append(time.monotonic() - asked)
    assert 0.05 <= pauses[0] < 0.15
    assert all(0.2 <= pause < 0.35 for pause in pauses[-3:]), pauses
