"""What a `jobsvc bench` run reports: the figures it adds up burst by burst beside the pairs
(cache, queue, routing, collections), and the JSON report and plot made of them. Kept apart
from the driver, so that what a report holds can be read, and tested, without engines."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobsvc.bench.measure import (
    Pair,
    milliseconds,
    outside_engine_ms_per_job_by_role,
    parity_checks,
    percentile,
    summarize_pairs,
)
from jobsvc.bench.options import BenchOptions, arm_names, output_tokens
from jobsvc.settings import Settings


@dataclass
class GcTotals:
    """Each worker's longest GC pauses and its collections, over the bursts of one arm: while
    it had work in flight, and (`idle_*`) while it had none."""

    pause_max_ms: dict[str, float] = field(default_factory=dict)
    pause_max_ms_by_generation: dict[str, list[float]] = field(default_factory=dict)
    cpu_max_ms: dict[str, float] = field(default_factory=dict)
    collections_by_generation: dict[str, list[int]] = field(default_factory=dict)
    idle_pause_max_ms: dict[str, float] = field(default_factory=dict)
    idle_collections: dict[str, int] = field(default_factory=dict)

    def add(self, replies: Iterable[Mapping[str, Mapping[str, Any]]]) -> None:
        """Fold in the workers' `take_gc_pauses` readings."""
        for reply in replies:
            for worker, reading in reply.items():
                self.pause_max_ms[worker] = max(self.pause_max_ms.get(worker, 0.0),
                                                reading["gc_pause_max_ms"])
                self.cpu_max_ms[worker] = max(self.cpu_max_ms.get(worker, 0.0),
                                              reading["gc_cpu_max_ms"])
                self.idle_pause_max_ms[worker] = max(self.idle_pause_max_ms.get(worker, 0.0),
                                                     reading["gc_idle_pause_max_ms"])
                self.idle_collections[worker] = (self.idle_collections.get(worker, 0)
                                                 + reading["gc_idle_collections"])
                by_generation = self.pause_max_ms_by_generation.setdefault(
                    worker, [0.0, 0.0, 0.0])
                by_generation[:] = map(max, by_generation,
                                       reading["gc_pause_max_ms_by_generation"])
                collections = self.collections_by_generation.setdefault(worker, [0, 0, 0])
                collections[:] = map(sum, zip(collections,
                                              reading["gc_collections_by_generation"],
                                              strict=True))


@dataclass
class Totals:
    """Service-side figures accumulated over all trials."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    standalone_prompt_tokens: int = 0
    standalone_cached_tokens: int = 0
    shard_jobs: list[int] = field(default_factory=list)
    admission_ms: list[float] = field(default_factory=list)
    recording_lag_ms: list[float] = field(default_factory=list)
    # Per burst: from the last result's `recorded_at` stamp to the producer hearing its commit.
    heard_after_recorded_ms: list[float] = field(default_factory=list)
    gc: GcTotals = field(default_factory=GcTotals)
    # The same workers' collections during the standalone arm, when it drives their engines:
    # what vLLM's front end and the host cost the process without the service's work.
    standalone_gc: GcTotals = field(default_factory=GcTotals)
    bytes_enqueued: list[int] = field(default_factory=list)
    failed: int = 0


def run_report(settings: Settings, options: BenchOptions, totals: Totals,
           all_at_once_totals: Totals, pairs: list[Pair], mode: str,
           calibration: dict[str, float], ideal_rates: list[float], bytes_raw: list[int]
           ) -> dict[str, Any]:
    """The run's report from its pairs and totals, written as JSON and drawn where the options
    ask for it."""
    result: dict[str, Any] = {
        "workload": options.workload,
        "shards": settings.shards,
        "policy": settings.routing,
        "arms": "/".join(arm_names(options)),
        "trials": len(pairs),
        "jobs_per_trial": pairs[0].service.jobs,
        "output_tokens": output_tokens(options),
        "fresh_engines_per_pair": options.fresh_engines,
        "admission_chunk": settings.admission_chunk,
        "admission_pause_ms": settings.admission_pause_ms,
        **summarize_pairs(pairs),
        "ideal_hit_rate": sum(ideal_rates) / len(ideal_rates),
        "bytes_raw": sum(bytes_raw) // len(bytes_raw),
        **({} if options.compare_admission
           else _standalone_figures(totals, options, mode, calibration)),
        **({} if options.standalone_twice else _service_figures(totals)),
        **({"all_at_once": _service_figures(all_at_once_totals)}
           if options.compare_admission else {}),
    }
    result["parity_checks"] = parity_checks(result)
    result["pairs"] = [_pair_figures(pair) for pair in pairs]
    if options.json_path:
        options.json_path.parent.mkdir(parents=True, exist_ok=True)
        options.json_path.write_text(json.dumps(result, indent=2) + "\n")
    if options.plot_path:
        plot_pairs(result, options.plot_path)
    return result


def _standalone_figures(totals: Totals, options: BenchOptions, mode: str,
                        calibration: dict[str, float]) -> dict[str, Any]:
    """What only the standalone arm has: its admission style, cache and collections."""
    return {
        "standalone_on_workers": options.standalone_on_workers,
        "standalone_admission": mode,
        "admission_calibration_rps": calibration,
        "standalone_hit_rate": (totals.standalone_cached_tokens
                                / max(totals.standalone_prompt_tokens, 1)),
        "standalone_gc_pause_max_ms": totals.standalone_gc.pause_max_ms,
        "standalone_gc_cpu_max_ms": totals.standalone_gc.cpu_max_ms,
        "standalone_gc_collections_by_generation":
            totals.standalone_gc.collections_by_generation,
    }


def _service_figures(totals: Totals) -> dict[str, Any]:
    """What only the service arm has: its queue, database, routing and worker collections."""
    shard_jobs = totals.shard_jobs
    mean_jobs = sum(shard_jobs) / len(shard_jobs)
    return {
        "hit_rate": totals.cached_tokens / max(totals.prompt_tokens, 1),
        "shard_jobs": shard_jobs,
        "load_max_over_mean": max(shard_jobs) / mean_jobs if mean_jobs else 0.0,
        "bytes_enqueued": sum(totals.bytes_enqueued) // len(totals.bytes_enqueued),
        "gc_pause_max_ms": totals.gc.pause_max_ms,
        "gc_pause_max_ms_by_generation": totals.gc.pause_max_ms_by_generation,
        "gc_cpu_max_ms": totals.gc.cpu_max_ms,
        "gc_collections_by_generation": totals.gc.collections_by_generation,
        "gc_idle_pause_max_ms": totals.gc.idle_pause_max_ms,
        "gc_idle_collections": totals.gc.idle_collections,
        "queue_to_admission_ms": {"p50": percentile(totals.admission_ms, 0.5),
                                  "p99": percentile(totals.admission_ms, 0.99)},
        "engine_finish_to_recorded_ms": {
            "p50": percentile(totals.recording_lag_ms, 0.5),
            "p99": percentile(totals.recording_lag_ms, 0.99)} if totals.recording_lag_ms else None,
        "last_commit_heard_after_recorded_ms": {
            "p50": percentile(totals.heard_after_recorded_ms, 0.5),
            "max": max(totals.heard_after_recorded_ms)} if totals.heard_after_recorded_ms else None,
        "service_jobs_not_succeeded": totals.failed,
    }


def _pair_figures(pair: Pair) -> dict[str, Any]:
    """One pair as the JSON reports it: both arms side by side, so an outlier can be read."""
    return {
        "order": "service-first" if pair.service_first else "standalone-first",
        "ratio": pair.ratio,
        "body_ratio": pair.body_ratio,
        "shard_ratio": pair.shard_ratio,
        "standalone_rps": pair.standalone.requests_per_second,
        "service_rps": pair.service.requests_per_second,
        "standalone_output_tokens": pair.standalone.output_tokens,
        "service_output_tokens": pair.service.output_tokens,
        "standalone_tokens_per_s": pair.standalone.tokens_per_second,
        "service_tokens_per_s": pair.service.tokens_per_second,
        "standalone_cpu_s_per_job": pair.standalone.cpu_seconds_per_job,
        "service_cpu_s_per_job": pair.service.cpu_seconds_per_job,
        "standalone_outside_engine_cpu_s_per_job":
            pair.standalone.outside_engine_cpu_seconds_per_job,
        "service_outside_engine_cpu_s_per_job":
            pair.service.outside_engine_cpu_seconds_per_job,
        "standalone_outside_engine_cpu_ms_per_job_by_role":
            outside_engine_ms_per_job_by_role([pair.standalone]),
        "service_outside_engine_cpu_ms_per_job_by_role":
            outside_engine_ms_per_job_by_role([pair.service]),
        "standalone_steal_s": pair.standalone.steal_seconds,
        "service_steal_s": pair.service.steal_seconds,
        "standalone_unaccounted_cpu_s": pair.standalone.unaccounted_cpu_seconds,
        "service_unaccounted_cpu_s": pair.service.unaccounted_cpu_seconds,
        "standalone_foreign_cpu_s": pair.standalone.bounded_foreign_cpu_seconds,
        "service_foreign_cpu_s": pair.service.bounded_foreign_cpu_seconds,
        "disturbed": pair.disturbed,
        "standalone_head_ms": pair.standalone.head_seconds * 1000,
        "service_head_ms": pair.service.head_seconds * 1000,
        "service_tail_ms": pair.service.tail_seconds * 1000,
        "standalone_runner_wait_ms": pair.standalone.runner_wait_seconds * 1000,
        "service_runner_wait_ms": pair.service.runner_wait_seconds * 1000,
        "standalone_engine_steps": pair.standalone.engine_steps,
        "service_engine_steps": pair.service.engine_steps,
        "standalone_engine_step_tokens": pair.standalone.engine_step_tokens,
        "service_engine_step_tokens": pair.service.engine_step_tokens,
        "standalone_shard_finish_spread_ms": milliseconds(
            pair.standalone.shard_finish_spread_seconds),
        "service_shard_finish_spread_ms": milliseconds(pair.service.shard_finish_spread_seconds),
    }


def plot_pairs(result: dict[str, Any], path: Path) -> None:
    """Per-pair throughput ratio and CPU-seconds per job of both arms, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    pairs = result["pairs"]
    # The service arm's slot, then the standalone arm's (either may hold something else).
    first, second = result["arms"].split("/")
    index = list(range(1, len(pairs) + 1))
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4))
    left.plot(index, [pair["ratio"] for pair in pairs], "o-", label=f"{first} / {second}")
    left.axhline(0.99, color="red", linestyle="--", label="0.99")
    left.axhline(1.0, color="gray", linewidth=0.8)
    left.set_xlabel("pair")
    left.set_ylabel("throughput ratio")
    low, high = result["median_ratio_interval_95"]
    left.set_title(f"{result['workload']}, {result['shards']} shard(s): "
                   f"median {result['median_ratio']:.4f} ({low:.3f}-{high:.3f})")
    left.legend()
    width = 0.4
    right.bar([i - width / 2 for i in index], [p["standalone_cpu_s_per_job"] for p in pairs],
              width, label=second)
    right.bar([i + width / 2 for i in index], [p["service_cpu_s_per_job"] for p in pairs],
              width, label=first)
    right.set_xlabel("pair")
    right.set_ylabel("CPU seconds per job")
    right.set_title(f"cpu_ratio {result['cpu_ratio']:.4f}")
    right.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
