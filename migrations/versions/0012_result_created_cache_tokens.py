"""Record how many prompt tokens each answer's request wrote into the engine's prefix cache.

vLLM's server reports it beside the cached tokens (`created_cache_tokens`), and the Responses
API as `cache_write_tokens`; results written before this revision have none.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add `results.created_cache_tokens`, empty for results already written."""
    with op.batch_alter_table("results") as results:
        results.add_column(sa.Column("created_cache_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop `results.created_cache_tokens`."""
    with op.batch_alter_table("results") as results:
        results.drop_column("created_cache_tokens")
