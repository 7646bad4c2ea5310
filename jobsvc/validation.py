"""Every check of a job's values, whichever way the job comes in (`Client.submit_many`, a
batch file's line, `Client.submit_prepared`): its text, its sampling values, its stop strings,
its idempotency key, and its prompt against the model's context. A job accepted here is
accepted by the store, the tokenizer and vLLM's `SamplingParams`, so nothing fails later in
a worker for what could have been said at submit.

Pure: plain values in, plain values (or InvalidJob naming the field) out. What each way in
accepts as its shape (a mapping for the client, an OpenAI request for a batch line) is its
own business; the values are checked here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jobsvc.errors import InvalidJob

DEFAULT_MAX_TOKENS = 64
DEFAULT_TEMPERATURE = 0.0
MAX_STOP_STRINGS = 16
# The store's column for a job's idempotency key is this long.
MAX_IDEMPOTENCY_KEY_CHARS = 128
# What PostgreSQL's text and the tokenizer refuse: NUL, and UTF-16 surrogates that pair with
# nothing (a JSON escape such as "\ud800" decodes to one).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


class ContextExceeded(InvalidJob):
    """A prompt and the answer it asks for do not fit the model's context (OpenAI's endpoints
    call it `context_length_exceeded`)."""


def text_fault(value: str) -> str | None:
    """What makes `value` text that can be neither stored nor tokenized, or None."""
    found = _UNSTORABLE.search(value)
    if found is None:
        return None
    return "a NUL character" if found.group() == "\x00" else "a lone surrogate"


def storable(value: str) -> str:
    """`value` with each character `text_fault` names replaced by U+FFFD, to show it back."""
    return _UNSTORABLE.sub("\ufffd", value)


def first_unstorable(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first string (or key) anywhere in a JSON value that `text_fault` refuses: where it
    is (`messages[0].content`, keys shown as `storable` makes them) and what is wrong with it."""
    if isinstance(value, str):
        fault = text_fault(value)
        return None if fault is None else (path, fault)
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{storable(key)}" if path else storable(key)
            if found := first_unstorable(key, where) or first_unstorable(item, where):
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if found := first_unstorable(item, f"{path}[{index}]"):
                return found
    return None


def _number(name: str, value: Any, *, integer: bool) -> float:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise InvalidJob(f"{name} must be {kind}, got {type(value).__name__} {value!r}", name)
    if not integer and not math.isfinite(value):
        raise InvalidJob(f"{name} must be finite, got {value!r}", name)
    return value


def _in_range(name: str, value: Any, low: float, high: float, *, integer: bool = False) -> None:
    number = _number(name, value, integer=integer)
    if not low <= number <= high:
        raise InvalidJob(f"{name} must be between {low} and {high}, got {value!r}", name)


def _check_stop(name: str, value: Any, max_chars: int) -> None:
    if not isinstance(value, list | tuple) or not all(
            isinstance(item, str) and item for item in value) or len(value) > MAX_STOP_STRINGS:
        raise InvalidJob(f"{name} must be a list of at most {MAX_STOP_STRINGS} non-empty "
                         "strings", name)
    for item in value:
        if fault := text_fault(item):
            raise InvalidJob(f"{name} has a string with {fault}; remove it", name)
    longest = max((len(item) for item in value), default=0)
    if longest > max_chars:
        raise InvalidJob(f"{name} has a string of {longest} characters, over the limit of "
                         f"{max_chars} (JOBSVC_MAX_STOP_CHARS)", name)


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidJob(f"{name} must be true or false, got {value!r}", name)


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


def check_sampling_value(key: str, value: Any, max_stop_chars: int, *,
                         field: str | None = None) -> None:
    """Check the value of one sampling key of SAMPLING_KEYS; InvalidJob names `field` (the
    name the caller gave the value, `key` unless said otherwise) if it is wrong."""
    name = field or key
    if key == "stop":
        _check_stop(name, value, max_stop_chars)
    else:
        _SAMPLING_CHECKS[key](name, value)


def check_sampling(sampling: Mapping[str, Any], max_stop_chars: int) -> dict[str, Any]:
    """Check a job's sampling settings: known keys, each value in range. Returns them with the
    stop strings as a list, as they are stored."""
    unknown = sorted(set(sampling) - SAMPLING_KEYS)
    if unknown:
        raise InvalidJob(f"unknown sampling key(s) {unknown}; allowed: {sorted(SAMPLING_KEYS)}",
                         unknown[0])
    for key, value in sampling.items():
        check_sampling_value(key, value, max_stop_chars)
    checked = dict(sampling)
    if "stop" in checked:
        checked["stop"] = list(checked["stop"])
    return checked


def _check_min_tokens(sampling: Mapping[str, Any]) -> None:
    if sampling.get("min_tokens", 0) > sampling["max_tokens"]:
        raise InvalidJob("min_tokens must not exceed max_tokens", "min_tokens")


def _check_text(name: str, value: Any, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidJob(f"{name} must be text (str), got {type(value).__name__}", name)
    if not value.strip():
        raise InvalidJob(f"{name} is empty; give it some text", name)
    if len(value) > limit:
        raise InvalidJob(f"{name} has {len(value)} characters, over the limit of {limit} "
                         f"(JOBSVC_MAX_{name.upper()}_CHARS)", name)
    if fault := text_fault(value):
        raise InvalidJob(f"{name} contains {fault}; remove it", name)
    return value


def _check_idempotency_key(key: Any) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS:
        raise InvalidJob(f"idempotency_key must be a string of 1 to "
                         f"{MAX_IDEMPOTENCY_KEY_CHARS} characters", "idempotency_key")
    if fault := text_fault(key):
        raise InvalidJob(f"idempotency_key contains {fault}; remove it", "idempotency_key")
    return key


@dataclass(frozen=True)
class JobRequest:
    """A validated job as the producer accepted it."""

    document: str
    question: str
    sampling: dict[str, Any]
    idempotency_key: str | None = None


@dataclass(frozen=True)
class JobLimits:
    """What a job may hold; everything a worker later reads of it stays within these."""

    max_document_chars: int
    max_question_chars: int
    max_stop_chars: int
    # The job's own record (question and sampling, JSON-encoded) as a worker reads it.
    max_job_bytes: int


def validate_job(job: Any, limits: JobLimits) -> JobRequest:
    """Check one job as `Client.submit_many` takes it: a mapping of `document`, `question`, an
    optional `idempotency_key` and sampling keys, the defaults filled in. The prompt's length
    needs the tokenizer and is checked later (`check_prompt`)."""
    if not isinstance(job, Mapping):
        raise InvalidJob(f"expected a mapping, got {type(job).__name__}")
    fields = dict(job)
    key = _check_idempotency_key(fields.pop("idempotency_key", None))
    document = _check_text("document", fields.pop("document", None), limits.max_document_chars)
    question = _check_text("question", fields.pop("question", None), limits.max_question_chars)
    sampling = check_sampling({"max_tokens": DEFAULT_MAX_TOKENS,
                               "temperature": DEFAULT_TEMPERATURE, **fields},
                              limits.max_stop_chars)
    _check_min_tokens(sampling)
    encoded = len(json.dumps({"question": question, "sampling": sampling}).encode())
    if encoded > limits.max_job_bytes:
        raise InvalidJob(f"job is {encoded} bytes encoded (question and sampling), over the "
                         f"limit of {limits.max_job_bytes} (JOBSVC_MAX_JOB_BYTES)")
    return JobRequest(document, question, sampling, key)


def check_prompt(prompt_tokens: int, sampling: Mapping[str, Any], context: int, *,
                 prompt_field: str) -> None:
    """Check a tokenized job against the model: a prompt of at least two tokens (a stored
    prefix and suffix hold one each), the prompt plus `max_tokens` within the `context`
    (ContextExceeded), and `min_tokens` at most `max_tokens`. `prompt_field` names what
    holds the prompt (`document`, `messages`, `prompt`), for the error to name."""
    if prompt_tokens < 2:
        raise InvalidJob(f"{prompt_field} is too short: its prompt is a single token",
                         prompt_field)
    max_tokens = sampling["max_tokens"]
    if prompt_tokens + max(max_tokens, 1) > context:
        raise ContextExceeded(
            f"the prompt of {prompt_tokens} tokens plus max_tokens {max_tokens} exceeds the "
            f"model's context of {context} tokens; shorten the {prompt_field} or lower "
            "max_tokens", prompt_field if prompt_tokens >= context else "max_tokens")
    _check_min_tokens(sampling)
