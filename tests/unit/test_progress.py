"""Progress bars: a tqdm bar redrawn in place on a terminal, plain lines now and then
elsewhere, moved on by estimates and set right by counts."""

from __future__ import annotations

import io

import pytest

from jobsvc.console import ProgressBar
from tests.support.streams import Clock, Terminal

pytestmark = pytest.mark.unit


def test_away_from_a_terminal_progress_is_a_plain_line_now_and_then() -> None:
    stream, clock = io.StringIO(), Clock()
    with ProgressBar(40, "finished", stream=stream, every=10, clock=clock) as bar:
        for second in range(1, 25):
            clock.now = second
            bar.advance(1)
        bar.write("a line of its own")
        bar.reach(40)
    assert stream.getvalue().splitlines() == [
        "finished: 0 of 40 jobs", "finished: 10 of 40 jobs", "finished: 20 of 40 jobs",
        "a line of its own", "finished: 40 of 40 jobs"]


def test_on_a_terminal_the_bar_is_redrawn_in_place_and_ends_full() -> None:
    terminal = Terminal()
    with ProgressBar(8, "pairs", unit="pair", stream=terminal) as bar:
        bar.advance(3)
        bar.write("pair 3/8: ratio 1.01")
        bar.reach(8)
    # Each redraw returns to the line's start; only the written line and the end add lines.
    redraws = terminal.getvalue().split("\r")
    assert redraws[1].startswith("pairs:   0%") and "0/8" in redraws[1]
    assert "pair 3/8: ratio 1.01\n" in redraws
    assert redraws[-1].startswith("pairs: 100%") and "8/8" in redraws[-1]
    assert terminal.getvalue().count("\n") == 2


def test_estimates_never_pass_the_total_and_a_count_may_set_them_back() -> None:
    bar = ProgressBar(10, "finished", stream=io.StringIO())
    bar.advance(float("inf"))
    assert bar.done == 10
    bar.reach(7)
    assert bar.done == 7
    bar.advance(2)
    assert bar.done == 9
    bar.close()
