"""The wire between producers and workers: one Celery app configuration both sides share,
the task name, batched publishing of messages to shard queues, and each shard's set of the
messages Redis holds (`keys.messages_key`), which reconciliation reads instead of the queues.

Messages are JSON only (nothing else is accepted), compressed whole with zstd. They carry
job IDs and nothing else: a job's record in the store says what it runs."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import redis
from celery import Celery
from kombu import compression as kombu_compression
from kombu import serialization

from jobsvc import compression
from jobsvc.keys import DROPPED_JOBS_KEY, UNACKED_INDEX_KEY, messages_key, queue_name
from jobsvc.settings import Settings
from jobsvc.wire import QueueMessage

RUN_MESSAGE_TASK = "jobsvc.run_message"


def make_celery(settings: Settings) -> Celery:
    """The Celery app producers and workers share, JSON and zstd only, so the two sides can never
    disagree on the wire."""
    compression.configure(settings.zstd_level, settings.max_message_bytes)
    compression.register_kombu_codec()
    app = Celery("jobsvc", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        event_serializer="json",
        task_compression=compression.KOMBU_CODEC,
        task_ignore_result=True,
        task_create_missing_queues=True,
        task_default_queue=queue_name(0),
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout,
            # Scan for expired leases every few seconds (kombu's default waits ~100 s).
            "unacked_restore_interval": max(1, settings.visibility_timeout // 6),
            "unacked_restore_throttle": 1,
            "unacked_index_key": UNACKED_INDEX_KEY,
        },
    )
    return app


def publish(app: Celery, client: redis.Redis, messages: Sequence[QueueMessage]) -> None:
    """Send every message, and name it in its shard's message set, in one Redis transaction
    on `client` (connected to `app`'s broker): a message is in its queue exactly when the set
    names it, whatever dies when.

    The envelopes are the ones Celery's `send_task` and kombu's Redis transport would write
    (`_envelope`), built here so that the message and its name go in together and a submit
    costs one round trip to Redis instead of a publish per message."""
    if not messages:
        return
    with client.pipeline(transaction=True) as pipe:
        for message in messages:
            pipe.lpush(queue_name(message.shard), json.dumps(_envelope(app, message)))
        for shard, ids in _by_shard((message.shard, message.message_id)
                                    for message in messages).items():
            pipe.sadd(messages_key(shard), *ids)
        pipe.execute()


def _envelope(app: Celery, message: QueueMessage) -> dict[str, Any]:
    """A task message of Celery's protocol 2 for RUN_MESSAGE_TASK, its body JSON compressed
    with our codec, as kombu's Redis transport stores it in a queue."""
    queue = queue_name(message.shard)
    task = app.amqp.as_task_v2(
        message.message_id, RUN_MESSAGE_TASK, args=[message.to_wire()], kwargs={},
        root_id=message.message_id,
        # A summary for Flower, instead of Celery's repr of the whole message.
        argsrepr=f"shard {message.shard}: {len(message.job_ids)} jobs", kwargsrepr="{}")
    content_type, content_encoding, body = serialization.dumps(task.body, serializer="json")
    body, codec = kombu_compression.compress(body, compression.KOMBU_CODEC)
    return {
        "body": base64.b64encode(body).decode(),
        "content-encoding": content_encoding,
        "content-type": content_type,
        "headers": {**task.headers, "compression": codec},
        "properties": {
            "correlation_id": message.message_id, "delivery_mode": 2, "priority": 0,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "body_encoding": "base64", "delivery_tag": str(uuid.uuid4())},
    }


def message_finished(client: redis.Redis, shard: int, message_id: str,
                     dropped_jobs: Sequence[str] = ()) -> None:
    """A worker is done with a message of `shard`'s queue: it leaves the shard's message set.
    `dropped_jobs`: the message's jobs, when its task ended on an error and may have left them
    unfinished, for the next reconciliation round to check at once."""
    with client.pipeline(transaction=True) as pipe:
        pipe.srem(messages_key(shard), message_id)
        if dropped_jobs:
            pipe.sadd(DROPPED_JOBS_KEY, *dropped_jobs)
        pipe.execute()


def held_messages(client: redis.Redis, sent: Iterable[tuple[int, str]]) -> set[str]:
    """Which of these (shard, message ID) pairs Redis still holds, queued or leased: one
    round trip, whatever the queues' lengths."""
    by_shard = _by_shard(sent)
    with client.pipeline(transaction=False) as pipe:
        for shard, ids in by_shard.items():
            pipe.smismember(messages_key(shard), ids)
        replies = pipe.execute()
    return {message_id for ids, held in zip(by_shard.values(), replies, strict=True)
            for message_id, present in zip(ids, held, strict=True) if present}


def _by_shard(sent: Iterable[tuple[int, str]]) -> dict[int, list[str]]:
    by_shard: dict[int, dict[str, None]] = {}
    for shard, message_id in sent:
        by_shard.setdefault(shard, {})[message_id] = None
    return {shard: list(ids) for shard, ids in by_shard.items()}
