"""Shared fixtures: a fresh PostgreSQL database and Redis database per test session, and one
real worker (Celery + vLLM CPU engine + tiny model) started once, because it takes ~25 s."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
from xdist.scheduler import LoadScopeScheduling

from jobsvc import Client
from jobsvc.bench.probes import HOOKS_PATH
from jobsvc.child_processes import LocalWorkers
from jobsvc.migrate import upgrade_to_head
from jobsvc.settings import Settings
from jobsvc.store import Store
from tests.support.environment import (
    FAULT_TABLE,
    ROUTING_REDIS_URL,
    TEST_DATABASE,
    TEST_WORKER_NICE,
    WORKER_REDIS_URL,
    free_port,
    recreate_database,
)
from tests.support.jobs import record_queued_job

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


# Test modules with servers and workers of their own. A run split over processes
# (pytest-xdist, as the default options ask) runs these beside the rest, mostly waiting as they
# do on timeouts and restarts; every other test (among them modules that also start workers of
# their own, left there so that both processes take about as long) runs in one process, as
# the tests sharing the session's worker, database and Redis must.
PRIVATE_SERVER_MODULES = frozenset({"test_faults.py", "test_liveness_faults.py",
                                    "test_server_faults.py", "test_model_fleet.py"})


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


@pytest.fixture()
def queued_job(store: Store) -> Callable[[], str]:
    return lambda: record_queued_job(store)
