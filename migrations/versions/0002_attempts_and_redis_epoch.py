"""Count deliveries per job and remember which Redis a job was enqueued into.

`attempts` lets a worker give up on a job that keeps killing it; `redis_epoch` lets the
reconciler find jobs whose queue message vanished with a restarted Redis.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add `attempts` (0 for jobs already recorded) and `redis_epoch` to jobs."""
    with op.batch_alter_table("jobs") as jobs:
        jobs.add_column(sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"))
        jobs.add_column(sa.Column("redis_epoch", sa.String(32), nullable=True))


def downgrade() -> None:
    """Drop the two columns."""
    with op.batch_alter_table("jobs") as jobs:
        jobs.drop_column("redis_epoch")
        jobs.drop_column("attempts")
