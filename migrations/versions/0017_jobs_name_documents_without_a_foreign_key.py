"""Jobs name their documents without a foreign key, and without an index on that name.

PostgreSQL checks a foreign key row by row, with a lookup in the documents' index for each
job: that was two fifths of what inserting a submit's jobs cost the database. The reference
needs no check: a job's document is written by the same statement or transaction as the job
(or was committed before it), and documents are never deleted. Nothing looks jobs up by
document, so the index only served the key. SQLite, the demo's file, keeps both: dropping a
constraint there means copying the table, for a check that costs it little.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-08
"""

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Drop the jobs' foreign key to documents and the index of document keys."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_constraint("jobs_document_key_fkey", "jobs", type_="foreignkey")
    op.drop_index("ix_jobs_document_key", "jobs")


def downgrade() -> None:
    """Put them back."""
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_index("ix_jobs_document_key", "jobs", ["document_key"])
    op.create_foreign_key("jobs_document_key_fkey", "jobs", "documents", ["document_key"],
                          ["key"])
