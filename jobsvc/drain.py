"""`jobsvc drain --shard N`: take a shard out of service with nothing lost and nothing run
twice. The command flags the shard draining in Redis (routers leave it out from then on) and
waits for its worker to finish: the worker stops taking messages, lets its running messages
end, moves its queued jobs to live shards and exits with code 0 (`jobsvc.workers.drain`). A shard
whose worker is not alive has its queued jobs moved by the command itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from jobsvc.departures import ShardMover
from jobsvc.health import read_heartbeat
from jobsvc.keys import DRAINING_KEY
from jobsvc.routing.live import read_draining
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.transport import make_celery

_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class DrainOutcome:
    """What `jobsvc drain` came to: whether the shard's worker is gone, and who moved its jobs."""

    # The shard's worker shut down (or none was running).
    done: bool
    # Jobs this command moved itself (a shard without a live worker).
    moved: int
    worker: str | None


def drain_shard(settings: Settings, shard: int, timeout_s: float,
                progress: Callable[[str], None]) -> DrainOutcome:
    """Flag the shard draining and wait up to `timeout_s` for its worker to hand its work on and
    stop; with no live worker, move its queued jobs here."""
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=10)
    try:
        client.sadd(DRAINING_KEY, shard)
        progress(f"shard {shard} flagged draining; draining now: {sorted(read_draining(client))}")
        seen = read_heartbeat(client, shard)
        if seen is None or not seen.alive:
            return DrainOutcome(True, _move_queued(settings, client, shard), None)
        name = seen.heartbeat.worker
        progress(f"waiting for worker {name} to finish its messages and stop")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen = read_heartbeat(client, shard)
            if seen is None or not seen.alive:
                return DrainOutcome(True, 0, name)
            time.sleep(_POLL_SECONDS)
        return DrainOutcome(False, 0, name)
    finally:
        client.close()


def _move_queued(settings: Settings, client: redis.Redis, shard: int) -> int:
    store = Store(settings.resolved_database_url)
    try:
        return ShardMover(settings, client, store, make_celery(settings)).move_unclaimed(shard)
    finally:
        store.dispose()
