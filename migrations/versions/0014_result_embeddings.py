"""Keep an embedding job's vectors with its result.

An embedding job answers with one vector per input instead of text; they are written as one
compressed frame of float32 beside its (empty) answer. Results of generating jobs, and those
written before this revision, have none.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add `results.embeddings_zst`, empty for results already written."""
    with op.batch_alter_table("results") as results:
        results.add_column(sa.Column("embeddings_zst", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    """Drop `results.embeddings_zst`."""
    with op.batch_alter_table("results") as results:
        results.drop_column("embeddings_zst")
