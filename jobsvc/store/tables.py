"""Every table of the schema, jobs and the batch API's alike, under one metadata: the
store's modules alone spell their columns, and Alembic (`migrations/env.py`) reads the whole
schema from here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from jobsvc.validation import MAX_IDEMPOTENCY_KEY_CHARS, MAX_MODEL_NAME_CHARS
from jobsvc.wire import ACTIVE_STATUSES

_UNFINISHED = text("status IN ({})".format(", ".join(f"'{status}'" for status in ACTIVE_STATUSES)))


class Base(DeclarativeBase):
    """The declarative base of every table, so one metadata holds the whole schema."""


class Document(Base):
    """Each distinct document once, zstd-compressed, however many jobs ask about it."""

    __tablename__ = "documents"
    key: Mapped[str] = mapped_column(String(32), primary_key=True)
    text_zst: Mapped[bytes] = mapped_column(LargeBinary)
    # The producer's tokens (compression.pack_tokens), what workers run; none on documents
    # recorded before tokens were stored, whose text workers tokenize instead.
    tokens_zst: Mapped[bytes | None] = mapped_column(LargeBinary)
    tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class Job(Base):
    """One job: what it asks, where it was routed, its one queue message and how it ended; the
    record every other part defers to."""

    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    # A document's key, written with or after it (no foreign key: migration 0017).
    document_key: Mapped[str] = mapped_column(String(32))
    question: Mapped[str] = mapped_column(Text)
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The served model (or LoRA adapter) it asks for: only a worker serving it runs the job.
    model: Mapped[str] = mapped_column(String(MAX_MODEL_NAME_CHARS))
    shard: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), index=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    estimated_prefill: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    worker: Mapped[str | None] = mapped_column(String(200))
    # Deliveries to a worker so far; a job that keeps killing its worker is given up.
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    # How far a suspect's group has been halved: each time the engine dies under its group,
    # the job runs next in groups of at most half as many (jobsvc.workers.isolation).
    isolation: Mapped[int] = mapped_column(SmallInteger, server_default="0")
    # The question's tokens as the producer made them (compression.pack_tokens); none on jobs
    # recorded before they were stored, whose question workers tokenize instead.
    question_tokens_zst: Mapped[bytes | None] = mapped_column(LargeBinary)
    # What the router charged the job's shard; returned when the job finishes.
    load: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # The one queue message (Celery task ID) that may run this job, and when it was sent.
    message_id: Mapped[str | None] = mapped_column(String(32))
    enqueued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # A producer's own name for the job (unique): submitting it again returns this job.
    idempotency_key: Mapped[str | None] = mapped_column(String(MAX_IDEMPOTENCY_KEY_CHARS),
                                                          unique=True)
    submitted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    # Reconciliation reads unfinished jobs only, by send time and by message (migration 0015).
    __table_args__ = tuple(
        Index(name, *columns, postgresql_where=_UNFINISHED, sqlite_where=_UNFINISHED)
        for name, columns in (("ix_jobs_unfinished_sent", ("enqueued_at", "id")),
                              ("ix_jobs_unfinished_message", ("message_id",))))


# Unfinished jobs by shard, model and status on PostgreSQL, as rows of changes that triggers
# on `jobs` append (migration 0016): the counts are the sums of the rows of a key. Appended,
# never updated, so no two writers of jobs wait on one counter. SQLite has no such table: there
# the jobs themselves are counted.
active_job_counts = Table(
    "active_job_counts", Base.metadata,
    Column("shard", Integer, nullable=False),
    Column("model", String(MAX_MODEL_NAME_CHARS), nullable=False),
    Column("status", String(16), nullable=False),
    Column("jobs", BigInteger, nullable=False),
    Column("load", BigInteger, nullable=False))


class Result(Base):
    """A succeeded job's answer; the primary key makes a second delivery's write a no-op.
    `created_at` is when the worker wrote it, in the transaction that makes it visible."""

    __tablename__ = "results"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    answer_zst: Mapped[bytes] = mapped_column(LargeBinary)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # Prompt tokens the request wrote into the engine's prefix cache; none on results written
    # before it was recorded.
    created_cache_tokens: Mapped[int | None] = mapped_column(Integer)
    # Why the engine ended the answer: `stop` (end of sequence or a stop string) or `length`.
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    # Every choice with its log probabilities and stop reason (jobsvc.choices), for an answer
    # that holds more than its text; `answer_zst` holds the first choice's text.
    choices_zst: Mapped[bytes | None] = mapped_column(LargeBinary)
    # An embedding job's vectors (jobsvc.embeddings.pack_vectors); its answer is empty.
    embeddings_zst: Mapped[bytes | None] = mapped_column(LargeBinary)


class BatchStat(Base):
    """Throughput of one message on one worker, for `jobsvc stats` and benchmarks (the
    table's name is kept from earlier releases: a row is one queue message)."""

    __tablename__ = "batch_stats"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"),
                                    primary_key=True, autoincrement=True)
    worker: Mapped[str] = mapped_column(String(200))
    shard: Mapped[int] = mapped_column(Integer, index=True)
    jobs: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    wall_seconds: Mapped[float] = mapped_column(Float)
    requests_per_second: Mapped[float] = mapped_column(Float)
    tokens_per_second: Mapped[float] = mapped_column(Float)


# None is SQL NULL, not the JSON value null: "has an error" is `error IS NOT NULL`.
_JSON = JSON(none_as_null=True)


class StoredFile(Base):
    """An uploaded or produced file; its bytes are its chunks, in order."""

    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    # Whatever the uploader called it: shown back, never used as a path.
    filename: Mapped[str] = mapped_column(Text)
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class FileChunk(Base):
    """One chunk of a file's bytes: files are written and read a chunk at a time, never whole."""

    __tablename__ = "file_chunks"
    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"),
                                         primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class BatchRow(Base):
    """A batch as the API shows it, plus how far its driver got and who drives it."""

    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(8))
    batch_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", _JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)
    # The end a batch in `finalizing` or `cancelling` is being taken to: completed,
    # cancelled or expired.
    ending: Mapped[str | None] = mapped_column(String(16))
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(_JSON)
    total: Mapped[int] = mapped_column(Integer, server_default="0")
    completed: Mapped[int] = mapped_column(Integer, server_default="0")
    failed: Mapped[int] = mapped_column(Integer, server_default="0")
    # The last line of the input file that has its row in batch_lines (0: none yet).
    ingested_line: Mapped[int] = mapped_column(Integer, server_default="0")
    usage: Mapped[dict[str, int] | None] = mapped_column(_JSON)
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    # The server driving the batch, and until when its claim holds unless renewed.
    driver: Mapped[str | None] = mapped_column(String(64))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class BatchLine(Base):
    """One request line of a batch: its job, or the error that kept it from becoming one."""

    __tablename__ = "batch_lines"
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"),
                                          primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(Text)
    job_id: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[dict[str, Any] | None] = mapped_column(_JSON)
    # A chat line's tool plan, for its answer to be read as tool calls at the batch's end
    # (`jobsvc.batchapi.tool_calls.stored_plan`); None: the answer is text.
    tool_plan: Mapped[dict[str, Any] | None] = mapped_column(_JSON)


_UNDELIVERED = text("delivered_at IS NULL")


class WebhookDelivery(Base):
    """One event for one webhook endpoint, kept until the endpoint acknowledges it (the outbox
    of `jobsvc.store.webhooks`)."""

    __tablename__ = "webhook_deliveries"
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"),
                                    primary_key=True, autoincrement=True)
    # The event's ID, also its `webhook-id`: the same on every attempt, for receivers to
    # deduplicate by.
    event_id: Mapped[str] = mapped_column(String(40))
    endpoint: Mapped[str] = mapped_column(Text)
    # The event exactly as every attempt sends it.
    body: Mapped[bytes] = mapped_column(LargeBinary)
    # Attempts begun so far; the next one waits longer after each refusal.
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # When the next attempt is due; while one is under way, when its lease runs out.
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Why the last attempt failed (a status code or a connection error), for operators.
    last_error: Mapped[str | None] = mapped_column(String(200))

    # An event goes to an endpoint once; senders read undelivered rows by due time only.
    __table_args__ = (
        UniqueConstraint("event_id", "endpoint", name="uq_webhook_deliveries_event_endpoint"),
        Index("ix_webhook_deliveries_due", "next_attempt_at", postgresql_where=_UNDELIVERED,
              sqlite_where=_UNDELIVERED))
