"""Create documents, jobs, results and batch_stats.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    """Create the four tables with their indexes."""
    op.create_table(
        "documents",
        sa.Column("key", sa.String(32), primary_key=True),
        sa.Column("text_zst", sa.LargeBinary(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", _TIMESTAMP, nullable=False),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("document_key", sa.String(32), sa.ForeignKey("documents.key"), nullable=False),
        sa.Column("question", sa.Text(), nullable=False),
        sa.Column("sampling", sa.JSON(), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("estimated_prefill", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("worker", sa.String(200), nullable=True),
        sa.Column("submitted_at", _TIMESTAMP, nullable=False),
        sa.Column("started_at", _TIMESTAMP, nullable=True),
        sa.Column("finished_at", _TIMESTAMP, nullable=True),
    )
    op.create_index("ix_jobs_document_key", "jobs", ["document_key"])
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_table(
        "results",
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("answer_zst", sa.LargeBinary(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", _TIMESTAMP, nullable=False),
    )
    op.create_table(
        "batch_stats",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("worker", sa.String(200), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("jobs", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("started_at", _TIMESTAMP, nullable=False),
        sa.Column("finished_at", _TIMESTAMP, nullable=False),
        sa.Column("wall_seconds", sa.Float(), nullable=False),
        sa.Column("requests_per_second", sa.Float(), nullable=False),
        sa.Column("tokens_per_second", sa.Float(), nullable=False),
    )
    op.create_index("ix_batch_stats_shard", "batch_stats", ["shard"])


def downgrade() -> None:
    """Drop the four tables, dependents first."""
    op.drop_table("batch_stats")
    op.drop_table("results")
    op.drop_table("jobs")
    op.drop_table("documents")
