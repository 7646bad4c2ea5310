"""Micro-batch formation: pure logic that cuts a call's jobs into per-shard messages.

A document's questions stay together in as few messages as possible, so the engine meets them
side by side and computes the document's prefix once. Messages name documents by key; the
worker reads each one from the store once per message."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from jobsvc.schema import BatchMessage, QueuedJob


def form_batches(placed: Sequence[tuple[int, QueuedJob]], batch_size: int) -> list[BatchMessage]:
    """Group (shard, job) pairs into messages of at most `batch_size` jobs per shard, jobs of
    one document adjacent, in first-seen document order."""
    by_shard: dict[int, dict[str, list[QueuedJob]]] = defaultdict(lambda: defaultdict(list))
    for shard, job in placed:
        by_shard[shard][job.document_key].append(job)
    messages: list[BatchMessage] = []
    for shard in sorted(by_shard):
        ordered = [job for jobs in by_shard[shard].values() for job in jobs]
        for start in range(0, len(ordered), batch_size):
            messages.append(BatchMessage(shard, ordered[start:start + batch_size]))
    return messages
