"""The result recorder on the real PostgreSQL and Redis: results of a batch still generating
are gathered into one write, the result that completes a batch is written at once, and the
recorder's thread does not wake for every result."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from jobsvc.routing.feedback import CacheFeedback
from jobsvc.routing.ledger import LoadLedger
from jobsvc.settings import Settings
from jobsvc.store import JobOutcome, Store, utcnow
from jobsvc.wire import JobStatus
from jobsvc.workers.recorder import CacheCheck, Completion, ResultRecorder
from tests.support.jobs import claim

pytestmark = pytest.mark.integration

# Far longer than any test waits: a write before it ends was not gathering.
_GATHER_SECONDS = 60.0


@contextmanager
def _running_recorder(store: Store, settings: Settings) -> Iterator[ResultRecorder]:
    client = redis.Redis.from_url(settings.redis_url)
    recorder = ResultRecorder(store, LoadLedger(client), CacheFeedback(client),
                              block_size=16, gather_seconds=_GATHER_SECONDS)
    recorder.start()
    try:
        yield recorder
    finally:
        recorder.stop()
        client.close()


def _finish(recorder: ResultRecorder, job_id: str, completion: Completion) -> None:
    recorder.job_finished(JobOutcome(job_id, "answer", None, 1, 0, utcnow()), shard=0,
                          check=CacheCheck(0, 16), completion=completion)


def _claimed(store: Store, queued_job: Callable[[], str], count: int) -> list[str]:
    job_ids = [queued_job() for _ in range(count)]
    claim(store, job_ids)
    return job_ids


def test_the_result_that_completes_a_batch_is_written_without_waiting(
        store: Store, routing_settings: Settings, queued_job: Callable[[], str]) -> None:
    job_ids = _claimed(store, queued_job, 3)
    batch, other_batch = Completion(2), Completion(5)
    with _running_recorder(store, routing_settings) as recorder:
        _finish(recorder, job_ids[0], other_batch)
        _finish(recorder, job_ids[1], batch)
        assert not batch.wait(timeout=0.5)
        _finish(recorder, job_ids[2], batch)
        assert batch.wait(timeout=20)
        # The write took every result gathered so far, the other batch's too.
        records = store.get_many(job_ids)
        assert {record.status for record in records.values()} == {JobStatus.SUCCEEDED}
        assert len({record.recorded_at for record in records.values()}) == 1
        assert not other_batch.wait(timeout=0)


def test_results_of_a_batch_still_generating_are_gathered_into_one_write(
        store: Store, routing_settings: Settings, queued_job: Callable[[], str]) -> None:
    job_ids = _claimed(store, queued_job, 2)
    batch = Completion(3)
    with _running_recorder(store, routing_settings) as recorder:
        _finish(recorder, job_ids[0], batch)
        _finish(recorder, job_ids[1], batch)
        assert not batch.wait(timeout=0.5)
        assert {record.status for record in store.get_many(job_ids).values()} == {
            JobStatus.QUEUED}
    # Stopping writes what was gathered: both results, in one transaction.
    records = store.get_many(job_ids)
    assert {record.status for record in records.values()} == {JobStatus.SUCCEEDED}
    assert records[job_ids[0]].recorded_at == records[job_ids[1]].recorded_at


def _voluntary_switches(native_thread_id: int | None) -> int:
    """How often a thread of this process has gone to sleep (Linux's count per thread)."""
    status = Path(f"/proc/self/task/{native_thread_id}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines()
                if line.startswith("voluntary_ctxt_switches:"))


def test_the_recorder_sleeps_through_a_gathering_instead_of_waking_for_each_result(
        store: Store, routing_settings: Settings, queued_job: Callable[[], str]) -> None:
    job_ids = _claimed(store, queued_job, 40)
    batch = Completion(len(job_ids) + 1)
    with _running_recorder(store, routing_settings) as recorder:
        thread_id = next(thread.native_id for thread in threading.enumerate()
                         if thread.name == "result-recorder")
        _finish(recorder, job_ids[0], batch)
        time.sleep(0.2)
        before = _voluntary_switches(thread_id)
        for job_id in job_ids[1:]:
            _finish(recorder, job_id, batch)
            time.sleep(0.005)
        woken = _voluntary_switches(thread_id) - before
        assert not batch.wait(timeout=0)
    # Once per result would be 39; the gathering's first result woke it before `before`.
    assert woken <= 3
    assert {record.status for record in store.get_many(job_ids).values()} == {
        JobStatus.SUCCEEDED}
