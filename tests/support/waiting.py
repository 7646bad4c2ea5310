"""Waiting, bounded, for what a test's other processes do in their own time."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress
from typing import TypeVar

T = TypeVar("T")


def until(what: str, check: Callable[[], T], timeout: float = 30, every: float = 0.2,
          ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """The first truthy value of `check`, tried every `every` seconds (an error of the
    `ignoring` kinds counts as not yet); AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        found: T | None = None
        with suppress(*ignoring):
            found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(every)
