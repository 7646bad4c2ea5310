"""Shards joining and leaving: policies follow the live set, and the simulator reports how
many documents moved per change."""

from __future__ import annotations

import argparse

import pytest

from jobsvc.routing.policies import AffinityPolicy, CacheAwarePolicy, RoundRobinPolicy
from jobsvc.settings import Settings
from jobsvc.simulate import (
    FleetChange,
    WorkloadError,
    WorkloadShape,
    add_arguments,
    changed_fleet,
    generate,
    parse_changes,
    run_from_args,
    run_simulation,
)

pytestmark = pytest.mark.unit

# Every document asked in every round of 256 jobs, so each is asked again after each change.
ROUNDS = WorkloadShape(jobs=256 * 12, documents=256)


def _affinity_run(changes: list[FleetChange]) -> dict:
    return run_simulation(generate("reuse", ROUNDS), shards=8, policy="affinity",
                          cache_blocks=4096, changes=changes)


def test_a_shard_leaving_remaps_exactly_its_own_documents() -> None:
    report = _affinity_run([FleetChange(256 * 4, "leave", 3)])
    change, = report["fleet_changes"]
    before = run_simulation(generate("reuse", WorkloadShape(jobs=256 * 4, documents=256)),
                            shards=8, policy="affinity", cache_blocks=4096)
    held_by_leaver = before["shard_jobs"][3] / (256 * 4)
    assert change["documents_asked_again"] == 256
    assert change["remapped_share"] == pytest.approx(held_by_leaver)
    assert change["floor"] == pytest.approx(1 / 8)
    assert report["shard_jobs"][3] == before["shard_jobs"][3]


def test_a_shard_joining_keeps_every_document_where_it_was_and_draws_new_ones() -> None:
    shape = WorkloadShape(jobs=256 * 12, documents=256)
    report = run_simulation(generate("unique", shape), shards=8, policy="affinity",
                            cache_blocks=4096, changes=[FleetChange(1000, "join", 12)])
    assert report["shard_jobs"][12] > 0
    settled = _affinity_run([FleetChange(256 * 4, "join", 12)])
    change, = settled["fleet_changes"]
    assert change["remapped_share"] == 0
    assert change["floor"] == pytest.approx(1 / 9)
    assert 0 < change["hit_rate_after"] <= 1


def test_a_shard_that_left_gets_no_job_until_it_joins_again() -> None:
    report = run_simulation(
        generate("unique", WorkloadShape(jobs=3000, documents=3000)), shards=4,
        policy="round_robin", cache_blocks=64,
        changes=[FleetChange(1000, "leave", 2), FleetChange(2000, "join", 2)])
    # Round robin deals evenly: shard 2 takes a quarter of the first and last thousand jobs.
    assert report["shard_jobs"][2] == pytest.approx(500, abs=2)
    assert sum(report["shard_jobs"]) == 3000


def test_fleet_changes_are_read_in_job_order_and_refused_when_malformed() -> None:
    assert parse_changes("join:9@500, leave:3@100") == [FleetChange(100, "leave", 3),
                                                        FleetChange(500, "join", 9)]
    for bad in ("grow:3@10", "leave:x@10", "leave:3"):
        with pytest.raises(WorkloadError, match="KIND:SHARD@JOB"):
            parse_changes(bad)


def test_only_live_shards_may_leave_and_only_new_ones_join() -> None:
    assert changed_fleet([0, 1, 5], FleetChange(0, "join", 3)) == [0, 1, 3, 5]
    assert changed_fleet([0, 1, 5], FleetChange(0, "leave", 1)) == [0, 5]
    with pytest.raises(WorkloadError):
        changed_fleet([0, 1], FleetChange(0, "join", 1))
    with pytest.raises(WorkloadError):
        changed_fleet([0], FleetChange(0, "leave", 0))


def test_reindexing_keeps_the_state_of_shards_that_stay_and_forgets_the_leaver() -> None:
    affinity = AffinityPolicy(3)
    affinity.shard_of.update({"a": 0, "b": 1, "c": 2})
    affinity.loads[:] = [5, 6, 7]
    # Shard index 1 leaves and a new shard joins after the others.
    affinity.reindex([0, 2, None])
    assert affinity.shard_of == {"a": 0, "c": 1}
    assert affinity.loads == [5, 7, 0]

    aware = CacheAwarePolicy(2, block_size=4, capacity_blocks=8)
    aware.route(("x1", "x2"), 10)
    aware.route(("y1", "y2"), 10)
    held = {shard for shard in range(2) if aware.overlap(shard, ("x1", "x2")) == 2}
    aware.reindex([None, *held])
    assert aware.overlap(1, ("x1", "x2")) == 2
    assert aware.overlap(0, ("x1", "x2")) == 0
    assert aware.holders["x1"] == {1}
    assert "y1" not in aware.holders

    # Dealing went on at the fourth of four shards; two remain, and it goes on at the second.
    dealer = RoundRobinPolicy(4, first=3)
    dealer.reindex([0, 1])
    assert [dealer.choose((), 1) for _ in range(3)] == [1, 0, 1]


def test_the_command_line_replays_fleet_changes() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workload", "reuse", "--jobs", "600", "--shards", "4",
                              "--policy", "affinity", "--changes", "leave:2@300"])
    report = run_from_args(Settings.from_env({}), args)
    change, = report["fleet_changes"]
    assert (change["kind"], change["shard"], change["shards_after"]) == ("leave", 2, 3)
    # The affinity map keeps a load per shard and a shard per document: all 256 of `reuse`
    # without the change; with it, those of the departed shard not asked again are gone.
    steady = run_from_args(Settings.from_env({}), parser.parse_args(
        ["--workload", "reuse", "--jobs", "600", "--shards", "4", "--policy", "affinity"]))
    assert steady["router_state_entries"] == 4 + 256
    assert report["router_state_entries"] < 3 + 256
