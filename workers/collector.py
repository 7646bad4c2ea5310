"""When a worker's garbage collector may run: rarely while messages run, as usual when idle.

A collection holds the GIL for its whole length, so the engine's front end (which admits
requests and takes their outputs) stops with it; on a host whose cores the engine keeps busy
the OS also takes the collecting thread's core away mid-collection, stretching the pause well
past the CPU the collection took. A young collection starts once more tracked objects have
survived than its threshold allows, and every request in flight keeps a few dozen alive; so
while any message runs the threshold is raised past what thousands of requests in flight keep
alive, and no collection falls inside a burst unless far more than that is alive or lost in
reference cycles (then one runs, walking them all). Once no message runs, the usual threshold
returns and the next allocation collects whatever the burst left."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Surviving tracked objects a young collection waits for while messages run (CPython's own
# threshold is 700): above what a few thousand requests in flight keep alive, below what would
# make the collection that finally runs a pause longer than the ones it spares.
BUSY_YOUNG_THRESHOLD = 100_000


class CollectionWindow:
    """Shared by every message of a process: the first to start raises the young generation's
    threshold, the last to end restores it."""

    def __init__(self, busy_threshold: int = BUSY_YOUNG_THRESHOLD) -> None:
        self._busy_threshold = busy_threshold
        self._running = 0
        self._idle_thresholds = gc.get_threshold()
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        """Whether any message runs now. Read without the lock: the garbage collector's callbacks
        ask, and one may run in a thread that holds it."""
        return self._running > 0

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Hold the raised threshold while a message runs; the last message to end restores it."""
        with self._lock:
            if self._running == 0:
                self._idle_thresholds = gc.get_threshold()
                gc.set_threshold(self._busy_threshold, *self._idle_thresholds[1:])
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    gc.set_threshold(*self._idle_thresholds)
