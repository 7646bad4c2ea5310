"""Measures garbage-collector pauses with `gc.callbacks`, so a benchmark can report the
longest stop-the-world pause each worker suffered, and in which generation.

A pause is wall time with the GIL held. On a host whose cores the engine keeps busy, the OS
may preempt the collecting thread, which lengthens the pause without any more collecting;
the CPU time the collection itself took is reported beside it to tell the two apart. Pauses
while the worker has no batch in flight stall no work (workers leave their collections for
those moments, see `jobsvc.workers.collector`), so they are kept apart from the others."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

_GENERATIONS = 3


class GcPauseMeter:
    """Times every collection from the collector's own callbacks, busy and idle apart, so a
    benchmark can say whether collections stalled the engine."""

    def __init__(self, working: Callable[[], bool] = lambda: True) -> None:
        # Asked at each collection's start; it must not block (it runs inside the collector).
        self._working = working
        self._started = 0.0
        self._started_cpu = 0.0
        self._started_working = True
        self._start_over()

    def _start_over(self) -> None:
        self.max_ms = [0.0] * _GENERATIONS
        self.max_cpu_ms = 0.0
        self.collections = [0] * _GENERATIONS
        self.idle_max_ms = 0.0
        self.idle_collections = 0

    def install(self) -> None:
        """Start timing collections in this process."""
        gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        """Stop timing collections; harmless if not installed."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def take(self) -> dict[str, Any]:
        """The longest pauses and the collection counts since the last take, then start over:
        while work was in flight by generation, and while none was."""
        reading = {"gc_pause_max_ms": max(self.max_ms),
                   "gc_pause_max_ms_by_generation": self.max_ms,
                   "gc_cpu_max_ms": self.max_cpu_ms,
                   "gc_collections_by_generation": self.collections,
                   "gc_idle_pause_max_ms": self.idle_max_ms,
                   "gc_idle_collections": self.idle_collections}
        self._start_over()
        return reading

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started_working = self._working()
            self._started = time.perf_counter()
            self._started_cpu = time.thread_time()
            return
        pause_ms = (time.perf_counter() - self._started) * 1000
        if not self._started_working:
            self.idle_collections += 1
            self.idle_max_ms = max(self.idle_max_ms, pause_ms)
            return
        generation = info["generation"]
        self.collections[generation] += 1
        self.max_ms[generation] = max(self.max_ms[generation], pause_ms)
        self.max_cpu_ms = max(self.max_cpu_ms, (time.thread_time() - self._started_cpu) * 1000)
