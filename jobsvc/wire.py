"""Job input validation and the versioned queue message that crosses from producer to worker.

Everything here is pure: plain values in, plain values (or InvalidJob / MessageError) out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from jobsvc.errors import InvalidJob

MESSAGE_VERSION = 3
DEFAULT_MAX_TOKENS = 64
DEFAULT_TEMPERATURE = 0.0


class JobStatus(StrEnum):
    """A job's status as the store records it: one vocabulary for producers, workers, operators."""

    QUEUED = "queued"  # recorded and enqueued (perhaps claimed), not yet admitted to an engine
    RUNNING = "running"  # admitted to a worker's engine (shown within a second of it)
    SUCCEEDED = "succeeded"  # answer recorded
    FAILED = "failed"  # ended with a recorded error
    CANCELLED = "cancelled"  # cancelled by the user before it finished

    @property
    def finished(self) -> bool:
        """Whether the job has ended for good (nothing will change it again)."""
        return self in FINISHED_STATUSES


FINISHED_STATUSES = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
# The unfinished statuses' values, in the order a job passes through them.
ACTIVE_STATUSES = tuple(status.value for status in JobStatus if not status.finished)


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


MAX_STOP_STRINGS = 16
# What PostgreSQL's text and the tokenizer refuse: NUL, and UTF-16 surrogates that pair with
# nothing (a JSON escape such as "\ud800" decodes to one).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def text_fault(value: str) -> str | None:
    """What makes `value` text that can be neither stored nor tokenized, or None."""
    found = _UNSTORABLE.search(value)
    if found is None:
        return None
    return "a NUL character" if found.group() == "\x00" else "a lone surrogate"


def storable(value: str) -> str:
    """`value` with each character `text_fault` names replaced by U+FFFD, to show it back."""
    return _UNSTORABLE.sub("\ufffd", value)


def _check_stop(name: str, value: Any, max_chars: int) -> None:
    if not isinstance(value, list | tuple) or not all(
            isinstance(item, str) and item for item in value) or len(value) > MAX_STOP_STRINGS:
        raise InvalidJob(f"{name} must be a list of at most {MAX_STOP_STRINGS} non-empty strings")
    for item in value:
        if fault := text_fault(item):
            raise InvalidJob(f"{name} has a string with {fault}; remove it")
    longest = max((len(item) for item in value), default=0)
    if longest > max_chars:
        raise InvalidJob(f"{name} has a string of {longest} characters, over the limit of "
                         f"{max_chars} (JOBSVC_MAX_STOP_CHARS)")


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
    "ignore_eos": _check_flag,
}
SAMPLING_KEYS = frozenset({*_SAMPLING_CHECKS, "stop"})


def check_sampling_value(name: str, value: Any, max_stop_chars: int) -> None:
    """Check one sampling key of SAMPLING_KEYS (InvalidJob names it if its value is wrong)."""
    if name == "stop":
        _check_stop(name, value, max_stop_chars)
    else:
        _SAMPLING_CHECKS[name](name, value)


def _check_text(name: str, value: Any, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidJob(f"{name} must be text (str), got {type(value).__name__}")
    if not value.strip():
        raise InvalidJob(f"{name} is empty; give it some text")
    if len(value) > limit:
        raise InvalidJob(f"{name} has {len(value)} characters, over the limit of {limit} "
                         f"(JOBSVC_MAX_{name.upper()}_CHARS)")
    if fault := text_fault(value):
        raise InvalidJob(f"{name} contains {fault}; remove it")
    return value


@dataclass(frozen=True)
class JobRequest:
    """A validated job as the producer accepted it."""

    document: str
    question: str
    sampling: dict[str, Any]


@dataclass(frozen=True)
class JobLimits:
    """What a job may hold; everything a worker later reads of it stays within these."""

    max_document_chars: int
    max_question_chars: int
    max_stop_chars: int
    # The job's own record (question and sampling, JSON-encoded) as a worker reads it.
    max_job_bytes: int


def validate_job(document: Any, question: Any, sampling: Mapping[str, Any],
                 limits: JobLimits) -> JobRequest:
    """Check one job's fields; the prompt length check needs the tokenizer and comes later."""
    _check_text("document", document, limits.max_document_chars)
    _check_text("question", question, limits.max_question_chars)
    unknown = sorted(set(sampling) - SAMPLING_KEYS)
    if unknown:
        raise InvalidJob(f"unknown sampling key(s) {unknown}; allowed: {sorted(SAMPLING_KEYS)}")
    merged = {"max_tokens": DEFAULT_MAX_TOKENS, "temperature": DEFAULT_TEMPERATURE, **sampling}
    for name, value in merged.items():
        check_sampling_value(name, value, limits.max_stop_chars)
    if merged.get("min_tokens", 0) > merged["max_tokens"]:
        raise InvalidJob("min_tokens must not exceed max_tokens")
    if "stop" in merged:
        merged["stop"] = list(merged["stop"])
    encoded = len(json.dumps({"question": question, "sampling": merged}).encode())
    if encoded > limits.max_job_bytes:
        raise InvalidJob(f"job is {encoded} bytes encoded (question and sampling), over the "
                         f"limit of {limits.max_job_bytes} (JOBSVC_MAX_JOB_BYTES)")
    return JobRequest(document, question, merged)


class MessageError(ValueError):
    """A queue message that is not one of ours; the worker refuses it and carries on."""


# A message names at most this many jobs; the producer's JOBSVC_BATCH_SIZE is far below it.
MAX_MESSAGE_JOBS = 100_000


@dataclass(frozen=True)
class QueueMessage:
    """One queue message for one shard: only the IDs of its jobs. Everything that decides a
    job's answer (document, question, sampling) and what it charged its shard is read from the
    job's record, so a message can point a worker at work but never change it. The message's
    own ID (the Celery task ID) is recorded with each job it carries: only that message may
    run them, so copies, forgeries and messages superseded by a requeue run nothing."""

    shard: int
    job_ids: list[str]
    message_id: str

    def to_wire(self) -> dict[str, Any]:
        """The message as the versioned JSON body a shard queue carries."""
        return {"v": MESSAGE_VERSION, "shard": self.shard, "jobs": self.job_ids}

    @classmethod
    def from_wire(cls, data: Any, message_id: str) -> QueueMessage:
        """Rebuild a message, refusing anything that is not exactly our schema."""
        if not isinstance(data, dict) or data.get("v") != MESSAGE_VERSION:
            raise MessageError(f"not a version-{MESSAGE_VERSION} jobsvc message")
        shard, jobs = data.get("shard"), data.get("jobs")
        if not _is_int(shard) or not isinstance(jobs, list) or len(jobs) > MAX_MESSAGE_JOBS:
            raise MessageError(f"a message needs an integer shard and a list of at most "
                               f"{MAX_MESSAGE_JOBS} job IDs")
        if not all(isinstance(job_id, str) and 0 < len(job_id) <= 64 for job_id in jobs):
            raise MessageError("a message's job IDs must be strings of 1 to 64 characters")
        return cls(shard, jobs, message_id)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
