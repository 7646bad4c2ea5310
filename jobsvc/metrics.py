"""The fleet's metrics for Prometheus, as the server's /metrics serves them: read at each scrape
(a collector, not counters kept up to date), so they hold for every listed shard whether or
not its worker is up. Each worker serves its own engine's and messages' metrics
(`jobsvc.workers.metrics`).

Families: `jobsvc_queue_messages{queue,shard}`, `jobsvc_jobs{status,shard}` (queued and
running), `jobsvc_shard_outstanding_load{shard}`, `jobsvc_worker_healthy{shard,model}`, by model
`jobsvc_model_jobs{model,status}` and `jobsvc_model_workers{model}` and, where the store has
the batch API's table, `jobsvc_batches{status}`."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jobsvc.fleet import Fleet
from jobsvc.keys import queue_name


def fleet_families(fleet: Fleet) -> list[Metric]:
    """The fleet's metric families from one read of it; pure, so tests check them unscraped."""
    queues = GaugeMetricFamily("jobsvc_queue_messages",
                               "Messages waiting in the shard's queue (each names a few jobs)",
                               labels=["queue", "shard"])
    jobs = GaugeMetricFamily("jobsvc_jobs", "Unfinished jobs by status",
                             labels=["status", "shard"])
    loads = GaugeMetricFamily("jobsvc_shard_outstanding_load",
                              "Work the router counts the shard as owing, in prefill tokens",
                              labels=["shard"])
    healthy = GaugeMetricFamily("jobsvc_worker_healthy",
                                "1 if the shard's worker sent a heartbeat lately and its engine "
                                "is ready, else 0; model is the one it serves, empty if unknown",
                                labels=["shard", "model"])
    model_jobs = GaugeMetricFamily("jobsvc_model_jobs", "Unfinished jobs by the model they ask "
                                   "for and status", labels=["model", "status"])
    model_workers = GaugeMetricFamily("jobsvc_model_workers",
                                      "Live workers serving the model or adapter; at 0 its "
                                      "jobs wait for one",
                                      labels=["model"])
    for view in fleet.shards:
        shard = str(view.shard)
        queues.add_metric([queue_name(view.shard), shard], view.queue_messages)
        for status, count in view.jobs.items():
            jobs.add_metric([status, shard], count)
        if view.outstanding_load is not None:
            loads.add_metric([shard], view.outstanding_load)
        healthy.add_metric([shard, view.models[0] if view.models else ""], int(view.healthy))
    for model in fleet.models:
        for status, count in model.jobs.items():
            model_jobs.add_metric([model.name, status], count)
        model_workers.add_metric([model.name], model.workers)
    families: list[Metric] = [queues, jobs, loads, healthy, model_jobs, model_workers]
    if fleet.batches is not None:
        batches = GaugeMetricFamily("jobsvc_batches", "Batches of the batch API by status",
                                    labels=["status"])
        for status, count in sorted(fleet.batches.items()):
            batches.add_metric([status], count)
        families.append(batches)
    return families


class FleetCollector(Collector):
    """Reads the fleet at each scrape; a read that fails fails the scrape (Prometheus then
    records the target down) rather than serving stale numbers."""

    def __init__(self, read_fleet: Callable[[], Fleet]) -> None:
        self._read_fleet = read_fleet

    def collect(self) -> Iterator[Metric]:
        """Read the fleet now and yield its families."""
        yield from fleet_families(self._read_fleet())


def fleet_registry(read_fleet: Callable[[], Fleet]) -> CollectorRegistry:
    """A registry of the fleet's metrics alone (e.g. `FleetReader(...).read`); it reads
    nothing until scraped."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(read_fleet))
    return registry
