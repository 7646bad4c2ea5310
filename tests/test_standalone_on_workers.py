"""The bench's standalone arm driven on a running worker's own engine: a remote-control
command runs the burst inside the worker, past queue and database."""

from __future__ import annotations

import random
from typing import Any

from jobsvc.local import LocalWorkers
from jobsvc.settings import Settings
from jobsvc.transport import make_celery
from jobsvc.workloads import document, question


def _burst(settings: Settings, jobs: list[list[Any]], mode: str) -> dict[str, Any]:
    replies = make_celery(settings).control.broadcast(
        "run_standalone_burst", arguments={"jobs_by_shard": [jobs], "mode": mode,
                                           "chunk": 2, "pause_ms": 15.0},
        reply=True, timeout=180, limit=1)
    assert len(replies) == 1, replies
    (reading,) = replies[0].values()
    return reading


def test_a_burst_on_the_workers_engine_runs_every_job_and_reuses_the_document(
        settings: Settings, worker: LocalWorkers) -> None:
    rng = random.Random(31)
    text = document(rng, 400)
    sampling = {"max_tokens": 5, "ignore_eos": True, "temperature": 0.0}
    jobs = [[text, question(rng), sampling] for _ in range(4)]
    for mode in ("all", "staggered"):
        run = _burst(settings, jobs, mode)
        assert run["output_tokens"] == 4 * 5
        assert run["prompt_tokens"] > 4 * 400
        # The burst starts from a cold cache: the first question computes the document, the
        # other three find its blocks.
        assert 0 < run["cached_tokens"] < run["prompt_tokens"]
        assert run["finished"] > run["started"]


def test_an_unknown_admission_mode_comes_back_as_an_error(
        settings: Settings, worker: LocalWorkers) -> None:
    reading = _burst(settings, [["a document", "a question", {"max_tokens": 1}]], "sideways")
    assert "admission mode" in reading["error"]
