"""Where the tests run: the PostgreSQL and Redis they use (overridable, so that two runs on
one machine keep apart), fresh databases, free ports, the workers' CPU priority, and the rows
of the fault table that the running test recorded."""

from __future__ import annotations

import os
import socket

import psycopg

from jobsvc.migrate import upgrade_to_head

POSTGRES_ADMIN_URL = os.environ.get("JOBSVC_TEST_POSTGRES_ADMIN_URL",
                                    "postgresql://postgres@127.0.0.1:5432/postgres")
# Overridable so that two test runs on one machine keep out of each other's way.
TEST_DATABASE = os.environ.get("JOBSVC_TEST_DATABASE", "jobsvc_test")
# The worker's Redis database, and a second one for routing tests that need shards no worker
# consumes (their queues just fill up and are dropped).
WORKER_REDIS_URL = os.environ.get("JOBSVC_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
ROUTING_REDIS_URL = os.environ.get("JOBSVC_TEST_ROUTING_REDIS_URL",
                                   WORKER_REDIS_URL.rsplit("/", 1)[0] + "/14")
# Every test worker runs below the tests' own priority: on a host with few cores, an engine
# that busy-waits between steps can otherwise keep the tests, PostgreSQL and Redis off the
# CPU for seconds while it generates (see JOBSVC_WORKER_NICE).
TEST_WORKER_NICE = 10
# Rows of the fault tests' table, one per scenario, that the running test recorded. Each
# test's report carries them on (as user properties), so that they reach the process that
# prints the table after the run, also when the run is split over several processes.
FAULT_TABLE: list[dict[str, object]] = []


def drop_database(name: str) -> None:
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as connection:
        connection.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def empty_database(name: str) -> str:
    """A new, empty PostgreSQL database of this name (replacing one left over); its URL."""
    drop_database(name)
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as connection:
        connection.execute(f"CREATE DATABASE {name}")
    return POSTGRES_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def recreate_database(name: str = TEST_DATABASE) -> str:
    """An empty PostgreSQL database of this name at the schema's head; returns its URL."""
    url = empty_database(name)
    upgrade_to_head(url)
    return url


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
