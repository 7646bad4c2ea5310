"""Batch webhooks as the official `openai` client reads them: the event's shape, the signature
its `webhooks.unwrap` verifies, the waits between attempts, and the settings they need."""

from __future__ import annotations

import base64
import json
import time
from datetime import UTC, datetime

import openai
import pytest
from openai.types.webhooks import (
    BatchCancelledWebhookEvent,
    BatchCompletedWebhookEvent,
    BatchExpiredWebhookEvent,
    BatchFailedWebhookEvent,
)

from jobsvc.errors import ConfigurationError
from jobsvc.settings import Settings
from jobsvc.webhooks import BATCH_EVENTS, batch_event, retry_delay, signed_headers

pytestmark = pytest.mark.unit

SECRET = "whsec_" + base64.b64encode(b"a key of thirty-two bytes, random").decode()
EVENT_CLASSES = {"completed": BatchCompletedWebhookEvent, "failed": BatchFailedWebhookEvent,
                 "expired": BatchExpiredWebhookEvent, "cancelled": BatchCancelledWebhookEvent}


def _key(secret: str = SECRET) -> bytes:
    return Settings.from_env({"JOBSVC_WEBHOOK_URLS": "http://127.0.0.1:9/hook",
                              "JOBSVC_WEBHOOK_SECRET": secret}).webhook_key


@pytest.mark.parametrize("status", sorted(BATCH_EVENTS))
def test_the_official_client_verifies_and_reads_each_batch_event(status: str) -> None:
    ended = datetime(2026, 12, 8, 1, 2, 3, tzinfo=UTC)
    event_id, body = batch_event("batch_abc", status, ended)
    headers = signed_headers(_key(), event_id, int(time.time()), body)
    event = openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=SECRET)
    assert type(event) is EVENT_CLASSES[status]
    assert (event.id, event.type, event.object, event.data.id, event.created_at) == (
        event_id, f"batch.{status}", "event", "batch_abc", int(ended.timestamp()))
    # Every field the client's type asks for, checked strictly (unwrap only constructs it).
    assert EVENT_CLASSES[status].model_validate(json.loads(body), strict=True) == event
    assert event_id.startswith("evt_") and event_id != batch_event("batch_abc", status, ended)[0]


def test_a_changed_body_an_old_timestamp_or_another_secret_is_refused() -> None:
    event_id, body = batch_event("batch_abc", "completed", datetime.now(UTC))
    now = int(time.time())
    webhooks = openai.OpenAI(api_key="unused").webhooks
    other = "whsec_" + base64.b64encode(b"another key").decode()
    for payload, headers, secret in (
            (body.replace(b"batch_abc", b"batch_abd"), signed_headers(_key(), event_id, now,
                                                                      body), SECRET),
            (body, signed_headers(_key(), event_id, now - 600, body), SECRET),
            (body, signed_headers(_key(), event_id, now, body), other)):
        with pytest.raises(openai.InvalidWebhookSignatureError):
            webhooks.unwrap(payload, headers, secret=secret)


def test_refused_deliveries_wait_twice_as_long_each_time_up_to_the_longest_wait() -> None:
    assert [retry_delay(attempts, 5, 60) for attempts in (1, 2, 3, 4, 5, 100)] == [
        5, 10, 20, 40, 60, 60]


@pytest.mark.parametrize("environ", [
    {"JOBSVC_WEBHOOK_URLS": "https://example.com/hook"},
    {"JOBSVC_WEBHOOK_URLS": "https://example.com/hook", "JOBSVC_WEBHOOK_SECRET": "s3cr3t-key"},
    {"JOBSVC_WEBHOOK_URLS": "https://example.com/hook", "JOBSVC_WEBHOOK_SECRET": "whsec_!!!"},
    {"JOBSVC_WEBHOOK_URLS": "ftp://example.com/hook", "JOBSVC_WEBHOOK_SECRET": SECRET},
    {"JOBSVC_WEBHOOK_RETRY_SECONDS": "10", "JOBSVC_WEBHOOK_RETRY_MAX_SECONDS": "5"}])
def test_webhook_settings_are_refused_without_showing_the_secret(
        environ: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError, match="JOBSVC_WEBHOOK_") as refused:
        Settings.from_env(environ)
    secret = environ.get("JOBSVC_WEBHOOK_SECRET")
    assert secret is None or secret.removeprefix("whsec_") not in str(refused.value)


def test_each_endpoint_is_named_once_in_the_order_given() -> None:
    settings = Settings.from_env({"JOBSVC_WEBHOOK_URLS": " http://a/1, https://b/2 ,http://a/1,",
                                  "JOBSVC_WEBHOOK_SECRET": SECRET})
    assert settings.webhook_endpoints == ("http://a/1", "https://b/2")
    assert Settings.from_env({}).webhook_endpoints == ()
