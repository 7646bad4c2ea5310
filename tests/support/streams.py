"""Stand-ins for what the command line writes to: a terminal, and a clock the test moves."""

from __future__ import annotations

import io


class Terminal(io.StringIO):
    """A stream that says it is a terminal, so output is redrawn in place."""

    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
