"""Index the unfinished jobs alone, by send time and by message.

Reconciliation checks each message once after it was sent, in the order messages were sent,
and sweeps every unfinished job in turn by message, sending a lost message's jobs again
together: each reads only unfinished jobs, however many have finished. Partial indexes keep
those reads, and what each insert costs, proportional to the unfinished jobs.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_UNFINISHED = sa.text("status IN ('queued', 'running')")


def upgrade() -> None:
    """Add the two partial indexes of unfinished jobs."""
    op.create_index("ix_jobs_unfinished_sent", "jobs", ["enqueued_at", "id"],
                    postgresql_where=_UNFINISHED, sqlite_where=_UNFINISHED)
    op.create_index("ix_jobs_unfinished_message", "jobs", ["message_id"],
                    postgresql_where=_UNFINISHED, sqlite_where=_UNFINISHED)


def downgrade() -> None:
    """Drop them."""
    op.drop_index("ix_jobs_unfinished_message", "jobs")
    op.drop_index("ix_jobs_unfinished_sent", "jobs")
