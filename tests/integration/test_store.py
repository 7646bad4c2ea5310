"""Repository rules that keep results exactly-once, on the real PostgreSQL test database."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, timedelta
from typing import Any

import pytest
from sqlalchemy import event, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from jobsvc.compression import compress, pack_tokens
from jobsvc.store import JobOutcome, MessageStats, NewDocument, Store, utcnow
from jobsvc.store.tables import BatchStat, Document, Job
from jobsvc.wire import JobStatus, QueueMessage
from tests.support.jobs import TEST_MESSAGE, TEST_MODEL, claim, new_job, record_queued_job

pytestmark = pytest.mark.integration


def _attempts_and_levels(store: Store, job_ids: list[str]) -> dict[str, tuple[int, int]]:
    with store.engine.connect() as connection:
        return {row.id: (row.attempts, row.isolation) for row in connection.execute(
            select(Job.id, Job.attempts, Job.isolation).where(Job.id.in_(job_ids)))}


def test_a_group_charge_raises_its_members_isolation_and_only_a_run_alone_is_an_attempt(
        store: Store, queued_job: Callable[[], str]) -> None:
    first, second, third, bystander = (queued_job() for _ in range(4))
    group = [first, second, third]
    claimed = store.claim_message([*group, bystander], message_id=TEST_MESSAGE, shard=0,
                                redelivered=False, worker="w", max_attempts=3, models=[TEST_MODEL])
    assert [(job.suspect, job.isolation) for job in claimed.jobs] == [(False, 0)] * 4
    assert store.charge_isolated(group, 3) == set(group)
    again = store.claim_message([*group, bystander], message_id=TEST_MESSAGE, shard=0,
                              redelivered=True, worker="w", max_attempts=3, models=[TEST_MODEL])
    assert [(job.job_id, job.suspect, job.isolation) for job in again.jobs] == [
        (first, True, 3), (second, True, 3), (third, True, 3), (bystander, True, 0)]
    # A group of one runs alone: that counts as an attempt, a larger group's run does not.
    assert store.charge_isolated([first], 4) == {first}
    assert store.charge_isolated([second, third], 4) == {second, third}
    assert _attempts_and_levels(store, [*group, bystander]) == {
        first: (2, 4), second: (1, 4), third: (1, 4), bystander: (1, 0)}
    # A job that ended meanwhile is not charged; the rest of its group is.
    assert store.cancel_many([second]).job_ids == [second]
    assert store.charge_isolated([second, third], 5) == {third}
    assert _attempts_and_levels(store, [second, third]) == {second: (1, 4), third: (1, 5)}


def test_a_job_that_stopped_its_engine_alone_max_attempts_times_ends_failed_with_the_reason(
        store: Store, queued_job: Callable[[], str]) -> None:
    job_id, mate = queued_job(), queued_job()
    first = store.claim_message([job_id, mate], message_id=TEST_MESSAGE, shard=0,
                              redelivered=False, worker="w", max_attempts=3, models=[TEST_MODEL])
    assert [job.suspect for job in first.jobs] == [False, False]
    # Deliveries that died in company, or in a group of several, charge no attempt.
    for level in range(1, 5):
        again = store.claim_message([job_id], message_id=TEST_MESSAGE, shard=0,
                                  redelivered=True, worker="w", max_attempts=3, models=[TEST_MODEL])
        assert [(job.job_id, job.suspect) for job in again.jobs] == [(job_id, True)]
        assert store.charge_isolated([job_id, mate], level) == {job_id, mate}
    for level in range(5, 8):
        assert set(claim(store, [job_id], redelivered=True)) == {job_id}
        assert store.charge_isolated([job_id], level) == {job_id}
    assert claim(store, [job_id], redelivered=True) == {}
    record = store.get_many([job_id])[job_id]
    assert record.status is JobStatus.FAILED
    assert "stopped each of the 3 times this job ran alone" in (record.error or "")
    assert store.charge_isolated([job_id], 8) == set()
    assert store.get_many([mate])[mate].status is JobStatus.QUEUED
    assert _attempts_and_levels(store, [mate]) == {mate: (1, 4)}


def _plans(store: Store, call: Callable[[], object]) -> list[str]:
    """The query plans of the statements `call` sends that look jobs up (not its inserts)."""
    statements: list[tuple[str, Any]] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("UPDATE", "SELECT", "WITH")):
            statements.append((statement, parameters))

    event.listen(store.engine, "before_cursor_execute", capture)
    try:
        call()
    finally:
        event.remove(store.engine, "before_cursor_execute", capture)
    with store.engine.connect() as connection:
        cursor = connection.connection.driver_connection.cursor()
        plans = []
        for statement, parameters in statements:
            cursor.execute("EXPLAIN " + statement, parameters)
            plans.append("\n".join(row[0] for row in cursor.fetchall()))
        connection.rollback()
    return plans


def test_statements_on_listed_jobs_look_them_up_by_key_not_by_status(
        store: Store, queued_job: Callable[[], str]) -> None:
    # Finished jobs leave entries in the status index until a vacuum; with a few hundred of
    # them the planner took to walking that index for a batch's claims and outcomes.
    history = [queued_job() for _ in range(500)]
    claim(store, history)
    store.record_outcomes([JobOutcome(job_id, "answer", None, 1, 0, utcnow())
                           for job_id in history])
    job_ids = [queued_job() for _ in range(64)]
    batch = job_ids[:32]
    outcomes = [JobOutcome(job_id, "answer", None, 1, 0, utcnow()) for job_id in batch]
    plans = [*_plans(store, lambda: claim(store, batch)),
             *_plans(store, lambda: store.record_outcomes(outcomes)),
             *_plans(store, lambda: store.count_unfinished(batch)),
             *_plans(store, lambda: store.cancel(job_ids[-1]))]
    assert len(plans) >= 4
    assert all("ix_jobs_status" not in plan for plan in plans), plans


def test_statements_repeated_on_one_connection_are_planned_for_the_table_as_it_is(
        routing_database: str) -> None:
    # psycopg prepares a statement once it has been sent five times, and after five more
    # PostgreSQL may keep one generic plan for it, made for the table as it was then: a
    # worker's outcome writes kept scanning the whole jobs table they had found nearly empty.
    # A fresh store: its connection has prepared and planned none of these statements yet.
    store = Store(routing_database)
    try:
        for _ in range(16):
            job_id = record_queued_job(store)
            claim(store, [job_id])
            store.record_outcomes([JobOutcome(job_id, "answer", None, 1, 0, utcnow())])
            store.count_unfinished([job_id])
        with store.engine.connect() as connection:
            prepared = connection.execute(text(
                "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
            )).all()
    finally:
        store.dispose()
    written = [row for row in prepared if "UPDATE jobs SET status" in row.statement]
    assert written and written[0].custom_plans >= 10, prepared
    assert all(row.generic_plans == 0 for row in prepared), prepared


def test_a_second_outcome_for_a_finished_job_changes_nothing(
        store: Store, queued_job: Callable[[], str]) -> None:
    job_id = queued_job()
    claim(store, [job_id])
    first = JobOutcome(job_id, "first answer", None, 3, 0, utcnow())
    store.record_outcomes([first])
    store.record_outcomes([JobOutcome(job_id, "second answer", None, 5, 0, utcnow()),
                           JobOutcome(job_id, None, "late failure", 0, 0, utcnow())])
    record = store.get_many([job_id])[job_id]
    assert (record.status, record.answer, record.completion_tokens, record.error) == (
        JobStatus.SUCCEEDED, "first answer", 3, None)


def test_a_result_records_when_it_was_written_beside_when_the_engine_finished(
        store: Store, queued_job: Callable[[], str]) -> None:
    job_id = queued_job()
    claim(store, [job_id])
    engine_finished = utcnow() - timedelta(minutes=1)
    before = utcnow()
    store.record_outcomes([JobOutcome(job_id, "answer", None, 1, 0, engine_finished)])
    record = store.get_many([job_id])[job_id]
    assert record.finished_at == engine_finished
    assert record.recorded_at is not None and before <= record.recorded_at <= utcnow()


def _message_stats(worker: str, jobs: int) -> MessageStats:
    now = utcnow()
    return MessageStats(worker=worker, shard=0, jobs=jobs, prompt_tokens=10,
                        completion_tokens=2, cached_tokens=0, started_at=now, finished_at=now,
                        wall_seconds=1.0, requests_per_second=1.0, tokens_per_second=2.0)


def test_outcomes_and_their_batch_statistics_commit_together_or_not_at_all(
        store: Store, queued_job: Callable[[], str]) -> None:
    job_id = queued_job()
    claim(store, [job_id])
    outcome = JobOutcome(job_id, "answer", None, 2, 0, utcnow())
    unwritable = replace(_message_stats("w", 1), jobs=None)
    with pytest.raises(IntegrityError):
        store.record_outcomes([outcome], [unwritable])
    assert store.get_many([job_id])[job_id].status is JobStatus.QUEUED
    worker = f"w-{uuid.uuid4().hex}"
    store.record_outcomes([outcome], [_message_stats(worker, 1)])
    assert store.get_many([job_id])[job_id].status is JobStatus.SUCCEEDED
    with store.engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(BatchStat)
                                  .where(BatchStat.worker == worker)).scalar_one() == 1


def test_a_claimed_batch_runs_on_the_recorded_tokens_or_else_the_text_or_else_fails(
        store: Store) -> None:
    stored = {"tokens": pack_tokens([5, 6, 7]), "none": None, "unreadable": b"garbage",
              "nothing": b"garbage"}
    documents = {name: uuid.uuid4().hex for name in stored}
    jobs = {name: uuid.uuid4().hex for name in [*stored, "tokens-again"]}
    # Documents as no producer stores them: without tokens, or with frames that do not read.
    with store.engine.begin() as connection:
        connection.execute(insert(Document), [
            {"key": documents[name], "tokens_zst": tokens_zst, "tokens": 3,
             "created_at": utcnow(),
             "text_zst": b"garbage" if name == "nothing" else compress(f"text of {name}".encode())}
            for name, tokens_zst in stored.items()])
    store.record_submitted([], [new_job(job_id, documents[name.removesuffix("-again")])
                                for name, job_id in jobs.items()])
    assert claim(store, [*jobs.values(), uuid.uuid4().hex]) == {
        jobs["tokens"]: (5, 6, 7), jobs["tokens-again"]: (5, 6, 7),
        jobs["none"]: "text of none", jobs["unreadable"]: "text of unreadable"}
    record = store.get_many([jobs["nothing"]])[jobs["nothing"]]
    assert record.status is JobStatus.FAILED
    assert f"document {documents['nothing']} does not read back" in (record.error or "")


def test_a_batch_reads_each_of_its_documents_once_and_no_text_where_tokens_serve(
        store: Store) -> None:
    documents = {uuid.uuid4().hex: (index, 1, 2) for index in range(2)}
    jobs = {uuid.uuid4().hex: key for key in documents for _ in range(3)}
    store.record_submitted([NewDocument(key, "text", tokens) for key, tokens in documents.items()],
                           [new_job(job_id, key) for job_id, key in jobs.items()])
    document_rows: list[int] = []

    def count_document_rows(_conn: Any, cursor: Any, statement: str, *_args: Any) -> None:
        if "FROM documents" in statement:
            assert "text_zst" not in statement
            document_rows.append(cursor.rowcount)

    event.listen(store.engine, "after_cursor_execute", count_document_rows)
    try:
        read = claim(store, list(jobs))
    finally:
        event.remove(store.engine, "after_cursor_execute", count_document_rows)
    assert read == {job_id: documents[key] for job_id, key in jobs.items()}
    assert document_rows == [2]
    # A document's questions share one tuple of its tokens: the garbage collector walks each
    # document once, not once per question.
    shared = {key: {id(read[job_id]) for job_id, job_key in jobs.items() if job_key == key}
              for key in documents}
    assert all(len(objects) == 1 for objects in shared.values())


def test_lookups_by_job_ids_work_alike_on_postgresql_and_on_the_embedded_sqlite(
        store: Store, embedded: Store) -> None:
    # PostgreSQL takes the IDs as one array parameter, SQLite as an IN list.
    for repository in (store, embedded):
        ids = [record_queued_job(repository) for _ in range(3)]
        assert set(claim(repository, ids[:2])) == set(ids[:2])
        repository.record_outcomes([JobOutcome(ids[0], "answer", None, 1, 0, utcnow())],
                                   started=dict.fromkeys(ids[:2], utcnow()))
        assert repository.statuses([*ids, "unknown"]) == {
            ids[0]: JobStatus.SUCCEEDED, ids[1]: JobStatus.RUNNING, ids[2]: JobStatus.QUEUED}
        assert repository.count_unfinished(ids) == 2
        assert repository.get_many(ids)[ids[0]].answer == "answer"
        repository.forget_submitted(ids[2:])
        assert set(repository.statuses(ids)) == set(ids[:2])


def test_a_job_that_ends_twice_in_one_gathering_keeps_its_first_ending_on_both_databases(
        store: Store, embedded: Store) -> None:
    # PostgreSQL records a gathering in one statement from arrays, SQLite row by row.
    for repository in (store, embedded):
        answered, failed = (record_queued_job(repository) for _ in range(2))
        claim(repository, [answered, failed])
        repository.record_outcomes([
            JobOutcome(answered, "first", None, 2, 0, utcnow()),
            JobOutcome(failed, None, "engine error", 0, 0, utcnow()),
            JobOutcome(answered, None, "second delivery failed", 0, 0, utcnow()),
            JobOutcome(failed, "late answer", None, 3, 0, utcnow())])
        records = repository.get_many([answered, failed])
        assert (records[answered].status, records[answered].answer,
                records[answered].error) == (JobStatus.SUCCEEDED, "first", None)
        assert (records[failed].status, records[failed].answer,
                records[failed].error) == (JobStatus.FAILED, None, "engine error")


def test_a_submit_records_its_jobs_alike_on_postgresql_and_on_the_embedded_sqlite(
        store: Store, embedded: Store) -> None:
    # PostgreSQL takes a submit's jobs by COPY, SQLite by INSERT: text with the characters
    # COPY escapes, nested sampling settings and the timestamp must read back unchanged.
    columns = ("id", "document_key", "question", "sampling", "shard", "status",
               "prompt_tokens", "estimated_prefill", "load", "message_id", "submitted_at",
               "enqueued_at")
    for repository in (store, embedded):
        key = uuid.uuid4().hex
        jobs = [new_job(uuid.uuid4().hex, key, question=question, sampling=sampling,
                        shard=shard, prompt_tokens=10 + shard, estimated_prefill=5, load=7,
                        message_id=message)
                for question, sampling, shard, message in [
                    ("tab\there, newline\nthere, back\\slash and \\N", {"stop": ["\n", "\\."]},
                     0, "e1"),
                    ("Ünïcødé — ✓", {"max_tokens": 4, "temperature": 0.5, "ignore_eos": True}, 1,
                     "e2")]]
        before = utcnow()
        repository.record_submitted([NewDocument(key, "", (1,))], jobs)
        after = utcnow()
        with repository.engine.connect() as connection:
            rows = connection.execute(select(*(Job.__table__.c[c] for c in columns))
                                      .where(Job.document_key == key).order_by(Job.shard)).all()
        read = [dict(zip(columns, row, strict=True)) for row in rows]
        for row in read:
            # SQLite hands back the UTC moment without its zone; PostgreSQL, with one.
            moments = {row.pop(name) for name in ("submitted_at", "enqueued_at")}
            (moment,) = {at if at.tzinfo else at.replace(tzinfo=UTC) for at in moments}
            assert before <= moment <= after
        assert read == [
            {"id": job.job_id, "document_key": key, "question": job.question,
             "sampling": job.sampling, "shard": job.shard, "status": "queued",
             "prompt_tokens": job.prompt_tokens, "estimated_prefill": 5, "load": 7,
             "message_id": job.message_id} for job in jobs]
        assert repository.statuses([job.job_id for job in jobs]) == {
            job.job_id: JobStatus.QUEUED for job in jobs}


def test_only_a_jobs_own_message_on_its_own_shard_claims_it(store: Store) -> None:
    own, elsewhere, other_message = (record_queued_job(store) for _ in range(3))
    with store.engine.begin() as connection:
        connection.execute(update(Job).where(Job.id == elsewhere).values(shard=3))
        connection.execute(update(Job).where(Job.id == other_message).values(message_id="x"))
    assert set(claim(store, [own, elsewhere, other_message])) == {own}
    # A copy of the message, not a redelivery, finds the job claimed and leaves it alone.
    assert claim(store, [own]) == {}
    assert set(claim(store, [own], redelivered=True)) == {own}
    store.record_outcomes([JobOutcome(own, "answer", None, 1, 0, utcnow())])
    assert claim(store, [own], redelivered=True) == {}
    records = store.get_many([own, elsewhere, other_message])
    assert [records[job].status for job in (own, elsewhere, other_message)] == [
        JobStatus.SUCCEEDED, JobStatus.QUEUED, JobStatus.QUEUED]


def test_a_claim_reads_the_recorded_question_tokens_or_else_the_question_text(
        store: Store) -> None:
    tokens, text = record_queued_job(store, question_tokens_zst=pack_tokens([9, 8])), \
        record_queued_job(store, question_tokens_zst=b"not a frame")
    claimed = store.claim_message([tokens, text], message_id=TEST_MESSAGE, shard=0,
                                redelivered=False, worker="w", max_attempts=3, models=[TEST_MODEL])
    assert {job.job_id: job.question for job in claimed.jobs} == {tokens: (9, 8), text: "q"}


def test_each_job_returns_its_recorded_load_once_whichever_way_it_ends(store: Store) -> None:
    answered, cancelled, exhausted = (record_queued_job(store, load=load)
                                      for load in (10, 20, 40))
    claim(store, [answered])
    outcome = JobOutcome(answered, "answer", None, 1, 0, utcnow())
    assert store.record_outcomes([outcome, outcome]) == {0: 10}
    assert store.record_outcomes([outcome]) == {}
    assert store.cancel(cancelled) == {0: 20}
    assert store.cancel(cancelled) is None
    claim(store, [exhausted])
    for level in range(1, 4):
        store.charge_isolated([exhausted], level)
    given_up = store.claim_message([exhausted], message_id=TEST_MESSAGE, shard=0,
                                 redelivered=True, worker="w", max_attempts=3, models=[TEST_MODEL])
    assert (given_up.jobs, given_up.released) == ([], {0: 40})


def test_reconciliation_reads_unfinished_jobs_by_send_time_by_message_and_by_name(
        store: Store) -> None:
    old = utcnow() - timedelta(minutes=5)
    first, second, young, finished = (
        record_queued_job(store, enqueued_at=moment, message_id=name)
        for name, moment in [("a", old), ("b", old + timedelta(seconds=1)), ("c", utcnow()),
                             ("d", old)])
    store.cancel(finished)
    cutoff = utcnow() - timedelta(minutes=1)
    mine = {first, second, young, finished}
    sent = [job for job in store.sent_after(None, cutoff, 10_000) if job.job_id in mine]
    assert [(job.job_id, job.message_id) for job in sent] == [(first, "a"), (second, "b")]
    after_first = store.sent_after((sent[0].enqueued_at, first), cutoff, 10_000)
    assert [job.job_id for job in after_first if job.job_id in mine] == [second]
    # Every unfinished job falls in exactly one bucket of message IDs.
    swept = [job.job_id for bucket in range(16)
             for job in store.unfinished_in_buckets(bucket, 1, 16) if job.job_id in mine]
    assert sorted(swept) == sorted([first, second, young])
    assert [job.job_id for job in store.unfinished_in_buckets(10, 1, 16)
            if job.job_id in mine] == [first]  # message "a"
    # Contiguous buckets read as one range: 10 and 11 hold "a" and "b".
    assert sorted(job.job_id for job in store.unfinished_in_buckets(10, 2, 16)
                  if job.job_id in mine) == sorted([first, second])
    assert sorted(job.job_id for job in store.unfinished_in_buckets(0, 16, 16)
                  if job.job_id in mine) == sorted([first, second, young])
    assert {job.job_id for job in store.unfinished_among([first, young, finished])} == {
        first, young}
    assert [job.job_id for job in store.unfinished_of_messages(["c", "d"])] == [young]
    store.assign_messages([QueueMessage(0, [first, finished], "resent")])
    records = store.get_many([first, finished])
    assert (records[first].status, records[finished].status) == (
        JobStatus.QUEUED, JobStatus.CANCELLED)
    # Sent again just now: after the cutoff, under its new message.
    assert first not in {job.job_id for job in store.sent_after(None, cutoff, 10_000)}
    (again,) = store.unfinished_among([first])
    assert again.message_id == "resent"


def test_a_claimed_job_stays_queued_until_admitted_then_runs_from_its_admission(
        store: Store, embedded: Store) -> None:
    for repository in (store, embedded):
        job_id = record_queued_job(repository)
        claim(repository, [job_id])
        assert repository.get_many([job_id])[job_id].started_at is None
        admitted = utcnow()
        repository.record_outcomes([], started={job_id: admitted})
        record = repository.get_many([job_id])[job_id]
        assert record.status is JobStatus.RUNNING
        assert record.started_at.replace(tzinfo=UTC) == admitted
        # A late admission of a job that already ended changes nothing.
        repository.record_outcomes([JobOutcome(job_id, "answer", None, 1, 0, utcnow())])
        repository.record_outcomes([], started={job_id: utcnow()})
        assert repository.get_many([job_id])[job_id].status is JobStatus.SUCCEEDED


def test_a_claim_returns_its_jobs_in_the_order_the_message_gave_them(store: Store) -> None:
    # The producer puts a document's questions side by side; the engine gains from meeting
    # them together, whatever order the database finds the rows in.
    job_ids = [record_queued_job(store) for _ in range(12)]
    given = job_ids[::2] + job_ids[1::2][::-1]
    claimed = store.claim_message(given, message_id=TEST_MESSAGE, shard=0, redelivered=False,
                                worker="w", max_attempts=3, models=[TEST_MODEL])
    assert [job.job_id for job in claimed.jobs] == given


def test_totals_span_every_job_whatever_its_status(embedded: Store) -> None:
    early = utcnow() - timedelta(hours=2)
    queued = record_queued_job(embedded, submitted_at=early)
    failed = record_queued_job(embedded, submitted_at=early + timedelta(minutes=1),
                               status=JobStatus.FAILED.value, error="refused",
                               finished_at=early + timedelta(minutes=2))
    totals = embedded.totals()
    assert totals["statuses"] == {"queued": 1, "failed": 1}
    # Neither job has a result row: before, the span came from succeeded jobs alone.
    assert totals["first_submitted"].replace(tzinfo=None) == early.replace(tzinfo=None)
    assert totals["last_finished"].replace(tzinfo=None) == (
        early + timedelta(minutes=2)).replace(tzinfo=None)
    assert embedded.get_many([queued, failed]).keys() == {queued, failed}
