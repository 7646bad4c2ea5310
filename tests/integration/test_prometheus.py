"""What an operator's Prometheus stores: a real Prometheus server (Debian's package), configured
from ops/prometheus.yml, scrapes the test worker and the batch server; every query of the
Grafana dashboard returns data after a burst, every metric the docs name exists under that
name, and no ratio is NaN without traffic."""

from __future__ import annotations

import io
import json
import math
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from jobsvc import Client
from jobsvc.settings import Settings
from jobsvc.workloads import document_questions
from tests.support.batch_server import API_KEY, openai_client, server_in_thread
from tests.support.environment import free_port
from tests.support.waiting import until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_SECONDS = 1


def _dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((ROOT / "ops/grafana/dashboards/jobsvc.json").read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"]
            for target in panel.get("targets", ())]


def _documented_names() -> set[str]:
    """Every metric name the operations guide's Monitoring section spells out."""
    guide = (ROOT / "docs/operations.md").read_text()
    section = guide.split("\n## Monitoring\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`((?:vllm:|jobsvc_)[a-z0-9_:]+[a-z])(?:\{[^`]*\})?`", section))


def _config(worker_port: int, server_port: int, key_file: Path) -> dict[str, Any]:
    """ops/prometheus.yml with the targets of this test and a short scrape interval."""
    config = yaml.safe_load((ROOT / "ops/prometheus.yml").read_text())
    config["global"].update(scrape_interval=f"{SCRAPE_SECONDS}s",
                            evaluation_interval=f"{SCRAPE_SECONDS}s")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["jobsvc-server"]["authorization"]["credentials_file"] = str(key_file)
    jobs["jobsvc-server"]["static_configs"] = [{"targets": [f"127.0.0.1:{server_port}"]}]
    jobs["jobsvc-workers"]["static_configs"] = [
        {"targets": [f"127.0.0.1:{worker_port}"], "labels": {"shard": "0"}}]
    return config


class Prometheus:
    def __init__(self, port: int, api_url: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        # The batch server it scrapes.
        self.api_url = api_url

    def get(self, path: str, **query: str) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(query)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expression: str) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expression)["result"]


@pytest.fixture()
def prometheus(settings: Settings, client: Client, tmp_path: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus package is missing: run ops/setup.sh as root"
    with server_in_thread(settings) as base_url:
        server_port = urllib.parse.urlsplit(base_url).port
        key_file = tmp_path / "api-key"
        key_file.write_text(API_KEY)
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(
            _config(settings.metrics_port, server_port or 0, key_file)))
        port = free_port()
        with (tmp_path / "prometheus.log").open("wb") as log:
            process = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
        try:
            server = Prometheus(port, base_url)
            until("Prometheus scraping both targets", lambda: _all_up(server), timeout=60,
                  ignoring=(OSError,))
            yield server
        finally:
            process.terminate()
            process.wait(timeout=30)


def _all_up(prometheus: Prometheus) -> bool:
    targets = prometheus.get("/api/v1/targets")["activeTargets"]
    return len(targets) == 2 and all(target["health"] == "up" for target in targets)


def _values(result: list[dict[str, Any]]) -> list[float]:
    return [float(series["value"][1]) for series in result]


def test_every_dashboard_query_and_documented_metric_has_data_in_a_real_prometheus(
        prometheus: Prometheus, client: Client, settings: Settings) -> None:
    queries = _dashboard_queries()
    # Before any traffic of this test's, a ratio shows no line rather than a NaN one.
    for title, expression in queries:
        assert not any(math.isnan(v) for v in _values(prometheus.query(expression))), title

    jobs = document_questions(4, 4, 200, seed=54)
    ids = client.submit_many({"document": job.document, "question": job.question,
                              "max_tokens": 8} for job in jobs)
    api = openai_client(prometheus.api_url)
    lines = [{"custom_id": f"q{n}", "method": "POST", "url": "/v1/completions",
              "body": {"model": settings.served_model_name, "prompt": f"Question {n}:",
                       "max_tokens": 4}} for n in range(2)]
    batch = api.batches.create(
        input_file_id=api.files.create(file=("lines.jsonl", io.BytesIO(
            b"".join(json.dumps(line).encode() + b"\n" for line in lines))),
            purpose="batch").id,
        endpoint="/v1/completions", completion_window="24h")
    client.wait(ids, timeout=240)
    until("the batch completed", lambda: api.batches.retrieve(batch.id).status == "completed",
          timeout=120)
    # Two scrapes after the last result: every rate has a change to see.
    until("the burst's results in Prometheus", lambda: sum(_values(prometheus.query(
        'jobsvc_jobs_finished_total{status="succeeded"}'))) >= len(ids), timeout=30)
    until("one more scrape", lambda: prometheus.query(
        f"changes(jobsvc_jobs_finished_total[{4 * SCRAPE_SECONDS}s])"), timeout=30)

    empty = [title for title, expression in queries if not prometheus.query(expression)]
    assert not empty, f"dashboard panels without data: {empty}"
    for title, expression in queries:
        assert not any(math.isnan(v) for v in _values(prometheus.query(expression))), title

    names = _documented_names()
    assert {"vllm:num_requests_running", "vllm:prefix_cache_hits_total",
            "jobsvc_jobs_finished_total", "jobsvc_queue_messages"} <= names
    # A histogram is stored as its _bucket, _sum and _count series.
    missing = [name for name in sorted(names)
               if not prometheus.query(f'count({{__name__=~"{name}(_count)?"}})')]
    assert not missing, f"documented metrics Prometheus does not have: {missing}"
