"""The benchmark's arithmetic and workloads: pure logic."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

from jobsvc.bench.measure import (
    ENGINE_ROLE,
    ArmResult,
    Pair,
    busy_seconds,
    chance_to_clear,
    cpu_seconds_by_role,
    ideal_hit_rate,
    mean_shard_seconds,
    median,
    median_interval,
    outside_engine_ms_per_job_by_role,
    parity_checks,
    percentile,
    ratio_summary,
    reading_at,
    schedstat_wait_ns,
    shard_finish_spread_seconds,
    steal_seconds,
    summarize_pairs,
    wait_seconds,
)
from jobsvc.bench.options import BenchOptions, bench_jobs, check_options, shard_devices
from jobsvc.bench.report import GcTotals, Totals, plot_pairs, run_report
from jobsvc.errors import ConfigurationError, InvalidJob
from jobsvc.settings import Settings
from jobsvc.workloads import read_jsonl_jobs

pytestmark = pytest.mark.bench


def test_percentiles_interpolate_linearly() -> None:
    assert percentile([1, 2, 3, 4], 0.5) == 2.5
    assert percentile([5, 1, 3], 0.0) == 1
    assert percentile([5, 1, 3], 1.0) == 5
    assert percentile(list(range(101)), 0.99) == pytest.approx(99)
    assert median([3, 1, 2]) == 2
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_median_interval_brackets_the_median_and_widens_with_the_spread() -> None:
    steady = [0.99, 1.0, 1.01, 1.0, 0.99, 1.01, 1.0]
    noisy = [0.9, 1.1, 0.95, 1.05, 0.85, 1.15, 1.0]
    low, high = median_interval(steady)
    assert low <= median(steady) <= high
    assert (low, high) == median_interval(steady)  # seeded: a report reproduces
    noisy_low, noisy_high = median_interval(noisy)
    assert noisy_high - noisy_low > high - low
    assert min(noisy) <= noisy_low < median(noisy) < noisy_high <= max(noisy)
    assert median_interval([0.97]) == (0.97, 0.97)
    with pytest.raises(ValueError):
        median_interval([])
    with pytest.raises(ValueError):
        median_interval(steady, level=1.0)


def test_cpu_used_counts_new_processes_from_zero_and_ignores_vanished_ones() -> None:
    before = {(1, "worker"): 10.0, (2, "worker"): 5.0, (4, ENGINE_ROLE): 20.0}
    after = {(1, "worker"): 12.5, (3, "redis"): 1.0, (4, ENGINE_ROLE): 26.0,
             (5, ENGINE_ROLE): 2.0}
    used = cpu_seconds_by_role(before, after)
    assert used == pytest.approx({"worker": 2.5, "redis": 1.0, ENGINE_ROLE: 8.0})
    arm = ArmResult(jobs=10, seconds=1.0, output_tokens=10, cpu_by_role=used)
    assert (arm.cpu_seconds, arm.outside_engine_cpu_seconds) == pytest.approx((11.5, 3.5))


def _arm(jobs: int, seconds: float, cpu: float, outside_engine: float = 1.0) -> ArmResult:
    return ArmResult(jobs=jobs, seconds=seconds, output_tokens=jobs * 16,
                     cpu_by_role={"worker": outside_engine, ENGINE_ROLE: cpu - outside_engine})


def test_pair_summary_gives_median_worst_ratio_and_cpu_ratio() -> None:
    pairs = [Pair(_arm(100, 10.0, 20.0), _arm(100, 10.1, 20.2), False),
             Pair(_arm(100, 10.0, 20.0), _arm(100, 9.9, 20.0), True),
             Pair(_arm(100, 10.0, 20.0), _arm(100, 10.5, 20.4), False)]
    summary = summarize_pairs(pairs)
    assert summary["median_ratio"] == pytest.approx(10.0 / 10.1)
    low, high = summary["median_ratio_interval_95"]
    assert 10.0 / 10.5 <= low <= summary["median_ratio"] <= high <= 10.0 / 9.9
    assert summary["pairs_behind"] == 2
    assert summary["min_ratio"] == pytest.approx(10.0 / 10.5)
    assert summary["cpu_ratio"] == pytest.approx(60.6 / 60.0)
    assert summary["added_cpu_share"] == 0.0
    assert pairs[0].service.tokens_per_second == pytest.approx(1600 / 10.1)


def test_pooled_ratios_are_summarised_as_one_run_s_pairs_are() -> None:
    ratios = [0.97, 1.02, 0.99, 1.00, 0.95]
    summary = ratio_summary(ratios)
    assert summary["median_ratio"] == 0.99
    assert summary["pairs_behind"] == 3  # 1.00 is not behind
    assert (summary["min_ratio"], summary["max_ratio"]) == (0.95, 1.02)
    assert summary["median_ratio_interval_95"] == list(median_interval(ratios))


def test_chance_to_clear_draws_runs_from_the_pairs_a_host_gave() -> None:
    assert chance_to_clear([0.99, 1.0, 1.02], pairs_per_run=7) == {
        "median_ratio": 1.0, "min_ratio": 1.0, "both": 1.0}
    # One pair in ten below 0.95: seven draws all miss it 0.9 ** 7 of the time.
    chance = chance_to_clear([0.93] + [1.0] * 9, pairs_per_run=7)
    assert chance["min_ratio"] == pytest.approx(0.9 ** 7, abs=0.03)
    assert chance["median_ratio"] > 0.99  # a median misses only if 4+ of 7 draws are low
    assert chance["both"] == chance["min_ratio"]  # every run that misses the median misses min
    # Pairs centred below the median bar rarely give a run whose median clears it.
    behind = chance_to_clear([0.96, 0.97, 0.98, 0.985, 1.0], pairs_per_run=10)
    assert behind["median_ratio"] < 0.1 and behind["min_ratio"] == 1.0
    assert chance_to_clear([0.93] + [1.0] * 9, 7) == chance  # seeded: a report reproduces
    with pytest.raises(ValueError):
        chance_to_clear([], pairs_per_run=7)
    with pytest.raises(ValueError):
        chance_to_clear([1.0], pairs_per_run=0)


def _parity_report(**figures: object) -> dict[str, object]:
    report: dict[str, object] = {
        "workload": "reuse", "median_ratio": 0.995, "min_ratio": 0.96, "cpu_ratio": 1.004,
        "bytes_raw": 1_600_000, "bytes_enqueued": 100_000,
        "gc_pause_max_ms": {"shard0@a": 0.0, "shard1@a": 3.9}}
    report.update(figures)
    return report


def test_parity_checks_pass_a_report_that_clears_every_bar() -> None:
    assert parity_checks(_parity_report()) == {"median_ratio": True, "min_ratio": True,
                                               "cpu_ratio": True, "bytes_enqueued": True,
                                               "gc_pause_max_ms": True}


@pytest.mark.parametrize(("figure", "value"), [
    ("median_ratio", 0.989), ("min_ratio", 0.949), ("cpu_ratio", 1.011),
    ("bytes_enqueued", 100_001), ("gc_pause_max_ms", {"shard0@a": 0.0, "shard1@a": 4.1})])
def test_parity_checks_fail_each_bar_just_past_it(figure: str, value: object) -> None:
    checks = parity_checks(_parity_report(**{figure: value}))
    assert checks[figure] is False
    assert all(passed for name, passed in checks.items() if name != figure)


def test_parity_checks_leave_out_what_a_run_cannot_show() -> None:
    unique = parity_checks(_parity_report(workload="unique"))
    assert unique["bytes_enqueued"] is None and unique["median_ratio"] is True
    twice = {key: value for key, value in _parity_report().items()
             if key not in ("bytes_enqueued", "gc_pause_max_ms")}
    checks = parity_checks(twice)
    assert checks["bytes_enqueued"] is None and checks["gc_pause_max_ms"] is None


def test_added_cpu_share_compares_the_cpu_each_arm_spends_outside_the_engine() -> None:
    pairs = [Pair(_arm(100, 10.0, 20.0, 0.5), _arm(100, 10.0, 21.0, 0.9), False),
             Pair(_arm(100, 10.0, 20.0, 0.5), _arm(100, 10.0, 19.0, 0.7), True)]
    summary = summarize_pairs(pairs)
    assert summary["standalone_outside_engine_cpu_seconds_per_job"] == pytest.approx(0.005)
    assert summary["service_outside_engine_cpu_seconds_per_job"] == pytest.approx(0.008)
    assert summary["added_cpu_share"] == pytest.approx(0.6 / 40.0)
    assert summary["service_outside_engine_cpu_ms_per_job_by_role"] == {"worker": 8.0}
    assert outside_engine_ms_per_job_by_role([pairs[0].service]) == {"worker": 9.0}


def test_steal_is_read_from_the_aggregate_cpu_line_and_summed_per_arm() -> None:
    proc_stat = ("cpu  437606 34234 72958 351094 4700 0 1150 52218 0 0\n"
                 "cpu0 218803 17117 36479 175547 2350 0 575 26109 0 0\n")
    assert steal_seconds(proc_stat, 100) == pytest.approx(522.18)
    assert steal_seconds("cpu  1 2 3 4\n", 100) == 0.0
    with pytest.raises(ValueError):
        steal_seconds("intr 1 2 3\n", 100)
    pairs = [Pair(replace(_arm(100, 10.0, 20.0), steal_seconds=0.2),
                  replace(_arm(100, 10.0, 20.0), steal_seconds=1.0), False),
             Pair(_arm(100, 10.0, 20.0), replace(_arm(100, 10.0, 20.0), steal_seconds=0.6), True)]
    summary = summarize_pairs(pairs)
    assert summary["standalone_steal_seconds_per_job"] == pytest.approx(0.001)
    assert summary["service_steal_seconds_per_job"] == pytest.approx(0.008)


def test_the_machines_cpu_is_its_busy_time_and_what_no_process_of_an_arm_spent() -> None:
    # user, nice, system, idle, iowait, irq, softirq, steal, guest, guest_nice
    proc_stat = "cpu  437606 34234 72958 351094 4700 120 1150 52218 900 0\n"
    assert busy_seconds(proc_stat, 100) == pytest.approx(5460.68)
    assert busy_seconds("cpu  1 2 3 4\n", 100) == pytest.approx(0.06)
    with pytest.raises(ValueError):
        busy_seconds("intr 1 2 3\n", 100)
    # Each arm's processes spent 20 s; the machine 20.5 and 21.5 s in the first pair.
    pairs = [Pair(replace(_arm(100, 10.0, 20.0), machine_cpu_seconds=20.5),
                  replace(_arm(100, 10.0, 20.0), machine_cpu_seconds=21.5), False),
             Pair(replace(_arm(100, 10.0, 20.0), machine_cpu_seconds=20.3),
                  replace(_arm(100, 10.0, 20.0), machine_cpu_seconds=20.7), True)]
    assert pairs[0].service.unaccounted_cpu_seconds == pytest.approx(1.5)
    summary = summarize_pairs(pairs)
    assert summary["unaccounted_cpu_ms_per_job"] == {
        "standalone": pytest.approx(4.0), "service": pytest.approx(11.0)}
    unread = [Pair(_arm(100, 10.0, 20.0), pairs[0].service, False), pairs[1]]
    assert _arm(100, 10.0, 20.0).unaccounted_cpu_seconds is None
    assert summarize_pairs(unread)["unaccounted_cpu_ms_per_job"] == {
        "standalone": None, "service": pytest.approx(11.0)}


def test_a_pair_is_disturbed_when_other_programs_took_over_two_percent_of_the_cpu() -> None:
    # The machine spent 25 s in each arm; other programs 0.3 (1.2 %), 1.0 (4 %) and 0.5 s
    # (exactly 2 %). What the kernel or a server's passing process took is not theirs.
    def arm(foreign: float | None) -> ArmResult:
        return replace(_arm(100, 10.0, 20.0), machine_cpu_seconds=25.0,
                       foreign_cpu_seconds=foreign)

    calm, busy, near = arm(0.3), arm(1.0), arm(0.5)
    assert busy.disturbed
    assert not calm.disturbed and not near.disturbed
    assert not arm(None).disturbed  # other programs' CPU was not read
    assert not replace(busy, machine_cpu_seconds=None).disturbed
    pairs = [Pair(calm, calm, False), Pair(busy, calm, True), Pair(calm, busy, False),
             Pair(near, calm, True)]
    assert [pair.disturbed for pair in pairs] == [False, True, True, False]
    summary = summarize_pairs(pairs)
    assert summary["disturbed_pairs"] == [2, 3]
    assert summary["foreign_cpu_ms_per_job"] == {"standalone": pytest.approx(5.25),
                                                 "service": pytest.approx(4.75)}
    unread = summarize_pairs([Pair(arm(None), calm, False)])["foreign_cpu_ms_per_job"]
    assert unread == {"standalone": None, "service": pytest.approx(3.0)}
    # A parent that reaped a long-lived child read 800 s: no more than the 5 s the machine
    # spent outside the arm's processes can be other programs'.
    reaped = arm(800.0)
    assert reaped.bounded_foreign_cpu_seconds == pytest.approx(5.0) and reaped.disturbed
    assert replace(reaped, machine_cpu_seconds=None).bounded_foreign_cpu_seconds == 800.0
    assert arm(None).bounded_foreign_cpu_seconds is None


def test_heads_are_medians_per_arm_and_the_extra_head_a_share_of_the_service_burst() -> None:
    def headed(seconds: float, head: float) -> ArmResult:
        return replace(_arm(100, seconds, 20.0), head_seconds=head)

    pairs = [Pair(headed(10.0, 0.08), headed(10.0, 0.13), False),
             Pair(headed(10.0, 0.09), headed(5.0, 0.12), True),
             Pair(headed(10.0, 0.20), headed(10.0, 0.20), False)]
    summary = summarize_pairs(pairs)
    assert summary["head_ms"] == pytest.approx({"standalone": 90.0, "service": 130.0})
    assert summary["service_tail_ms"] == {"p50": 0.0, "max": 0.0}
    tailed = [replace(pair, service=replace(pair.service, tail_seconds=tail))
              for pair, tail in zip(pairs, (0.01, 0.5, 0.02), strict=True)]
    assert summarize_pairs(tailed)["service_tail_ms"] == pytest.approx({"p50": 20.0, "max": 500.0})
    # Per pair 0.005, 0.006 and 0: the median of the shares, not a share of the medians.
    assert summary["extra_head_share"] == pytest.approx(0.005)
    # Without the heads: 9.92 / 9.87, 9.91 / 4.88 and 9.8 / 9.8.
    assert summary["body_ratio"] == pytest.approx(9.92 / 9.87)


def test_model_runner_waits_are_read_from_schedstat_and_summed_over_threads_per_arm() -> None:
    assert schedstat_wait_ns("13944812345 1628900123 135206\n") == 1628900123
    with pytest.raises(ValueError):
        schedstat_wait_ns("13944812345 1628900123")
    # Thread 7 was born between the readings, thread 3 ended.
    before = {1: 2_000_000_000, 2: 500_000_000, 3: 100_000_000}
    after = {1: 2_250_000_000, 2: 500_000_000, 7: 40_000_000}
    assert wait_seconds(before, after) == pytest.approx(0.29)
    pairs = [Pair(replace(_arm(100, 10.0, 20.0), runner_wait_seconds=wait),
                  replace(_arm(100, 10.0, 20.0), runner_wait_seconds=wait + extra), False)
             for wait, extra in ((1.6, 0.4), (1.2, 0.9), (1.8, 0.3))]
    assert summarize_pairs(pairs)["runner_wait_ms"] == pytest.approx(
        {"standalone": 1600.0, "service": 2100.0})


def test_shard_finish_spread_runs_from_the_first_shards_last_job_to_the_last_shards() -> None:
    # Shard 0's last job ends at 14.0, shard 1's at 11.5: the spread is 2.5 s, whatever order
    # the jobs come in.
    jobs = [(0, 10.0), (1, 11.5), (0, 14.0), (1, 9.0), (0, 12.0)]
    assert shard_finish_spread_seconds(jobs) == pytest.approx(2.5)
    assert shard_finish_spread_seconds(reversed(jobs)) == pytest.approx(2.5)
    assert shard_finish_spread_seconds([(0, 3.0), (0, 7.0)]) == 0.0
    pairs = [Pair(replace(_arm(100, 10.0, 20.0), shard_finish_spread_seconds=spread),
                  replace(_arm(100, 10.0, 20.0), shard_finish_spread_seconds=spread / 2), False)
             for spread in (0.4, 1.2, 0.8)]
    assert summarize_pairs(pairs)["shard_finish_spread_ms"] == pytest.approx(
        {"standalone": 800.0, "service": 400.0})
    # A pair that could not read it leaves that arm's median out rather than guessing.
    pairs[0] = Pair(pairs[0].standalone, replace(pairs[0].service,
                                                 shard_finish_spread_seconds=None), False)
    assert summarize_pairs(pairs)["shard_finish_spread_ms"]["service"] is None


def test_mean_shard_time_runs_from_the_first_admission_to_each_shards_last_job() -> None:
    # Admitted at 2.0; shard 0's last job ends at 14.0, shard 1's at 11.5: 12 s and 9.5 s.
    jobs = [(0, 10.0), (1, 11.5), (0, 14.0), (1, 9.0), (0, 12.0)]
    assert mean_shard_seconds(jobs, admitted=2.0) == pytest.approx(10.75)
    assert mean_shard_seconds(reversed(jobs), admitted=2.0) == pytest.approx(10.75)
    assert mean_shard_seconds([(0, 3.0), (0, 7.0)], admitted=1.0) == pytest.approx(6.0)


def test_shard_ratio_is_the_standalone_mean_shard_time_over_the_services() -> None:
    # The service's shards run 2 % longer in every pair, whatever the bursts' spreads.
    pairs = [Pair(replace(_arm(100, 10.0, 20.0), mean_shard_seconds=seconds),
                  replace(_arm(100, 10.3, 20.0), mean_shard_seconds=seconds * 1.02), False)
             for seconds in (9.0, 9.5, 8.7)]
    assert [pair.shard_ratio for pair in pairs] == pytest.approx([1 / 1.02] * 3)
    assert summarize_pairs(pairs)["shard_ratio"] == pytest.approx(1 / 1.02)
    # A pair whose arm could not read it leaves the median out rather than guessing.
    pairs[1] = Pair(replace(pairs[1].standalone, mean_shard_seconds=None), pairs[1].service,
                    True)
    assert pairs[1].shard_ratio is None
    assert summarize_pairs(pairs)["shard_ratio"] is None


def test_ideal_hit_rate_counts_full_blocks_of_repeated_documents() -> None:
    jobs = [("a", 300, 310), ("b", 100, 110), ("a", 300, 305), ("a", 300, 305)]
    assert ideal_hit_rate(jobs, block_size=128) == pytest.approx(2 * 256 / 1030)


def test_named_workloads_have_the_documented_shape_and_fresh_documents_per_trial() -> None:
    reuse = bench_jobs(BenchOptions(workload="reuse", words=30), trial=1)
    assert len(reuse) == 256 and len({job["document"] for job in reuse}) == 64
    # Interleaved: the first 64 jobs are 64 different documents.
    assert len({job["document"] for job in reuse[:64]}) == 64
    assert all(job["max_tokens"] == 16 and job["ignore_eos"] for job in reuse)
    unique = bench_jobs(BenchOptions(workload="unique", words=30), trial=1)
    assert len(unique) == 64 and len({job["document"] for job in unique}) == 64
    again = bench_jobs(BenchOptions(workload="unique", words=30), trial=2)
    assert {job["document"] for job in again}.isdisjoint(job["document"] for job in unique)


def test_jsonl_workloads_keep_their_own_sampling_and_refuse_incomplete_lines(
        tmp_path: Path) -> None:
    path = tmp_path / "jobs.jsonl"
    path.write_text(json.dumps({"document": "d", "question": "q", "max_tokens": 3}) + "\n\n")
    (job,) = bench_jobs(BenchOptions(workload=str(path)), trial=1)
    assert job["max_tokens"] == 3 and job["ignore_eos"] is True
    path.write_text(json.dumps({"document": "d"}) + "\n")
    with pytest.raises(InvalidJob, match=r"jobs\.jsonl:1"):
        read_jsonl_jobs(path)


def test_readings_are_interpolated_at_a_moment_between_samples() -> None:
    samples = [(10.0, 1.0), (12.0, 5.0), (11.0, 2.0)]
    assert reading_at(samples, 11.5) == pytest.approx(3.5)
    assert reading_at(samples, 11.0) == pytest.approx(2.0)
    assert reading_at(samples, 9.0) == 1.0
    assert reading_at(samples, 13.0) == 5.0
    assert reading_at([(3.0, 7.0), (3.0, 7.0)], 3.0) == 7.0
    with pytest.raises(ValueError):
        reading_at([], 1.0)


def test_gc_totals_keep_each_workers_longest_pauses_and_sum_its_collections() -> None:
    def reading(pause: float, cpu: float, walls: list[float], counts: list[int],
                idle_pause: float, idle_count: int) -> dict[str, Any]:
        return {"gc_pause_max_ms": pause, "gc_cpu_max_ms": cpu,
                "gc_pause_max_ms_by_generation": walls, "gc_collections_by_generation": counts,
                "gc_idle_pause_max_ms": idle_pause, "gc_idle_collections": idle_count}

    totals = GcTotals()
    totals.add([{"shard0": reading(5.0, 2.0, [5.0, 1.0, 0.0], [10, 1, 0], 0.5, 4)},
                {"shard1": reading(1.0, 1.0, [1.0, 0.0, 0.0], [3, 0, 0], 2.0, 1)}])
    totals.add([{"shard0": reading(3.0, 2.5, [2.0, 3.0, 0.0], [12, 1, 1], 1.5, 3)}])
    assert totals.pause_max_ms == {"shard0": 5.0, "shard1": 1.0}
    assert totals.cpu_max_ms == {"shard0": 2.5, "shard1": 1.0}
    assert totals.pause_max_ms_by_generation["shard0"] == [5.0, 3.0, 0.0]
    assert totals.collections_by_generation == {"shard0": [22, 2, 1], "shard1": [3, 0, 0]}
    assert totals.idle_pause_max_ms == {"shard0": 1.5, "shard1": 2.0}
    assert totals.idle_collections == {"shard0": 7, "shard1": 1}


def _report_of(totals: Totals, standalone_twice: bool = False,
               compare_admission: bool = False,
               all_at_once_totals: Totals | None = None) -> dict[str, Any]:
    arm = ArmResult(jobs=4, seconds=2.0, output_tokens=64,
                    cpu_by_role={ENGINE_ROLE: 3.0, "worker": 0.2})
    slower = replace(arm, seconds=2.5)
    pairs = [Pair(arm, slower, service_first=False), Pair(slower, arm, service_first=True)]
    settings = SimpleNamespace(shards=1, routing="cache_aware", admission_chunk=32,
                               admission_pause_ms=15.0)
    options = BenchOptions(standalone_twice=standalone_twice, compare_admission=compare_admission)
    return run_report(settings, options, totals, all_at_once_totals or Totals(),  # type: ignore[arg-type]
                      pairs, "all", {"all": 2.0}, ideal_rates=[0.5, 0.7], bytes_raw=[1000, 3000])


def test_an_a_a_report_gives_the_ratios_and_leaves_out_what_only_the_service_has() -> None:
    report = _report_of(Totals(), standalone_twice=True)
    assert report["arms"] == "standalone/standalone"
    assert report["min_ratio"] == pytest.approx(0.8)
    assert report["max_ratio"] == pytest.approx(1.25)
    assert report["ideal_hit_rate"] == pytest.approx(0.6)
    assert report["bytes_raw"] == 2000
    assert [pair["order"] for pair in report["pairs"]] == ["standalone-first", "service-first"]
    for service_only in ("hit_rate", "bytes_enqueued", "gc_pause_max_ms",
                         "queue_to_admission_ms", "shard_jobs"):
        assert service_only not in report
    assert report["parity_checks"]["gc_pause_max_ms"] is None
    assert report["parity_checks"]["bytes_enqueued"] is None


def test_a_service_report_carries_its_queue_and_routing_figures() -> None:
    totals = Totals(prompt_tokens=1000, cached_tokens=700, shard_jobs=[6, 2],
                    admission_ms=[10.0, 20.0, 30.0], bytes_enqueued=[100, 300])
    report = _report_of(totals, standalone_twice=False)
    assert report["arms"] == "service/standalone"
    assert report["hit_rate"] == pytest.approx(0.7)
    assert report["load_max_over_mean"] == pytest.approx(1.5)
    assert report["bytes_enqueued"] == 200
    assert report["queue_to_admission_ms"]["p50"] == pytest.approx(20.0)
    assert report["engine_finish_to_recorded_ms"] is None
    assert report["standalone_admission"] == "all"
    assert report["admission_chunk"] == 32
    assert "all_at_once" not in report
    # Pairs at 0.8 and 1.25, the same CPU in both arms, 10x smaller in Redis, no pauses read.
    assert report["parity_checks"] == {"median_ratio": True, "min_ratio": False,
                                       "cpu_ratio": True, "bytes_enqueued": False,
                                       "gc_pause_max_ms": None}


def test_an_admission_a_b_report_gives_both_services_figures_and_no_standalone_ones() -> None:
    paced = Totals(prompt_tokens=1000, cached_tokens=700, shard_jobs=[8], failed=0,
                   admission_ms=[10.0], bytes_enqueued=[100])
    at_once = Totals(prompt_tokens=1000, cached_tokens=600, shard_jobs=[8], failed=1,
                     admission_ms=[30.0], bytes_enqueued=[120])
    report = _report_of(paced, compare_admission=True, all_at_once_totals=at_once)
    assert report["arms"] == "service paced/service all at once"
    assert report["min_ratio"] == pytest.approx(0.8)
    assert report["hit_rate"] == pytest.approx(0.7)
    assert report["all_at_once"]["hit_rate"] == pytest.approx(0.6)
    assert report["all_at_once"]["service_jobs_not_succeeded"] == 1
    assert report["all_at_once"]["queue_to_admission_ms"]["p50"] == pytest.approx(30.0)
    for standalone_only in ("standalone_admission", "standalone_hit_rate",
                            "standalone_gc_pause_max_ms", "admission_calibration_rps"):
        assert standalone_only not in report


def test_the_plot_of_a_run_names_what_stood_in_each_slot(tmp_path: Path) -> None:
    def totals() -> Totals:
        return Totals(shard_jobs=[8], admission_ms=[1.0], bytes_enqueued=[1])

    report = _report_of(totals(), compare_admission=True, all_at_once_totals=totals())
    with mock.patch("matplotlib.figure.Figure.savefig", autospec=True) as savefig:
        plot_pairs(report, tmp_path / "pairs.png")
    ratios, cpu = savefig.call_args.args[0].axes
    assert ratios.get_legend().get_texts()[0].get_text() == (
        "service paced / service all at once")
    assert [text.get_text() for text in cpu.get_legend().get_texts()] == [
        "service all at once", "service paced"]


@pytest.mark.parametrize(("options", "chunk", "refusal"), [
    (BenchOptions(compare_admission=True, standalone_twice=True), 32, "--standalone-twice"),
    (BenchOptions(compare_admission=True, standalone_on_workers=False), 32,
     "--own-standalone-engines"),
    (BenchOptions(compare_admission=True), 0, "set it to the chunk"),
    (BenchOptions(compare_admission=True, standalone_admission="all"), 32,
     "--standalone-admission"),
    (BenchOptions(standalone_admission="paced"), 0, "must be one of"),
])
def test_the_bench_refuses_options_that_would_not_measure_what_they_name(
        options: BenchOptions, chunk: int, refusal: str) -> None:
    with pytest.raises(ConfigurationError, match=refusal):
        check_options(Settings(admission_chunk=chunk), options)


def test_the_usual_runs_pass_the_option_check_and_a_contradiction_does_not() -> None:
    refused = []
    for options in (BenchOptions(), BenchOptions(standalone_twice=True),
                    BenchOptions(compare_admission=True),
                    BenchOptions(standalone_admission="all"),
                    BenchOptions(standalone_admission="staggered")):
        try:
            check_options(Settings(admission_chunk=0 if not options.compare_admission else 8),
                          options)
        except ConfigurationError as error:
            refused.append((options, error))
    assert refused == []
    # The same comparison with nothing to compare against: refused, naming the setting.
    with pytest.raises(ConfigurationError, match="JOBSVC_ADMISSION_CHUNK"):
        check_options(Settings(admission_chunk=0), BenchOptions(compare_admission=True))


def test_engine_steps_are_summarized_per_arm_and_left_out_where_an_arm_lacks_them() -> None:
    def arm(steps: float | None) -> ArmResult:
        return ArmResult(jobs=8, seconds=2.0, output_tokens=8, cpu_by_role={"worker": 1.0},
                         engine_steps=steps,
                         engine_step_tokens=None if steps is None else steps * 100)

    pairs = [Pair(arm(74), arm(73), service_first=False), Pair(arm(74), arm(75), True),
             Pair(arm(70), arm(74), False)]
    summary = summarize_pairs(pairs)
    assert summary["engine_steps"] == {"standalone": 74, "service": 74}
    assert summary["engine_step_tokens"] == {"standalone": 7400, "service": 7400}
    own_engines = [Pair(arm(None), arm(74), False), Pair(arm(None), arm(73), True)]
    assert summarize_pairs(own_engines)["engine_steps"] == {"standalone": None,
                                                            "service": 73.5}


def test_bench_devices_give_each_shard_its_device_or_the_cpu_split() -> None:
    gpus = {"JOBSVC_BENCH_DEVICES": "0 1 2"}
    assert shard_devices(3, gpus) == ["0", "1", "2"]
    assert shard_devices(2, {}) == ["0", "1"]
    assert shard_devices(1, {}) == ["0-1"]
    with pytest.raises(ConfigurationError, match="JOBSVC_BENCH_DEVICES"):
        shard_devices(2, gpus)
