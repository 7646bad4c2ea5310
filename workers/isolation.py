"""Turns at the engine: batches share it, a suspect job has it alone.

A suspect is a job whose earlier delivery died with its engine. Whichever job of that engine
killed it, a suspect run alone either finishes or is the one to blame, so no job is failed for
the company it kept. A suspect waiting for its turn keeps new batches out, so it is not
starved by a steady stream of them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class EngineTurns:
    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._sharing = 0
        self._alone = False
        self._waiting_alone = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Run a batch beside other batches, unless a suspect has or waits for the engine."""
        with self._changed:
            self._changed.wait_for(lambda: not self._alone and not self._waiting_alone)
            self._sharing += 1
        try:
            yield
        finally:
            with self._changed:
                self._sharing -= 1
                self._changed.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        """Run one suspect with nothing else in the engine."""
        with self._changed:
            self._waiting_alone += 1
            self._changed.wait_for(lambda: not self._alone and not self._sharing)
            self._waiting_alone -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._changed:
                self._alone = False
                self._changed.notify_all()
