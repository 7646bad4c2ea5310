"""Record why the engine ended each answer (`stop` or `length`).

The batch API's responses carry a `finish_reason`; guessed from the token count, an answer that
ended on its end-of-sequence token exactly at the limit read as `length`. Results written
before this revision have none, and keep the guess.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add `results.finish_reason`, empty for results already written."""
    with op.batch_alter_table("results") as results:
        results.add_column(sa.Column("finish_reason", sa.String(16), nullable=True))


def downgrade() -> None:
    """Drop `results.finish_reason`; responses guess it from the token count again."""
    with op.batch_alter_table("results") as results:
        results.drop_column("finish_reason")
