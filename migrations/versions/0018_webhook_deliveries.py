"""Webhook deliveries: the outbox of the events sent when batches end.

A batch that reaches a final state writes one row per configured endpoint in the transaction
that sets that state: the event's ID and exact body, the attempts so far, when the next one is
due and when the endpoint acknowledged it. Servers send due rows and keep them until they are
acknowledged (`jobsvc.webhooks`); an index of the undelivered rows by due time is all their
polling reads.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-08
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_STAMP = sa.DateTime(timezone=True)
_UNDELIVERED = sa.text("delivered_at IS NULL")


def upgrade() -> None:
    """Create `webhook_deliveries` with its index of undelivered rows."""
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("event_id", sa.String(40), nullable=False),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("created_at", _STAMP, nullable=False),
        sa.Column("next_attempt_at", _STAMP, nullable=False),
        sa.Column("delivered_at", _STAMP, nullable=True),
        sa.Column("last_error", sa.String(200), nullable=True),
        sa.UniqueConstraint("event_id", "endpoint", name="uq_webhook_deliveries_event_endpoint"))
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["next_attempt_at"],
                    postgresql_where=_UNDELIVERED, sqlite_where=_UNDELIVERED)


def downgrade() -> None:
    """Drop it, and with it every delivery not yet acknowledged."""
    op.drop_table("webhook_deliveries")
