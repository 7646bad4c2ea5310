"""Lease renewal for the messages a worker is running.

kombu's Redis transport redelivers a message once it has been unacknowledged for longer than
the visibility timeout. A short timeout brings a crashed worker's messages back quickly, but
would also redeliver a long message that is still running; so a live worker re-scores the
messages it runs every third of the timeout, and only a dead worker's leases run out."""

from __future__ import annotations

import logging
import threading
import time

import redis

from jobsvc.keys import UNACKED_INDEX_KEY

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews the leases of the messages this worker runs, so a message longer than the visibility
    timeout is not delivered again while it still runs."""

    def __init__(self, client: redis.Redis, visibility_timeout: float) -> None:
        self._redis = client
        self._interval = visibility_timeout / 3
        self._tags: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)

    def start(self) -> None:
        """Start renewing, every third of the visibility timeout."""
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing; leases still held then run out, and their messages come back."""
        self._stopped.set()
        self._thread.join(timeout=5)

    def hold(self, tag: str) -> None:
        """Renew the lease of the message with delivery tag `tag` until it is released."""
        with self._lock:
            self._tags[tag] = self._tags.get(tag, 0) + 1

    def release(self, tag: str) -> None:
        """Stop renewing `tag` once every hold of it has been released."""
        with self._lock:
            left = self._tags.get(tag, 0) - 1
            if left > 0:
                self._tags[tag] = left
            else:
                self._tags.pop(tag, None)

    def renew(self) -> int:
        """Re-score every held message that is still unacknowledged; returns how many."""
        with self._lock:
            tags = list(self._tags)
        if not tags:
            return 0
        now = time.time()
        return int(self._redis.zadd(UNACKED_INDEX_KEY, dict.fromkeys(tags, now), xx=True, ch=True))

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self.renew()
            except redis.RedisError as error:
                log.warning("could not renew leases: %s", error)
