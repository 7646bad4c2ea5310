"""The wire between producers and workers: one Celery app configuration both sides share,
the task name, and batched publishing of messages to shard queues.

Messages are JSON only (nothing else is accepted), compressed whole with zstd. They carry
job IDs and nothing else: a job's record in the store says what it runs."""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery

from jobsvc import compression
from jobsvc.keys import UNACKED_INDEX_KEY, queue_name
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


def publish(app: Celery, messages: Sequence[QueueMessage]) -> None:
    """Send every message in one Redis pipeline."""
    with app.producer_or_acquire() as producer, producer.batch(max_size=max(1, len(messages))):
        for message in messages:
            queue = queue_name(message.shard)
            # A summary for Flower, instead of Celery's truncated repr of the whole message.
            app.send_task(RUN_MESSAGE_TASK, args=[message.to_wire()], queue=queue,
                          routing_key=queue, producer=producer, task_id=message.message_id,
                          argsrepr=f"shard {message.shard}: {len(message.job_ids)} jobs")

