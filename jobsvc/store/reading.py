"""Reading jobs and cancelling them: what producers and waiters ask of the store (records
with their answers, statuses, how many are unfinished) and the cancels they make."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection

from jobsvc import compression
from jobsvc.choices import stored_choices
from jobsvc.embeddings import unpack_vectors
from jobsvc.errors import JobNotFound
from jobsvc.finish_signal import FinishSignal
from jobsvc.store.conditions import unfinished
from jobsvc.store.database import Database
from jobsvc.store.records import Cancelled, JobRecord, load_by_shard, utcnow
from jobsvc.store.tables import Job, Result
from jobsvc.wire import JobStatus


class Reading(Database):
    """The store's part producers and waiters use."""

    def __init__(self, database_url: str) -> None:
        super().__init__(database_url)
        # A waiting producer's checks, built once: building the statement anew would be a
        # large share of each check's client CPU, on cores the engines keep busy.
        self._statuses = select(Job.id, Job.status).where(
            self._sql.among_listed(Job.id, "job_ids"))
        self._count_unfinished = select(func.count()).select_from(Job).where(
            self._sql.among_listed(Job.id, "job_ids"), unfinished(Job.status))

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
        self._sql.lock_in_order(connection, job_ids)
        rows = connection.execute(
            update(Job).where(self._sql.among(Job.id, job_ids), unfinished(Job.status))
            .values(status=JobStatus.CANCELLED.value, finished_at=utcnow())
            .returning(Job.id, Job.shard, Job.load)).all()
        return Cancelled([row.id for row in rows],
                         load_by_shard((row.shard, row.load) for row in rows))

    def finish_signal(self) -> FinishSignal:
        """What a waiter blocks on between checks of its jobs (see `jobsvc.finish_signal`)."""
        return FinishSignal(self.engine)

    def get_many(self, job_ids: Sequence[str]) -> dict[str, JobRecord]:
        """The jobs among `job_ids` that exist, with their answers, in one query."""
        query = (
            select(Job.id, Job.status, Job.error, Job.model, Job.shard, Job.prompt_tokens,
                   Job.submitted_at,
                   Job.started_at, Job.finished_at, Result.answer_zst, Result.completion_tokens,
                   Result.cached_tokens, Result.created_at, Result.finish_reason,
                   Result.choices_zst, Result.embeddings_zst)
            .outerjoin(Result, Result.job_id == Job.id)
            .where(self._sql.among(Job.id, job_ids))
        )
        with self._reads.connect() as connection:
            rows = connection.execute(query).all()
        return {row.id: _record(row) for row in rows}

    def statuses(self, job_ids: Sequence[str]) -> dict[str, JobStatus]:
        """Just the statuses, for polling without fetching answers."""
        with self._reads.connect() as connection:
            rows = connection.execute(self._statuses, {"job_ids": list(job_ids)}).all()
        return {job_id: JobStatus(status) for job_id, status in rows}

    def cancelled_among(self, job_ids: Sequence[str]) -> list[str]:
        """Which of these jobs were cancelled, filtered in the store: a worker checks the jobs
        it runs every few seconds, nearly none of them cancelled."""
        query = select(Job.id).where(self._sql.among(Job.id, job_ids),
                                     Job.status == JobStatus.CANCELLED.value)
        with self._reads.connect() as connection:
            return list(connection.scalars(query))

    def count_unfinished(self, job_ids: Sequence[str]) -> int:
        """How many of these jobs have not finished: what a waiting producer checks."""
        with self._reads.connect() as connection:
            return connection.execute(self._count_unfinished,
                                      {"job_ids": list(job_ids)}).scalar_one()


def _record(row: Any) -> JobRecord:
    answer = (None if row.answer_zst is None
              else compression.decompress(row.answer_zst).decode())
    return JobRecord(
        job_id=row.id, status=JobStatus(row.status), answer=answer, error=row.error,
        model=row.model, shard=row.shard, prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens, cached_tokens=row.cached_tokens,
        submitted_at=row.submitted_at, started_at=row.started_at, finished_at=row.finished_at,
        recorded_at=row.created_at,
        choices=() if answer is None else stored_choices(
            answer, row.finish_reason, row.completion_tokens, row.choices_zst),
        embeddings=None if row.embeddings_zst is None else unpack_vectors(row.embeddings_zst))
