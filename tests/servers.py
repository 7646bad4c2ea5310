"""Private Redis and PostgreSQL servers on loopback for fault tests: the tests may stop and
restart them at will without touching the machine's own servers."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
import redis


class PrivateRedis:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tempfile.gettempdir()],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"private Redis on port {self.port} did not start")

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None


class PrivatePostgres:
    """A throw-away cluster (trust auth, fsync off) owned by the postgres user when we are
    root, since PostgreSQL refuses to run as root."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        versions = sorted(Path("/usr/lib/postgresql").iterdir())
        self._bin = versions[-1] / "bin"
        self._dir = Path(tempfile.mkdtemp(prefix="jobsvc-pg-"))
        self._as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as_postgres:
            shutil.chown(self._dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self._dir / "data"), "-A", "trust", "-U", "postgres")

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self._as_postgres, str(self._bin / tool), *args], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        options = (f"-p {self.port} -k {self._dir} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c full_page_writes=off")
        self._run("pg_ctl", "-D", str(self._dir / "data"), "-o", options,
                  "-l", str(self._dir / "log"), "-w", "start")
        with psycopg.connect(self.url) as connection:
            connection.execute("select 1")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self._dir / "data"), "-m", "fast", "-w", "stop")

    def remove(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
