"""Recording submitted jobs and moving them: a submit's documents and jobs in one
transaction, jobs found by idempotency key, jobs handed to new messages (a reconciler sending
stranded jobs again, a departing shard's jobs moved elsewhere)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, bindparam, or_, select, tuple_, update

from jobsvc import compression
from jobsvc.embeddings import is_embedding
from jobsvc.routing.job_cost import Route, answer_tokens
from jobsvc.store.conditions import sent_before, unclaimed
from jobsvc.store.database import Database
from jobsvc.store.records import MovableJob, NewDocument, NewJob, SentJob, utcnow
from jobsvc.store.tables import Document, Job
from jobsvc.wire import ACTIVE_STATUSES, JobStatus, QueueMessage


def _document_row(document: NewDocument, now: datetime) -> dict[str, Any]:
    # Workers read everything a job runs from here: queue messages only name jobs.
    return {"key": document.key, "text_zst": compression.compress(document.text.encode()),
            "tokens_zst": compression.pack_tokens(document.tokens),
            "tokens": len(document.tokens), "created_at": now}


def _job_row(job: NewJob, now: datetime) -> dict[str, Any]:
    return {"id": job.job_id, "document_key": job.document_key, "question": job.question,
            "question_tokens_zst": compression.pack_tokens(job.question_tokens),
            "sampling": job.sampling, "model": job.model, "shard": job.shard,
            "status": JobStatus.QUEUED.value,
            "prompt_tokens": job.prompt_tokens, "estimated_prefill": job.estimated_prefill,
            "load": job.load, "message_id": job.message_id, "submitted_at": now,
            "enqueued_at": now, "idempotency_key": job.idempotency_key}


_SENT_COLUMNS = (Job.id, Job.shard, Job.message_id, Job.enqueued_at, Job.worker, Job.status)


_QUEUED = JobStatus.QUEUED.value


def _sent(row: Sequence[Any]) -> SentJob:
    job_id, shard, message_id, sent, worker, status = row
    # SQLite gives back the UTC times it was given without their zone.
    if sent is not None and sent.tzinfo is None:
        sent = sent.replace(tzinfo=UTC)
    return SentJob(job_id, shard, message_id, sent, worker is not None or status != _QUEUED)


def _bucket_bounds(bucket: int, buckets: int) -> tuple[str, str | None]:
    """Bucket `bucket` of `buckets` even ranges of 32-digit hexadecimal IDs (a power of two
    up to 65,536): the first reaches down to the empty string, the last up without end, so
    together they hold every ID."""
    digits = max(1, (buckets.bit_length() - 1 + 3) // 4)
    width = 16 ** digits // buckets

    def at(index: int) -> str:
        return f"{index * width:0{digits}x}"

    return ("" if bucket == 0 else at(bucket),
            None if bucket == buckets - 1 else at(bucket + 1))


class Submitting(Database):
    """The store's part that records jobs and hands them to messages."""

    def record_submitted(self, documents: Sequence[NewDocument],
                         jobs: Sequence[NewJob]) -> dict[str, str]:
        """Record new documents (once each) and jobs, queued, in one transaction. A job whose
        `idempotency_key` another job already holds is not recorded: the result maps such a
        job's ID to the ID of the job that holds its key (committed by a concurrent submit
        since the caller looked; the unique index makes this insert wait for that one)."""
        now = utcnow()
        document_rows = [_document_row(document, now) for document in documents]
        rows = [_job_row(job, now) for job in jobs]
        keyed = [row for row in rows if row["idempotency_key"] is not None]
        unkeyed = [row for row in rows if row["idempotency_key"] is None]
        if not keyed and self._sql.records_at_once(len(rows)):
            with self._reads.connect() as connection:
                self._sql.insert_submitted(connection, document_rows, rows)
            return {}
        with self.engine.begin() as connection:
            if document_rows:
                connection.execute(self._sql.insert_ignoring_duplicates(Document.__table__),
                                   document_rows)
            self._sql.insert_jobs(connection, unkeyed)
            if not keyed:
                return {}
            inserted = self._sql.insert_keyed(connection, keyed)
            lost = {row["idempotency_key"]: row["id"] for row in keyed
                    if row["id"] not in inserted}
            if not lost:
                return {}
            holders = self._sql.jobs_by_key(connection, list(lost))
        return {job_id: holders[key] for key, job_id in lost.items()}

    def jobs_by_key(self, keys: Sequence[str]) -> dict[str, str]:
        """The IDs of the jobs recorded under these idempotency keys, by key."""
        if not keys:
            return {}
        with self._reads.connect() as connection:
            return self._sql.jobs_by_key(connection, keys)

    def forget_submitted(self, job_ids: Sequence[str]) -> None:
        """Remove jobs recorded by a submit whose enqueue then failed."""
        with self.engine.begin() as connection:
            connection.execute(Job.__table__.delete().where(self._sql.among(Job.id, job_ids)))

    def sent_after(self, mark: tuple[datetime, str] | None, enqueued_before: datetime,
                   limit: int) -> list[SentJob]:
        """Unfinished jobs in the order their messages were sent (then by ID), after `mark`
        (a send time and job ID; None: from the first) and before `enqueued_before`, at most
        `limit`: the ones whose messages reconciliation has yet to check once."""
        after = [] if mark is None else [tuple_(Job.enqueued_at, Job.id) > tuple_(*mark)]
        return self._unfinished(
            select(*_SENT_COLUMNS).where(Job.enqueued_at < enqueued_before, *after)
            .order_by(Job.enqueued_at, Job.id).limit(limit))

    def unfinished_in_buckets(self, first: int, count: int, buckets: int) -> list[SentJob]:
        """The unfinished jobs whose message IDs fall in `count` of `buckets` even ranges of
        the (hexadecimal) IDs from bucket `first` on, every job of each such message: a slice
        of the sweep that checks every unfinished job's message in turn. A range, not a page in
        ID order, so the read is the same index range scan whatever the planner knows of the
        table."""
        low, _ = _bucket_bounds(first, buckets)
        _, high = _bucket_bounds(first + count - 1, buckets)
        below = [] if high is None else [Job.message_id < high]
        return self._unfinished(select(*_SENT_COLUMNS).where(Job.message_id >= low, *below))

    def unfinished_of_messages(self, message_ids: Sequence[str]) -> list[SentJob]:
        """The unfinished jobs these messages may run."""
        if not message_ids:
            return []
        return self._unfinished(select(*_SENT_COLUMNS).where(
            self._sql.among(Job.message_id, message_ids)))

    def unfinished_among(self, job_ids: Sequence[str]) -> list[SentJob]:
        """Those of these jobs that are unfinished."""
        if not job_ids:
            return []
        return self._unfinished(select(*_SENT_COLUMNS).where(self._sql.among(Job.id, job_ids)))

    def _unfinished(self, query: Select[Any]) -> list[SentJob]:
        """What `query` reads of the jobs, restricted to the unfinished ones (the condition
        the partial indexes of migration 0015 are made for)."""
        with self._reads.connect() as connection:
            # Fetched at once, as plain tuples: a sweep at ten million held reads tens of
            # thousands of rows, and row by row that cost more than the query.
            rows = connection.execute(query.where(Job.status.in_(ACTIVE_STATUSES))).all()
            return [_sent(row) for row in rows]

    def jobs_on_shard(self, shard: int, *, unclaimed_only: bool,
                      enqueued_before: datetime | None, models: Collection[str],
                      limit: int) -> list[MovableJob]:
        """Unfinished jobs of these models on a shard that is leaving (all, or only those no
        worker has claimed), oldest first, with what routing them again needs."""
        query = select(Job.id, Job.document_key, Job.prompt_tokens, Job.sampling, Job.load,
                       Job.model).where(
            Job.shard == shard, Job.status.in_(ACTIVE_STATUSES), Job.model.in_(list(models)))
        if unclaimed_only:
            query = query.where(unclaimed())
        if enqueued_before is not None:
            query = query.where(sent_before(enqueued_before))
        with self._reads.connect() as connection:
            rows = connection.execute(query.order_by(Job.submitted_at).limit(limit)).all()
            documents = self._documents(connection, {row.document_key for row in rows})
        return [MovableJob(row.id, row.document_key, documents.get(row.document_key),
                           row.prompt_tokens, answer_tokens(row.sampling), row.load,
                           row.model, is_embedding(row.sampling))
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
            statement = statement.where(unclaimed())
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
            self._sql.lock_in_order(connection, [row["b_id"] for row in rows])
            connection.execute(statement, rows)
            return set(connection.scalars(select(Job.id).where(self._sql.among(
                Job.message_id, [message.message_id for message in messages]))))

    def assign_messages(self, messages: Sequence[QueueMessage]) -> None:
        """Hand unfinished jobs to new messages, which alone may run them from now on; a job
        a worker had claimed becomes queued and unclaimed again (its worker's message is
        gone)."""
        owners = {job_id: message.message_id for message in messages
                  for job_id in message.job_ids}
        with self.engine.begin() as connection:
            self._sql.lock_in_order(connection, list(owners))
            self._sql.assign_messages(connection, owners, utcnow())
