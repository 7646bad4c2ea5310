"""A worker's metrics for Prometheus, served on 127.0.0.1 (`JOBSVC_METRICS_ADDRESS`), port
`JOBSVC_METRICS_PORT` + its shard: vLLM's own engine metrics (`vllm:*`; the engine registers
them in the process's default registry because the worker runs it with stats on) beside the
worker's counts of the jobs it ran.

They are updated once per message, after its results are committed, through the worker's hooks:
nothing per token, a few additions and two histogram observations per job."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

from jobsvc.exposition import serve_registry
from jobsvc.settings import Settings
from jobsvc.wire import JobStatus
from jobsvc.workers.hooks import FinishedMessage, WorkerHooks

log = logging.getLogger(__name__)

# Seconds: from a fraction of a second on an idle worker to an hour behind a backlog.
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_MESSAGE_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def metrics_port(settings: Settings, shard: int) -> int | None:
    """The port shard `shard`'s worker serves /metrics on; None when metrics are off."""
    return settings.metrics_port + shard if settings.metrics_port else None


def serve_metrics(settings: Settings, shard: int,
                  registry: CollectorRegistry = prometheus_client.REGISTRY) -> int | None:
    """Serve the registry over HTTP from a daemon thread; the port, or None when metrics are
    off or the port is taken (the worker runs on without them, and its heartbeat says so)."""
    port = metrics_port(settings, shard)
    if port is None:
        return None
    try:
        serve_registry(registry, settings.metrics_address, port)
    except OSError as error:
        log.error("shard %d serves no metrics: cannot listen on %s:%d (%s); free the port or "
                  "set JOBSVC_METRICS_PORT", shard, settings.metrics_address, port, error)
        return None
    log.info("shard %d serves metrics at http://%s:%d/metrics", shard,
             settings.metrics_address, port)
    return port


class WorkerMetrics(WorkerHooks):
    """The worker's own metrics, labelled with its shard."""

    def __init__(self, shard: int,
                 registry: CollectorRegistry = prometheus_client.REGISTRY) -> None:
        self._shard = str(shard)
        labels = ["shard"]
        finished = Counter("jobsvc_jobs_finished", "Jobs this worker ran to their end",
                           ["shard", "status"], registry=registry)
        self._succeeded = finished.labels(self._shard, JobStatus.SUCCEEDED.value)
        self._failed = finished.labels(self._shard, JobStatus.FAILED.value)
        tokens = {name: Counter(f"jobsvc_{name}_tokens", help_text, labels, registry=registry)
                  for name, help_text in (
                      ("prompt", "Prompt tokens of succeeded jobs"),
                      ("cached", "Prompt tokens of succeeded jobs found in the prefix cache"),
                      ("completion", "Tokens generated for succeeded jobs"),
                      ("estimated_prefill", "Prompt tokens the router expected succeeded "
                                            "jobs to compute (not found cached)"),
                      ("actual_prefill", "Prompt tokens succeeded jobs computed (not found "
                                         "cached)"))}
        self._prompt, self._cached, self._completion = (
            tokens["prompt"].labels(self._shard), tokens["cached"].labels(self._shard),
            tokens["completion"].labels(self._shard))
        self._estimated_prefill, self._actual_prefill = (
            tokens["estimated_prefill"].labels(self._shard),
            tokens["actual_prefill"].labels(self._shard))
        self._message_seconds = Histogram(
            "jobsvc_message_duration_seconds", "From a message's admission to the engine "
            "to its last job's end", labels, buckets=_LATENCY_BUCKETS,
            registry=registry).labels(self._shard)
        self._message_jobs = Histogram(
            "jobsvc_message_jobs", "Jobs per message run", labels,
            buckets=_MESSAGE_SIZE_BUCKETS, registry=registry).labels(self._shard)
        self._queue_wait = Histogram(
            "jobsvc_queue_wait_seconds", "From a job's submit to its admission to the engine",
            labels, buckets=_LATENCY_BUCKETS, registry=registry).labels(self._shard)
        self._submit_to_result = Histogram(
            "jobsvc_submit_to_result_seconds", "From a job's submit to the engine's end of it "
            "(its result is committed within about a second)", labels,
            buckets=_LATENCY_BUCKETS, registry=registry).labels(self._shard)

    def on_jobs_finished(self, message: FinishedMessage) -> None:
        """Count the message's jobs and tokens, and how far the prefill estimate was off."""
        jobs = {job.job_id: job for job in message.jobs}
        succeeded = [result for result in message.results if result.error is None]
        self._succeeded.inc(len(succeeded))
        self._failed.inc(len(message.results) - len(succeeded))
        prompt = sum(result.prompt_tokens for result in succeeded)
        cached = sum(result.cached_tokens for result in succeeded)
        self._prompt.inc(prompt)
        self._cached.inc(cached)
        self._completion.inc(sum(result.completion_tokens for result in succeeded))
        self._estimated_prefill.inc(
            sum(jobs[result.job_id].estimated_prefill for result in succeeded))
        self._actual_prefill.inc(prompt - cached)
        self._message_jobs.observe(len(message.results))
        self._message_seconds.observe(
            max(0.0, max(result.finished_at for result in message.results) - message.admitted_at))
        for result in message.results:
            submitted_at = _epoch(jobs[result.job_id].submitted_at)
            self._queue_wait.observe(max(0.0, message.admitted_at - submitted_at))
            self._submit_to_result.observe(max(0.0, result.finished_at - submitted_at))


def _epoch(moment: datetime) -> float:
    """Seconds since the epoch; a naive time (SQLite keeps no zone) is UTC, as written."""
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
