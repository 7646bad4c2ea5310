"""A worker answers the benchmark's remote-control commands and meters its collections only
when its hooks attach the bench's probes: the commands drive its engine past the queue and
the database."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from typing import Any

import prometheus_client
import pytest

from jobsvc.bench.gcpause import GcPauseMeter
from jobsvc.bench.probes import (
    COMMANDS,
    HOOKS_PATH,
    STEP_HISTOGRAM,
    BenchProbes,
    engine_step_totals,
)
from jobsvc.settings import Settings
from jobsvc.workers.collector import CollectionWindow
from jobsvc.workers.hooks import WorkerContext

pytestmark = pytest.mark.bench

# Builds a worker's app in a process of its own (Celery keeps one registry of commands per
# process), makes it ready as Celery would once its engine runs, and prints the
# remote-control commands it would answer and the collector callbacks it added.
_INSPECT_WORKER = """
import gc, json, sys
from celery import signals
from celery.worker.control import Panel
from jobsvc.settings import Settings
from jobsvc.workers.celery_app import create_worker_app
create_worker_app(Settings.from_env({}, redis_url=sys.argv[1], database_url=sys.argv[2],
                                    worker_hooks=sys.argv[3]), 0)
callbacks = len(gc.callbacks)
signals.worker_ready.send(sender=None)
print(json.dumps({"commands": sorted(Panel.data), "gc_callbacks": len(gc.callbacks) - callbacks}))
"""


def _inspect_worker(settings: Settings, hooks: str) -> dict[str, Any]:
    run = subprocess.run([sys.executable, "-c", _INSPECT_WORKER, settings.redis_url,
                          settings.resolved_database_url, hooks],
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(run.stdout.splitlines()[-1])


def test_a_worker_answers_the_bench_commands_only_with_the_benchs_probes_attached(
        settings: Settings) -> None:
    plain = _inspect_worker(settings, "")
    assert "ping" in plain["commands"]
    assert not set(plain["commands"]) & set(COMMANDS)
    assert plain["gc_callbacks"] == 0
    probed = _inspect_worker(settings, HOOKS_PATH)
    # Exactly these: a command the probes add that COMMANDS does not name fails here too.
    assert set(probed["commands"]) - set(plain["commands"]) == set(COMMANDS)
    assert probed["gc_callbacks"] == 1


def test_the_probes_keep_the_earliest_admission_until_taken() -> None:
    probes = BenchProbes()
    assert probes.take_first_admission() is None
    probes.on_admit(0, 5.0)
    assert probes.take_first_admission() is None
    for admitted_at in (12.0, 10.5, 11.0):
        probes.on_admit(8, admitted_at)
    assert probes.take_first_admission() == 10.5
    assert probes.take_first_admission() is None


def test_the_probes_meter_collections_from_start_to_stop() -> None:
    probes = BenchProbes()
    with pytest.raises(RuntimeError, match="not started"):
        probes.take_gc_pauses()
    window = CollectionWindow()
    probes.on_start(WorkerContext(0, None, None, window))  # type: ignore[arg-type]
    try:
        with window.busy():
            gc.collect(0)
        gc.collect(0)
        reading = probes.take_gc_pauses()
    finally:
        probes.on_stop()
    assert reading["gc_collections_by_generation"][0] == 1
    assert reading["gc_idle_collections"] >= 1
    assert not any(isinstance(getattr(callback, "__self__", None), GcPauseMeter)
                   for callback in gc.callbacks)


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
