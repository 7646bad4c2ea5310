"""The producer API: submit document-question jobs, poll their results, cancel them."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from jobsvc import compression
from jobsvc.console import ProgressBar
from jobsvc.errors import (
    BROKER_ERRORS,
    STORAGE_ERRORS,
    BrokerUnavailable,
    InvalidJob,
    JobNotFound,
    StorageUnavailable,
    translated,
)
from jobsvc.finish_signal import FinishSignal
from jobsvc.keys import CANCEL_CHANNEL
from jobsvc.messages import PlacedJob, form_messages
from jobsvc.prompts import PromptBuilder
from jobsvc.routing.job_cost import RoutingJob, decode_load, loads_per_shard
from jobsvc.routing.prefix import DocumentKeys, document_keys
from jobsvc.routing.router import make_router
from jobsvc.routing.state import ShardState
from jobsvc.settings import Settings
from jobsvc.store import MAX_IDEMPOTENCY_KEY_CHARS, JobRecord, Store, utcnow
from jobsvc.transport import make_celery, publish
from jobsvc.wire import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    JobLimits,
    JobRequest,
    JobStatus,
    text_fault,
    validate_job,
)

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class PreparedJob:
    """A job ready to record: its prompt as a shared prefix (a document, or the part of a
    rendered request that other requests share), stored once however many jobs run on it,
    and the job's own suffix, both already tokenized; the engine runs prefix + suffix.
    `question` is kept in the job's record as what it asked (the suffix's text for requests
    of a batch file). `idempotency_key`: see `Client.submit_many`."""

    prefix: str
    prefix_tokens: Sequence[int]
    question: str
    suffix_tokens: Sequence[int]
    sampling: dict[str, Any]
    idempotency_key: str | None = None

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt's length, what the engine must fit in its context."""
        return len(self.prefix_tokens) + len(self.suffix_tokens)


@dataclass(frozen=True)
class _Routed:
    """Jobs with their shards, what each charged its shard, and their prefixes' keys."""

    placed: list[PlacedJob]
    loads: list[int]
    estimated_prefills: list[int]

    def charges(self, job_ids: set[str] | None = None) -> dict[int, int]:
        """What these jobs (or those of them named) charged each shard."""
        return loads_per_shard((job.shard, load) for job, load in zip(
            self.placed, self.loads, strict=True) if job_ids is None or job.job_id in job_ids)


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
        self._shard_state = ShardState(self._redis)
        self._router = make_router(self._redis, self._shard_state, self.settings)
        self._prompts = PromptBuilder(self.settings.model, self.settings.max_model_len)
        self._celery = make_celery(self.settings)
        self._limits = JobLimits(self.settings.max_document_chars,
                                 self.settings.max_question_chars, self.settings.max_stop_chars,
                                 self.settings.max_job_bytes)

    def close(self) -> None:
        """Let go of the database pool and the Redis connection."""
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
        and enqueued in one Redis pipeline. Returns the job IDs in input order.

        A job may carry an `idempotency_key` (a string of at most `MAX_IDEMPOTENCY_KEY_CHARS`
        characters): a submit of a key already recorded returns that job's ID and records
        nothing new, so a producer that retries after a timeout or a crash never makes a second
        job."""
        requests: list[JobRequest] = []
        keys: list[str | None] = []
        for index, job in enumerate(jobs):
            request, key = self._validate(index, job)
            requests.append(request)
            keys.append(key)
        if not requests:
            return []
        distinct = list(dict.fromkeys(request.document for request in requests))
        document_tokens = dict(zip(distinct, self._prompts.documents(distinct), strict=True))
        question_tokens = self._prompts.questions([request.question for request in requests])
        return self.submit_prepared([
            PreparedJob(request.document, document_tokens[request.document], request.question,
                        tokens, request.sampling, key)
            for request, tokens, key in zip(requests, question_tokens, keys, strict=True)])

    def submit_prepared(self, jobs: Sequence[PreparedJob]) -> list[str]:
        """Submit jobs whose prompts are already tokenized (what `submit_many` and the batch
        server's ingestion both end in): check lengths, route each by its prefix's block
        hashes, record prefixes once and jobs in one transaction, enqueue in one pipeline.
        Sampling must already be validated. Returns the job IDs in input order; a job whose
        idempotency key is recorded already gets that job's ID."""
        self._check_lengths(jobs)
        with translated(f"look up the idempotency keys of {len(jobs)} jobs"):
            recorded = self._store.jobs_by_key(
                [job.idempotency_key for job in jobs if job.idempotency_key is not None])
        job_ids: list[str] = []
        new: list[PreparedJob] = []
        new_ids: list[str] = []
        for job in jobs:
            key = job.idempotency_key
            if key is not None and key in recorded:
                job_ids.append(recorded[key])
                continue
            job_id = uuid.uuid4().hex
            if key is not None:
                recorded[key] = job_id
            new.append(job)
            new_ids.append(job_id)
            job_ids.append(job_id)
        if new:
            taken = self._record_and_enqueue(new, new_ids)
            job_ids = [taken.get(job_id, job_id) for job_id in job_ids]
        return job_ids

    def _record_and_enqueue(self, jobs: Sequence[PreparedJob], job_ids: Sequence[str]
                            ) -> dict[str, str]:
        """Route, record and enqueue new jobs. Returns, for jobs whose idempotency key a
        concurrent submit recorded first, the ID of that submit's job: they are neither
        recorded nor enqueued, and what routing charged for them is returned."""
        with translated(f"route {len(jobs)} jobs; nothing was recorded or enqueued"):
            routed, prefix_keys = self._route(jobs, job_ids)
        messages = form_messages(routed.placed, self.settings.batch_size)
        message_of = {job_id: message.message_id for message in messages
                      for job_id in message.job_ids}
        now = utcnow()
        # Workers read everything a job runs from here: queue messages only name jobs.
        document_rows = [{"key": key, "text_zst": compression.compress(job.prefix.encode()),
                          "tokens_zst": compression.pack_tokens(job.prefix_tokens),
                          "tokens": len(job.prefix_tokens), "created_at": now}
                         for key, job in prefix_keys.items()]
        job_rows = [{
            "id": placed.job_id, "document_key": placed.document_key, "question": job.question,
            "question_tokens_zst": compression.pack_tokens(job.suffix_tokens),
            "sampling": job.sampling, "shard": placed.shard,
            "status": JobStatus.QUEUED.value, "prompt_tokens": job.prompt_tokens,
            "estimated_prefill": prefill, "load": load,
            "message_id": message_of[placed.job_id], "submitted_at": now, "enqueued_at": now,
            "idempotency_key": job.idempotency_key,
        } for job, placed, prefill, load in zip(
            jobs, routed.placed, routed.estimated_prefills, routed.loads, strict=True)]
        try:
            taken = self._store.record_submitted(document_rows, job_rows)
        except STORAGE_ERRORS as error:
            self._return_charges(routed.charges())
            raise StorageUnavailable(
                f"could not record {len(job_rows)} jobs ({type(error).__name__}); nothing was "
                "enqueued, submit them again once the database is back") from error
        if taken:
            self._return_charges(routed.charges(set(taken)))
            messages = [replace(message, job_ids=kept) for message in messages
                        if (kept := [job_id for job_id in message.job_ids
                                     if job_id not in taken])]
        try:
            publish(self._celery, messages)
        except Exception as error:
            recorded = [row["id"] for row in job_rows if row["id"] not in taken]
            with translated(f"withdraw {len(recorded)} jobs after Redis refused them"):
                self._store.forget_submitted(recorded)
            self._return_charges(routed.charges(set(recorded)))
            raise BrokerUnavailable(
                f"could not enqueue {len(recorded)} jobs ({type(error).__name__}: {error}); "
                "nothing was kept, submit them again") from error
        log.debug("submitted %d jobs", len(job_rows) - len(taken))
        return taken

    def _return_charges(self, charges: dict[int, int]) -> None:
        """Give back what a submit charged for jobs it did not keep; if Redis is gone too,
        the reconciler returns it later."""
        try:
            self._shard_state.release(charges)
        except BROKER_ERRORS as error:
            log.warning("could not return the load of an abandoned submit: %s", error)

    def _route(self, jobs: Sequence[PreparedJob], job_ids: Sequence[str]
               ) -> tuple[_Routed, dict[str, PreparedJob]]:
        """Hash each distinct prefix once and pick shards, charging them; nothing is written
        to the database here. Also returns one job per distinct prefix key."""
        # Jobs on one prefix share its token list: hashed once per list, not per job.
        keys: dict[int, DocumentKeys] = {}
        for job in jobs:
            if id(job.prefix_tokens) not in keys:
                keys[id(job.prefix_tokens)] = document_keys(job.prefix_tokens,
                                                            self.settings.block_size)
        prefix_keys = [keys[id(job.prefix_tokens)] for job in jobs]
        decode_cost = self.settings.routing_decode_cost
        routes = self._router.route([
            RoutingJob(prefix, job.prompt_tokens,
                       decode_load(job.sampling["max_tokens"], decode_cost))
            for job, prefix in zip(jobs, prefix_keys, strict=True)])
        return _Routed(
            placed=[PlacedJob(job_id, route.shard, prefix.document_key) for job_id, prefix, route
                    in zip(job_ids, prefix_keys, routes, strict=True)],
            loads=[route.load for route in routes],
            estimated_prefills=[route.estimated_prefill for route in routes],
        ), {prefix.document_key: job for job, prefix in zip(jobs, prefix_keys, strict=True)}

    def get(self, job_id: str) -> JobRecord:
        """The job `job_id` as the store holds it; JobNotFound if there is none."""
        with translated(f"read job {job_id}"):
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
        with (translated(f"wait for {len(ids)} jobs"),
              ProgressBar(len(ids), "finished") if progress else nullcontext() as bar):
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
        with translated(f"count unfinished jobs among {len(ids)}"):
            return sum(self._store.count_unfinished(ids[start:start + _WAIT_CHUNK])
                       for start in range(0, len(ids), _WAIT_CHUNK))

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued or running job. Returns False if it had already finished."""
        with translated(f"cancel job {job_id}"):
            released = self._store.cancel(job_id)
            if released is None:
                return False
            self._announce_cancelled([job_id], released)
        return True

    def cancel_many(self, job_ids: Sequence[str]) -> list[str]:
        """Cancel those of these jobs that have not finished, in one transaction; returns the
        IDs of those it cancelled."""
        with translated(f"cancel {len(job_ids)} jobs"):
            cancelled = self._store.cancel_many(job_ids)
            if cancelled.job_ids:
                self._announce_cancelled(cancelled.job_ids, cancelled.released)
        return cancelled.job_ids

    def _announce_cancelled(self, job_ids: Sequence[str], released: dict[int, int]) -> None:
        """Return cancelled jobs' load; a worker running one aborts it, one that has it
        queued skips it."""
        self._shard_state.release(released)
        with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.publish(CANCEL_CHANNEL, job_id)
            pipe.execute()

    def unfinished(self, job_ids: Sequence[str]) -> list[str]:
        """The jobs among these that have not finished yet, in the order given (poll with the
        shrinking list, so each poll costs less than the last). Raises JobNotFound for an
        unknown ID."""
        ids = list(job_ids)
        with translated(f"check {len(ids)} jobs"):
            return [job_id for start in range(0, len(ids), _WAIT_CHUNK)
                    for job_id in self._unfinished_chunk(ids[start:start + _WAIT_CHUNK])]

    def _unfinished_chunk(self, job_ids: list[str]) -> list[str]:
        statuses = self._store.statuses(job_ids)
        missing = [job_id for job_id in job_ids if job_id not in statuses]
        if missing:
            raise JobNotFound(f"no job with ID {missing[0]!r}")
        return [job_id for job_id in job_ids if not statuses[job_id].finished]

    def _validate(self, index: int, job: Mapping[str, Any]) -> tuple[JobRequest, str | None]:
        if not isinstance(job, Mapping):
            raise InvalidJob(f"job {index}: expected a mapping, got {type(job).__name__}")
        fields = dict(job)
        key = fields.pop("idempotency_key", None)
        if key is not None and not (isinstance(key, str)
                                    and 0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS):
            raise InvalidJob(f"job {index}: idempotency_key must be a string of 1 to "
                             f"{MAX_IDEMPOTENCY_KEY_CHARS} characters")
        if key is not None and (fault := text_fault(key)):
            raise InvalidJob(f"job {index}: idempotency_key contains {fault}; remove it")
        try:
            return validate_job(fields.pop("document", None), fields.pop("question", None),
                                fields, self._limits), key
        except InvalidJob as error:
            raise InvalidJob(f"job {index}: {error}") from None

    def _check_lengths(self, jobs: Sequence[PreparedJob]) -> None:
        limit = self._prompts.context_length
        for index, job in enumerate(jobs):
            max_tokens = job.sampling["max_tokens"]
            if job.prompt_tokens + max_tokens > limit:
                raise InvalidJob(
                    f"job {index}: prompt of {job.prompt_tokens} tokens plus max_tokens "
                    f"{max_tokens} exceeds the model's context of {limit} tokens; "
                    "shorten the document or lower max_tokens")
