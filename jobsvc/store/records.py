"""The typed values that cross the job store's boundary: what producers and workers hand it
to record, what workers and waiters get back. Nothing outside the store spells a column:
these are what the others say instead. (The batch API's records sit with their stores, in
`batches` and `files`.)"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from jobsvc.choices import Choice
from jobsvc.routing.job_cost import loads_per_shard
from jobsvc.wire import JobStatus


def utcnow() -> datetime:
    """Now, timezone-aware in UTC: every time the store writes is one."""
    return datetime.now(UTC)


def load_by_shard(rows: Iterable[tuple[int, Any]]) -> dict[int, int]:
    """Sum (shard, load) rows: what jobs that just finished return to their shards."""
    return loads_per_shard((shard, int(load)) for shard, load in rows)


@dataclass(frozen=True)
class NewDocument:
    """A document a submit records (once, however many of its jobs ask about it): its text,
    and its tokens as the producer made them, which workers run."""

    key: str
    text: str
    tokens: Sequence[int]


@dataclass(frozen=True)
class NewJob:
    """A job a submit records, queued: what it asks, the shard and message routing gave it,
    and what it cost that shard."""

    job_id: str
    document_key: str
    question: str
    # The question's tokens as the producer made them.
    question_tokens: Sequence[int]
    sampling: dict[str, Any]
    # The served model or adapter it asks for.
    model: str
    shard: int
    prompt_tokens: int
    estimated_prefill: int
    # What the router charged the job's shard; returned when the job finishes.
    load: int
    # The one queue message that may run the job.
    message_id: str
    # A producer's own name for the job: a second submit of it gets this job.
    idempotency_key: str | None = None


@dataclass(frozen=True)
class MessageStats:
    """Throughput of one queue message on one worker (a row of `batch_stats`), recorded with
    its jobs' outcomes."""

    worker: str
    shard: int
    jobs: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    started_at: datetime
    finished_at: datetime
    wall_seconds: float
    requests_per_second: float
    tokens_per_second: float


@dataclass(frozen=True)
class JobRecord:
    """What `Client.get` returns."""

    job_id: str
    status: JobStatus
    answer: str | None
    error: str | None
    # The served model or adapter it asked for.
    model: str
    shard: int
    prompt_tokens: int
    completion_tokens: int | None
    cached_tokens: int | None
    submitted_at: datetime
    # When a worker admitted the job to its engine (status `running` from then on); a job a
    # worker has claimed but not yet admitted is still `queued`.
    started_at: datetime | None
    finished_at: datetime | None
    # When the answer was written: `finished_at` is the engine's end of the job, and the
    # worker records results a little later, gathered into few transactions.
    recorded_at: datetime | None = None
    # Every answer of a succeeded job, each with its log probabilities if the job asked for
    # them: one choice unless the job asked for several (`n`); empty until it succeeds.
    choices: tuple[Choice, ...] = ()
    # A succeeded embedding job's vectors, one per input in order (its answer is empty);
    # None for any other job.
    embeddings: list[list[float]] | None = None

    @property
    def finished(self) -> bool:
        """Whether the job has ended for good."""
        return self.status.finished


@dataclass(frozen=True)
class ClaimedJob:
    """A job a worker may run, as its record says. Document and question are tokens, or text
    to tokenize where the tokens do not read back."""

    job_id: str
    document: tuple[int, ...] | str
    question: tuple[int, ...] | str
    sampling: dict[str, Any]
    # The served model or adapter it asks for.
    model: str
    estimated_prefill: int
    submitted_at: datetime
    # Claimed before and never finished: the engine it ran in died, perhaps of this job, so
    # it runs in a group with nothing else in the engine, as small as `isolation` says (see
    # `charge_isolated`).
    suspect: bool = False
    isolation: int = 0


@dataclass(frozen=True)
class Claim:
    """What a claim gives the worker: the jobs to run, and the load of those it ended."""

    jobs: list[ClaimedJob]
    released: dict[int, int]


@dataclass(frozen=True)
class Cancelled:
    """Jobs a cancel ended, and their load by shard (to return to the router)."""

    job_ids: list[str]
    released: dict[int, int]


@dataclass(frozen=True)
class MovableJob:
    """An unfinished job on a shard that is leaving, with what routing it again needs."""

    job_id: str
    document_key: str
    # The document's tokens; its text where no tokens were kept; None where neither reads back.
    document: tuple[int, ...] | str | None
    prompt_tokens: int
    # Most tokens its answers may take (`job_cost.answer_tokens`).
    answer_tokens: int
    # What its current shard was charged for it.
    load: int
    # The served model or adapter it asks for: it moves only to a shard serving that.
    model: str
    # Routed by load alone, not by its prompt's blocks (an embedding job).
    by_load: bool = False


@dataclass(frozen=True)
class SentJob:
    """An unfinished job as reconciliation checks it: the one message that may run it (None:
    none yet), on its shard's queue, sent at `enqueued_at`."""

    job_id: str
    shard: int
    message_id: str | None
    enqueued_at: datetime | None
    # A worker has claimed it (or runs it): only a new message may take it from that worker.
    claimed: bool


@dataclass(frozen=True)
class JobOutcome:
    """How one job ended on a worker, as the worker hands it to the store."""

    job_id: str
    answer: str | None
    error: str | None
    completion_tokens: int
    cached_tokens: int
    finished_at: datetime
    finish_reason: str | None = None
    # Every choice, when the job asked for several or for log probabilities, or a stop string
    # or token ended its answer (else none).
    choices: tuple[Choice, ...] = ()
    # Prompt tokens the request wrote into the engine's prefix cache.
    created_cache_tokens: int | None = None
    # An embedding job's vectors, one per input in order; None for a generating job.
    embeddings: tuple[tuple[float, ...], ...] | None = None

    @property
    def status(self) -> JobStatus:
        """The status the outcome records: failed if it carries an error."""
        return JobStatus.SUCCEEDED if self.error is None else JobStatus.FAILED
