"""Message formation: pure logic that cuts a call's jobs into per-shard messages.

A document's questions stay together in as few messages as possible, so the engine meets them
side by side and computes the document's prefix once."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from jobsvc.wire import QueueMessage


@dataclass(frozen=True)
class PlacedJob:
    """A job with the shard chosen for it."""

    job_id: str
    shard: int
    document_key: str


def form_messages(placed: Sequence[PlacedJob], batch_size: int) -> list[QueueMessage]:
    """Group jobs into messages of at most `batch_size` jobs per shard, jobs of one document
    adjacent, in first-seen document order; each message gets a fresh ID."""
    by_shard: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for job in placed:
        by_shard[job.shard][job.document_key].append(job.job_id)
    messages: list[QueueMessage] = []
    for shard in sorted(by_shard):
        ordered = [job_id for job_ids in by_shard[shard].values() for job_id in job_ids]
        for start in range(0, len(ordered), batch_size):
            messages.append(QueueMessage(shard, ordered[start:start + batch_size],
                                         uuid.uuid4().hex))
    return messages
