"""Reconciliation: the store is the record of every job, and this keeps Redis true to it.

A round finds unfinished jobs whose one queue message Redis no longer holds (neither waiting in
a shard queue nor held by a worker) and sends them again; this covers a restarted Redis, a
producer killed between recording and enqueueing, and a message whose task ended on an error.
Whether Redis holds a message is asked of its shard's message set (`transport.held_messages`),
never by reading the queues, and a round asks it only of jobs that could be stranded:
  new       jobs sent since the last round, once each, `stranded_grace` seconds after sending
            (a producer that died between recording and enqueueing)
  dropped   the jobs of messages whose task ended on an error (`keys.DROPPED_JOBS_KEY`)
  sweep     the unfinished jobs of the next ranges of message IDs, about SWEEP_JOBS_PER_ROUND
            of them (the ID space cut in SWEEP_BUCKETS, as many taken as the backlog's size
            calls for): a bounded backstop that goes round the whole backlog in turn
  all       every unfinished job, when `keys.RECONCILED_KEY` is gone or names another run of
            the Redis server: a restarted Redis (whatever it kept), or one never used before
so a round costs what was sent since the last one, not what waits in the queues.
It also returns shard load that no unfinished job holds any more (a producer that charged and
died, a worker that ended jobs and lost Redis before returning their load). Workers run a
round every `requeue_interval` seconds; a Redis lock keeps two from running one at a time.
Before that, it moves the unfinished jobs of shards whose workers have been silent for
`shard_timeout` seconds to live shards (`jobsvc.departures`): silent by their heartbeats as
Redis keeps them, and never longer than Redis has known their absence, so a restarted Redis
declares nobody dead; a worker's own round never counts its own shard dead.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import redis
from celery import Celery
from redis.lock import Lock

from jobsvc.departures import (
    RECONCILE_LOCK_SECONDS,
    ShardMover,
    dead_shards,
    reconcile_lock,
    rejoin_alive,
)
from jobsvc.dispatch import Dispatcher
from jobsvc.health import read_heartbeats, read_silences
from jobsvc.keys import (
    DROPPED_JOBS_KEY,
    RECONCILED_KEY,
    UNACKED_KEY,
    messages_key,
    queue_name,
    shard_of_queue,
)
from jobsvc.routing.ledger import LoadLedger
from jobsvc.routing.live import NoLiveShard, live_shard_ids, read_draining
from jobsvc.settings import Settings
from jobsvc.store import SentJob, Store, utcnow
from jobsvc.transport import held_messages

log = logging.getLogger(__name__)

# A message moves from a queue to a worker's lease in two steps: a second look after this
# pause keeps one caught between them from being taken for gone.
_SECOND_LOOK_SECONDS = 0.5
# Newly sent jobs a round checks at most, and jobs of dropped messages.
_NEW_JOBS_PER_ROUND = 50_000
_DROPPED_JOBS_PER_ROUND = 10_000
# The sweep's ranges of message IDs, and about how many unfinished jobs a round's sweep reads
# (a check of every job after a Redis restart reads SWEEP_JOBS_PER_SLICE at a time): with ten
# million held a round goes round 1/500 of the backlog, with fewer than these all of it.
SWEEP_BUCKETS = 65_536
SWEEP_JOBS_PER_ROUND = 20_000
SWEEP_JOBS_PER_SLICE = 100_000


@dataclass
class RoundReport:
    """What a reconciliation round changed, for its log line and for tests."""

    requeued: int = 0
    # Load added (positive) or returned (negative) per shard.
    load_corrected: dict[int, int] = field(default_factory=dict)
    # Jobs moved off dead shards.
    moved: int = 0


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
        # Shards whose message set outnumbered their queue and leases at the last round.
        self._excess: set[int] = set()

    def run_round(self) -> RoundReport:
        """One round, unless another reconciler is in one; returns what it changed."""
        lock = reconcile_lock(self._redis, wait=False)
        if not lock.acquire():
            return RoundReport()
        try:
            # Read once a round, again only after moves. The counts are folded here first: one
            # round runs at a time, so folds never wait on one another, and the other readers
            # of the counts (`jobsvc status`, the mover) only read.
            self._store.fold_active_counts()
            loads = self._store.active_load()
            moved, dead = self._move_off_dead_shards(loads)
            if moved:
                loads = self._store.active_load()
            stale = self._forget_stale_messages(set(range(self._settings.shards)) | set(loads),
                                                dead)
            return RoundReport(self._send_lost(dead, lock, stale), self._correct_load(loads),
                               moved)
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:
                # Held past its timeout: another reconciler may have begun a round meanwhile,
                # which sends a message twice at worst (a job runs under its latest one).
                log.warning("a reconciliation round outlasted its %d s lock",
                            RECONCILE_LOCK_SECONDS)

    def _move_off_dead_shards(self, loads: dict[int, int]) -> tuple[int, set[int]]:
        """Move the jobs of dead shards to live shards serving their models; returns how many
        moved, and the dead shards (jobs whose model no live worker serves wait there)."""
        workers = read_heartbeats(self._redis)
        rejoin_alive(self._redis, workers)
        try:
            live = live_shard_ids(workers, read_draining(self._redis), self._settings.shards)
        except NoLiveShard:
            return 0, set()
        timeout = self._settings.shard_timeout
        silences = read_silences(self._redis, workers, loads)
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
            self._redis.delete(queue_name(shard), messages_key(shard))
        return moved, dead

    def _send_lost(self, dead: set[int], lock: Lock, stale: set[str]) -> int:
        """Send again the jobs that could be stranded and whose message Redis no longer holds
        (a dead shard's jobs are the mover's); `stale`: messages just found gone."""
        sent_before = utcnow() - timedelta(seconds=self._settings.stranded_grace)
        # Progress belongs to one run of the Redis server: one that restarted since (even
        # during this round) holds only what it kept, so every job is checked again.
        server = str(self._redis.info("server")["run_id"])
        progress = {key.decode(): value.decode()
                    for key, value in self._redis.hgetall(RECONCILED_KEY).items()}
        if progress.get("server") != server:
            count = self._sweep_all(dead, sent_before, lock)
            self._redis.hset(RECONCILED_KEY, mapping={
                "server": server, "checked": _mark_text(sent_before, ""), "bucket": 0})
            return count
        dropped = [job_id.decode() for job_id in
                   self._redis.spop(DROPPED_JOBS_KEY, _DROPPED_JOBS_PER_ROUND) or []]
        count = self._resend(self._store.unfinished_among(dropped), dead)
        count += self._resend(self._store.unfinished_of_messages(sorted(stale)), dead)
        new = self._store.sent_after(_mark(progress["checked"]), sent_before,
                                     _NEW_JOBS_PER_ROUND)
        count += self._resend(new, dead)
        bucket = int(progress.get("bucket", 0)) % SWEEP_BUCKETS
        buckets = _sweep_size(bucket, SWEEP_JOBS_PER_ROUND, self._unfinished())
        count += self._resend(self._swept(bucket, buckets, sent_before), dead, whole=True)
        checked = (_mark_text(new[-1].enqueued_at, new[-1].job_id)
                   if len(new) == _NEW_JOBS_PER_ROUND and new[-1].enqueued_at is not None
                   else _mark_text(sent_before, ""))
        self._redis.hset(RECONCILED_KEY, mapping={
            "server": server, "checked": checked,
            "bucket": (bucket + buckets) % SWEEP_BUCKETS})
        if count:
            log.warning("sent %d stranded jobs again (no message of theirs was left in Redis)",
                        count)
        return count

    def _forget_stale_messages(self, shards: set[int], dead: set[int]) -> set[str]:
        """Take out of a shard's message set the messages Redis no longer holds (a queue
        deleted by hand, a message finished before its producer added it), which would
        otherwise hide their jobs from reconciliation. Only a shard whose set has outnumbered
        its queue and leases at two rounds running has its queue read, twice, a moment apart,
        so a message on its way from the queue to a worker's lease is not taken for gone."""
        shards = sorted(shards - dead)
        with self._redis.pipeline(transaction=False) as pipe:
            for shard in shards:
                pipe.scard(messages_key(shard))
                pipe.llen(queue_name(shard))
            replies = pipe.execute()
        leased = Counter(shard for shard, _ in self._leased())
        excess = {shard for shard, named, queued in zip(shards, replies[0::2], replies[1::2],
                                                        strict=True)
                  if named > queued + leased[shard]}
        suspects, self._excess = excess & self._excess, excess
        if not suspects:
            return set()
        # Named before either look: a message published later is in neither.
        named = {shard: {item.decode() for item in self._redis.smembers(messages_key(shard))}
                 for shard in suspects}
        first = self._held_now(suspects)
        time.sleep(_SECOND_LOOK_SECONDS)
        second = self._held_now(suspects)
        gone: set[str] = set()
        with self._redis.pipeline(transaction=False) as pipe:
            for shard in suspects:
                if stale := named[shard] - first[shard] - second[shard]:
                    pipe.srem(messages_key(shard), *stale)
                    gone |= stale
                    log.warning("shard %d: %d messages named but no longer in Redis; their "
                                "unfinished jobs are sent again", shard, len(stale))
            pipe.execute()
        return gone

    def _held_now(self, shards: set[int]) -> dict[int, set[str]]:
        """The IDs of the messages waiting in these shards' queues or leased to a worker."""
        held: dict[int, set[str]] = {shard: set() for shard in shards}
        for shard in shards:
            held[shard] |= {_envelope_id(raw) for raw in
                            self._redis.lrange(queue_name(shard), 0, -1)}
        for shard, message_id in self._leased():
            if shard in held:
                held[shard].add(message_id)
        return held

    def _leased(self) -> list[tuple[int, str]]:
        """(shard, message ID) of every message a worker holds: what kombu keeps in its
        unacknowledged hash, bounded by the workers' concurrency."""
        leased = []
        for raw in self._redis.hvals(UNACKED_KEY):
            try:
                envelope, _, routing_key = json.loads(raw)
            except (ValueError, TypeError):
                continue
            shard = shard_of_queue(routing_key) if isinstance(routing_key, str) else None
            if shard is not None:
                leased.append((shard, _envelope_id(envelope)))
        return leased

    def _sweep_all(self, dead: set[int], sent_before: datetime, lock: Lock) -> int:
        """Check every unfinished job sent before `sent_before`, bucket by bucket, keeping
        the round's lock."""
        count = bucket = 0
        unfinished = self._unfinished()
        while bucket < SWEEP_BUCKETS:
            buckets = _sweep_size(bucket, SWEEP_JOBS_PER_SLICE, unfinished)
            count += self._resend(self._swept(bucket, buckets, sent_before), dead, whole=True)
            bucket += buckets
            lock.extend(RECONCILE_LOCK_SECONDS, replace_ttl=True)
        if count:
            log.warning("Redis had lost its messages: sent %d unfinished jobs again", count)
        return count

    def _unfinished(self) -> int:
        """How many jobs are unfinished, as the store counts them."""
        return sum(sum(by_status.values()) for by_status in self._store.active_counts().values())

    def _swept(self, first: int, buckets: int, sent_before: datetime) -> list[SentJob]:
        """The unfinished jobs of `buckets` buckets from `first` on, but those of messages
        sent too lately to be looked for yet (a producer may be about to publish them)."""
        jobs = self._store.unfinished_in_buckets(first, buckets, SWEEP_BUCKETS)
        young = {job.message_id for job in jobs
                 if job.enqueued_at is not None and job.enqueued_at >= sent_before}
        return [job for job in jobs if job.message_id not in young]

    def _resend(self, jobs: Sequence[SentJob], dead: set[int], *, whole: bool = False) -> int:
        """Send again the jobs of those of `jobs`' messages that Redis does not hold (`whole`:
        `jobs` holds every unfinished job of each message it names); returns how many."""
        jobs = [job for job in jobs if job.shard not in dead]
        held = held_messages(self._redis, [(job.shard, job.message_id) for job in jobs
                                           if job.message_id is not None])
        if whole:
            return self._dispatcher.resend([job for job in jobs if job.message_id not in held])
        lost = {job.message_id for job in jobs if job.message_id not in held} - {None}
        # Every unfinished job of a lost message, not only those read: the message goes again
        # whole, and is then held for the rest of its jobs.
        return self._dispatcher.resend([
            *(job for job in jobs if job.message_id is None),
            *(job for job in self._store.unfinished_of_messages(sorted(lost))
              if job.shard not in dead)])

    def _correct_load(self, true_loads: dict[int, int]) -> dict[int, int]:
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


def _mark(text: str) -> tuple[datetime, str]:
    """A send time and job ID as `_mark_text` wrote them."""
    moment, _, job_id = text.partition(" ")
    return datetime.fromisoformat(moment), job_id


def _sweep_size(first: int, jobs: int, unfinished: int) -> int:
    """How many buckets from `first` on hold about `jobs` of the `unfinished` jobs, taken as
    spread evenly over the IDs (they are random): at least one, and none past the last."""
    wanted = -(-SWEEP_BUCKETS * jobs // max(unfinished, 1))
    return max(1, min(wanted, SWEEP_BUCKETS - first))


def _mark_text(moment: datetime, job_id: str) -> str:
    return f"{moment.isoformat()} {job_id}"


def _envelope_id(raw: bytes | dict[str, object]) -> str:
    """The task ID of a kombu envelope (raw or decoded); "" for anything else."""
    try:
        envelope = json.loads(raw) if isinstance(raw, bytes) else raw
    except ValueError:
        return ""
    headers = envelope.get("headers") if isinstance(envelope, dict) else None
    task_id = headers.get("id") if isinstance(headers, dict) else None
    return task_id if isinstance(task_id, str) else ""
