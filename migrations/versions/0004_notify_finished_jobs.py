"""Notify listeners when a statement finishes jobs.

Waiting producers listen on the channel `jobsvc_finished`. A statement-level trigger sends the
notification from within the statement that moved jobs to a finished status, and PostgreSQL
delivers it at commit (never for a rollback). No writer spends a round trip of its own on it,
and no path that finishes jobs can leave it out. SQLite has no notifications: nothing to do.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the trigger and its function on PostgreSQL; nothing on SQLite."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("""
        CREATE FUNCTION jobsvc_notify_finished() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF EXISTS (SELECT 1 FROM changed
                       WHERE status IN ('succeeded', 'failed', 'cancelled')) THEN
                PERFORM pg_notify('jobsvc_finished', '');
            END IF;
            RETURN NULL;
        END
        $$""")
    op.execute("""
        CREATE TRIGGER jobs_notify_finished AFTER UPDATE ON jobs
        REFERENCING NEW TABLE AS changed
        FOR EACH STATEMENT EXECUTE FUNCTION jobsvc_notify_finished()""")


def downgrade() -> None:
    """Drop the trigger and its function on PostgreSQL."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER jobs_notify_finished ON jobs")
    op.execute("DROP FUNCTION jobsvc_notify_finished()")
