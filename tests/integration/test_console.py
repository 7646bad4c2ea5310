"""What the command line shows: a few lines of its own, library logging only when asked for,
and progress as one line (updated in place on a terminal, now and then elsewhere)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobsvc.console import StatusLine, configure_logging
from tests.support.streams import Clock, Terminal

pytestmark = pytest.mark.integration


def test_progress_away_from_a_terminal_is_a_plain_line_now_and_then() -> None:
    stream, clock = io.StringIO(), Clock()
    status = StatusLine(stream, every=10, clock=clock)
    for second in range(25):
        clock.now = second
        status.update(f"starting: {second} s")
    status.finish()
    assert stream.getvalue().splitlines() == [
        "starting: 0 s", "starting: 10 s", "starting: 20 s", "starting: 24 s"]


def test_progress_in_a_terminal_is_one_line_rewritten_in_place() -> None:
    stream = Terminal()
    status = StatusLine(stream, every=10, clock=Clock())
    for second in range(3):
        status.update(f"starting: {second} s")
    status.finish("ready")
    assert stream.getvalue() == ("\r\x1b[Kstarting: 0 s\r\x1b[Kstarting: 1 s"
                                 "\r\x1b[Kstarting: 2 s\r\x1b[Kready\n")


def migrate(tmp_path: Path, **environment: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("JOBSVC_")}
    env |= {"JOBSVC_DATABASE_URL": f"sqlite:///{tmp_path / 'jobs.db'}", **environment}
    return subprocess.run([sys.executable, "-m", "jobsvc", "migrate"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=True)


def test_a_command_shows_its_own_line_and_no_library_logging(tmp_path: Path) -> None:
    run = migrate(tmp_path)
    assert len(run.stdout.splitlines()) == 1 and "database at head" in run.stdout
    assert run.stderr == ""


def test_an_explicit_log_level_shows_library_logging_again(tmp_path: Path) -> None:
    run = migrate(tmp_path, JOBSVC_LOG_LEVEL="INFO")
    assert "alembic.runtime.migration" in run.stderr and "Running upgrade" in run.stderr


@pytest.mark.parametrize(("explicit", "worker", "inherited", "expected"), [
    (False, False, None, "WARNING"),
    (False, False, "DEBUG", "DEBUG"),
    (False, True, None, "INFO"),
    (True, True, "WARNING", "INFO"),
])
def test_vllm_logs_at_the_asked_level_else_at_its_own_or_the_commands(
        monkeypatch: pytest.MonkeyPatch, explicit: bool, worker: bool, inherited: str | None,
        expected: str) -> None:
    if inherited is None:
        monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    else:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", inherited)
    configure_logging("INFO", explicit=explicit, worker=worker)
    assert os.environ["VLLM_LOGGING_LEVEL"] == expected
