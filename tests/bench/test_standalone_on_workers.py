"""The bench's standalone arm driven on a running worker's own engine: a remote-control
command runs the burst inside the worker, past queue and database."""

from __future__ import annotations

import random
from typing import Any

import pytest

from jobsvc.child_processes import LocalWorkers
from jobsvc.client import Client
from jobsvc.settings import Settings
from jobsvc.workloads import document, question
from tests.support.worker_control import ask_worker, set_pacing

pytestmark = pytest.mark.bench


def _burst(settings: Settings, jobs: list[list[Any]], mode: str) -> dict[str, Any]:
    return ask_worker(settings, "run_standalone_burst",
                      {"jobs_by_shard": [jobs], "mode": mode}, timeout=180)


def test_a_burst_on_the_workers_engine_runs_every_job_and_reuses_the_document(
        settings: Settings, worker: LocalWorkers) -> None:
    rng = random.Random(31)
    text = document(rng, 400)
    sampling = {"max_tokens": 5, "ignore_eos": True, "temperature": 0.0}
    jobs = [[text, question(rng), sampling] for _ in range(4)]
    # Staggered, the burst takes the worker's pacing: two chunks of two.
    configured = set_pacing(settings, 2, 15.0)
    try:
        runs = {mode: _burst(settings, jobs, mode) for mode in ("all", "staggered")}
    finally:
        set_pacing(settings, configured["chunk"], configured["pause_ms"])
    for run in runs.values():
        assert run["output_tokens"] == 4 * 5
        assert run["prompt_tokens"] > 4 * 400
        # The burst starts from a cold cache: the first question computes the document, the
        # other three find its blocks.
        assert 0 < run["cached_tokens"] < run["prompt_tokens"]
        assert run["finished"] > run["started"]
        # One engine: its last request returned between the burst's start and its end.
        [engine_finished] = run["engines_finished"]
        assert run["admitted"] < engine_finished <= run["finished"]


def test_the_workers_step_counters_count_a_bursts_steps_and_computed_tokens(
        settings: Settings, worker: LocalWorkers) -> None:
    rng = random.Random(32)
    output_tokens = 3
    sampling = {"max_tokens": output_tokens, "ignore_eos": True, "temperature": 0.0}
    jobs = [[document(rng, 300), question(rng), sampling] for _ in range(2)]
    before = ask_worker(settings, "engine_steps", {})
    run = _burst(settings, jobs, "all")
    after = ask_worker(settings, "engine_steps", {})
    steps, tokens = after["steps"] - before["steps"], after["tokens"] - before["tokens"]
    # A prefill step yields each request's first token, a decode step each later one.
    assert output_tokens <= steps <= tokens
    # Every prompt token not found cached is computed once, and every output token counts.
    assert tokens == run["prompt_tokens"] - run["cached_tokens"] + run["output_tokens"]


def test_an_unknown_admission_mode_comes_back_as_an_error(
        settings: Settings, worker: LocalWorkers) -> None:
    reading = _burst(settings, [["a document", "a question", {"max_tokens": 1}]], "sideways")
    assert "admission mode" in reading["error"]


def test_the_worker_says_when_its_first_batch_went_to_the_engine(
        settings: Settings, client: Client) -> None:
    ask_worker(settings, "take_first_admission", {})
    rng = random.Random(33)
    text = document(rng, 300)
    ids = client.submit_many({"document": text, "question": question(rng), "max_tokens": 2}
                             for _ in range(3))
    records = client.wait(ids, timeout=120)
    admitted = ask_worker(settings, "take_first_admission", {})["admitted"]
    # The bench's service head ends here: the jobs' recorded start is this admission (to
    # the microsecond a timestamp keeps), before any of them finished in the engine.
    assert min(r.started_at.timestamp() for r in records) == pytest.approx(admitted, abs=1e-5)
    assert admitted <= min(r.finished_at.timestamp() for r in records)
    # Taken once: until another batch runs there is nothing to report.
    assert ask_worker(settings, "take_first_admission", {})["admitted"] is None
