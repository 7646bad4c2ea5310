"""Wake whoever waits for results when jobs finish, instead of having them poll.

Every statement that finishes jobs sends a PostgreSQL notification (a trigger on the jobs
table, migration 0004), which the server delivers when (and only if) its transaction
commits, saying how many jobs the statement finished (migration 0005). A waiter listens on its
own connection and re-checks its jobs once the notifications since its last check could cover
every job it still waits for, so it sees its last result within a round trip of the commit
and asks the database nothing in between. On SQLite, which has no notifications, a waiter
sleeps between checks, briefly at first and longer as the wait goes on."""

from __future__ import annotations

import logging
import math
import select
import time
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)

# The channel migration 0004's trigger notifies.
FINISHED_CHANNEL = "jobsvc_finished"
# Without notifications: the first pause between checks, and how much each grows.
_FIRST_PAUSE_SECONDS = 0.05
_PAUSE_GROWTH = 1.5
# While notifications arrive, the longest a waiter goes between checks: only a safety net for
# jobs finished outside the service's own statements (by hand, say), since the announced
# counts bring on every check that can find jobs finished. A short bound would only add checks
# that find nothing, each taking the producer's and the database's CPU from the engines.
NOTIFIED_CHECK_SECONDS = 10.0


def finished_count(payload: str) -> float:
    """How many jobs a notification says its statement finished; infinity where it does not
    say (a database before migration 0005), so that a waiter checks at once."""
    try:
        return int(payload.split(" ", 1)[0])
    except ValueError:
        return math.inf


class FinishSignal:
    """A waiter's end of the notifications: `wait` returns the moment the notification arrived
    that brought the jobs finished since its last return up to those asked for, or None when
    the timeout passed first. Without notifications (on SQLite, or while the listening
    connection is lost) it returns None after a pause, and the waiter just checks again."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._listening: Any = None
        self._pause = _FIRST_PAUSE_SECONDS
        # Jobs announced finished since `wait` last returned, and when the latest announcement
        # arrived.
        self._finished: float = 0
        self.last_heard: float | None = None

    def __enter__(self) -> FinishSignal:
        self._listen()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the listening connection, if one is open."""
        if self._listening is not None:
            self._listening.close()
            self._listening = None

    def _listen(self) -> None:
        if self._engine.dialect.name != "postgresql" or self._listening is not None:
            return
        # A connection of its own, outside the pool: it stays in LISTEN for the whole wait.
        # Its parameters are the pool's (options included), as the dialect derives them.
        _args, parameters = self._engine.dialect.create_connect_args(self._engine.url)
        try:
            listening = psycopg.connect(**parameters, autocommit=True)
            listening.execute(f"LISTEN {FINISHED_CHANNEL}")
        except (psycopg.Error, OSError) as error:
            log.warning("cannot listen for finished jobs (%s); checking once a wait instead",
                        error)
            return
        self._listening = listening

    def check_interval(self, without_notifications: float) -> float:
        """The longest pause a waiter should take between checks: `without_notifications`
        while it has no notifications to count on, and at least NOTIFIED_CHECK_SECONDS while it
        listens."""
        if self._listening is None:
            return without_notifications
        return max(without_notifications, NOTIFIED_CHECK_SECONDS)

    def _drain(self, announced: Callable[[float], None] | None) -> None:
        """Count every notification already received, without waiting (several commits may
        have landed at once: one check answers them all)."""
        for notification in self._listening.notifies(timeout=0):
            count = finished_count(notification.payload)
            self._finished += count
            self.last_heard = time.time()
            if announced is not None:
                announced(count)

    def wait(self, timeout: float, jobs: int = 1,
             announced: Callable[[float], None] | None = None) -> float | None:
        """Block until notifications since the last return announce at least `jobs` finished
        jobs (those of other waiters count too: a check too early costs only itself), or
        `timeout` seconds pass. Every job among `jobs` that finishes after the waiter's last
        check is announced after this signal's last return, so none can be missed.
        `announced` is told each notification's count as it arrives (a progress display's
        estimate between checks)."""
        self._listen()
        if self._listening is None:
            time.sleep(min(timeout, self._pause))
            self._pause *= _PAUSE_GROWTH
            return None
        deadline = time.monotonic() + timeout
        try:
            # psycopg's own blocking wait for notifications wakes every 0.1 s to look for
            # interrupts; on a host whose cores the engine keeps busy each wakeup takes a core
            # from it. Blocking on the socket wakes only when something arrives.
            self._drain(announced)
            while self._finished < jobs:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                select.select([self._listening.fileno()], [], [], remaining)
                self._drain(announced)
        except (psycopg.Error, OSError) as error:
            log.warning("lost the connection listening for finished jobs (%s)", error)
            self.close()
            return None
        finally:
            self._finished = 0
        return self.last_heard
