"""Private Redis and PostgreSQL servers on loopback for fault tests: the tests may stop and
restart them at will without touching the machine's own servers. The Redis one is the demo's
(`jobsvc.private_redis`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from jobsvc.migrate import upgrade_to_head
from jobsvc.private_redis import PrivateRedis

__all__ = ["PrivatePostgres", "PrivateRedis"]


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


@contextmanager
def private_servers(redis_port: int, postgres_port: int
                    ) -> Iterator[tuple[PrivateRedis, PrivatePostgres]]:
    """A private Redis and a private PostgreSQL at the schema's head, both stopped (and the
    cluster removed) however the block ends."""
    redis_server = PrivateRedis(redis_port)
    redis_server.start()
    try:
        postgres = PrivatePostgres(postgres_port)
        try:
            postgres.start()
            upgrade_to_head(postgres.url)
            yield redis_server, postgres
        finally:
            postgres.stop()
            postgres.remove()
    finally:
        redis_server.stop()
