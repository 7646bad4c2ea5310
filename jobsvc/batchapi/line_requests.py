"""What one line of a batch file asks for, checked and mapped onto a job: the messages or the
prompt, and sampling settings in jobsvc's terms (those of vLLM's SamplingParams). A line that
asks for something wrong or unsupported fails alone, with an error naming the field, as an
OpenAI endpoint would answer it with a 400 (text that cannot be stored or tokenized was
refused before, with the line: `jobsvc.batchapi.lines`). What the request may ask for is
decided here; the values it gives are checked by `jobsvc.validation`, as every job's are.
Pure: plain values in, plain values out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jobsvc.batchapi.tool_calls import (
    NO_TOOLS,
    TOOL_ROLE,
    ToolPlan,
    check_tools,
    message_tool_fields,
)
from jobsvc.errors import InvalidJob
from jobsvc.validation import (
    JobLimits,
    Unsupported,
    check_encoding_format,
    check_model_name,
    check_sampling,
    check_sampling_value,
    embedding_inputs,
)

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
# Read as the chat request it amounts to (`jobsvc.batchapi.responses_requests`).
RESPONSES_ENDPOINT = "/v1/responses"
# One embedding job per line, whose inputs the engine embeds (`jobsvc.embeddings`).
EMBEDDINGS_ENDPOINT = "/v1/embeddings"
# OpenAI's defaults where jobsvc's own differ: sampling at temperature 1, and a completion of
# 16 tokens (a chat completion runs to the end of the context).
OPENAI_TEMPERATURE = 1.0
COMPLETIONS_MAX_TOKENS = 16
# Keys with the same meaning in the OpenAI request and in jobsvc's sampling, vLLM's extra
# ones included (a `response_format` becomes the `structured_outputs` constraint it asks for).
_SAMPLING_KEYS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
                  "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                  "response_format", "structured_outputs", "n", "logit_bias", "priority")
# Keys that change nothing about the answer here.
_IGNORED_KEYS = frozenset({"user", "metadata", "store", "service_tier", "stream_options"})
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          TOOL_ROLE: TOOL_ROLE}


class LineError(ValueError):
    """A line that fails alone: what a 400 from the endpoint would say."""

    def __init__(self, message: str, param: str | None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def to_api(self) -> dict[str, Any]:
        """The error as the `error` of an error file's line, as the endpoint's 400 would say it."""
        return {"message": str(self), "type": "invalid_request_error", "param": self.param,
                "code": self.code}


@dataclass(frozen=True)
class ChatRequest:
    """A chat line's request, checked and reduced to what the prompt and the engine need."""

    # Roles and text (content parts joined, `developer` is `system`), and what the template
    # is given of earlier tool calls and their results (`tool_calls.message_tool_fields`).
    messages: list[dict[str, Any]]
    sampling: dict[str, Any]
    # None: as many as the context leaves after the prompt.
    max_tokens: int | None
    # What `tools` and `tool_choice` ask of the prompt, the engine and the answer.
    tools: ToolPlan = NO_TOOLS
    # The model or adapter the line names; None: the fleet's default.
    model: str | None = None


@dataclass(frozen=True)
class EmbeddingRequest:
    """An embeddings line's request: its inputs (texts, or token IDs given as they are), the
    dimensions asked for (None: the model's own), and how the vectors are written out."""

    inputs: list[str | list[int]]
    dimensions: int | None
    encoding_format: str
    # The model the line names; None: the fleet's default.
    model: str | None = None


@dataclass(frozen=True)
class CompletionRequest:
    """A completions line's request, checked and reduced to what the prompt and the engine need."""

    prompt: str
    sampling: dict[str, Any]
    max_tokens: int
    # The model or adapter the line names; None: the fleet's default.
    model: str | None = None


def _unsupported(param: str, what: str) -> LineError:
    return LineError(f"{param}: {what} is not supported by this server", param,
                     "unsupported_parameter")


def _refuse_unsupported(body: Mapping[str, Any], endpoint: str) -> None:
    """Features jobsvc does not serve, each refused by name when the line asks for it."""
    if body.get("stream"):
        raise _unsupported("stream", "streaming")
    # Tools are given as `tools` and `tool_choice`, never as the legacy `functions`.
    if body.get("functions"):
        raise _unsupported("functions", "tool calling through functions (give tools)")
    if body.get("function_call") not in (None, "none"):
        raise _unsupported("function_call", "tool calling through function_call (give "
                           "tool_choice)")
    if endpoint == COMPLETIONS_ENDPOINT:
        if body.get("tools"):
            raise _unsupported("tools", "tool calling on completions (use the chat endpoint)")
        if body.get("tool_choice") not in (None, "none"):
            raise _unsupported("tool_choice", "tool calling on completions (use the chat "
                               "endpoint)")
        if body.get("echo"):
            raise _unsupported("echo", "echoing the prompt")
        if body.get("best_of") not in (None, 1, body.get("n", 1)):
            # The engine returns every choice it samples: best_of > n is not served by it.
            raise _unsupported("best_of", "best_of other than n (the engine returns every "
                               "sampled choice)")
        if body.get("suffix") is not None:
            raise _unsupported("suffix", "a suffix")


_HANDLED = {
    CHAT_ENDPOINT: frozenset({"model", "messages", "max_tokens", "max_completion_tokens",
                              "stop", "n", "stream", "tools", "functions", "tool_choice",
                              "function_call", "parallel_tool_calls", "logprobs",
                              "top_logprobs", "logit_bias", *_SAMPLING_KEYS, *_IGNORED_KEYS}),
    COMPLETIONS_ENDPOINT: frozenset({"model", "prompt", "max_tokens", "stop", "n", "stream",
                                     "logprobs", "logit_bias", "echo", "best_of", "suffix", "tools",
                                     "functions", "tool_choice", "function_call",
                                     "parallel_tool_calls", "top_logprobs", *_SAMPLING_KEYS,
                                     *_IGNORED_KEYS}),
    EMBEDDINGS_ENDPOINT: frozenset({"input", "model", "dimensions", "encoding_format", "user"}),
}


def _logprobs(body: Mapping[str, Any], endpoint: str) -> int | None:
    """How many alternatives per token the line asks log probabilities for, in vLLM's terms
    (None: no log probabilities): chat's `logprobs` flag with `top_logprobs`, completions'
    `logprobs` count."""
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if endpoint == COMPLETIONS_ENDPOINT:
        if top is not None:
            raise _unsupported("top_logprobs", "top_logprobs on completions (give logprobs "
                               "as a count)")
        return None if logprobs is None else logprobs
    if logprobs not in (None, True, False):
        raise LineError(f"logprobs must be true or false, got {logprobs!r}", "logprobs")
    if not logprobs:
        if top not in (None, 0):
            raise LineError("top_logprobs needs logprobs set to true", "top_logprobs")
        return None
    if top is None:
        return 0
    try:
        check_sampling_value("logprobs", top, 0, field="top_logprobs")
    except InvalidJob as error:
        raise LineError(str(error), error.field) from None
    return int(top)


def _sampling(body: Mapping[str, Any], endpoint: str, limits: JobLimits) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": OPENAI_TEMPERATURE}
    for name in _SAMPLING_KEYS:
        if body.get(name) is not None:
            sampling[name] = body[name]
    stop = body.get("stop")
    if stop is not None:
        sampling["stop"] = [stop] if isinstance(stop, str) else stop
    logprobs = _logprobs(body, endpoint)
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    try:
        checked = check_sampling(sampling, limits.max_stop_chars,
                                 priority_scheduling=limits.priority_scheduling)
    except Unsupported as error:
        raise LineError(str(error), error.field, "unsupported_parameter") from None
    except InvalidJob as error:
        raise LineError(str(error), error.field) from None
    return checked


def _max_tokens(body: Mapping[str, Any], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = body.get(name)
        if value is not None:
            try:
                check_sampling_value("max_tokens", value, 0, field=name)
            except InvalidJob as error:
                raise LineError(str(error), error.field) from None
            return int(value)
    return None


def _text_content(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise LineError(f"messages[{index}].content must be text or a list of text parts",
                        f"messages[{index}].content")
    texts = []
    for part_index, part in enumerate(content):
        param = f"messages[{index}].content[{part_index}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _unsupported(f"{param}.type", f"content of type {kind!r} (only text is)")
        if not isinstance(part.get("text"), str):
            raise LineError(f"{param}.text must be a string", f"{param}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise LineError("messages must be a non-empty list", "messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise LineError(f"messages[{index}] must be an object", f"messages[{index}]")
        role = message.get("role")
        if role not in _ROLES:
            raise _unsupported(f"messages[{index}].role", f"the role {role!r}")
        try:
            tool_fields = message_tool_fields(index, message)
        except InvalidJob as error:
            raise _line_error(error) from None
        content = message.get("content")
        # An assistant's turn that only calls tools may leave its text out.
        text = "" if content is None and "tool_calls" in tool_fields else _text_content(
            index, content)
        messages.append({"role": _ROLES[role], "content": text, **tool_fields})
    return messages


def _tool_plan(body: Mapping[str, Any], sampling: Mapping[str, Any],
               limits: JobLimits) -> ToolPlan:
    """The plan of a chat line's `tools`, `tool_choice` and `parallel_tool_calls`."""
    try:
        return check_tools(body.get("tools"), body.get("tool_choice"),
                           parser=limits.tool_call_parser,
                           parallel_tool_calls=body.get("parallel_tool_calls"),
                           structured_outputs=sampling.get("structured_outputs"))
    except InvalidJob as error:
        raise _line_error(error) from None


def _line_error(error: InvalidJob) -> LineError:
    """A check's refusal as the line's: Unsupported is an unsupported parameter."""
    code = "unsupported_parameter" if isinstance(error, Unsupported) else "invalid_value"
    return LineError(str(error), error.field, code)


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        raise LineError("prompt must be one non-empty string (lists of prompts and token IDs "
                        "are not supported)", "prompt")
    return value


def _embedding_request(body: Mapping[str, Any], limits: JobLimits,
                       model: str | None) -> EmbeddingRequest:
    """An embeddings line's inputs and options; whether the model can cut its vectors to
    `dimensions` is known with the model, at ingest."""
    dimensions = body.get("dimensions")
    try:
        inputs = embedding_inputs(body.get("input"), limits.max_document_chars)
        if dimensions is not None:
            check_sampling_value("max_tokens", dimensions, 0, field="dimensions")
        return EmbeddingRequest(inputs, dimensions, check_encoding_format(
            body.get("encoding_format")), model)
    except InvalidJob as error:
        raise _line_error(error) from None


def parse_request(endpoint: str, body: Mapping[str, Any], *, limits: JobLimits
                  ) -> ChatRequest | CompletionRequest | EmbeddingRequest:
    """The request a line's body makes of `endpoint`, or LineError naming the field. Whether
    the fleet serves the model it names is checked as the line becomes a job."""
    try:
        model = check_model_name(body.get("model"))
    except InvalidJob as error:
        raise LineError(str(error), "model") from None
    unknown = sorted(set(body) - _HANDLED[endpoint])
    if unknown:
        raise _unsupported(unknown[0], f"the parameter {unknown[0]!r}")
    if endpoint == EMBEDDINGS_ENDPOINT:
        return _embedding_request(body, limits, model)
    _refuse_unsupported(body, endpoint)
    sampling = _sampling(body, endpoint, limits)
    if endpoint == CHAT_ENDPOINT:
        tools = _tool_plan(body, sampling, limits)
        if tools.constraint is not None:
            # The calls' schema replaces any constraint of the line's own, as in vLLM.
            sampling = {**sampling, "structured_outputs": tools.constraint}
        return ChatRequest(_messages(body.get("messages")), sampling,
                           _max_tokens(body, ("max_completion_tokens", "max_tokens")), tools,
                           model)
    max_tokens = _max_tokens(body, ("max_tokens",))
    return CompletionRequest(_prompt(body.get("prompt")), sampling,
                             COMPLETIONS_MAX_TOKENS if max_tokens is None else max_tokens, model)
