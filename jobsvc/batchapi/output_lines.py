"""Every shape a batch request's end takes on its way out, made here alone: the line of a
batch's output or error file as OpenAI writes it (`{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`, with `chat.completion` or `text_completion`
bodies whose usage carries the cached tokens, or lists of embeddings), and the same line as
`vllm run-batch` writes it.
Both shapes come from one typed `FinishedLine`, so they cannot drift apart.
Pure: typed values in, JSON-ready dicts out."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from jobsvc.batchapi.line_requests import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    EMBEDDINGS_ENDPOINT,
    RESPONSES_ENDPOINT,
)
from jobsvc.batchapi.tool_calls import OPENAI_CALL_ID_PREFIX, VLLM_CALL_ID_PREFIX, ToolAnswer
from jobsvc.choices import Choice
from jobsvc.embeddings import base64_vector, encoding_format

ENDED_MESSAGES = {
    "batch_cancelled": "The batch was cancelled before this request finished.",
    "batch_expired": "This request could not be executed before the completion window "
                     "expired.",
}


@dataclass(frozen=True)
class Answer:
    """What a succeeded job gives its request's response."""

    job_id: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    max_tokens: int
    created: int
    # The engine's own reason, as recorded; None for results recorded before reasons were.
    recorded_finish_reason: str | None = None
    # Every choice, when the job asked for several or for log probabilities; else the text
    # is the one choice.
    choices: tuple[Choice, ...] = ()
    # The job's sampling as stored, for a response that gives the request's settings back.
    sampling: Mapping[str, Any] = field(default_factory=dict)
    # Each choice's answer read as tool calls, by index, when the request's tools make calls
    # (`tool_calls.tool_answer`); empty: every choice is text.
    tool_answers: tuple[ToolAnswer, ...] = ()
    # Prompt tokens the request wrote into the engine's prefix cache (None: not recorded).
    created_cache_tokens: int | None = None
    # An embedding request's vectors, one per input in order; None for any other request.
    embeddings: list[list[float]] | None = None

    @property
    def top_logprobs(self) -> int | None:
        """The most likely alternatives per token the request asked log probabilities for
        (None: no log probabilities), as its job's sampling holds it."""
        value = self.sampling.get("logprobs")
        return None if value is None else int(value)

    @property
    def finish_reason(self) -> str:
        """The first choice's reason."""
        return self._reason(self.recorded_finish_reason, self.completion_tokens)

    @property
    def every_choice(self) -> tuple[Choice, ...]:
        """The answer's choices, one at least."""
        return self.choices or (Choice(self.text, self.recorded_finish_reason,
                                       self.completion_tokens),)

    def reason(self, choice: Choice) -> str:
        """Why a choice ended, as recorded; for an older result, `length` when it used every
        token it was allowed, else `stop`."""
        return self._reason(choice.finish_reason, choice.completion_tokens)

    def _reason(self, recorded: str | None, tokens: int) -> str:
        if recorded is not None:
            return recorded
        return "length" if tokens >= self.max_tokens else "stop"


@dataclass(frozen=True)
class Refused:
    """A request its endpoint answered with an error object (a 400 for its content)."""

    status_code: int
    error: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """A request the service accepted but could not run: its job failed for `reason`."""

    reason: str


@dataclass(frozen=True)
class Unrun:
    """A request the batch's end stopped before it ran; `error` is `{"code", "message"}`."""

    error: dict[str, Any]


Outcome = Answer | Refused | Failed | Unrun


@dataclass(frozen=True)
class FinishedLine:
    """One request of a batch at the batch's end: which it is and what came of it."""

    # What the line's IDs end with: its job's ID, or one made for a line without a job.
    request: str
    custom_id: str
    outcome: Outcome


def ended_error(ending: str) -> dict[str, str]:
    """The `error` of a request that the batch's end stopped: the window's end (`ending`
    "expired") or a cancel (any other)."""
    code = "batch_expired" if ending == "expired" else "batch_cancelled"
    return {"code": code, "message": ENDED_MESSAGES[code]}


def response_body(endpoint: str, answer: Answer, model: str, *,
                  call_ids: str = OPENAI_CALL_ID_PREFIX) -> dict[str, Any]:
    """The body the endpoint would have answered the request with; a chat answer's tool
    calls have IDs starting with `call_ids` (OpenAI's `call_`, vLLM's `chatcmpl-tool-`)."""
    if endpoint == RESPONSES_ENDPOINT:
        return _response_object(answer, model)
    if endpoint == EMBEDDINGS_ENDPOINT:
        return _embedding_list(answer, model)
    if endpoint == CHAT_ENDPOINT:
        kind, prefix = "chat.completion", "chatcmpl"
        choices = [{"index": index, **_chat_message(answer, index, choice, call_ids),
                    "logprobs": _chat_logprobs(choice, answer.top_logprobs)}
                   for index, choice in enumerate(answer.every_choice)]
    else:
        kind, prefix = "text_completion", "cmpl"
        choices = [{"index": index, "text": choice.text, "finish_reason": answer.reason(choice),
                    "logprobs": _completion_logprobs(choice, answer.top_logprobs)}
                   for index, choice in enumerate(answer.every_choice)]
    return {
        "id": f"{prefix}-{answer.job_id}", "object": kind, "created": answer.created,
        "model": model, "choices": choices,
        "usage": {"prompt_tokens": answer.prompt_tokens,
                  "completion_tokens": answer.completion_tokens,
                  "total_tokens": answer.prompt_tokens + answer.completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": answer.cached_tokens}},
    }


# Answer --> the Response object of a /v1/responses request
def _response_object(answer: Answer, model: str) -> dict[str, Any]:
    """OpenAI's Response object: one assistant message of output text, `incomplete` when the
    answer ran out of `max_output_tokens`. The settings it gives back are the job's as
    stored; what the store does not keep of the request (instructions, metadata, a schema's
    name) is given back as OpenAI gives it for a request without it."""
    incomplete = answer.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    sampling = answer.sampling
    return {
        "id": f"resp_{answer.job_id}", "object": "response", "created_at": answer.created,
        "status": status, "background": False,
        "completed_at": None if incomplete else answer.created, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": None, "max_output_tokens": answer.max_tokens, "max_tool_calls": None,
        "metadata": {}, "model": model,
        "output": [{"type": "message", "id": f"msg_{answer.job_id}", "status": status,
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": answer.text,
                                 "annotations": [], "logprobs": []}]}],
        "parallel_tool_calls": True, "previous_response_id": None, "reasoning": None,
        "service_tier": "default", "temperature": sampling.get("temperature", 1.0),
        "text": {"format": _text_format(sampling.get("structured_outputs"))},
        "tool_choice": "auto", "tools": [], "top_logprobs": 0,
        "top_p": sampling.get("top_p", 1.0), "truncation": "disabled",
        "usage": {
            "input_tokens": answer.prompt_tokens,
            "input_tokens_details": {"cached_tokens": answer.cached_tokens,
                                     "cache_write_tokens": answer.created_cache_tokens or 0},
            "output_tokens": answer.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + answer.completion_tokens},
        "user": None, "safety_identifier": None, "prompt_cache_key": None,
    }


# Answer --> the embedding list of a /v1/embeddings request
def _embedding_list(answer: Answer, model: str) -> dict[str, Any]:
    """OpenAI's list of embeddings: one per input, in order, as numbers or (`encoding_format`
    base64) as base64 of little-endian float32; usage counts the inputs' tokens."""
    as_base64 = encoding_format(answer.sampling) == "base64"
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": index,
                  "embedding": base64_vector(vector) if as_base64 else vector}
                 for index, vector in enumerate(answer.embeddings or [])],
        "model": model,
        "usage": {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens},
    }


def _text_format(constraint: Mapping[str, Any] | None) -> dict[str, Any]:
    """`text.format` as the job's stored constraint asks for it (the schema's name is not
    kept: `response`)."""
    if constraint is None:
        return {"type": "text"}
    if constraint.get("json_object"):
        return {"type": "json_object"}
    schema = constraint.get("json")
    if isinstance(schema, str):
        schema = json.loads(schema)
    return {"type": "json_schema", "name": "response", "schema": schema, "strict": None}


# Choice --> a chat choice's message, its text or its tool calls
def _chat_message(answer: Answer, index: int, choice: Choice,
                  call_ids: str) -> dict[str, Any]:
    """A chat choice's `message` and `finish_reason`: the text as it is, or the tool calls it
    was read as (each choice's IDs its own, made from the job and the choice's index)."""
    if not answer.tool_answers:
        return {"message": {"role": "assistant", "content": choice.text},
                "finish_reason": answer.reason(choice)}
    read = answer.tool_answers[index]
    message: dict[str, Any] = {"role": "assistant", "content": read.content}
    if read.calls:
        message["tool_calls"] = read.tool_calls(f"{answer.job_id}-{index}", call_ids)
    return {"message": message, "finish_reason": read.finish_reason}


# Choice --> a choice's `logprobs`, as each endpoint shapes them
def _chat_logprobs(choice: Choice, top: int | None) -> dict[str, Any] | None:
    """Chat's shape: each token with its bytes and the `top` most likely alternatives."""
    if top is None or choice.logprobs is None:
        return None
    return {"content": [
        {**_chat_token(step.token, step.logprob),
         "top_logprobs": [_chat_token(token, logprob) for token, logprob in step.top[:top]]}
        for step in choice.logprobs]}


def _chat_token(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob,
            "bytes": list(token.encode("utf-8", errors="replace"))}


def _completion_logprobs(choice: Choice, top: int | None) -> dict[str, Any] | None:
    """Completions' shape: parallel lists of tokens, their log probabilities, each step's
    most likely tokens with the sampled one among them (up to `top` + 1, as OpenAI's
    endpoint gives), and where each token starts in the text."""
    if top is None or choice.logprobs is None:
        return None
    offsets, offset = [], 0
    for step in choice.logprobs:
        offsets.append(offset)
        offset += len(step.token)
    return {"tokens": [step.token for step in choice.logprobs],
            "token_logprobs": [step.logprob for step in choice.logprobs],
            "top_logprobs": [{**dict(step.top[:top]), step.token: step.logprob}
                             for step in choice.logprobs],
            "text_offset": offsets}


def _error_response(outcome: Refused | Failed) -> tuple[int, dict[str, Any]]:
    """The status code and error object of a request that ran into an error."""
    if isinstance(outcome, Refused):
        return outcome.status_code, outcome.error
    return 500, {"message": outcome.reason, "type": "server_error", "param": None,
                 "code": "job_failed"}


def _line(line_id: str, custom_id: str, response: dict[str, Any] | None,
          error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": error}


# FinishedLine --> a line of the batch's output or error file, as OpenAI writes it
def openai_line(line: FinishedLine, *, endpoint: str, model: str) -> dict[str, Any]:
    """The line as OpenAI's Batch API writes it: a request that ran has a `response` (its
    error object in the body, if any); one that never ran has an `error` alone."""
    line_id, request_id = f"batch_req_{line.request}", f"req_{line.request}"
    outcome = line.outcome
    if isinstance(outcome, Unrun):
        return _line(line_id, line.custom_id, None, outcome.error)
    if isinstance(outcome, Answer):
        status, body = 200, response_body(endpoint, outcome, model)
    else:
        status, error = _error_response(outcome)
        body = {"error": error}
    return _line(line_id, line.custom_id,
                 {"status_code": status, "request_id": request_id, "body": body}, None)


# FinishedLine --> a line of `vllm run-batch`'s output file
def vllm_line(line: FinishedLine, *, endpoint: str, model: str) -> dict[str, Any]:
    """The line as `vllm run-batch` writes it: an answer's body carries vLLM's own fields as
    well; an error carries its status in the response and vLLM's error object beside it, with
    the status code as its `code`."""
    line_id, request_id = f"vllm-{line.request}", f"vllm-batch-{line.request}"
    outcome = line.outcome
    if isinstance(outcome, Unrun):
        return _line(line_id, line.custom_id, None,
                     {"error": {**outcome.error, "type": "BatchError", "param": None}})
    if isinstance(outcome, Answer) and endpoint == EMBEDDINGS_ENDPOINT:
        body = _as_vllm_embedding_list(response_body(endpoint, outcome, model), outcome)
        return _line(line_id, line.custom_id,
                     {"status_code": 200, "request_id": request_id, "body": body}, None)
    if isinstance(outcome, Answer):
        body = _as_vllm_body(endpoint, response_body(endpoint, outcome, model,
                                                     call_ids=VLLM_CALL_ID_PREFIX),
                             [choice.stop_reason for choice in outcome.every_choice],
                             outcome.created_cache_tokens)
        return _line(line_id, line.custom_id,
                     {"status_code": 200, "request_id": request_id, "body": body}, None)
    status, error = _error_response(outcome)
    return _line(line_id, line.custom_id,
                 {"status_code": status, "request_id": request_id, "body": None},
                 {"error": {**error, "code": status}})


def jsonl(line: dict[str, Any]) -> bytes:
    """A file line: compact JSON and a newline."""
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


# An answer's body --> the same body as vLLM's server writes it
# What the lines name as the system that answered: the engines' configuration lives with each
# worker, not with the process that writes the lines, so the lines name jobsvc's release.
_FINGERPRINT = f"jobsvc-{metadata.version('jobsvc')}"
# vLLM's fields of each part of a body, in its order. Those the renderer does not write are
# null in every line: vLLM fills them only for what a request asks and jobsvc refuses (token
# IDs, prompt log probabilities, transfers, metrics, a tier, a reasoning parser, media).
_BODY = {
    CHAT_ENDPOINT: ("id", "object", "created", "model", "choices", "service_tier",
                    "system_fingerprint", "usage", "prompt_logprobs", "prompt_token_ids",
                    "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics"),
    COMPLETIONS_ENDPOINT: ("id", "object", "created", "model", "choices", "service_tier",
                           "system_fingerprint", "usage", "kv_transfer_params",
                           "ec_transfer_params", "metrics"),
}
_CHOICE = {
    CHAT_ENDPOINT: ("index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids",
                    "routed_experts"),
    COMPLETIONS_ENDPOINT: ("index", "text", "logprobs", "finish_reason", "stop_reason",
                           "token_ids", "prompt_logprobs", "prompt_token_ids",
                           "routed_experts"),
}
# Without its `tool_calls`, which vLLM leaves out when there are none.
_MESSAGE = ("role", "content", "refusal", "annotations", "audio", "function_call", "reasoning")
_USAGE = ("prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
          "completion_tokens_details")
_PROMPT_TOKENS = ("cached_tokens", "created_cache_tokens", "multimodal_tokens")


def _as_vllm_body(endpoint: str, body: dict[str, Any],
                  stop_reasons: Sequence[str | int | None],
                  created_cache_tokens: int | None) -> dict[str, Any]:
    """`body` with every field vLLM's server writes for the endpoint, each in vLLM's order:
    the system's name, each choice's stop reason (`stop_reasons`, by index), the prompt
    tokens the request wrote into the cache, and null for the rest the body lacks. Only
    adds: what the answer says is the renderer's alone. A body of any other endpoint comes
    back as it is."""
    if endpoint not in _BODY:
        return body
    choices = []
    for choice, stop_reason in zip(body["choices"], stop_reasons, strict=True):
        added: dict[str, Any] = {"stop_reason": stop_reason}
        if endpoint == CHAT_ENDPOINT:
            added["message"] = _with_fields(choice["message"], _MESSAGE)
        choices.append(_with_fields({**choice, **added}, _CHOICE[endpoint]))
    usage = body["usage"]
    usage = _with_fields({**usage, "prompt_tokens_details": _with_fields(
        {**usage["prompt_tokens_details"], "created_cache_tokens": created_cache_tokens},
        _PROMPT_TOKENS)}, _USAGE)
    return _with_fields({**body, "choices": choices, "system_fingerprint": _FINGERPRINT,
                         "usage": usage}, _BODY[endpoint])


_EMBEDDING_LIST = ("id", "object", "created", "model", "data", "usage")
_EMBEDDING = ("index", "object", "embedding")


def _as_vllm_embedding_list(body: dict[str, Any], answer: Answer) -> dict[str, Any]:
    """An embedding list as vLLM's server writes it: with its ID and time, each field in
    vLLM's order, and a usage with no completion tokens and no token details."""
    return _with_fields({
        **body, "id": f"embd-{answer.job_id}", "created": answer.created,
        "data": [_with_fields(item, _EMBEDDING) for item in body["data"]],
        "usage": _with_fields({**body["usage"], "completion_tokens": 0}, _USAGE)},
        _EMBEDDING_LIST)


def _with_fields(found: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """`found` with each of `fields` it lacks as null, in the order of `fields` (what `found`
    has besides comes after)."""
    return {**dict.fromkeys(fields), **found}
