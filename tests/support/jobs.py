"""Jobs recorded straight into a store, as a submit records them, for tests of the store's
rules that need no producer."""

from __future__ import annotations

import uuid
from typing import Any

from jobsvc.store import Store, utcnow

# The message that the jobs `record_queued_job` records belong to.
TEST_MESSAGE = "test-message"


def queued_job_row(job_id: str, document_key: str, **fields: Any) -> dict[str, Any]:
    """A queued job's row as a submit records it, on shard 0, owned by TEST_MESSAGE."""
    return {"id": job_id, "document_key": document_key, "question": "q", "sampling": {},
            "shard": 0, "status": "queued", "prompt_tokens": 2, "estimated_prefill": 2,
            "load": 2, "message_id": TEST_MESSAGE, "submitted_at": utcnow(),
            "enqueued_at": utcnow(), **fields}


def record_queued_job(store: Store, **fields: Any) -> str:
    """Records a queued job on a document of its own and returns its ID."""
    job_id = uuid.uuid4().hex
    document_key = uuid.uuid4().hex
    store.record_submitted(
        [{"key": document_key, "text_zst": b"", "tokens": 1, "created_at": utcnow()}],
        [queued_job_row(job_id, document_key, **fields)])
    return job_id


def claim(store: Store, job_ids: list[str], *, redelivered: bool = False
          ) -> dict[str, tuple[int, ...] | str]:
    """Claim jobs as TEST_MESSAGE's worker on shard 0; their documents by job ID."""
    claimed = store.claim_message(job_ids, message_id=TEST_MESSAGE, shard=0,
                                redelivered=redelivered, worker="w", max_attempts=3)
    return {job.job_id: job.document for job in claimed.jobs}
