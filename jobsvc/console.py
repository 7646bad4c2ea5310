"""What the command line shows: its own few lines, with library logging kept out of them unless
asked for, and progress as one line that updates in place in a terminal."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TextIO

# Alembic, Celery and vLLM talk at INFO about their own set-up; a command's output says what
# happens in its own words and shows their warnings only.
LIBRARY_LEVEL = "WARNING"
# Away from a terminal (a pipe, a CI log) progress is a plain line this often at most.
PLAIN_LINE_SECONDS = 10.0


def configure_logging(log_level: str, *, explicit: bool, worker: bool) -> None:
    """A worker logs at JOBSVC_LOG_LEVEL (`log_level`): its log is its output. Other commands
    log at LIBRARY_LEVEL unless JOBSVC_LOG_LEVEL was set (`explicit`). vLLM configures its
    own logger from VLLM_LOGGING_LEVEL when a process loads it: an explicit JOBSVC_LOG_LEVEL
    sets that too (so workers started from a quiet command log at theirs), else it is left
    to the user and defaults to this process's level."""
    level = log_level if explicit or worker else LIBRARY_LEVEL
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if explicit:
        os.environ["VLLM_LOGGING_LEVEL"] = level
    else:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", level)


class StatusLine:
    """Progress as one line: rewritten in place on a terminal; elsewhere written as a plain
    line at most every `every` seconds, so a captured run stays a few lines long."""

    def __init__(self, stream: TextIO | None = None, *, every: float = PLAIN_LINE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream or sys.stdout
        self._terminal = self._stream.isatty()
        self._every = every
        self._clock = clock
        self._last_written: float | None = None
        self._unwritten: str | None = None
        self._line_open = False

    def update(self, text: str) -> None:
        if self._terminal:
            self._write(f"\r\x1b[K{text}")
            self._line_open = True
            return
        now = self._clock()
        if self._last_written is None or now - self._last_written >= self._every:
            self._write(f"{text}\n")
            self._last_written, self._unwritten = now, None
        else:
            self._unwritten = text

    def finish(self, text: str | None = None) -> None:
        """End the line with `text`, or else with the latest update not yet written."""
        if self._terminal:
            if text is not None:
                self._write(f"\r\x1b[K{text}\n")
            elif self._line_open:
                self._write("\n")
        elif (final := text if text is not None else self._unwritten) is not None:
            self._write(f"{final}\n")
        self._last_written, self._unwritten, self._line_open = None, None, False

    def _write(self, text: str) -> None:
        self._stream.write(text)
        self._stream.flush()
