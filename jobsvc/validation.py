"""Every check of a job's values, whichever way the job comes in (`Client.submit_many`, a
batch file's line, `Client.submit_prepared`): its text, its sampling values, its stop strings,
its idempotency key, and its prompt against the model's context. A job accepted here is
accepted by the store, the tokenizer and vLLM's `SamplingParams`, so nothing fails later in
a worker for what could have been said at submit. That includes a structured-output constraint
(`response_format`, `structured_outputs`): it is checked by vLLM's own backends, where vLLM is
installed, as its input processor checks it before the engine.

Pure: plain values in, plain values (or InvalidJob naming the field) out. What each way in
accepts as its shape (a mapping for the client, an OpenAI request for a batch line) is its
own business; the values are checked here.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jobsvc.errors import InvalidJob

DEFAULT_MAX_TOKENS = 64
DEFAULT_TEMPERATURE = 0.0
MAX_STOP_STRINGS = 16
# Most choices a job may ask for (OpenAI's limit on `n`), most likely alternatives per token
# (the engine's default `max_logprobs`), and most tokens a logit bias may name.
MAX_CHOICES = 128
MAX_TOP_LOGPROBS = 20
MAX_BIASED_TOKENS = 1024
# Most log probabilities one job's answers may carry (a token's own and its alternatives', over
# every choice): they are held whole while the answer is recorded and while it is written out.
MAX_LOGPROB_ENTRIES = 1 << 18
# The store's column for a job's idempotency key is this long.
MAX_IDEMPOTENCY_KEY_CHARS = 128
# The longest name of a served model or adapter a job may ask for.
MAX_MODEL_NAME_CHARS = 200
# What PostgreSQL's text and the tokenizer refuse: NUL, and UTF-16 surrogates that pair with
# nothing (a JSON escape such as "\ud800" decodes to one).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


class Unsupported(InvalidJob):
    """A job asks for something this service does not serve (OpenAI's endpoints call it
    `unsupported_parameter`)."""


class ContextExceeded(InvalidJob):
    """A prompt and the answer it asks for do not fit the model's context (OpenAI's endpoints
    call it `context_length_exceeded`)."""


def text_fault(value: str) -> str | None:
    """What makes `value` text that can be neither stored nor tokenized, or None."""
    if value.isascii():
        # Known of the string without reading it: no surrogate, and NUL found by a byte scan.
        return "a NUL character" if "\x00" in value else None
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


def _check_logit_bias(name: str, value: Any) -> None:
    if not isinstance(value, Mapping) or len(value) > MAX_BIASED_TOKENS:
        raise InvalidJob(f"{name} must be an object of at most {MAX_BIASED_TOKENS} token IDs, "
                         "each with a bias from -100 to 100", name)
    for token, bias in value.items():
        if not _token_id(token):
            raise InvalidJob(f"{name} has the key {storable(str(token))!r}, which is not a "
                             "token ID (a non-negative integer)", name)
        _in_range(f"{name}[{token}]", bias, -100.0, 100.0)


def _token_id(key: Any) -> bool:
    """Whether a logit bias key names a token: an int, or a string of ASCII digits."""
    if isinstance(key, bool):
        return False
    if isinstance(key, int):
        return 0 <= key < 1 << 31
    return isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10


def _check_json_schema(name: str, value: Any) -> None:
    schema = value
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except (ValueError, RecursionError):
            raise InvalidJob(f"{name} must be a JSON schema: an object, or a string holding "
                             "one", name) from None
    if not isinstance(schema, Mapping):
        raise InvalidJob(f"{name} must be a JSON schema: an object, or a string holding one",
                         name)


def _check_regex(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise InvalidJob(f"{name} must be a string (a regular expression)", name)


def _check_choice(name: str, value: Any) -> None:
    if not isinstance(value, list) or not value or not all(isinstance(item, str)
                                                           for item in value):
        raise InvalidJob(f"{name} must be a non-empty list of strings", name)


def _check_grammar(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise InvalidJob(f"{name} must be a non-empty string (an EBNF or Lark grammar)", name)


def _check_json_object(name: str, value: Any) -> None:
    if value is not True:
        raise InvalidJob(f"{name} must be true if given", name)


def _check_whitespace_pattern(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise InvalidJob(f"{name} must be a string (a regular expression)", name)


# vLLM's StructuredOutputsParams, as its OpenAI server takes `structured_outputs`: exactly one
# constraint, and options that shape it. `structural_tag` (tool-call tags) is not served.
_CONSTRAINTS = {"json": _check_json_schema, "regex": _check_regex, "choice": _check_choice,
                "grammar": _check_grammar, "json_object": _check_json_object}
_CONSTRAINT_OPTIONS = {"disable_any_whitespace": _check_flag,
                       "disable_additional_properties": _check_flag,
                       "whitespace_pattern": _check_whitespace_pattern}


# Verdicts of the backend check by the digest of the constraint's JSON: a batch's lines
# usually share one constraint, and a digest keeps what is held small however large the
# constraints callers send.
_VERDICTS: dict[bytes, str | None] = {}
_MOST_VERDICTS = 256
_VERDICTS_LOCK = threading.Lock()


def _backend_refusal(constraint_json: str) -> str | None:
    """Why the engine's structured-output backends cannot compile a constraint (given as its
    JSON), or None; the verdict is kept per distinct constraint."""
    digest = hashlib.sha256(constraint_json.encode()).digest()
    with _VERDICTS_LOCK:
        if digest in _VERDICTS:
            return _VERDICTS[digest]
    verdict = _compile_refusal(constraint_json)
    with _VERDICTS_LOCK:
        if len(_VERDICTS) >= _MOST_VERDICTS:
            del _VERDICTS[next(iter(_VERDICTS))]
        _VERDICTS[digest] = verdict
    return verdict


def _compile_refusal(constraint_json: str) -> str | None:
    """The backend check itself, tried as vLLM's default `auto` backend tries them in its
    input processor: xgrammar, else guidance (outlines for a schema guidance cannot take).
    Only the grammar is built, not the tokenizer's mask, which keeps the check cheap."""
    try:
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams
        from vllm.v1.structured_output.backend_guidance import (
            has_guidance_unsupported_json_features,
            validate_guidance_grammar,
        )
        from vllm.v1.structured_output.backend_outlines import (
            validate_structured_output_request_outlines,
        )
        from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar
    except ImportError:
        # A producer without vLLM: the worker's engine checks it, failing the job alone.
        return None
    constraint = json.loads(constraint_json)

    def params() -> Any:
        # A fresh one for each backend: xgrammar's check rewrites a `choice` into a grammar.
        return SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))

    try:
        validate_xgrammar_grammar(params())
        return None
    except Exception as error:
        xgrammar_refusal = str(error).rstrip()
    schema = constraint.get("json")
    if isinstance(schema, str):
        schema = json.loads(schema)
    try:
        if schema is not None and has_guidance_unsupported_json_features(schema):
            validate_structured_output_request_outlines(params())
        else:
            validate_guidance_grammar(params())
    except Exception as error:
        return f"{xgrammar_refusal}; the fallback backend: {error}"
    return None


# xgrammar starts its messages with a time and a source line of its own, which tell a caller
# nothing.
_BACKEND_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: ")


def _json_encoded(name: str, value: Any) -> str:
    """`value` as the job's sampling is stored (JSON, finite numbers only), or InvalidJob."""
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        raise InvalidJob(f"{name} must hold JSON values only (objects, arrays, strings, finite "
                         "numbers, booleans, null), not nested too deep", name) from None


def _check_storable_and_compiles(name: str, given: Any, constraint: Mapping[str, Any]) -> None:
    """Check what the caller `given` holds only storable text, and that the `constraint` it
    asks for compiles."""
    _json_encoded(name, given)
    if found := first_unstorable(given, name):
        raise InvalidJob(f"{found[0]} has {found[1]}; remove it", found[0])
    refusal = _backend_refusal(_json_encoded(name, constraint))
    if refusal is not None:
        reason = " ".join(_BACKEND_LOG_PREFIX.sub("", refusal).split())
        raise InvalidJob(f"{name} cannot be compiled by the structured-output backend: "
                         f"{reason}", name)


def _check_structured_outputs(name: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise InvalidJob(f"{name} must be an object with one of {sorted(_CONSTRAINTS)}", name)
    for key in value:
        if key not in _CONSTRAINTS and key not in _CONSTRAINT_OPTIONS:
            raise Unsupported(f"{name}.{key} is not supported by this server; use one of "
                              f"{sorted(_CONSTRAINTS)}", f"{name}.{key}")
    given = [key for key in _CONSTRAINTS if value.get(key) is not None]
    if len(given) != 1:
        raise InvalidJob(f"{name} must give exactly one of {sorted(_CONSTRAINTS)}, got "
                         f"{given or 'none'}", name)
    for key, item in value.items():
        if item is not None:
            {**_CONSTRAINTS, **_CONSTRAINT_OPTIONS}[key](f"{name}.{key}", item)
    _check_storable_and_compiles(name, dict(value), dict(value))


def _response_format_constraint(value: Any) -> dict[str, Any] | None:
    """The `structured_outputs` constraint OpenAI's `response_format` asks for (None for
    text), as vLLM's server translates it."""
    name = "response_format"
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        constraint: dict[str, Any] = {"json_object": True}
    elif kind == "json_schema":
        spec = value.get("json_schema")
        field = f"{name}.json_schema"
        if not isinstance(spec, Mapping):
            raise InvalidJob(f"{field} must be an object with `name` and `schema`", field)
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise InvalidJob(f"{field}.name must be a non-empty string", f"{field}.name")
        if spec.get("strict") is not None:
            _check_flag(f"{field}.strict", spec["strict"])
        if not isinstance(spec.get("schema"), Mapping):
            raise InvalidJob(f"{field}.schema must be an object (a JSON schema)",
                             f"{field}.schema")
        constraint = {"json": dict(spec["schema"])}
    elif kind == "structural_tag":
        raise Unsupported(f"{name}: a structural tag is not supported by this server",
                          f"{name}.type")
    else:
        raise InvalidJob(f"{name}.type must be one of text, json_object, json_schema; got "
                         f"{kind!r}", f"{name}.type")
    _check_storable_and_compiles(name, dict(value), constraint)
    return constraint


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
    "n": lambda n, v: _in_range(n, v, 1, MAX_CHOICES, integer=True),
    # vLLM's meaning: the log probability of each generated token and of the k most likely.
    "logprobs": lambda n, v: _in_range(n, v, 0, MAX_TOP_LOGPROBS, integer=True),
    "logit_bias": _check_logit_bias,
    # vLLM's meaning: lower runs earlier, when the engine schedules by priority.
    "priority": lambda n, v: _in_range(n, v, -(1 << 31), (1 << 31) - 1, integer=True),
    # Stored in vLLM's terms; `response_format` (OpenAI's) is translated to it.
    "structured_outputs": _check_structured_outputs,
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


def check_sampling(sampling: Mapping[str, Any], max_stop_chars: int, *,
                   priority_scheduling: bool) -> dict[str, Any]:
    """Check a job's sampling settings: known keys, each value in range, a structured-output
    constraint one the backend compiles, a priority only where the engine schedules by it
    (`priority_scheduling`). Returns them as they are stored: the stop strings as a list, a
    logit bias keyed by token IDs as strings, a `response_format` as the `structured_outputs`
    constraint it asks for (None for either means none)."""
    checked = {key: value for key, value in sampling.items()
               if value is not None or key not in ("response_format", "structured_outputs")}
    response_format = checked.pop("response_format", None)
    unknown = sorted(set(checked) - SAMPLING_KEYS)
    if unknown:
        allowed = sorted({*SAMPLING_KEYS, "response_format"})
        raise InvalidJob(f"unknown sampling key(s) {unknown}; allowed: {allowed}", unknown[0])
    for key, value in checked.items():
        check_sampling_value(key, value, max_stop_chars)
    if "stop" in checked:
        checked["stop"] = list(checked["stop"])
    if "logit_bias" in checked:
        checked["logit_bias"] = {str(token): bias for token, bias in checked["logit_bias"].items()}
    if checked.get("priority", 0) != 0 and not priority_scheduling:
        raise Unsupported("priority is not served: the engine schedules requests in arrival "
                          "order (JOBSVC_SCHEDULING_POLICY=fcfs); leave it 0", "priority")
    if response_format is not None:
        if "structured_outputs" in checked:
            raise InvalidJob("give either response_format or structured_outputs, not both",
                             "structured_outputs")
        if (constraint := _response_format_constraint(response_format)) is not None:
            checked["structured_outputs"] = constraint
    return checked


def _check_min_tokens(sampling: Mapping[str, Any]) -> None:
    if sampling.get("min_tokens", 0) > sampling["max_tokens"]:
        raise InvalidJob("min_tokens must not exceed max_tokens", "min_tokens")


def _check_text(name: str, value: Any, limit: int, *, setting: str | None = None) -> str:
    """Storable text, not blank, of at most `limit` characters (the `setting` that sets it:
    JOBSVC_MAX_<NAME>_CHARS unless given)."""
    if not isinstance(value, str):
        raise InvalidJob(f"{name} must be text (str), got {type(value).__name__}", name)
    if not value or value.isspace():
        raise InvalidJob(f"{name} is empty; give it some text", name)
    if len(value) > limit:
        raise InvalidJob(f"{name} has {len(value)} characters, over the limit of {limit} "
                         f"({setting or f'JOBSVC_MAX_{name.upper()}_CHARS'})", name)
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
    # The served model or adapter it names; None: the settings' served model.
    model: str | None = None


@dataclass(frozen=True)
class JobLimits:
    """What a job may hold; everything a worker later reads of it stays within these."""

    max_document_chars: int
    max_question_chars: int
    max_stop_chars: int
    # The job's own record (question and sampling, JSON-encoded) as a worker reads it.
    max_job_bytes: int
    # Whether the engine schedules by a job's `priority` (JOBSVC_SCHEDULING_POLICY).
    priority_scheduling: bool
    # vLLM's parser that finds tool calls in a chat line's `auto` answer
    # (JOBSVC_TOOL_CALL_PARSER); None: such answers are text.
    tool_call_parser: str | None = None


def validate_job(job: Any, limits: JobLimits) -> JobRequest:
    """Check one job as `Client.submit_many` takes it: a mapping of `document`, `question`, an
    optional `idempotency_key`, an optional `model` and sampling keys, the defaults filled in.
    The prompt's length needs the tokenizer and is checked later (`check_prompt`)."""
    if not isinstance(job, Mapping):
        raise InvalidJob(f"expected a mapping, got {type(job).__name__}")
    fields = dict(job)
    key = _check_idempotency_key(fields.pop("idempotency_key", None))
    model = check_model_name(fields.pop("model", None))
    document = _check_text("document", fields.pop("document", None), limits.max_document_chars)
    question = _check_text("question", fields.pop("question", None), limits.max_question_chars)
    sampling = check_sampling({"max_tokens": DEFAULT_MAX_TOKENS,
                               "temperature": DEFAULT_TEMPERATURE, **fields},
                              limits.max_stop_chars,
                              priority_scheduling=limits.priority_scheduling)
    _check_min_tokens(sampling)
    _check_logprob_entries(sampling)
    encoded = len(json.dumps({"question": question, "sampling": sampling}).encode())
    if encoded > limits.max_job_bytes:
        raise InvalidJob(f"job is {encoded} bytes encoded (question and sampling), over the "
                         f"limit of {limits.max_job_bytes} (JOBSVC_MAX_JOB_BYTES)")
    return JobRequest(document, question, sampling, key, model)


def check_model_name(model: Any) -> str | None:
    """A job's `model`: None, or a name of at most MAX_MODEL_NAME_CHARS characters (whether
    the fleet serves it is `jobsvc.served_models`' to say)."""
    if model is None:
        return None
    if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_NAME_CHARS:
        raise InvalidJob(f"model must be a string of 1 to {MAX_MODEL_NAME_CHARS} characters",
                         "model")
    if fault := text_fault(model):
        raise InvalidJob(f"model contains {fault}; remove it", "model")
    return model


def _check_logprob_entries(sampling: Mapping[str, Any]) -> None:
    if (top := sampling.get("logprobs")) is None:
        return
    choices, max_tokens = sampling.get("n", 1), sampling["max_tokens"]
    entries = choices * max_tokens * (top + 1)
    if entries > MAX_LOGPROB_ENTRIES:
        raise InvalidJob(f"{choices} choice(s) of up to {max_tokens} tokens, each with {top} "
                         f"alternatives, would carry {entries} log probabilities, over the "
                         f"limit of {MAX_LOGPROB_ENTRIES}; lower max_tokens, n or the "
                         "alternatives asked for", "logprobs")


def check_prompt(prompt_tokens: int, sampling: Mapping[str, Any], context: int,
                 vocabulary: int, *, prompt_field: str) -> None:
    """Check a tokenized job against the model: a prompt of at least two tokens (a stored
    prefix and suffix hold one each), the prompt plus `max_tokens` within the `context`
    (ContextExceeded), `min_tokens` at most `max_tokens`, log probabilities within
    MAX_LOGPROB_ENTRIES, and a logit bias naming tokens of the model's `vocabulary` (its
    size). `prompt_field` names what holds the prompt (`document`, `messages`, `prompt`), for
    the error to name."""
    outside = [token for token in sampling.get("logit_bias", {}) if int(token) >= vocabulary]
    if outside:
        raise InvalidJob(f"logit_bias names token {outside[0]}, outside the model's vocabulary "
                         f"of {vocabulary} tokens", "logit_bias")
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
    _check_logprob_entries(sampling)


# Most inputs one embedding request may give (OpenAI's limit).
MAX_EMBEDDING_INPUTS = 2048


def embedding_inputs(value: Any, max_chars: int, *, field: str = "input"
                     ) -> list[str | list[int]]:
    """The inputs an embedding request gives, as OpenAI's `input` takes them: one string, a
    list of strings, one list of token IDs, or a list of such lists; at most
    MAX_EMBEDDING_INPUTS, none empty, each string storable text, not blank, of at most
    `max_chars` characters. Token IDs against the model's vocabulary and every input's length
    against its context are checked once tokenized (`check_embedding_prompt`)."""
    one_tokens = isinstance(value, list) and value and all(_is_token_id(item) for item in value)
    single = isinstance(value, str) or bool(one_tokens)
    if single:
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidJob(f"{field} must be a string, a list of strings, a list of token IDs "
                         "or a list of lists of token IDs, and not empty", field)
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise InvalidJob(f"{field} holds {len(value)} inputs, over the limit of "
                         f"{MAX_EMBEDDING_INPUTS}", field)
    inputs: list[str | list[int]] = []
    for index, item in enumerate(value):
        name = field if single else f"{field}[{index}]"
        if isinstance(item, str):
            inputs.append(_check_text(name, item, max_chars,
                                      setting="JOBSVC_MAX_DOCUMENT_CHARS"))
        elif isinstance(item, list) and item and all(_is_token_id(token) for token in item):
            inputs.append(list(item))
        else:
            raise InvalidJob(f"{name} must be a non-empty string or a non-empty list of token "
                             "IDs (non-negative integers)", name)
        if type(inputs[-1]) is not type(inputs[0]):
            raise InvalidJob(f"{name}: the inputs must be all strings or all lists of token "
                             "IDs", name)
    return inputs


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


def check_encoding_format(value: Any, *, field: str = "encoding_format") -> str:
    """How an embedding request asks its vectors written: `float` (the default) or `base64`."""
    if value is None:
        return "float"
    if value not in ("float", "base64"):
        raise InvalidJob(f"{field} must be 'float' or 'base64', got {value!r}", field)
    return str(value)


def check_dimensions(value: Any, supported: Sequence[int] | None, *,
                     field: str = "dimensions") -> int:
    """An embedding request's `dimensions`: a positive integer the model can cut its vectors
    to. `supported` is what the model's configuration says (`PromptBuilder.matryoshka`):
    None for a model that is no Matryoshka model, whose engine refuses any."""
    _in_range(field, value, 1, 1 << 20, integer=True)
    if supported is None:
        raise InvalidJob(f"{field}: the model does not support Matryoshka embeddings, so its "
                         "vectors cannot be cut; leave dimensions out", field)
    if value not in supported:
        listed = (f"from 1 to {supported[-1]}" if isinstance(supported, range)
                  else f"one of {sorted(supported)}")
        raise InvalidJob(f"{field} must be {listed} for this model, got {value}", field)
    return int(value)


def check_embedding_prompt(inputs: Sequence[Sequence[int]], context: int, vocabulary: int, *,
                           field: str = "input") -> None:
    """Check a tokenized embedding job against the model: each input holds at least one token,
    every token is of the model's `vocabulary` (its size), and each input, run as a request of
    its own, fits the `context` (ContextExceeded). A single input is named `field`, each of
    several `field[index]`."""
    for index, tokens in enumerate(inputs):
        name = field if len(inputs) == 1 else f"{field}[{index}]"
        if not tokens:
            raise InvalidJob(f"{name} holds no tokens", name)
        outside = [token for token in tokens if not 0 <= token < vocabulary]
        if outside:
            raise InvalidJob(f"{name} holds token {outside[0]}, outside the model's vocabulary "
                             f"of {vocabulary} tokens", name)
        if len(tokens) > context:
            raise ContextExceeded(f"{name} is {len(tokens)} tokens long, over the model's "
                                  f"context of {context} tokens; shorten it", name)
