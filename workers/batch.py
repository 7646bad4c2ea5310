"""The batch loop: one Celery task per micro-batch message. It refuses what is not ours, skips
jobs cancelled while queued, reads the documents of the rest from the store, admits them to
the engine at once, and returns (so the message is acknowledged) only when every result is
committed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from jobsvc.prompts import PromptBuilder
from jobsvc.schema import BatchMessage, MessageError, QueuedJob
from jobsvc.store import JobOutcome, Store
from workers.engine import EngineAdapter, EngineRequest, EngineResult
from workers.hooks import WorkerHooks
from workers.recorder import CacheCheck, Completion, ResultRecorder

log = logging.getLogger(__name__)
T = TypeVar("T")


class BatchRunner:
    def __init__(self, *, shard: int, worker_name: str, store: Store, engine: EngineAdapter,
                 recorder: ResultRecorder, prompts: PromptBuilder, max_attempts: int,
                 hooks: WorkerHooks) -> None:
        self.shard = shard
        self.worker_name = worker_name
        self.max_attempts = max_attempts
        self._store = store
        self._prompts = prompts
        self._engine = engine
        self._recorder = recorder
        self._hooks = hooks
        self._running: set[str] = set()
        self._lock = threading.Lock()

    def run(self, payload: Any) -> dict[str, int]:
        """Run one batch message; returns counts for the task's log line."""
        try:
            message = BatchMessage.from_wire(payload)
        except MessageError as error:
            log.error("shard %d refused a message: %s", self.shard, error)
            return {"refused": 1}
        if message.shard != self.shard:
            log.warning("shard %d got a batch addressed to shard %d; running it anyway",
                        self.shard, message.shard)
        jobs, requests, checks = self._claim(message)
        self._hooks.on_claim([job.job_id for job in jobs])
        loads = {job.job_id: job.load for job in jobs}
        completion = Completion(len(jobs))
        results: list[EngineResult] = []
        started = time.time()

        def on_result(result: EngineResult) -> None:
            results.append(result)
            with self._lock:
                self._running.discard(result.job_id)
            self._recorder.job_finished(_outcome(result), message.shard,
                                        loads[result.job_id], checks[result.job_id],
                                        completion)

        with self._lock:
            self._running.update(loads)
        self._hooks.on_admit(len(requests), started)
        self._engine.submit(requests, on_result).result()
        completion.wait()
        if results:
            self._recorder.batch_finished(self._batch_stats(message.shard, started, results))
        self._hooks.on_batch_end(len(jobs), started)
        return {"jobs": len(jobs), "skipped": len(message.jobs) - len(jobs)}

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """Wait out a database outage: the message stays unacknowledged (and its lease
        renewed) until the database answers."""
        delay = 0.5
        while True:
            try:
                return call()
            except SQLAlchemyError as error:
                log.warning("shard %d cannot %s (%s); retrying in %.1f s",
                            self.shard, what, type(error).__name__, delay)
                time.sleep(delay)
                delay = min(10.0, delay * 2)

    def _claim(self, message: BatchMessage
               ) -> tuple[list[QueuedJob], list[EngineRequest], dict[str, CacheCheck]]:
        """Claim the message's jobs; return those that run, their engine requests, and what
        each one's cache hit is checked against. Jobs that will not run (cancelled, finished,
        or failed by the claim) are skipped. A document's tokens are one tuple that all its
        questions' requests share (see EngineRequest)."""
        documents = self._claimed_documents(message.jobs)
        skipped = [job for job in message.jobs if job.job_id not in documents]
        if skipped:
            log.info("shard %d skips %d jobs that will not run (cancelled, finished, or "
                     "failed at their claim)", self.shard, len(skipped))
            self._recorder.release_load(message.shard, sum(job.load for job in skipped))
        jobs = [job for job in message.jobs if job.job_id in documents]
        requests = [EngineRequest(job.job_id, documents[job.job_id],
                                  tuple(job.question_tokens), job.sampling) for job in jobs]
        checks = {request.job_id: CacheCheck(
            request.prompt_tokens - job.estimated_prefill, len(request.prefix))
            for job, request in zip(jobs, requests, strict=True)}
        return jobs, requests, checks

    def _claimed_documents(self, jobs: Sequence[QueuedJob]) -> dict[str, tuple[int, ...]]:
        """Claim these jobs; the document tokens of those that may run, by job ID, from the
        store (messages do not carry documents). A document stored without tokens is
        tokenized here as the producer did."""
        job_ids = [job.job_id for job in jobs]
        stored = self._retrying(f"claim {len(job_ids)} jobs", lambda: (
            self._store.claim_batch(job_ids, self.worker_name, self.max_attempts)))
        texts = list(dict.fromkeys(doc for doc in stored.values() if isinstance(doc, str)))
        tokenized = {text: tuple(tokens) for text, tokens
                     in zip(texts, self._prompts.documents(texts), strict=True)}
        return {job_id: tokenized[doc] if isinstance(doc, str) else doc
                for job_id, doc in stored.items()}

    def abort_if_running(self, job_id: str) -> None:
        with self._lock:
            running = job_id in self._running
        if running:
            log.info("shard %d aborts cancelled job %s", self.shard, job_id)
            self._engine.abort(job_id)

    def _batch_stats(self, shard: int, started: float,
                     results: list[EngineResult]) -> dict[str, Any]:
        finished = max(result.finished_at for result in results)
        wall = max(finished - started, 1e-9)
        completion_tokens = sum(result.completion_tokens for result in results)
        return {
            "worker": self.worker_name, "shard": shard, "jobs": len(results),
            "prompt_tokens": sum(result.prompt_tokens for result in results),
            "completion_tokens": completion_tokens,
            "cached_tokens": sum(result.cached_tokens for result in results),
            "started_at": datetime.fromtimestamp(started, UTC),
            "finished_at": datetime.fromtimestamp(finished, UTC),
            "wall_seconds": wall, "requests_per_second": len(results) / wall,
            "tokens_per_second": completion_tokens / wall,
        }


def _outcome(result: EngineResult) -> JobOutcome:
    return JobOutcome(result.job_id, result.text, result.error, result.completion_tokens,
                      result.cached_tokens, datetime.fromtimestamp(result.finished_at, UTC))
