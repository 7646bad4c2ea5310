"""Moving work off shards that leave the fleet: dead ones (a worker silent for
`JOBSVC_SHARD_TIMEOUT` seconds) and drained ones (`jobsvc drain`).

A job is moved through the one door every job goes through (`jobsvc.dispatch`): routed again
(so a document's jobs stay together and land on live shards), its new shard, message and load
recorded in the store, and only then the new messages published. The store update is
conditional on the job still being unfinished on the old shard, so a job moves once even if
two movers raced; the old shard's messages, queued or unacknowledged, then match no job (a
claim names shard and message) and run nothing. The reconciler moves dead shards' jobs under
its lock, and forgets a dead shard's routing state (affinity entries, load, cache estimate)
once."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import timedelta

import redis
from celery import Celery
from redis.lock import Lock

from jobsvc.dispatch import Dispatcher
from jobsvc.health import SeenWorker
from jobsvc.keys import DEPARTED_KEY, DRAINING_KEY, RECONCILE_LOCK_KEY
from jobsvc.routing.ledger import LoadLedger
from jobsvc.routing.router import forget_shard
from jobsvc.settings import Settings
from jobsvc.store import Store, utcnow

log = logging.getLogger(__name__)

# Jobs moved per call; a reconciler round moves at most this many per dead shard.
MOST_JOBS_PER_MOVE = 10_000
# Longest anyone holds the reconcile lock. Rounds and moves take seconds at most; a worker
# killed while it held the lock keeps every other reconciler, and so the move of its own jobs,
# waiting this long.
RECONCILE_LOCK_SECONDS = 30
# Longest a drain waits for a reconciliation round to end before it moves jobs.
_LOCK_WAIT_SECONDS = 60


def reconcile_lock(client: redis.Redis, *, wait: bool) -> Lock:
    """The lock under which jobs are sent again or moved, one process at a time."""
    return client.lock(RECONCILE_LOCK_KEY, timeout=RECONCILE_LOCK_SECONDS, blocking=wait,
                       blocking_timeout=_LOCK_WAIT_SECONDS if wait else None)


def dead_shards(silences: Mapping[int, float], live: Iterable[int], timeout_s: float, *,
                own: int | None = None) -> set[int]:
    """The shards that left the fleet: silent for longer than `timeout_s` (seconds by shard,
    `jobsvc.health.read_silences`) and not live. Never `own`, the shard of the worker that
    asks: it is alive, whatever Redis says of its heartbeat."""
    live = set(live)
    return {shard for shard, silent_s in silences.items()
            if silent_s > timeout_s and shard not in live and shard != own}


def rejoin(client: redis.Redis, shard: int) -> None:
    """A worker starting under `shard` takes it back into the fleet: not draining, not
    departed (its engine's start report already empties its cache estimate)."""
    with client.pipeline(transaction=True) as pipe:
        pipe.srem(DRAINING_KEY, shard)
        pipe.srem(DEPARTED_KEY, shard)
        pipe.execute()


def rejoin_alive(client: redis.Redis, workers: Mapping[int, SeenWorker]) -> set[int]:
    """Take departed shards whose workers are heartbeating back into the fleet (found dead
    while they ran on, or back from a pause): should they truly die later, their routing
    state is forgotten then. Returns the shards taken back."""
    alive = {shard for shard, seen in workers.items() if seen.alive}
    back = alive & {int(shard) for shard in client.smembers(DEPARTED_KEY)} if alive else set()
    if back:
        client.srem(DEPARTED_KEY, *back)
        log.warning("shards %s were counted departed but their workers are alive: they "
                    "rejoin the fleet", sorted(back))
    return back


class ShardMover:
    """Moves the jobs of a shard that left the fleet onto live shards, through the router, so
    nothing waits on a shard that will not run it."""

    def __init__(self, settings: Settings, client: redis.Redis, store: Store,
                 celery: Celery) -> None:
        self._redis = client
        self._store = store
        self._dispatcher = Dispatcher(settings, client, store, celery, LoadLedger(client))

    def move(self, shard: int, *, unclaimed_only: bool,
             waited_s: float | None = None) -> int:
        """Route the shard's unfinished jobs (only those no worker claimed, if asked; only
        those enqueued more than `waited_s` seconds ago, if given) again to live shards;
        returns how many moved."""
        enqueued_before = None if waited_s is None else utcnow() - timedelta(seconds=waited_s)
        # Jobs of a model no live worker serves wait where they are: they are not even read.
        models = self._dispatcher.live_models(self._store.active_by_model(shard))
        if not models:
            return 0
        jobs = self._store.jobs_on_shard(shard, unclaimed_only=unclaimed_only,
                                         enqueued_before=enqueued_before, models=models,
                                         limit=MOST_JOBS_PER_MOVE)
        if not jobs:
            return 0
        moved = self._dispatcher.move(shard, jobs, unclaimed_only=unclaimed_only)
        if moved:
            log.warning("moved %d unfinished jobs off shard %d to shards %s", len(moved), shard,
                        sorted(set(moved.values())))
        return len(moved)

    def move_unclaimed(self, shard: int) -> int:
        """Move the jobs of a draining shard that no worker claimed, under the reconcile lock
        (waiting for a round to end)."""
        with reconcile_lock(self._redis, wait=True):
            return self.move(shard, unclaimed_only=True)

    def forget(self, shard: int) -> None:
        """Forget a dead shard's routing state, once (until a worker rejoins under it)."""
        if self._redis.sismember(DEPARTED_KEY, shard):
            return
        forget_shard(self._redis, shard)
        self._redis.sadd(DEPARTED_KEY, shard)
        log.warning("shard %d left the fleet: its affinity entries, load and cache estimate "
                    "are forgotten", shard)
