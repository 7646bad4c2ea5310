"""A worker's side of `jobsvc drain`: once its shard is flagged draining, it stops taking
messages, lets the messages it runs finish, moves the jobs no message of its claimed to live
shards (`jobsvc.departures`), and shuts down warm, with exit code 0.

Routers leave a draining shard out within `LIVE_SET_SECONDS`; the worker waits that long
before moving, and moves once more after its last message, so that a job a producer routed
from a live set read just before the flag is not left behind. A move touches only jobs that
no worker claimed, in one conditional update, so a job either runs here in a message already
claimed or moves: never both."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis
from kombu.exceptions import OperationalError
from sqlalchemy.exc import SQLAlchemyError

from jobsvc.departures import ShardMover
from jobsvc.keys import DRAINING_KEY
from jobsvc.routing.live import LIVE_SET_SECONDS
from jobsvc.workers.heartbeat import BatchActivity

log = logging.getLogger(__name__)

# How often the worker looks for its drain flag, and for its messages to end.
_CHECK_SECONDS = 1.0
# What a broker, Redis or store outage raises while draining: the drain is tried again.
_DRAIN_ERRORS = (redis.RedisError, SQLAlchemyError, OperationalError)


class DrainWatch:
    """Watches for the worker's shard to be flagged draining and then takes the worker out with
    nothing lost and nothing run twice."""

    def __init__(self, client: redis.Redis, shard: int, activity: BatchActivity,
                 mover: ShardMover, *, stop_consuming: Callable[[], None],
                 shut_down: Callable[[], None]) -> None:
        self._redis = client
        self._shard = shard
        self._activity = activity
        self._mover = mover
        self._stop_consuming = stop_consuming
        self._shut_down = shut_down

    def run(self, stopped: threading.Event) -> None:
        """Wait for the drain flag (or `stopped`), then drain; a failed drain is tried again."""
        while not stopped.wait(_CHECK_SECONDS):
            try:
                draining = bool(self._redis.sismember(DRAINING_KEY, self._shard))
            except redis.RedisError as error:
                log.warning("shard %d cannot read its drain flag: %s", self._shard, error)
                continue
            if not draining:
                continue
            try:
                self._drain(stopped)
            except _DRAIN_ERRORS as error:
                # Asking to stop consuming again is harmless: the next pass starts over.
                log.error("shard %d could not finish draining (%s: %s); trying again",
                          self._shard, type(error).__name__, error)
                continue
            return

    def _drain(self, stopped: threading.Event) -> None:
        log.warning("shard %d is draining: taking no more messages", self._shard)
        self._stop_consuming()
        # A worker stopped meanwhile leaves the rest to the reconciler: a draining shard is
        # not live, and once silent for the shard timeout its jobs move.
        if stopped.wait(LIVE_SET_SECONDS):
            return
        moved = self._mover.move_unclaimed(self._shard)
        while self._activity.now()[0]:
            if stopped.wait(_CHECK_SECONDS):
                return
        moved += self._mover.move_unclaimed(self._shard)
        log.warning("shard %d drained: its messages ended and %d queued jobs moved to live "
                    "shards; shutting down", self._shard, moved)
        self._shut_down()
