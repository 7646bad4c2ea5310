"""The live fleet as producers route to it: for each model, the shards whose workers have
fresh heartbeats (`jobsvc.health`), serve that model and are not being drained. A model with
no live worker keeps the shards that served it last, where its jobs wait. Until any worker
has reported, the configured shards (`JOBSVC_SHARDS`) stand in for them.

Policies decide over dense indices 0..n-1 (`routing.policies`); the routers map index i to the
i-th live shard number, so a policy never learns that the fleet changed and a static fleet of
shards 0..n-1 routes exactly as before."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import redis

from jobsvc.errors import JobsvcError
from jobsvc.health import SeenWorker, read_heartbeats
from jobsvc.keys import DRAINING_KEY
from jobsvc.served_models import read_registry

# How long a producer reuses the live set it read: a submit then costs no extra round trip,
# and a shard that joins or leaves is seen within this long (heartbeats come every 5 s).
LIVE_SET_SECONDS = 1.5


class NoLiveShard(JobsvcError):
    """No shard may take a model's work: every one that could is being drained."""


@dataclass(frozen=True)
class ModelShards:
    """The shards a model's jobs go to now, and whether a worker there runs them: if not, the
    jobs wait there for one (`jobsvc.served_models`)."""

    shards: tuple[int, ...]
    live: bool


def live_shard_ids(workers: Mapping[int, SeenWorker], draining: Collection[int],
                   configured: int) -> tuple[int, ...]:
    """The shards with a live worker that is not draining, whatever they serve; while no
    worker is alive, the configured shards 0..configured-1 that are not draining."""
    alive = [shard for shard, seen in workers.items() if seen.alive]
    candidates = alive or range(configured)
    shards = tuple(sorted(shard for shard in candidates if shard not in draining))
    if not shards:
        raise NoLiveShard(
            f"every shard that could take work is draining ({sorted(draining)}); start a worker "
            "under a new shard number, or end a drain by starting that shard's worker again")
    return shards


def model_shard_ids(model: str, workers: Mapping[int, SeenWorker], draining: Collection[int],
                    configured: int, registered: Mapping[int, Sequence[str]]) -> ModelShards:
    """Where `model`'s jobs go: the shards whose live workers serve it and are not draining;
    if none, the shards that served it last (not draining), where its jobs wait; while no
    worker has ever registered and none is alive, the configured shards stand in."""
    live = tuple(sorted(shard for shard, seen in workers.items()
                        if seen.serves(model) and shard not in draining))
    if live:
        return ModelShards(live, True)
    if not registered and not any(seen.alive for seen in workers.values()):
        return ModelShards(live_shard_ids(workers, draining, configured), True)
    waiting = tuple(sorted(shard for shard, names in registered.items()
                           if model in names and shard not in draining))
    if not waiting:
        raise NoLiveShard(
            f"no shard may take jobs for model {model!r}: no live worker serves it and every "
            f"shard that served it is draining or gone; start a worker for it")
    return ModelShards(waiting, False)


def read_draining(client: redis.Redis) -> set[int]:
    """The shards flagged draining (`jobsvc drain`), which new jobs must not go to."""
    return {int(shard) for shard in client.smembers(DRAINING_KEY)}


class LiveShards:
    """Where each model's jobs go now, from heartbeats, drains and the registry read from
    Redis at most once per `LIVE_SET_SECONDS`."""

    def __init__(self, client: redis.Redis, configured: int, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = client
        self._configured = configured
        self._clock = clock
        self._workers: Mapping[int, SeenWorker] = {}
        self._draining: set[int] = set()
        self._registered: Mapping[int, Sequence[str]] = {}
        self._read_at = float("-inf")

    def shards(self, model: str) -> ModelShards:
        """`model`'s shards now (`model_shard_ids`), read again only when the last read is
        older than LIVE_SET_SECONDS."""
        now = self._clock()
        if now - self._read_at >= LIVE_SET_SECONDS:
            self._workers = read_heartbeats(self._redis)
            self._draining = read_draining(self._redis)
            self._registered = read_registry(self._redis)[1]
            self._read_at = now
        return model_shard_ids(model, self._workers, self._draining, self._configured,
                               self._registered)
