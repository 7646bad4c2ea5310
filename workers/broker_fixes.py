"""Adjustments to kombu 5.7's Redis transport that keep a worker alive whatever Redis holds
or does.

Anything that can write to Redis can push an item into a shard queue. kombu reads every item
as a JSON message envelope and lets an error in that escape its consumer loop, which Celery
treats as unrecoverable: one bad item would stop a GPU's worker. Here an item that is not a
message envelope is moved to the queue's dead-letter list (the newest `DEAD_LETTER_LIMIT`
kept, for inspection) and logged, and the worker carries on. A message that is an envelope
but not a task of ours is Celery's to refuse, which it does without stopping.

Across a broker reconnect (a Redis restart, a dropped connection):
kombu acknowledges a late-acknowledged message on the channel that delivered it. After a
reconnect that channel is closed, and kombu's ack (and the restore of unacknowledged messages
while closing it) dies with an AttributeError that Celery treats as unrecoverable: the whole
worker stops. Here an ack on a closed channel removes the message's lease entries through a
fresh connection instead, and closing a channel no longer restores messages (our leases make
that unnecessary: what a stopped worker held returns when its lease runs out)."""

from __future__ import annotations

import base64
import binascii
import json
import logging
from typing import Any

import redis
from kombu.transport import redis as kombu_redis

from jobsvc.keys import UNACKED_INDEX_KEY, UNACKED_KEY, dead_letter_key

log = logging.getLogger(__name__)

DEAD_LETTER_LIMIT = 1000
# An item longer than this is kept cut to it: the list is for seeing what came, not replaying.
_DEAD_LETTER_ITEM_BYTES = 64 * 1024


def is_envelope(item: Any) -> bool:
    """Whether a decoded queue item has what kombu's message needs to be handed to Celery."""
    if not isinstance(item, dict):
        return False
    properties, body = item.get("properties"), item.get("body")
    if not (isinstance(properties, dict) and isinstance(properties.get("delivery_tag"), str)
            and isinstance(properties.get("delivery_info"), dict) and isinstance(body, str)
            and isinstance(item.get("headers", {}), dict)):
        return False
    encoding = properties.get("body_encoding")
    if encoding is None or encoding == "utf-8":
        return True
    if encoding != "base64":
        return False
    try:
        base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def install(client: redis.Redis, queue: str) -> None:
    """Patch kombu for this worker, which consumes `queue`."""
    qos = kombu_redis.QoS
    if getattr(qos, "_jobsvc_fixed", False):
        return
    _set_aside_malformed_items(client, queue)
    qos.restore_at_shutdown = False
    original_ack, original_reject = qos.ack, qos.reject

    def forget(delivery_tag: str) -> None:
        try:
            with client.pipeline(transaction=False) as pipe:
                pipe.zrem(UNACKED_INDEX_KEY, delivery_tag)
                pipe.hdel(UNACKED_KEY, delivery_tag)
                pipe.execute()
        except redis.RedisError as error:
            # Not acknowledged: the message returns when its lease runs out, and results
            # are idempotent, so a second run records nothing new.
            log.warning("could not acknowledge %s after a reconnect: %s", delivery_tag, error)

    def ack(self: Any, delivery_tag: str) -> None:
        if self.channel.connection is not None:
            original_ack(self, delivery_tag)
        else:
            forget(delivery_tag)

    def reject(self: Any, delivery_tag: str, requeue: bool = False) -> None:
        if self.channel.connection is not None:
            original_reject(self, delivery_tag, requeue)
        elif not requeue:
            forget(delivery_tag)

    qos.ack, qos.reject = ack, reject
    qos._jobsvc_fixed = True


def _set_aside_malformed_items(client: redis.Redis, queue: str) -> None:
    key = dead_letter_key(queue)

    def set_aside(raw: str, why: str) -> None:
        data = raw.encode(errors="replace")
        log.error("moved a malformed item (%s) from %s to %s: %r", why, queue, key, data[:200])
        try:
            with client.pipeline(transaction=True) as pipe:
                pipe.lpush(key, data[:_DEAD_LETTER_ITEM_BYTES])
                pipe.ltrim(key, 0, DEAD_LETTER_LIMIT - 1)
                pipe.execute()
        except redis.RedisError as error:
            log.error("could not keep the malformed item in %s: %s", key, error)

    transport, channel = kombu_redis.Transport, kombu_redis.Channel
    original_deliver, original_read = transport._deliver, channel._brpop_read

    def deliver(self: Any, message: Any, destination: str) -> None:
        if not is_envelope(message):
            set_aside(json.dumps(message), "not a message envelope")
            return
        original_deliver(self, message, destination)

    def read(self: Any, **options: Any) -> Any:
        # The item is already off the queue when kombu fails to decode it.
        try:
            return original_read(self, **options)
        except json.JSONDecodeError as error:
            set_aside(error.doc, "not JSON")
        return True

    transport._deliver, channel._brpop_read = deliver, read

