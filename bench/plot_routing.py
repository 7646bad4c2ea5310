"""Summarise routing benchmark runs (`jobsvc bench --policy P --json DIR/<workload>-<P>.json`)
as one table on standard output (JSON lines) and one PNG: measured prefix-cache hit rate
against the ideal, and the service's median throughput, per workload and policy.

    python -m jobsvc.bench.plot_routing bench-out/routing
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

POLICIES = ("round_robin", "affinity", "cache_aware")


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """One run's row of the table: hit rate against the ideal, throughputs and balance."""
    pairs = run["pairs"]
    return {
        "workload": Path(run["workload"]).stem,
        "policy": run["policy"],
        "shards": run["shards"],
        "pairs": len(pairs),
        "hit_rate": round(run["hit_rate"], 3),
        "ideal_hit_rate": round(run["ideal_hit_rate"], 3),
        "hit_of_ideal": round(run["hit_rate"] / run["ideal_hit_rate"], 3),
        "service_rps_median": round(statistics.median(p["service_rps"] for p in pairs), 2),
        "standalone_rps_median": round(statistics.median(p["standalone_rps"] for p in pairs), 2),
        "median_ratio": round(run["median_ratio"], 3),
        "cpu_ratio": round(run["cpu_ratio"], 3),
        "shard_jobs": run["shard_jobs"],
        "load_max_over_mean": round(run["load_max_over_mean"], 3),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Draw hit rate and service throughput per workload, a bar per policy, into `path`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    workloads = list(dict.fromkeys(row["workload"] for row in rows))
    by_key = {(row["workload"], row["policy"]): row for row in rows}
    figure, (hits, speed) = pyplot.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(POLICIES)
    for offset, policy in enumerate(POLICIES):
        present = [w for w in workloads if (w, policy) in by_key]
        xs = [workloads.index(w) + (offset - 1) * width for w in present]
        hits.bar(xs, [by_key[(w, policy)]["hit_rate"] for w in present], width, label=policy)
        speed.bar(xs, [by_key[(w, policy)]["service_rps_median"] for w in present], width,
                  label=policy)
    for index, workload in enumerate(workloads):
        ideal = next(row["ideal_hit_rate"] for row in rows if row["workload"] == workload)
        hits.hlines(ideal, index - 0.45, index + 0.45, colors="black", linestyles="--")
    hits.set_title("prefix-cache hit rate (dashed: ideal)")
    hits.set_ylim(0, 1)
    speed.set_title("service throughput, median of pairs (req/s)")
    speed.set_ylim(0, 1.4 * max(row["service_rps_median"] for row in rows))
    for axis in (hits, speed):
        axis.set_xticks(range(len(workloads)), workloads)
        axis.legend(loc="upper left", ncol=3)
    shards = rows[0]["shards"]
    figure.suptitle(f"routing policies, {shards} workers, tiny model on a 2-core CPU host")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)


def main(directory: Path) -> None:
    """Print the table of every run in `directory` and write its `routing.png`."""
    rows = [summarise(json.loads(path.read_text())) for path in sorted(directory.glob("*.json"))]
    if not rows:
        raise SystemExit(f"no bench results (*.json) in {directory}")
    rows.sort(key=lambda row: (row["workload"], POLICIES.index(row["policy"])))
    for row in rows:
        print(json.dumps(row))
    plot(rows, directory / "routing.png")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench-out/routing"))
