"""Workers and the batch API server as child processes of this machine, for the demo, the
benchmark and the tests: start one worker per shard, wait until each answers a ping, stop them
with a warm shutdown; start `jobsvc serve`, wait until it answers /health, stop it."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType

import kombu.exceptions
import redis
from celery import Celery

from jobsvc.errors import JobsvcError
from jobsvc.settings import Settings
from jobsvc.transport import make_celery


class WorkerStartError(JobsvcError):
    """A local worker exited or did not become ready in time."""


class ServerStartError(JobsvcError):
    """A local `jobsvc serve` exited or did not answer in time."""


def settings_environment(settings: Settings) -> dict[str, str]:
    """The JOBSVC_* variables that make a child process see exactly these settings."""
    return {f"JOBSVC_{name.upper()}": str(value) for name, value in settings.__dict__.items()}


class LocalWorkers:
    """Workers as child processes of this one, so the demo, the benchmark and the tests get a whole
    fleet on one machine and leave none running."""

    def __init__(self, settings: Settings, log_dir: Path, *,
                 devices: list[str | None] | None = None, shards: Sequence[int] | None = None,
                 startup_timeout: float = 600) -> None:
        """One worker per device (none by default), under the shard numbers given (by default
        0, 1, ... up to the configured count)."""
        database_url = settings.resolved_database_url
        if database_url.startswith("sqlite:///") and not database_url.startswith("sqlite:////"):
            database_url = "sqlite:///" + str(Path(database_url[10:]).resolve())
        self.settings = replace(settings, database_url=database_url)
        self.log_dir = log_dir
        self.shards = list(range(settings.shards) if shards is None else shards)
        self._devices = devices or [None] * len(self.shards)
        if len(self._devices) != len(self.shards):
            raise WorkerStartError(f"{len(self._devices)} devices for {len(self.shards)} shards")
        self._timeout = startup_timeout
        self.processes: list[subprocess.Popen[bytes]] = []

    def log_path(self, shard: int) -> Path:
        """Where `shard`'s worker writes its output: the first place to look when it fails."""
        return self.log_dir / f"worker-{shard}.log"

    def start(self, progress: Callable[[str], None] = lambda _: None) -> None:
        """Start every worker and return once each answers a ping; WorkerStartError if one exits or
        the startup timeout passes first."""
        self.spawn()
        self.wait_ready(progress)

    def spawn(self) -> None:
        """Start every worker's process without waiting for it (`wait_ready` does), so that
        several groups' engines start at once."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **settings_environment(self.settings)}
        for shard, device in zip(self.shards, self._devices, strict=True):
            command = [sys.executable, "-m", "jobsvc", "worker", "--shard", str(shard),
                       "--parent-pid", str(os.getpid())]
            if device:
                command += ["--device", device]
            with self.log_path(shard).open("wb") as log:
                # A session of its own, whose CPU priority the worker may lower
                # (`jobsvc.workers.bootstrap.yield_to_helpers`) without lowering its caller's.
                self.processes.append(subprocess.Popen(
                    command, env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))

    def wait_ready(self, progress: Callable[[str], None] = lambda _: None) -> None:
        """Return once every spawned worker answers a ping; WorkerStartError if one exits or
        the startup timeout passes first."""
        app: Celery = make_celery(self.settings)
        expected = {f"shard{shard}@" for shard in self.shards}
        started = time.monotonic()
        try:
            while True:
                for shard, process in zip(self.shards, self.processes, strict=True):
                    if process.poll() is not None:
                        tail = self.log_path(shard).read_text(errors="replace")[-3000:]
                        raise WorkerStartError(
                            f"worker for shard {shard} exited with code {process.returncode}; "
                            f"log {self.log_path(shard)} ends with:\n{tail}")
                try:
                    replies = app.control.ping(timeout=1.0)
                except (redis.RedisError, kombu.exceptions.KombuError, OSError):
                    # The broker dropped the connection (it may have just restarted): ask again.
                    replies = []
                ready = {name.split("@")[0] + "@" for reply in replies for name in reply}
                elapsed = time.monotonic() - started
                if expected <= ready:
                    progress(f"{len(expected)} worker(s) ready after {elapsed:.0f} s")
                    return
                if elapsed > self._timeout:
                    raise WorkerStartError(f"workers not ready after {self._timeout:.0f} s; "
                                           f"see {self.log_dir}")
                progress(f"starting {len(expected)} worker(s): {len(ready & expected)} ready, "
                         f"{elapsed:.0f} s")
        finally:
            app.close()

    def stop(self, timeout: float = 60) -> None:
        """Warm shutdown (SIGTERM lets running batches finish), then SIGKILL what remains."""
        self.ask_to_stop()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()

    def ask_to_stop(self) -> None:
        """Ask every worker for a warm shutdown without waiting for it (`stop` waits), so that
        several groups stop at once."""
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class ServerProcess:
    """`jobsvc serve` as a child process on `port` of the loopback interface, seeing exactly
    `settings` (API key included), with its log appended to `log_path`."""

    def __init__(self, settings: Settings, port: int, log_path: Path, *,
                 startup_timeout: float = 120) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}/v1"
        self.log_path = log_path
        self._environment = {**os.environ, **settings_environment(settings)}
        self._api_key = settings.api_key
        self._timeout = startup_timeout
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The server's process ID, for whoever must signal it; ServerStartError before start."""
        if self._process is None:
            raise ServerStartError("the server has not been started")
        return self._process.pid

    def start(self) -> None:
        """Start the server and return once it answers /health; a server that exits first (a
        bad setting, or another process on the port) or never answers is an error."""
        with self.log_path.open("ab") as log:
            self._process = process = subprocess.Popen(
                [sys.executable, "-m", "jobsvc", "serve", "--port", str(self.port)],
                env=self._environment, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self._timeout
        while not self._healthy():
            if process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise ServerStartError(f"jobsvc serve exited with code {process.returncode}; "
                                       f"log {self.log_path} ends with:\n{tail}")
            if time.monotonic() > deadline:
                self.kill()
                raise ServerStartError(f"jobsvc serve did not answer in {self._timeout:.0f} s; "
                                       f"see {self.log_path}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/health")
        if self._api_key:
            request.add_header("Authorization", f"Bearer {self._api_key}")
        # No proxy: the server is on this machine's loopback interface.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=2) as response:
                return 200 <= response.status < 300
        except (OSError, http.client.HTTPException):  # refused, not up yet, or a non-2xx
            return False

    def kill(self) -> None:
        """SIGKILL: no shutdown, no lease handed back."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL if it has not exited in `timeout`."""
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
