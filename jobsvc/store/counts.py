"""Counts and totals for operators and summaries: load and active jobs by shard, batches by
status, and the job and token totals of `jobsvc stats`. On PostgreSQL the active jobs are
counted as they change, by triggers (migration 0016), so these reads do not grow with the
backlog; the embedded SQLite counts the jobs themselves."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, inspect, select

from jobsvc.store.database import Database
from jobsvc.store.records import load_by_shard
from jobsvc.store.tables import BatchRow, Job, Result


class Counting(Database):
    """The store's part that counts, for operators."""

    def __init__(self, database_url: str) -> None:
        super().__init__(database_url)
        # Whether the batches table was there when last looked for: once it is, it stays.
        self._has_batches = False

    def active_load(self) -> dict[int, int]:
        """What every unfinished job charged its shard, summed by shard."""
        with self._reads.connect() as connection:
            return load_by_shard((row.shard, row.load) for row in connection.execute(
                self._sql.active_totals(["shard"])))

    def active_counts(self) -> dict[int, dict[str, int]]:
        """Queued and running jobs by shard and status, for operators."""
        counts: dict[int, dict[str, int]] = {}
        with self._reads.connect() as connection:
            for row in connection.execute(self._sql.active_totals(["shard", "status"])):
                counts.setdefault(row.shard, {})[row.status] = int(row.jobs)
        return counts

    def active_by_model(self, shard: int | None = None) -> dict[str, dict[str, int]]:
        """Queued and running jobs by the model they ask for and status, on one shard or all."""
        counts: dict[str, dict[str, int]] = {}
        with self._reads.connect() as connection:
            for row in connection.execute(self._sql.active_totals(["model", "status"], shard)):
                counts.setdefault(row.model, {})[row.status] = int(row.jobs)
        return counts

    def fold_active_counts(self) -> None:
        """Sum up the changes the counts of unfinished jobs are kept as (on PostgreSQL), so
        that reading them reads about a row per shard, model and status: a reconciliation
        round does it before it reads them."""
        with self.engine.begin() as connection:
            self._sql.fold_active_totals(connection)

    def batch_counts(self) -> dict[str, int] | None:
        """Batches of the batch API by status; None where the schema has no such table yet
        (an embedded demo file made before the batch API)."""
        if not self._has_batches:
            if not inspect(self.engine).has_table(BatchRow.__tablename__):
                return None
            self._has_batches = True
        query = select(BatchRow.status, func.count()).group_by(BatchRow.status)
        with self._reads.connect() as connection:
            return {str(status): int(count) for status, count in connection.execute(query)}

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
