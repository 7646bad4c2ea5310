"""The result recorder on the real PostgreSQL and Redis: results that finish while the engine
still runs are gathered into one write, and the last one is written without waiting."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

from jobsvc.affinity import ShardState
from jobsvc.routers import CacheFeedback
from jobsvc.schema import JobStatus
from jobsvc.settings import Settings
from jobsvc.store import JobOutcome, Store, utcnow
from workers.recorder import CacheCheck, Completion, ResultRecorder

# Far longer than any test waits: a write before it ends was not gathering.
_GATHER_SECONDS = 60.0


@contextmanager
def _running_recorder(store: Store, settings: Settings,
                      engine_idle: Callable[[], bool]) -> Iterator[ResultRecorder]:
    client = redis.Redis.from_url(settings.redis_url)
    recorder = ResultRecorder(store, ShardState(client, settings.shards), CacheFeedback(client),
                              block_size=16, engine_idle=engine_idle,
                              gather_seconds=_GATHER_SECONDS)
    recorder.start()
    try:
        yield recorder
    finally:
        recorder.stop()
        client.close()


def _finish(recorder: ResultRecorder, job_id: str) -> Completion:
    completion = Completion(1)
    recorder.job_finished(JobOutcome(job_id, "answer", None, 1, 0, utcnow()), shard=0,
                          prefill=10, check=CacheCheck(0, 16), completion=completion)
    return completion


def test_once_the_engine_is_idle_a_result_is_written_without_waiting_for_more(
        store: Store, routing_settings: Settings, queued_job: Callable[[], str]) -> None:
    job_id = queued_job()
    store.claim_for_running([job_id], "w", max_attempts=3)
    with _running_recorder(store, routing_settings, engine_idle=lambda: True) as recorder:
        assert _finish(recorder, job_id).wait(timeout=20)
        assert store.get_many([job_id])[job_id].status is JobStatus.SUCCEEDED


def test_while_the_engine_runs_results_are_gathered_into_one_write(
        store: Store, routing_settings: Settings, queued_job: Callable[[], str]) -> None:
    job_ids = [queued_job(), queued_job()]
    store.claim_for_running(job_ids, "w", max_attempts=3)
    with _running_recorder(store, routing_settings, engine_idle=lambda: False) as recorder:
        first = _finish(recorder, job_ids[0])
        assert not first.wait(timeout=0.5)
        second = _finish(recorder, job_ids[1])
    # Stopping writes what was gathered: both results, in one transaction.
    assert first.wait(timeout=0) and second.wait(timeout=0)
    records = store.get_many(job_ids)
    assert {record.status for record in records.values()} == {JobStatus.SUCCEEDED}
    assert records[job_ids[0]].recorded_at == records[job_ids[1]].recorded_at
