"""Wake whoever waits for results when jobs finish, instead of having them poll.

Every transaction that finishes jobs sends a PostgreSQL notification, which the server
delivers when (and only if) the transaction commits. A waiter listens on its own connection
and re-checks its jobs when one arrives, so it sees a result within a round trip of its
commit and asks the database nothing in between. On SQLite, which has no notifications, a
waiter sleeps between checks, briefly at first and longer as the wait goes on."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)

FINISHED_CHANNEL = "jobsvc_finished"
_NOTIFY = text(f"NOTIFY {FINISHED_CHANNEL}")
# Without notifications: the first pause between checks, and how much each grows.
_FIRST_PAUSE_SECONDS = 0.05
_PAUSE_GROWTH = 1.5


def announce_finished(connection: Connection) -> None:
    """Within a transaction that finishes jobs: wake the waiters once it commits."""
    if connection.dialect.name == "postgresql":
        connection.execute(_NOTIFY)


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

    def wait(self, timeout: float) -> float | None:
        """Block until a notification arrives or `timeout` seconds pass."""
        self._listen()
        if self._listening is None:
            time.sleep(min(timeout, self._pause))
            self._pause *= _PAUSE_GROWTH
            return None
        try:
            arrived = None
            for _ in self._listening.notifies(timeout=timeout, stop_after=1):
                arrived = time.time()
            if arrived is not None:
                # Several commits may have landed at once: one check answers them all.
                for _ in self._listening.notifies(timeout=0):
                    pass
            return arrived
        except (psycopg.Error, OSError) as error:
            log.warning("lost the connection listening for finished jobs (%s)", error)
            self.close()
            return None
