"""Keep how a batch line's answer is read as tool calls.

A chat line with `tools` and a `tool_choice` that makes calls has its answer turned into tool
calls when the batch's output is written; the line's plan for that (the choice, the function
it names, the tools for a parser) is kept with the line. Lines written before this revision,
and lines answered with text, have none.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add `batch_lines.tool_plan`, empty for lines already written."""
    with op.batch_alter_table("batch_lines") as lines:
        lines.add_column(sa.Column("tool_plan", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop `batch_lines.tool_plan`: every answer is read as text."""
    with op.batch_alter_table("batch_lines") as lines:
        lines.drop_column("tool_plan")
