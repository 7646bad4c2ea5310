"""Measures garbage-collector pauses with `gc.callbacks`, so a benchmark can report the
longest stop-the-world pause each worker suffered, and in which generation.

A pause is wall time with the GIL held. On a host whose cores the engine keeps busy, the OS
may preempt the collecting thread, which lengthens the pause without any more collecting;
the CPU time the collection itself took is reported beside it to tell the two apart."""

from __future__ import annotations

import gc
import time
from typing import Any

_GENERATIONS = 3


class GcPauseMeter:
    def __init__(self) -> None:
        self._started = 0.0
        self._started_cpu = 0.0
        self.max_ms = [0.0] * _GENERATIONS
        self.max_cpu_ms = 0.0
        self.collections = [0] * _GENERATIONS

    def install(self) -> None:
        gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def take(self) -> dict[str, Any]:
        """The longest pause and the collection counts since the last take, then start over."""
        reading = {"gc_pause_max_ms": max(self.max_ms),
                   "gc_pause_max_ms_by_generation": self.max_ms,
                   "gc_cpu_max_ms": self.max_cpu_ms,
                   "gc_collections_by_generation": self.collections}
        self.max_ms = [0.0] * _GENERATIONS
        self.max_cpu_ms = 0.0
        self.collections = [0] * _GENERATIONS
        return reading

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            self._started_cpu = time.thread_time()
            return
        generation = info["generation"]
        self.collections[generation] += 1
        self.max_ms[generation] = max(self.max_ms[generation],
                                      (time.perf_counter() - self._started) * 1000)
        self.max_cpu_ms = max(self.max_cpu_ms, (time.thread_time() - self._started_cpu) * 1000)
