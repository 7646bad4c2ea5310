"""What operators see of a running service: the worker's own /metrics after it ran jobs, its
heartbeat in `jobsvc status`, the fleet's metrics over HTTP for shards no worker serves, and
a producer's progress while it waits."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import prometheus_client
import pytest
import redis

from jobsvc import Client
from jobsvc.child_processes import LocalWorkers, settings_environment
from jobsvc.fleet import FleetReader
from jobsvc.health import KEEP_SECONDS, read_heartbeats
from jobsvc.keys import LOAD_KEY, heartbeat_key, queue_name
from jobsvc.metrics import fleet_registry
from jobsvc.served_models import read_registry, served_by
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.workers.heartbeat import BatchActivity, HeartbeatKeeper
from tests.support.exposition import Samples, parse_samples
from tests.support.waiting import until

pytestmark = pytest.mark.integration


def scrape(url: str) -> Samples:
    """Every sample a /metrics endpoint serves, parsed as Prometheus parses it."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse_samples(response.read().decode())


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include these."""
    wanted = set(labels.items())
    return sum(value for (found, found_labels), value in samples.items()
               if found == name and wanted <= found_labels)


def test_the_workers_metrics_count_its_jobs_and_carry_the_engines_prefix_cache_counters(
        settings: Settings, client: Client) -> None:
    url = f"http://127.0.0.1:{settings.metrics_port}/metrics"
    before = scrape(url)
    document = "The ferry leaves the north pier at dawn and returns at dusk. " * 60
    ids = client.submit_many({"document": document, "question": question, "max_tokens": 4}
                             for question in ("When does it leave?", "When does it return?",
                                              "From where?", "How often?"))
    records = client.wait(ids, timeout=120)
    assert all(record.status.value == "succeeded" for record in records)
    # The worker counts a batch right after its results commit, which the wait may beat.
    after = until("the batch counted", lambda: (
        found := scrape(url),
        total(found, "jobsvc_jobs_finished_total", status="succeeded", shard="0")
        - total(before, "jobsvc_jobs_finished_total", status="succeeded", shard="0") >= 4
        and found)[-1])
    assert total(after, "jobsvc_jobs_finished_total", status="succeeded", shard="0") - total(
        before, "jobsvc_jobs_finished_total", status="succeeded", shard="0") == 4
    cached = sum(record.cached_tokens or 0 for record in records)
    assert cached > 0
    assert total(after, "jobsvc_cached_tokens_total") - total(
        before, "jobsvc_cached_tokens_total") == cached
    assert total(after, "jobsvc_prompt_tokens_total") - total(
        before, "jobsvc_prompt_tokens_total") == sum(record.prompt_tokens for record in records)
    assert total(after, "jobsvc_queue_wait_seconds_count") - total(
        before, "jobsvc_queue_wait_seconds_count") == 4
    assert total(after, "jobsvc_submit_to_result_seconds_count") - total(
        before, "jobsvc_submit_to_result_seconds_count") == 4
    # vLLM's own counters, from the engine this worker runs: the questions after the first
    # found the document's blocks cached.
    queries = total(after, "vllm:prefix_cache_queries_total") - total(
        before, "vllm:prefix_cache_queries_total")
    hits = total(after, "vllm:prefix_cache_hits_total") - total(
        before, "vllm:prefix_cache_hits_total")
    assert queries >= sum(record.prompt_tokens for record in records) and hits >= cached
    assert ("vllm:num_requests_running" in {name for name, _ in after}
            and "vllm:kv_cache_usage_perc" in {name for name, _ in after})


def _status(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jobsvc", "status", *args],
                          env={**settings_environment(settings), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def test_status_shows_the_worker_alive_with_its_engine_ready(
        settings: Settings, worker: LocalWorkers) -> None:
    run = _status(settings, "--json", "--shard", "0")
    assert run.returncode == 0, run.stderr
    (shard,) = json.loads(run.stdout)["shards"]
    assert shard["shard"] == 0 and set(shard["jobs"]) == {"queued", "running"}
    found = shard["worker"]
    assert found["alive"] and found["healthy"] and found["engine_ready"]
    assert (found["host"], found["pid"]) == (socket.gethostname(), worker.processes[0].pid)
    assert found["metrics_port"] == settings.metrics_port
    assert 0 <= found["last_seen_s"] <= 15
    assert shard["models"][0] == settings.served_model_name
    served = {model["model"]: model for model in json.loads(run.stdout)["models"]}
    assert served[settings.served_model_name]["workers"] >= 1
    assert not served[settings.served_model_name]["waiting"]
    text = _status(settings)
    assert "alive shard0@" in text.stdout.splitlines()[1], text.stdout
    assert text.stdout.splitlines()[1].split()[1] == settings.served_model_name


def test_a_shard_asked_about_with_no_worker_fails_the_health_check(settings: Settings) -> None:
    run = _status(settings, "--shard", "41")
    assert run.returncode == 1
    # Not named by the settings, so marked with a star.
    assert run.stdout.splitlines()[1].split() == ["41*", "-", "0", "0", "0", "0", "none",
                                                  "seen"]
    assert run.stdout.splitlines()[-1].startswith("needs attention: shard 41")


@contextmanager
def served(registry: prometheus_client.CollectorRegistry) -> Iterator[str]:
    """The registry served over HTTP on loopback, as the server's /metrics serves it."""
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_the_fleet_metrics_show_queued_work_on_shards_no_worker_serves(
        routing_settings: Settings) -> None:
    broker = redis.Redis.from_url(routing_settings.redis_url)
    # This reader's settings name two shards; the producer's eight make the others live.
    reader_settings = replace(routing_settings, shards=2)
    store = Store(routing_settings.resolved_database_url)
    with Client(settings=routing_settings) as client:
        ids = client.submit_many({"document": f"Log {number}: {number} boats came in. " * 40,
                                  "question": "How many boats?", "max_tokens": 2}
                                 for number in range(16))
        mine: dict[int, int] = {}
        for job_id in ids:
            shard = client.get(job_id).shard
            mine[shard] = mine.get(shard, 0) + 1
        try:
            registry = fleet_registry(FleetReader(reader_settings, broker, store).read)
            with served(registry) as url:
                found = scrape(url)
            loads = {int(shard): int(load) for shard, load in broker.hgetall(LOAD_KEY).items()}
        finally:
            for job_id in ids:
                client.cancel(job_id)
            store.dispose()
    assert set(mine) - {0, 1}, "the producer used only the configured shards"
    listed = {int(dict(labels)["shard"]) for name, labels in found
              if name == "jobsvc_queue_messages"}
    # Every configured shard and every shard with work; other tests' unfinished jobs in
    # this database may add shards of their own.
    assert listed >= {0, 1} | set(mine)
    for shard, count in mine.items():
        labels = {"shard": str(shard)}
        assert found[("jobsvc_queue_messages", frozenset(
            {**labels, "queue": queue_name(shard)}.items()))] == broker.llen(queue_name(shard))
        assert found[("jobsvc_jobs", frozenset({**labels, "status": "queued"}.items()))] >= count
        # One series a shard, whichever model it served last.
        assert [value for (name, found_labels), value in found.items()
                if name == "jobsvc_worker_healthy" and ("shard", str(shard)) in found_labels
                ] == [0]
        assert found[("jobsvc_shard_outstanding_load", frozenset(labels.items()))] == loads[
            shard] > 0
    assert found[("jobsvc_model_jobs", frozenset(
        {"model": routing_settings.served_model_name, "status": "queued"}.items()))] >= len(ids)


def test_a_heartbeat_says_what_the_worker_does_and_that_it_stopped(
        routing_settings: Settings) -> None:
    broker = redis.Redis.from_url(routing_settings.redis_url)
    activity = BatchActivity()
    settings = replace(routing_settings, loras="sql=/adapters/sql")
    keeper = HeartbeatKeeper(routing_settings.redis_url, 23, "shard23@here", activity,
                             served=served_by(settings, 0))
    keeper.start(metrics_port=None)
    starting = until("the first heartbeat", lambda: read_heartbeats(broker).get(23))
    assert starting.alive and not starting.healthy
    assert starting.heartbeat.last_message_finished_s is None
    assert starting.heartbeat.models == [settings.served_model_name, "sql"]
    assert starting.heartbeat.task == "generate"
    # Registered from its first beat, while its engine starts: producers take its jobs.
    assert until("its registration", lambda: read_registry(broker)[1].get(23)) == [
        settings.served_model_name, "sql"]
    models = read_registry(broker)[0]
    assert (models["sql"].base, models["sql"].context) == (settings.served_model_name, 0)
    with activity.running():
        keeper.engine_started(served_by(settings, 2048))
        running = read_heartbeats(broker)[23]
        assert running.healthy and running.heartbeat.messages_in_flight == 1
        assert read_registry(broker)[0]["sql"].context == 2048
    keeper.stop()
    stopped = read_heartbeats(broker)[23]
    assert stopped.heartbeat.stopped and not stopped.alive
    assert stopped.heartbeat.messages_in_flight == 0
    assert stopped.heartbeat.last_message_finished_s is not None
    assert 0 < broker.ttl(heartbeat_key(23)) <= KEEP_SECONDS


def test_a_producer_waiting_with_progress_sees_its_jobs_counted_to_the_end(
        client: Client, capsys: pytest.CaptureFixture[str]) -> None:
    ids = client.submit_many({"document": f"Tide table {number}. " * 50, "question": "High?",
                              "max_tokens": 2} for number in range(6))
    client.wait(ids, timeout=120, progress=True)
    lines = capsys.readouterr().err.splitlines()
    # Standard error is no terminal here: plain lines, the first and the last at least.
    assert lines[0].startswith("finished: ") and lines[0].endswith(" of 6 jobs")
    assert lines[-1] == "finished: 6 of 6 jobs"
