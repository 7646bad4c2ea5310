"""The fleet as an operator sees it: for every shard worth listing, its queue, its unfinished
jobs, its outstanding load and its worker's last heartbeat. `jobsvc status`, the server's
/metrics and Flower's queue list read it from here.

A shard is listed when the settings name it or when Redis or the store reports it: a
heartbeat is kept for it, messages wait in its queue, or the store holds unfinished jobs for
it. Producers or workers
configured with more shards than this process show up that way too.

A model is listed when the registry (`jobsvc.served_models`) knows it, a worker serves it or
unfinished jobs ask for it: a model no live worker serves keeps its jobs waiting, which only
this per-model view shows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import redis

from jobsvc.health import SeenWorker, read_heartbeats
from jobsvc.keys import ALL_QUEUES_PATTERN, queue_name, shard_of_queue
from jobsvc.routing.ledger import LoadLedger
from jobsvc.served_models import ServedModel, read_registry
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.wire import ACTIVE_STATUSES


@dataclass(frozen=True)
class ShardView:
    """One shard as an operator sees it: what waits for it and whether its worker is there."""

    shard: int
    # The settings of the process that looked name this shard.
    configured: bool
    # Messages waiting in the shard's queue (delivered, unacknowledged ones not counted).
    queue_messages: int
    # Unfinished jobs by status, every one of ACTIVE_STATUSES present.
    jobs: dict[str, int]
    # What the router counts the shard as still owing; None where the value is unreadable.
    outstanding_load: int | None
    worker: SeenWorker | None
    # The names it serves, its model's first, then its adapters': its heartbeat's, or where
    # none is kept, those it registered last; empty where neither says.
    models: list[str] = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        """Whether anything still waits on the shard: queued messages or unfinished jobs."""
        return self.queue_messages > 0 or any(self.jobs.values())

    @property
    def healthy(self) -> bool:
        """A worker is seen for the shard and is healthy (`SeenWorker.healthy`)."""
        return self.worker is not None and self.worker.healthy


@dataclass(frozen=True)
class ModelView:
    """One name jobs may ask for as an operator sees it: who serves it and what waits for it."""

    name: str
    # `generate` or `embed`, as registered or heartbeated; None where nothing says.
    task: str | None
    # Live workers serving it (alive heartbeats naming it), fleet-wide.
    workers: int
    # Unfinished jobs asking for it by status, every one of ACTIVE_STATUSES present.
    jobs: dict[str, int]

    @property
    def waiting(self) -> bool:
        """Jobs ask for it and no live worker serves it: they wait until one comes back."""
        return self.workers == 0 and any(self.jobs.values())


@dataclass(frozen=True)
class Fleet:
    """Every shard and model worth listing and the batches by status: the one read that
    `jobsvc status`, /metrics and Flower share."""

    shards: list[ShardView]
    # Batches of the batch API by status; None where the store has no batch table.
    batches: dict[str, int] | None
    # Every model worth listing, by name.
    models: list[ModelView] = field(default_factory=list)


def queued_shards(client: redis.Redis) -> set[int]:
    """Shards whose queue holds messages (Redis keeps no empty list)."""
    return {shard for key in client.scan_iter(match=ALL_QUEUES_PATTERN, count=1000)
            if (shard := shard_of_queue(key)) is not None}


def reported_shards(client: redis.Redis) -> set[int]:
    """Shards Redis reports, whatever their health: a heartbeat kept, or messages waiting."""
    return queued_shards(client) | set(read_heartbeats(client))


def listed_shards(configured: int, *reported: Iterable[int]) -> list[int]:
    """The configured shards and every reported one, in order."""
    return sorted(set(range(configured)).union(*reported))


def served_names(seen: SeenWorker | None, registered: Sequence[str]) -> list[str]:
    """What a shard serves: its heartbeat's names, or where none is kept, those it registered
    last."""
    return list(seen.heartbeat.models if seen is not None else registered)


def model_views(shards: Sequence[ShardView], workers: Mapping[int, SeenWorker],
                active: Mapping[str, Mapping[str, int]], registered: Mapping[str, ServedModel],
                *, every_registered: bool = True) -> list[ModelView]:
    """Every model served by a listed shard or asked for by unfinished jobs (`active`), and
    every registered one unless told otherwise, by name; its live workers are counted over
    all of `workers`."""
    names = (set(registered) if every_registered else set()) | set(active) | {
        name for view in shards for name in view.models}
    tasks = {name: seen.heartbeat.task for seen in workers.values()
             for name in seen.heartbeat.models}
    return [ModelView(
        name=name, task=registered[name].task if name in registered else tasks.get(name),
        workers=sum(seen.serves(name) for seen in workers.values()),
        jobs={status: active.get(name, {}).get(status, 0) for status in ACTIVE_STATUSES})
        for name in sorted(names)]


class FleetReader:
    """Reads the fleet in a few round trips: in Redis two key scans (one when reading one
    shard), a pipeline each for heartbeats, queue lengths and the model registry, and the load
    hash; in the store two GROUP BYs, by shard and by model (plus one for batches, where that
    table exists)."""

    def __init__(self, settings: Settings, client: redis.Redis, store: Store) -> None:
        self._configured = settings.shards
        self._redis = client
        self._store = store
        self._loads = LoadLedger(client)

    def read(self, only: int | None = None) -> Fleet:
        """Every listed shard and model, or shard `only` alone (listed or not) and the models
        it serves or its unfinished jobs ask for, their jobs counted on it alone."""
        workers = read_heartbeats(self._redis)
        active = self._store.active_counts()
        shards = ([only] if only is not None else
                  listed_shards(self._configured, workers, active, queued_shards(self._redis)))
        with self._redis.pipeline(transaction=False) as pipe:
            for shard in shards:
                pipe.llen(queue_name(shard))
            lengths = pipe.execute()
        loads = self._loads.loads()
        registered, shard_models = read_registry(self._redis)
        views = [ShardView(
            shard=shard, configured=shard < self._configured, queue_messages=int(length),
            jobs={status: active.get(shard, {}).get(status, 0) for status in ACTIVE_STATUSES},
            outstanding_load=loads.get(shard, 0), worker=workers.get(shard),
            models=served_names(workers.get(shard), shard_models.get(shard, [])))
            for shard, length in zip(shards, lengths, strict=True)]
        return Fleet(
            shards=views, batches=self._store.batch_counts(),
            models=model_views(views, workers, self._store.active_by_model(only), registered,
                               every_registered=only is None))
