"""The batch API server for tests: in this process on a free port (uvicorn in a thread), or
as a `jobsvc serve` child process that a test can kill."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import uvicorn

from jobsvc.child_processes import ServerProcess
from jobsvc.server.app import create_app
from jobsvc.settings import Settings
from tests.support.environment import free_port

API_KEY = "test-key"


def openai_client(base_url: str, api_key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60,
                         _strict_response_validation=True)


@contextmanager
def server_in_thread(settings: Settings) -> Iterator[str]:
    """Serve `settings` (with API_KEY required) until the block ends; yields the /v1 URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name="batch-api-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the batch API server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def server_process(settings: Settings, log_path: Path) -> ServerProcess:
    """`jobsvc serve` as a child process on a free port, not started yet."""
    return ServerProcess(settings, free_port(), log_path)
