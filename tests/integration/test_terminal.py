"""`jobsvc demo` and `jobsvc bench` in a real terminal (tmux), as a person runs them: their
progress bars tick every second and move with the work, and SIGTERM (as `timeout` and
supervisors send it; Ctrl-C unwinds the same way) stops every worker and engine the command
started. Each command starts its own workers, on a database and a Redis of its own."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from jobsvc.private_redis import PrivateRedis
from tests.support.environment import TEST_DATABASE, free_port, recreate_database
from tests.support.terminal import Pane, bars, engine_tree, terminate_and_check, until_shown, watch
from tests.support.waiting import until

pytestmark = pytest.mark.integration


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


def test_the_demo_bar_ticks_and_moves_with_the_jobs_and_sigterm_stops_its_workers(
        pane_for: Callable[[list[str]], Pane]) -> None:
    pane = pane_for(["demo", "--documents", "48", "--questions", "4", "--words", "400"])
    until_shown(pane, "the jobs' progress bar",
                 lambda: any(total == 192 for _, total, _ in bars(pane)))
    seen = watch(pane, 4)
    assert len({elapsed for _, _, elapsed in seen}) >= 3, seen
    until("a count between none and all", lambda: any(
        0 < done < total for done, total, _ in bars(pane)), 120, every=0.1)
    terminate_and_check(pane)


def test_the_bench_bar_ticks_while_a_pair_runs_and_sigterm_stops_its_engines(
        pane_for: Callable[[list[str]], Pane]) -> None:
    pane = pane_for(["bench", "--shards", "1", "--trials", "1"])
    until("an engine under the bench", lambda: engine_tree(pane.process), 180,
          ignoring=(psutil.NoSuchProcess,))
    seen = watch(pane, 4)
    assert seen and all(total == 1 for _, total, _ in seen), pane.screen()
    assert len({elapsed for _, _, elapsed in seen}) >= 3, seen
    terminate_and_check(pane)
