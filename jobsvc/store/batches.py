"""Batches and their request lines in PostgreSQL: what the API shows, and what the driver
needs to take a batch to its end after any restart.

Who drives a batch is a lease on its row (`driver`, `lease_until`) rather than an advisory
lock: a lease holds through a connection pool and a dropped connection alike (a blip in the
network does not hand a batch to another server mid-step), it shows in the table which server
drives what, and it works on the embedded SQLite too. Every write of the driver is fenced by
its lease: it changes the row only while the row still names that driver, so a server that
stalled past its lease learns it (LeaseLost) instead of writing over its successor."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import case, func, insert, or_, select, update
from sqlalchemy.engine import Connection, Engine

from jobsvc import compression
from jobsvc.choices import Choice, stored_choices
from jobsvc.embeddings import unpack_vectors
from jobsvc.store.dialect import dialect_of
from jobsvc.store.paging import page_rows
from jobsvc.store.records import utcnow
from jobsvc.store.tables import BatchLine, BatchRow, Job, Result
from jobsvc.store.webhooks import add_deliveries
from jobsvc.webhooks import batch_event
from jobsvc.wire import ACTIVE_STATUSES, JobStatus

# The one completion window a batch may ask for (OpenAI's).
COMPLETION_WINDOW = "24h"
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
# A cancel takes a batch in these states to `cancelling`; later ones are past cancelling.
CANCELLABLE = ("validating", "in_progress")
# The stamp of each final state.
_FINAL_STAMP = {"completed": "completed_at", "cancelled": "cancelled_at",
                "expired": "expired_at", "failed": "failed_at"}
# Lines read per query for the output files: a page holds each line's answer and, for an
# answer with several choices or log probabilities, its compressed choices.
_OUTPUT_PAGE = 256


class LeaseLost(RuntimeError):
    """Another server drives this batch now; this one must stop touching it."""


class BatchChanged(RuntimeError):
    """The batch left the state a step started from (a cancel came in); the next step sees
    the new one."""


@dataclass(frozen=True)
class BatchRecord:
    """A batch row as the API and the driver read it: plain values, so nothing outside this module
    spells a column."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    status: str
    ending: str | None
    errors: list[dict[str, Any]] | None
    total: int
    completed: int
    failed: int
    ingested_line: int
    usage: dict[str, int] | None
    output_file_id: str | None
    error_file_id: str | None
    created_at: datetime
    expires_at: datetime | None
    in_progress_at: datetime | None
    finalizing_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None


_FIELDS = [field.name for field in fields(BatchRecord)]
_COLUMNS = [BatchRow.__table__.c[name] for name in _FIELDS]


def _record(row: Any) -> BatchRecord:
    """A batch from a row of the batches table (its columns, by name)."""
    return BatchRecord(**{name: row._mapping[name] for name in _FIELDS})


@dataclass(frozen=True)
class LineOutcome:
    """A line's row in batch_lines: its job, or the 400 that kept it from having one."""

    line: int
    custom_id: str
    job_id: str | None
    error: dict[str, Any] | None
    # How the answer is read as tool calls, as the line's request planned it; None: as text.
    tool_plan: dict[str, Any] | None = None


@dataclass(frozen=True)
class Tally:
    """Where a batch's lines stand, and the tokens of those that succeeded."""

    lines: int
    succeeded: int
    failed: int
    unfinished: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int

    def usage(self) -> dict[str, Any]:
        """The tally's tokens as a batch object's `usage` (no reasoning tokens)."""
        return {"input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens}


@dataclass(frozen=True)
class OutputRow:
    """A line with what its job came to, for the output and error files."""

    line: int
    custom_id: str
    job_id: str | None
    error: dict[str, Any] | None
    status: str | None
    job_error: str | None
    prompt_tokens: int | None
    # The job's token limit (0 for a line without a job).
    max_tokens: int
    finished_at: datetime | None
    # The answer's text, once the job has a result.
    answer: str | None
    completion_tokens: int | None
    cached_tokens: int | None
    finish_reason: str | None
    # The job's sampling as stored (what it asked for: choices, log probabilities).
    sampling: dict[str, Any]
    # The answer's choices as stored (`jobsvc.choices`; None: its text is the one choice), read
    # one line at a time as the line is written (`choices`).
    choices_frame: bytes | None
    # The line's tool plan as stored; None: the answer is text.
    tool_plan: dict[str, Any] | None = None
    # Prompt tokens the request wrote into the engine's prefix cache, once recorded.
    created_cache_tokens: int | None = None
    # An embedding line's vectors as stored (`jobsvc.embeddings`), read one line at a time
    # as the line is written (`embeddings`); None for any other line.
    embeddings_frame: bytes | None = None
    # The model or adapter the line's job asked for; None for a line without a job.
    model: str | None = None

    def embeddings(self) -> list[list[float]] | None:
        """An embedding answer's vectors, one per input; None for any other line."""
        return None if self.embeddings_frame is None else unpack_vectors(self.embeddings_frame)

    def choices(self) -> tuple[Choice, ...]:
        """Every choice of the answer (one, unless it holds more); empty without an answer.
        Decoded on each call: a page keeps its lines' choices compressed."""
        if self.answer is None:
            return ()
        return stored_choices(self.answer, self.finish_reason, self.completion_tokens or 0,
                              self.choices_frame)


class BatchStore:
    """Every read and write of the batches and their lines, in one place, each driver write fenced
    by its lease."""

    def __init__(self, engine: Engine, webhook_endpoints: Sequence[str] = ()) -> None:
        """`webhook_endpoints`: where each batch's end is announced (its driver's settings)."""
        self._engine = engine
        self._sql = dialect_of(engine)
        self._webhook_endpoints = tuple(webhook_endpoints)

    def create(self, *, endpoint: str, input_file_id: str, completion_window: str,
               metadata: dict[str, str] | None, window_seconds: int) -> BatchRecord:
        """A new `validating` batch, expiring in `window_seconds`; the driver takes it on."""
        now = utcnow()
        with self._engine.begin() as connection:
            row = connection.execute(insert(BatchRow).values(
                id=f"batch_{uuid.uuid4().hex}", endpoint=endpoint, input_file_id=input_file_id,
                completion_window=completion_window, batch_metadata=metadata,
                status="validating", total=0, completed=0, failed=0, ingested_line=0,
                created_at=now, expires_at=now + timedelta(seconds=window_seconds))
                .returning(*_COLUMNS)).one()
            return _record(row)

    def get(self, batch_id: str) -> BatchRecord | None:
        """The batch `batch_id` as it stands; None: no such batch."""
        with self._engine.connect() as connection:
            row = connection.execute(select(*_COLUMNS).where(BatchRow.id == batch_id)).first()
        return None if row is None else _record(row)

    def page(self, *, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """Up to `limit` batches, newest first, after the batch `after`; and whether more
        follow."""
        with self._engine.connect() as connection:
            rows, more = page_rows(connection, select(*_COLUMNS), BatchRow.created_at,
                                   BatchRow.id, after=after, limit=limit, ascending=False)
        return [_record(row) for row in rows], more

    def unfinished_reading(self, file_id: str) -> str | None:
        """An unfinished batch whose input is `file_id`, if there is one."""
        with self._engine.connect() as connection:
            return connection.execute(
                select(BatchRow.id).where(BatchRow.input_file_id == file_id,
                                          BatchRow.status.in_(UNFINISHED))
                .order_by(BatchRow.created_at).limit(1)).scalar_one_or_none()

    def request_cancel(self, batch_id: str) -> BatchRecord | None:
        """Mark a validating or running batch `cancelling` (its driver does the rest); a
        batch past that is left as it is. None: no such batch."""
        with self._engine.begin() as connection:
            connection.execute(
                update(BatchRow).where(BatchRow.id == batch_id,
                                       BatchRow.status.in_(CANCELLABLE))
                .values(status="cancelling", ending="cancelled", cancelling_at=utcnow()))
            row = connection.execute(select(*_COLUMNS).where(BatchRow.id == batch_id)).first()
        return None if row is None else _record(row)

    def claim(self, driver: str, lease_seconds: int, only: str | None = None
              ) -> list[BatchRecord]:
        """Take (or keep) the lease of every unfinished batch no other live server holds
        (of batch `only`, if given)."""
        now = utcnow()
        query = update(BatchRow).where(
            BatchRow.status.in_(UNFINISHED),
            or_(BatchRow.driver.is_(None), BatchRow.driver == driver,
                BatchRow.lease_until < now))
        if only is not None:
            query = query.where(BatchRow.id == only)
        with self._engine.begin() as connection:
            rows = connection.execute(
                query
                .values(driver=driver, lease_until=now + timedelta(seconds=lease_seconds))
                .returning(*_COLUMNS)).all()
            return sorted((_record(row) for row in rows), key=lambda batch: batch.created_at)

    def release(self, driver: str) -> None:
        """Give up every lease of this driver (a server stopping), so another takes over at
        once."""
        with self._engine.begin() as connection:
            connection.execute(update(BatchRow).where(BatchRow.driver == driver)
                               .values(driver=None, lease_until=None))

    def renew(self, batch_id: str, holder: str, lease_seconds: int) -> None:
        """Renew the lease `holder` has of the batch; LeaseLost if it no longer holds it."""
        self._change(batch_id, holder, lease_seconds)

    def start(self, batch_id: str, holder: str, lease_seconds: int, total: int) -> None:
        """A validated batch of `total` requests goes `in_progress`."""
        self._change(batch_id, holder, lease_seconds, status_was="validating",
                     status="in_progress", in_progress_at=utcnow(), total=total)

    def refuse(self, batch_id: str, holder: str, lease_seconds: int,
               errors: list[dict[str, Any]]) -> None:
        """A batch whose file failed validation ends `failed`, with the file's errors."""
        self._change(batch_id, holder, lease_seconds, status_was="validating",
                     status="failed", failed_at=utcnow(), errors=errors, driver=None)

    def follow(self, batch_id: str, holder: str, lease_seconds: int, tally: Tally, *,
               finalize: bool) -> None:
        """Bring a running batch's request counts and usage up to `tally`; with `finalize`
        (every line has ended), the batch goes `finalizing` to be completed."""
        ending = ({"status": "finalizing", "ending": "completed", "finalizing_at": utcnow()}
                  if finalize else {})
        self._change(batch_id, holder, lease_seconds, status_was="in_progress",
                     completed=tally.succeeded, failed=tally.failed, usage=tally.usage(),
                     **ending)

    def expire(self, batch_id: str, holder: str, lease_seconds: int) -> None:
        """A running batch whose window has passed goes `finalizing`, to be expired."""
        self._change(batch_id, holder, lease_seconds, status_was="in_progress",
                     status="finalizing", ending="expired", finalizing_at=utcnow())

    def end(self, batch_id: str, holder: str, lease_seconds: int, ending: str, *,
            tally: Tally | None = None, failed: int = 0,
            errors: list[dict[str, Any]] | None = None, output_file_id: str | None = None,
            error_file_id: str | None = None, connection: Connection | None = None) -> None:
        """Put a batch in its final state `ending` (completed, cancelled, expired or failed)
        and give up its lease; with `tally`, its final counts and usage (`failed` lines that
        did not succeed). Inside `connection`'s transaction if one is given, so the output
        files commit with the state."""
        values: dict[str, Any] = {"status": ending, "driver": None,
                                  _FINAL_STAMP[ending]: utcnow()}
        if tally is not None:
            values.update(completed=tally.succeeded, failed=failed, usage=tally.usage())
        if errors is not None:
            values["errors"] = errors
        if output_file_id is not None:
            values["output_file_id"] = output_file_id
        if error_file_id is not None:
            values["error_file_id"] = error_file_id
        self._change(batch_id, holder, lease_seconds, connection=connection, **values)

    def _change(self, batch_id: str, holder: str, lease_seconds: int, *,
                status_was: str | None = None, connection: Connection | None = None,
                **values: Any) -> None:
        """Change a batch that `holder` drives, renewing its lease; LeaseLost if it no longer
        holds it. With `status_was`, only while the batch is still in that state (a cancel
        may have come in meanwhile): BatchChanged otherwise."""
        if connection is None:
            with self._engine.begin() as own:
                self._change(batch_id, holder, lease_seconds, status_was=status_was,
                             connection=own, **values)
            return
        held = connection.execute(
            update(BatchRow).where(BatchRow.id == batch_id, BatchRow.driver == holder)
            .values(lease_until=utcnow() + timedelta(seconds=lease_seconds))
            .returning(BatchRow.status)).scalar_one_or_none()
        if held is None:
            raise LeaseLost(f"batch {batch_id} is no longer driven by {holder}")
        if status_was is not None and held != status_was:
            raise BatchChanged(f"batch {batch_id} is {held} now, no longer {status_was}")
        if values:
            connection.execute(update(BatchRow).where(BatchRow.id == batch_id).values(**values))
        if self._webhook_endpoints and (ending := values.get("status")) in _FINAL_STAMP:
            # Every final state is set here: its webhooks commit with it, or neither does.
            event_id, body = batch_event(batch_id, ending, values[_FINAL_STAMP[ending]])
            add_deliveries(connection, event_id, body, self._webhook_endpoints)

    def record_lines(self, batch_id: str, driver: str, lease_seconds: int,
                     outcomes: Sequence[LineOutcome], last_line: int) -> None:
        """Record a slice's lines and the progress they make, together; a line recorded
        before keeps its first row."""
        with self._engine.begin() as connection:
            self._change(batch_id, driver, lease_seconds, connection=connection,
                         ingested_line=last_line)
            self._sql.insert_new_rows(connection, BatchLine.__table__, [
                {"batch_id": batch_id, "line": outcome.line, "custom_id": outcome.custom_id,
                 "job_id": outcome.job_id, "error": outcome.error,
                 "tool_plan": outcome.tool_plan}
                for outcome in outcomes])

    def tally(self, batch_id: str) -> Tally:
        """Where the batch's lines stand, counted from its jobs in one query: the counts and usage
        the API shows come from the rows, never from a counter that could drift."""
        status = Job.status
        finished_badly = status.in_([JobStatus.FAILED.value, JobStatus.CANCELLED.value])
        succeeded = status == JobStatus.SUCCEEDED.value
        query = (
            select(func.count(),
                   _count(succeeded),
                   _count(or_(BatchLine.error.is_not(None), finished_badly)),
                   _count(status.in_(ACTIVE_STATUSES)),
                   func.coalesce(func.sum(case((succeeded, Job.prompt_tokens), else_=0)), 0),
                   func.coalesce(func.sum(Result.cached_tokens), 0),
                   func.coalesce(func.sum(Result.completion_tokens), 0))
            .select_from(BatchLine)
            .outerjoin(Job, Job.id == BatchLine.job_id)
            .outerjoin(Result, Result.job_id == Job.id)
            .where(BatchLine.batch_id == batch_id))
        with self._engine.connect() as connection:
            return Tally(*(int(value) for value in connection.execute(query).one()))

    def unfinished_jobs(self, batch_id: str, limit: int) -> list[str]:
        """Up to `limit` of the batch's jobs that have not finished."""
        query = (select(Job.id).select_from(BatchLine).join(Job, Job.id == BatchLine.job_id)
                 .where(BatchLine.batch_id == batch_id,
                        Job.status.in_(ACTIVE_STATUSES))
                 .limit(limit))
        with self._engine.connect() as connection:
            return list(connection.execute(query).scalars())

    def output_pages(self, batch_id: str) -> Iterator[list[OutputRow]]:
        """The batch's lines in order, with their jobs' outcomes: a page per query, so no
        more than a page is held."""
        after = 0
        while rows := self._output_rows(batch_id, after, _OUTPUT_PAGE):
            yield rows
            after = rows[-1].line

    def _output_rows(self, batch_id: str, after_line: int, limit: int) -> list[OutputRow]:
        """The batch's lines after `after_line`, in order, with their jobs' outcomes."""
        query = (
            select(BatchLine.line, BatchLine.custom_id, BatchLine.job_id, BatchLine.error,
                   BatchLine.tool_plan, Job.status, Job.error.label("job_error"),
                   Job.prompt_tokens, Job.sampling, Job.model,
                   Job.finished_at, Result.answer_zst, Result.completion_tokens,
                   Result.cached_tokens, Result.finish_reason, Result.choices_zst,
                   Result.created_cache_tokens, Result.embeddings_zst)
            .select_from(BatchLine)
            .outerjoin(Job, Job.id == BatchLine.job_id)
            .outerjoin(Result, Result.job_id == Job.id)
            .where(BatchLine.batch_id == batch_id, BatchLine.line > after_line)
            .order_by(BatchLine.line).limit(limit))
        with self._engine.connect() as connection:
            return [_output_row(row) for row in connection.execute(query)]


def _count(condition: Any) -> Any:
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def _output_row(row: Any) -> OutputRow:
    answer = None if row.answer_zst is None else compression.decompress(row.answer_zst).decode()
    sampling = row.sampling or {}
    return OutputRow(
        row.line, row.custom_id, row.job_id, row.error, row.status, row.job_error,
        row.prompt_tokens, int(sampling.get("max_tokens", 0)), row.finished_at, answer,
        row.completion_tokens, row.cached_tokens, row.finish_reason, sampling,
        row.choices_zst, row.tool_plan, row.created_cache_tokens, row.embeddings_zst,
        row.model)
