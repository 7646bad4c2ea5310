"""`jobsvc flower` on the real broker: beside the real worker it starts without the virtual
environment on PATH, lists the worker and its shard queue, and gets the task events that the
worker sends only once a monitor asks for them; started before any worker, its Broker page
lists every configured and live shard queue with its length. It needs a password unless told
to run open on loopback, and in headless Chromium its pages list real workers only, the
broker URL as set and, for a message whose jobs failed, how many."""

from __future__ import annotations

import base64
import html
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

import pytest
import redis

from jobsvc import Client, JobStatus
from jobsvc.child_processes import LocalWorkers, settings_environment
from jobsvc.health import Heartbeat, write_heartbeat
from jobsvc.keys import queue_name
from jobsvc.settings import Settings
from jobsvc.store import NewDocument, NewJob, Store
from jobsvc.transport import make_celery, publish
from jobsvc.wire import QueueMessage
from tests.support.browser import chromium_page
from tests.support.environment import free_port
from tests.support.waiting import until

pytestmark = pytest.mark.integration

T = TypeVar("T")

_DEADLINE_SECONDS = 60


@contextmanager
def running_flower(settings: Settings, *arguments: str, output: list[str] | None = None,
                   **environment: str) -> Iterator[str]:
    """`jobsvc flower` on these settings; its URL. What it printed is added to `output`."""
    port = free_port()
    env = {**os.environ, **settings_environment(settings), "JOBSVC_FLOWER_PORT": str(port),
           "PATH": "/usr/bin:/bin", **environment}
    process = subprocess.Popen([sys.executable, "-m", "jobsvc", "flower", *arguments], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        printed = process.communicate(timeout=30)[0].decode(errors="replace")
        print(printed[-3000:])
        if output is not None:
            output.append(printed)


CREDENTIALS = "operator:secret"


@pytest.fixture()
def flower(settings: Settings, worker: LocalWorkers) -> Iterator[str]:
    with running_flower(settings, FLOWER_BASIC_AUTH=CREDENTIALS) as url:
        yield url


def _get(url: str, credentials: str | None = CREDENTIALS) -> Any:
    return json.loads(_read(url, credentials))


def _read(url: str, credentials: str | None = None) -> str:
    request = urllib.request.Request(url)
    if credentials is not None:
        request.add_header("Authorization",
                           "Basic " + base64.b64encode(credentials.encode()).decode())
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read().decode()


_QUEUE_ROW = re.compile(r'<tr id="[^"]*">\s*<td>([^<]*)</td>\s*<td[^>]*>([^<]*)</td>')


def broker_page_queues(flower: str, credentials: str) -> dict[str, int]:
    """The queues Flower's Broker page lists, with the messages it shows for each."""
    page = _read(f"{flower}/broker", credentials)
    return {html.unescape(name): int(messages)
            for name, messages in _QUEUE_ROW.findall(page)}


def _until(what: str, check: Callable[[], T]) -> T:
    """What Flower shows, once it shows it (a Flower not yet listening is retried)."""
    return until(f"Flower shows {what}", check, _DEADLINE_SECONDS, every=1,
                 ignoring=(urllib.error.URLError, ConnectionError))


def test_flower_lists_the_worker_its_shard_queue_and_the_batches_it_ran(
        flower: str, client: Client) -> None:
    # Flower fills each worker's entry one inspect reply at a time, and lists its own app's
    # default queue until the worker's queues have come in.
    workers = _until("the worker's queues", lambda: {
        name: info for name, info in _get(f"{flower}/api/workers").items()
        if name.startswith("shard0@") and info.get("active_queues")})
    assert [queue["name"] for queue in next(iter(workers.values()))["active_queues"]] == [
        queue_name(0)]
    queues = _get(f"{flower}/api/queues/length")["active_queues"]
    assert queue_name(0) in [queue["name"] for queue in queues]

    def batch_events() -> list[dict[str, Any]]:
        # Flower turns the worker's events on at its start and every few seconds after; a
        # batch run before that leaves no event, so each round submits another.
        client.wait(client.submit_many([{"document": "The keeper counted the cats. " * 20,
                                         "question": "How many cats?", "max_tokens": 2}]),
                    timeout=60)
        tasks = _get(f"{flower}/api/tasks").values()
        return [task for task in tasks
                if task["name"] == "jobsvc.run_message" and task["state"] == "SUCCESS"]

    succeeded = _until("a succeeded batch", batch_events)
    assert "'jobs': 1" in succeeded[0]["result"]


def test_flower_started_before_any_worker_lists_every_shard_queue_with_its_length(
        routing_settings: Settings) -> None:
    """On a broker no worker consumes: the configured shards' queues, some with messages
    waiting, and a shard beyond the configured ones that is live by its heartbeat."""
    broker = redis.Redis.from_url(routing_settings.redis_url)
    beyond = routing_settings.shards + 1
    write_heartbeat(broker, Heartbeat(beyond, f"shard{beyond}@elsewhere", "elsewhere", 7, 1.0,
                                      False, 0, None, None, "generate", ["jobsvc"]))
    credentials = CREDENTIALS
    with Client(settings=routing_settings) as client, \
            running_flower(routing_settings, FLOWER_BASIC_AUTH=credentials) as flower:
        ids = client.submit_many({"document": f"Report {number}: the pier holds {number} "
                                              "cats. " * 30, "question": "How many cats?",
                                  "max_tokens": 2} for number in range(12))
        shards = {client.get(job_id).shard for job_id in ids}
        expected = {queue_name(shard): broker.llen(queue_name(shard))
                    for shard in [*range(routing_settings.shards), beyond]}
        assert all(expected[queue_name(shard)] > 0 for shard in shards)
        # Until its first look at the workers, Flower lists its app's default queue alone.
        _until("every shard queue",
               lambda: broker_page_queues(flower, credentials) == expected)
        assert _get(f"{flower}/api/queues/length", credentials)["active_queues"] == [
            {"name": name, "messages": messages} for name, messages in sorted(expected.items())]
        with pytest.raises(urllib.error.HTTPError, match="401"):
            _read(f"{flower}/broker")
        # A shard that comes alive later shows from Flower's next look at the workers.
        later = beyond + 1
        write_heartbeat(broker, Heartbeat(later, f"shard{later}@elsewhere", "elsewhere", 8,
                                          1.0, False, 0, None, None, "generate",
                                          ["jobsvc"]))
        _get(f"{flower}/api/workers?refresh=1", credentials)
        assert broker_page_queues(flower, credentials)[queue_name(later)] == 0
        for job_id in ids:
            client.cancel(job_id)


def test_flower_names_a_live_shard_even_when_its_settings_name_fewer(
        routing_settings: Settings) -> None:
    few = replace(routing_settings, shards=1)
    broker = redis.Redis.from_url(few.redis_url)
    broker.rpush(queue_name(5), b"waiting")
    with running_flower(few, FLOWER_BASIC_AUTH="a:b") as flower:
        _until("the live shard", lambda: broker_page_queues(flower, "a:b") == {
            queue_name(0): 0, queue_name(5): 1})


def _flower_exit(settings: Settings, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **settings_environment(settings),
           "JOBSVC_FLOWER_PORT": str(free_port())}
    for name in ("FLOWER_BASIC_AUTH", "FLOWER_AUTH"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "jobsvc", "flower", *arguments], env=env,
                          capture_output=True, text=True, timeout=60)


def test_flower_without_a_password_starts_only_when_opened_on_loopback(
        routing_settings: Settings) -> None:
    refused = _flower_exit(routing_settings)
    assert refused.returncode == 2 and "FLOWER_BASIC_AUTH" in refused.stderr
    wide = _flower_exit(routing_settings, "--open", "--address", "0.0.0.0")
    assert wide.returncode == 2 and "loopback" in wide.stderr
    printed: list[str] = []
    with running_flower(routing_settings, "--open", output=printed) as url:
        page = _until("its pages without a password", lambda: _read(f"{url}/broker", None))
        assert queue_name(0) in page
        # Its API stays closed unless FLOWER_UNAUTHENTICATED_API says otherwise.
        with pytest.raises(urllib.error.HTTPError, match="401"):
            _read(f"{url}/api/workers", None)
    # The broker URL has no password, so none is shown masked.
    assert f"Broker: {routing_settings.redis_url}" in printed[0] and "**" not in printed[0]


def _message_with_a_failing_job(settings: Settings, store: Store) -> list[str]:
    """One message of two jobs recorded by hand: one the engine runs, one whose prompt holds a
    token the model does not have, which the engine refuses; their IDs."""
    message = QueueMessage(0, [uuid.uuid4().hex, uuid.uuid4().hex], uuid.uuid4().hex)
    tokens = {message.job_ids[0]: [7, 8, 9], message.job_ids[1]: [1, 2, 10_000_000]}
    store.record_submitted(
        [NewDocument(job_id, "", ids) for job_id, ids in tokens.items()],
        [NewJob(job_id, job_id, "?", (5,), {"max_tokens": 2}, settings.served_model_name,
                shard=0, prompt_tokens=4,
                estimated_prefill=4, load=4, message_id=message.message_id)
         for job_id in tokens])
    publish(make_celery(settings), redis.Redis.from_url(settings.redis_url), [message])
    return message.job_ids


def test_flower_in_a_browser_shows_real_workers_the_broker_url_as_set_and_failed_jobs(
        flower: str, settings: Settings, worker_store: Store, client: Client) -> None:
    def failed_in_flower() -> bool:
        # Flower turns the worker's events on at its start and every few seconds after: a
        # message run before that leaves no event, so each round sends another.
        records = client.wait(_message_with_a_failing_job(settings, worker_store), timeout=60)
        assert [record.status for record in records] == [JobStatus.SUCCEEDED, JobStatus.FAILED]
        return any("'failed': 1" in (task.get("result") or "")
                   for task in _get(f"{flower}/api/tasks").values()
                   if task["name"] == "jobsvc.run_message")

    _until("a message whose job failed", failed_in_flower)
    basic = base64.b64encode(CREDENTIALS.encode()).decode()
    with chromium_page({"Authorization": f"Basic {basic}"}) as page:
        page.open(f"{flower}/tasks", showing="'succeeded': 1, 'failed': 1")
        workers = page.open(f"{flower}/", showing="shard0@")
        assert "shard-queues" not in workers
        broker = page.open(f"{flower}/broker", showing=queue_name(0))
        assert settings.redis_url in broker and "**" not in broker
