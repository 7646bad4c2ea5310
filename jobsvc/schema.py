"""Job input validation and the versioned batch message that crosses from producer to worker.

Everything here is pure: plain values in, plain values (or InvalidJob / MessageError) out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from jobsvc.errors import InvalidJob

MESSAGE_VERSION = 2
DEFAULT_MAX_TOKENS = 64
DEFAULT_TEMPERATURE = 0.0


class JobStatus(StrEnum):
    QUEUED = "queued"  # recorded and enqueued, not yet admitted to an engine
    RUNNING = "running"  # admitted to a worker's engine
    SUCCEEDED = "succeeded"  # answer recorded
    FAILED = "failed"  # ended with a recorded error
    CANCELLED = "cancelled"  # cancelled by the user before it finished

    @property
    def finished(self) -> bool:
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})


def _number(name: str, value: Any, *, integer: bool) -> float:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise InvalidJob(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    if not integer and not math.isfinite(value):
        raise InvalidJob(f"{name} must be finite, got {value!r}")
    return value


def _in_range(name: str, value: Any, low: float, high: float, *, integer: bool = False) -> None:
    number = _number(name, value, integer=integer)
    if not low <= number <= high:
        raise InvalidJob(f"{name} must be between {low} and {high}, got {value!r}")


def _check_stop(name: str, value: Any) -> None:
    if not isinstance(value, list | tuple) or not all(
            isinstance(item, str) and item for item in value) or len(value) > 16:
        raise InvalidJob(f"{name} must be a list of at most 16 non-empty strings")


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidJob(f"{name} must be true or false, got {value!r}")


# Sampling keys a job may set, each with its check. Values pass to vLLM's SamplingParams as is,
# so no range may be wider than the one SamplingParams accepts (temperature: [0, 2]): a job
# accepted here and refused there would fail in the worker instead of at submit.
_SAMPLING_CHECKS = {
    "max_tokens": lambda n, v: _in_range(n, v, 1, 1 << 20, integer=True),
    "min_tokens": lambda n, v: _in_range(n, v, 0, 1 << 20, integer=True),
    "temperature": lambda n, v: _in_range(n, v, 0.0, 2.0),
    "top_p": lambda n, v: _in_range(n, v, 1e-6, 1.0),
    "top_k": lambda n, v: _in_range(n, v, -1, 1 << 20, integer=True),
    "min_p": lambda n, v: _in_range(n, v, 0.0, 1.0),
    "presence_penalty": lambda n, v: _in_range(n, v, -2.0, 2.0),
    "frequency_penalty": lambda n, v: _in_range(n, v, -2.0, 2.0),
    "repetition_penalty": lambda n, v: _in_range(n, v, 1e-3, 10.0),
    "seed": lambda n, v: _in_range(n, v, 0, (1 << 63) - 1, integer=True),
    "stop": _check_stop,
    "ignore_eos": _check_flag,
}
SAMPLING_KEYS = frozenset(_SAMPLING_CHECKS)


def _check_text(name: str, value: Any, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidJob(f"{name} must be text (str), got {type(value).__name__}")
    if not value.strip():
        raise InvalidJob(f"{name} is empty; give it some text")
    if len(value) > limit:
        raise InvalidJob(f"{name} has {len(value)} characters, over the limit of {limit} "
                         f"(JOBSVC_MAX_{name.upper()}_CHARS)")
    if "\x00" in value:
        raise InvalidJob(f"{name} contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidJob(f"{name} is not valid Unicode text (lone surrogate)") from None
    return value


@dataclass(frozen=True)
class JobRequest:
    """A validated job as the producer accepted it."""

    document: str
    question: str
    sampling: dict[str, Any]

    @property
    def max_tokens(self) -> int:
        return int(self.sampling["max_tokens"])


def validate_job(document: Any, question: Any, sampling: Mapping[str, Any], *,
                 max_document_chars: int, max_question_chars: int) -> JobRequest:
    """Check one job's fields; the prompt length check needs the tokenizer and comes later."""
    _check_text("document", document, max_document_chars)
    _check_text("question", question, max_question_chars)
    unknown = sorted(set(sampling) - SAMPLING_KEYS)
    if unknown:
        raise InvalidJob(f"unknown sampling key(s) {unknown}; allowed: {sorted(SAMPLING_KEYS)}")
    merged = {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": DEFAULT_TEMPERATURE, **sampling}
    for name, value in merged.items():
        _SAMPLING_CHECKS[name](name, value)
    if merged.get("min_tokens", 0) > merged["max_tokens"]:
        raise InvalidJob("min_tokens must not exceed max_tokens")
    if "stop" in merged:
        merged["stop"] = list(merged["stop"])
    return JobRequest(document, question, merged)


class MessageError(ValueError):
    """A queue message that is not a batch of ours; the worker refuses it and carries on."""


@dataclass(frozen=True)
class QueuedJob:
    job_id: str
    document_key: str
    question_tokens: list[int]
    sampling: dict[str, Any]
    # The prompt tokens the router expected the shard to compute (the rest it expected cached).
    estimated_prefill: int
    # What the router charged the shard for this job (`routers.Route.load`); returned when it
    # ends.
    load: int


@dataclass(frozen=True)
class BatchMessage:
    """One micro-batch for one shard. Jobs name their documents by key and never carry them:
    submit records every document, with its tokens, before it enqueues, and the worker reads
    them from there; Redis holds no copy of a document to lose or expire."""

    shard: int
    jobs: list[QueuedJob]

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": MESSAGE_VERSION,
            "shard": self.shard,
            "jobs": [[job.job_id, job.document_key, job.question_tokens, job.sampling,
                      job.estimated_prefill, job.load] for job in self.jobs],
        }

    @classmethod
    def from_wire(cls, data: Any) -> BatchMessage:
        """Rebuild a message, refusing anything that is not exactly our schema."""
        if not isinstance(data, dict) or data.get("v") != MESSAGE_VERSION:
            raise MessageError(f"not a version-{MESSAGE_VERSION} jobsvc batch")
        shard, jobs = data.get("shard"), data.get("jobs")
        if not _is_int(shard) or not isinstance(jobs, list):
            raise MessageError("batch needs an integer shard and a jobs list")
        return cls(shard, [_parse_job(entry) for entry in jobs])


def _parse_job(entry: Any) -> QueuedJob:
    """A job entry; one without its load (enqueued before loads counted decoding) was charged
    its estimated prefill alone."""
    if not isinstance(entry, list) or len(entry) not in (5, 6):
        raise MessageError("a job entry must be [id, document_key, question_tokens, sampling, "
                           "estimated_prefill, load]")
    job_id, document_key, question_tokens, sampling, prefill = entry[:5]
    load = entry[5] if len(entry) == 6 else prefill
    if not (isinstance(job_id, str) and job_id and isinstance(document_key, str)
            and document_key):
        raise MessageError(f"job {job_id!r} has no ID or no document key")
    if not _is_token_list(question_tokens) or not isinstance(sampling, dict) or not (
            _is_int(prefill) and _is_int(load)):
        raise MessageError(f"job {job_id!r} has malformed tokens, sampling, prefill or load")
    if set(sampling) - SAMPLING_KEYS:
        raise MessageError(f"job {job_id!r} has unknown sampling keys")
    return QueuedJob(job_id, document_key, question_tokens, sampling, prefill, load)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(token) and token >= 0 for token in value)
