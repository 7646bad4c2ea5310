"""Measures garbage-collector pauses with `gc.callbacks`, so a benchmark can report the
longest stop-the-world pause each worker suffered, and in which generation."""

from __future__ import annotations

import gc
import time
from typing import Any

_GENERATIONS = 3


class GcPauseMeter:
    def __init__(self) -> None:
        self._started = 0.0
        self.max_ms = [0.0] * _GENERATIONS
        self.collections = [0] * _GENERATIONS

    def install(self) -> None:
        gc.callbacks.append(self._callback)

    def take(self) -> dict[str, Any]:
        """The longest pause and the collection counts since the last take, then start over."""
        reading = {"gc_pause_max_ms": max(self.max_ms),
                   "gc_pause_max_ms_by_generation": self.max_ms,
                   "gc_collections_by_generation": self.collections}
        self.max_ms = [0.0] * _GENERATIONS
        self.collections = [0] * _GENERATIONS
        return reading

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.collections[generation] += 1
        self.max_ms[generation] = max(self.max_ms[generation],
                                      (time.perf_counter() - self._started) * 1000)
