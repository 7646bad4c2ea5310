"""The benchmark's baseline: vLLM driven directly, tuned as a careful user would tune it —
prefix caching on, gc.freeze() after start-up, the same engines and document-to-engine
assignment as the service, each distinct document tokenized once with the fast tokenizer
(inside the timed region), and token prompts handed to the engine in one of two admission
styles (all at once, or staggered with a bound on requests in flight)."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jobsvc.prompts import PromptBuilder
from jobsvc.settings import Settings
from workers.bootstrap import bind_device
from workers.engine import EngineAdapter, engine_args

ADMISSION_MODES = ("all", "staggered")


@dataclass(frozen=True)
class StandaloneRun:
    seconds: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int


class StandaloneEngines:
    """One AsyncLLM per shard in this process, each bound to its own cores."""

    def __init__(self, settings: Settings, devices: Sequence[str | None]) -> None:
        self._engines: list[EngineAdapter] = []
        for device in devices:
            bind_device(settings, device)
            adapter = EngineAdapter(engine_args(settings))
            adapter.start()
            self._engines.append(adapter)
        self._prompts = PromptBuilder(settings.model, settings.max_model_len)
        self._prompts.questions(["warm up the tokenizer"])
        gc.collect()
        gc.freeze()
        self._runs = 0

    def shutdown(self) -> None:
        for adapter in self._engines:
            adapter.shutdown()

    def run(self, jobs_by_engine: Sequence[Sequence[tuple[str, str]]],
            sampling: dict[str, Any], mode: str, in_flight: int) -> StandaloneRun:
        """Run one burst of (document, question) jobs on every engine at once, each engine
        from a cold prefix cache."""
        if mode not in ADMISSION_MODES:
            raise ValueError(f"admission mode must be one of {ADMISSION_MODES}")
        for adapter in self._engines:
            adapter.reset_prefix_cache()
        self._runs += 1
        started = time.perf_counter()
        prompts_by_engine = [self._tokenize(jobs) for jobs in jobs_by_engine]
        futures = [adapter.schedule(
                       lambda engine, prompts=prompts, tag=f"sa{self._runs}-{index}": _burst(
                           engine, prompts, sampling, mode, in_flight, tag))
                   for index, (adapter, prompts) in enumerate(
                       zip(self._engines, prompts_by_engine, strict=True))]
        outputs = [output for future in futures for output in future.result()]
        seconds = time.perf_counter() - started
        return StandaloneRun(
            seconds=seconds,
            output_tokens=sum(len(output.outputs[0].token_ids) for output in outputs),
            prompt_tokens=sum(len(output.prompt_token_ids or ()) for output in outputs),
            cached_tokens=sum(output.num_cached_tokens or 0 for output in outputs))


    def _tokenize(self, jobs: Sequence[tuple[str, str]]) -> list[list[int]]:
        distinct = list(dict.fromkeys(document for document, _ in jobs))
        documents = dict(zip(distinct, self._prompts.documents(distinct), strict=True))
        questions = self._prompts.questions([question for _, question in jobs])
        return [documents[document] + tokens
                for (document, _), tokens in zip(jobs, questions, strict=True)]


async def _burst(engine: Any, prompts: Sequence[list[int]], sampling: dict[str, Any], mode: str,
                 in_flight: int, tag: str) -> list[Any]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(**sampling, output_kind=RequestOutputKind.FINAL_ONLY)
    limit = asyncio.Semaphore(in_flight if mode == "staggered" else len(prompts) or 1)

    async def one(index: int, prompt: list[int]) -> Any:
        async with limit:
            final = None
            async for output in engine.generate({"prompt_token_ids": prompt}, params,
                                                f"{tag}-{index}"):
                final = output
            return final

    return await asyncio.gather(*(one(index, prompt) for index, prompt in enumerate(prompts)))
