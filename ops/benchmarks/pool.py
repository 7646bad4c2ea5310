"""Pool the pairs of several `jobsvc bench` runs, and say which parity bars each run cleared.

One run of ten pairs places its median within a few percent on a noisy host; the pairs of
several runs of the same row (workload, shard count and arms) pooled place it closer. Prints
JSON: each run's figures and `parity_checks` (worked out again for reports written before the
bench added them), each row's pooled pairs, and all pairs pooled per kind of run.

    python ops/benchmarks/pool.py ops/benchmarks/parity-xeon-amx-quiet/*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jobsvc.measure import parity_checks, ratio_summary

# What pooling reads from a report; other JSON with pairs (the interference script's) lacks it.
REPORT_KEYS = ("workload", "shards", "median_ratio", "min_ratio", "cpu_ratio", "pairs")


def row_of(report: dict[str, Any]) -> tuple[str, int, str]:
    """The row a run belongs to: its workload (a JSONL file by its name), shards and arms."""
    workload = Path(report["workload"]).name.removesuffix(".jsonl")
    return workload, report["shards"], report.get("arms", "service/standalone")


def pool(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
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
        "rows": [{"workload": workload, "shards": shards, "arms": arms, "pairs": len(ratios),
                  **ratio_summary(ratios)}
                 for (workload, shards, arms), ratios in sorted(rows.items())],
        "pooled": [{"arms": arms, "pairs": len(ratios), **ratio_summary(ratios)}
                   for arms, ratios in sorted(kinds.items())],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JSON written by jobsvc bench")
    args = parser.parse_args(argv)
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
    json.dump(pool(reports), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
