"""PostgreSQL (or embedded SQLite) storage: the schema and the one repository that speaks to it.

PostgreSQL is the record of every job; Redis only carries them. Writes are batched (one
executemany per table per call) and idempotent, so a job delivered twice records one result.
Documents are stored once, with their tokens: queue messages name them, workers read them here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Text,
    and_,
    any_,
    bindparam,
    case,
    create_engine,
    event,
    func,
    inspect,
    literal,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.sql.elements import ColumnElement

from jobsvc import compression
from jobsvc.errors import JobNotFound
from jobsvc.finish_signal import FinishSignal
from jobsvc.routing.job_cost import Route, loads_per_shard
from jobsvc.wire import ACTIVE_STATUSES, FINISHED_STATUSES, JobStatus, QueueMessage

log = logging.getLogger(__name__)


def utcnow() -> datetime:
    """Now, timezone-aware in UTC: every time the store writes is one."""
    return datetime.now(UTC)


class Base(DeclarativeBase):
    """The declarative base of every table, so one metadata holds the whole schema."""
    pass


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


# The longest idempotency key a producer may give (the column's width).
MAX_IDEMPOTENCY_KEY_CHARS = 128


class Job(Base):
    """One job: what it asks, where it was routed, its one queue message and how it ended; the
    record every other part defers to."""

    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    document_key: Mapped[str] = mapped_column(ForeignKey("documents.key"), index=True)
    question: Mapped[str] = mapped_column(Text)
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
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


class Result(Base):
    """A succeeded job's answer; the primary key makes a second delivery's write a no-op.
    `created_at` is when the worker wrote it, in the transaction that makes it visible."""

    __tablename__ = "results"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    answer_zst: Mapped[bytes] = mapped_column(LargeBinary)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # Why the engine ended the answer: `stop` (end of sequence or a stop string) or `length`.
    finish_reason: Mapped[str | None] = mapped_column(String(16))


class BatchStat(Base):
    """Throughput of one message on one worker, for `jobsvc stats` and benchmarks."""

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


@dataclass(frozen=True)
class JobRecord:
    """What `Client.get` returns."""

    job_id: str
    status: JobStatus
    answer: str | None
    error: str | None
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


def _load_by_shard(rows: Any) -> dict[int, int]:
    """Sum (shard, load) rows: what jobs that just finished return to their shards."""
    return loads_per_shard((shard, int(load)) for shard, load in rows)


@dataclass(frozen=True)
class MovableJob:
    """An unfinished job on a shard that is leaving, with what routing it again needs."""

    job_id: str
    document_key: str
    # The document's tokens; its text where no tokens were kept; None where neither reads back.
    document: tuple[int, ...] | str | None
    prompt_tokens: int
    max_tokens: int
    # What its current shard was charged for it.
    load: int


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

    @property
    def status(self) -> JobStatus:
        """The status the outcome records: failed if it carries an error."""
        return JobStatus.SUCCEEDED if self.error is None else JobStatus.FAILED


def _on_sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _readable_tokens(label: str, tokens_zst: bytes | None) -> tuple[int, ...] | None:
    """The tokens, or None where there are none or they do not read back (logged under
    `label`, e.g. "document <key>": the caller then uses the text instead)."""
    if tokens_zst is None:
        return None
    try:
        return compression.unpack_tokens(tokens_zst)
    except compression.TokenFrameError as error:
        log.warning("%s: %s; its text is used instead", label, error)
        return None


def _readable_text(key: str, text_zst: bytes) -> str | None:
    try:
        return compression.decompress_text(text_zst)
    except compression.TextFrameError as error:
        log.warning("document %s: %s", key, error)
        return None


# psycopg prepares a statement sent five times on a connection, and PostgreSQL may then keep
# one generic plan for it, made for the tables as they were. A worker's connections live as
# long as it does: outcome writes planned while the jobs table was nearly empty would go on
# scanning all of it as it grows. Planning at each execution costs little beside that, and
# keeps every plan fit for the table as it is.
_POSTGRESQL_OPTIONS = "-c plan_cache_mode=force_custom_plan"


def make_engine(database_url: str) -> Engine:
    """An engine for `database_url`: psycopg 3 for PostgreSQL with a plan per execution, WAL and
    foreign keys on SQLite."""
    if database_url.startswith("postgresql://"):
        database_url = "postgresql+psycopg://" + database_url.removeprefix("postgresql://")
    url = make_url(database_url)
    if url.get_backend_name() == "postgresql":
        given = url.query.get("options", ())  # kept: the URL may set options of its own
        url = url.update_query_dict({"options": " ".join(
            [*([given] if isinstance(given, str) else given), _POSTGRESQL_OPTIONS])})
    engine = create_engine(url, pool_pre_ping=True)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _on_sqlite_connect)
    return engine


# The batch API's table (`jobsvc serve`), counted for operators once the schema has it.
BATCHES_TABLE = "batches"
_FINISHED = sorted(status.value for status in FINISHED_STATUSES)


def _unfinished(status: Any) -> ColumnElement[bool]:
    """The status test of statements that pick jobs by ID. With `status IN (queued,
    running)` the planner may also walk the status index: every active entry and, until a
    vacuum, every once-active one (two per finished job), a walk that makes a claim far slower
    than the lookup by primary key alone. `NOT IN` the finished statuses, which no index
    serves, leaves the lookup by key."""
    return status.not_in(_FINISHED)


def _sent_before(moment: datetime) -> ColumnElement[bool]:
    """The job's message was sent before `moment`; one with no send time counts as sent."""
    return or_(Job.enqueued_at.is_(None), Job.enqueued_at < moment)


def _unclaimed() -> ColumnElement[bool]:
    """Queued, and no worker has claimed the job."""
    return and_(Job.worker.is_(None), Job.status == JobStatus.QUEUED.value)


# A gathering's outcomes in one statement on PostgreSQL, from arrays: the jobs still active
# take theirs, those that succeeded get their result rows, and the loads of the jobs it ended
# come back by shard (a job's load returns once, with the statement that ends it). Row by row
# (an UPDATE and an INSERT per job after a locking SELECT) costs both the recorder and the
# database far more CPU, taken from the engine's cores.
_RECORD_OUTCOMES_POSTGRESQL = text("""
WITH finished AS (
    UPDATE jobs SET status = o.status, error = o.error, finished_at = o.finished_at
    FROM unnest(CAST(:ids AS varchar[]), CAST(:statuses AS varchar[]),
                CAST(:errors AS text[]), CAST(:finished_at AS timestamptz[]))
         AS o (id, status, error, finished_at)
    WHERE jobs.id = o.id AND jobs.status <> ALL(CAST(:finished AS varchar[]))
    RETURNING jobs.id, jobs.shard, jobs.load),
answered AS (
    INSERT INTO results (job_id, answer_zst, completion_tokens, cached_tokens, finish_reason,
                         created_at)
    SELECT r.job_id, r.answer_zst, r.completion_tokens, r.cached_tokens, r.finish_reason,
           :recorded_at
    FROM unnest(CAST(:result_ids AS varchar[]), CAST(:answers AS bytea[]),
                CAST(:completion_tokens AS integer[]), CAST(:cached_tokens AS integer[]),
                CAST(:finish_reasons AS varchar[]))
         AS r (job_id, answer_zst, completion_tokens, cached_tokens, finish_reason)
    JOIN finished ON finished.id = r.job_id
    ON CONFLICT DO NOTHING)
SELECT shard, sum(load) FROM finished GROUP BY shard""")


_MARK_STARTED_POSTGRESQL = text("""
UPDATE jobs SET status = 'running', started_at = s.started_at
FROM unnest(CAST(:ids AS varchar[]), CAST(:started_at AS timestamptz[])) AS s (id, started_at)
WHERE jobs.id = s.id AND jobs.status <> ALL(CAST(:not_queued AS varchar[]))""")


def _record_outcomes_postgresql(connection: Connection, outcomes: Sequence[JobOutcome]
                                ) -> dict[int, int]:
    succeeded = [o for o in outcomes if o.error is None]
    return _load_by_shard(connection.execute(_RECORD_OUTCOMES_POSTGRESQL, {
        "ids": [o.job_id for o in outcomes],
        "statuses": [o.status.value for o in outcomes],
        "errors": [o.error for o in outcomes],
        "finished_at": [o.finished_at for o in outcomes],
        "finished": _FINISHED,
        "recorded_at": utcnow(),
        "result_ids": [o.job_id for o in succeeded],
        "answers": [compression.compress((o.answer or "").encode()) for o in succeeded],
        "completion_tokens": [o.completion_tokens for o in succeeded],
        "cached_tokens": [o.cached_tokens for o in succeeded],
        "finish_reasons": [o.finish_reason for o in succeeded],
    }))


def _copy_rows(connection: Connection, table: Any, rows: Sequence[dict[str, Any]],
               into: str | None = None) -> None:
    """Insert rows with PostgreSQL's COPY, in the connection's transaction (into the table
    `into` of the same columns, if given). One INSERT per row costs a submit far more time
    and producer CPU, all of it before the first job can run."""
    if not rows:
        return
    columns = list(rows[0])
    as_json = [isinstance(table.c[column].type, JSON) for column in columns]
    cursor = connection.connection.driver_connection.cursor()
    target = into or table.name
    with cursor, cursor.copy(f"COPY {target} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row([json.dumps(row[column]) if dumped else row[column]
                            for column, dumped in zip(columns, as_json, strict=True)])


class Store:
    """The repository: every read and write of jobs, results and statistics goes through here."""

    def __init__(self, database_url: str) -> None:
        self.engine = make_engine(database_url)
        self._dialect = postgresql if self.engine.dialect.name == "postgresql" else sqlite
        # Single-statement reads run outside a transaction: with none to open and roll back,
        # a waiting producer's check of its jobs takes 2 round trips to PostgreSQL, not 4.
        self._reads = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        # A worker's statements for every message, built once: building and keying a statement
        # cost more of its CPU than sending it.
        # Only the job's own message, on the job's own shard, claims it: a job no worker has
        # claimed, or one whose message came back because its worker stopped (`redelivered`).
        # The job stays queued until the worker admits it to its engine (`started`).
        self._claim = (
            update(Job)
            .where(self._among_listed(Job.id, "job_ids"), Job.shard == bindparam("b_shard"),
                   Job.message_id == bindparam("b_message_id"), _unfinished(Job.status),
                   or_(bindparam("redelivered", type_=Boolean),
                       and_(Job.worker.is_(None), Job.status != JobStatus.RUNNING.value)))
            # A first claim counts as an attempt; a suspect's come as it runs alone, in a
            # group of one.
            .values(worker=bindparam("worker"),
                    attempts=case((Job.worker.is_(None), Job.attempts + 1),
                                  else_=Job.attempts))
            .returning(Job.id, Job.attempts, Job.isolation, Job.document_key, Job.question,
                       Job.question_tokens_zst, Job.sampling, Job.estimated_prefill,
                       Job.submitted_at))
        self._document_tokens = select(Document.key, Document.tokens_zst).where(
            self._among_listed(Document.key, "keys"))
        self._document_texts = select(Document.key, Document.text_zst).where(
            self._among_listed(Document.key, "keys"))
        # A waiting producer's checks, also built once: building the statement anew would be a
        # large share of each check's client CPU, on cores the engines keep busy.
        self._statuses = select(Job.id, Job.status).where(self._among_listed(Job.id, "job_ids"))
        self._count_unfinished = select(func.count()).select_from(Job).where(
            self._among_listed(Job.id, "job_ids"), _unfinished(Job.status))
        # Whether the batches table was there when last looked for: once it is, it stays.
        self._has_batches = False

    def dispose(self) -> None:
        """Close every pooled connection."""
        self.engine.dispose()

    def _insert_ignoring_duplicates(self, table: Any) -> Any:
        return self._dialect.insert(table).on_conflict_do_nothing()

    def _among(self, column: Any, values: Sequence[str]) -> ColumnElement[bool]:
        """`column IN values`; on PostgreSQL as one array parameter. An IN list binds each
        value on its own, which adds to a status poll's client CPU with every job it names."""
        if self._dialect is postgresql:
            return column == any_(literal(list(values), postgresql.ARRAY(String)))
        return column.in_(list(values))

    def _lock_in_order(self, connection: Connection, job_ids: Sequence[str]) -> None:
        """Lock these unfinished jobs' rows in ID order, first thing in a transaction that
        updates several: every such transaction then waits for the others in one order, and
        none can hold a row another holds while it waits for one that other holds (a
        deadlock, which fails one of them). SQLite writes one transaction at a time."""
        if self._dialect is postgresql and job_ids:
            connection.execute(select(Job.id).where(self._among(Job.id, sorted(set(job_ids))),
                                                    _unfinished(Job.status))
                               .order_by(Job.id).with_for_update(key_share=True))

    def _among_listed(self, column: Any, name: str) -> ColumnElement[bool]:
        """`_among` for a statement built once: the list is bound as parameter `name`."""
        if self._dialect is postgresql:
            return column == any_(bindparam(name, type_=postgresql.ARRAY(String)))
        return column.in_(bindparam(name, expanding=True))

    def record_submitted(self, documents: Sequence[dict[str, Any]],
                         jobs: Sequence[dict[str, Any]]) -> dict[str, str]:
        """Record new documents (once each) and jobs in one transaction. A job whose
        `idempotency_key` another job already holds is not recorded: the result maps such a
        job's ID to the ID of the job that holds its key (committed by a concurrent submit
        since the caller looked; the unique index makes this insert wait for that one)."""
        keyed = [job for job in jobs if job.get("idempotency_key") is not None]
        unkeyed = [job for job in jobs if job.get("idempotency_key") is None]
        with self.engine.begin() as connection:
            if documents:
                connection.execute(self._insert_ignoring_duplicates(Document.__table__),
                                   list(documents))
            if self._dialect is postgresql:
                _copy_rows(connection, Job.__table__, unkeyed)
            elif unkeyed:
                connection.execute(Job.__table__.insert(), unkeyed)
            if not keyed:
                return {}
            inserted = self._insert_keyed(connection, keyed)
            lost = {job["idempotency_key"]: job["id"] for job in keyed
                    if job["id"] not in inserted}
            if not lost:
                return {}
            holders = self._jobs_by_key(connection, list(lost))
        return {job_id: holders[key] for key, job_id in lost.items()}

    def _insert_keyed(self, connection: Connection, jobs: list[dict[str, Any]]) -> set[str]:
        """Insert jobs that carry idempotency keys, skipping keys already held; returns the
        IDs inserted. On PostgreSQL by COPY into a scratch table, then one INSERT from it: a
        multi-row INSERT of a 1,000-job slice spent more time in the driver building the
        statement than the database spent running it."""
        if self._dialect is not postgresql:
            return {row.id for row in connection.execute(
                self._dialect.insert(Job.__table__)
                .on_conflict_do_nothing(index_elements=[Job.idempotency_key])
                .returning(Job.id), jobs)}
        columns = ", ".join(jobs[0])
        connection.execute(text("CREATE TEMPORARY TABLE keyed_jobs (LIKE jobs INCLUDING DEFAULTS) "
                                "ON COMMIT DROP"))
        _copy_rows(connection, Job.__table__, jobs, into="keyed_jobs")
        return set(connection.execute(text(
            f"INSERT INTO jobs ({columns}) SELECT {columns} FROM keyed_jobs "
            "ON CONFLICT (idempotency_key) DO NOTHING RETURNING id")).scalars())

    def jobs_by_key(self, keys: Sequence[str]) -> dict[str, str]:
        """The IDs of the jobs recorded under these idempotency keys, by key."""
        if not keys:
            return {}
        with self._reads.connect() as connection:
            return self._jobs_by_key(connection, keys)

    def _jobs_by_key(self, connection: Connection, keys: Sequence[str]) -> dict[str, str]:
        return dict(connection.execute(
            select(Job.idempotency_key, Job.id).where(self._among(Job.idempotency_key, keys)))
            .all())

    def claim_message(self, job_ids: Sequence[str], *, message_id: str, shard: int,
                    redelivered: bool, worker: str, max_attempts: int) -> Claim:
        """Claim for this worker the jobs that this message may run and read what they run, in
        one transaction; they come back in the order given. Jobs finished, cancelled, on
        another shard or owned by another message are left alone. A job claimed before and
        not finished is a suspect. One that has stopped its engine while running alone (in a
        group of one) `max_attempts` times ends failed instead, and so does one whose
        document reads back as neither tokens nor text (no delivery could run it). A message
        asks several questions of each document: each is read once."""
        ended: list[tuple[int, int]] = []
        with self.engine.begin() as connection:
            self._lock_in_order(connection, job_ids)
            suspects = set(connection.scalars(select(Job.id).where(
                self._among(Job.id, job_ids), Job.worker.is_not(None))))
            claimed = connection.execute(self._claim, {
                "job_ids": list(job_ids), "b_message_id": message_id, "b_shard": shard,
                "redelivered": redelivered, "worker": worker}).all()
            exhausted = [row.id for row in claimed if row.attempts > max_attempts]
            if exhausted:
                ended += self._fail(
                    connection, exhausted, f"gave up: the engine stopped each of the "
                    f"{max_attempts} times this job ran alone in it")
            # In the message's order, whatever order the database returns them in: the
            # producer put a document's questions side by side, and the engine computes the
            # document once for neighbours that reach it together.
            position = {job_id: index for index, job_id in enumerate(job_ids)}
            runnable = sorted((row for row in claimed if row.attempts <= max_attempts),
                              key=lambda row: position[row.id])
            documents = self._documents(connection, {row.document_key for row in runnable})
            for key, document in documents.items():
                if document is None:
                    ended += self._fail(
                        connection, [row.id for row in runnable if row.document_key == key],
                        f"its document {key} does not read back from the database "
                        "(neither its tokens nor its text); submit it again")
        jobs: list[ClaimedJob] = []
        for row in runnable:
            if (document := documents[row.document_key]) is None:
                continue
            tokens = _readable_tokens(f"job {row.id}'s question", row.question_tokens_zst)
            jobs.append(ClaimedJob(row.id, document, row.question if tokens is None else tokens,
                                   row.sampling, row.estimated_prefill, row.submitted_at,
                                   row.id in suspects, row.isolation))
        return Claim(jobs, _load_by_shard(ended))

    def charge_isolated(self, job_ids: Sequence[str], isolation: int) -> set[str]:
        """Raise a group of suspects to isolation level `isolation` before the group runs
        with nothing else in the engine: should the engine die now, their next delivery runs
        them in smaller groups. A group of one is charged an attempt as well: if the engine
        dies now, this job killed it. Returns the jobs charged, those not ended meanwhile."""
        solo = len(job_ids) == 1
        with self.engine.begin() as connection:
            self._lock_in_order(connection, job_ids)
            return set(connection.scalars(
                update(Job).where(self._among(Job.id, job_ids), _unfinished(Job.status))
                .values(isolation=isolation, attempts=Job.attempts + int(solo))
                .returning(Job.id)))

    def _documents(self, connection: Connection, keys: set[str]
                   ) -> dict[str, tuple[int, ...] | str | None]:
        """Each document's tokens, else its text, else None; its text only where needed."""
        if not keys:
            return {}
        documents: dict[str, tuple[int, ...] | str | None] = {}
        for key, tokens_zst in connection.execute(self._document_tokens, {"keys": list(keys)}):
            tokens = _readable_tokens(f"document {key}", tokens_zst)
            if tokens is not None:
                documents[key] = tokens
        untokenized = list(keys - documents.keys())
        if untokenized:
            for key, text_zst in connection.execute(self._document_texts,
                                                    {"keys": untokenized}):
                documents[key] = _readable_text(key, text_zst)
        return documents

    def _fail(self, connection: Connection, job_ids: Sequence[str], reason: str
              ) -> list[tuple[int, int]]:
        """End these jobs failed with `reason`, unless they have already ended; returns the
        (shard, load) of those it ended."""
        return [(row.shard, row.load) for row in connection.execute(
            update(Job).where(self._among(Job.id, job_ids), _unfinished(Job.status))
            .values(status=JobStatus.FAILED.value, finished_at=utcnow(), error=reason)
            .returning(Job.shard, Job.load))]

    def stranded_jobs(self, enqueued_before: datetime, live_messages: Sequence[str],
                      limit: int) -> dict[int, list[str]]:
        """Unfinished jobs sent before `enqueued_before` whose message is none of the live
        ones, by shard: nothing will ever run them unless they are sent again."""
        query = (
            select(Job.shard, Job.id)
            .where(Job.status.in_(ACTIVE_STATUSES), _sent_before(enqueued_before),
                   or_(Job.message_id.is_(None),
                       ~self._among(Job.message_id, list(live_messages))))
            .order_by(Job.submitted_at)
            .limit(limit))
        stranded: dict[int, list[str]] = {}
        with self._reads.connect() as connection:
            for shard, job_id in connection.execute(query):
                stranded.setdefault(shard, []).append(job_id)
        return stranded

    def jobs_on_shard(self, shard: int, *, unclaimed_only: bool,
                      enqueued_before: datetime | None, limit: int) -> list[MovableJob]:
        """Unfinished jobs on a shard that is leaving (all, or only those no worker has
        claimed), oldest first, with what routing them again needs."""
        query = select(Job.id, Job.document_key, Job.prompt_tokens, Job.sampling, Job.load).where(
            Job.shard == shard, Job.status.in_(ACTIVE_STATUSES))
        if unclaimed_only:
            query = query.where(_unclaimed())
        if enqueued_before is not None:
            query = query.where(_sent_before(enqueued_before))
        with self._reads.connect() as connection:
            rows = connection.execute(query.order_by(Job.submitted_at).limit(limit)).all()
            documents = self._documents(connection, {row.document_key for row in rows})
        return [MovableJob(row.id, row.document_key, documents.get(row.document_key),
                           row.prompt_tokens, int(row.sampling.get("max_tokens", 0)), row.load)
                for row in rows]

    def move_jobs(self, shard: int, messages: Sequence[QueueMessage],
                  routes: Mapping[str, Route], *, unclaimed_only: bool) -> set[str]:
        """Hand jobs still unfinished on `shard` (and unclaimed, if asked) to new messages on
        the shards `routes` chose, with the loads charged there; the old messages then match
        none of them. Returns the IDs of the jobs moved: a job that ended or was claimed
        meanwhile stays where it is."""
        now = utcnow()
        # Statuses spelled out: an IN list cannot be bound once per row of an executemany.
        statement = update(Job).where(
            Job.id == bindparam("b_id"), Job.shard == shard,
            or_(*(Job.status == status for status in ACTIVE_STATUSES)))
        if unclaimed_only:
            statement = statement.where(_unclaimed())
        statement = statement.values(
            shard=bindparam("b_shard"), message_id=bindparam("b_message_id"),
            estimated_prefill=bindparam("b_prefill"), load=bindparam("b_load"),
            status=JobStatus.QUEUED.value, worker=None, enqueued_at=now)
        rows = [{"b_id": job_id, "b_shard": message.shard, "b_message_id": message.message_id,
                 "b_prefill": routes[job_id].estimated_prefill, "b_load": routes[job_id].load}
                for message in messages for job_id in message.job_ids]
        if not rows:
            return set()
        with self.engine.begin() as connection:
            self._lock_in_order(connection, [row["b_id"] for row in rows])
            connection.execute(statement, rows)
            return set(connection.scalars(select(Job.id).where(self._among(
                Job.message_id, [message.message_id for message in messages]))))

    def assign_messages(self, messages: Sequence[QueueMessage]) -> None:
        """Hand unfinished jobs to new messages, which alone may run them from now on; a job
        a worker had claimed becomes queued and unclaimed again (its worker's message is
        gone)."""
        now = utcnow()
        with self.engine.begin() as connection:
            self._lock_in_order(connection, [job_id for message in messages
                                             for job_id in message.job_ids])
            for message in messages:
                connection.execute(
                    update(Job).where(self._among(Job.id, message.job_ids),
                                      Job.status.in_(ACTIVE_STATUSES))
                    .values(message_id=message.message_id, status=JobStatus.QUEUED.value,
                            worker=None, enqueued_at=now))

    def active_load(self) -> dict[int, int]:
        """What every unfinished job charged its shard, summed by shard."""
        query = (select(Job.shard, func.sum(Job.load)).where(Job.status.in_(ACTIVE_STATUSES))
                 .group_by(Job.shard))
        with self._reads.connect() as connection:
            return _load_by_shard(connection.execute(query))

    def active_counts(self) -> dict[int, dict[str, int]]:
        """Queued and running jobs by shard and status, for operators: one GROUP BY over the
        active entries of the status index, however many finished jobs the table holds."""
        query = (select(Job.shard, Job.status, func.count()).where(Job.status.in_(ACTIVE_STATUSES))
                 .group_by(Job.shard, Job.status))
        counts: dict[int, dict[str, int]] = {}
        with self._reads.connect() as connection:
            for shard, status, count in connection.execute(query):
                counts.setdefault(shard, {})[status] = int(count)
        return counts

    def batch_counts(self) -> dict[str, int] | None:
        """Batches of the batch API by status; None where the schema has no such table yet."""
        if not self._has_batches:
            if not inspect(self.engine).has_table(BATCHES_TABLE):
                return None
            self._has_batches = True
        with self._reads.connect() as connection:
            rows = connection.execute(text(f"SELECT status, count(*) FROM {BATCHES_TABLE} "
                                           "GROUP BY status"))
            return {str(status): int(count) for status, count in rows}

    def forget_submitted(self, job_ids: Sequence[str]) -> None:
        """Remove jobs recorded by a submit whose enqueue then failed."""
        with self.engine.begin() as connection:
            connection.execute(Job.__table__.delete().where(self._among(Job.id, job_ids)))

    def record_outcomes(self, outcomes: Sequence[JobOutcome],
                        batch_stats: Sequence[dict[str, Any]] = (),
                        started: Mapping[str, datetime] | None = None) -> dict[int, int]:
        """Record jobs admitted to an engine (`started`: when, by job ID) as running, then
        finished jobs and the statistics of messages that ended with them, in one transaction
        (one commit per gathering: each commit costs the database a WAL flush). Only jobs
        still queued or running take the outcome: a job already finished (an earlier
        delivery) or cancelled keeps its first ending. Returns the load of the jobs this call
        ended, by shard."""
        # A job delivered twice can end twice in one gathering: its first ending counts.
        first: dict[str, JobOutcome] = {}
        for outcome in outcomes:
            first.setdefault(outcome.job_id, outcome)
        outcomes = list(first.values())
        with self.engine.begin() as connection:
            self._lock_in_order(connection, [*(started or ()), *first])
            if started:
                self._mark_started(connection, started)
            if batch_stats:
                connection.execute(BatchStat.__table__.insert(), list(batch_stats))
            if not outcomes:
                return {}
            if self._dialect is postgresql:
                return _record_outcomes_postgresql(connection, outcomes)
            return self._record_outcomes_row_by_row(connection, outcomes)

    def _mark_started(self, connection: Connection, started: Mapping[str, datetime]) -> None:
        """Queued jobs become running: ended ones stay as they are."""
        if self._dialect is postgresql:
            connection.execute(_MARK_STARTED_POSTGRESQL, {
                "ids": list(started), "started_at": list(started.values()),
                "not_queued": [*_FINISHED, JobStatus.RUNNING.value]})
            return
        job = Job.__table__
        connection.execute(
            update(job).where(job.c.id == bindparam("b_id"),
                              job.c.status == JobStatus.QUEUED.value)
            .values(status=JobStatus.RUNNING.value, started_at=bindparam("b_started_at")),
            [{"b_id": job_id, "b_started_at": at} for job_id, at in started.items()])

    def _record_outcomes_row_by_row(self, connection: Connection,
                                    outcomes: Sequence[JobOutcome]) -> dict[int, int]:
        """For the embedded SQLite, which has no arrays (nor row locks: it writes one
        transaction at a time)."""
        job = Job.__table__
        active = {row.id: (row.shard, row.load) for row in connection.execute(
            select(job.c.id, job.c.shard, job.c.load)
            .where(self._among(job.c.id, [o.job_id for o in outcomes]),
                   _unfinished(job.c.status)))}
        outcomes = [o for o in outcomes if o.job_id in active]
        if not outcomes:
            return {}
        succeeded = [o for o in outcomes if o.error is None]
        if succeeded:
            recorded_at = utcnow()
            connection.execute(self._insert_ignoring_duplicates(Result.__table__), [
                {"job_id": o.job_id, "answer_zst": compression.compress(o.answer.encode()),
                 "completion_tokens": o.completion_tokens, "cached_tokens": o.cached_tokens,
                 "finish_reason": o.finish_reason, "created_at": recorded_at}
                for o in succeeded])
        connection.execute(
            update(job).where(job.c.id == bindparam("b_id")).values(
                status=bindparam("b_status"), error=bindparam("b_error"),
                finished_at=bindparam("b_finished_at")),
            [{"b_id": o.job_id, "b_error": o.error, "b_finished_at": o.finished_at,
              "b_status": o.status.value} for o in outcomes])
        return _load_by_shard(active[o.job_id] for o in outcomes)

    def cancel(self, job_id: str) -> dict[int, int] | None:
        """Cancel a job that has not finished; returns its load by shard (to return to the
        router), or None if it had already ended."""
        with self.engine.begin() as connection:
            ended = self._cancel(connection, [job_id])
            if ended.job_ids:
                return ended.released
            if connection.execute(select(Job.id).where(Job.id == job_id)).first() is None:
                raise JobNotFound(f"no job with ID {job_id!r}")
            return None

    def cancel_many(self, job_ids: Sequence[str]) -> Cancelled:
        """Cancel those of these jobs that have not finished, in one transaction."""
        with self.engine.begin() as connection:
            return self._cancel(connection, job_ids)

    def _cancel(self, connection: Connection, job_ids: Sequence[str]) -> Cancelled:
        self._lock_in_order(connection, job_ids)
        rows = connection.execute(
            update(Job).where(self._among(Job.id, job_ids), _unfinished(Job.status))
            .values(status=JobStatus.CANCELLED.value, finished_at=utcnow())
            .returning(Job.id, Job.shard, Job.load)).all()
        return Cancelled([row.id for row in rows],
                         _load_by_shard((row.shard, row.load) for row in rows))

    def finish_signal(self) -> FinishSignal:
        """What a waiter blocks on between checks of its jobs (see `jobsvc.finish_signal`)."""
        return FinishSignal(self.engine)

    def get_many(self, job_ids: Sequence[str]) -> dict[str, JobRecord]:
        """The jobs among `job_ids` that exist, with their answers, in one query."""
        query = (
            select(Job.id, Job.status, Job.error, Job.shard, Job.prompt_tokens, Job.submitted_at,
                   Job.started_at, Job.finished_at, Result.answer_zst, Result.completion_tokens,
                   Result.cached_tokens, Result.created_at)
            .outerjoin(Result, Result.job_id == Job.id)
            .where(self._among(Job.id, job_ids))
        )
        with self._reads.connect() as connection:
            rows = connection.execute(query).all()
        return {row.id: JobRecord(
            job_id=row.id, status=JobStatus(row.status),
            answer=(compression.decompress(row.answer_zst).decode()
                    if row.answer_zst is not None else None),
            error=row.error, shard=row.shard, prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens, cached_tokens=row.cached_tokens,
            submitted_at=row.submitted_at, started_at=row.started_at,
            finished_at=row.finished_at, recorded_at=row.created_at) for row in rows}

    def statuses(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        """Just the statuses, for polling without fetching answers."""
        with self._reads.connect() as connection:
            rows = connection.execute(self._statuses, {"job_ids": list(job_ids)}).all()
        return {job_id: JobStatus(status) for job_id, status in rows}

    def cancelled_among(self, job_ids: Sequence[str]) -> list[str]:
        """Which of these jobs were cancelled, filtered in the store: a worker checks the jobs
        it runs every few seconds, nearly none of them cancelled."""
        query = select(Job.id).where(self._among(Job.id, job_ids),
                                     Job.status == JobStatus.CANCELLED.value)
        with self._reads.connect() as connection:
            return list(connection.scalars(query))

    def count_unfinished(self, job_ids: Sequence[str]) -> int:
        """How many of these jobs have not finished: what a waiting producer checks."""
        with self._reads.connect() as connection:
            return connection.execute(self._count_unfinished,
                                      {"job_ids": list(job_ids)}).scalar_one()

    def totals(self) -> dict[str, Any]:
        """Job counts by status and token/cache totals, for summaries and `jobsvc stats`."""
        by_status = select(Job.status, func.count()).group_by(Job.status)
        # Token totals are of succeeded jobs (those with a result); the time span covers
        # every job, whatever its status.
        tokens = select(func.coalesce(func.sum(Job.prompt_tokens), 0),
                        func.coalesce(func.sum(Result.completion_tokens), 0),
                        func.coalesce(func.sum(Result.cached_tokens), 0)
                        ).join(Result, Result.job_id == Job.id)
        span = select(func.min(Job.submitted_at), func.max(Job.finished_at))
        per_shard = select(Job.shard, func.count()).group_by(Job.shard).order_by(Job.shard)
        with self.engine.connect() as connection:
            statuses = dict(connection.execute(by_status).all())
            prompt, completion, cached = connection.execute(tokens).one()
            first, last = connection.execute(span).one()
            shards = dict(connection.execute(per_shard).all())
        return {"statuses": statuses, "prompt_tokens": int(prompt),
                "completion_tokens": int(completion), "cached_tokens": int(cached),
                "first_submitted": first, "last_finished": last, "shard_jobs": shards}
