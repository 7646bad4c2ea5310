"""`python -m jobsvc.bench.pool`: several bench reports in, each run's checks and pooled rows
out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.bench

REPOSITORY = Path(__file__).resolve().parents[2]


def _report(workload: str, shards: int, ratios: list[float], **figures: Any) -> dict[str, Any]:
    report = {"workload": workload, "shards": shards, "arms": "service/standalone",
              "median_ratio": sorted(ratios)[len(ratios) // 2], "min_ratio": min(ratios),
              "cpu_ratio": 1.0, "bytes_raw": 1_600_000, "bytes_enqueued": 60_000,
              "gc_pause_max_ms": {"shard0@a": 0.0},
              "pairs": [{"ratio": ratio} for ratio in ratios]}
    report.update(figures)
    return report


def _pool(tmp_path: Path, reports: dict[str, dict[str, Any]], *options: str
          ) -> subprocess.CompletedProcess[str]:
    paths = []
    for name, report in reports.items():
        path = tmp_path / name
        path.write_text(json.dumps(report))
        paths.append(str(path))
    return subprocess.run([sys.executable, "-m", "jobsvc.bench.pool", *options, *paths],
                          capture_output=True, text=True, timeout=60, cwd=REPOSITORY)


def test_runs_of_one_row_pool_their_pairs_and_each_run_keeps_its_checks(tmp_path: Path) -> None:
    done = _pool(tmp_path, {
        "a.json": _report("reuse", 1, [0.97, 1.00, 1.01]),
        "b.json": _report("reuse", 1, [0.98, 0.99, 1.03], cpu_ratio=1.02),
        "c.json": _report("ops/workloads/uneven.jsonl", 2, [0.94, 1.05, 1.00]),
    })
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    checks = {run["file"].rsplit("/", 1)[-1]: run["parity_checks"] for run in result["runs"]}
    assert checks["a.json"]["median_ratio"] and checks["a.json"]["cpu_ratio"]
    assert checks["b.json"]["median_ratio"] is True and checks["b.json"]["cpu_ratio"] is False
    assert checks["c.json"]["min_ratio"] is False and checks["c.json"]["bytes_enqueued"] is None
    rows = {(row["workload"], row["shards"]): row for row in result["rows"]}
    assert rows[("reuse", 1)]["pairs"] == 6
    assert rows[("reuse", 1)]["median_ratio"] == 0.995
    assert rows[("reuse", 1)]["pairs_behind"] == 3
    assert rows[("uneven", 2)]["min_ratio"] == 0.94
    [pooled] = result["pooled"]
    assert (pooled["arms"], pooled["pairs"], pooled["pairs_behind"]) == (
        "service/standalone", 9, 4)


def test_a_file_that_is_no_bench_report_is_refused_by_name(tmp_path: Path) -> None:
    done = _pool(tmp_path, {"good.json": _report("unique", 1, [1.0]),
                            "bad.json": {"workload": "unique"}})
    assert done.returncode == 2
    assert "bad.json is not a jobsvc bench report" in done.stderr


def test_other_json_with_pairs_is_refused_rather_than_half_read(tmp_path: Path) -> None:
    # The interference script's reports have pairs too, but no workload or shards.
    done = _pool(tmp_path, {"interference.json": {"pairs": [{"amplification": 1.1}],
                                                  "median_amplification": 1.1}})
    assert done.returncode == 2
    assert "interference.json is not a jobsvc bench report" in done.stderr
    assert "Traceback" not in done.stderr


def test_pooled_a_a_pairs_say_how_often_a_run_of_them_would_clear_the_bars(
        tmp_path: Path) -> None:
    quiet = [0.99, 1.0, 1.01] * 4
    noisy = [0.90, 1.0, 1.02, 0.98, 1.05]
    done = _pool(tmp_path, {
        "quiet.json": _report("reuse", 1, quiet, arms="standalone/standalone"),
        "noisy.json": _report("unique", 1, noisy, arms="standalone/standalone"),
    }, "--pairs-per-run", "10")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["pairs_per_run"] == 10
    chances = {row["workload"]: row["chance_a_run_clears"] for row in result["rows"]}
    assert chances["reuse"] == {"median_ratio": 1.0, "min_ratio": 1.0, "both": 1.0}
    # One pair in five below 0.95: ten draws all miss it about 0.8 ** 10 of the time.
    assert abs(chances["unique"]["min_ratio"] - 0.8 ** 10) < 0.03
    [pooled] = result["pooled"]
    assert pooled["pairs"] == 17
    assert 0.8 ** 10 < pooled["chance_a_run_clears"]["min_ratio"] < 1.0


def test_a_run_of_no_pairs_is_refused(tmp_path: Path) -> None:
    done = _pool(tmp_path, {"a.json": _report("reuse", 1, [1.0])}, "--pairs-per-run", "0")
    assert done.returncode == 2
    assert "--pairs-per-run must be at least 1" in done.stderr
