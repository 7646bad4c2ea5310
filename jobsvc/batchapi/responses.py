"""The lines of a batch's output and error files, as OpenAI writes them: one JSON object per
request, `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`,
with `chat.completion` or `text_completion` bodies whose usage carries the cached tokens.
Pure: values in, JSON-ready dicts out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jobsvc.batchapi.requests import CHAT_ENDPOINT

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

    @property
    def finish_reason(self) -> str:
        """The recorded reason; for an older result, `length` when the answer used every
        token it was allowed, else `stop`."""
        if self.recorded_finish_reason is not None:
            return self.recorded_finish_reason
        return "length" if self.completion_tokens >= self.max_tokens else "stop"


def response_body(endpoint: str, answer: Answer, model: str) -> dict[str, Any]:
    """The body the endpoint would have answered the request with."""
    reason = answer.finish_reason
    if endpoint == CHAT_ENDPOINT:
        kind, prefix = "chat.completion", "chatcmpl"
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                          "content": answer.text},
                                  "finish_reason": reason, "logprobs": None}
    else:
        kind, prefix = "text_completion", "cmpl"
        choice = {"index": 0, "text": answer.text, "finish_reason": reason, "logprobs": None}
    return {
        "id": f"{prefix}-{answer.job_id}", "object": kind, "created": answer.created,
        "model": model, "choices": [choice],
        "usage": {"prompt_tokens": answer.prompt_tokens,
                  "completion_tokens": answer.completion_tokens,
                  "total_tokens": answer.prompt_tokens + answer.completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": answer.cached_tokens}},
    }


def output_line(line_id: str, custom_id: str, *, status_code: int | None = None,
                request_id: str | None = None, body: dict[str, Any] | None = None,
                error: dict[str, Any] | None = None) -> dict[str, Any]:
    """One line of an output or error file; `status_code` None: the request never ran."""
    response = (None if status_code is None else
                {"status_code": status_code, "request_id": request_id, "body": body})
    return {"id": line_id, "custom_id": custom_id, "response": response, "error": error}


def ended_error(ending: str) -> dict[str, str]:
    """The `error` of a request that the batch's end stopped: the window's end (`ending`
    "expired") or a cancel (any other)."""
    code = "batch_expired" if ending == "expired" else "batch_cancelled"
    return {"code": code, "message": ENDED_MESSAGES[code]}


def server_error(reason: str) -> dict[str, Any]:
    """The body of a request the service accepted but could not run."""
    return {"error": {"message": reason, "type": "server_error", "param": None,
                      "code": "job_failed"}}


def jsonl(line: dict[str, Any]) -> bytes:
    """A file line: compact JSON and a newline."""
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
