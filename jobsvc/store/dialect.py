"""Where PostgreSQL and the embedded SQLite differ, in one place: how an engine is made, how
lists of IDs are bound, how rows are inserted (COPY or INSERT), how duplicates are skipped,
how rows are locked, and the PostgreSQL-only statements that record a gathering of outcomes
from arrays. The store's operations are written once, above a `Dialect`."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy import (
    JSON,
    Select,
    String,
    any_,
    bindparam,
    create_engine,
    event,
    exc,
    func,
    literal,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.sql.elements import ColumnElement

from jobsvc import compression
from jobsvc.choices import encode_choices
from jobsvc.embeddings import pack_vectors
from jobsvc.store.conditions import FINISHED, unfinished
from jobsvc.store.records import JobOutcome, load_by_shard, utcnow
from jobsvc.store.tables import Job, Result, active_job_counts
from jobsvc.wire import ACTIVE_STATUSES, JobStatus


def _on_sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


# psycopg prepares a statement sent five times on a connection, and PostgreSQL may then keep
# one generic plan for it, made for the tables as they were. A worker's connections live as
# long as it does: outcome writes planned while the jobs table was nearly empty would go on
# scanning all of it as it grows. Planning at each execution costs little beside that, and
# keeps every plan fit for the table as it is.
_POSTGRESQL_OPTIONS = "-c plan_cache_mode=force_custom_plan"
# A pooled connection idle this long is pinged before use. One used more lately is taken as
# it is: a ping on every checkout was a round trip and a fifth of a single submit's time. If
# the server went away in between, that one statement fails (StorageUnavailable) and the
# pool drops every connection made before the failure.
_PING_AFTER_IDLE_SECONDS = 1.0
_CHECKED_IN_AT = "jobsvc_checked_in_at"


def _on_checkin(_dbapi_connection: Any, record: Any) -> None:
    record.info[_CHECKED_IN_AT] = time.monotonic()


def _on_checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
    """Ping a connection that has idled: a dead one is replaced before any statement runs."""
    idle_since = record.info.get(_CHECKED_IN_AT)
    if idle_since is None or time.monotonic() - idle_since < _PING_AFTER_IDLE_SECONDS:
        return
    # Outside a transaction, as the pool hands connections out.
    autocommit = dbapi_connection.autocommit
    try:
        dbapi_connection.autocommit = True
        with dbapi_connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        dbapi_connection.autocommit = autocommit
    except Exception as error:
        # The pool takes this to mean: discard it and check out another.
        raise exc.DisconnectionError(str(error)) from error


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
    engine = create_engine(url)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _on_sqlite_connect)
    else:
        event.listen(engine, "checkin", _on_checkin)
        event.listen(engine, "checkout", _on_checkout)
    return engine


def dialect_of(engine: Engine) -> Dialect:
    """The dialect the store's statements take for `engine`'s database."""
    return PostgreSQL() if engine.dialect.name == "postgresql" else SQLite()


class Dialect:
    """What the store's operations ask of a database that the two databases do differently."""

    def insert_ignoring_duplicates(self, table: Any) -> Any:
        """An INSERT into `table` that skips rows whose key is already there."""
        raise NotImplementedError

    def among(self, column: Any, values: Sequence[str]) -> ColumnElement[bool]:
        """`column IN values`."""
        raise NotImplementedError

    def among_listed(self, column: Any, name: str) -> ColumnElement[bool]:
        """`among` for a statement built once: the list is bound as parameter `name`."""
        raise NotImplementedError

    def lock_in_order(self, connection: Connection, job_ids: Sequence[str]) -> None:
        """Lock these unfinished jobs' rows in ID order, first thing in a transaction that
        updates several: every such transaction then waits for the others in one order, and
        none can hold a row another holds while it waits for one that other holds (a
        deadlock, which fails one of them)."""
        raise NotImplementedError

    def insert_jobs(self, connection: Connection, rows: Sequence[dict[str, Any]]) -> None:
        """Insert job rows that carry no idempotency key."""
        raise NotImplementedError

    def insert_keyed(self, connection: Connection, rows: Sequence[dict[str, Any]]) -> set[str]:
        """Insert job rows that carry idempotency keys, skipping keys already held; returns
        the IDs inserted."""
        raise NotImplementedError

    def jobs_by_key(self, connection: Connection, keys: Sequence[str]) -> dict[str, str]:
        """The IDs of the jobs holding these idempotency keys, by key."""
        return dict(connection.execute(
            select(Job.idempotency_key, Job.id).where(self.among(Job.idempotency_key, keys)))
            .all())

    def insert_new_rows(self, connection: Connection, table: Any,
                        rows: Sequence[dict[str, Any]]) -> None:
        """Insert rows into `table`, skipping those whose key is there already."""
        if rows:
            connection.execute(self.insert_ignoring_duplicates(table), list(rows))

    def bytes_scalar(self, connection: Connection, query: Any) -> bytes | None:
        """The one value of the row `query` selects (None: no row), read for large bytes."""
        value: bytes | None = connection.execute(query).scalar_one_or_none()
        return value

    def assign_messages(self, connection: Connection, owners: Mapping[str, str],
                        now: datetime) -> None:
        """Hand each of these jobs that is unfinished to the message `owners` names for it,
        queued, unclaimed and sent at `now`."""
        raise NotImplementedError

    def records_at_once(self, jobs: int) -> bool:
        """Whether `insert_submitted` records a submit of this many jobs (none keyed)."""
        return False

    def insert_submitted(self, connection: Connection, documents: Sequence[dict[str, Any]],
                         rows: Sequence[dict[str, Any]]) -> None:
        """Insert a small submit's new documents (skipping those already there) and its
        jobs in one statement, which needs no transaction around it."""
        raise NotImplementedError

    def mark_started(self, connection: Connection, started: Mapping[str, datetime]) -> None:
        """Queued jobs become running from when they were admitted: ended ones stay as they
        are."""
        raise NotImplementedError

    def record_outcomes(self, connection: Connection, outcomes: Sequence[JobOutcome]
                        ) -> dict[int, int]:
        """Jobs still unfinished take their outcomes, the succeeded ones their results (a
        job's first ending counts); returns the load of the jobs ended, by shard."""
        raise NotImplementedError

    def active_totals(self, keys: Sequence[str], shard: int | None = None) -> Select[Any]:
        """The unfinished jobs (of one shard, or all) grouped by `keys` (of shard, model and
        status): a row per group that has any, its keys, then `jobs` (how many) and `load`
        (what they charged)."""
        raise NotImplementedError

    def fold_active_totals(self, connection: Connection) -> None:
        """Keep what `active_totals` reads to about a row per group, where it reads counts
        kept as changes."""
        raise NotImplementedError


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
                         choices_zst, created_cache_tokens, embeddings_zst, created_at)
    SELECT r.job_id, r.answer_zst, r.completion_tokens, r.cached_tokens, r.finish_reason,
           r.choices_zst, r.created_cache_tokens, r.embeddings_zst, :recorded_at
    FROM unnest(CAST(:result_ids AS varchar[]), CAST(:answers AS bytea[]),
                CAST(:completion_tokens AS integer[]), CAST(:cached_tokens AS integer[]),
                CAST(:finish_reasons AS varchar[]), CAST(:choices AS bytea[]),
                CAST(:created_cache_tokens AS integer[]), CAST(:embeddings AS bytea[]))
         AS r (job_id, answer_zst, completion_tokens, cached_tokens, finish_reason,
               choices_zst, created_cache_tokens, embeddings_zst)
    JOIN finished ON finished.id = r.job_id
    ON CONFLICT DO NOTHING)
SELECT shard, sum(load) FROM finished GROUP BY shard""")


# Jobs handed to new messages in one statement: one UPDATE per message cost a resend of a
# large backlog a statement (and its index maintenance pass) per few hundred jobs.
_ASSIGN_MESSAGES_POSTGRESQL = text("""
UPDATE jobs SET message_id = m.message_id, status = 'queued', worker = NULL, enqueued_at = :now
FROM unnest(CAST(:ids AS varchar[]), CAST(:message_ids AS varchar[])) AS m (id, message_id)
WHERE jobs.id = m.id AND jobs.status <> ALL(CAST(:finished AS varchar[]))""")
# A submit of at most this many jobs is recorded by one statement (`insert_submitted`), with
# no transaction to begin and commit around it; larger ones take COPY, cheaper per row.
_AT_ONCE_JOBS = 64
# The job columns `_INSERT_SUBMITTED_POSTGRESQL` takes as arrays, by parameter name.
_SUBMITTED_ARRAYS = (("ids", "id"), ("document_keys", "document_key"), ("questions", "question"),
                     ("question_tokens", "question_tokens_zst"), ("models", "model"),
                     ("shards", "shard"), ("prompt_tokens", "prompt_tokens"),
                     ("prefills", "estimated_prefill"), ("loads", "load"),
                     ("message_ids", "message_id"))
# Sent by the driver itself: through SQLAlchemy, binding its arrays cost a single submit
# more of the producer's CPU than the database spent on it.
_INSERT_SUBMITTED_POSTGRESQL = """
WITH new_documents AS (
    INSERT INTO documents (key, text_zst, tokens_zst, tokens, created_at)
    SELECT d.key, d.text_zst, d.tokens_zst, d.tokens, %(now)s
    FROM unnest(CAST(%(keys)s AS varchar[]), CAST(%(texts)s AS bytea[]),
                CAST(%(document_tokens)s AS bytea[]), CAST(%(token_counts)s AS integer[]))
         AS d (key, text_zst, tokens_zst, tokens)
    ON CONFLICT DO NOTHING)
INSERT INTO jobs (id, document_key, question, question_tokens_zst, sampling, model, shard,
                  status, prompt_tokens, estimated_prefill, load, message_id, submitted_at,
                  enqueued_at)
SELECT j.id, j.document_key, j.question, j.question_tokens_zst, j.sampling, j.model, j.shard,
       'queued', j.prompt_tokens, j.estimated_prefill, j.load, j.message_id, %(now)s, %(now)s
FROM unnest(CAST(%(ids)s AS varchar[]), CAST(%(document_keys)s AS varchar[]),
            CAST(%(questions)s AS text[]), CAST(%(question_tokens)s AS bytea[]),
            CAST(%(samplings)s AS json[]), CAST(%(models)s AS varchar[]),
            CAST(%(shards)s AS integer[]), CAST(%(prompt_tokens)s AS integer[]),
            CAST(%(prefills)s AS integer[]), CAST(%(loads)s AS bigint[]),
            CAST(%(message_ids)s AS varchar[]))
     AS j (id, document_key, question, question_tokens_zst, sampling, model, shard,
           prompt_tokens, estimated_prefill, load, message_id)"""


_MARK_STARTED_POSTGRESQL = text("""
UPDATE jobs SET status = 'running', started_at = s.started_at
FROM unnest(CAST(:ids AS varchar[]), CAST(:started_at AS timestamptz[])) AS s (id, started_at)
WHERE jobs.id = s.id AND jobs.status <> ALL(CAST(:not_queued AS varchar[]))""")


def _copy_rows(connection: Connection, table: Any, rows: Sequence[dict[str, Any]],
               into: str | None = None) -> None:
    """Insert rows with PostgreSQL's COPY, in the connection's transaction (into the table
    `into` of the same columns, if given). One INSERT per row costs a submit far more time
    and producer CPU, all of it before the first job can run."""
    if not rows:
        return
    columns = list(rows[0])
    types = [table.c[column].type for column in columns]
    as_json = [isinstance(kind, JSON) for kind in types]
    # A JSON column that keeps None as SQL NULL, as an INSERT through its type would.
    null_json = [dumped and kind.none_as_null for kind, dumped in zip(types, as_json,
                                                                      strict=True)]
    cursor = connection.connection.driver_connection.cursor()
    target = into or table.name
    with cursor, cursor.copy(f"COPY {target} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row([
                None if value is None and null else json.dumps(value) if dumped else value
                for value, dumped, null in zip((row[column] for column in columns), as_json,
                                               null_json, strict=True)])


_JOBS_BY_KEY_POSTGRESQL = text("""
SELECT k.key, (SELECT id FROM jobs WHERE idempotency_key = k.key)
FROM unnest(CAST(:keys AS varchar[])) AS k (key)""")


def _copied_if_new(connection: Connection, table: Any, rows: Sequence[dict[str, Any]]) -> bool:
    """COPY rows into `table` in a savepoint: True if all went in, False (none did) if a row's
    unique key is there already, for the caller to insert skipping those. A first submit
    meets no such row, and COPY is the cheapest insert PostgreSQL has."""
    savepoint = connection.begin_nested()
    try:
        _copy_rows(connection, table, rows)
    except psycopg.errors.UniqueViolation:
        savepoint.rollback()
        return False
    savepoint.commit()
    return True


# The changes of `active_job_counts` replaced by their sums, a row per key, in one statement:
# a key whose sums are nothing leaves no row. Rows appended meanwhile by writers of jobs stay
# as they are, for the next fold, and a fold running at once finds the rows this one took gone.
_FOLD_ACTIVE_COUNTS_POSTGRESQL = text("""
WITH gone AS (DELETE FROM active_job_counts RETURNING shard, model, status, jobs, load)
INSERT INTO active_job_counts (shard, model, status, jobs, load)
SELECT shard, model, status, sum(jobs), sum(load) FROM gone GROUP BY shard, model, status
HAVING sum(jobs) <> 0 OR sum(load) <> 0""")


class PostgreSQL(Dialect):
    """The record of every job: arrays, COPY and row locks."""

    def insert_ignoring_duplicates(self, table: Any) -> Any:
        return postgresql.insert(table).on_conflict_do_nothing()

    def among(self, column: Any, values: Sequence[str]) -> ColumnElement[bool]:
        # One array parameter: an IN list binds each value on its own, which adds to a status
        # poll's client CPU with every job it names.
        return column == any_(literal(list(values), postgresql.ARRAY(String)))

    def among_listed(self, column: Any, name: str) -> ColumnElement[bool]:
        return column == any_(bindparam(name, type_=postgresql.ARRAY(String)))

    def lock_in_order(self, connection: Connection, job_ids: Sequence[str]) -> None:
        if job_ids:
            connection.execute(select(Job.id).where(self.among(Job.id, sorted(set(job_ids))),
                                                    unfinished(Job.status))
                               .order_by(Job.id).with_for_update(key_share=True))

    def insert_jobs(self, connection: Connection, rows: Sequence[dict[str, Any]]) -> None:
        _copy_rows(connection, Job.__table__, rows)

    def jobs_by_key(self, connection: Connection, keys: Sequence[str]) -> dict[str, str]:
        # A lookup of the unique index per key: with `= ANY` over many keys the planner
        # may scan the whole table instead, as it grows.
        return {key: job_id for key, job_id in connection.execute(_JOBS_BY_KEY_POSTGRESQL,
                                                                  {"keys": list(keys)})
                if job_id is not None}

    def insert_new_rows(self, connection: Connection, table: Any,
                        rows: Sequence[dict[str, Any]]) -> None:
        if rows and not _copied_if_new(connection, table, rows):
            super().insert_new_rows(connection, table, rows)

    def bytes_scalar(self, connection: Connection, query: Any) -> bytes | None:
        # In binary: as text, bytea comes as hex, twice its size, written and parsed a byte
        # at a time.
        compiled = query.compile(dialect=connection.dialect)
        with connection.connection.driver_connection.cursor(binary=True) as cursor:
            row = cursor.execute(str(compiled), compiled.params).fetchone()
        return None if row is None else bytes(row[0])

    def insert_keyed(self, connection: Connection, rows: Sequence[dict[str, Any]]) -> set[str]:
        if _copied_if_new(connection, Job.__table__, rows):
            return {row["id"] for row in rows}
        # Some key is held: COPY into a scratch table, then one INSERT from it that skips
        # those (a multi-row INSERT of a 1,000-job slice spent more time in the driver
        # building the statement than the database spent running it).
        columns = ", ".join(rows[0])
        connection.execute(text("CREATE TEMPORARY TABLE keyed_jobs (LIKE jobs INCLUDING DEFAULTS) "
                                "ON COMMIT DROP"))
        _copy_rows(connection, Job.__table__, rows, into="keyed_jobs")
        return set(connection.execute(text(
            f"INSERT INTO jobs ({columns}) SELECT {columns} FROM keyed_jobs "
            "ON CONFLICT (idempotency_key) DO NOTHING RETURNING id")).scalars())

    def assign_messages(self, connection: Connection, owners: Mapping[str, str],
                        now: datetime) -> None:
        connection.execute(_ASSIGN_MESSAGES_POSTGRESQL, {
            "ids": list(owners), "message_ids": list(owners.values()), "now": now,
            "finished": FINISHED})

    def records_at_once(self, jobs: int) -> bool:
        return jobs <= _AT_ONCE_JOBS

    def insert_submitted(self, connection: Connection, documents: Sequence[dict[str, Any]],
                         rows: Sequence[dict[str, Any]]) -> None:
        now = rows[0]["submitted_at"]
        connection.connection.driver_connection.execute(_INSERT_SUBMITTED_POSTGRESQL, {
            "keys": [row["key"] for row in documents],
            "texts": [row["text_zst"] for row in documents],
            "document_tokens": [row["tokens_zst"] for row in documents],
            "token_counts": [row["tokens"] for row in documents],
            "now": now,
            **{name: [row[column] for row in rows] for name, column in _SUBMITTED_ARRAYS},
            "samplings": [json.dumps(row["sampling"]) for row in rows]})

    def mark_started(self, connection: Connection, started: Mapping[str, datetime]) -> None:
        connection.execute(_MARK_STARTED_POSTGRESQL, {
            "ids": list(started), "started_at": list(started.values()),
            "not_queued": [*FINISHED, JobStatus.RUNNING.value]})

    def record_outcomes(self, connection: Connection, outcomes: Sequence[JobOutcome]
                        ) -> dict[int, int]:
        succeeded = [o for o in outcomes if o.error is None]
        return load_by_shard(connection.execute(_RECORD_OUTCOMES_POSTGRESQL, {
            "ids": [o.job_id for o in outcomes],
            "statuses": [o.status.value for o in outcomes],
            "errors": [o.error for o in outcomes],
            "finished_at": [o.finished_at for o in outcomes],
            "finished": FINISHED,
            "recorded_at": utcnow(),
            "result_ids": [o.job_id for o in succeeded],
            "answers": [compression.compress((o.answer or "").encode()) for o in succeeded],
            "completion_tokens": [o.completion_tokens for o in succeeded],
            "cached_tokens": [o.cached_tokens for o in succeeded],
            "finish_reasons": [o.finish_reason for o in succeeded],
            "choices": [_choices_frame(o) for o in succeeded],
            "created_cache_tokens": [o.created_cache_tokens for o in succeeded],
            "embeddings": [_embeddings_frame(o) for o in succeeded],
        }))

    def active_totals(self, keys: Sequence[str], shard: int | None = None) -> Select[Any]:
        # The sums of the triggers' rows of changes (migration 0016): a read of about a row
        # per key once folded, however many jobs are unfinished.
        counts = active_job_counts.c
        groups = [counts[key] for key in keys]
        query = (select(*groups, func.sum(counts.jobs).label("jobs"),
                        func.sum(counts.load).label("load"))
                 .group_by(*groups).having(func.sum(counts.jobs) != 0))
        return query if shard is None else query.where(counts.shard == shard)

    def fold_active_totals(self, connection: Connection) -> None:
        connection.execute(_FOLD_ACTIVE_COUNTS_POSTGRESQL)


class SQLite(Dialect):
    """The one-machine demo's file: no arrays, and no row locks (it writes one transaction at
    a time)."""

    def insert_ignoring_duplicates(self, table: Any) -> Any:
        return sqlite.insert(table).on_conflict_do_nothing()

    def among(self, column: Any, values: Sequence[str]) -> ColumnElement[bool]:
        return column.in_(list(values))

    def among_listed(self, column: Any, name: str) -> ColumnElement[bool]:
        return column.in_(bindparam(name, expanding=True))

    def lock_in_order(self, connection: Connection, job_ids: Sequence[str]) -> None:
        pass

    def assign_messages(self, connection: Connection, owners: Mapping[str, str],
                        now: datetime) -> None:
        by_message: dict[str, list[str]] = {}
        for job_id, message_id in owners.items():
            by_message.setdefault(message_id, []).append(job_id)
        for message_id, job_ids in by_message.items():
            connection.execute(
                update(Job).where(Job.id.in_(job_ids), unfinished(Job.status))
                .values(message_id=message_id, status=JobStatus.QUEUED.value, worker=None,
                        enqueued_at=now))

    def insert_jobs(self, connection: Connection, rows: Sequence[dict[str, Any]]) -> None:
        if rows:
            connection.execute(Job.__table__.insert(), list(rows))

    def insert_keyed(self, connection: Connection, rows: Sequence[dict[str, Any]]) -> set[str]:
        return {row.id for row in connection.execute(
            sqlite.insert(Job.__table__)
            .on_conflict_do_nothing(index_elements=[Job.idempotency_key])
            .returning(Job.id), list(rows))}

    def mark_started(self, connection: Connection, started: Mapping[str, datetime]) -> None:
        job = Job.__table__
        connection.execute(
            update(job).where(job.c.id == bindparam("b_id"),
                              job.c.status == JobStatus.QUEUED.value)
            .values(status=JobStatus.RUNNING.value, started_at=bindparam("b_started_at")),
            [{"b_id": job_id, "b_started_at": at} for job_id, at in started.items()])

    def record_outcomes(self, connection: Connection, outcomes: Sequence[JobOutcome]
                        ) -> dict[int, int]:
        # Row by row: the jobs still active, then their results and their endings.
        job = Job.__table__
        active = {row.id: (row.shard, row.load) for row in connection.execute(
            select(job.c.id, job.c.shard, job.c.load)
            .where(self.among(job.c.id, [o.job_id for o in outcomes]),
                   unfinished(job.c.status)))}
        outcomes = [o for o in outcomes if o.job_id in active]
        if not outcomes:
            return {}
        succeeded = [o for o in outcomes if o.error is None]
        if succeeded:
            recorded_at = utcnow()
            connection.execute(self.insert_ignoring_duplicates(Result.__table__), [
                {"job_id": o.job_id, "answer_zst": compression.compress(o.answer.encode()),
                 "completion_tokens": o.completion_tokens, "cached_tokens": o.cached_tokens,
                 "finish_reason": o.finish_reason, "choices_zst": _choices_frame(o),
                 "created_cache_tokens": o.created_cache_tokens,
                 "embeddings_zst": _embeddings_frame(o), "created_at": recorded_at}
                for o in succeeded])
        connection.execute(
            update(job).where(job.c.id == bindparam("b_id")).values(
                status=bindparam("b_status"), error=bindparam("b_error"),
                finished_at=bindparam("b_finished_at")),
            [{"b_id": o.job_id, "b_error": o.error, "b_finished_at": o.finished_at,
              "b_status": o.status.value} for o in outcomes])
        return load_by_shard(active[o.job_id] for o in outcomes)

    def active_totals(self, keys: Sequence[str], shard: int | None = None) -> Select[Any]:
        # The unfinished jobs themselves, through the status index.
        groups = [Job.__table__.c[key] for key in keys]
        query = (select(*groups, func.count().label("jobs"), func.sum(Job.load).label("load"))
                 .where(Job.status.in_(ACTIVE_STATUSES)).group_by(*groups))
        return query if shard is None else query.where(Job.shard == shard)

    def fold_active_totals(self, connection: Connection) -> None:
        pass


def _choices_frame(outcome: JobOutcome) -> bytes | None:
    """What a result stores of its choices: a frame only for an answer that holds more than
    its text (`JobOutcome.choices`)."""
    return encode_choices(outcome.choices) if outcome.choices else None


def _embeddings_frame(outcome: JobOutcome) -> bytes | None:
    """What a result stores of an embedding job's vectors (none for a generating job)."""
    return None if outcome.embeddings is None else pack_vectors(outcome.embeddings)
