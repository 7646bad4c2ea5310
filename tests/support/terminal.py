"""A real terminal (tmux) for the tests of what commands show a person: a command alone in a
detached pane, its screen as text, and the progress bars on it."""

from __future__ import annotations

import contextlib
import re
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

from tests.support.waiting import until

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


def bars(pane: Pane) -> list[tuple[int, int, str]]:
    """The progress bars on the screen: (done, total, elapsed)."""
    return [(int(done), int(total), elapsed) for done, total, elapsed
            in _BAR.findall(pane.screen())]


def watch(pane: Pane, seconds: float) -> list[tuple[int, int, str]]:
    """The last bar of each screen, read every 0.2 s for `seconds`."""
    seen: list[tuple[int, int, str]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if shown := bars(pane):
            seen.append(shown[-1])
        time.sleep(0.2)
    return seen


def until_shown(pane: Pane, what: str, check: Callable[[], bool]) -> None:
    """Wait (bounded) for the screen to show something; the screen in the error if not."""
    try:
        until(what, check, 240, every=0.2)
    except AssertionError as error:
        raise AssertionError(f"{error}; the screen:\n{pane.screen()}") from None


def engine_tree(command: psutil.Process) -> list[psutil.Process]:
    """The command's process tree once a vLLM engine process is in it, else []."""
    tree = command.children(recursive=True)
    return tree if any(p.name().startswith("VLLM") for p in tree if p.is_running()) else []


def terminate_and_check(pane: Pane) -> None:
    """SIGTERM to the command: it exits 143 and nothing it started lives on."""
    tree = until("an engine under the command", lambda: engine_tree(pane.process), 180,
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
