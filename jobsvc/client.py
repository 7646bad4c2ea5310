"""The producer API: submit document-question jobs, poll their results, cancel them."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from jobsvc.console import ProgressBar
from jobsvc.dispatch import Dispatcher, PreparedJob
from jobsvc.embeddings import embedding_sampling, input_lengths, is_embedding, split_inputs
from jobsvc.errors import (
    InvalidJob,
    JobNotFound,
    translated,
)
from jobsvc.finish_signal import FinishSignal
from jobsvc.keys import CANCEL_CHANNEL
from jobsvc.routing.ledger import LoadLedger
from jobsvc.served_models import EMBED, GENERATE, FleetModels, ServedModel
from jobsvc.settings import Settings
from jobsvc.store import JobRecord, Store
from jobsvc.transport import make_celery
from jobsvc.validation import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    JobRequest,
    check_dimensions,
    check_embedding_prompt,
    check_prompt,
    embedding_inputs,
    validate_job,
)

log = logging.getLogger(__name__)

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
        self._ledger = LoadLedger(self._redis)
        self._models = FleetModels(self._redis, self.settings)
        self._celery = make_celery(self.settings)
        self._dispatcher = Dispatcher(self.settings, self._redis, self._store, self._celery,
                                      self._ledger)
        self._limits = self.settings.job_limits

    @property
    def models(self) -> FleetModels:
        """The models the fleet serves, as this producer last read them."""
        return self._models

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

        A job may carry an `idempotency_key` (a string of at most 128 characters,
        `jobsvc.validation.MAX_IDEMPOTENCY_KEY_CHARS`): a submit of a key already recorded
        returns that job's ID and records nothing new, so a producer that retries after a
        timeout or a crash never makes a second job."""
        requests: list[JobRequest] = []
        models: dict[str, ServedModel] = {}
        for index, job in enumerate(jobs):
            with _naming_job(index):
                request = validate_job(job, self._limits)
                model = self._models.resolve(request.model, GENERATE)
            requests.append(request)
            models[model.name] = model
        if not requests:
            return []
        prepared: dict[int, PreparedJob] = {}
        for name, model in models.items():
            # Each model's jobs tokenized by its own tokenizer, each distinct document once.
            positions = [index for index, request in enumerate(requests)
                         if (request.model or self.settings.served_model_name) == name]
            prompts = FleetModels.prompts(model)
            distinct = list(dict.fromkeys(requests[index].document for index in positions))
            documents = dict(zip(distinct, prompts.documents(distinct), strict=True))
            questions = prompts.questions([requests[index].question for index in positions])
            for index, tokens in zip(positions, questions, strict=True):
                request = requests[index]
                prepared[index] = PreparedJob(
                    request.document, documents[request.document], request.question, tokens,
                    request.sampling, request.idempotency_key, model=name)
        return self.submit_prepared([prepared[index] for index in range(len(requests))])

    def submit_prepared(self, jobs: Sequence[PreparedJob]) -> list[str]:
        """Submit jobs whose prompts are already tokenized (what `submit_many` and the batch
        server's ingestion both end in): check each prompt against the model, route each by
        its prefix's block hashes, record prefixes once and jobs in one transaction, enqueue in
        one pipeline. Sampling must already be validated. Returns the job IDs in input order;
        a job whose idempotency key is recorded already gets that job's ID."""
        self._check_prompts(jobs)
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
            taken = self._dispatcher.submit(new, new_ids)
            job_ids = [taken.get(job_id, job_id) for job_id in job_ids]
        return job_ids

    def submit_embeddings(self, inputs: Sequence[str], *, dimensions: int | None = None,
                          model: str | None = None) -> list[str]:
        """Submit one embedding job per text (tokenized as vLLM's embeddings endpoint does,
        with the model's leading special tokens) and return their IDs in input order; each
        job's vectors come back as `get(job_id).embeddings`, one vector. `dimensions` cuts the
        vectors of a Matryoshka model; `model` names an embedding model the fleet serves
        (None: JOBSVC_SERVED_MODEL_NAME). All are checked before any is recorded."""
        texts = [] if isinstance(inputs, str) else list(inputs)
        if isinstance(inputs, str) or not all(isinstance(text, str) for text in texts):
            raise InvalidJob("inputs must be a sequence of texts", "inputs")
        jobs = []
        for index, text in enumerate(texts):
            field = f"inputs[{index}]"
            one = embedding_inputs(text, self._limits.max_document_chars, field=field)
            jobs.append(self.prepare_embedding(one, dimensions=dimensions, model=model,
                                               field=field))
        return self.submit_prepared(jobs) if jobs else []

    def prepare_embedding(self, inputs: Sequence[str | Sequence[int]], *,
                          dimensions: int | None = None, encoding_format: str = "float",
                          model: str | None = None, idempotency_key: str | None = None,
                          field: str = "input") -> PreparedJob:
        """One embedding job of these inputs (as `validation.embedding_inputs` gives them:
        texts, tokenized here with the model's leading special tokens, or token IDs taken as
        they are), each checked against the model, for `submit_prepared`. InvalidJob names
        `field` (or `field[index]`), `dimensions` or `model`."""
        served = self._models.resolve(model, EMBED)
        prompts = FleetModels.prompts(served)
        if dimensions is not None:
            check_dimensions(dimensions, prompts.matryoshka)
        encoded = iter(prompts.encode([item for item in inputs if isinstance(item, str)],
                                      special=True))
        tokens = [next(encoded) if isinstance(item, str) else list(item) for item in inputs]
        check_embedding_prompt(tokens, prompts.context_length, prompts.vocabulary_size,
                               field=field)
        # The document's text is what the job asked: its one text, else its inputs as JSON.
        text = inputs[0] if len(inputs) == 1 and isinstance(inputs[0], str) else json.dumps(
            [item if isinstance(item, str) else list(item) for item in inputs])
        return PreparedJob(text, [token for ids in tokens for token in ids], "", (),
                           embedding_sampling([len(ids) for ids in tokens], dimensions,
                                              encoding_format),
                           idempotency_key, model=served.name)

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
        self._ledger.release(released)
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

    def _check_prompts(self, jobs: Sequence[PreparedJob]) -> None:
        """Each job's model is served by the fleet and answers the job's task, and its prompt
        fits that model."""
        for index, job in enumerate(jobs):
            with _naming_job(index):
                embedding = is_embedding(job.sampling)
                prompts = FleetModels.prompts(
                    self._models.resolve(job.model, EMBED if embedding else GENERATE))
                if not embedding:
                    check_prompt(job.prompt_tokens, job.sampling, prompts.context_length,
                                 prompts.vocabulary_size, prompt_field="document")
                    continue
                try:
                    inputs = split_inputs(job.prefix_tokens, input_lengths(job.sampling))
                except ValueError as error:
                    raise InvalidJob(str(error), "sampling") from None
                check_embedding_prompt(inputs, prompts.context_length, prompts.vocabulary_size)


@contextmanager
def _naming_job(index: int) -> Iterator[None]:
    """Say which job of a call an InvalidJob is about (`job 3: ...`)."""
    try:
        yield
    except InvalidJob as error:
        raise type(error)(f"job {index}: {error}", error.field) from None
