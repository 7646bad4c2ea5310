"""The counts of unfinished jobs by shard, model and status: on PostgreSQL read from what the
triggers of migration 0016 keep, on the embedded SQLite from the jobs; either way what grouping
the unfinished jobs gives, through every way a job enters, changes or leaves."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import func, select

from jobsvc import migrations
from jobsvc.routing.job_cost import Route
from jobsvc.store import JobOutcome, NewDocument, Store, utcnow
from jobsvc.store.tables import Job, active_job_counts
from jobsvc.wire import ACTIVE_STATUSES, QueueMessage
from tests.support.environment import TEST_DATABASE, drop_database, empty_database
from tests.support.jobs import TEST_MODEL, claim, new_job, record_queued_job

pytestmark = pytest.mark.integration

_OTHER_MODEL = "other-model"


def _grouped(store: Store) -> dict[str, Any]:
    """What each count reads, as grouping the unfinished jobs themselves gives it."""
    with store.engine.connect() as connection:
        groups = connection.execute(
            select(Job.shard, Job.model, Job.status, func.count(), func.sum(Job.load))
            .where(Job.status.in_(ACTIVE_STATUSES)).group_by(Job.shard, Job.model, Job.status)
        ).all()
    load: dict[int, int] = {}
    by_shard: dict[int, dict[str, int]] = {}
    by_model: dict[int | None, dict[str, dict[str, int]]] = {}
    for shard, model, status, jobs, jobs_load in groups:
        load[shard] = load.get(shard, 0) + int(jobs_load)
        on_shard = by_shard.setdefault(shard, {})
        on_shard[status] = on_shard.get(status, 0) + int(jobs)
        for scope in (None, shard):
            counts = by_model.setdefault(scope, {}).setdefault(model, {})
            counts[status] = counts.get(status, 0) + int(jobs)
    return {"load": load, "by_shard": by_shard, "by_model": by_model}


def _assert_counts_are_the_jobs(store: Store) -> None:
    grouped = _grouped(store)
    assert store.active_load() == grouped["load"]
    assert store.active_counts() == grouped["by_shard"]
    assert store.active_by_model() == grouped["by_model"].get(None, {})
    for shard in (0, 2, 5, 9):
        assert store.active_by_model(shard) == grouped["by_model"].get(shard, {})


def _count_rows(store: Store) -> int:
    with store.engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(active_job_counts))
                   .scalar_one())


def test_the_counts_follow_every_way_a_job_enters_changes_and_leaves_on_both_databases(
        store: Store, embedded: Store) -> None:
    for repository in (store, embedded):
        # Alone (one statement for a small submit) and by the hundred (COPY on PostgreSQL).
        alone = [record_queued_job(repository, shard=shard, model=model, load=load)
                 for shard, model, load in [(0, TEST_MODEL, 3), (0, TEST_MODEL, 5),
                                            (0, _OTHER_MODEL, 7), (2, TEST_MODEL, 11),
                                            (5, _OTHER_MODEL, 13), (0, TEST_MODEL, 17)]]
        key = uuid.uuid4().hex
        many = [new_job(uuid.uuid4().hex, key, shard=5, load=n) for n in range(100)]
        repository.record_submitted([NewDocument(key, "d", (1,))], many)
        _assert_counts_are_the_jobs(repository)

        # Claimed (no count changes), admitted, then ended every way a job ends.
        claim(repository, alone[:2])
        repository.record_outcomes([], started=dict.fromkeys(alone[:2], utcnow()))
        _assert_counts_are_the_jobs(repository)
        repository.record_outcomes([JobOutcome(alone[0], "answer", None, 1, 0, utcnow()),
                                    JobOutcome(many[0].job_id, None, "failed", 0, 0, utcnow())])
        repository.cancel_many([alone[4], many[1].job_id])
        _assert_counts_are_the_jobs(repository)

        # Removed after a failed enqueue.
        repository.forget_submitted([alone[3], many[2].job_id])
        _assert_counts_are_the_jobs(repository)

        # Moved off shard 0 to shard 9 at a new load; a running job queued again.
        moved = repository.move_jobs(0, [QueueMessage(9, [alone[2], alone[5]], "moved")],
                                     {alone[2]: Route(9, 4, 40), alone[5]: Route(9, 4, 50)},
                                     unclaimed_only=False)
        assert moved == {alone[2], alone[5]}
        repository.assign_messages([QueueMessage(0, [alone[1]], "again")])
        _assert_counts_are_the_jobs(repository)


def test_a_fold_keeps_the_sums_in_a_row_per_shard_model_and_status(store: Store) -> None:
    jobs = [record_queued_job(store, shard=9, load=load) for load in range(1, 6)]
    store.record_outcomes([], started=dict.fromkeys(jobs[:3], utcnow()))
    store.cancel_many(jobs[3:])
    assert _count_rows(store) > len(_rows_of_the_sums(store))
    store.fold_active_counts()
    assert _count_rows(store) == len(_rows_of_the_sums(store))
    _assert_counts_are_the_jobs(store)


def _rows_of_the_sums(store: Store) -> set[tuple[int, str, str]]:
    """The keys a fold keeps a row for: those whose jobs or load sum to anything."""
    counts = active_job_counts.c
    with store.engine.connect() as connection:
        return set(connection.execute(
            select(counts.shard, counts.model, counts.status)
            .group_by(counts.shard, counts.model, counts.status)
            .having((func.sum(counts.jobs) != 0) | (func.sum(counts.load) != 0))).all())


def _migrate(url: str, revision: str, *, down: bool = False) -> None:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.attributes["database_url"] = url
    (command.downgrade if down else command.upgrade)(config, revision)


def _triggers(url: str) -> set[str]:
    with psycopg.connect(url) as connection:
        return {name for (name,) in connection.execute(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = 'jobs'::regclass "
            "AND NOT tgisinternal")}


def test_the_migration_counts_the_jobs_already_there_and_its_downgrade_drops_the_counts(
        ) -> None:
    name = TEST_DATABASE + "_counts"
    url = empty_database(name)
    try:
        _migrate(url, "0015")
        with psycopg.connect(url) as connection:
            connection.execute("INSERT INTO documents (key, text_zst, tokens, created_at) "
                               "VALUES ('d', '', 1, now())")
            connection.execute(
                "INSERT INTO jobs (id, document_key, question, sampling, model, shard, status, "
                "prompt_tokens, estimated_prefill, load, submitted_at) "
                "SELECT n::text, 'd', 'q', '{}', 'm' || n % 2, n % 3, "
                "(ARRAY['queued', 'running', 'succeeded'])[n % 3 + 1], 1, 1, n, now() "
                "FROM generate_series(1, 60) AS n")
        _migrate(url, "head")
        store = Store(url)
        try:
            assert store.active_load()
            _assert_counts_are_the_jobs(store)
            with psycopg.connect(url) as connection:
                connection.execute("TRUNCATE jobs CASCADE")
            assert store.active_counts() == {} == store.active_load()
        finally:
            store.dispose()
        _migrate(url, "0015", down=True)
        assert _triggers(url) == {"jobs_notify_finished"}
        with psycopg.connect(url) as connection:
            assert connection.execute(
                "SELECT to_regclass('active_job_counts'), "
                "to_regprocedure('jobsvc_count_active_jobs()')").fetchone() == (None, None)
    finally:
        drop_database(name)
