"""Two adjustments to kombu 5.7's Redis transport that keep a worker alive across a broker
reconnect (a Redis restart, a dropped connection).

kombu acknowledges a late-acknowledged message on the channel that delivered it. After a
reconnect that channel is closed, and kombu's ack (and the restore of unacknowledged messages
while closing it) dies with an AttributeError that Celery treats as unrecoverable: the whole
worker stops. Here an ack on a closed channel removes the message's lease entries through a
fresh connection instead, and closing a channel no longer restores messages (our leases make
that unnecessary: what a stopped worker held returns when its lease runs out)."""

from __future__ import annotations

import logging
from typing import Any

import redis
from kombu.transport import redis as kombu_redis

from jobsvc.keys import UNACKED_INDEX_KEY, UNACKED_KEY

log = logging.getLogger(__name__)


def install(client: redis.Redis) -> None:
    qos = kombu_redis.QoS
    if getattr(qos, "_jobsvc_fixed", False):
        return
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
