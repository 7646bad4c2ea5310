"""Say in each finished-jobs notification how many jobs its statement finished.

A producer waiting for a burst checked its jobs at every notification, many times per burst,
each check costing the producer and the database a little of the engines' cores. With the
count in the payload it can sum the notifications since its last check and check again only
once they could cover every job it still waits for. The count is followed by a random UUID:
PostgreSQL delivers identical payloads of one transaction only once, which would undercount
two statements that finish as many jobs each.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _notify(payload: str) -> str:
    return f"""
        CREATE OR REPLACE FUNCTION jobsvc_notify_finished() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE
            finished bigint;
        BEGIN
            SELECT count(*) INTO finished FROM changed
            WHERE status IN ('succeeded', 'failed', 'cancelled');
            IF finished > 0 THEN
                PERFORM pg_notify('jobsvc_finished', {payload});
            END IF;
            RETURN NULL;
        END
        $$"""


def upgrade() -> None:
    """Replace the trigger's function with one whose payload is the count and a UUID."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(_notify("finished || ' ' || gen_random_uuid()"))


def downgrade() -> None:
    """Go back to the empty payload."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(_notify("''"))
