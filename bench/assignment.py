"""What a routing setting's document-to-shard assignment is worth to the engines alone:
standalone bursts on the service workers' own engines (no queue, no database), one burst per
value of one routing setting (`JOBSVC_ROUTING_DECODE_COST`, `JOBSVC_ROUTING_LOAD_WEIGHT` or
`JOBSVC_ROUTING_LOAD_SLACK`) in each round, in mirrored order round by round so that a drift of
the host's speed favours no value. Prints JSON: each value's jobs and planned work per shard,
every burst's rate and shard finish spread, and each value's median rate and median per-round
ratio to the first value's.

    python -m jobsvc.bench.assignment --workload ops/workloads/uneven.jsonl --shards 2 \
        --setting decode_cost --values 0,8 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from jobsvc.bench.options import BenchOptions, bench_jobs
from jobsvc.bench.run import Bench, trial_shape
from jobsvc.prompts import PromptBuilder
from jobsvc.routing.ledger import LoadLedger
from jobsvc.routing.router import make_router
from jobsvc.settings import Settings

# The routing settings a run can race, by the name `--setting` takes.
SETTINGS = {"decode_cost": "routing_decode_cost", "load_weight": "routing_load_weight",
            "load_slack": "routing_load_slack"}


def planned_work(jobs: list[dict[str, Any]], shard_of_job: list[int],
                 prompt_lengths: tuple[dict[str, int], list[int]], shards: int
                 ) -> list[dict[str, int]]:
    """Per shard, what an assignment asks of it: jobs, prompt tokens to prefill (each
    document once per shard, as a cache large enough to keep it would), output tokens.
    `prompt_lengths`: each document's tokens by text, and each job's question tokens."""
    document_tokens, question_tokens = prompt_lengths
    work = [{"jobs": 0, "prefill_tokens": 0, "output_tokens": 0} for _ in range(shards)]
    seen: set[tuple[int, str]] = set()
    for job, question, shard in zip(jobs, question_tokens, shard_of_job, strict=True):
        if (shard, job["document"]) not in seen:
            seen.add((shard, job["document"]))
            work[shard]["prefill_tokens"] += document_tokens[job["document"]]
        work[shard]["jobs"] += 1
        work[shard]["prefill_tokens"] += question
        work[shard]["output_tokens"] += job["max_tokens"]
    return work


def prompt_lengths(jobs: list[dict[str, Any]], prompts: PromptBuilder
                   ) -> tuple[dict[str, int], list[int]]:
    """Each distinct document's length in tokens, and each job's question's."""
    distinct = list(dict.fromkeys(job["document"] for job in jobs))
    return (dict(zip(distinct, map(len, prompts.documents(distinct)), strict=True)),
            [len(tokens) for tokens in prompts.questions([job["question"] for job in jobs])])


def run(workload: str, shards: int, setting: str, values: list[float], rounds: int,
        mode: str) -> dict[str, Any]:
    """Plan the workload's assignment under each value of `setting`, then race the assignments in
    `rounds` of standalone bursts on the same engines, so only the assignment differs."""
    settings = replace(Settings.from_env(), shards=shards)
    options = BenchOptions(workload=workload, shards=shards)
    bench = Bench(settings, options, print)
    jobs = bench_jobs(options, trial=0)
    shapes = {value: trial_shape(jobs, bench.prompts, make_router(
                  bench.redis, LoadLedger(bench.redis),
                  replace(settings, **{SETTINGS[setting]: value})))
              for value in values}
    bursts: dict[float, list[dict[str, float]]] = {value: [] for value in values}
    if rounds:
        bench.start_engines()
        try:
            # One unrecorded burst per assignment first: none meets the engines cold.
            for value in values:
                bench.run_standalone(jobs, shapes[value], mode, record=False)
            for round_index in range(rounds):
                order = values if round_index % 2 == 0 else values[::-1]
                for value in order:
                    result = bench.run_standalone(jobs, shapes[value], mode, record=False)
                    bursts[value].append({
                        "requests_per_second": result.requests_per_second,
                        "shard_finish_spread_s": result.shard_finish_spread_seconds or 0.0})
        finally:
            bench.stop_engines()
    first = values[0]
    lengths = prompt_lengths(jobs, bench.prompts)
    return {
        "workload": workload, "shards": shards, "mode": mode, "rounds": rounds,
        "setting": SETTINGS[setting],
        "planned_work": {str(value): planned_work(jobs, shapes[value].shard_of_job, lengths,
                                                  shards) for value in values},
        "bursts": {str(value): runs for value, runs in bursts.items()},
        "median_requests_per_second": {
            str(value): statistics.median(run["requests_per_second"] for run in runs)
            for value, runs in bursts.items() if runs},
        f"median_ratio_to_{first:g}": {
            str(value): statistics.median(
                mine["requests_per_second"] / base["requests_per_second"]
                for mine, base in zip(runs, bursts[first], strict=True))
            for value, runs in bursts.items() if runs},
    }


def main() -> None:
    """`python -m jobsvc.bench.assignment`: the result as JSON on stdout (and in `--json`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="ops/workloads/uneven.jsonl")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="decode_cost",
                        help="the routing setting to race (JOBSVC_ROUTING_<SETTING>)")
    parser.add_argument("--values", default="0,8", help="comma-separated values of it")
    parser.add_argument("--rounds", type=int, default=10,
                        help="rounds of bursts; 0 prints the assignments alone")
    parser.add_argument("--mode", default="staggered", help="standalone admission style")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    result = run(args.workload, args.shards, args.setting,
                 [float(value) for value in args.values.split(",")], args.rounds, args.mode)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
