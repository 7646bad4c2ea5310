"""Keep what an answer holds beyond its text: several choices and log probabilities.

A job may ask for `n` answers and for the log probability of each token; they are written as
one compressed frame beside the answer's text, which stays the first choice's. Results
written before this revision, and jobs that ask for neither, have none.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add `results.choices_zst`, empty for results already written."""
    with op.batch_alter_table("results") as results:
        results.add_column(sa.Column("choices_zst", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    """Drop `results.choices_zst`: answers keep their first choice's text alone."""
    with op.batch_alter_table("results") as results:
        results.drop_column("choices_zst")
