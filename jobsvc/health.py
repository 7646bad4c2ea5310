"""Worker heartbeats: what a worker says about itself every few seconds, and how operators read
it back. A heartbeat is a small versioned JSON record under the shard's key in Redis. Each
write sets the key to expire after KEEP_SECONDS, so a reader learns how long ago the last one
came from the key's remaining lifetime, on the Redis server's clock: no two hosts' clocks are
ever compared."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields

import redis

from jobsvc.keys import (
    ALL_HEARTBEATS_PATTERN,
    SILENT_SINCE_KEY,
    heartbeat_key,
    shard_of_heartbeat,
)

log = logging.getLogger(__name__)

HEARTBEAT_VERSION = 2
# How often a worker writes its heartbeat.
HEARTBEAT_SECONDS = 5.0
# A worker whose last heartbeat is older than this (three missed) counts as gone.
ALIVE_SECONDS = 3 * HEARTBEAT_SECONDS
# How long a heartbeat stays readable after its worker stopped writing: an hour of "last
# seen", after which the shard is no longer live unless its queue or its jobs say so.
KEEP_SECONDS = 3600


class HeartbeatError(ValueError):
    """A heartbeat record that is not one this version writes."""


@dataclass(frozen=True)
class Heartbeat:
    """One worker's state as it last reported it. Durations are measured by the worker up to
    the moment it wrote the record."""

    shard: int
    worker: str
    host: str
    pid: int
    # Seconds since the worker began to start its engine.
    up_s: float
    engine_ready: bool
    messages_in_flight: int
    # Seconds between the end of the worker's last message and this record; None before one.
    last_message_finished_s: float | None
    # Where the worker serves /metrics; None when it serves none.
    metrics_port: int | None
    # What its engine does (`generate` or `embed`), and the names it serves: its model's,
    # then its LoRA adapters'.
    task: str
    models: list[str]
    # The worker shut down (warm shutdown); its last record says so.
    stopped: bool = False

    def to_json(self) -> str:
        """The heartbeat as the versioned JSON record kept in Redis."""
        return json.dumps({"v": HEARTBEAT_VERSION, **asdict(self)}, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Heartbeat:
        """A heartbeat read back from Redis; HeartbeatError for anything that is not a version this
        code reads, so a stray key never passes for a worker."""
        try:
            record = json.loads(raw)
        except ValueError as error:
            raise HeartbeatError(f"not JSON ({error})") from None
        if not isinstance(record, dict) or record.get("v") != HEARTBEAT_VERSION:
            raise HeartbeatError(f"not a version {HEARTBEAT_VERSION} heartbeat")
        names = {field.name for field in fields(cls)}
        try:
            return cls(**{name: value for name, value in record.items() if name in names})
        except TypeError as error:
            raise HeartbeatError(str(error)) from None


@dataclass(frozen=True)
class SeenWorker:
    """A heartbeat and how long ago it was written."""

    heartbeat: Heartbeat
    age_s: float

    @property
    def alive(self) -> bool:
        """The worker has not said it stopped and was heard from within ALIVE_SECONDS."""
        return not self.heartbeat.stopped and self.age_s <= ALIVE_SECONDS

    def serves(self, model: str) -> bool:
        """Alive and serving `model` (a model's served name or an adapter's)."""
        return self.alive and model in self.heartbeat.models

    @property
    def healthy(self) -> bool:
        """Alive with its engine ready: it takes work now."""
        return self.alive and self.heartbeat.engine_ready


def write_heartbeat(client: redis.Redis, heartbeat: Heartbeat) -> None:
    """Store the heartbeat under its shard's key, expiring after KEEP_SECONDS."""
    client.set(heartbeat_key(heartbeat.shard), heartbeat.to_json(), ex=KEEP_SECONDS)


def read_heartbeats(client: redis.Redis) -> dict[int, SeenWorker]:
    """Every shard's latest heartbeat still kept, by shard, in one scan and one round trip. An
    unreadable record is logged and left out."""
    shards = sorted(shard for key in client.scan_iter(match=ALL_HEARTBEATS_PATTERN, count=1000)
                    if (shard := shard_of_heartbeat(key)) is not None)
    with client.pipeline(transaction=False) as pipe:
        for shard in shards:
            pipe.get(heartbeat_key(shard))
            pipe.pttl(heartbeat_key(shard))
        replies = pipe.execute()
    return {shard: seen for shard, raw, remaining_ms
            in zip(shards, replies[::2], replies[1::2], strict=True)
            if (seen := _seen(shard, raw, remaining_ms)) is not None}


def read_heartbeat(client: redis.Redis, shard: int) -> SeenWorker | None:
    """One shard's latest heartbeat, if one is kept and readable, in one round trip."""
    with client.pipeline(transaction=False) as pipe:
        pipe.get(heartbeat_key(shard))
        pipe.pttl(heartbeat_key(shard))
        raw, remaining_ms = pipe.execute()
    return _seen(shard, raw, remaining_ms)


def read_silences(client: redis.Redis, workers: Mapping[int, SeenWorker],
                  known: Iterable[int]) -> dict[int, float]:
    """How long each shard with a heartbeat (`workers`) or otherwise `known` has been silent,
    as far as Redis can tell, on its own clock; what Redis lost never makes a shard silent
    longer. A heartbeat's age counts back no further than Redis's start: a server restored
    from a snapshot keeps its keys' old expiry, and no worker could write while it was down.
    A known shard without a heartbeat key is silent since that absence was first seen (kept
    under SILENT_SINCE_KEY) or since Redis started, whichever is later."""
    absent = set(known) - set(workers)
    with client.pipeline(transaction=False) as pipe:
        pipe.time()
        pipe.info("server")
        pipe.hgetall(SILENT_SINCE_KEY)
        (seconds, microseconds), server, recorded = pipe.execute()
    now = seconds + microseconds / 1_000_000
    uptime = float(server["uptime_in_seconds"])
    since = {int(shard): float(moment) for shard, moment in recorded.items()}
    with client.pipeline(transaction=False) as pipe:
        for shard in absent - since.keys():
            pipe.hsetnx(SILENT_SINCE_KEY, shard, repr(now))
        # A shard heard from again, or no longer known, starts afresh should it fall silent.
        if gone := since.keys() - absent:
            pipe.hdel(SILENT_SINCE_KEY, *gone)
        pipe.execute()
    silences = {shard: min(seen.age_s, uptime) for shard, seen in workers.items()}
    silences.update({shard: min(now - since.get(shard, now), uptime) for shard in absent})
    return silences


def _seen(shard: int, raw: bytes | None, remaining_ms: int) -> SeenWorker | None:
    """The heartbeat read under `shard`'s key with the key's remaining lifetime; None where
    there is none (it expired meanwhile) or it is unreadable, which is logged."""
    if raw is None or remaining_ms < 0:
        return None
    try:
        heartbeat = Heartbeat.from_json(raw)
    except HeartbeatError as error:
        log.warning("ignoring the heartbeat of shard %d: %s", shard, error)
        return None
    if heartbeat.shard != shard:
        log.warning("ignoring the heartbeat under shard %d's key: it names shard %d",
                    shard, heartbeat.shard)
        return None
    return SeenWorker(heartbeat, max(0.0, KEEP_SECONDS - remaining_ms / 1000))
