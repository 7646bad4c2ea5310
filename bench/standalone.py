"""The benchmark's baseline: vLLM driven directly, tuned as a careful user would tune it —
prefix caching on, gc.freeze() after start-up, collections held off while a burst runs (as
the service's workers hold them off), the same document-to-engine assignment as the service,
each distinct document tokenized once with the fast tokenizer (inside the timed region), each
document's questions handed over together, and token prompts admitted in one of two styles
(all at once, or staggered in chunks at a steady pace as the service's workers admit them).
The engines are either this process's own or, through a worker's remote-control command, the
service workers' resident ones."""

from __future__ import annotations

import gc
import itertools
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jobsvc.prompts import PromptBuilder
from jobsvc.settings import Settings
from jobsvc.validation import JobLimits, validate_job
from jobsvc.workers.bootstrap import bind_device, kept_to_device
from jobsvc.workers.collector import CollectionWindow
from jobsvc.workers.engine import (
    EngineAdapter,
    Pacing,
    engine_args,
    gather_paced,
    sampling_params,
)

# "all": every request at once; "staggered": paced as the service's workers pace a batch
# where they pace it (`jobsvc.workers.engine.Pacing`, from JOBSVC_ADMISSION_CHUNK and
# JOBSVC_ADMISSION_PAUSE_MS), and otherwise with STAGGERED_PACING. Either way each document's
# questions are made adjacent first, as the service's batches make them: handed over
# interleaved, a reused document's later questions reach the engine far from its first, and
# the engine ends the burst decoding many of them at once on slow steps. A bound on requests
# in flight instead was slower than either style (`docs/benchmarks.md`), so the staggered
# style paces rather than bounds.
ADMISSION_MODES = ("all", "staggered")
# The staggered style where the workers admit each batch at once: paced this way, a burst
# driven straight into one engine ran faster than all at once (`docs/benchmarks.md`), so the
# baseline keeps it as a style to calibrate against, whatever the service's.
STAGGERED_PACING = Pacing(32, 0.015)


Job = tuple[str, str, dict[str, Any]]  # (document, question, sampling settings as stored)


def as_job(job: Mapping[str, Any], limits: JobLimits) -> Job:
    """A bench job (`document`, `question` and its sampling keys, as `Client.submit_many`
    takes it) as the standalone arm takes it: checked by the producer's own `validate_job`, so
    that its sampling is what the service stores (defaults filled in, a `response_format`
    become the `structured_outputs` constraint it asks for)."""
    request = validate_job(job, limits)
    return request.document, request.question, request.sampling


def engine_sampling(samplings: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's SamplingParams for each distinct stored sampling, by its JSON: made by the
    service workers' own `sampling_params`, so that both arms hand the engine the same
    parameters and constraints."""
    params: dict[str, Any] = {}
    for sampling in samplings:
        key = _sampling_key(sampling)
        if key not in params:
            params[key] = sampling_params(sampling)
    return params


def _sampling_key(sampling: dict[str, Any]) -> str:
    return json.dumps(sampling, sort_keys=True)


# A job's tokens as the engine takes them: (document, question, sampling settings).
Prompt = tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]


@dataclass(frozen=True)
class StandaloneRun:
    """What one standalone burst took: its moments and tokens, for comparing with a service arm."""

    # Wall-clock moments (time.time()), so that bursts run by several processes at once can be
    # joined into one: from the earliest start to the latest finish.
    started: float
    # When the first request went to the engine, after tokenizing.
    admitted: float
    finished: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    # When each engine's last request returned.
    engines_finished: Sequence[float]

    @property
    def seconds(self) -> float:
        """The burst's wall time, start to last finish."""
        return self.finished - self.started

    @property
    def head_seconds(self) -> float:
        """From the start to the first request in an engine (tokenizing)."""
        return self.admitted - self.started


class StandaloneEngines:
    """One AsyncLLM per shard in this process, each bound to its own cores."""

    def __init__(self, settings: Settings, devices: Sequence[str | None]) -> None:
        self._pacing = Pacing.from_settings(settings)
        self._engines: list[EngineAdapter] = []
        for device in devices:
            bind_device(settings, device)
            with kept_to_device(device):
                adapter = EngineAdapter(engine_args(settings))
                adapter.start()
            self._engines.append(adapter)
        self._prompts = PromptBuilder(settings.model, settings.max_model_len)
        self._prompts.questions(["warm up the tokenizer"])
        self._collections = CollectionWindow()
        gc.collect()
        gc.freeze()

    def shutdown(self) -> None:
        """Stop every engine and unfreeze what start-up froze."""
        for adapter in self._engines:
            adapter.shutdown()
        # Let the collector free what start-up froze, so engines started later in this
        # process do not pile up behind it.
        gc.unfreeze()

    def run(self, jobs_by_engine: Sequence[Sequence[Job]], mode: str) -> StandaloneRun:
        """Run one burst over the engines, collections held off while it runs as a service worker
        holds them off."""
        with self._collections.busy():
            return run_burst(self._engines, self._prompts, jobs_by_engine, mode, self._pacing)


_bursts = itertools.count(1)


def run_burst(engines: Sequence[EngineAdapter], prompts: PromptBuilder,
              jobs_by_engine: Sequence[Sequence[Job]], mode: str, pacing: Pacing
              ) -> StandaloneRun:
    """Run one burst of jobs on every engine at once, each engine from a cold prefix cache,
    staggered (with `staggered_pacing(pacing)`) or all at once. The engines may be this
    process's own or a service worker's resident one: the bench can drive a worker's engine
    directly, so that both arms of a pair meet the same engine."""
    if mode not in ADMISSION_MODES:
        raise ValueError(f"admission mode must be one of {ADMISSION_MODES}")
    pacing = staggered_pacing(pacing) if mode == "staggered" else Pacing()
    jobs_by_engine = [_grouped(jobs) for jobs in jobs_by_engine]
    for adapter in engines:
        adapter.reset_prefix_cache()
    burst = next(_bursts)
    started = time.time()
    prompts_by_engine = [[(*parts, job[2]) for parts, job
                          in zip(_tokenize(prompts, jobs), jobs, strict=True)]
                         for jobs in jobs_by_engine]
    admitted = time.time()
    futures = [adapter.schedule(
                   lambda engine, engine_prompts=engine_prompts, tag=f"sa{burst}-{index}":
                   _burst(engine, engine_prompts, pacing, tag))
               for index, (adapter, engine_prompts) in enumerate(
                   zip(engines, prompts_by_engine, strict=True))]
    runs = [future.result() for future in futures]
    finished = time.time()
    outputs = [output for engine_outputs, _ in runs for output in engine_outputs]
    return StandaloneRun(
        started=started, admitted=admitted, finished=finished,
        engines_finished=[engine_finished for _, engine_finished in runs],
        output_tokens=sum(len(output.outputs[0].token_ids) for output in outputs),
        prompt_tokens=sum(len(output.prompt_token_ids or ()) for output in outputs),
        cached_tokens=sum(output.num_cached_tokens or 0 for output in outputs))


def staggered_pacing(workers_pacing: Pacing) -> Pacing:
    """The staggered style's pacing: the workers' own where they pace their batches, so that
    the baseline can match the service, and STAGGERED_PACING where they admit all at once, so
    that the two styles the baseline calibrates between still differ."""
    return workers_pacing if workers_pacing.chunk else STAGGERED_PACING


def _tokenize(prompts: PromptBuilder, jobs: Sequence[Job]
              ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each job's prompt as its document's tokens (one tuple per document) and its question's,
    joined only as the engine takes the request, as the service's workers hand them over (see
    `jobsvc.workers.engine.EngineRequest`)."""
    distinct = list(dict.fromkeys(job[0] for job in jobs))
    documents = {text: tuple(tokens)
                 for text, tokens in zip(distinct, prompts.documents(distinct), strict=True)}
    questions = prompts.questions([job[1] for job in jobs])
    return [(documents[job[0]], tuple(tokens))
            for job, tokens in zip(jobs, questions, strict=True)]


def _grouped(jobs: Sequence[Job]) -> list[Job]:
    by_document: dict[str, list[Job]] = {}
    for job in jobs:
        by_document.setdefault(job[0], []).append(job)
    return [job for group in by_document.values() for job in group]


async def _burst(engine: Any, prompts: Sequence[Prompt], pacing: Pacing, tag: str
                 ) -> tuple[list[Any], float]:
    """The final outputs of one engine's share of a burst, and when its last one returned."""
    params = engine_sampling(sampling for _, _, sampling in prompts)

    async def one(index: int, document: tuple[int, ...], question: tuple[int, ...],
                  sampling: dict[str, Any]) -> Any:
        final = None
        async for output in engine.generate({"prompt_token_ids": document + question},
                                            params[_sampling_key(sampling)],
                                            f"{tag}-{index}"):
            final = output
        return final

    outputs = await gather_paced([one(index, *prompt) for index, prompt in enumerate(prompts)],
                                 pacing)
    return outputs, time.time()
