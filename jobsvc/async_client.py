"""The producer API for asyncio applications: `Client`'s methods, awaited.

Each call runs the one `Client`'s own blocking method on a thread pool of this client's, so
validation, routing, recording and waiting exist once, in `Client`, and a long `wait` never
holds a thread of the event loop's default executor, which the application's other blocking
work shares."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from jobsvc.client import Client
from jobsvc.dispatch import PreparedJob
from jobsvc.finish_signal import NOTIFIED_CHECK_SECONDS
from jobsvc.settings import Settings
from jobsvc.store import JobRecord
from jobsvc.validation import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE

P = ParamSpec("P")
T = TypeVar("T")

# Enough for a web application's concurrent requests, each with a submit or a wait under way;
# a wait holds its thread for as long as it waits.
DEFAULT_MAX_THREADS = 16


class AsyncClient:
    """A producer's handle on the service for coroutines: every method that touches Redis or
    the database is awaited. Safe to share between the tasks of one event loop.

    Each call takes a thread of this client's pool (`max_threads`) for as long as it runs:
    calls beyond that number queue until a thread is free, so size the pool above the number
    of waits you expect at once. Cancelling a task that awaits a call returns control to it at
    once, but a thread cannot be interrupted: a cancelled submit or cancel still completes
    (retry a submit with an `idempotency_key` to be sure of one job), and a cancelled `wait`
    frees its thread within `wait_slice` seconds. `close` (or leaving `async with`) returns
    once every running call has."""

    def __init__(self, redis_url: str | None = None, database_url: str | None = None, *,
                 settings: Settings | None = None, max_threads: int = DEFAULT_MAX_THREADS,
                 wait_slice: float = NOTIFIED_CHECK_SECONDS) -> None:
        """`redis_url`, `database_url` and `settings` as for `Client`. `wait_slice`: the
        longest a cancelled `wait` keeps its thread; each slice costs the wait one more
        check and listening connection, so the default adds about none to the checks a
        listening wait makes anyway."""
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, not {max_threads}")
        if wait_slice <= 0:
            raise ValueError(f"wait_slice must be positive, not {wait_slice}")
        self._client = Client(redis_url, database_url, settings=settings)
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="jobsvc-async-client")
        self._wait_slice = wait_slice

    @property
    def settings(self) -> Settings:
        """The settings the wrapped `Client` runs with."""
        return self._client.settings

    async def close(self) -> None:
        """Let go of the pool (once its running calls return), then of the database pool and
        the Redis connection. Calls still queued for a thread are dropped."""
        await asyncio.to_thread(self._shut_down)

    def _shut_down(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def _run(self, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`call` on a thread of the pool. The caller's context variables go with it, as
        `asyncio.to_thread` carries them, so a request's logging or tracing context holds."""
        context = contextvars.copy_context()
        bound = functools.partial(context.run, call, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, bound)

    async def submit(self, document: str, question: str, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                     temperature: float = DEFAULT_TEMPERATURE, **sampling: Any) -> str:
        """`Client.submit`: submit one job and return its ID."""
        return await self._run(self._client.submit, document, question, max_tokens=max_tokens,
                               temperature=temperature, **sampling)

    async def submit_many(self, jobs: Iterable[Mapping[str, Any]]) -> list[str]:
        """`Client.submit_many`: validate all, record them in one transaction, enqueue them in
        one pipeline; the IDs in input order. `jobs` is read on the pool's thread."""
        return await self._run(self._client.submit_many, jobs)

    async def submit_prepared(self, jobs: Sequence[PreparedJob]) -> list[str]:
        """`Client.submit_prepared`: submit jobs whose prompts are already tokenized."""
        return await self._run(self._client.submit_prepared, jobs)

    async def submit_embeddings(self, inputs: Sequence[str], *, dimensions: int | None = None,
                                model: str | None = None) -> list[str]:
        """`Client.submit_embeddings`: one embedding job per text; their IDs in input order."""
        return await self._run(self._client.submit_embeddings, inputs, dimensions=dimensions,
                               model=model)

    async def prepare_embedding(self, inputs: Sequence[str | Sequence[int]], *,
                                dimensions: int | None = None, encoding_format: str = "float",
                                model: str | None = None, idempotency_key: str | None = None,
                                field: str = "input") -> PreparedJob:
        """`Client.prepare_embedding`, awaited: it reads the fleet's models from Redis and
        tokenizes, neither of which belongs on the event loop."""
        return await self._run(self._client.prepare_embedding, inputs, dimensions=dimensions,
                               encoding_format=encoding_format, model=model,
                               idempotency_key=idempotency_key, field=field)

    async def get(self, job_id: str) -> JobRecord:
        """`Client.get`: the job as the store holds it; JobNotFound if there is none."""
        return await self._run(self._client.get, job_id)

    async def wait(self, job_ids: Sequence[str] | str, timeout: float | None = None,
                   check_interval: float = 1.0) -> list[JobRecord]:
        """`Client.wait`, woken by the same notifications: the records once every job has
        finished, in the order given; TimeoutError after `timeout` seconds, JobNotFound for
        an unknown ID. It waits in slices of `wait_slice` seconds, so that a cancelled wait
        lets go of its thread after the slice under way. No progress bar: that belongs to a
        terminal, and `pending` gives a count to show instead."""
        ids = [job_ids] if isinstance(job_ids, str) else list(job_ids)
        stop = threading.Event()
        try:
            return await self._run(self._wait_in_slices, ids, timeout, check_interval, stop)
        finally:
            stop.set()

    def _wait_in_slices(self, ids: list[str], timeout: float | None, check_interval: float,
                        stop: threading.Event) -> list[JobRecord]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            last = left is not None and left <= self._wait_slice
            try:
                return self._client.wait(ids, left if last else self._wait_slice,
                                         check_interval)
            except TimeoutError as error:
                if last:
                    raise TimeoutError(f"{error}, the end of a {timeout} s wait") from None
                if stop.is_set():
                    raise

    async def pending(self, job_ids: Sequence[str]) -> int:
        """`Client.pending`: how many of these jobs have not finished yet."""
        return await self._run(self._client.pending, job_ids)

    async def unfinished(self, job_ids: Sequence[str]) -> list[str]:
        """`Client.unfinished`: the jobs among these not finished yet, in the order given."""
        return await self._run(self._client.unfinished, job_ids)

    async def cancel(self, job_id: str) -> bool:
        """`Client.cancel`: cancel a queued or running job; False if it had finished."""
        return await self._run(self._client.cancel, job_id)

    async def cancel_many(self, job_ids: Sequence[str]) -> list[str]:
        """`Client.cancel_many`: cancel those not finished, in one transaction; their IDs."""
        return await self._run(self._client.cancel_many, job_ids)
