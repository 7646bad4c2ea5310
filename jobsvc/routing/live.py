"""The live fleet as producers route to it: the shards whose workers have fresh heartbeats
(`jobsvc.health`) and are not being drained. Until any worker has reported, the configured
shards (`JOBSVC_SHARDS`) stand in for them.

Policies decide over dense indices 0..n-1 (`routing.policies`); the routers map index i to the
i-th live shard number, so a policy never learns that the fleet changed and a static fleet of
shards 0..n-1 routes exactly as before."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping

import redis

from jobsvc.errors import JobsvcError
from jobsvc.health import SeenWorker, read_heartbeats
from jobsvc.keys import DRAINING_KEY

# How long a producer reuses the live set it read: a submit then costs no extra round trip,
# and a shard that joins or leaves is seen within this long (heartbeats come every 5 s).
LIVE_SET_SECONDS = 1.5


class NoLiveShard(JobsvcError):
    """Every shard that could take work is being drained: nothing can be routed."""


def live_shard_ids(workers: Mapping[int, SeenWorker], draining: Collection[int],
                   configured: int) -> tuple[int, ...]:
    """The shards new jobs may go to, in order: those with a live worker that is not draining;
    while no worker is alive, the configured shards 0..configured-1 that are not draining."""
    alive = [shard for shard, seen in workers.items() if seen.alive]
    candidates = alive or range(configured)
    shards = tuple(sorted(shard for shard in candidates if shard not in draining))
    if not shards:
        raise NoLiveShard(
            f"every shard that could take work is draining ({sorted(draining)}); start a worker "
            "under a new shard number, or end a drain by starting that shard's worker again")
    return shards


def read_draining(client: redis.Redis) -> set[int]:
    """The shards flagged draining (`jobsvc drain`), which new jobs must not go to."""
    return {int(shard) for shard in client.smembers(DRAINING_KEY)}


class LiveShards:
    """The live shard set, read from Redis at most once per `LIVE_SET_SECONDS`."""

    def __init__(self, client: redis.Redis, configured: int, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = client
        self._configured = configured
        self._clock = clock
        self._shards: tuple[int, ...] = ()
        self._read_at = float("-inf")

    def shards(self) -> tuple[int, ...]:
        """The live shards now, read again only when the last read is older than
        LIVE_SET_SECONDS."""
        now = self._clock()
        if now - self._read_at >= LIVE_SET_SECONDS:
            self._shards = live_shard_ids(read_heartbeats(self._redis),
                                          read_draining(self._redis), self._configured)
            self._read_at = now
        return self._shards
