"""Count unfinished jobs by shard, model and status as their changes happen, on PostgreSQL.

The reconciler compares each shard's load in Redis with what the store's unfinished jobs hold
at every round, and `jobsvc status` counts them by shard and by model: grouping the jobs
themselves reads every unfinished job, so both grew with the backlog. Statement-level triggers
on `jobs` now append one row per (shard, model, status) that a statement changed, with the
change in jobs and in load, to `active_job_counts`; the counts are the sums of its rows, a read
as long as the table. Rows are only ever appended, never updated, so concurrent submits, claims
and outcomes never wait on one another for a counter; a fold (`jobsvc.store.counts`) replaces
the rows by their sums, in one statement, to keep the table short. The table starts with the
sums of the jobs unfinished now. SQLite (the embedded demo) keeps counting the jobs.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-08
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

_ACTIVE = "status IN ('queued', 'running')"

# One function for every event: inserted jobs count in, deleted ones out, an update counts its
# jobs out as they were and in as they are (keys whose changes cancel out add no row), and a
# TRUNCATE of the jobs leaves nothing to count.
_COUNT_FUNCTION = f"""
CREATE FUNCTION jobsvc_count_active_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO active_job_counts (shard, model, status, jobs, load)
        SELECT shard, model, status, count(*), sum(load) FROM new_jobs
        WHERE {_ACTIVE} GROUP BY shard, model, status;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO active_job_counts (shard, model, status, jobs, load)
        SELECT shard, model, status, -count(*), -sum(load) FROM old_jobs
        WHERE {_ACTIVE} GROUP BY shard, model, status;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO active_job_counts (shard, model, status, jobs, load)
        SELECT shard, model, status, sum(jobs), sum(load) FROM (
            SELECT shard, model, status, 1 AS jobs, load FROM new_jobs WHERE {_ACTIVE}
            UNION ALL
            SELECT shard, model, status, -1, -load FROM old_jobs WHERE {_ACTIVE}) AS changed
        GROUP BY shard, model, status HAVING sum(jobs) <> 0 OR sum(load) <> 0;
    ELSE
        DELETE FROM active_job_counts;
    END IF;
    RETURN NULL;
END
$$"""

_TRIGGERS = {
    "jobs_count_inserted": "AFTER INSERT ON jobs REFERENCING NEW TABLE AS new_jobs",
    "jobs_count_deleted": "AFTER DELETE ON jobs REFERENCING OLD TABLE AS old_jobs",
    "jobs_count_updated": ("AFTER UPDATE ON jobs REFERENCING OLD TABLE AS old_jobs "
                           "NEW TABLE AS new_jobs"),
    "jobs_count_truncated": "AFTER TRUNCATE ON jobs",
}


def upgrade() -> None:
    """Create the table, its function and triggers, then count the unfinished jobs into it
    (under the triggers' lock, which holds every writer of jobs off until the commit)."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_table(
        "active_job_counts",
        sa.Column("shard", sa.Integer, nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("jobs", sa.BigInteger, nullable=False),
        sa.Column("load", sa.BigInteger, nullable=False))
    op.execute(_COUNT_FUNCTION)
    for name, event in _TRIGGERS.items():
        op.execute(f"CREATE TRIGGER {name} {event} "
                   "FOR EACH STATEMENT EXECUTE FUNCTION jobsvc_count_active_jobs()")
    op.execute("INSERT INTO active_job_counts (shard, model, status, jobs, load) "
               "SELECT shard, model, status, count(*), sum(load) FROM jobs "
               f"WHERE {_ACTIVE} GROUP BY shard, model, status")


def downgrade() -> None:
    """Drop the triggers, their function and the table."""
    if op.get_bind().dialect.name != "postgresql":
        return
    for name in _TRIGGERS:
        op.execute(f"DROP TRIGGER {name} ON jobs")
    op.execute("DROP FUNCTION jobsvc_count_active_jobs()")
    op.drop_table("active_job_counts")
