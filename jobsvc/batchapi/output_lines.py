"""Every shape a batch request's end takes on its way out, made here alone: the line of a
batch's output or error file as OpenAI writes it (`{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`, with `chat.completion` or `text_completion`
bodies whose usage carries the cached tokens), and the same line as `vllm run-batch` writes it.
Both shapes come from one typed `FinishedLine`, so they cannot drift apart.
Pure: typed values in, JSON-ready dicts out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jobsvc.batchapi.line_requests import CHAT_ENDPOINT
from jobsvc.choices import Choice

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
    # The most likely alternatives per token the request asked log probabilities for (None:
    # no log probabilities).
    top_logprobs: int | None = None

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


def response_body(endpoint: str, answer: Answer, model: str) -> dict[str, Any]:
    """The body the endpoint would have answered the request with."""
    if endpoint == CHAT_ENDPOINT:
        kind, prefix = "chat.completion", "chatcmpl"
        choices = [{"index": index, "message": {"role": "assistant", "content": choice.text},
                    "finish_reason": answer.reason(choice),
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
    """The line as `vllm run-batch` writes it: an error carries its status in the response
    and vLLM's error object beside it, with the status code as its `code`."""
    line_id, request_id = f"vllm-{line.request}", f"vllm-batch-{line.request}"
    outcome = line.outcome
    if isinstance(outcome, Unrun):
        return _line(line_id, line.custom_id, None,
                     {"error": {**outcome.error, "type": "BatchError", "param": None}})
    if isinstance(outcome, Answer):
        return _line(line_id, line.custom_id,
                     {"status_code": 200, "request_id": request_id,
                      "body": response_body(endpoint, outcome, model)}, None)
    status, error = _error_response(outcome)
    return _line(line_id, line.custom_id,
                 {"status_code": status, "request_id": request_id, "body": None},
                 {"error": {**error, "code": status}})


def jsonl(line: dict[str, Any]) -> bytes:
    """A file line: compact JSON and a newline."""
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
