"""A worker answers the benchmark's remote-control commands only when told to: they drive its
engine past the queue and the database."""

from __future__ import annotations

import json
import subprocess
import sys

import prometheus_client
import pytest

from jobsvc.settings import Settings
from workers.bench_control import COMMANDS, STEP_HISTOGRAM, engine_step_totals

# Builds a worker's app in a process of its own (Celery keeps one registry of commands per
# process) and prints the remote-control commands it would answer.
_LIST_COMMANDS = """
import json, sys
from celery.worker.control import Panel
from jobsvc.settings import Settings
from workers.celery_app import create_worker_app
create_worker_app(Settings.from_env({}, redis_url=sys.argv[1], database_url=sys.argv[2],
                                    bench_control=sys.argv[3] == "on"), 0)
print(json.dumps(sorted(Panel.data)))
"""


def _worker_commands(settings: Settings, bench_control: str) -> set[str]:
    run = subprocess.run([sys.executable, "-c", _LIST_COMMANDS, settings.redis_url,
                          settings.resolved_database_url, bench_control],
                         capture_output=True, text=True, timeout=300, check=True)
    return set(json.loads(run.stdout.splitlines()[-1]))


def test_a_worker_answers_the_bench_commands_only_when_told_to(settings: Settings) -> None:
    plain = _worker_commands(settings, "off")
    assert "ping" in plain
    assert not plain & set(COMMANDS)
    # Exactly these: a command the gate adds that COMMANDS does not name fails here too.
    assert _worker_commands(settings, "on") - plain == set(COMMANDS)


def test_step_totals_count_every_engines_steps_and_their_tokens() -> None:
    registry = prometheus_client.CollectorRegistry()
    steps = prometheus_client.Histogram(STEP_HISTOGRAM, "tokens per step", ["engine"],
                                        registry=registry)
    unrelated = prometheus_client.Histogram("vllm:time_to_first_token_seconds", "ttft",
                                            registry=registry)
    for engine, tokens in (("0", 2048), ("0", 300), ("1", 16)):
        steps.labels(engine=engine).observe(tokens)
    unrelated.observe(5.0)
    assert engine_step_totals(registry) == pytest.approx({"steps": 3, "tokens": 2364})
    assert engine_step_totals(prometheus_client.CollectorRegistry()) == {"steps": 0.0,
                                                                        "tokens": 0.0}
