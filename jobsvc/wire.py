"""What crosses between producers and workers: the job statuses every process reads and
writes in the store, and the versioned queue message a producer publishes to a shard.

Pure: plain values in, plain values (or MessageError) out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

MESSAGE_VERSION = 3


class JobStatus(StrEnum):
    """A job's status as the store records it: one vocabulary for producers, workers, operators."""

    QUEUED = "queued"  # recorded and enqueued (perhaps claimed), not yet admitted to an engine
    RUNNING = "running"  # admitted to a worker's engine (shown within a second of it)
    SUCCEEDED = "succeeded"  # answer recorded
    FAILED = "failed"  # ended with a recorded error
    CANCELLED = "cancelled"  # cancelled by the user before it finished

    @property
    def finished(self) -> bool:
        """Whether the job has ended for good (nothing will change it again)."""
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
# The unfinished statuses' values, in the order a job passes through them.
ACTIVE_STATUSES = tuple(status.value for status in JobStatus if not status.finished)


class MessageError(ValueError):
    """A queue message that is not one of ours; the worker refuses it and carries on."""


# A message names at most this many jobs; the producer's JOBSVC_BATCH_SIZE is far below it.
MAX_MESSAGE_JOBS = 100_000


@dataclass(frozen=True)
class QueueMessage:
    """One queue message for one shard: only the IDs of its jobs. Everything that decides a
    job's answer (document, question, sampling) and what it charged its shard is read from the
    job's record, so a message can point a worker at work but never change it. The message's
    own ID (the Celery task ID) is recorded with each job it carries: only that message may
    run them, so copies, forgeries and messages superseded by a requeue run nothing."""

    shard: int
    job_ids: list[str]
    message_id: str

    def to_wire(self) -> dict[str, Any]:
        """The message as the versioned JSON body a shard queue carries."""
        return {"v": MESSAGE_VERSION, "shard": self.shard, "jobs": self.job_ids}

    @classmethod
    def from_wire(cls, data: Any, message_id: str) -> QueueMessage:
        """Rebuild a message, refusing anything that is not exactly our schema."""
        if not isinstance(data, dict) or data.get("v") != MESSAGE_VERSION:
            raise MessageError(f"not a version-{MESSAGE_VERSION} jobsvc message")
        shard, jobs = data.get("shard"), data.get("jobs")
        if not _is_int(shard) or not isinstance(jobs, list) or len(jobs) > MAX_MESSAGE_JOBS:
            raise MessageError(f"a message needs an integer shard and a list of at most "
                               f"{MAX_MESSAGE_JOBS} job IDs")
        if not all(isinstance(job_id, str) and 0 < len(job_id) <= 64 for job_id in jobs):
            raise MessageError("a message's job IDs must be strings of 1 to 64 characters")
        return cls(shard, jobs, message_id)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
