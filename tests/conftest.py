"""Shared fixtures: a fresh PostgreSQL database and Redis database per test session, and one
real worker (Celery + vLLM CPU engine + tiny model) started once, because it takes ~25 s."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from xdist.scheduler import LoadScopeScheduling

from jobsvc import Client
from jobsvc.bench.probes import HOOKS_PATH
from jobsvc.local import LocalWorkers
from jobsvc.migrate import upgrade_to_head
from jobsvc.settings import Settings
from jobsvc.store import Store, utcnow
from jobsvc.transport import make_celery

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
_FAULT_ROW = "fault scenario"
_reported_rows: list[dict[str, object]] = []


TIERS = ("unit", "integration", "faults", "bench")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test belongs to exactly one tier, so that selecting tiers never misses one.
    Tests that stop the shared worker run after all others, which then need not wait for it
    to start again."""
    for item in items:
        tiers = [tier for tier in TIERS if item.get_closest_marker(tier)]
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid} must be in exactly one tier of {TIERS} "
                                    f"(pytestmark), not {tiers}")
    items.sort(key=lambda item: item.get_closest_marker("stops_worker") is not None)


# Test modules with servers or workers of their own (private servers, or commands that start
# their own workers). A run split over processes (pytest-xdist, as the default options ask)
# runs these beside the rest, mostly waiting as they do on timeouts and restarts; every other
# test shares the session's worker, database and Redis, so all of those run in one process.
PRIVATE_SERVER_MODULES = frozenset({"test_faults.py", "test_liveness_faults.py",
                                    "test_server_faults.py", "test_terminal.py"})


class _ByServers(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        module = Path(nodeid.split("::", 1)[0]).name
        return module if module in PRIVATE_SERVER_MODULES else "shared servers"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
    """Replaces xdist's default distribution only (`--dist load`); others are kept."""
    return _ByServers(config, log) if config.getvalue("dist") == "load" else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.when == "call":
        report.user_properties.extend((_FAULT_ROW, row) for row in FAULT_TABLE)
        FAULT_TABLE.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call":
        _reported_rows.extend(row for name, row in report.user_properties if name == _FAULT_ROW)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _reported_rows:
        return
    columns = list(_reported_rows[0])
    widths = {c: max(len(c), *(len(str(row[c])) for row in _reported_rows)) for c in columns}
    terminalreporter.section("fault scenarios")
    terminalreporter.line("  ".join(c.ljust(widths[c]) for c in columns))
    for row in _reported_rows:
        terminalreporter.line("  ".join(str(row[c]).ljust(widths[c]) for c in columns))


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


@pytest.fixture(scope="session")
def settings() -> Settings:
    database_url = recreate_database()
    for url in (WORKER_REDIS_URL, ROUTING_REDIS_URL):
        redis.Redis.from_url(url).flushdb()
    # The worker attaches the bench's probes, whose remote-control commands some tests send.
    # The tests size their bursts in messages: small ones keep those bursts short, and
    # chunks smaller than a message make the worker pace its admission as it does in service.
    return Settings.from_env({}, redis_url=WORKER_REDIS_URL, database_url=database_url,
                             batch_size=32, admission_chunk=8, worker_concurrency=4,
                             log_level="INFO", max_message_bytes=16 << 20,
                             worker_hooks=HOOKS_PATH, metrics_port=free_port(),
                             worker_nice=TEST_WORKER_NICE)


@pytest.fixture(scope="session")
def shared_worker(settings: Settings, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[LocalWorkers]:
    log_dir: Path = tmp_path_factory.mktemp("worker-logs")
    workers = LocalWorkers(settings, log_dir, startup_timeout=300)
    workers.start()
    yield workers
    workers.stop()


@pytest.fixture()
def worker(shared_worker: LocalWorkers) -> LocalWorkers:
    """The session's worker, started again if a test (marked `stops_worker`) stopped it."""
    if not shared_worker.processes:
        shared_worker.start()
    return shared_worker


@pytest.fixture()
def client(settings: Settings, worker: LocalWorkers) -> Iterator[Client]:
    with Client(settings=settings) as producer:
        yield producer


@pytest.fixture(scope="session")
def routing_database(settings: Settings) -> str:
    """A database of its own for jobs routed where no worker consumes: in the worker's
    database, its reconciler would find them stranded and send them to its own Redis."""
    return recreate_database(TEST_DATABASE + "_routing")


@pytest.fixture()
def routing_settings(settings: Settings, routing_database: str) -> Iterator[Settings]:
    """Settings with 8 shards on a Redis database that no worker consumes."""
    routed = replace(settings, redis_url=ROUTING_REDIS_URL, shards=8,
                     database_url=routing_database)
    yield routed
    redis.Redis.from_url(ROUTING_REDIS_URL).flushdb()


@pytest.fixture()
def store(routing_database: str) -> Iterator[Store]:
    """The store of `routing_settings`: jobs recorded here wait for no worker, and none
    reconciles them."""
    repository = Store(routing_database)
    yield repository
    repository.dispose()


@pytest.fixture()
def worker_store(settings: Settings) -> Iterator[Store]:
    """The store the test worker reads and writes."""
    repository = Store(settings.resolved_database_url)
    yield repository
    repository.dispose()


@pytest.fixture()
def embedded(tmp_path: Path) -> Iterator[Store]:
    """A store on the embedded SQLite, beside the PostgreSQL one."""
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    upgrade_to_head(url)
    repository = Store(url)
    yield repository
    repository.dispose()


# The message that the jobs `record_queued_job` records belong to.
TEST_MESSAGE = "test-message"


def queued_job_row(job_id: str, document_key: str, **fields: Any) -> dict[str, Any]:
    """A queued job's row as a submit records it, on shard 0, owned by TEST_MESSAGE."""
    return {"id": job_id, "document_key": document_key, "question": "q", "sampling": {},
            "shard": 0, "status": "queued", "prompt_tokens": 2, "estimated_prefill": 2,
            "load": 2, "message_id": TEST_MESSAGE, "submitted_at": utcnow(),
            "enqueued_at": utcnow(), **fields}


def record_queued_job(store: Store, **fields: Any) -> str:
    """Records a queued job on a document of its own and returns its ID."""
    job_id = uuid.uuid4().hex
    document_key = uuid.uuid4().hex
    store.record_submitted(
        [{"key": document_key, "text_zst": b"", "tokens": 1, "created_at": utcnow()}],
        [queued_job_row(job_id, document_key, **fields)])
    return job_id


def claim(store: Store, job_ids: list[str], *, redelivered: bool = False
          ) -> dict[str, tuple[int, ...] | str]:
    """Claim jobs as TEST_MESSAGE's worker on shard 0; their documents by job ID."""
    claimed = store.claim_batch(job_ids, message_id=TEST_MESSAGE, shard=0,
                                redelivered=redelivered, worker="w", max_attempts=3)
    return {job.job_id: job.document for job in claimed.jobs}


@pytest.fixture()
def queued_job(store: Store) -> Callable[[], str]:
    return lambda: record_queued_job(store)


def ask_worker(settings: Settings, command: str, arguments: dict[str, Any],
               timeout: float = 30) -> dict[str, Any]:
    """The test worker's reply to a remote-control command."""
    replies = make_celery(settings).control.broadcast(command, arguments=arguments, reply=True,
                                                      timeout=timeout, limit=1)
    assert len(replies) == 1, replies
    (reading,) = replies[0].values()
    return reading


def set_pacing(settings: Settings, chunk: int, pause_ms: float) -> dict[str, Any]:
    """Pace the test worker's later batches; returns its reply (the pacing it replaced)."""
    return ask_worker(settings, "set_admission_pacing", {"chunk": chunk, "pause_ms": pause_ms})
