"""Store each document's tokens beside its text.

Queue messages name documents instead of carrying them, and workers read the tokens the
producer computed from here. Documents recorded before have none; workers tokenize their text.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add `tokens_zst` to documents, empty for those already recorded."""
    with op.batch_alter_table("documents") as documents:
        documents.add_column(sa.Column("tokens_zst", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    """Drop `tokens_zst`; workers tokenize every document's text again."""
    with op.batch_alter_table("documents") as documents:
        documents.drop_column("tokens_zst")
