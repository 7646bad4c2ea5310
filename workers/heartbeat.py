"""The worker's heartbeat: every few seconds a thread writes what the worker is doing (engine
ready, messages in flight, when the last one ended) to its shard's key in Redis
(`jobsvc.health`), from the moment it starts its engine until it shuts down, when a last
record says it stopped. `jobsvc status`, the server's /metrics and Flower read it."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from jobsvc.health import HEARTBEAT_SECONDS, Heartbeat, write_heartbeat
from jobsvc.served_models import ServedModel, register

log = logging.getLogger(__name__)

# A heartbeat that cannot reach Redis within this long is skipped; the next one tries again.
_REDIS_TIMEOUT_SECONDS = 3.0


class BatchActivity:
    """How many messages run now and when the last one ended; updated once per message."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._last_finished: float | None = None

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count a message in flight while the block runs, and note when it ends."""
        with self._lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self._last_finished = time.monotonic()

    def now(self) -> tuple[int, float | None]:
        """Messages in flight, and seconds since the last one ended (None before one did)."""
        with self._lock:
            in_flight, last = self._in_flight, self._last_finished
        return in_flight, None if last is None else time.monotonic() - last


class HeartbeatKeeper:
    """Writes the worker's heartbeat every few seconds from its own thread, so a busy engine never
    makes a live worker look dead."""

    def __init__(self, redis_url: str, shard: int, worker: str, activity: BatchActivity, *,
                 served: list[ServedModel]) -> None:
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=_REDIS_TIMEOUT_SECONDS,
                                           socket_connect_timeout=_REDIS_TIMEOUT_SECONDS)
        self._shard = shard
        self._worker = worker
        # Celery names a worker name@host: the host part is the one the fleet knows it by.
        self._host = worker.partition("@")[2] or socket.gethostname()
        self._activity = activity
        # What the worker serves (its model, then its adapters), registered at every beat from
        # the first: producers take jobs for it while its engine starts, as routers already
        # count it live, and a Redis that lost the registry has it back within a beat.
        self._served = served
        self._started = time.monotonic()
        self._engine_ready = False
        self._metrics_port: int | None = None
        self._failing = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self, metrics_port: int | None) -> None:
        """Beat from now on; `metrics_port` is where the worker serves /metrics, if it does."""
        self._metrics_port = metrics_port
        self._thread.start()

    def engine_started(self, served: list[ServedModel]) -> None:
        """The engine answers, serving these models (with the context it really runs): say so
        at once rather than at the next beat."""
        self._served = served
        self._engine_ready = True
        self._beat()

    def stop(self) -> None:
        """Stop beating and leave a last record that says the worker stopped."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
        self._beat(stopped=True)
        self._redis.close()

    def _record(self, *, stopped: bool = False) -> Heartbeat:
        in_flight, since_last = self._activity.now()
        return Heartbeat(shard=self._shard, worker=self._worker, host=self._host,
                         pid=os.getpid(), up_s=time.monotonic() - self._started,
                         engine_ready=self._engine_ready and not stopped,
                         messages_in_flight=in_flight, last_message_finished_s=since_last,
                         metrics_port=self._metrics_port, task=self._served[0].task,
                         models=[model.name for model in self._served], stopped=stopped)

    def _run(self) -> None:
        self._beat()
        while not self._stopped.wait(HEARTBEAT_SECONDS):
            self._beat()

    def _beat(self, *, stopped: bool = False) -> None:
        try:
            write_heartbeat(self._redis, self._record(stopped=stopped))
            if not stopped:
                register(self._redis, self._shard, self._served)
        except redis.RedisError as error:
            if not self._failing:
                log.warning("shard %d cannot write its heartbeat (%s); retrying every %.0f s",
                            self._shard, error, HEARTBEAT_SECONDS)
            self._failing = True
            return
        if self._failing:
            log.info("shard %d writes its heartbeat again", self._shard)
        self._failing = False
