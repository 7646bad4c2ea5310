"""The text subset of OpenAI's Responses API as a batch endpoint: a `/v1/responses` line's body
is read as the chat-completions body it amounts to, so that one parser (`line_requests`)
decides what a request may ask for and one validator checks its values, and the chat fields
named by an error found there are named back as the Responses fields the line used. Its
answer is shaped as a Response object by the one renderer (`output_lines`).
What the Responses API has beyond text in, text out (tools, reasoning, stored conversations,
streaming, input items that are not text messages) is refused by the field's path.
Pure: plain values in, plain values out."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jobsvc.batchapi.line_requests import LineError

# Keys passed to the chat body as they are: OpenAI's, then the extra sampling keys that vLLM's
# own Responses endpoint takes (and jobsvc's chat lines take too).
_SAME_KEYS = ("model", "temperature", "top_p", "metadata", "top_k", "min_p",
              "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
              "ignore_eos")
# Keys translated into other chat keys.
_TRANSLATED_KEYS = ("input", "instructions", "max_output_tokens", "text")
# Keys that change nothing about the answer here, whatever their value; the strings among
# them must be strings, as in OpenAI's Response object.
_IGNORED_KEYS = ("user", "safety_identifier", "prompt_cache_key", "store", "service_tier",
                 "parallel_tool_calls")
_ECHOED_STRINGS = ("user", "safety_identifier", "prompt_cache_key")
# Features not served: each key with what it asks for and the values that ask for nothing
# (null always does).
_FEATURES: dict[str, tuple[str, tuple[Any, ...]]] = {
    "tools": ("tool calling", ([],)),
    "tool_choice": ("tool calling", ("none", "auto")),
    "max_tool_calls": ("tool calling", ()),
    "reasoning": ("reasoning settings", ({},)),
    "include": ("extra output items (include)", ([],)),
    "top_logprobs": ("log probabilities", (0,)),
    "stream": ("streaming", (False,)),
    "background": ("background mode", (False,)),
    "previous_response_id": ("continuing a stored response", ()),
    "conversation": ("conversations", ()),
    "prompt": ("prompt templates", ()),
    "truncation": ("truncating the input", ("disabled",)),
}
_KNOWN_KEYS = frozenset({*_SAME_KEYS, *_TRANSLATED_KEYS, *_IGNORED_KEYS, *_FEATURES})

_ROLES = ("user", "system", "developer", "assistant")
# An input message's keys; `id`, `status` and `phase` are what an output message given back
# as input carries, and change nothing.
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
# A text part's keys by its type; an assistant's text is `output_text`, any other role's
# `input_text`. Annotations and log probabilities of a past answer change nothing.
_PART_KEYS = {"input_text": frozenset({"type", "text"}),
              "output_text": frozenset({"type", "text", "annotations", "logprobs"})}
# `text.format`'s keys by its type.
_FORMAT_KEYS = {"text": frozenset({"type"}), "json_object": frozenset({"type"}),
                "json_schema": frozenset({"type", "name", "schema", "strict", "description"})}

# A chat field's name, where an error message says it: `messages[2].content[0].text`,
# `max_tokens`, `response_format.json_schema.name`.
_CHAT_NAME = re.compile(r"(?<![\w.\]])(?:messages(?:\[\d+\](?:\.\w+|\[\d+\])*)?"
                        r"|max_completion_tokens|max_tokens|response_format(?:\.\w+)*)"
                        r"(?![\w\[])")
_CHAT_MESSAGE = re.compile(r"messages\[(\d+)\](.*)")


def _unsupported(param: str, what: str) -> LineError:
    return LineError(f"{param}: {what} is not supported by this server", param,
                     "unsupported_parameter")


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    unknown = sorted(set(body) - _KNOWN_KEYS)
    if unknown:
        raise _unsupported(unknown[0], f"the parameter {unknown[0]!r}")
    for name, (what, asks_nothing) in _FEATURES.items():
        value = body.get(name)
        if value is not None and value not in asks_nothing:
            raise _unsupported(name, what)


def _text_part(where: str, part: Any, kind: str) -> dict[str, str]:
    if not isinstance(part, Mapping):
        raise LineError(f"{where} must be an object (a content part)", where)
    given = part.get("type")
    if given != kind:
        if given in _PART_KEYS:
            raise LineError(f"{where}.type must be {kind!r} in this message, got {given!r}",
                            f"{where}.type")
        raise _unsupported(f"{where}.type", f"content of type {given!r} (only text is)")
    extra = sorted(set(part) - _PART_KEYS[kind])
    if extra:
        raise _unsupported(f"{where}.{extra[0]}", f"the content part field {extra[0]!r}")
    if not isinstance(part.get("text"), str):
        raise LineError(f"{where}.text must be a string", f"{where}.text")
    return {"type": "text", "text": part["text"]}


def _chat_message(index: int, item: Any) -> dict[str, Any]:
    where = f"input[{index}]"
    if not isinstance(item, Mapping):
        raise LineError(f"{where} must be an object (a message)", where)
    kind = item.get("type", "message")
    if kind != "message":
        raise _unsupported(f"{where}.type",
                           f"an input item of type {kind!r} (only a message of text is)")
    extra = sorted(set(item) - _MESSAGE_KEYS)
    if extra:
        raise _unsupported(f"{where}.{extra[0]}", f"the message field {extra[0]!r}")
    role = item.get("role")
    if role not in _ROLES:
        raise LineError(f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}",
                        f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or not content:
        raise LineError(f"{where}.content must be text or a non-empty list of text parts",
                        f"{where}.content")
    kind = "output_text" if role == "assistant" else "input_text"
    return {"role": role, "content": [_text_part(f"{where}.content[{part_index}]", part, kind)
                                      for part_index, part in enumerate(content)]}


def _instructions(body: Mapping[str, Any]) -> str | None:
    """The instructions that lead the conversation as its system message, if any (an empty
    string leads nothing, as in vLLM's endpoint)."""
    instructions = body.get("instructions")
    return instructions if isinstance(instructions, str) and instructions else None


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise LineError("instructions must be a string", "instructions")
    value = body.get("input")
    if value is None:
        raise LineError("input is required: a string or a list of message items", "input",
                        "missing_required_parameter")
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value:
        messages = [_chat_message(index, item) for index, item in enumerate(value)]
    else:
        raise LineError("input must be a string or a non-empty list of message items", "input")
    leading = _instructions(body)
    return messages if leading is None else [{"role": "system", "content": leading},
                                             *messages]


def _response_format(text: Any) -> dict[str, Any] | None:
    """Chat's `response_format` for the Responses `text` setting; its values are checked
    where every `response_format` is."""
    if text is None:
        return None
    if not isinstance(text, Mapping):
        raise LineError("text must be an object with a `format`", "text")
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise _unsupported(f"text.{extra[0]}", f"the text setting {extra[0]!r}")
    if text.get("verbosity") not in (None, "medium"):
        raise _unsupported("text.verbosity", "a verbosity other than 'medium'")
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise LineError("text.format must be an object with a `type`", "text.format")
    kind = spec.get("type")
    if kind not in _FORMAT_KEYS:
        raise LineError(f"text.format.type must be one of {', '.join(_FORMAT_KEYS)}; got "
                        f"{kind!r}", "text.format.type")
    extra = sorted(set(spec) - _FORMAT_KEYS[kind])
    if extra:
        raise _unsupported(f"text.format.{extra[0]}", f"the format field {extra[0]!r}")
    if kind != "json_schema":
        return {"type": kind}
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise LineError("text.format.description must be a string", "text.format.description")
    return {"type": kind, "json_schema": {key: spec[key] for key in
                                          ("name", "schema", "strict", "description")
                                          if key in spec}}


def _check_echoed(body: Mapping[str, Any]) -> None:
    """Fields OpenAI's Response object types (strings, a map of strings) must have that
    type, as OpenAI's endpoint checks them, though they change nothing here."""
    for name in _ECHOED_STRINGS:
        if body.get(name) is not None and not isinstance(body[name], str):
            raise LineError(f"{name} must be a string", name)
    metadata = body.get("metadata")
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise LineError("metadata must be an object of string values", "metadata")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise LineError(f"metadata.{key} must be a string", f"metadata.{key}")


# Responses body --> chat-completions body
def chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions body a Responses body amounts to, for `line_requests` to parse; or
    LineError naming the Responses field that is wrong or not served. Errors found in the
    result name chat fields: `responses_error` names them back."""
    _refuse_unsupported(body)
    _check_echoed(body)
    chat: dict[str, Any] = {"messages": _messages(body)}
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if (response_format := _response_format(body.get("text"))) is not None:
        chat["response_format"] = response_format
    chat.update((name, body[name]) for name in _SAME_KEYS if body.get(name) is not None)
    return chat


def responses_param(chat_param: str | None, body: Mapping[str, Any]) -> str | None:
    """The field of the Responses `body` that the field `chat_param` of `chat_body(body)` came
    from (`messages[1].content` is `input[0].content` after instructions)."""
    if chat_param is None:
        return None
    if chat_param in ("max_completion_tokens", "max_tokens"):
        return "max_output_tokens"
    if chat_param == "messages":
        return "input"
    if chat_param == "response_format" or chat_param.startswith("response_format."):
        rest = chat_param.removeprefix("response_format").removeprefix(".json_schema")
        return f"text.format{rest}"
    found = _CHAT_MESSAGE.fullmatch(chat_param)
    if found is None:
        return chat_param
    index = int(found[1]) - (_instructions(body) is not None)
    if index < 0:
        return "instructions"
    if isinstance(body.get("input"), str):
        return "input"
    return f"input[{index}]{found[2]}"


def responses_error(error: LineError, body: Mapping[str, Any]) -> LineError:
    """An error found in `chat_body(body)` (by `parse_request`, the chat template or the prompt
    check) as the Responses endpoint says it: its param and the chat fields its message names
    are the Responses fields they came from."""
    message = _CHAT_NAME.sub(lambda name: responses_param(name[0], body) or name[0], str(error))
    return LineError(message, responses_param(error.param, body), error.code)
