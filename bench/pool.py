"""Pool the pairs of several `jobsvc bench` runs, and say which parity bars each run cleared.

One run of ten pairs places its median within a few percent on a noisy host; the pairs of
several runs of the same row (workload, shard count and arms) pooled place it closer. Prints
JSON: each run's figures and `parity_checks` (worked out again for reports written before the
bench added them), each row's pooled pairs, and all pairs pooled per kind of run, each with
how often a run of `--pairs-per-run` pairs drawn from them would clear the median and min
bars (drawn from A/A pairs: the most any service could expect of the host).

    python -m jobsvc.bench.pool bench-out/*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobsvc.bench.measure import chance_to_clear, parity_checks, ratio_summary

# What pooling reads from a report; other JSON with pairs (the interference script's) lacks it.
REPORT_KEYS = ("workload", "shards", "median_ratio", "min_ratio", "cpu_ratio", "pairs")


def row_of(report: dict[str, Any]) -> tuple[str, int, str]:
    """The row a run belongs to: its workload (a JSONL file by its name), shards and arms."""
    workload = Path(report["workload"]).name.removesuffix(".jsonl")
    return workload, report["shards"], report.get("arms", "service/standalone")


# The fewest pairs a parity run may have: the run most likely to keep every pair above the
# min bar.
PAIRS_PER_RUN = 7


def pooled_summary(ratios: list[float], pairs_per_run: int) -> dict[str, Any]:
    """Where pooled pairs lie, and how often runs drawn from them would clear the bars."""
    return {"pairs": len(ratios), **ratio_summary(ratios),
            "chance_a_run_clears": chance_to_clear(ratios, pairs_per_run)}


def pool(reports: dict[str, dict[str, Any]],
         pairs_per_run: int = PAIRS_PER_RUN) -> dict[str, Any]:
    """Each run's figures and checks, and the ratios pooled by row and by kind of run."""
    runs = []
    rows: dict[tuple[str, int, str], list[float]] = {}
    kinds: dict[str, list[float]] = {}
    for name, report in reports.items():
        workload, shards, arms = row_of(report)
        ratios = [pair["ratio"] for pair in report["pairs"]]
        rows.setdefault((workload, shards, arms), []).extend(ratios)
        kinds.setdefault(arms, []).extend(ratios)
        runs.append({"file": name, "workload": workload, "shards": shards, "arms": arms,
                     "pairs": len(ratios), "median_ratio": report["median_ratio"],
                     "min_ratio": report["min_ratio"], "cpu_ratio": report["cpu_ratio"],
                     "parity_checks": parity_checks(report)})
    return {
        "runs": runs,
        "pairs_per_run": pairs_per_run,
        "rows": [{"workload": workload, "shards": shards, "arms": arms,
                  **pooled_summary(ratios, pairs_per_run)}
                 for (workload, shards, arms), ratios in sorted(rows.items())],
        "pooled": [{"arms": arms, **pooled_summary(ratios, pairs_per_run)}
                   for arms, ratios in sorted(kinds.items())],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jobsvc.bench.pool`: pool the reports' pairs per row and print them, with each
    run's parity checks, as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JSON written by jobsvc bench")
    parser.add_argument("--pairs-per-run", type=int, default=PAIRS_PER_RUN,
                        help="pairs in the runs whose chance to clear the bars is drawn "
                             f"(default {PAIRS_PER_RUN}, the fewest a parity run may have)")
    args = parser.parse_args(argv)
    if args.pairs_per_run < 1:
        parser.error("--pairs-per-run must be at least 1")
    reports = {}
    for path in args.reports:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            parser.error(f"cannot read {path}: {error}")
        if (not isinstance(report, dict) or any(key not in report for key in REPORT_KEYS)
                or not report["pairs"]):
            parser.error(f"{path} is not a jobsvc bench report with pairs (it needs "
                         f"{', '.join(REPORT_KEYS)})")
        reports[str(path)] = report
    json.dump(pool(reports, args.pairs_per_run), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
