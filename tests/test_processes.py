"""The bench's process accounting against real processes: this one, a child named like vLLM's
model runner, and the machine's Redis and PostgreSQL servers."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from jobsvc.measure import ENGINE_ROLE
from jobsvc.processes import (
    MACHINE_CPU,
    RUNNER_WAIT,
    STEAL,
    Usage,
    server_processes,
    with_roles,
)

# A child that keeps to the first core and spins until stopped; with a name, it first renames
# itself (vLLM names its model runner "VLLM::Worker...").
_SPINNER = ("import os, sys\n"
            "os.sched_setaffinity(0, {0})\n"
            "if len(sys.argv) > 1:\n"
            "    open('/proc/self/comm', 'w').write(sys.argv[1])\n"
            "while True:\n"
            "    pass\n")


@pytest.fixture
def runner_like_child() -> Iterator[psutil.Process]:
    """A runner-like child sharing its core with a plain spinner, so that it waits for it."""
    children = [subprocess.Popen([sys.executable, "-c", _SPINNER, *name])
                for name in (["VLLM::Worker_0"], [])]
    process = psutil.Process(children[0].pid)
    deadline = time.monotonic() + 10
    while not process.name().startswith("VLLM::") and time.monotonic() < deadline:
        time.sleep(0.01)
    yield process
    for child in children:
        child.kill()
        child.wait(timeout=10)


def test_a_child_named_like_vllm_counts_as_engine(runner_like_child: psutil.Process) -> None:
    tagged = with_roles([psutil.Process()], "producer", descendants=True)
    roles = {process.pid: role for process, role in tagged}
    assert roles[psutil.Process().pid] == "producer"
    assert roles[runner_like_child.pid] == ENGINE_ROLE
    alone = with_roles([psutil.Process()], "producer", descendants=False)
    assert [process.pid for process, _ in alone] == [psutil.Process().pid]


def test_usage_splits_cpu_by_role(runner_like_child: psutil.Process) -> None:
    usage = Usage([(psutil.Process(), "producer"), (runner_like_child, ENGINE_ROLE)])
    spin_until = time.thread_time() + 0.2
    while time.thread_time() < spin_until:
        pass
    time.sleep(0.3)
    used = usage.since_start()
    # Process CPU times come in clock ticks (10 ms): two readings can differ by a tick less.
    assert used["producer"] >= 0.18
    # The child shares its core with the spinner: about half of the 0.5 s each.
    assert used[ENGINE_ROLE] >= 0.1
    assert used[RUNNER_WAIT] >= 0.1
    # The machine was busy at least as long as these processes ran (to a clock tick each).
    assert used[MACHINE_CPU] >= used["producer"] + used[ENGINE_ROLE] - 0.03
    assert set(used) == {"producer", ENGINE_ROLE, STEAL, RUNNER_WAIT, MACHINE_CPU}


def test_usage_without_engine_has_no_runner_wait() -> None:
    usage = Usage([(psutil.Process(), "producer")])
    time.sleep(0.05)
    assert usage.since_start()[RUNNER_WAIT] == 0.0


def test_the_running_servers_are_found() -> None:
    servers = server_processes()
    assert set(servers) == {"redis", "postgres"}
    assert servers["redis"] and servers["postgres"]
