"""The batch API server for tests: in this process on a free port (uvicorn in a thread), or
as a `jobsvc serve` child process that a test can kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import uvicorn

from jobsvc.local import settings_environment
from jobsvc.server.app import create_app
from jobsvc.settings import Settings
from tests.conftest import free_port

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


class ServerProcess:
    """`jobsvc serve` as a child process, with its log in `log_path`."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._environment = {**os.environ, **settings_environment(settings)}
        self._log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self._log_path.open("ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "jobsvc", "serve", "--port", str(self.port)],
                env=self._environment, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            assert self._process.poll() is None, self._log_path.read_text(errors="replace")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2,
                             headers={"Authorization": f"Bearer {API_KEY}"}).is_success:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobsvc serve did not answer; see {self._log_path}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no lease handed back."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
