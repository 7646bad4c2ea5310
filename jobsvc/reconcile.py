"""Reconciliation: the store is the record of every job, and this keeps Redis true to it.

A round finds unfinished jobs whose one queue message is nowhere in Redis (neither waiting in
a shard queue nor held by a worker) and sends them again; this covers a restarted Redis, a
producer killed between recording and enqueueing, and a message a worker refused or dropped.
It also returns shard load that no unfinished job holds any more (a producer that charged and
died, a worker that ended jobs and lost Redis before returning their load). Workers run a
round every `requeue_interval` seconds; a Redis lock keeps two from running one at a time.
Everything it reads scales with the unfinished jobs and the queued messages, not with the
finished jobs. Before that, it moves the unfinished jobs of shards whose workers have been
silent for `shard_timeout` seconds to live shards (`jobsvc.departures`): silent by their
heartbeats as Redis keeps them, and never longer than Redis has known their absence, so a
restarted Redis declares nobody dead; a worker's own round never counts its own shard dead.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import redis
from celery import Celery

from jobsvc.departures import (
    RECONCILE_LOCK_SECONDS,
    ShardMover,
    dead_shards,
    reconcile_lock,
    rejoin_alive,
)
from jobsvc.dispatch import Dispatcher
from jobsvc.health import read_heartbeats, read_silences
from jobsvc.keys import UNACKED_KEY, queue_name
from jobsvc.routing.ledger import LoadLedger
from jobsvc.routing.live import NoLiveShard, live_shard_ids, read_draining
from jobsvc.settings import Settings
from jobsvc.store import Store, utcnow

log = logging.getLogger(__name__)

# A message moves from a queue to a worker's leases, and back, in two steps: a second look
# after this pause keeps one caught between them from being taken for lost.
_SECOND_LOOK_SECONDS = 0.5
_MOST_JOBS_PER_ROUND = 10_000


@dataclass
class RoundReport:
    """What a reconciliation round changed, for its log line and for tests."""

    requeued: int = 0
    # Load added (positive) or returned (negative) per shard.
    load_corrected: dict[int, int] = field(default_factory=dict)
    # Jobs moved off dead shards.
    moved: int = 0


def message_ids(raw_messages: Iterable[bytes]) -> set[str]:
    """The task IDs of kombu envelopes as the Redis transport stores them: a queued message
    is the envelope, a leased one `[envelope, exchange, routing_key]`. Anything else (raw
    garbage pushed into a queue) names no message."""
    ids: set[str] = set()
    for raw in raw_messages:
        try:
            item = json.loads(raw)
        except ValueError:
            continue
        envelope = item[0] if isinstance(item, list) and item else item
        headers = envelope.get("headers") if isinstance(envelope, dict) else None
        task_id = headers.get("id") if isinstance(headers, dict) else None
        if isinstance(task_id, str):
            ids.add(task_id)
    return ids


class Reconciler:
    """Keeps Redis true to the store, one round at a time: without it a job whose message Redis
    lost, or whose shard died, would wait forever."""

    def __init__(self, settings: Settings, client: redis.Redis, store: Store,
                 celery: Celery, *, own_shard: int | None = None) -> None:
        """`own_shard`: the shard of the worker running these rounds, which they never count
        dead (None for an operator's round)."""
        self._settings = settings
        self._redis = client
        self._store = store
        self._own_shard = own_shard
        self._ledger = LoadLedger(client)
        self._dispatcher = Dispatcher(settings, client, store, celery, self._ledger)
        self._mover = ShardMover(settings, client, store, celery)
        # Each shard's store-minus-Redis load difference at the last round: only a difference
        # that persists across two rounds is corrected, since submits and finishing jobs
        # change the two sides a moment apart.
        self._last_drift: dict[int, int] = {}

    def run_round(self) -> RoundReport:
        """One round, unless another reconciler is in one; returns what it changed."""
        lock = reconcile_lock(self._redis, wait=False)
        if not lock.acquire():
            return RoundReport()
        try:
            moved, dead = self._move_off_dead_shards()
            return RoundReport(self._requeue_stranded(dead), self._correct_load(), moved)
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:
                # Held past its timeout: another reconciler may have begun a round meanwhile,
                # which sends a message twice at worst (a job runs under its latest one).
                log.warning("a reconciliation round outlasted its %d s lock",
                            RECONCILE_LOCK_SECONDS)

    def _move_off_dead_shards(self) -> tuple[int, set[int]]:
        """Move the jobs of dead shards to live shards serving their models; returns how many
        moved, and the dead shards (jobs whose model no live worker serves wait there)."""
        workers = read_heartbeats(self._redis)
        rejoin_alive(self._redis, workers)
        try:
            live = live_shard_ids(workers, read_draining(self._redis), self._settings.shards)
        except NoLiveShard:
            return 0, set()
        timeout = self._settings.shard_timeout
        silences = read_silences(self._redis, workers, self._store.active_load())
        moved = 0
        dead = dead_shards(silences, live, timeout, own=self._own_shard)
        for shard in sorted(dead):
            # Jobs on a shard no worker ever reported for may have been routed there a moment
            # ago (producers assume the configured shards until one reports): they wait a
            # timeout too.
            moved += self._mover.move(shard, unclaimed_only=False,
                                      waited_s=None if shard in workers else timeout)
            self._mover.forget(shard)
            # Its messages now match no job (a job still there moves in a later round), and
            # nothing consumes them: an empty queue is not taken for work waiting.
            self._redis.delete(queue_name(shard))
        return moved, dead

    def _live_messages(self, shards: Iterable[int]) -> set[str]:
        with self._redis.pipeline(transaction=True) as pipe:
            for shard in shards:
                pipe.lrange(queue_name(shard), 0, -1)
            pipe.hvals(UNACKED_KEY)
            replies = pipe.execute()
        return message_ids(raw for reply in replies for raw in reply)

    def _requeue_stranded(self, dead: set[int]) -> int:
        """Send again the jobs of live shards whose messages Redis lost (a dead shard's jobs
        are the mover's)."""
        sent_before = utcnow() - timedelta(seconds=self._settings.stranded_grace)
        shards = (set(range(self._settings.shards)) | set(self._store.active_load())) - dead
        live = self._live_messages(shards)
        if not self._store.stranded_jobs(sent_before, live, 1, skipped=dead):
            return 0
        time.sleep(_SECOND_LOOK_SECONDS)
        live |= self._live_messages(shards)
        stranded = self._store.stranded_jobs(sent_before, live, _MOST_JOBS_PER_ROUND,
                                             skipped=dead)
        count = self._dispatcher.requeue(stranded)
        if not count:
            return 0
        log.warning("sent %d stranded jobs again (no message of theirs was left in Redis)",
                    count)
        return count

    def _correct_load(self) -> dict[int, int]:
        true_loads = self._store.active_load()
        recorded = self._ledger.loads()
        corrections: dict[int, tuple[int, int]] = {}
        drift: dict[int, int] = {}
        for shard in true_loads.keys() | recorded.keys():
            true_load, now = true_loads.get(shard, 0), recorded.get(shard, 0)
            if now is None:
                corrections[shard] = (0, true_load)
                continue
            drift[shard] = true_load - now
            last = self._last_drift.get(shard, 0)
            if drift[shard] * last > 0:
                step = min(abs(drift[shard]), abs(last))
                corrections[shard] = (step if drift[shard] > 0 else -step, true_load)
        self._last_drift = drift
        self._ledger.correct(corrections)
        deltas = {shard: delta for shard, (delta, _) in corrections.items()}
        if deltas:
            log.warning("corrected shard loads that no unfinished job accounted for: %s", deltas)
        return deltas
