"""The producer API: submit document-question jobs, poll their results, cancel them."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import kombu.exceptions
import psycopg
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from sqlalchemy.exc import SQLAlchemyError

from jobsvc import compression
from jobsvc.batching import PlacedJob, form_batches
from jobsvc.console import ProgressBar
from jobsvc.errors import BrokerUnavailable, InvalidJob, JobNotFound, StorageUnavailable
from jobsvc.finish_signal import FinishSignal
from jobsvc.keys import CANCEL_CHANNEL
from jobsvc.prompts import PromptBuilder
from jobsvc.routing.cost import RoutingJob, decode_load, loads_per_shard
from jobsvc.routing.prefix import document_keys
from jobsvc.routing.router import make_router
from jobsvc.routing.state import ShardState
from jobsvc.schema import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    JobLimits,
    JobRequest,
    JobStatus,
    validate_job,
)
from jobsvc.settings import Settings
from jobsvc.store import JobRecord, Store, utcnow
from jobsvc.transport import make_celery, publish

log = logging.getLogger(__name__)

# What a lost connection to the database or the broker raises, below jobsvc's own errors.
_STORAGE_ERRORS = (SQLAlchemyError, psycopg.Error)
_BROKER_ERRORS = (redis.RedisError, kombu.exceptions.KombuError, ConnectionError)


@contextmanager
def _translated(what: str) -> Iterator[None]:
    """Raise an outage as StorageUnavailable / BrokerUnavailable, never as a driver's own
    exception, so callers handle one documented error per service."""
    try:
        yield
    except _STORAGE_ERRORS as error:
        raise StorageUnavailable(f"could not {what}: the database is unavailable "
                                 f"({type(error).__name__}); try again later") from error
    except _BROKER_ERRORS as error:
        raise BrokerUnavailable(f"could not {what}: Redis is unavailable "
                                f"({type(error).__name__}); try again later") from error


@dataclass(frozen=True)
class _Routed:
    """Jobs with their shards, what each charged its shard, and their tokens."""

    placed: list[PlacedJob]
    loads: list[int]
    estimated_prefills: list[int]
    question_tokens: list[list[int]]
    document_tokens: dict[str, list[int]]
    document_texts: dict[str, str]

    def charges(self) -> dict[int, int]:
        """What these jobs charged each shard."""
        return loads_per_shard(zip((job.shard for job in self.placed), self.loads, strict=True))


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
        self._limits = JobLimits(self.settings.max_document_chars,
                                 self.settings.max_question_chars, self.settings.max_stop_chars,
                                 self.settings.max_job_bytes)

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
        with _translated(f"route {len(requests)} jobs; nothing was recorded or enqueued"):
            routed = self._route(requests, job_ids)
        messages = form_batches(routed.placed, self.settings.batch_size)
        message_of = {job_id: message.message_id for message in messages
                      for job_id in message.job_ids}
        now = utcnow()
        # Workers read everything a job runs from here: queue messages only name jobs.
        document_rows = [{"key": key, "text_zst": compression.compress(text.encode()),
                          "tokens_zst": compression.pack_tokens(routed.document_tokens[key]),
                          "tokens": len(routed.document_tokens[key]), "created_at": now}
                         for key, text in routed.document_texts.items()]
        job_rows = [{
            "id": job.job_id, "document_key": job.document_key, "question": request.question,
            "question_tokens_zst": compression.pack_tokens(question_tokens),
            "sampling": request.sampling, "shard": job.shard, "status": JobStatus.QUEUED.value,
            "prompt_tokens": len(routed.document_tokens[job.document_key])
            + len(question_tokens),
            "estimated_prefill": prefill, "load": load, "message_id": message_of[job.job_id],
            "submitted_at": now, "enqueued_at": now,
        } for request, job, question_tokens, prefill, load in zip(
            requests, routed.placed, routed.question_tokens, routed.estimated_prefills,
            routed.loads, strict=True)]
        try:
            self._store.record_submitted(document_rows, job_rows)
        except _STORAGE_ERRORS as error:
            self._return_charges(routed)
            raise StorageUnavailable(
                f"could not record {len(job_rows)} jobs ({type(error).__name__}); nothing was "
                "enqueued, submit them again once the database is back") from error
        try:
            publish(self._celery, messages)
        except Exception as error:
            with _translated(f"withdraw {len(job_rows)} jobs after Redis refused them"):
                self._store.forget_submitted(job_ids)
            self._return_charges(routed)
            raise BrokerUnavailable(
                f"could not enqueue {len(job_rows)} jobs ({type(error).__name__}: {error}); "
                "nothing was kept, submit them again") from error
        log.debug("submitted %d jobs", len(job_rows))
        return job_ids

    def _return_charges(self, routed: _Routed) -> None:
        """Give back what a submit that kept nothing charged; if Redis is gone too, the
        reconciler returns it later."""
        try:
            self._shard_state.release(routed.charges())
        except _BROKER_ERRORS as error:
            log.warning("could not return the load of an abandoned submit: %s", error)

    def _route(self, requests: Sequence[JobRequest], job_ids: Sequence[str]) -> _Routed:
        """Tokenize (each document once), check lengths and pick shards, charging them;
        nothing is written to the database here."""
        distinct = list(dict.fromkeys(request.document for request in requests))
        document_tokens = dict(zip(distinct, self._prompts.documents(distinct), strict=True))
        question_tokens = self._prompts.questions([request.question for request in requests])
        self._check_lengths(requests, document_tokens, question_tokens)
        keys = {text: document_keys(tokens, self.settings.block_size)
                for text, tokens in document_tokens.items()}
        decode_cost = self.settings.routing_decode_cost
        routes = self._router.route([
            RoutingJob(keys[request.document], len(document_tokens[request.document]) + len(tokens),
                       decode_load(request.sampling["max_tokens"], decode_cost))
            for request, tokens in zip(requests, question_tokens, strict=True)])
        return _Routed(
            placed=[PlacedJob(job_id, route.shard, keys[request.document].document_key)
                    for job_id, request, route in zip(job_ids, requests, routes, strict=True)],
            loads=[route.load for route in routes],
            estimated_prefills=[route.estimated_prefill for route in routes],
            question_tokens=question_tokens,
            document_tokens={keys[text].document_key: tokens
                             for text, tokens in document_tokens.items()},
            document_texts={keys[text].document_key: text for text in distinct})

    def get(self, job_id: str) -> JobRecord:
        with _translated(f"read job {job_id}"):
            record = self._store.get_many([job_id]).get(job_id)
        if record is None:
            raise JobNotFound(f"no job with ID {job_id!r}")
        return record

    def wait(self, job_ids: Sequence[str] | str, timeout: float | None = None,
             check_interval: float = 1.0, *, progress: bool = False) -> list[JobRecord]:
        """Block until every job has finished; return their records in the order given.
        Raises TimeoutError if `timeout` seconds pass first, JobNotFound for an unknown ID.
        The jobs are checked again once the database has announced as many finished jobs as
        are still unfinished, and at least every 10 s (or `check_interval` seconds, if
        longer); without announcements (on SQLite) every `check_interval` seconds, after
        pauses that start at 50 ms and grow to that. With `progress`, a tqdm bar on standard
        error counts the jobs finished, moved on by each notification as it arrives (a plain
        line now and then where standard error is no terminal)."""
        ids = [job_ids] if isinstance(job_ids, str) else list(job_ids)
        with _translated(f"wait for {len(ids)} jobs"), ExitStack() as stack:
            bar = stack.enter_context(ProgressBar(len(ids), "finished")) if progress else None
            return self._wait(ids, timeout, check_interval, bar)

    def _wait(self, ids: list[str], timeout: float | None, check_interval: float,
              bar: ProgressBar | None) -> list[JobRecord]:
        deadline = None if timeout is None else time.monotonic() + timeout
        # Listen only for jobs not finished yet, then check again: no commit between the
        # first check and the listening goes unnoticed.
        pending = self.unfinished(ids)
        if pending:
            with self.finish_signal() as signal:
                while pending := self.unfinished(pending):
                    if bar is not None:
                        bar.reach(len(ids) - len(pending))
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(f"{len(pending)} of {len(ids)} jobs still "
                                           f"unfinished after {timeout} s (first: {pending[0]})")
                    interval = signal.check_interval(check_interval)
                    signal.wait(interval if deadline is None else
                                max(0.0, min(interval, deadline - time.monotonic())),
                                jobs=len(pending),
                                announced=None if bar is None else bar.advance)
        if bar is not None:
            bar.reach(len(ids))
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
        with _translated(f"count unfinished jobs among {len(ids)}"):
            return sum(self._store.count_unfinished(ids[start:start + _WAIT_CHUNK])
                       for start in range(0, len(ids), _WAIT_CHUNK))

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued or running job. Returns False if it had already finished."""
        with _translated(f"cancel job {job_id}"):
            released = self._store.cancel(job_id)
            if released is None:
                return False
            self._shard_state.release(released)
            # A worker running the job aborts it; one that has it queued skips it.
            self._redis.publish(CANCEL_CHANNEL, job_id)
        return True

    def unfinished(self, job_ids: Sequence[str]) -> list[str]:
        """The jobs among these that have not finished yet, in the order given (poll with the
        shrinking list, so each poll costs less than the last). Raises JobNotFound for an
        unknown ID."""
        ids = list(job_ids)
        with _translated(f"check {len(ids)} jobs"):
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
                                fields, self._limits)
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
