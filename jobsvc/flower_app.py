"""The Celery app `jobsvc flower` runs Flower with: the shared transport configuration, and an
inspection that also names every shard queue, so that Flower's Broker page lists them all.

Flower lists on its Broker page only the queues that workers reported when it last inspected
them (at its start, and when its Refresh is pressed), and its own default queue when none
did: a shard whose worker is down, or was still loading its engine when Flower started, has
no row, though its backlog is what an operator needs to see (Flower issue #335). Here the
reply to Flower's `active_queues` inspection carries one more entry, under the name
SHARD_QUEUES_NODE, with every configured or live shard queue (`jobsvc.fleet`), whoever
consumes it; Flower then shows each of them with its length, read from Redis at each page
load. Configured shards stay listed as workers come and go; a live shard beyond the
configured ones appears at Flower's next inspection.

Nothing of the worker side is imported: Flower needs only the broker."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property, partial
from typing import Any

import redis
from celery import Celery
from celery.app.control import Control, Inspect

from jobsvc.fleet import listed_shards, live_shards
from jobsvc.keys import queue_name
from jobsvc.settings import Settings
from jobsvc.transport import make_celery

# The name the shard queues are listed under among the workers Flower inspected.
SHARD_QUEUES_NODE = "shard-queues@jobsvc"


class ShardQueuesInspect(Inspect):
    def active_queues(self) -> dict[str, Any] | None:
        replies = super().active_queues()
        if self.destination:
            return replies
        control: ShardQueuesControl = self.app.control
        return {**(replies or {}),
                SHARD_QUEUES_NODE: [{"name": name} for name in control.shard_queues()]}


class ShardQueuesControl(Control):
    def __init__(self, app: Celery, shard_queues: Callable[[], list[str]]) -> None:
        super().__init__(app)
        self.shard_queues = shard_queues

    @cached_property
    def inspect(self) -> type[Inspect]:
        return self.app.subclass_with_self(ShardQueuesInspect, reverse="control.inspect")


def shard_queue_names(settings: Settings, client: redis.Redis) -> list[str]:
    """Every configured shard's queue and every live one's."""
    return [queue_name(shard) for shard in listed_shards(settings.shards, live_shards(client))]


def flower_celery(settings: Settings) -> Celery:
    app = make_celery(settings)
    client = redis.Redis.from_url(settings.redis_url, socket_timeout=5)
    app.control_cls = partial(ShardQueuesControl, shard_queues=partial(shard_queue_names,
                                                                       settings, client))
    return app


def run_flower(settings: Settings, address: str) -> int:
    """Flower in this process, on `address` and JOBSVC_FLOWER_PORT (other options from its
    FLOWER_* variables); returns its exit code. The broker URL never leaves the process."""
    return flower_celery(settings).start(
        ["flower", f"--address={address}", f"--port={settings.flower_port}"]) or 0
