"""The producer API: submit document-question jobs, poll their results, cancel them."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from sqlalchemy.exc import SQLAlchemyError

from jobsvc import compression
from jobsvc.batching import form_batches
from jobsvc.errors import BrokerUnavailable, InvalidJob, JobNotFound, StorageUnavailable
from jobsvc.finish_signal import FinishSignal
from jobsvc.keys import CANCEL_CHANNEL, RECONCILED_EPOCH_KEY, REQUEUE_LOCK_KEY
from jobsvc.prompts import PromptBuilder
from jobsvc.routing.cost import RoutingJob, decode_load, loads_per_shard
from jobsvc.routing.prefix import document_keys
from jobsvc.routing.router import make_router
from jobsvc.routing.state import ShardState
from jobsvc.schema import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    JobRequest,
    JobStatus,
    QueuedJob,
    validate_job,
)
from jobsvc.settings import Settings
from jobsvc.store import JobRecord, Store, utcnow
from jobsvc.transport import make_celery, publish

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Routed:
    """Jobs ready to enqueue: (shard, queue entry) each, and their documents by key."""

    placed: list[tuple[int, QueuedJob]]
    epoch: str
    document_tokens: dict[str, list[int]]
    document_texts: dict[str, str]

    def shard_loads(self) -> dict[int, int]:
        """What these jobs charged each shard."""
        return loads_per_shard((shard, job.load) for shard, job in self.placed)


_WAIT_CHUNK = 5000


class Client:
    """A producer's handle on the service. Safe to share between threads of one process."""

    def __init__(self, redis_url: str | None = None, database_url: str | None = None, *,
                 settings: Settings | None = None) -> None:
        base = settings or Settings.from_env()
        self.settings = replace(base, redis_url=redis_url or base.redis_url,
                                database_url=database_url or base.database_url)
        self._store = Store(self.settings.resolved_database_url)
        # A few retries ride out a dropped connection or a Redis restart.
        self._redis = redis.Redis.from_url(
            self.settings.redis_url, retry=Retry(ExponentialBackoff(cap=2.0), 5),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        self._shard_state = ShardState(self._redis, self.settings.shards)
        self._router = make_router(self._redis, self._shard_state, self.settings)
        self._prompts = PromptBuilder(self.settings.model, self.settings.max_model_len)
        self._celery = make_celery(self.settings)

    def close(self) -> None:
        self._store.dispose()
        self._redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def submit(self, document: str, question: str, *, max_tokens: int = DEFAULT_MAX_TOKENS,
               temperature: float = DEFAULT_TEMPERATURE, **sampling: Any) -> str:
        """Submit one job and return its ID."""
        job = {"document": document, "question": question, "max_tokens": max_tokens,
               "temperature": temperature, **sampling}
        return self.submit_many([job])[0]

    def submit_many(self, jobs: Iterable[Mapping[str, Any]]) -> list[str]:
        """Submit many jobs at once: all are validated first, then recorded in one transaction
        and enqueued in one Redis pipeline. Returns the job IDs in input order."""
        requests = [self._validate(index, job) for index, job in enumerate(jobs)]
        if not requests:
            return []
        job_ids = [uuid.uuid4().hex for _ in requests]
        routed = self._route(requests, job_ids)
        now = utcnow()
        # Workers read each document's tokens from here: queue messages only name documents.
        document_rows = [{"key": key, "text_zst": compression.compress(text.encode()),
                          "tokens_zst": compression.pack_tokens(routed.document_tokens[key]),
                          "tokens": len(routed.document_tokens[key]), "created_at": now}
                         for key, text in routed.document_texts.items()]
        job_rows = [{
            "id": job.job_id, "document_key": job.document_key, "question": request.question,
            "sampling": request.sampling, "shard": shard, "status": JobStatus.QUEUED.value,
            "prompt_tokens": len(routed.document_tokens[job.document_key])
            + len(job.question_tokens),
            "estimated_prefill": job.estimated_prefill, "submitted_at": now,
            "redis_epoch": routed.epoch,
        } for request, (shard, job) in zip(requests, routed.placed, strict=True)]
        try:
            self._store.record_submitted(document_rows, job_rows)
        except SQLAlchemyError as error:
            self._shard_state.release(routed.shard_loads())
            raise StorageUnavailable(
                f"could not record {len(job_rows)} jobs ({type(error).__name__}); nothing was "
                "enqueued, submit them again once the database is back") from error
        try:
            self._publish(routed)
        except Exception as error:
            self._store.forget_submitted(job_ids)
            self._shard_state.release(routed.shard_loads())
            raise BrokerUnavailable(
                f"could not enqueue {len(job_rows)} jobs ({type(error).__name__}: {error}); "
                "nothing was kept, submit them again") from error
        log.debug("submitted %d jobs", len(job_rows))
        return job_ids

    def requeue_stale(self, limit: int = 10_000) -> int:
        """Enqueue again every unfinished job whose message was lost with a restarted Redis
        (recorded under another Redis epoch); returns how many were requeued. Once a round
        has found them all, later rounds under the same epoch skip the database: a job is
        recorded before its message is sent, so every job whose message the restart lost
        was already recorded when the new epoch began."""
        lock = self._redis.lock(REQUEUE_LOCK_KEY, timeout=300, blocking=False)
        if not lock.acquire():
            return 0
        try:
            epoch = self._shard_state.epoch()
            if self._redis.get(RECONCILED_EPOCH_KEY) == epoch.encode():
                return 0
            stale = self._store.stale_jobs(epoch, limit)
            requeued = self._requeue(stale)
            if len(stale) < limit:
                self._redis.set(RECONCILED_EPOCH_KEY, epoch)
        finally:
            lock.release()
        return requeued

    def _requeue(self, stale: list[dict[str, Any]]) -> int:
        """Enqueue these lost jobs again, failing those whose documents do not read back;
        returns how many were enqueued."""
        unreadable = [row["job_id"] for row in stale if row["document"] is None]
        if unreadable:
            self._store.fail(unreadable, "its message was lost with a restarted Redis and "
                             "its document does not read back from the database, so it "
                             "cannot be enqueued again; submit it again")
            log.error("failed %d lost jobs whose documents do not read back", len(unreadable))
        stale = [row for row in stale if row["document"] is not None]
        if not stale:
            return 0
        requests = [JobRequest(row["document"], row["question"], row["sampling"])
                    for row in stale]
        routed = self._route(requests, [row["job_id"] for row in stale])
        # Enqueue first: if marking then fails, the next round enqueues these jobs again
        # (a harmless duplicate run); marking first could lose them.
        self._publish(routed)
        self._store.mark_requeued({job.job_id: shard for shard, job in routed.placed},
                                  routed.epoch)
        log.warning("requeued %d jobs whose messages were lost with an earlier Redis",
                    len(stale))
        return len(stale)

    def _route(self, requests: Sequence[JobRequest], job_ids: Sequence[str]) -> _Routed:
        """Tokenize (each document once), check lengths, pick shards and build the queue
        entries; nothing is written to the database here."""
        distinct = list(dict.fromkeys(request.document for request in requests))
        document_tokens = dict(zip(distinct, self._prompts.documents(distinct), strict=True))
        question_tokens = self._prompts.questions([request.question for request in requests])
        self._check_lengths(requests, document_tokens, question_tokens)
        keys = {text: document_keys(tokens, self.settings.block_size)
                for text, tokens in document_tokens.items()}
        epoch = self._shard_state.epoch()
        decode_cost = self.settings.routing_decode_cost
        routes = self._router.route([
            RoutingJob(keys[request.document], len(document_tokens[request.document]) + len(tokens),
                       decode_load(request.sampling["max_tokens"], decode_cost))
            for request, tokens in zip(requests, question_tokens, strict=True)])
        placed = [(route.shard, QueuedJob(job_id, keys[request.document].document_key, tokens,
                                          request.sampling, route.estimated_prefill, route.load))
                  for job_id, request, tokens, route
                  in zip(job_ids, requests, question_tokens, routes, strict=True)]
        return _Routed(
            placed=placed, epoch=epoch,
            document_tokens={keys[text].document_key: tokens
                             for text, tokens in document_tokens.items()},
            document_texts={keys[text].document_key: text for text in distinct})

    def _publish(self, routed: _Routed) -> None:
        """Call only once the jobs' documents are recorded: messages name documents by key
        and workers read them from the store."""
        publish(self._celery, form_batches(routed.placed, self.settings.batch_size))

    def get(self, job_id: str) -> JobRecord:
        record = self._store.get_many([job_id]).get(job_id)
        if record is None:
            raise JobNotFound(f"no job with ID {job_id!r}")
        return record

    def wait(self, job_ids: Sequence[str] | str, timeout: float | None = None,
             check_interval: float = 1.0) -> list[JobRecord]:
        """Block until every job has finished; return their records in the order given.
        Raises TimeoutError if `timeout` seconds pass first, JobNotFound for an unknown ID.
        The jobs are checked again once the database has announced as many finished jobs as
        are still unfinished, and at least every 10 s (or `check_interval` seconds, if
        longer); without announcements (on SQLite) every `check_interval` seconds, after
        pauses that start at 50 ms and grow to that."""
        ids = [job_ids] if isinstance(job_ids, str) else list(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        # Listen only for jobs not finished yet, then check again: no commit between the
        # first check and the listening goes unnoticed.
        pending = self.unfinished(ids)
        if pending:
            with self.finish_signal() as signal:
                while pending := self.unfinished(pending):
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(f"{len(pending)} of {len(ids)} jobs still "
                                           f"unfinished after {timeout} s (first: {pending[0]})")
                    interval = signal.check_interval(check_interval)
                    signal.wait(interval if deadline is None else
                                max(0.0, min(interval, deadline - time.monotonic())),
                                jobs=len(pending))
        records: dict[str, JobRecord] = {}
        for start in range(0, len(ids), _WAIT_CHUNK):
            records.update(self._store.get_many(ids[start:start + _WAIT_CHUNK]))
        return [records[job_id] for job_id in ids]

    def finish_signal(self) -> FinishSignal:
        """Listen for jobs finishing: open it before checking, then `wait` between checks,
        and no commit between the two goes unnoticed."""
        return self._store.finish_signal()

    def pending(self, job_ids: Sequence[str]) -> int:
        """How many of these jobs have not finished yet (for progress displays)."""
        ids = list(job_ids)
        return sum(self._store.count_unfinished(ids[start:start + _WAIT_CHUNK])
                   for start in range(0, len(ids), _WAIT_CHUNK))

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued or running job. Returns False if it had already finished."""
        cancelled = self._store.cancel(job_id)
        if cancelled:
            self._redis.publish(CANCEL_CHANNEL, job_id)
        return cancelled

    def unfinished(self, job_ids: Sequence[str]) -> list[str]:
        """The jobs among these that have not finished yet, in the order given (poll with the
        shrinking list, so each poll costs less than the last). Raises JobNotFound for an
        unknown ID."""
        ids = list(job_ids)
        return [job_id for start in range(0, len(ids), _WAIT_CHUNK)
                for job_id in self._unfinished_chunk(ids[start:start + _WAIT_CHUNK])]

    def _unfinished_chunk(self, job_ids: list[str]) -> list[str]:
        statuses = self._store.statuses(job_ids)
        missing = [job_id for job_id in job_ids if job_id not in statuses]
        if missing:
            raise JobNotFound(f"no job with ID {missing[0]!r}")
        return [job_id for job_id in job_ids if not statuses[job_id].finished]

    def _validate(self, index: int, job: Mapping[str, Any]) -> JobRequest:
        if not isinstance(job, Mapping):
            raise InvalidJob(f"job {index}: expected a mapping, got {type(job).__name__}")
        fields = dict(job)
        try:
            return validate_job(fields.pop("document", None), fields.pop("question", None),
                                fields, max_document_chars=self.settings.max_document_chars,
                                max_question_chars=self.settings.max_question_chars)
        except InvalidJob as error:
            raise InvalidJob(f"job {index}: {error}") from None

    def _check_lengths(self, requests: Sequence[JobRequest],
                       document_tokens: Mapping[str, list[int]],
                       question_tokens: Sequence[list[int]]) -> None:
        limit = self._prompts.context_length
        for index, (request, tokens) in enumerate(zip(requests, question_tokens, strict=True)):
            prompt = len(document_tokens[request.document]) + len(tokens)
            if prompt + request.max_tokens > limit:
                raise InvalidJob(
                    f"job {index}: prompt of {prompt} tokens plus max_tokens "
                    f"{request.max_tokens} exceeds the model's context of {limit} tokens; "
                    "shorten the document or lower max_tokens")
