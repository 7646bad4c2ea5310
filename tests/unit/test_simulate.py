"""The workload simulator: generated and JSONL workloads, cache hits, balance, the CLI options."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import pytest

from jobsvc.errors import JobsvcError
from jobsvc.prompts import PromptBuilder
from jobsvc.routing.job_cost import DEFAULT_CAPACITY_BLOCKS, DEFAULT_DECODE_COST
from jobsvc.routing.policies import DEFAULT_EPSILON, DEFAULT_WEIGHT, POLICY_NAMES
from jobsvc.settings import TINY_MODEL, Settings
from jobsvc.simulate import (
    WORKLOAD_NAMES,
    Job,
    Workload,
    WorkloadError,
    WorkloadShape,
    add_arguments,
    generate,
    load_jsonl,
    run_from_args,
    run_simulation,
)

pytestmark = pytest.mark.unit

SMALL = WorkloadShape(jobs=4000, documents=256)


def simulate(name: str, policy: str, shape: WorkloadShape = SMALL, shards: int = 8,
             **options: float) -> dict:
    return run_simulation(generate(name, shape), shards=shards, policy=policy,
                          cache_blocks=1024, **options)


def listed(jobs: list[Job], block_ids: int, block_size: int = 16) -> Workload:
    return Workload("listed", block_size, block_ids, jobs)


def test_on_a_hot_document_cache_aware_stays_balanced_near_the_ideal_hit_rate() -> None:
    aware = simulate("hot", "cache_aware")
    affinity = simulate("hot", "affinity")
    assert aware["load_max_over_mean"] <= 1.25
    assert aware["hit_rate"] >= 0.9 * aware["ideal_hit_rate"]
    # The plain map keeps every hot job on one shard: half the jobs on one of eight shards,
    # more than twice the mean work even though most of them find the document cached.
    assert affinity["load_max_over_mean"] > 2
    assert max(affinity["shard_jobs"]) > SMALL.jobs / 2
    assert aware["makespan"] < affinity["makespan"] / 2


def test_on_shared_preambles_cache_aware_hits_more_than_the_affinity_map() -> None:
    aware = simulate("shared-preamble", "cache_aware")
    affinity = simulate("shared-preamble", "affinity")
    assert aware["ideal_hit_rate"] == affinity["ideal_hit_rate"]
    assert aware["hit_rate"] > affinity["hit_rate"] + 0.01
    assert aware["hit_rate"] <= aware["ideal_hit_rate"]


def test_report_accounts_for_every_job_and_all_the_work() -> None:
    report = simulate("zipf", "round_robin", WorkloadShape(jobs=801, documents=50))
    assert report["jobs"] == 801 == sum(report["shard_jobs"])
    assert len(report["shard_work"]) == 8
    # Round robin hands out jobs evenly whatever their documents.
    assert max(report["shard_jobs"]) - min(report["shard_jobs"]) == 1
    assert report["load_max_over_mean"] == pytest.approx(
        max(report["shard_work"]) * 8 / sum(report["shard_work"]))
    # All jobs arrive at once, so the busiest shard finishes last.
    assert report["makespan"] == max(report["shard_work"])
    assert 0 < report["hit_rate"] < report["ideal_hit_rate"] < 1


def test_ideal_hit_rate_counts_every_prefix_seen_before() -> None:
    # Four documents of two 16-token blocks, three rounds, 16 question tokens: each prompt is
    # 48 tokens, of which 32 are cached once the document has been seen.
    shape = WorkloadShape(jobs=12, documents=4, blocks_per_document=2, block_size=16)
    report = run_simulation(generate("reuse", shape), shards=1, policy="affinity",
                            cache_blocks=8)
    assert report["ideal_hit_rate"] == pytest.approx(8 * 32 / (12 * 48))
    assert report["hit_rate"] == report["ideal_hit_rate"]
    unique = run_simulation(generate("unique", shape), shards=1, policy="affinity",
                            cache_blocks=8)
    assert unique["hit_rate"] == unique["ideal_hit_rate"] == 0


def test_lru_cache_capacity_decides_the_hits() -> None:
    cycle: list[Job] = [([0, 1], 40, 4), ([2, 3], 40, 4), ([4, 5], 40, 4)] * 3
    fits = run_simulation(listed(cycle, 6), shards=1, policy="round_robin", cache_blocks=6)
    thrashes = run_simulation(listed(cycle, 6), shards=1, policy="round_robin", cache_blocks=4)
    assert fits["hit_rate"] == fits["ideal_hit_rate"] == pytest.approx(6 * 32 / (9 * 40))
    # Three documents cycling through room for two: LRU always evicts the next one needed.
    assert thrashes["hit_rate"] == 0


def test_a_shared_leading_part_is_a_partial_hit() -> None:
    jobs: list[Job] = [([0, 1, 2], 50, 1), ([0, 1, 3], 50, 1), ([4, 1, 2], 50, 1)]
    report = run_simulation(listed(jobs, 5), shards=1, policy="round_robin", cache_blocks=10,
                            prefill_cost=1, decode_cost=10)
    assert report["hit_rate"] == pytest.approx(2 * 16 / 150)
    assert report["shard_work"] == [50 + 10 + 18 + 10 + 50 + 10]


def test_work_decays_between_arrivals_so_a_slow_stream_never_needs_to_move_a_document() -> None:
    burst = simulate("hot", "cache_aware")
    # One job per 10,000 work units: every job has finished before the next one arrives.
    trickle = simulate("hot", "cache_aware", arrival_rate=1e-4)
    assert trickle["hit_rate"] == trickle["ideal_hit_rate"] > burst["hit_rate"]
    assert trickle["makespan"] > (SMALL.jobs - 1) * 1e4


def test_generators_are_seeded_and_shaped_as_named() -> None:
    def documents(name: str, seed: int = 0) -> list[tuple[int, ...]]:
        shape = WorkloadShape(jobs=2000, documents=64, seed=seed)
        return [tuple(chain) for chain, _, _ in generate(name, shape).jobs]

    for name in WORKLOAD_NAMES:
        assert documents(name) == documents(name)
    assert documents("zipf") != documents("zipf", seed=1)
    assert len(set(documents("unique"))) == 2000
    hot = Counter(documents("hot")).most_common(2)
    assert 900 < hot[0][1] < 1100 and hot[1][1] < 100
    zipf = Counter(documents("zipf")).most_common()
    assert zipf[0][1] > 5 * zipf[len(zipf) // 2][1]
    reuse = Counter(documents("reuse"))
    assert len(reuse) == 64 and set(reuse.values()) <= {31, 32}
    chains = sorted(set(documents("shared-preamble")))
    shape = WorkloadShape()
    preambles = Counter(chain[:shape.preamble_blocks] for chain in chains)
    assert set(preambles.values()) == {shape.group_size}
    assert len({chain[shape.preamble_blocks:] for chain in chains}) == 64


def test_bad_workloads_are_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="unknown workload"):
        generate("bursty", SMALL)
    with pytest.raises(WorkloadError, match="documents >= 2"):
        generate("hot", WorkloadShape(documents=1))
    with pytest.raises(WorkloadError, match="preamble"):
        generate("shared-preamble", WorkloadShape(preamble_blocks=12))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(WorkloadError, match="no jobs"):
        run_simulation(load_jsonl(empty, block_size=16, output_tokens=4), shards=2,
                       policy="affinity", cache_blocks=8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"document": "text"}\n')
    with pytest.raises(JobsvcError, match=r"bad.jsonl:1: .*question"):
        load_jsonl(bad, block_size=16, output_tokens=4)


def test_jsonl_jobs_are_tokenized_and_hashed_like_the_client(tmp_path: Path) -> None:
    documents = ["Plora venst thrai. " * 40, "Kel dramou sto. " * 30]
    lines = [{"document": text, "question": f"What about {word}?"}
             for word in ("venst", "kel") for text in documents]
    lines[0]["max_tokens"] = 9
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n")
    workload = load_jsonl(path, block_size=16, output_tokens=4)
    jobs = list(workload.jobs)
    prompts = PromptBuilder(str(TINY_MODEL))
    tokens = prompts.documents(documents)
    questions = prompts.questions(["What about venst?"])
    assert jobs[0][1:] == (len(tokens[0]) + len(questions[0]), 9)
    assert [len(chain) for chain, _, _ in jobs] == [len(t) // 16 for t in tokens] * 2
    assert jobs[0][0] == jobs[2][0] != jobs[1][0]
    report = run_simulation(load_jsonl(path, block_size=16, output_tokens=4), shards=2,
                            policy="cache_aware", cache_blocks=64)
    assert report["workload"] == "jobs.jsonl"
    assert report["hit_rate"] == report["ideal_hit_rate"] > 0.4


def test_cli_options_run_a_simulation_and_write_the_report(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "report.json"
    for policy in POLICY_NAMES:
        args = parser.parse_args(["--workload", "hot", "--shards", "4", "--policy", policy,
                                  "--jobs", "300", "--cache-blocks", "256", "--json", str(out)])
        report = run_from_args(Settings.from_env({}), args)
        written = json.loads(out.read_text())
        assert written == report
        assert written["policy"] == policy and written["shards"] == 4
        assert written["block_size"] == Settings().block_size
        assert {"hit_rate", "ideal_hit_rate", "shard_jobs", "shard_work", "load_max_over_mean",
                "makespan", "seconds", "workload", "jobs"} <= set(written)


def test_the_simulator_routes_with_the_services_settings_unless_told_otherwise() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workload", "reuse", "--jobs", "50"])
    report = run_from_args(Settings.from_env({}), args)
    assert (report["policy"], report["decode_cost"], report["weight"], report["epsilon"]) == (
        "cache_aware", DEFAULT_DECODE_COST, DEFAULT_WEIGHT, DEFAULT_EPSILON)
    assert report["cache_blocks"] == DEFAULT_CAPACITY_BLOCKS
    tuned = Settings.from_env({"JOBSVC_ROUTING": "affinity", "JOBSVC_ROUTING_DECODE_COST": "3",
                               "JOBSVC_ROUTING_LOAD_WEIGHT": "0.5"})
    report = run_from_args(tuned, args)
    assert (report["policy"], report["decode_cost"], report["weight"]) == ("affinity", 3, 0.5)
    told = parser.parse_args(["--workload", "reuse", "--jobs", "50", "--decode-cost", "0",
                              "--policy", "round_robin"])
    report = run_from_args(tuned, told)
    assert (report["policy"], report["decode_cost"]) == ("round_robin", 0)
