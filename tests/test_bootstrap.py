"""A worker bound to CPU cores keeps its whole process tree on them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobsvc.errors import ConfigurationError
from workers.bootstrap import cpu_cores

_REPORT_AFFINITIES = """
import multiprocessing, os, sys
from workers.bootstrap import keep_to_device

def child(queue):
    queue.put(sorted(os.sched_getaffinity(0)))

if __name__ == "__main__":
    keep_to_device(sys.argv[1])
    queue = multiprocessing.get_context("spawn").Queue()
    process = multiprocessing.get_context("spawn").Process(target=child, args=(queue,))
    process.start()
    print(sorted(os.sched_getaffinity(0)), queue.get(timeout=60))
    process.join()
"""


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
    script = tmp_path / "report_affinities.py"
    script.write_text(_REPORT_AFFINITIES)
    reported = subprocess.run([sys.executable, str(script), "1"], cwd=Path(__file__).parents[1],
                              capture_output=True, text=True, timeout=120, check=True)
    assert reported.stdout.split() == ["[1]", "[1]"]


def test_a_device_naming_cores_the_machine_lacks_stops_the_worker_with_a_clear_error() -> None:
    started = subprocess.run(
        [sys.executable, "-m", "jobsvc", "worker", "--shard", "0", "--device", "4090-4091"],
        cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=120)
    assert started.returncode != 0
    assert "--device '4090-4091' names cores this machine does not offer" in started.stderr
