"""Webhook deliveries in the database: an outbox of one row per event and endpoint.

A batch's end writes its rows in the transaction that ends it (`add_deliveries`), so an event
is sent if and only if the state it announces committed, and a crash between the two cannot
lose or invent one. A server's sender takes due rows under a lease (`take_due`: on PostgreSQL
`FOR UPDATE SKIP LOCKED`, so two servers never take one row at once; the lease is the row's
next attempt time pushed past the send's timeout, so a server that dies mid-send leaves the
row due again), then marks it delivered or due again later. The body is kept as sent, so
every attempt carries the same bytes; only the timestamp and signature are made anew."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import insert, select, update
from sqlalchemy.engine import Connection

from jobsvc.store.database import Database
from jobsvc.store.records import utcnow
from jobsvc.store.tables import WebhookDelivery

# Longest refusal a row keeps (the reason the endpoint's last attempt failed).
_ERROR_CHARS = 200


@dataclass(frozen=True)
class Delivery:
    """A delivery taken for one attempt: where to, what, and which attempt this is."""

    id: int
    event_id: str
    endpoint: str
    body: bytes
    # Attempts so far, this one included.
    attempts: int


def add_deliveries(connection: Connection, event_id: str, body: bytes,
                   endpoints: Sequence[str]) -> None:
    """One delivery of the event to each endpoint, due now, in `connection`'s transaction."""
    if not endpoints:
        return
    now = utcnow()
    connection.execute(insert(WebhookDelivery), [
        {"event_id": event_id, "endpoint": endpoint, "body": body, "attempts": 0,
         "created_at": now, "next_attempt_at": now} for endpoint in endpoints])


class WebhookDeliveries(Database):
    """Taking due deliveries and recording how each attempt went."""

    def take_due(self, limit: int, lease_seconds: float) -> list[Delivery]:
        """Up to `limit` due deliveries, oldest due first, counted as attempted and held for
        `lease_seconds` (no other sender takes them meanwhile)."""
        now = utcnow()
        due = (select(WebhookDelivery.id)
               .where(WebhookDelivery.delivered_at.is_(None),
                      WebhookDelivery.next_attempt_at <= now)
               .order_by(WebhookDelivery.next_attempt_at).limit(limit)
               .with_for_update(skip_locked=True))
        with self.engine.begin() as connection:
            rows = connection.execute(
                update(WebhookDelivery).where(WebhookDelivery.id.in_(due.scalar_subquery()))
                .values(attempts=WebhookDelivery.attempts + 1,
                        next_attempt_at=now + timedelta(seconds=lease_seconds))
                .returning(WebhookDelivery.id, WebhookDelivery.event_id,
                           WebhookDelivery.endpoint, WebhookDelivery.body,
                           WebhookDelivery.attempts)).all()
        return sorted((Delivery(*row) for row in rows), key=lambda delivery: delivery.id)

    def delivered(self, delivery: Delivery) -> None:
        """The endpoint acknowledged the event: it is never sent there again."""
        with self.engine.begin() as connection:
            connection.execute(
                update(WebhookDelivery).where(WebhookDelivery.id == delivery.id,
                                              WebhookDelivery.delivered_at.is_(None))
                .values(delivered_at=utcnow(), last_error=None))

    def retry_later(self, delivery: Delivery, delay_seconds: float, error: str) -> None:
        """The endpoint refused the attempt (`error` says how): due again in `delay_seconds`,
        unless it was acknowledged or taken again meanwhile."""
        with self.engine.begin() as connection:
            connection.execute(
                update(WebhookDelivery).where(WebhookDelivery.id == delivery.id,
                                              WebhookDelivery.attempts == delivery.attempts,
                                              WebhookDelivery.delivered_at.is_(None))
                .values(next_attempt_at=utcnow() + timedelta(seconds=delay_seconds),
                        last_error=error[:_ERROR_CHARS]))
