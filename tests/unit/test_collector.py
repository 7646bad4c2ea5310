"""When a worker's garbage collector may run: held off while batches run, as usual after."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest

from jobsvc.workers.collector import CollectionWindow

pytestmark = pytest.mark.unit


def _collections() -> int:
    return sum(stats["collections"] for stats in gc.get_stats())


def _collections_during(make_survivors: Callable[[], Any]) -> int:
    """Collections while `make_survivors` runs (from a fresh start), not counting any that
    follows it."""
    gc.collect()
    before = _collections()
    survivors = make_survivors()
    during = _collections() - before
    del survivors
    return during


def _survivors(count: int) -> list[list[int]]:
    return [[index] for index in range(count)]


def _inside(window: CollectionWindow, count: int) -> Callable[[], Any]:
    def burst() -> Any:
        with window.busy():
            survivors = _survivors(count)
            # Read inside the window: the collection its end allows comes after.
            return survivors, _collections()
    return burst


def test_a_burst_of_surviving_objects_triggers_no_collection_while_busy() -> None:
    gc.collect()
    before = _collections()
    _, inside = _inside(CollectionWindow(busy_threshold=50_000), 20_000)()
    assert inside == before
    # The same burst outside a busy window meets the usual threshold many times over.
    assert _collections_during(lambda: _survivors(20_000)) > 0


def test_past_the_busy_threshold_a_collection_still_runs() -> None:
    gc.collect()
    before = _collections()
    _, inside = _inside(CollectionWindow(busy_threshold=5_000), 20_000)()
    assert inside > before


def test_the_last_batch_to_end_restores_the_usual_threshold() -> None:
    usual = gc.get_threshold()
    window = CollectionWindow(busy_threshold=90_000)
    first_in, second_in, release = threading.Event(), threading.Event(), threading.Event()

    def batch(entered: threading.Event) -> None:
        with window.busy():
            entered.set()
            release.wait(10)

    threads = [threading.Thread(target=batch, args=(first_in,)),
               threading.Thread(target=batch, args=(second_in,))]
    threads[0].start()
    assert first_in.wait(10)
    threads[1].start()
    assert second_in.wait(10)
    both_running = gc.get_threshold()[0]
    release.set()
    for thread in threads:
        thread.join(10)
    assert both_running == 90_000
    assert gc.get_threshold() == usual
