"""The benchmark's remote-control commands (`app.control.broadcast(name, reply=True)`): reset a
worker's prefix cache, read its GC pauses, its engine's step counters and when its first batch
went to the engine, change its admission pacing, and drive its engine directly with the
standalone arm's burst. They bypass the queue and the database, so a worker registers them
only when told to (`JOBSVC_BENCH_CONTROL`, which `jobsvc bench` sets on the workers it
starts)."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import prometheus_client
from celery.worker.control import control_command

from workers.engine import Pacing

if TYPE_CHECKING:
    from workers.celery_app import WorkerRuntime

log = logging.getLogger(__name__)

COMMANDS = ("reset_prefix_cache", "take_gc_pauses", "engine_steps", "take_first_admission",
            "set_admission_pacing", "run_standalone_burst")
# vLLM observes every scheduler step's token count in this histogram, once per engine.
STEP_HISTOGRAM = "vllm:iteration_tokens_total"


def engine_step_totals(registry: prometheus_client.CollectorRegistry) -> dict[str, float]:
    """The steps the engines of this process have run so far and the tokens those steps
    computed (prompt tokens not found cached, and generated ones), summed over engines. Two
    bursts of the same jobs that differ here were scheduled differently; bursts that agree
    here and differ in time ran the same steps at different speeds."""
    totals = {"steps": 0.0, "tokens": 0.0}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == f"{STEP_HISTOGRAM}_count":
                totals["steps"] += sample.value
            elif sample.name == f"{STEP_HISTOGRAM}_sum":
                totals["tokens"] += sample.value
    return totals


def register(runtime: WorkerRuntime) -> None:
    """Make this process's worker answer the commands, acting on `runtime`."""
    log.warning("shard %d answers the benchmark's remote-control commands "
                "(JOBSVC_BENCH_CONTROL)", runtime.shard)

    @control_command()
    def reset_prefix_cache(_state: Any) -> dict[str, bool]:
        runtime.engine.reset_prefix_cache()
        return {"ok": True}

    @control_command()
    def take_gc_pauses(_state: Any) -> dict[str, float]:
        return runtime.gc_pauses.take()

    @control_command()
    def engine_steps(_state: Any) -> dict[str, float]:
        return engine_step_totals(prometheus_client.REGISTRY)

    @control_command()
    def take_first_admission(_state: Any) -> dict[str, float | None]:
        """When this worker's earliest batch since the last asking went to its engine: the
        end of the service arm's head, as the standalone arm's ends at its first request."""
        runner = runtime.runner
        return {"admitted": runner.take_first_admission() if runner is not None else None}

    @control_command(args=[("chunk", int), ("pause_ms", float)])
    def set_admission_pacing(_state: Any, chunk: int, pause_ms: float) -> dict[str, Any]:
        """Pace the batches admitted from now on `chunk` requests every `pause_ms` (0: all at
        once), so that the bench can compare admission styles on one running worker. Replies
        with the pacing it replaced."""
        try:
            pacing = Pacing(chunk, pause_ms / 1000)
        except ValueError as error:
            return {"error": str(error)}
        replaced, runtime.engine.pacing = runtime.engine.pacing, pacing
        return {"chunk": replaced.chunk, "pause_ms": replaced.pause_seconds * 1000}

    @control_command(args=[("jobs_by_shard", list), ("mode", str)])
    def run_standalone_burst(_state: Any, jobs_by_shard: list[list[list[Any]]],
                             mode: str) -> dict[str, float]:
        """Drive this worker's engine directly with this shard's share of a burst, bypassing
        queue and database: the benchmark's standalone arm on the very engine the service arm
        uses, staggered (if so) as `workers.standalone.staggered_pacing` says. The consumer waits
        meanwhile, so no batch runs beside the burst."""
        from workers.standalone import run_burst

        jobs = [(document, question, sampling)
                for document, question, sampling in jobs_by_shard[runtime.shard]]
        with runtime.collections.busy():
            return asdict(run_burst([runtime.engine], runtime.prompts, [jobs], mode,
                                    runtime.engine.pacing))
