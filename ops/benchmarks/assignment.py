"""What a routing setting's document-to-shard assignment is worth to the engines alone:
standalone bursts on the service workers' own engines (no queue, no database), one burst per
value of `JOBSVC_ROUTING_DECODE_COST` in each round, in mirrored order round by round so that a
drift of the host's speed favours no value. Prints JSON: each value's jobs per shard, every
burst's rate and shard finish spread, and each value's median rate and median per-round ratio
to the first value's.

    python ops/benchmarks/assignment.py --workload ops/workloads/uneven.jsonl --shards 2 \
        --decode-costs 0,8 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from jobsvc.affinity import ShardState
from jobsvc.bench import BenchOptions, _Bench, _shape, bench_jobs
from jobsvc.routers import make_router
from jobsvc.settings import Settings


def run(workload: str, shards: int, decode_costs: list[float], rounds: int,
        mode: str) -> dict[str, Any]:
    settings = replace(Settings.from_env(), shards=shards)
    options = BenchOptions(workload=workload, shards=shards)
    bench = _Bench(settings, options, print)
    bench.start_engines()
    try:
        jobs = bench_jobs(options, trial=0)
        shapes = {cost: _shape(jobs, bench.prompts, make_router(
                      bench.redis, ShardState(bench.redis, shards),
                      replace(settings, routing_decode_cost=cost)))
                  for cost in decode_costs}
        # One unrecorded burst per assignment first: none meets the engines cold.
        for cost in decode_costs:
            bench.run_standalone(jobs, shapes[cost], mode, record=False)
        bursts: dict[float, list[dict[str, float]]] = {cost: [] for cost in decode_costs}
        for round_index in range(rounds):
            order = decode_costs if round_index % 2 == 0 else decode_costs[::-1]
            for cost in order:
                result = bench.run_standalone(jobs, shapes[cost], mode, record=False)
                bursts[cost].append({
                    "requests_per_second": result.requests_per_second,
                    "shard_finish_spread_s": result.shard_finish_spread_seconds or 0.0})
    finally:
        bench.stop_engines()
    first = decode_costs[0]
    return {
        "workload": workload, "shards": shards, "mode": mode, "rounds": rounds,
        "jobs_per_shard": {str(cost): [shapes[cost].shard_of_job.count(shard)
                                       for shard in range(shards)] for cost in decode_costs},
        "bursts": {str(cost): runs for cost, runs in bursts.items()},
        "median_requests_per_second": {
            str(cost): statistics.median(run["requests_per_second"] for run in runs)
            for cost, runs in bursts.items()},
        f"median_ratio_to_{first:g}": {
            str(cost): statistics.median(
                mine["requests_per_second"] / base["requests_per_second"]
                for mine, base in zip(runs, bursts[first], strict=True))
            for cost, runs in bursts.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="ops/workloads/uneven.jsonl")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--decode-costs", default="0,8",
                        help="comma-separated JOBSVC_ROUTING_DECODE_COST values")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--mode", default="staggered", help="standalone admission style")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = run(args.workload, args.shards,
                 [float(cost) for cost in args.decode_costs.split(",")], args.rounds, args.mode)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
