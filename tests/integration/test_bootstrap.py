"""A worker keeps its whole process tree on its cores, and below the database and the broker
in CPU priority."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobsvc.errors import ConfigurationError
from jobsvc.settings import Settings
from jobsvc.workers.bootstrap import autogroups_enabled, cpu_cores

pytestmark = pytest.mark.integration

_REPORT_AFFINITIES = """
import multiprocessing, os, sys, threading
from jobsvc.workers.bootstrap import keep_to_device, kept_to_device

def child(queue):
    queue.put(sorted(os.sched_getaffinity(0)))

def report():
    # The cores of the calling thread and of a process it spawns.
    queue = multiprocessing.get_context("spawn").Queue()
    process = multiprocessing.get_context("spawn").Process(target=child, args=(queue,))
    process.start()
    reported = [sorted(os.sched_getaffinity(0)), queue.get(timeout=60)]
    process.join()
    return reported

if __name__ == "__main__":
    device, how = sys.argv[1:]
    if how == "worker":
        keep_to_device(device)
        print(*report())
    else:
        before = sorted(os.sched_getaffinity(0))
        reports = []
        with kept_to_device(device):
            thread = threading.Thread(target=lambda: reports.extend(report()))
            thread.start()
        thread.join()
        print(*reports, sorted(os.sched_getaffinity(0)) == before)
"""


def _report_affinities(tmp_path: Path, device: str, how: str) -> list[str]:
    script = tmp_path / "report_affinities.py"
    script.write_text(_REPORT_AFFINITIES)
    reported = subprocess.run([sys.executable, str(script), device, how],
                              cwd=Path(__file__).parents[2], capture_output=True, text=True,
                              timeout=120, check=True)
    return reported.stdout.split()


def test_cpu_devices_name_cores_as_vllm_reads_them() -> None:
    assert cpu_cores("0-1") == {0, 1}
    assert cpu_cores("1") == {1}
    assert cpu_cores("0,2-3") == {0, 2, 3}
    assert cpu_cores("0-1|2-3") == {0, 1, 2, 3}
    with pytest.raises(ConfigurationError, match="not a list of CPU cores"):
        cpu_cores("cuda:0")
    # A range written backwards names no core, rather than quietly dropping its part.
    with pytest.raises(ConfigurationError, match="not a list of CPU cores"):
        cpu_cores("3-1|0")


def test_a_worker_bound_to_one_core_keeps_itself_and_the_processes_it_starts_there(
        tmp_path: Path) -> None:
    # vLLM starts its scheduler process from the worker the same way: spawned, inheriting.
    assert _report_affinities(tmp_path, "1", "worker") == ["[1]", "[1]"]


def test_an_engine_started_for_a_device_runs_there_while_its_starter_goes_free(
        tmp_path: Path) -> None:
    # The bench's own standalone engines: each one's loop thread, and the processes that
    # thread spawns, on its shard's core; the bench process's own thread on every core again.
    assert _report_affinities(tmp_path, "1", "thread") == ["[1]", "[1]", "True"]


def test_a_device_naming_cores_the_machine_lacks_stops_the_worker_with_a_clear_error() -> None:
    started = subprocess.run(
        [sys.executable, "-m", "jobsvc", "worker", "--shard", "0", "--device", "4090-4091"],
        cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=120)
    assert started.returncode != 0
    assert "--device '4090-4091' names cores this machine does not offer" in started.stderr


_REPORT_PRIORITIES = """
import multiprocessing, os
from pathlib import Path
from jobsvc.workers.bootstrap import yield_to_helpers

def child(queue):
    queue.put(os.getpriority(os.PRIO_PROCESS, 0))

if __name__ == "__main__":
    yield_to_helpers(7)
    queue = multiprocessing.get_context("spawn").Queue()
    process = multiprocessing.get_context("spawn").Process(target=child, args=(queue,))
    process.start()
    print(os.getpriority(os.PRIO_PROCESS, 0), queue.get(timeout=60))
    process.join()
    autogroup = Path("/proc/self/autogroup")
    print(autogroup.read_text().strip() if autogroup.exists() else "-")
"""


def _report_priorities(tmp_path: Path, own_session: bool) -> list[str]:
    script = tmp_path / "report_priorities.py"
    script.write_text(_REPORT_PRIORITIES)
    reported = subprocess.run([sys.executable, str(script)], cwd=Path(__file__).parents[2],
                              capture_output=True, text=True, timeout=120, check=True,
                              start_new_session=own_session)
    return reported.stdout.splitlines()


def test_a_worker_leading_its_session_yields_the_cpu_with_everything_it_starts(
        tmp_path: Path) -> None:
    # As `jobsvc`'s launcher starts workers: the worker and the processes it spawns (vLLM's)
    # run at the lower priority, and so does its session where sessions are scheduled apart.
    priorities, autogroup = _report_priorities(tmp_path, own_session=True)
    assert priorities == "7 7"
    if autogroups_enabled():
        assert autogroup.endswith("nice 7")


def test_a_worker_started_inside_another_session_leaves_that_session_alone(
        tmp_path: Path) -> None:
    # As from a terminal: the worker's own priority drops, its caller's session keeps its own.
    own_autogroup = Path("/proc/self/autogroup")
    before = own_autogroup.read_text() if own_autogroup.exists() else None
    priorities, autogroup = _report_priorities(tmp_path, own_session=False)
    assert priorities == "7 7"
    if before is not None:
        assert own_autogroup.read_text() == before
        assert autogroup == before.strip()


# A real Celery worker, on the real broker, whose start fails as an unrecoverable error does:
# `run_worker` must end the process non-zero, so that a supervisor restarts it.
_FAILING_WORKER = """
import sys
from celery import bootsteps
import jobsvc.workers.celery_app
from jobsvc.settings import Settings
from jobsvc.transport import make_celery
from jobsvc.workers.bootstrap import run_worker

class Broken(bootsteps.StartStopStep):
    def start(self, worker):
        raise RuntimeError("an error the worker cannot recover from")

settings = Settings.from_env({}, redis_url=sys.argv[1], database_url=sys.argv[2],
                             worker_concurrency=1)
app = make_celery(settings)
app.steps["worker"].add(Broken)
jobsvc.workers.celery_app.create_worker_app = lambda _settings, _shard: app
run_worker(settings, 97, None)
"""


def test_a_worker_that_hits_an_unrecoverable_error_exits_non_zero(settings: Settings) -> None:
    done = subprocess.run([sys.executable, "-c", _FAILING_WORKER, settings.redis_url,
                           settings.resolved_database_url],
                          capture_output=True, timeout=120)
    assert b"Unrecoverable error" in done.stdout + done.stderr, done.stderr[-2000:]
    assert done.returncode == 1
