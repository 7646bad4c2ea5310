"""Keeps a worker's engine from outliving the worker.

vLLM starts its engine processes itself (by spawn on CPU hosts, by fork on GPU hosts), and
neither way gives them a parent-death signal; a worker killed with SIGKILL cannot stop them,
so they would live on, holding their memory (on GPU hosts, the GPU's) beside the engine of
the restarted worker. So a worker first starts this small process. The kernel signals it as
soon as the worker dies (PR_SET_PDEATHSIG, which needs no supervisor), and it then kills
every process it saw under the worker, with whatever those started since. It looks every
second until the worker says, on its stdin, that the engine has started; it looks once more
then, and sleeps until the worker dies or closes its stdin on a warm shutdown (after which it
kills whatever of the engine is left)."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import IO

import psutil

_PR_SET_PDEATHSIG = 1
# How often the processes under the worker are listed until its engine has started.
_LOOK_SECONDS = 1.0
# How long the processes it kills may take to go, and a warm shutdown may wait for it.
_WAIT_SECONDS = 10.0


class EngineReaper:
    """The worker's side: start the reaper before the engine, tell it once the engine runs,
    and stop it after the engine has shut down."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the reaper process, with the worker's PID to watch."""
        # The kernel sends the parent-death signal when the thread that started the process
        # ends, not only the process: the main thread lasts as long as the worker.
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the engine reaper must be started from the main thread")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "jobsvc.workers.engine_reaper", str(os.getpid())],
            stdin=subprocess.PIPE)

    def engine_started(self) -> None:
        """Tell the reaper the engine is up, so it takes note of the engine's processes."""
        stdin = self._stdin()
        stdin.write(b"started\n")
        stdin.flush()

    def stop(self) -> None:
        """Close the reaper's pipe after a clean shutdown: it kills whatever engine process outlived
        the shutdown and ends, or is terminated if it does not."""
        if self._process is None:
            return
        self._stdin().close()
        try:
            self._process.wait(timeout=_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            # A forked engine process still holds the pipe open: reap now.
            self._process.terminate()
            self._process.wait()

    def _stdin(self) -> IO[bytes]:
        assert self._process is not None and self._process.stdin is not None
        return self._process.stdin


def _look(worker: int, seen: dict[int, psutil.Process]) -> None:
    """Add the processes now under the worker to those seen (never the reaper itself)."""
    try:
        children = psutil.Process(worker).children(recursive=True)
    except psutil.Error:
        return
    seen.update((child.pid, child) for child in children if child.pid != os.getpid())


def _gone(process: psutil.Process) -> bool:
    """Ended, or a zombie: its parent, not this process, reaps it."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _reap(seen: dict[int, psutil.Process]) -> None:
    """Kill every process seen that still runs (the same process, not a reused ID), and the
    processes they started since; wait (bounded) until they have ended."""
    victims: dict[int, psutil.Process] = {}
    for process in seen.values():
        try:
            if not _gone(process):
                victims[process.pid] = process
                victims.update((child.pid, child) for child in process.children(recursive=True))
        except psutil.Error:
            continue
    for process in victims.values():
        try:
            process.kill()
        except psutil.Error:
            continue
    deadline = time.monotonic() + _WAIT_SECONDS
    while not all(_gone(process) for process in victims.values()):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def signal_on_parent_death(signum: int) -> None:
    """Have the kernel send this process `signum` when its parent dies, even by SIGKILL."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)


def main(worker: int) -> None:
    """The reaper process: note the worker's descendants as they appear, and kill them when the
    worker dies (its parent-death signal) or closes the pipe."""
    seen: dict[int, psutil.Process] = {}

    def on_worker_death(_signal: int, _frame: FrameType | None) -> None:
        _reap(seen)
        os._exit(0)

    # A terminal's Ctrl-C reaches the whole foreground group: the worker shuts down warmly
    # and stops this process itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_worker_death)
    signal_on_parent_death(signal.SIGTERM)
    if os.getppid() != worker:
        # The worker died before the signal was asked for.
        on_worker_death(signal.SIGTERM, None)
    stdin = sys.stdin.buffer
    while not select.select([stdin], [], [], _LOOK_SECONDS)[0]:
        _look(worker, seen)
    while stdin.readline():
        _look(worker, seen)
    _reap(seen)


if __name__ == "__main__":
    main(int(sys.argv[1]))
