"""The bench's process accounting against real processes: this one, a child named like vLLM's
model runner, a program outside this process's tree, and the machine's Redis and PostgreSQL
servers."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from jobsvc.bench.measure import ENGINE_ROLE, cpu_seconds_by_role
from jobsvc.bench.processes import (
    FOREIGN_CPU,
    MACHINE_CPU,
    RUNNER_WAIT,
    STEAL,
    Usage,
    foreign_cpu_now,
    server_processes,
    with_roles,
)

pytestmark = pytest.mark.bench

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
    assert set(used) == {"producer", ENGINE_ROLE, STEAL, RUNNER_WAIT, MACHINE_CPU, FOREIGN_CPU}


def test_usage_without_engine_has_no_runner_wait() -> None:
    usage = Usage([(psutil.Process(), "producer")])
    time.sleep(0.05)
    assert usage.since_start()[RUNNER_WAIT] == 0.0


def test_the_running_servers_are_found() -> None:
    servers = server_processes()
    assert set(servers) == {"redis", "postgres"}
    assert servers["redis"] and servers["postgres"]


# A program that spins for 0.3 s of CPU, then idles until stopped (at most a minute).
_BURNER = ("import time\n"
           "until = time.process_time() + 0.3\n"
           "while time.process_time() < until:\n"
           "    pass\n"
           "time.sleep(60)\n")


def _start_other_program() -> psutil.Process:
    """A burner outside this process's tree: a shell starts it in the background and exits,
    so it is orphaned and adopted elsewhere, as another program on the machine would be."""
    shell = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0" >/dev/null 2>&1 & echo $!',
                            _BURNER], capture_output=True, text=True, check=True)
    return psutil.Process(int(shell.stdout))


def test_other_programs_cpu_is_counted_and_this_tree_and_the_servers_are_not(
        runner_like_child: psutil.Process) -> None:
    before = foreign_cpu_now()
    other_program = _start_other_program()
    try:
        deadline = time.monotonic() + 10
        while sum(other_program.cpu_times()[:2]) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.02)
        after = foreign_cpu_now()
    finally:
        other_program.kill()
    counted = {pid for pid, _ in after}
    assert other_program.pid in counted
    assert not counted & {psutil.Process().pid, runner_like_child.pid}
    assert not counted & {process.pid for processes in server_processes().values()
                          for process in processes}
    # The burner started after the first reading: all of its CPU counts (to a clock tick).
    assert cpu_seconds_by_role(before, after)[FOREIGN_CPU] >= 0.29


def test_the_benchs_ancestors_count_without_the_children_they_reaped() -> None:
    # This process reaps a burner, then a probe run as its child reads the other programs:
    # this process is the probe's ancestor, and its reaped children must not count.
    subprocess.run([sys.executable, "-c", _BURNER.replace("time.sleep(60)", "")], check=True)
    assert sum(psutil.Process().cpu_times()[2:4]) >= 0.28
    probe = subprocess.run(
        [sys.executable, "-c", "import os\nfrom jobsvc.bench.processes import FOREIGN_CPU, "
         "foreign_cpu_now\nprint(foreign_cpu_now()[os.getppid(), FOREIGN_CPU])"],
        capture_output=True, text=True, check=True)
    mine = psutil.Process().cpu_times()
    # To a clock tick: its own CPU, none of the burner's.
    assert float(probe.stdout) <= mine.user + mine.system + 0.02
