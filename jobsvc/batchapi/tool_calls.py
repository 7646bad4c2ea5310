"""Tool calling on chat lines, served as vLLM's OpenAI server serves it. A line's `tools` go to
the chat template, and its `tool_choice` decides what the answer is made of:

- a named function: the answer is held to that function's parameter schema and becomes the
  arguments of one call to it;
- `required`: the answer is held to a JSON array of `{"name", "parameters"}` objects, each
  naming one of the tools with arguments of its schema, and becomes one call per element;
- `auto` (the default when tools are given): the configured tool-call parser (vLLM's parser
  names, e.g. `hermes`) finds the calls in free text; with no parser configured the answer is
  text;
- `none`: text.

vLLM holds named and required choices to these schemas with its JSON tool-call path (the one
its JSON-based parsers use, and every parser when VLLM_ENFORCE_STRICT_TOOL_CALLING is off);
its other path, a structural tag in the model's own call syntax, is not served here, so these
choices need no parser. Earlier turns of a conversation may hold an assistant's `tool_calls`
and `tool` results: they reach the template as vLLM hands them over, arguments decoded to
objects.

Errors are InvalidJob (Unsupported for what is not served) naming the field, as the request's
sampling checks raise them. Pure, except `auto` with a parser, which runs vLLM's parser."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

from jobsvc.errors import InvalidJob
from jobsvc.validation import Unsupported, check_sampling_value

# The choices a plan can hold; a named function is FUNCTION with the plan's `function`.
NONE, AUTO, REQUIRED, FUNCTION = "none", "auto", "required", "function"
# How tool calls are named in each shape of answer: vLLM's server and OpenAI's API.
VLLM_CALL_ID_PREFIX = "chatcmpl-tool-"
OPENAI_CALL_ID_PREFIX = "call_"
TOOL_ROLE = "tool"
_CALL_ID_DIGITS = 32
_NAMED_USAGE = 'give {"type": "function", "function": {"name": "<one of the tools>"}}'
# Constraints vLLM will not combine with a named function (it replaces the others).
_EXCLUSIVE_CONSTRAINTS = ("json", "regex", "choice")


@dataclass(frozen=True)
class ToolPlan:
    """What a line's `tools` and `tool_choice` ask of the prompt, the engine and the answer.
    Plain values only, so a plan can be stored with its job and read back."""

    choice: str = NONE
    # The tools as the chat template is given them; None without tools.
    tools: list[dict[str, Any]] | None = None
    # vLLM's `structured_outputs` constraint for the answer; it replaces the line's own.
    # None: the line's own constraint, if any, stays.
    constraint: dict[str, Any] | None = None
    # The function a named choice calls.
    function: str | None = None
    # vLLM's tool-call parser for `auto`; None: the answer is text.
    parser: str | None = None
    # `parallel_tool_calls: false`: at most one call.
    single_call: bool = False

    @property
    def makes_calls(self) -> bool:
        """Whether the answer is turned into tool calls (else it is text)."""
        return self.choice in (FUNCTION, REQUIRED) or (self.choice == AUTO
                                                       and self.parser is not None)


NO_TOOLS = ToolPlan()


def stored_plan(plan: ToolPlan) -> dict[str, Any] | None:
    """What is kept of a plan for its answer to be read at the batch's end: the plan as JSON,
    or None when the answer is text as it is (no tools, `none`, `auto` without a parser)."""
    return asdict(plan) if plan.makes_calls else None


def plan_of(stored: Mapping[str, Any]) -> ToolPlan:
    """A plan as `stored_plan` kept it."""
    return ToolPlan(**stored)


@dataclass(frozen=True)
class ToolAnswer:
    """The assistant message's parts for an answer, and the choice's `finish_reason`: what
    is read of the answer once, whichever shape of output line it is written in."""

    content: str | None
    # (name, arguments as JSON text) of each call; empty: no calls.
    calls: tuple[tuple[str, str], ...]
    finish_reason: str

    def tool_calls(self, request: str, prefix: str) -> list[dict[str, Any]]:
        """The calls in OpenAI's shape, `{"id", "type": "function", "function": {"name",
        "arguments"}}`, their IDs made from `request` and `prefix` (`tool_call_id`)."""
        return [{"id": tool_call_id(request, index, prefix=prefix), "type": "function",
                 "function": {"name": name, "arguments": arguments}}
                for index, (name, arguments) in enumerate(self.calls)]


def _object(field: str, value: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidJob(f"{field} must be an object ({what})", field)
    return value


def _optional(field: str, value: Any, kind: type, what: str) -> None:
    if value is not None and not isinstance(value, kind):
        raise InvalidJob(f"{field} must be {what}", field)


def _name(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidJob(f"{field} must be a non-empty string", field)
    return value


def _function_of(field: str, item: Any,
                 what: str) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """A tool or a call (`what`), which must be of type `function`, and its `function`."""
    item = _object(field, item, 'with "type": "function" and "function"')
    kind = item.get("type", "function")
    if kind != "function":
        raise Unsupported(f"{field}.type: {what} of type {kind!r} are not supported by this "
                          "server (only function ones are)", f"{field}.type")
    return item, _object(f"{field}.function", item.get("function"), 'with "name"')


def _checked_tools(tools: Any) -> list[dict[str, Any]]:
    """The tools as the template is given them (vLLM's dump of each: `description` and
    `parameters` None when not given, `strict` only when given)."""
    if not isinstance(tools, list):
        raise InvalidJob("tools must be a list of tools", "tools")
    if not tools:
        raise InvalidJob("tools must not be an empty list; give at least one tool or leave "
                         "tools out", "tools")
    checked: list[dict[str, Any]] = []
    names: set[str] = set()
    for index, tool in enumerate(tools):
        field = f"tools[{index}]"
        _, function = _function_of(field, tool, "tools")
        name = _name(f"{field}.function.name", function.get("name"))
        if name in names:
            raise InvalidJob(f"{field}.function.name: a tool named {name!r} is given twice; "
                             "give each tool once", f"{field}.function.name")
        names.add(name)
        _optional(f"{field}.function.description", function.get("description"), str,
                  "a string")
        _optional(f"{field}.function.parameters", function.get("parameters"), Mapping,
                  "an object (a JSON schema)")
        _optional(f"{field}.function.strict", function.get("strict"), bool, "true or false")
        spec: dict[str, Any] = {"name": name, "description": function.get("description"),
                                "parameters": function.get("parameters")}
        if function.get("strict") is not None:
            spec["strict"] = function["strict"]
        checked.append({"type": "function", "function": spec})
    return checked


def _arguments_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """A function's parameter schema; none (or an empty one) still asks for a JSON object."""
    return dict(parameters) if parameters else {"type": "object", "properties": {}}


def _required_schema(tools: list[dict[str, Any]], single_call: bool) -> dict[str, Any]:
    """vLLM's schema for `required`: an array of one or more `{"name", "parameters"}` objects,
    each one of the tools, the tools' `$defs` gathered at the top so references resolve."""
    calls = []
    definitions: dict[str, Any] = {}
    for index, tool in enumerate(tools):
        function = tool["function"]
        parameters = _arguments_schema(copy.deepcopy(function["parameters"]))
        field = f"tools[{index}].function.parameters.$defs"
        own = _object(field, parameters.pop("$defs", {}), "named schemas")
        for key, schema in own.items():
            if definitions.setdefault(key, schema) != schema:
                raise InvalidJob(f"{field}.{key} differs from a definition of the same name in "
                                 "another tool; give one schema per name", f"{field}.{key}")
        calls.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": calls}}
    if single_call:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def _compiled(field: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The constraint for `schema`, once the engine's backends are known to compile it."""
    constraint = {"json": schema}
    check_sampling_value("structured_outputs", constraint, 0, field=field)
    return constraint


def _named_function(tool_choice: Mapping[str, Any], names: list[str]) -> str:
    kind = tool_choice.get("type", "function")
    if kind in ("allowed_tools", "custom"):
        raise Unsupported(f"tool_choice.type: a tool choice of type {kind!r} is not supported "
                          "by this server", "tool_choice.type")
    if kind != "function":
        raise InvalidJob(f"tool_choice.type must be 'function', got {kind!r}",
                         "tool_choice.type")
    function = tool_choice.get("function")
    if not isinstance(function, Mapping):
        raise InvalidJob(f"tool_choice.function must be an object; {_NAMED_USAGE}",
                         "tool_choice.function")
    name = _name("tool_choice.function.name", function.get("name"))
    if name not in names:
        raise InvalidJob(f"tool_choice.function.name {name!r} is none of the tools "
                         f"{names}", "tool_choice.function.name")
    return name


def check_tools(tools: Any, tool_choice: Any, *, parser: str | None,
                parallel_tool_calls: Any = None, structured_outputs: Any = None) -> ToolPlan:
    """The plan for a chat line's `tools`, `tool_choice` and `parallel_tool_calls` (each None
    when the line leaves it out), given the configured tool-call `parser` (None: none) and the
    line's own `structured_outputs` (vLLM refuses it beside a named function). InvalidJob (or
    Unsupported) names the field at fault. `tool_choice` left out is `auto` with tools, as in
    vLLM and OpenAI. Named and required choices have their constraint compiled here."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidJob("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None:
        if tool_choice not in (None, NONE):
            raise InvalidJob("tool_choice needs tools: give the functions the model may call "
                             "in tools", "tool_choice")
        return NO_TOOLS
    checked = _checked_tools(tools)
    single_call = parallel_tool_calls is False
    if tool_choice is None or tool_choice == AUTO:
        return ToolPlan(AUTO, checked, parser=parser, single_call=single_call)
    if tool_choice == NONE:
        return ToolPlan(NONE, checked)
    if tool_choice == REQUIRED:
        schema = _required_schema(checked, single_call)
        return ToolPlan(REQUIRED, checked, _compiled("tools", schema), single_call=single_call)
    if not isinstance(tool_choice, Mapping):
        raise InvalidJob(f"tool_choice must be 'none', 'auto', 'required' or a named function "
                         f"({_NAMED_USAGE}), got {tool_choice!r}", "tool_choice")
    names = [tool["function"]["name"] for tool in checked]
    name = _named_function(tool_choice, names)
    if isinstance(structured_outputs, Mapping) and any(
            structured_outputs.get(key) is not None for key in _EXCLUSIVE_CONSTRAINTS):
        raise InvalidJob("give either a named tool_choice or a structured_outputs constraint, "
                         "not both", "structured_outputs")
    index = names.index(name)
    schema = _arguments_schema(checked[index]["function"]["parameters"])
    return ToolPlan(FUNCTION, checked, _compiled(f"tools[{index}].function.parameters", schema),
                    function=name, single_call=single_call)


def tool_call_id(request: str, index: int, *, prefix: str = VLLM_CALL_ID_PREFIX) -> str:
    """The ID of a request's `index`-th tool call: the same each time the answer is rendered
    (vLLM draws a random one of the same shape: the prefix and 32 hex digits)."""
    digest = hashlib.sha256(f"{request}/{index}".encode()).hexdigest()
    return prefix + digest[:_CALL_ID_DIGITS]


def _forbid_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _required_calls(text: str) -> list[tuple[str, str]]:
    """The (name, arguments) of a `required` answer; none where it is not a complete array
    of `{"name", "parameters"}` objects (cut short, say), as vLLM reads it."""
    try:
        value = json.loads(text, parse_constant=_forbid_constant)
    except (ValueError, RecursionError):
        return []
    if not isinstance(value, list) or not all(
            isinstance(item, dict) and isinstance(item.get("name"), str)
            and isinstance(item.get("parameters"), dict | None) for item in value):
        return []
    return [(item["name"], json.dumps(item.get("parameters"), ensure_ascii=False))
            for item in value]


@cache
def parser_tokenizer(model: str) -> Any:
    """The served model's tokenizer as vLLM hands it to a tool-call parser, loaded once per
    process (`model`: its folder or name, JOBSVC_MODEL)."""
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(model)


def _parsed_calls(plan: ToolPlan, text: str,
                  tokenizer: Any) -> tuple[str | None, list[tuple[str, str]]] | None:
    """The content and (name, arguments) calls vLLM's tool-call parser finds in `text`, or None
    when it finds none."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    request = ChatCompletionRequest(messages=[], tools=plan.tools, tool_choice=AUTO)
    parser = ToolParserManager.get_tool_parser(str(plan.parser))(tokenizer, request.tools)
    found = parser.extract_tool_calls(text, request)
    if not found.tools_called:
        return None
    content = found.content
    if content and not content.strip():
        content = None
    return content, [(call.function.name, call.function.arguments) for call in found.tool_calls]


def tool_answer(plan: ToolPlan, text: str, finish_reason: str, *,
                tokenizer: Any = None) -> ToolAnswer:
    """The assistant message's content and tool calls for an answer `text` that ended for the
    engine's `finish_reason`, as vLLM's server makes them. `tokenizer` is the served model's,
    needed only for `auto` with a parser, whose parser reads it.

    - none, or auto without a parser: the text, the engine's reason;
    - named: one call with the text as its arguments (none for a blank text), content "", the
      engine's reason (OpenAI's: a named call stops);
    - required: a call per element of the array (none if the text is not one), content "",
      `tool_calls` if the engine stopped, else its reason (`length`);
    - auto with a parser: the calls it finds, with the text before them as content (None when
      blank) and `tool_calls`; without calls the text and the engine's reason.
    `parallel_tool_calls: false` keeps the first call alone."""
    content: str | None = ""
    if plan.choice == FUNCTION and text.strip():
        calls = [(str(plan.function), text)]
    elif plan.choice == FUNCTION:
        calls = []
    elif plan.choice == REQUIRED:
        calls = _required_calls(text)
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    elif plan.choice == AUTO and plan.parser is not None:
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to run the tool-call parser")
        parsed = _parsed_calls(plan, text, tokenizer)
        if parsed is None:
            return ToolAnswer(text, (), finish_reason)
        (content, calls), finish_reason = parsed, "tool_calls"
    else:
        return ToolAnswer(text, (), finish_reason)
    if plan.single_call:
        calls = calls[:1]
    return ToolAnswer(content, tuple(calls), finish_reason)


def _decoded_arguments(value: Any) -> dict[str, Any]:
    """A call's arguments as templates read them: an object. vLLM makes anything else (text
    that is not a JSON object, nothing) an empty object, so that a conversation holding a bad
    call can go on."""
    if isinstance(value, str) and value:
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return {}
    return dict(value) if isinstance(value, Mapping) else {}


def _template_calls(index: int, calls: Any) -> list[dict[str, Any]]:
    field = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise InvalidJob(f"{field} must be a list of tool calls", field)
    rendered = []
    for number, call in enumerate(calls):
        call_field = f"{field}[{number}]"
        call, function = _function_of(call_field, call, "tool calls")
        call_id = _name(f"{call_field}.id", call.get("id"))
        name = _name(f"{call_field}.function.name", function.get("name"))
        arguments = function.get("arguments")
        if arguments is not None and not isinstance(arguments, str | Mapping):
            raise InvalidJob(f"{call_field}.function.arguments must be a string (JSON text)",
                             f"{call_field}.function.arguments")
        rendered.append({"id": call_id, "type": "function",
                         "function": {"name": name, "arguments": _decoded_arguments(arguments)}})
    return rendered


def message_tool_fields(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """What the chat template is given of `messages[index]` beside its role and text: an
    assistant's `tool_calls` (arguments decoded to objects), a tool result's `tool_call_id`;
    nothing for other messages, or for an assistant's empty `tool_calls`. An assistant message
    with calls may leave its content out (null): its text is then ""."""
    role = message.get("role")
    if role == TOOL_ROLE:
        return {"tool_call_id": _name(f"messages[{index}].tool_call_id",
                                      message.get("tool_call_id"))}
    calls = message.get("tool_calls")
    if role != "assistant" or calls is None or calls == []:
        return {}
    return {"tool_calls": _template_calls(index, calls)}
