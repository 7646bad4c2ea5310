"""Webhooks announcing a batch's end, signed as OpenAI signs its own (Standard Webhooks).

`batch_event` renders the event a batch's final state announces, in the shape of the official
client's `batch.*` webhook events; `signed_headers` signs an attempt: `webhook-signature` is
`v1,` and the base64 HMAC-SHA256, keyed by the secret's key, of `{webhook-id}.{timestamp}.{body}`,
which `openai.OpenAI().webhooks.unwrap(body, headers, secret=...)` verifies. The event is
written to the outbox in the transaction that ends the batch (`jobsvc.store.webhooks`);
`WebhookSender`, a thread of `jobsvc serve`, POSTs each due delivery and keeps one an endpoint
refuses, waiting twice as long after each refusal up to the longest wait, until the endpoint
answers 2xx. An event goes out at least once per endpoint and, once its acknowledgement is
recorded, never again there; receivers drop repeats by `webhook-id`, the event's ID, the same
on every attempt."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx

from jobsvc.settings import Settings, masked_url
from jobsvc.store.webhooks import Delivery, WebhookDeliveries

log = logging.getLogger(__name__)

# The event each final state of a batch announces.
BATCH_EVENTS = {"completed": "batch.completed", "failed": "batch.failed",
                "expired": "batch.expired", "cancelled": "batch.cancelled"}
# Deliveries taken per round, all sent at once (so a lease need outlast one timeout only).
_PAGE = 8
# Seconds between rounds while nothing is due.
_ROUND_SECONDS = 1.0
# How far a taken delivery's lease outlasts its attempt's timeout.
_LEASE_MARGIN_SECONDS = 10.0


def batch_event(batch_id: str, status: str, ended_at: datetime) -> tuple[str, bytes]:
    """A new event's ID and body announcing that batch `batch_id` ended in `status` (a final
    state) at `ended_at`."""
    event_id = f"evt_{uuid.uuid4().hex}"
    event = {"id": event_id, "object": "event", "created_at": int(ended_at.timestamp()),
             "type": BATCH_EVENTS[status], "data": {"id": batch_id}}
    return event_id, json.dumps(event, separators=(",", ":")).encode()


def signature(key: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` of a body sent under `webhook_id` at `timestamp`."""
    mac = hmac.new(key, f"{webhook_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def signed_headers(key: bytes, webhook_id: str, timestamp: int, body: bytes
                   ) -> dict[str, str]:
    """The headers of one attempt to deliver `body`, signed at `timestamp` (Unix seconds:
    receivers refuse an old one, so each attempt is signed anew)."""
    return {"content-type": "application/json", "webhook-id": webhook_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(key, webhook_id, timestamp, body)}


def retry_delay(attempts: int, first: float, longest: float) -> float:
    """Seconds to wait after `attempts` refused attempts: `first`, doubled for each further
    one, at most `longest`."""
    return min(longest, first * 2.0 ** min(attempts - 1, 64))


class WebhookSender:
    """Sends every due delivery of the outbox, each round a page at once, for the server's
    life; what an endpoint refuses waits and is sent again."""

    def __init__(self, settings: Settings, deliveries: WebhookDeliveries) -> None:
        self._key = settings.webhook_key
        self._first_retry = settings.webhook_retry_seconds
        self._longest_retry = settings.webhook_retry_max_seconds
        self._lease = settings.webhook_timeout_seconds + _LEASE_MARGIN_SECONDS
        self._deliveries = deliveries
        # Redirects are not followed: an endpoint acknowledges with 2xx itself.
        self._http = httpx.Client(timeout=settings.webhook_timeout_seconds,
                                  follow_redirects=False)
        self._sending = ThreadPoolExecutor(_PAGE, thread_name_prefix="webhook-send")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Send in a thread of its own, so no request or batch waits on an endpoint."""
        self._thread = threading.Thread(target=self._run, name="webhook-sender", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Let the attempts under way end, then close the connections; what is left is sent
        by the next server to run (a delivery taken and not finished, once its lease ends)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sending.shutdown()
        self._http.close()

    def run_round(self) -> int:
        """Send a page of due deliveries; how many were sent."""
        due = self._deliveries.take_due(_PAGE, self._lease)
        list(self._sending.map(self._send, due))
        return len(due)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                full = self.run_round() == _PAGE
            except Exception:
                log.exception("webhook round failed; trying again")
                full = False
            if not full:
                self._stop.wait(_ROUND_SECONDS)

    def _send(self, delivery: Delivery) -> None:
        headers = signed_headers(self._key, delivery.event_id, int(time.time()), delivery.body)
        try:
            response = self._http.post(delivery.endpoint, content=delivery.body,
                                       headers=headers)
            refusal = None if response.is_success else f"HTTP {response.status_code}"
        except httpx.HTTPError as error:
            refusal = f"{type(error).__name__}: {error}"
        if refusal is None:
            self._deliveries.delivered(delivery)
            return
        delay = retry_delay(delivery.attempts, self._first_retry, self._longest_retry)
        self._deliveries.retry_later(delivery, delay, refusal)
        log.warning("webhook %s to %s refused (%s) at attempt %d; next in %.1f s",
                    delivery.event_id, masked_url(delivery.endpoint), refusal,
                    delivery.attempts, delay)
