"""Jobs recorded straight into a store, as a submit records them, for tests of the store's
rules that need no producer."""

from __future__ import annotations

import uuid
from dataclasses import fields
from typing import Any

from sqlalchemy import update

from jobsvc.store import NewDocument, NewJob, Store
from jobsvc.store.tables import Job

# The message that the jobs `record_queued_job` records belong to, and the model they ask for.
TEST_MESSAGE = "test-message"
TEST_MODEL = "jobsvc"
_SUBMITTED = {field.name for field in fields(NewJob)}


def new_job(job_id: str, document_key: str, **given: Any) -> NewJob:
    """A job as a submit hands it to the store, on shard 0, owned by TEST_MESSAGE."""
    return NewJob(**{"job_id": job_id, "document_key": document_key, "question": "q",
                     "question_tokens": (2,), "sampling": {}, "model": TEST_MODEL, "shard": 0,
                     "prompt_tokens": 2, "estimated_prefill": 2, "load": 2,
                     "message_id": TEST_MESSAGE, **given})


def record_queued_job(store: Store, **given: Any) -> str:
    """Records a queued job on a document of its own and returns its ID. What a submit does
    not set (a status, timestamps, stored frames: the `jobs` columns named) is written to its
    row afterwards, as no producer would."""
    job_id = uuid.uuid4().hex
    document_key = uuid.uuid4().hex
    store.record_submitted(
        [NewDocument(document_key, "d", (1,))],
        [new_job(job_id, document_key,
                 **{name: value for name, value in given.items() if name in _SUBMITTED})])
    if columns := {name: value for name, value in given.items() if name not in _SUBMITTED}:
        with store.engine.begin() as connection:
            connection.execute(update(Job).where(Job.id == job_id).values(**columns))
    return job_id


def claim(store: Store, job_ids: list[str], *, redelivered: bool = False
          ) -> dict[str, tuple[int, ...] | str]:
    """Claim jobs as TEST_MESSAGE's worker on shard 0; their documents by job ID."""
    claimed = store.claim_message(job_ids, message_id=TEST_MESSAGE, shard=0,
                                redelivered=redelivered, worker="w", max_attempts=3,
                                models=[TEST_MODEL])
    return {job.job_id: job.document for job in claimed.jobs}
