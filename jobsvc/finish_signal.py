"""Wake whoever waits for results when jobs finish, instead of having them poll.

Every statement that finishes jobs sends a PostgreSQL notification (a trigger on the jobs
table, migration 0004), which the server delivers when (and only if) its transaction
commits. A waiter listens on its own connection and re-checks its jobs when one arrives, so it
sees a result within a round trip of its commit and asks the database nothing in between. On
SQLite, which has no notifications, a waiter sleeps between checks, briefly at first and
longer as the wait goes on."""

from __future__ import annotations

import logging
import select
import time
from typing import Any

import psycopg
from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)

# The channel migration 0004's trigger notifies.
FINISHED_CHANNEL = "jobsvc_finished"
# Without notifications: the first pause between checks, and how much each grows.
_FIRST_PAUSE_SECONDS = 0.05
_PAUSE_GROWTH = 1.5


class FinishSignal:
    """A waiter's end of the notifications: `wait` returns the moment one arrived, or None
    when the timeout passed first. Without notifications (on SQLite, or while the listening
    connection is lost) it returns None after a pause, and the waiter just checks again."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._listening: Any = None
        self._pause = _FIRST_PAUSE_SECONDS

    def __enter__(self) -> FinishSignal:
        self._listen()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._listening is not None:
            self._listening.close()
            self._listening = None

    def _listen(self) -> None:
        if self._engine.dialect.name != "postgresql" or self._listening is not None:
            return
        # A connection of its own, outside the pool: it stays in LISTEN for the whole wait.
        conninfo = self._engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False)
        try:
            listening = psycopg.connect(conninfo, autocommit=True)
            listening.execute(f"LISTEN {FINISHED_CHANNEL}")
        except (psycopg.Error, OSError) as error:
            log.warning("cannot listen for finished jobs (%s); checking once a wait instead",
                        error)
            return
        self._listening = listening

    def _drain(self) -> bool:
        """Take every notification already received, without waiting; True if there was any
        (several commits may have landed at once: one check answers them all)."""
        return sum(1 for _ in self._listening.notifies(timeout=0)) > 0

    def wait(self, timeout: float) -> float | None:
        """Block until a notification arrives or `timeout` seconds pass."""
        self._listen()
        if self._listening is None:
            time.sleep(min(timeout, self._pause))
            self._pause *= _PAUSE_GROWTH
            return None
        try:
            # psycopg's own blocking wait for notifications wakes every 0.1 s to look for
            # interrupts; on a host whose cores the engine keeps busy each wakeup takes a core
            # from it. Blocking on the socket wakes only when something arrives.
            if self._drain():
                return time.time()
            readable, _, _ = select.select([self._listening.fileno()], [], [], timeout)
            arrived = time.time()
            return arrived if readable and self._drain() else None
        except (psycopg.Error, OSError) as error:
            log.warning("lost the connection listening for finished jobs (%s)", error)
            self.close()
            return None
