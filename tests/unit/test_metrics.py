"""Metric families as Prometheus reads them (parsed with prometheus_client's own text parser):
the fleet's, built at each scrape, and a worker's, moved once per batch."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from prometheus_client import CollectorRegistry

from jobsvc.exposition import exposition
from jobsvc.fleet import Fleet, ModelView, ShardView
from jobsvc.health import Heartbeat, SeenWorker
from jobsvc.metrics import fleet_registry
from jobsvc.store import ClaimedJob
from jobsvc.workers.engine import EngineResult
from jobsvc.workers.hooks import FinishedMessage, HookChain, WorkerHooks
from jobsvc.workers.metrics import WorkerMetrics
from tests.support.exposition import Samples, parse_samples

pytestmark = pytest.mark.unit


def samples(registry: CollectorRegistry) -> Samples:
    """Every sample of the registry's text exposition, by name and labels."""
    text, content_type = exposition(registry)
    assert content_type.startswith("text/plain")
    return parse_samples(text.decode())


def labels(**pairs: str) -> frozenset[tuple[str, str]]:
    return frozenset(pairs.items())


def _fleet(batches: dict[str, int] | None) -> Fleet:
    worker = SeenWorker(Heartbeat(0, "shard0@h", "h", 1, 5.0, True, 0, None, 9400, "generate",
                                  ["jobsvc"]), 1.0)
    return Fleet([ShardView(0, True, 3, {"queued": 70, "running": 8}, 1200, worker,
                            ["jobsvc", "sql"]),
                  ShardView(4, False, 0, {"queued": 0, "running": 2}, None, None)], batches,
                 [ModelView("chat", "generate", 0, {"queued": 0, "running": 2}),
                  ModelView("jobsvc", "generate", 1, {"queued": 70, "running": 8}),
                  ModelView("sql", "generate", 1, {"queued": 0, "running": 0})])


def test_the_fleet_families_name_every_shard_its_queue_jobs_load_and_worker() -> None:
    reads = []
    registry = fleet_registry(lambda: reads.append(1) or _fleet(None))
    assert reads == []  # nothing is read until a scrape
    found = samples(registry)
    assert reads == [1]
    assert found[("jobsvc_queue_messages", labels(queue="jobs.shard.0", shard="0"))] == 3
    assert found[("jobsvc_queue_messages", labels(queue="jobs.shard.4", shard="4"))] == 0
    assert found[("jobsvc_jobs", labels(status="queued", shard="0"))] == 70
    assert found[("jobsvc_jobs", labels(status="running", shard="4"))] == 2
    assert found[("jobsvc_shard_outstanding_load", labels(shard="0"))] == 1200
    # An unreadable load is left out, not reported as zero.
    assert ("jobsvc_shard_outstanding_load", labels(shard="4")) not in found
    # A shard's worker carries the model it serves; none known, the label is empty.
    assert found[("jobsvc_worker_healthy", labels(shard="0", model="jobsvc"))] == 1
    assert found[("jobsvc_worker_healthy", labels(shard="4", model=""))] == 0
    assert not any(name == "jobsvc_batches" for name, _ in found)


def test_the_fleet_families_count_each_models_unfinished_jobs_and_live_workers() -> None:
    found = samples(fleet_registry(lambda: _fleet(None)))
    assert found[("jobsvc_model_jobs", labels(model="jobsvc", status="queued"))] == 70
    assert found[("jobsvc_model_jobs", labels(model="chat", status="running"))] == 2
    # A model with no jobs keeps its series, at zero.
    assert found[("jobsvc_model_jobs", labels(model="sql", status="queued"))] == 0
    assert found[("jobsvc_model_workers", labels(model="jobsvc"))] == 1
    assert found[("jobsvc_model_workers", labels(model="sql"))] == 1
    # Running jobs and no live worker: what an alert on waiting jobs looks for.
    assert found[("jobsvc_model_workers", labels(model="chat"))] == 0


def test_batches_are_counted_by_status_where_the_store_has_them() -> None:
    found = samples(fleet_registry(lambda: _fleet({"completed": 4, "in_progress": 1})))
    assert found[("jobsvc_batches", labels(status="completed"))] == 4
    assert found[("jobsvc_batches", labels(status="in_progress"))] == 1


def _job(job_id: str, submitted: float, estimated: int) -> ClaimedJob:
    return ClaimedJob(job_id, (1, 2), (3,), {}, "jobsvc", estimated,
                      datetime.fromtimestamp(submitted, UTC).replace(tzinfo=None))


def test_a_worker_counts_a_message_once_its_results_are_committed() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(2, registry)
    jobs = [_job("a", 100.0, 300), _job("b", 103.0, 10), _job("c", 100.0, 50)]
    results = [EngineResult("b", "x", None, 400, 16, 384, 110.0),
               EngineResult("a", "y", None, 400, 8, 128, 112.0),
               EngineResult("c", None, "aborted in the engine", 400, 0, 0, 111.0)]
    HookChain([WorkerHooks(), metrics]).on_jobs_finished(FinishedMessage(2, 105.0, jobs, results))
    found = samples(registry)
    shard = labels(shard="2")
    assert found[("jobsvc_jobs_finished_total", labels(shard="2", status="succeeded"))] == 2
    assert found[("jobsvc_jobs_finished_total", labels(shard="2", status="failed"))] == 1
    assert found[("jobsvc_prompt_tokens_total", shard)] == 800
    assert found[("jobsvc_cached_tokens_total", shard)] == 512
    assert found[("jobsvc_completion_tokens_total", shard)] == 24
    assert found[("jobsvc_estimated_prefill_tokens_total", shard)] == 310
    assert found[("jobsvc_actual_prefill_tokens_total", shard)] == 288
    assert found[("jobsvc_message_jobs_count", shard)] == 1
    assert found[("jobsvc_message_jobs_sum", shard)] == 3
    assert found[("jobsvc_message_duration_seconds_sum", shard)] == pytest.approx(7.0)
    # Submitted at 100, 103 and 100, admitted at 105.
    assert found[("jobsvc_queue_wait_seconds_count", shard)] == 3
    assert found[("jobsvc_queue_wait_seconds_sum", shard)] == pytest.approx(12.0)
    assert found[("jobsvc_queue_wait_seconds_bucket", labels(shard="2", le="2.5"))] == 1
    assert found[("jobsvc_queue_wait_seconds_bucket", labels(shard="2", le="5.0"))] == 3
    assert found[("jobsvc_submit_to_result_seconds_sum", shard)] == pytest.approx(7 + 12 + 11)


class Recording(WorkerHooks):
    def __init__(self, name: str, calls: list[str]) -> None:
        self._name, self._calls = name, calls

    def on_admit(self, jobs: int, admitted_at: float) -> None:
        self._calls.append(f"{self._name} admit {jobs}")

    def on_stop(self) -> None:
        self._calls.append(f"{self._name} stop")


def test_chained_hooks_are_each_called_in_turn() -> None:
    calls: list[str] = []
    chain = HookChain([Recording("metrics", calls), Recording("probes", calls)])
    chain.on_admit(4, 0.0)
    chain.on_claim(["a"])
    chain.on_stop()
    assert calls == ["metrics admit 4", "probes admit 4", "metrics stop", "probes stop"]
