"""Claiming and ending jobs on a worker: a message's claim with the reads of what its jobs
run, suspects charged before they run alone, and a gathering of outcomes recorded in one
transaction with the statistics of the messages that ended with them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from datetime import datetime

from sqlalchemy import Boolean, and_, bindparam, case, or_, select, update
from sqlalchemy.engine import Connection

from jobsvc.store.conditions import unfinished
from jobsvc.store.database import Database, readable_tokens
from jobsvc.store.records import Claim, ClaimedJob, JobOutcome, MessageStats, load_by_shard, utcnow
from jobsvc.store.tables import BatchStat, Job
from jobsvc.wire import JobStatus


class Claiming(Database):
    """The store's part a worker runs messages through."""

    def __init__(self, database_url: str) -> None:
        super().__init__(database_url)
        # A worker's statement for every message, built once: building and keying a statement
        # cost more of its CPU than sending it.
        # Only the job's own message, on the job's own shard, claims it: a job no worker has
        # claimed, or one whose message came back because its worker stopped (`redelivered`).
        # The job stays queued until the worker admits it to its engine (`started`).
        self._claim = (
            update(Job)
            .where(self._sql.among_listed(Job.id, "job_ids"), Job.shard == bindparam("b_shard"),
                   self._sql.among_listed(Job.model, "b_models"),
                   Job.message_id == bindparam("b_message_id"), unfinished(Job.status),
                   or_(bindparam("redelivered", type_=Boolean),
                       and_(Job.worker.is_(None), Job.status != JobStatus.RUNNING.value)))
            # A first claim counts as an attempt; a suspect's come as it runs alone, in a
            # group of one.
            .values(worker=bindparam("worker"),
                    attempts=case((Job.worker.is_(None), Job.attempts + 1),
                                  else_=Job.attempts))
            .returning(Job.id, Job.attempts, Job.isolation, Job.document_key, Job.question,
                       Job.question_tokens_zst, Job.sampling, Job.model, Job.estimated_prefill,
                       Job.submitted_at))

    def claim_message(self, job_ids: Sequence[str], *, message_id: str, shard: int,
                      redelivered: bool, worker: str, max_attempts: int,
                      models: Sequence[str]) -> Claim:
        """Claim for this worker the jobs that this message may run and read what they run, in
        one transaction; they come back in the order given. Jobs finished, cancelled, on
        another shard or owned by another message are left alone. A job claimed before and
        not finished is a suspect. One that has stopped its engine while running alone (in a
        group of one) `max_attempts` times ends failed instead, and so does one whose
        document reads back as neither tokens nor text (no delivery could run it). A message
        asks several questions of each document: each is read once. Only jobs for one of
        `models` (what the worker serves) are claimed."""
        ended: list[tuple[int, int]] = []
        with self.engine.begin() as connection:
            self._sql.lock_in_order(connection, job_ids)
            suspects = set(connection.scalars(select(Job.id).where(
                self._sql.among(Job.id, job_ids), Job.worker.is_not(None))))
            claimed = connection.execute(self._claim, {
                "job_ids": list(job_ids), "b_message_id": message_id, "b_shard": shard,
                "redelivered": redelivered, "worker": worker, "b_models": list(models)}).all()
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
            tokens = readable_tokens(f"job {row.id}'s question", row.question_tokens_zst)
            jobs.append(ClaimedJob(row.id, document, row.question if tokens is None else tokens,
                                   row.sampling, row.model, row.estimated_prefill,
                                   row.submitted_at,
                                   row.id in suspects, row.isolation))
        return Claim(jobs, load_by_shard(ended))

    def charge_isolated(self, job_ids: Sequence[str], isolation: int) -> set[str]:
        """Raise a group of suspects to isolation level `isolation` before the group runs
        with nothing else in the engine: should the engine die now, their next delivery runs
        them in smaller groups. A group of one is charged an attempt as well: if the engine
        dies now, this job killed it. Returns the jobs charged, those not ended meanwhile."""
        solo = len(job_ids) == 1
        with self.engine.begin() as connection:
            self._sql.lock_in_order(connection, job_ids)
            return set(connection.scalars(
                update(Job).where(self._sql.among(Job.id, job_ids), unfinished(Job.status))
                .values(isolation=isolation, attempts=Job.attempts + int(solo))
                .returning(Job.id)))

    def _fail(self, connection: Connection, job_ids: Sequence[str], reason: str
              ) -> list[tuple[int, int]]:
        """End these jobs failed with `reason`, unless they have already ended; returns the
        (shard, load) of those it ended."""
        return [(row.shard, row.load) for row in connection.execute(
            update(Job).where(self._sql.among(Job.id, job_ids), unfinished(Job.status))
            .values(status=JobStatus.FAILED.value, finished_at=utcnow(), error=reason)
            .returning(Job.shard, Job.load))]

    def record_outcomes(self, outcomes: Sequence[JobOutcome],
                        messages: Sequence[MessageStats] = (),
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
            self._sql.lock_in_order(connection, [*(started or ()), *first])
            if started:
                self._sql.mark_started(connection, started)
            if messages:
                # The record's fields are the table's columns.
                connection.execute(BatchStat.__table__.insert(),
                                   [asdict(message) for message in messages])
            if not outcomes:
                return {}
            return self._sql.record_outcomes(connection, outcomes)
