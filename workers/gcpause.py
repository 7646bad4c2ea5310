"""Measures garbage-collector pauses with `gc.callbacks`, so a benchmark can report the
longest stop-the-world pause each worker suffered."""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauseMeter:
    def __init__(self) -> None:
        self._started = 0.0
        self.max_ms = 0.0
        self.collections = 0

    def install(self) -> None:
        gc.callbacks.append(self._callback)

    def take(self) -> dict[str, float]:
        """The longest pause and the count since the last take, then start over."""
        reading = {"gc_pause_max_ms": self.max_ms, "gc_collections": self.collections}
        self.max_ms = 0.0
        self.collections = 0
        return reading

    def _callback(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections += 1
            self.max_ms = max(self.max_ms, (time.perf_counter() - self._started) * 1000)
