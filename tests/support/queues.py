"""What tests read of a shard queue as kombu's Redis transport keeps it."""

from __future__ import annotations

import base64
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import redis
from kombu import compression as kombu_compression

from jobsvc import compression
from jobsvc.keys import queue_name


def queued_message_ids(broker: redis.Redis, shard: int) -> list[str]:
    """The task IDs of the messages waiting in `shard`'s queue, oldest first (each once per
    copy)."""
    return [envelope["headers"]["id"] for envelope in _envelopes(broker, shard)]


def queued_jobs(broker: redis.Redis, shards: Iterable[int]) -> dict[str, str]:
    """The message each job waits under in these shards' queues, read from the messages
    themselves; a job queued twice fails the test."""
    compression.register_kombu_codec()
    queued: dict[str, str] = {}
    copies: Counter[str] = Counter()
    for shard in shards:
        for envelope in _envelopes(broker, shard):
            body = kombu_compression.decompress(base64.b64decode(envelope["body"]),
                                                envelope["headers"]["compression"])
            ((payload,), _, _) = json.loads(body)
            for job_id in payload["jobs"]:
                copies[job_id] += 1
                queued[job_id] = envelope["headers"]["id"]
    assert not [job_id for job_id, count in copies.items() if count > 1], "queued twice"
    return queued


def _envelopes(broker: redis.Redis, shard: int) -> Iterator[dict[str, Any]]:
    """The envelopes in `shard`'s queue, oldest first (kombu pushes to the head)."""
    for raw in reversed(broker.lrange(queue_name(shard), 0, -1)):
        yield json.loads(raw)
