"""`jobsvc flower` on the real broker beside the real worker: it starts without the virtual
environment on PATH, lists the worker and its shard queue, and gets the task events that the
worker sends only once a monitor asks for them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from jobsvc import Client
from jobsvc.keys import queue_name
from jobsvc.local import LocalWorkers, settings_environment
from jobsvc.settings import Settings

pytestmark = pytest.mark.integration

_DEADLINE_SECONDS = 60


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture()
def flower(settings: Settings, worker: LocalWorkers) -> Iterator[str]:
    port = _free_port()
    env = {**os.environ, **settings_environment(settings), "JOBSVC_FLOWER_PORT": str(port),
           "FLOWER_UNAUTHENTICATED_API": "true", "PATH": "/usr/bin:/bin"}
    process = subprocess.Popen([sys.executable, "-m", "jobsvc", "flower"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
        print(output.decode(errors="replace")[-3000:])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _until(what: str, check: Any) -> Any:
    deadline = time.monotonic() + _DEADLINE_SECONDS
    while True:
        try:
            found = check()
        except (urllib.error.URLError, ConnectionError):
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"Flower did not show {what} within {_DEADLINE_SECONDS} s")
        time.sleep(1)


def test_flower_lists_the_worker_its_shard_queue_and_the_batches_it_ran(
        flower: str, client: Client) -> None:
    # Flower fills each worker's entry one inspect reply at a time, and lists its own app's
    # default queue until the worker's queues have come in.
    workers = _until("the worker's queues", lambda: {
        name: info for name, info in _get(f"{flower}/api/workers").items()
        if info.get("active_queues")})
    assert any(name.startswith("shard0@") for name in workers)
    queues = _get(f"{flower}/api/queues/length")["active_queues"]
    assert [queue["name"] for queue in queues] == [queue_name(0)]

    def batch_events() -> list[dict[str, Any]]:
        # Flower turns the worker's events on at its start and every few seconds after; a
        # batch run before that leaves no event, so each round submits another.
        client.wait(client.submit_many([{"document": "The keeper counted the cats. " * 20,
                                         "question": "How many cats?", "max_tokens": 2}]),
                    timeout=60)
        tasks = _get(f"{flower}/api/tasks").values()
        return [task for task in tasks
                if task["name"] == "jobsvc.run_batch" and task["state"] == "SUCCESS"]

    succeeded = _until("a succeeded batch", batch_events)
    assert "'jobs': 1" in succeeded[0]["result"]
