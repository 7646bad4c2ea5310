"""How a batch's requests enter the engine: a chunk at a time, one chunk every pause."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from jobsvc.bench.standalone import STAGGERED_PACING, staggered_pacing
from jobsvc.child_processes import LocalWorkers
from jobsvc.client import Client
from jobsvc.settings import Settings
from jobsvc.wire import JobStatus
from jobsvc.workers.engine import Pacing, gather_paced
from tests.support.waiting import until
from tests.support.worker_control import set_pacing

pytestmark = pytest.mark.bench


def _start_times(count: int, pacing: Pacing) -> tuple[list[int], list[float]]:
    """Each request's result (its index) and the moment it started, from the first start."""
    starts: list[float] = []

    async def request(index: int) -> int:
        starts.append(time.monotonic())
        await asyncio.sleep(0)
        return index

    async def run() -> list[int]:
        return await gather_paced([request(index) for index in range(count)], pacing)

    results = asyncio.run(run())
    return results, [start - starts[0] for start in starts]


def test_requests_start_a_chunk_at_a_time_one_pause_apart_and_all_results_come_back() -> None:
    results, starts = _start_times(7, Pacing(chunk=3, pause_seconds=0.2))
    assert results == list(range(7))
    # Chunks [0, 1, 2], [3, 4, 5], [6]: each starts together, the next a pause later.
    assert max(starts[:3]) < 0.1
    assert starts[3] >= 0.2 and max(starts[3:6]) - starts[3] < 0.1
    assert starts[6] - starts[3] >= 0.2


def test_a_chunk_of_zero_starts_every_request_at_once() -> None:
    results, starts = _start_times(50, Pacing())
    assert results == list(range(50))
    assert max(starts) < 0.1


def test_the_baselines_staggered_style_paces_even_where_the_workers_do_not() -> None:
    assert Settings().admission_chunk == 0
    assert staggered_pacing(Pacing()) == STAGGERED_PACING
    assert STAGGERED_PACING.chunk > 0 and STAGGERED_PACING.pause_seconds > 0
    workers = Pacing(chunk=8, pause_seconds=0.005)
    assert staggered_pacing(workers) == workers


def test_a_negative_chunk_or_pause_is_refused() -> None:
    for chunk, pause in ((-1, 0.015), (32, -0.001)):
        with pytest.raises(ValueError, match=">= 0"):
            Pacing(chunk, pause)


def test_pacing_comes_from_the_admission_settings() -> None:
    settings = Settings.from_env({"JOBSVC_ADMISSION_CHUNK": "8",
                                  "JOBSVC_ADMISSION_PAUSE_MS": "20"})
    assert Pacing.from_settings(settings) == Pacing(8, 0.02)


def _configured(settings: Settings) -> dict[str, Any]:
    """The test worker's own pacing, as the pacing command takes and returns it."""
    return {"chunk": settings.admission_chunk, "pause_ms": settings.admission_pause_ms}


def test_a_job_cancelled_while_its_chunk_waits_never_reaches_the_engine(
        settings: Settings, worker: LocalWorkers, client: Client) -> None:
    """One request per chunk, five seconds apart: the second job is cancelled once their
    batch is admitted, while its chunk waits, and is withdrawn before the engine sees it."""
    configured = _configured(settings)
    set_pacing(settings, 1, 5000.0)
    try:
        first, second = client.submit_many(
            {"document": "a document admitted one request at a time " * 20,
             "question": f"{which} question?", "max_tokens": 4, "ignore_eos": True}
            for which in ("first", "second"))
        until("the batch admitted", lambda: client.get(first).status is not JobStatus.QUEUED,
              60, every=0.05)
        assert client.cancel(second)
        ran, withdrawn = client.wait([first, second], timeout=120)
        withdrawal = f"job {second} withdrawn before it reached the engine"
        until("the second job withdrawn",
              lambda: withdrawal in worker.log_path(0).read_text(errors="replace"))
    finally:
        set_pacing(settings, **configured)
    assert (ran.status, ran.completion_tokens) == (JobStatus.SUCCEEDED, 4)
    assert withdrawn.status is JobStatus.CANCELLED


def test_a_running_worker_paces_later_batches_as_told_and_says_what_it_replaced(
        settings: Settings, worker: LocalWorkers, client: Client) -> None:
    configured = _configured(settings)
    assert set_pacing(settings, 0, 0.0) == pytest.approx(configured)
    try:
        ids = client.submit_many({"document": "a document admitted at once " * 20,
                                  "question": f"question {index}?", "max_tokens": 2}
                                 for index in range(12))
        records = client.wait(ids, timeout=120)
        assert [record.status for record in records] == [JobStatus.SUCCEEDED] * 12
    finally:
        restored = set_pacing(settings, **configured)
    assert restored == pytest.approx({"chunk": 0, "pause_ms": 0.0})


def test_a_negative_pacing_is_refused_and_the_current_one_kept(
        settings: Settings, worker: LocalWorkers) -> None:
    assert ">= 0" in set_pacing(settings, -1, 15.0)["error"]
    configured = _configured(settings)
    assert set_pacing(settings, **configured) == pytest.approx(configured)
