"""Commands in a real terminal (tmux), as a person runs them: their progress bars tick every
second and move with the work, and SIGTERM (as `timeout` and supervisors send it; Ctrl-C
unwinds the same way) stops every worker and engine the command started."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from jobsvc.private_redis import PrivateRedis
from tests.conftest import TEST_DATABASE, free_port, recreate_database
from tests.waiting import until

pytestmark = pytest.mark.integration

# tqdm's bar: "finished:  40%|████      | 77/192 [00:05<00:07, 14.1job/s]".
_BAR = re.compile(r"(\d+)/(\d+) \[(\d\d:\d\d)<")


class Pane:
    """A command running alone in a detached tmux session of 160 columns."""

    def __init__(self, command: list[str], cwd: Path, environment: dict[str, str]) -> None:
        tmux = shutil.which("tmux")
        assert tmux, "tmux is missing: run ops/test-tools.sh as root"
        self._tmux = tmux
        self.session = f"jobsvc-test-{uuid.uuid4().hex[:8]}"
        exports = " ".join(f"{name}={shlex.quote(value)}" for name, value in environment.items())
        # The pane stays after the command exits, so its last words can be read.
        subprocess.run([tmux, "new-session", "-d", "-s", self.session, "-x", "160", "-y", "30",
                        "-c", str(cwd), f"exec env {exports} {shlex.join(command)}", ";",
                        "set-option", "-t", self.session, "remain-on-exit", "on"], check=True)
        self.process = psutil.Process(int(self._tmux_out("display-message", "-p", "-t",
                                                         self.session, "#{pane_pid}")))

    def _tmux_out(self, *arguments: str) -> str:
        return subprocess.run([self._tmux, *arguments], check=True, capture_output=True,
                              text=True).stdout.strip()

    def screen(self) -> str:
        return self._tmux_out("capture-pane", "-p", "-t", self.session)

    def close(self) -> None:
        subprocess.run([self._tmux, "kill-session", "-t", self.session], check=False,
                       capture_output=True)


@pytest.fixture()
def pane_for(tmp_path: Path) -> Iterator[Callable[[list[str]], Pane]]:
    """Start a `jobsvc` command in a pane, on a database and a Redis of its own, so that its
    workers consume no other test's queue."""
    panes: list[Pane] = []
    database = recreate_database(f"{TEST_DATABASE}_terminal")
    with PrivateRedis() as broker:
        environment = {"JOBSVC_REDIS_URL": broker.url, "JOBSVC_DATABASE_URL": database,
                       "JOBSVC_METRICS_PORT": str(free_port()), "JOBSVC_SHARDS": "1",
                       "PATH": os.environ["PATH"], "HOME": str(tmp_path), "TERM": "xterm"}

        def start(arguments: list[str]) -> Pane:
            pane = Pane([sys.executable, "-m", "jobsvc", *arguments], tmp_path, environment)
            panes.append(pane)
            return pane

        yield start
        for pane in panes:
            if pane.process.is_running():
                pane.process.kill()
            pane.close()


def _bars(pane: Pane) -> list[tuple[int, int, str]]:
    """The progress bars on the screen: (done, total, elapsed)."""
    return [(int(done), int(total), elapsed) for done, total, elapsed
            in _BAR.findall(pane.screen())]


def _watch(pane: Pane, seconds: float) -> list[tuple[int, int, str]]:
    """The last bar of each screen, read every 0.2 s for `seconds`."""
    seen: list[tuple[int, int, str]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if bars := _bars(pane):
            seen.append(bars[-1])
        time.sleep(0.2)
    return seen


def _until_shown(pane: Pane, what: str, check: Callable[[], bool]) -> None:
    """Wait (bounded) for the screen to show something; the screen in the error if not."""
    try:
        until(what, check, 240, every=0.2)
    except AssertionError as error:
        raise AssertionError(f"{error}; the screen:\n{pane.screen()}") from None


def _engine_tree(command: psutil.Process) -> list[psutil.Process]:
    """The command's process tree once a vLLM engine process is in it, else []."""
    tree = command.children(recursive=True)
    return tree if any(p.name().startswith("VLLM") for p in tree if p.is_running()) else []


def _terminate_and_check(pane: Pane) -> None:
    """SIGTERM to the command: it exits 143 and nothing it started lives on."""
    tree = until("an engine under the command", lambda: _engine_tree(pane.process), 180,
                 ignoring=(psutil.NoSuchProcess,))
    pane.process.send_signal(signal.SIGTERM)
    until("the command's exit", lambda: not pane.process.is_running()
          or pane.process.status() == psutil.STATUS_ZOMBIE, 120, ignoring=(psutil.Error,))
    def survivors() -> list[psutil.Process]:
        return [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    # Helpers such as multiprocessing's resource tracker leave once their parent has gone.
    with contextlib.suppress(AssertionError):
        until("every process under the command gone", lambda: not survivors(), 30,
              ignoring=(psutil.Error,))
    assert not survivors(), [(p.pid, p.cmdline()) for p in survivors()]
    assert "jobsvc: terminated" in pane.screen()


def test_the_demo_bar_ticks_and_moves_with_the_jobs_and_sigterm_stops_its_workers(
        pane_for: Callable[[list[str]], Pane]) -> None:
    pane = pane_for(["demo", "--documents", "48", "--questions", "4", "--words", "400"])
    _until_shown(pane, "the jobs' progress bar",
                 lambda: any(total == 192 for _, total, _ in _bars(pane)))
    seen = _watch(pane, 4)
    assert len({elapsed for _, _, elapsed in seen}) >= 3, seen
    until("a count between none and all", lambda: any(
        0 < done < total for done, total, _ in _bars(pane)), 120, every=0.1)
    _terminate_and_check(pane)


def test_the_bench_bar_ticks_while_a_pair_runs_and_sigterm_stops_its_engines(
        pane_for: Callable[[list[str]], Pane]) -> None:
    pane = pane_for(["bench", "--shards", "1", "--trials", "1"])
    until("an engine under the bench", lambda: _engine_tree(pane.process), 180,
          ignoring=(psutil.NoSuchProcess,))
    seen = _watch(pane, 4)
    assert seen and all(total == 1 for _, total, _ in seen), pane.screen()
    assert len({elapsed for _, _, elapsed in seen}) >= 3, seen
    _terminate_and_check(pane)
