"""Micro-batch formation: pure logic that cuts a call's jobs into per-shard messages.

A document's questions stay together in as few messages as possible, so the engine meets them
side by side and computes the document's prefix once; each message carries each of its
documents' tokens once."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from jobsvc.schema import BatchMessage, QueuedJob


def form_batches(placed: Sequence[tuple[int, QueuedJob]],
                 document_tokens: Mapping[str, list[int]],
                 batch_size: int) -> list[BatchMessage]:
    """Group (shard, job) pairs into messages of at most `batch_size` jobs per shard, jobs of
    one document adjacent, in first-seen document order."""
    by_shard: dict[int, dict[str, list[QueuedJob]]] = defaultdict(lambda: defaultdict(list))
    for shard, job in placed:
        by_shard[shard][job.document_key].append(job)
    messages: list[BatchMessage] = []
    for shard in sorted(by_shard):
        ordered = [job for jobs in by_shard[shard].values() for job in jobs]
        for start in range(0, len(ordered), batch_size):
            chunk = ordered[start:start + batch_size]
            keys = dict.fromkeys(job.document_key for job in chunk)
            messages.append(BatchMessage(shard, {key: document_tokens[key] for key in keys}, chunk))
    return messages
