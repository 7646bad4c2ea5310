"""What the command line shows: its own few lines, with library logging kept out of them unless
asked for, and progress as one line that updates in place in a terminal (a status line, or a
tqdm bar for a count toward a total)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from tqdm import tqdm

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
        """Show `text` as progress: in place on a terminal, elsewhere at most once per `every`."""
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


class ProgressBar:
    """Items finished toward a total, on standard error unless told otherwise: a tqdm bar
    redrawn in place on a terminal; elsewhere a StatusLine, so a captured run gets a plain
    line now and then instead of a stream of redraws.

    On a terminal the bar is also redrawn every `tick` seconds whether or not anything
    finished, so its elapsed time, rate and estimate keep moving while a long message runs
    (a bar that stands still looks like a hung program). The rate is the average since the
    start, so the estimate counts down between finishes."""

    def __init__(self, total: int, description: str, *, unit: str = "job",
                 stream: TextIO | None = None, every: float = PLAIN_LINE_SECONDS,
                 clock: Callable[[], float] = time.monotonic, tick: float = 1.0) -> None:
        self._stream = stream or sys.stderr
        self._total = total
        self._description = description
        self._unit = unit
        self.done = 0
        self._bar: tqdm | None = None
        self._line: StatusLine | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._ticker: threading.Thread | None = None
        if self._stream.isatty():
            self._bar = tqdm(total=total, desc=description, unit=unit, file=self._stream,
                             dynamic_ncols=True, smoothing=0)
            self._ticker = threading.Thread(target=self._tick, args=(tick,),
                                            name="progress-tick", daemon=True)
            self._ticker.start()
        else:
            self._line = StatusLine(self._stream, every=every, clock=clock)
            self._line.update(self._plain())

    def _tick(self, seconds: float) -> None:
        while not self._stopped.wait(seconds):
            with self._lock:
                if self._bar is not None and not self._stopped.is_set():
                    self._bar.refresh()

    def advance(self, count: float) -> None:
        """Count `count` more finished (never past the total)."""
        self.reach(min(self._total, self.done + count))

    def reach(self, done: float) -> None:
        """Set the count finished; a count known better than an earlier estimate may be lower."""
        done = int(max(0, min(self._total, done)))
        with self._lock:
            if done == self.done:
                return
            if self._bar is not None:
                self._bar.update(done - self.done)
            self.done = done
            if self._line is not None:
                self._line.update(self._plain())

    def write(self, line: str) -> None:
        """A line of text above the bar."""
        with self._lock:
            if self._bar is not None:
                self._bar.write(line, file=self._stream)
            else:
                self._write(f"{line}\n")

    def close(self) -> None:
        """Stop the ticker and leave the bar (or the last plain line) showing the final count."""
        self._stopped.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._bar is not None:
            self._bar.close()
        elif self._line is not None:
            self._line.finish(self._plain())

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _plain(self) -> str:
        return f"{self._description}: {self.done} of {self._total} {self._unit}s"

    def _write(self, text: str) -> None:
        self._stream.write(text)
        self._stream.flush()
