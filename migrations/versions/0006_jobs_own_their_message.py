"""Make a job's record the whole truth about it, and queue messages only pointers to it.

`question_tokens_zst` and `load` (what the router charged the job's shard) move off the wire
into the record, so a forged or duplicated message cannot change what a job runs or what it
returns to the router. `message_id` names the one queue message that may run the job, and
`enqueued_at` when it was sent: reconciliation finds jobs whose message is gone by those two,
under any Redis, which makes `redis_epoch` unnecessary.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the four columns, drop `redis_epoch`, and give unfinished jobs a load and an enqueue time
    so reconciliation can find them."""
    with op.batch_alter_table("jobs") as jobs:
        jobs.add_column(sa.Column("question_tokens_zst", sa.LargeBinary(), nullable=True))
        jobs.add_column(sa.Column("load", sa.BigInteger(), nullable=False, server_default="0"))
        jobs.add_column(sa.Column("message_id", sa.String(32), nullable=True))
        jobs.add_column(sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=True))
        jobs.drop_column("redis_epoch")
    # Jobs enqueued before this revision were charged their estimated prefill; they have no
    # message ID, so reconciliation sends each of them again in a message of its own making.
    op.execute("UPDATE jobs SET load = estimated_prefill, enqueued_at = submitted_at "
               "WHERE status IN ('queued', 'running')")


def downgrade() -> None:
    """Drop the four columns and bring `redis_epoch` back, empty."""
    with op.batch_alter_table("jobs") as jobs:
        jobs.add_column(sa.Column("redis_epoch", sa.String(32), nullable=True))
        jobs.drop_column("enqueued_at")
        jobs.drop_column("message_id")
        jobs.drop_column("load")
        jobs.drop_column("question_tokens_zst")
