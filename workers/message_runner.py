"""The message loop: one Celery task per queue message. It refuses what is not ours,
claims the jobs the message may run and reads everything they run from the store (the message
only names them), admits them to the engine at once, and returns (so the message is
acknowledged) only when every result is committed. Suspects, jobs whose engine died under
them before, run after their message-mates, in groups that each have the engine alone and
halve each time the engine dies under them (see jobsvc.workers.isolation)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from jobsvc.prompts import PromptBuilder
from jobsvc.store import ClaimedJob, JobOutcome, MessageStats, Store
from jobsvc.wire import MessageError, QueueMessage
from jobsvc.workers.engine import EngineAdapter, EngineRequest, EngineResult
from jobsvc.workers.hooks import FinishedMessage, WorkerHooks
from jobsvc.workers.isolation import EngineTurns, SuspectGroup, suspect_groups
from jobsvc.workers.recorder import CacheCheck, Completion, ResultRecorder

log = logging.getLogger(__name__)
# How a job the engine ran can end, as a message's task result counts them.
_ENDINGS = ("succeeded", "failed", "cancelled")
T = TypeVar("T")


class MessageRunner:
    """Runs one message's jobs from claim to committed results: what makes acknowledging a message
    safe, since it returns only once every result it ran is in the store."""

    def __init__(self, *, shard: int, worker_name: str, store: Store, engine: EngineAdapter,
                 recorder: ResultRecorder, prompts: PromptBuilder, max_attempts: int,
                 batch_size: int, hooks: WorkerHooks, model: str,
                 adapters: Sequence[str] = ()) -> None:
        """`model`: the served name of the worker's model; `adapters`: the LoRA adapters it
        loaded. A job naming anything else is never claimed here."""
        self.shard = shard
        self._model = model
        self._served = [model, *adapters]
        self.worker_name = worker_name
        self.max_attempts = max_attempts
        self.batch_size = batch_size
        self._store = store
        self._prompts = prompts
        self._engine = engine
        self._recorder = recorder
        self._hooks = hooks
        self._running: set[str] = set()
        # Running jobs already aborted: a cancel heard twice aborts once.
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._turns = EngineTurns()

    def run(self, payload: Any, message_id: str, redelivered: bool) -> dict[str, int]:
        """Run one queue message; returns how its jobs ended, for the task's log line and the
        task result monitors show (a message whose jobs failed still ends as a task that
        succeeded: the count says so). `redelivered`: the broker sends the message again
        because the worker that had it stopped."""
        try:
            message = QueueMessage.from_wire(payload, message_id)
        except MessageError as error:
            log.error("shard %d refused message %s: %s", self.shard, message_id, error)
            return {"refused": 1}
        if message.shard != self.shard:
            log.warning("shard %d got message %s addressed to shard %d; only jobs recorded "
                        "for this shard run", self.shard, message_id, message.shard)
        # Claimed only once messages may share the engine: jobs kept waiting while a group of
        # suspects has it alone stay unclaimed, and are no suspects if that group kills it.
        with self._turns.shared():
            jobs = self._claim(message, redelivered)
            ended = self._run_together([job for job in jobs if not job.suspect])
        suspects = {job.job_id: job for job in jobs if job.suspect}
        for group in suspect_groups([(job.job_id, job.isolation) for job in suspects.values()],
                                    self.batch_size):
            with self._turns.alone():
                ended += self._run_isolated(group, [suspects[job_id]
                                                    for job_id in group.job_ids])
        ran = ended.total()
        return {"jobs": ran, **{ending: ended[ending] for ending in _ENDINGS},
                "skipped": len(message.job_ids) - ran}

    def _run_isolated(self, group: SuspectGroup, jobs: list[ClaimedJob]) -> Counter[str]:
        """Run a group of suspects with nothing else in the engine, charged first (while
        the group has the engine: a group still waiting is not charged for another's death):
        should the engine die now, the next delivery runs them in smaller groups, or knows
        that a job run alone killed it."""
        charged = self._retrying(
            f"charge {len(jobs)} suspect jobs",
            lambda: self._store.charge_isolated(group.job_ids, group.charged_level))
        with self._lock:
            self._running.difference_update(set(group.job_ids) - charged)
        if group.solo and charged:
            log.warning("shard %d runs job %s alone: an engine died while it ran", self.shard,
                        group.job_ids[0])
        elif charged:
            log.warning("shard %d runs %d suspect jobs, from job %s, with nothing else "
                        "in the engine, charged to isolation level %d: an engine died while "
                        "they ran", self.shard, len(charged), group.job_ids[0],
                        group.charged_level)
        return self._run_together([job for job in jobs if job.job_id in charged])

    def _run_together(self, jobs: list[ClaimedJob]) -> Counter[str]:
        """Admit claimed jobs to the engine at once and wait until their results are
        committed; returns how many ended in each of _ENDINGS."""
        ended: Counter[str] = Counter()
        if not jobs:
            return ended
        self._hooks.on_claim([job.job_id for job in jobs])
        requests, checks = self._requests(jobs)
        completion = Completion(len(requests))
        results: list[EngineResult] = []
        started = time.time()

        def on_result(result: EngineResult) -> None:
            results.append(result)
            with self._lock:
                self._running.discard(result.job_id)
                cancelled = result.job_id in self._aborted
                self._aborted.discard(result.job_id)
            ended["succeeded" if result.error is None else
                  "cancelled" if cancelled else "failed"] += 1
            self._recorder.job_finished(_outcome(result), self.shard, checks[result.job_id],
                                        completion)

        self._hooks.on_admit(len(requests), started)
        if requests:
            self._recorder.jobs_started([request.job_id for request in requests],
                                        datetime.fromtimestamp(started, UTC))
        self._engine.submit(requests, on_result).result()
        completion.wait()
        if results:
            self._recorder.message_finished(self._message_stats(started, results))
            self._hooks.on_jobs_finished(FinishedMessage(self.shard, started, jobs, results))
        self._hooks.on_message_end(len(requests), started)
        return ended

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

    def _claim(self, message: QueueMessage, redelivered: bool) -> list[ClaimedJob]:
        """Claim the jobs this message may run, leaving out any this worker already runs (a
        copy of a message it is running); the claim returns the load of jobs it ended
        instead (given up, or unreadable), and that goes back to the router."""
        with self._lock:
            job_ids = [job_id for job_id in message.job_ids if job_id not in self._running]
        claim = self._retrying(f"claim {len(job_ids)} jobs", lambda: self._store.claim_message(
            job_ids, message_id=message.message_id, shard=self.shard, redelivered=redelivered,
            worker=self.worker_name, max_attempts=self.max_attempts, models=self._served))
        self._recorder.release_load(claim.released)
        with self._lock:
            # Another thread may have claimed some of them meanwhile (a copy of this message
            # redelivered at once): the first keeps them.
            jobs = [job for job in claim.jobs if job.job_id not in self._running]
            self._running.update(job.job_id for job in jobs)
        if len(jobs) < len(message.job_ids):
            log.info("shard %d skips %d of message %s's jobs (finished, cancelled, running, "
                     "not this message's, or of a model not served here)", self.shard,
                     len(message.job_ids) - len(jobs), message.message_id)
        return jobs

    def _requests(self, jobs: list[ClaimedJob]
                  ) -> tuple[list[EngineRequest], dict[str, CacheCheck]]:
        """Engine requests for claimed jobs, and what each one's cache hit is checked
        against. A document's tokens are one tuple that all its questions' requests share
        (see EngineRequest); text stored without tokens is tokenized here as the producer
        did."""
        documents = self._tokenized([job.document for job in jobs], self._prompts.documents)
        questions = self._tokenized([job.question for job in jobs], self._prompts.questions)
        requests = [EngineRequest(job.job_id, document, question, job.sampling,
                                  None if job.model == self._model else job.model)
                    for job, document, question in zip(jobs, documents, questions, strict=True)]
        checks = {request.job_id: CacheCheck(
            request.prompt_tokens - job.estimated_prefill, len(request.prefix))
            for job, request in zip(jobs, requests, strict=True)}
        return requests, checks

    @staticmethod
    def _tokenized(parts: list[tuple[int, ...] | str],
                   tokenize: Callable[[list[str]], list[list[int]]]) -> list[tuple[int, ...]]:
        """Each part's tokens, tokenizing each distinct text once."""
        texts = list(dict.fromkeys(part for part in parts if isinstance(part, str)))
        tokenized = {text: tuple(ids) for text, ids in zip(texts, tokenize(texts), strict=True)}
        return [tokenized[part] if isinstance(part, str) else part for part in parts]

    def abort_if_running(self, job_id: str, via: str) -> None:
        """Abort a cancelled job if it runs here; `via` names how the cancel arrived, for the
        log."""
        with self._lock:
            running = job_id in self._running and job_id not in self._aborted
            if running:
                self._aborted.add(job_id)
        if running:
            log.info("shard %d aborts cancelled job %s (%s)", self.shard, job_id, via)
            self._engine.abort(job_id)

    def running_jobs(self) -> list[str]:
        """The jobs this worker has claimed and not yet finished."""
        with self._lock:
            return list(self._running)

    def _message_stats(self, started: float, results: list[EngineResult]) -> MessageStats:
        finished = max(result.finished_at for result in results)
        wall = max(finished - started, 1e-9)
        completion_tokens = sum(result.completion_tokens for result in results)
        return MessageStats(
            worker=self.worker_name, shard=self.shard, jobs=len(results),
            prompt_tokens=sum(result.prompt_tokens for result in results),
            completion_tokens=completion_tokens,
            cached_tokens=sum(result.cached_tokens for result in results),
            started_at=datetime.fromtimestamp(started, UTC),
            finished_at=datetime.fromtimestamp(finished, UTC),
            wall_seconds=wall, requests_per_second=len(results) / wall,
            tokens_per_second=completion_tokens / wall)


def _outcome(result: EngineResult) -> JobOutcome:
    return JobOutcome(result.job_id, result.text, result.error, result.completion_tokens,
                      result.cached_tokens, datetime.fromtimestamp(result.finished_at, UTC),
                      result.finish_reason, result.choices, result.created_cache_tokens,
                      result.vectors)
