"""The benchmark's probes in a service worker, attached through the worker's hooks
(`JOBSVC_WORKER_HOOKS=jobsvc.bench.probes:attach`, which `jobsvc bench` sets on the workers it
starts): a GC pause meter, the moment each burst's first batch went to the engine, and
remote-control commands (`app.control.broadcast(name, reply=True)`) that read them, reset the
prefix cache, read the engine's step counters, change the admission pacing, and drive the
engine directly with the standalone arm's burst. The commands bypass the queue and the
database, so only a worker told to attach them answers them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import prometheus_client
from celery.worker.control import control_command

from jobsvc.bench.gcpause import GcPauseMeter
from jobsvc.bench.standalone import run_burst
from jobsvc.workers.engine import Pacing
from jobsvc.workers.hooks import WorkerContext, WorkerHooks

log = logging.getLogger(__name__)

# The factory a worker's JOBSVC_WORKER_HOOKS names to attach these probes.
HOOKS_PATH = "jobsvc.bench.probes:attach"
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


class BenchProbes(WorkerHooks):
    """What the bench reads in a worker. The GC meter hooks the collector from the worker's
    start to its stop; the first admission is kept under a lock of its own, off the batch
    runner's."""

    def __init__(self) -> None:
        self._worker: WorkerContext | None = None
        self._gc_pauses: GcPauseMeter | None = None
        self._first_admission: float | None = None
        self._lock = threading.Lock()

    @property
    def worker(self) -> WorkerContext:
        """The worker's context, once its engine has started."""
        if self._worker is None:
            raise RuntimeError("the worker has not started its engine yet")
        return self._worker

    def on_start(self, worker: WorkerContext) -> None:
        """Keep the worker's context and start timing its collections."""
        self._worker = worker
        self._gc_pauses = GcPauseMeter(working=lambda: worker.collections.running)
        self._gc_pauses.install()

    def on_stop(self) -> None:
        """Stop timing collections."""
        if self._gc_pauses is not None:
            self._gc_pauses.uninstall()

    def on_admit(self, jobs: int, admitted_at: float) -> None:
        """Note the earliest admission of the burst: where the service arm's head ends."""
        if not jobs:
            return
        with self._lock:
            if self._first_admission is None or admitted_at < self._first_admission:
                self._first_admission = admitted_at

    def take_first_admission(self) -> float | None:
        """When (`time.time()`) the earliest batch since the last call went to the engine,
        after its claim; None if none did. It is also the `started_at` of that batch's jobs."""
        with self._lock:
            first, self._first_admission = self._first_admission, None
        return first

    def take_gc_pauses(self) -> dict[str, Any]:
        """The collections timed since the last take, the meter starting over."""
        if self._gc_pauses is None:
            raise RuntimeError("the worker has not started its engine yet")
        return self._gc_pauses.take()

    def run_standalone_burst(self, jobs: Sequence[Sequence[Any]], mode: str) -> dict[str, Any]:
        """Drive this worker's engine directly with these jobs, bypassing queue and database:
        the benchmark's standalone arm on the very engine the service arm uses, with
        collections held off as a batch holds them."""
        worker = self.worker
        with worker.collections.busy():
            return asdict(run_burst([worker.engine], worker.prompts,
                                    [[(document, question, sampling)
                                      for document, question, sampling in jobs]],
                                    mode, worker.engine.pacing))


def attach() -> BenchProbes:
    """The probes, with this process's worker answering the bench's commands through them."""
    probes = BenchProbes()
    _register_commands(probes)
    log.warning("this worker answers the benchmark's remote-control commands (%s)", HOOKS_PATH)
    return probes


def _register_commands(probes: BenchProbes) -> None:
    """Celery keeps one registry of remote-control commands per process."""

    @control_command()
    def reset_prefix_cache(_state: Any) -> dict[str, bool]:
        probes.worker.engine.reset_prefix_cache()
        return {"ok": True}

    @control_command()
    def take_gc_pauses(_state: Any) -> dict[str, Any]:
        return probes.take_gc_pauses()

    @control_command()
    def engine_steps(_state: Any) -> dict[str, float]:
        return engine_step_totals(prometheus_client.REGISTRY)

    @control_command()
    def take_first_admission(_state: Any) -> dict[str, float | None]:
        """When this worker's earliest batch since the last asking went to its engine: the
        end of the service arm's head, as the standalone arm's ends at its first request."""
        return {"admitted": probes.take_first_admission()}

    @control_command(args=[("chunk", int), ("pause_ms", float)])
    def set_admission_pacing(_state: Any, chunk: int, pause_ms: float) -> dict[str, Any]:
        """Pace the batches admitted from now on `chunk` requests every `pause_ms` (0: all at
        once), so that the bench can compare admission styles on one running worker. Replies
        with the pacing it replaced."""
        try:
            pacing = Pacing(chunk, pause_ms / 1000)
        except ValueError as error:
            return {"error": str(error)}
        engine = probes.worker.engine
        replaced, engine.pacing = engine.pacing, pacing
        return {"chunk": replaced.chunk, "pause_ms": replaced.pause_seconds * 1000}

    @control_command(args=[("jobs_by_shard", list), ("mode", str)])
    def run_standalone_burst(_state: Any, jobs_by_shard: list[list[list[Any]]],
                             mode: str) -> dict[str, Any]:
        """This shard's share of a standalone burst, staggered (if so) as
        `jobsvc.bench.standalone.staggered_pacing` says. The consumer waits meanwhile, so no batch
        runs beside the burst."""
        return probes.run_standalone_burst(jobs_by_shard[probes.worker.shard], mode)
