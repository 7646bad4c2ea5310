"""Batch webhooks from a real `jobsvc serve` to endpoints on loopback: each event verified by
the official `openai` client's `webhooks.unwrap`, and an endpoint down at first receiving
every event once it is back, and once only. No worker runs: the batches end failed (their file
is refused) or cancelled (their jobs wait in a queue nobody consumes)."""

from __future__ import annotations

import base64
import json
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from openai.types.webhooks import BatchCancelledWebhookEvent, BatchFailedWebhookEvent
from sqlalchemy import select

from jobsvc.child_processes import ServerProcess
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.store.tables import WebhookDelivery
from tests.support.batch_files import CHAT, line, start_batch, upload, wait_for
from tests.support.batch_server import API_KEY, openai_client, server_process
from tests.support.environment import (
    ROUTING_REDIS_URL,
    TEST_DATABASE,
    free_port,
    recreate_database,
)
from tests.support.waiting import until

pytestmark = pytest.mark.integration

SECRET = "whsec_" + base64.b64encode(b"the integration tests' own key").decode()
REFUSED_FILE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"\n'


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    body: bytes

    @property
    def event(self) -> dict[str, Any]:
        return json.loads(self.body)  # type: ignore[no-any-return]


class Receiver:
    """A webhook endpoint on a loopback port: records every POST and acknowledges it."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/hook"
        self.received: list[Received] = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                received.append(Received({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def of_batch(self, batch_id: str) -> list[Received]:
        return [item for item in list(self.received) if item.event["data"]["id"] == batch_id]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


@dataclass
class Hooked:
    api: openai.OpenAI
    store: Store
    # An endpoint up from the start.
    up: Receiver
    # The port of an endpoint down until a test starts one there.
    later_port: int


@pytest.fixture(scope="module")
def hooked(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hooked]:
    """A `jobsvc serve` announcing batches to two endpoints, one of them down, retrying
    within a second; its batches are in a database of their own, its jobs go to a Redis
    database no worker consumes."""
    database_url = recreate_database(TEST_DATABASE + "_webhooks")
    up, later_port = Receiver(free_port()), free_port()
    served = replace(settings, api_key=API_KEY, redis_url=ROUTING_REDIS_URL,
                     database_url=database_url,
                     webhook_urls=f"{up.url},http://127.0.0.1:{later_port}/hook",
                     webhook_secret=SECRET, webhook_retry_seconds=0.2,
                     webhook_retry_max_seconds=0.5, webhook_timeout_seconds=2)
    log: Path = tmp_path_factory.mktemp("webhooks") / "serve.log"
    server: ServerProcess = server_process(served, log)
    store = Store(database_url)
    try:
        server.start()
        yield Hooked(openai_client(server.url), store, up, later_port)
    finally:
        server.stop()
        up.stop()
        store.dispose()
        redis.Redis.from_url(ROUTING_REDIS_URL).flushdb()


def _failed_batch(api: openai.OpenAI) -> str:
    batch = api.batches.create(input_file_id=upload(api, REFUSED_FILE), endpoint=CHAT,
                               completion_window="24h")
    assert wait_for(api, batch.id).status == "failed"
    return batch.id


def _attempts(store: Store, batch_id: str, endpoint_port: int) -> int:
    with store.engine.connect() as connection:
        rows = connection.execute(select(WebhookDelivery.body, WebhookDelivery.attempts).where(
            WebhookDelivery.endpoint.contains(f":{endpoint_port}/"))).all()
    return sum(attempts for body, attempts in rows if json.loads(body)["data"]["id"] == batch_id)


def test_a_batch_refused_at_validation_announces_batch_failed_signed(hooked: Hooked) -> None:
    batch_id = _failed_batch(hooked.api)
    [received] = until("batch.failed received", lambda: hooked.up.of_batch(batch_id))
    event = openai.OpenAI(api_key="unused").webhooks.unwrap(received.body, received.headers,
                                                            secret=SECRET)
    assert isinstance(event, BatchFailedWebhookEvent)
    assert (event.type, event.data.id, event.id) == (
        "batch.failed", batch_id, received.headers["webhook-id"])
    assert hooked.api.batches.retrieve(batch_id).failed_at == event.created_at


def test_a_cancelled_batch_announces_batch_cancelled(hooked: Hooked) -> None:
    batch = start_batch(hooked.api, [line("a", {"messages": [{"role": "user",
                                                              "content": "hi"}]})])
    assert hooked.api.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    assert wait_for(hooked.api, batch.id).status == "cancelled"
    [received] = until("batch.cancelled received", lambda: hooked.up.of_batch(batch.id))
    event = openai.OpenAI(api_key="unused").webhooks.unwrap(received.body, received.headers,
                                                            secret=SECRET)
    assert isinstance(event, BatchCancelledWebhookEvent) and event.data.id == batch.id


def test_an_endpoint_down_at_first_gets_each_event_once_when_it_is_back(
        hooked: Hooked) -> None:
    first = _failed_batch(hooked.api)
    until("the endpoint that is down refused twice",
          lambda: _attempts(hooked.store, first, hooked.later_port) >= 2)
    back = Receiver(hooked.later_port)
    try:
        until("the event received once back", lambda: back.of_batch(first))
        # A later event arriving shows the sender went on after the first was acknowledged.
        second = _failed_batch(hooked.api)
        until("a later event received", lambda: back.of_batch(second))
        ids = Counter(item.headers["webhook-id"] for item in back.received)
    finally:
        back.stop()
    assert len(back.of_batch(first)) == 1 and set(ids.values()) == {1}, ids
    webhooks = openai.OpenAI(api_key="unused").webhooks
    assert all(webhooks.unwrap(item.body, item.headers, secret=SECRET)
               for item in back.received)
    assert set(Counter(item.headers["webhook-id"] for item in hooked.up.received).values()) == {1}
