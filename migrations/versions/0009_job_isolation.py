"""Record how far each suspect job's group has been halved.

A job whose engine died under it runs again in a group with nothing else in the engine; each
time its group kills the engine, it runs next in groups of at most half as many, until the
job that kills it runs alone. `isolation` is that level; jobs recorded before this revision
start at 0, as jobs no engine died under.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add `jobs.isolation`, 0 for jobs already recorded."""
    with op.batch_alter_table("jobs") as jobs:
        jobs.add_column(sa.Column("isolation", sa.SmallInteger(), nullable=False,
                                  server_default="0"))


def downgrade() -> None:
    """Drop `jobs.isolation`."""
    with op.batch_alter_table("jobs") as jobs:
        jobs.drop_column("isolation")
