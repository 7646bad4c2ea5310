"""The GC pause meter the benchmark reads from each worker."""

from __future__ import annotations

import gc

import pytest

from jobsvc.bench.gcpause import GcPauseMeter

pytestmark = pytest.mark.bench


def test_meter_records_each_generation_and_starts_over_after_a_take() -> None:
    meter = GcPauseMeter()
    meter.install()
    try:
        cycles = []
        for _ in range(20_000):
            node: list[object] = []
            node.append(node)
            cycles.append(node)
        del cycles, node
        gc.collect(0)
        gc.collect(2)
        reading = meter.take()
    finally:
        meter.uninstall()
    assert reading["gc_collections_by_generation"][0] >= 1
    assert reading["gc_collections_by_generation"][2] >= 1
    walls = reading["gc_pause_max_ms_by_generation"]
    assert walls[2] > 0 and reading["gc_pause_max_ms"] == max(walls)
    # Collection CPU time can exceed wall time only by the clocks' resolution.
    assert 0 < reading["gc_cpu_max_ms"] <= reading["gc_pause_max_ms"] + 1
    assert meter.take()["gc_pause_max_ms"] == 0.0


def test_collections_while_no_work_is_in_flight_are_kept_apart() -> None:
    working = [True]
    meter = GcPauseMeter(working=lambda: working[0])
    meter.install()
    try:
        gc.collect(0)
        working[0] = False
        gc.collect(0)
        gc.collect(1)
        reading = meter.take()
    finally:
        meter.uninstall()
    assert reading["gc_collections_by_generation"] == [1, 0, 0]
    assert reading["gc_idle_collections"] >= 2
    assert reading["gc_idle_pause_max_ms"] > 0
    assert meter.take()["gc_idle_collections"] == 0
