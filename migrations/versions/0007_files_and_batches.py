"""The OpenAI Batch API's state, and idempotent submits.

`files` and `file_chunks` hold uploaded and produced files as 1 MiB chunks, so neither an
upload nor a download is ever whole in memory. `batches` holds each batch with its lease (which
server drives it, until when) and `batch_lines` each request line: its custom_id, its job, or
the error that kept it from becoming one. `jobs.idempotency_key` (unique) lets a producer that
retries a submit get the job it already made instead of a second one.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_STAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    """Add `jobs.idempotency_key` and create the tables of files, batches and their lines."""
    with op.batch_alter_table("jobs") as jobs:
        jobs.add_column(sa.Column("idempotency_key", sa.String(128), nullable=True))
        jobs.create_index("ix_jobs_idempotency_key", ["idempotency_key"], unique=True)
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", _STAMP, nullable=False))
    op.create_index("ix_files_created_at", "files", ["created_at"])
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.String(40), sa.ForeignKey("files.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("seq", sa.Integer(), primary_key=True),
        sa.Column("data", sa.LargeBinary(), nullable=False))
    op.create_table(
        "batches",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(40), nullable=False),
        sa.Column("completion_window", sa.String(8), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("ending", sa.String(16), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("completed", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("failed", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("ingested_line", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("usage", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(40), nullable=True),
        sa.Column("error_file_id", sa.String(40), nullable=True),
        sa.Column("driver", sa.String(64), nullable=True),
        sa.Column("lease_until", _STAMP, nullable=True),
        *(sa.Column(name, _STAMP, nullable=name != "created_at") for name in (
            "created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at",
            "failed_at", "expired_at", "cancelling_at", "cancelled_at")))
    op.create_index("ix_batches_created_at", "batches", ["created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(40), sa.ForeignKey("batches.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("line", sa.Integer(), primary_key=True),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("job_id", sa.String(32), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop the batch API's tables and `jobs.idempotency_key`."""
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("file_chunks")
    op.drop_table("files")
    with op.batch_alter_table("jobs") as jobs:
        jobs.drop_index("ix_jobs_idempotency_key")
        jobs.drop_column("idempotency_key")
