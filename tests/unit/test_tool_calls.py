"""Tool calling on chat lines as vLLM's server serves it: each tool_choice's constraint and the
calls its answer becomes, refusals naming the field, conversations holding calls and results
rendered by the tiny model's template, plain conversations rendered as before, a chat line's
tools mapped onto its job, and its calls written in both shapes of output line."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from jobsvc.batchapi.chat_template import ChatTemplate
from jobsvc.batchapi.line_requests import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    ChatRequest,
    LineError,
    parse_request,
)
from jobsvc.batchapi.output_lines import Answer, FinishedLine, openai_line, vllm_line
from jobsvc.batchapi.tool_calls import (
    NO_TOOLS,
    OPENAI_CALL_ID_PREFIX,
    VLLM_CALL_ID_PREFIX,
    ToolPlan,
    check_tools,
    message_tool_fields,
    plan_of,
    stored_plan,
    tool_answer,
    tool_call_id,
)
from jobsvc.choices import Choice
from jobsvc.errors import ConfigurationError, InvalidJob
from jobsvc.settings import Settings
from jobsvc.validation import JobLimits, Unsupported, check_sampling_value

pytestmark = pytest.mark.unit

MODEL = Path(__file__).resolve().parents[2] / "ops" / "tiny-llama"
# The tiny model's template before tools: plain conversations must still render to this.
PLAIN_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
                  "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Today's weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
LIMITS = JobLimits(max_document_chars=1000, max_question_chars=100, max_stop_chars=100,
                   max_job_bytes=1 << 20, priority_scheduling=False)
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def openai_calls(calls: list[dict[str, Any]]) -> list[ChatCompletionMessageFunctionToolCall]:
    return [ChatCompletionMessageFunctionToolCall.model_validate(call, strict=True)
            for call in calls]


def template_source() -> str:
    return str(json.loads((MODEL / "tokenizer_config.json").read_text())["chat_template"])


def render_as_vllm(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """The prompt vLLM renders: the template through transformers' renderer."""
    rendered = render_jinja_template([messages], tools=tools, chat_template=template_source(),
                                     add_generation_prompt=True, bos_token="<s>",
                                     eos_token="</s>")
    return str(rendered[0][0] if isinstance(rendered, tuple) else rendered[0])


def test_lines_without_tools_have_no_plan() -> None:
    assert check_tools(None, None, parser="hermes") == NO_TOOLS
    assert check_tools(None, "none", parser=None) == NO_TOOLS
    assert not NO_TOOLS.makes_calls


def test_tools_without_a_choice_are_auto_and_reach_the_template_as_vllm_dumps_them() -> None:
    plan = check_tools(TOOLS, None, parser="hermes")
    assert (plan.choice, plan.parser, plan.constraint, plan.makes_calls) == (
        "auto", "hermes", None, True)
    assert plan.tools == [
        {"type": "function", "function": {"name": "get_weather",
                                          "description": "Today's weather",
                                          "parameters": WEATHER}},
        {"type": "function", "function": {"name": "get_time", "description": None,
                                          "parameters": None}},
    ]


def test_auto_without_a_parser_answers_text() -> None:
    plan = check_tools(TOOLS, "auto", parser=None)
    assert plan.tools is not None and not plan.makes_calls
    answer = tool_answer(plan, '<tool_call>{"name": "get_time"}</tool_call>', "stop")
    assert (answer.content, answer.calls, answer.finish_reason) == (
        '<tool_call>{"name": "get_time"}</tool_call>', (), "stop")


def test_none_keeps_tools_in_the_template_and_answers_text() -> None:
    plan = check_tools(TOOLS, "none", parser="hermes")
    assert (plan.choice, plan.constraint, plan.makes_calls) == ("none", None, False)
    assert plan.tools is not None and len(plan.tools) == 2
    assert tool_answer(plan, "It is sunny.", "length").content == "It is sunny."


def test_a_named_function_holds_the_answer_to_its_parameters_and_calls_it_once() -> None:
    plan = check_tools(TOOLS, NAMED, parser=None)
    assert (plan.choice, plan.function, plan.constraint) == (
        "function", "get_weather", {"json": WEATHER})
    check_sampling_value("structured_outputs", plan.constraint, 0)
    answer = tool_answer(plan, '{"city": "Paris"}', "stop")
    [call] = openai_calls(answer.tool_calls("job1", VLLM_CALL_ID_PREFIX))
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        tool_call_id("job1", 0), "get_weather", {"city": "Paris"})
    # vLLM: content "" beside the call, and the engine's reason (a named call is not
    # `tool_calls`).
    assert (answer.content, answer.finish_reason) == ("", "stop")
    cut = tool_answer(plan, '{"city": "Par', "length")
    assert (cut.calls[0][1], cut.finish_reason) == (
        '{"city": "Par', "length")
    blank = tool_answer(plan, "  ", "stop")
    assert (blank.content, blank.calls, blank.finish_reason) == ("", (), "stop")


def test_a_named_function_without_parameters_still_asks_for_an_object() -> None:
    plan = check_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}},
                       parser=None)
    assert plan.constraint == {"json": {"type": "object", "properties": {}}}


def test_required_asks_for_an_array_of_calls_as_vllm_builds_it() -> None:
    plan = check_tools(TOOLS, "required", parser=None)
    assert plan.constraint == {"json": {
        "type": "array", "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]},
        ]}}}
    check_sampling_value("structured_outputs", plan.constraint, 0)
    single = check_tools(TOOLS, "required", parser=None, parallel_tool_calls=False)
    assert single.constraint is not None and single.constraint["json"]["maxItems"] == 1


def test_required_answers_become_one_call_each() -> None:
    plan = check_tools(TOOLS, "required", parser=None)
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Zürich"}},
                       {"name": "get_time", "parameters": {}}])
    answer = tool_answer(plan, text, "stop")
    calls = openai_calls(answer.tool_calls("job7", OPENAI_CALL_ID_PREFIX))
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [
        ("get_weather", {"city": "Zürich"}), ("get_time", {})]
    assert calls[0].function.arguments == '{"city": "Zürich"}'
    assert [call.id for call in calls] == [tool_call_id("job7", 0, prefix="call_"),
                                           tool_call_id("job7", 1, prefix="call_")]
    assert (answer.content, answer.finish_reason) == ("", "tool_calls")
    single = check_tools(TOOLS, "required", parser=None, parallel_tool_calls=False)
    assert len(tool_answer(single, text, "stop").calls) == 1


@pytest.mark.parametrize("text", ['[{"name": "get_time", "parameters": {}', "[]", "{}",
                                  '[{"name": 3, "parameters": {}}]',
                                  '[{"name": "get_time", "parameters": NaN}]'])
def test_a_required_answer_that_is_not_an_array_of_calls_has_none(text: str) -> None:
    plan = check_tools(TOOLS, "required", parser=None)
    cut = tool_answer(plan, text, "length")
    assert (cut.content, cut.calls, cut.finish_reason) == ("", (), "length")
    assert tool_answer(plan, text, "stop").finish_reason == "tool_calls"


def test_required_gathers_the_tools_definitions_at_the_top() -> None:
    address = {"type": "object", "properties": {"street": {"type": "string"}}}
    parameters = {"type": "object", "properties": {"to": {"$ref": "#/$defs/Address"}},
                  "$defs": {"Address": address}}
    tools = [{"type": "function", "function": {"name": "send", "parameters": parameters}}]
    plan = check_tools(tools, "required", parser=None)
    assert plan.constraint is not None
    schema = plan.constraint["json"]
    assert schema["$defs"] == {"Address": address}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in parameters  # the line's own schema is left as it was
    other = {"type": "function", "function": {"name": "keep", "parameters": {
        "type": "object", "$defs": {"Address": {"type": "string"}}}}}
    with pytest.raises(InvalidJob) as refused:
        check_tools([*tools, other], "required", parser=None)
    assert refused.value.field == "tools[1].function.parameters.$defs.Address"


def test_call_ids_are_stable_per_request_and_call() -> None:
    first = tool_call_id("a" * 32, 0)
    assert first == tool_call_id("a" * 32, 0)
    assert first.startswith(VLLM_CALL_ID_PREFIX) and len(first) == len(VLLM_CALL_ID_PREFIX) + 32
    assert len({first, tool_call_id("a" * 32, 1), tool_call_id("b" * 32, 0)}) == 3


def test_a_plan_is_stored_as_plain_values() -> None:
    plan = check_tools(TOOLS, "required", parser=None, parallel_tool_calls=False)
    assert ToolPlan(**json.loads(json.dumps(asdict(plan)))) == plan


@pytest.mark.parametrize(("tools", "tool_choice", "field", "unsupported"), [
    ([], None, "tools", False),
    ({"name": "f"}, None, "tools", False),
    (["f"], None, "tools[0]", False),
    ([{"type": "custom", "custom": {"name": "f"}}], None, "tools[0].type", True),
    ([{"type": "function"}], None, "tools[0].function", False),
    ([TOOLS[0], {"type": "function", "function": {"name": ""}}], None,
     "tools[1].function.name", False),
    ([TOOLS[0], TOOLS[0]], None, "tools[1].function.name", False),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None,
     "tools[0].function.description", False),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], None,
     "tools[0].function.parameters", False),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None,
     "tools[0].function.strict", False),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
     {"type": "function", "function": {"name": "f"}}, "tools[0].function.parameters", False),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
     "required", "tools", False),
    (None, "required", "tool_choice", False),
    (None, NAMED, "tool_choice", False),
    (TOOLS, "always", "tool_choice", False),
    (TOOLS, {"type": "function", "function": {"name": "get_news"}},
     "tool_choice.function.name", False),
    (TOOLS, {"type": "function", "function": {}}, "tool_choice.function.name", False),
    (TOOLS, {"type": "function"}, "tool_choice.function", False),
    (TOOLS, {"type": "allowed_tools", "allowed_tools": {}}, "tool_choice.type", True),
    (TOOLS, {"type": "web_search"}, "tool_choice.type", False),
])
def test_refusals_name_the_field(tools: Any, tool_choice: Any, field: str,
                                 unsupported: bool) -> None:
    with pytest.raises(InvalidJob) as refused:
        check_tools(tools, tool_choice, parser="hermes")
    assert refused.value.field == field
    assert isinstance(refused.value, Unsupported) == unsupported


def test_a_named_function_beside_a_structured_output_constraint_is_refused() -> None:
    with pytest.raises(InvalidJob) as refused:
        check_tools(TOOLS, NAMED, parser=None, structured_outputs={"regex": "a+"})
    assert refused.value.field == "structured_outputs"
    plan = check_tools(TOOLS, "required", parser=None, structured_outputs={"regex": "a+"})
    assert plan.constraint is not None and "json" in plan.constraint
    with pytest.raises(InvalidJob) as refused:
        check_tools(TOOLS, "auto", parser=None, parallel_tool_calls="no")
    assert refused.value.field == "parallel_tool_calls"


def test_auto_with_a_parser_finds_calls_in_the_answer() -> None:
    plan = check_tools(TOOLS, "auto", parser="hermes", parallel_tool_calls=False)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    text = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call><tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    answer = tool_answer(plan, text, "length", tokenizer=tokenizer)
    [call] = openai_calls(answer.tool_calls("job3", VLLM_CALL_ID_PREFIX))
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        tool_call_id("job3", 0), "get_weather", {"city": "Oslo"})
    assert (answer.content, answer.finish_reason) == ("Let me look.", "tool_calls")
    plain = tool_answer(plan, "Sunny.", "stop", tokenizer=tokenizer)
    assert (plain.content, plain.calls, plain.finish_reason) == ("Sunny.", (), "stop")
    with pytest.raises(ValueError):
        tool_answer(plan, text, "stop")


def test_earlier_calls_and_results_reach_the_template_as_vllm_hands_them_over() -> None:
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "c2", "type": "function", "function": {"name": "get_time",
                                                           "arguments": "not json"}},
             {"id": "c3", "function": {"name": "get_time", "arguments": "[1]"}},
             {"id": "c4", "type": "function", "function": {"name": "get_time",
                                                           "arguments": {"zone": "UTC"}}}]
    fields = message_tool_fields(1, {"role": "assistant", "content": None,
                                     "tool_calls": calls})
    assert [call["function"]["arguments"] for call in fields["tool_calls"]] == [
        {"city": "Paris"}, {}, {}, {"zone": "UTC"}]
    assert all(call["type"] == "function" for call in fields["tool_calls"])
    assert message_tool_fields(2, {"role": "tool", "tool_call_id": "c1", "content": "18"}) == {
        "tool_call_id": "c1"}
    assert message_tool_fields(0, {"role": "assistant", "content": "hi", "tool_calls": []}) == {}
    assert message_tool_fields(0, {"role": "user", "content": "hi"}) == {}


@pytest.mark.parametrize(("message", "field"), [
    ({"role": "tool", "content": "18"}, "messages[3].tool_call_id"),
    ({"role": "assistant", "tool_calls": {"id": "c1"}}, "messages[3].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"type": "function",
                                           "function": {"name": "f", "arguments": "{}"}}]},
     "messages[3].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                           "function": {"arguments": "{}"}}]},
     "messages[3].tool_calls[0].function.name"),
    ({"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                           "function": {"name": "f", "arguments": 3}}]},
     "messages[3].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"id": "c1", "type": "custom", "custom": {}}]},
     "messages[3].tool_calls[0].type"),
])
def test_bad_calls_and_results_are_refused_naming_the_field(message: dict[str, Any],
                                                            field: str) -> None:
    with pytest.raises(InvalidJob) as refused:
        message_tool_fields(3, message)
    assert refused.value.field == field


def test_a_conversation_with_calls_and_results_renders_and_its_calls_read_back() -> None:
    plan = check_tools(TOOLS, "auto", parser="hermes")
    assert plan.tools is not None
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "",
                 **message_tool_fields(1, {"role": "assistant", "tool_calls": [call]})},
                {"role": "tool", "content": "18 degrees",
                 **message_tool_fields(2, {"role": "tool", "tool_call_id": "c1"})}]
    prompt = render_as_vllm(messages, plan.tools)
    assert prompt.startswith("<s><|system|>\n")
    assert json.dumps(plan.tools[0]) in prompt
    assert prompt.endswith("<|user|>\nWeather in Paris?</s>\n<|assistant|>\n<tool_call>\n"
                           '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                           "</tool_call></s>\n<|tool|>\n<tool_response>\n18 degrees\n"
                           "</tool_response></s>\n<|assistant|>\n")
    # The assistant turn is in the syntax the `hermes` parser reads.
    turn = prompt.split("<|assistant|>\n")[1].removesuffix("</s>\n<|tool|>\n")
    turn = turn[:turn.index("</s>")]
    answer = tool_answer(plan, turn, "stop", tokenizer=AutoTokenizer.from_pretrained(MODEL))
    assert [(name, json.loads(arguments)) for name, arguments in answer.calls] == [
        ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief.\n\nDocument text"},
     {"role": "user", "content": "Question?"},
     {"role": "assistant", "content": "An answer."},
     {"role": "user", "content": ""}],
])
def test_plain_conversations_render_as_before(messages: list[dict[str, Any]]) -> None:
    before = render_jinja_template([messages], chat_template=PLAIN_TEMPLATE,
                                   add_generation_prompt=True, bos_token="<s>",
                                   eos_token="</s>")
    expected = str(before[0][0] if isinstance(before, tuple) else before[0])
    assert render_as_vllm(messages, None) == expected
    assert ChatTemplate(str(MODEL)).render(messages) == expected


def chat_line(limits: JobLimits = LIMITS, **body: Any) -> ChatRequest:
    parsed = parse_request(CHAT_ENDPOINT, {"messages": QUESTION, **body}, limits=limits)
    assert isinstance(parsed, ChatRequest)
    return parsed


def test_a_chat_lines_tool_choice_constrains_its_job_over_its_own_format() -> None:
    named = chat_line(tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=True)
    assert named.sampling["structured_outputs"] == {"json": WEATHER}
    assert (named.tools.choice, named.tools.function) == ("function", "get_weather")
    required = chat_line(tools=TOOLS, tool_choice="required",
                         response_format={"type": "json_object"})
    assert required.sampling["structured_outputs"]["json"]["type"] == "array"
    auto = chat_line(limits=replace(LIMITS, tool_call_parser="hermes"), tools=TOOLS,
                     response_format={"type": "json_object"})
    assert (auto.tools.parser, auto.sampling["structured_outputs"]) == (
        "hermes", {"json_object": True})
    assert chat_line().tools == NO_TOOLS
    assert stored_plan(auto.tools) is not None and stored_plan(chat_line().tools) is None
    assert stored_plan(chat_line(tools=TOOLS, tool_choice="none").tools) is None
    assert plan_of(json.loads(json.dumps(stored_plan(required.tools)))) == required.tools


def test_a_conversation_with_calls_and_results_is_read_for_the_template() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    parsed = chat_line(messages=[*QUESTION, {"role": "assistant", "content": None,
                                             "tool_calls": [call]},
                                 {"role": "tool", "tool_call_id": "c1", "content": "18"}],
                       tools=TOOLS)
    assert parsed.messages[1:] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18", "tool_call_id": "c1"}]
    # Rendered here as vLLM renders it, tools and all.
    assert ChatTemplate(str(MODEL)).render(parsed.messages, parsed.tools.tools) == (
        render_as_vllm(parsed.messages, parsed.tools.tools))


@pytest.mark.parametrize(("endpoint", "body", "param", "code"), [
    (CHAT_ENDPOINT, {"tools": TOOLS, "tool_choice": {"type": "function",
                                                     "function": {"name": "get_news"}}},
     "tool_choice.function.name", "invalid_value"),
    (CHAT_ENDPOINT, {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "strnig"}}}], "tool_choice": "required"},
     "tools", "invalid_value"),
    (CHAT_ENDPOINT, {"tools": [{"type": "custom", "custom": {"name": "f"}}]},
     "tools[0].type", "unsupported_parameter"),
    (CHAT_ENDPOINT, {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls",
     "invalid_value"),
    (CHAT_ENDPOINT, {"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    (CHAT_ENDPOINT, {"function_call": "auto"}, "function_call", "unsupported_parameter"),
    (CHAT_ENDPOINT, {"messages": [{"role": "tool", "content": "18"}]},
     "messages[0].tool_call_id", "invalid_value"),
    (CHAT_ENDPOINT, {"messages": [{"role": "assistant", "content": None}]},
     "messages[0].content", "invalid_value"),
    (COMPLETIONS_ENDPOINT, {"prompt": "q", "tools": TOOLS}, "tools", "unsupported_parameter"),
    (COMPLETIONS_ENDPOINT, {"prompt": "q", "tool_choice": "auto"}, "tool_choice",
     "unsupported_parameter"),
])
def test_tool_fields_a_line_gets_wrong_are_named(endpoint: str, body: dict[str, Any],
                                                 param: str, code: str) -> None:
    if endpoint == CHAT_ENDPOINT:
        body = {"messages": QUESTION, **body}
    with pytest.raises(LineError) as refused:
        parse_request(endpoint, body, limits=LIMITS)
    assert (refused.value.param, refused.value.code) == (param, code)


def test_every_choice_is_rendered_as_its_calls_with_ids_of_each_shape() -> None:
    plan = check_tools(TOOLS, "required", parser=None)
    texts = [json.dumps([{"name": "get_time", "parameters": {}}]), '[{"name": "get_ti']
    answer = Answer("job9", texts[0], 5, 12, 0, 64, 1_700_000_000, "stop",
                    (Choice(texts[0], "stop", 8), Choice(texts[1], "length", 4)),
                    tool_answers=(tool_answer(plan, texts[0], "stop"),
                                  tool_answer(plan, texts[1], "length")))
    line = FinishedLine("job9", "a", answer)
    openai_body = openai_line(line, endpoint=CHAT_ENDPOINT, model="jobsvc")["response"]["body"]
    vllm_body = vllm_line(line, endpoint=CHAT_ENDPOINT, model="jobsvc")["response"]["body"]
    for body, prefix in ((openai_body, OPENAI_CALL_ID_PREFIX), (vllm_body, VLLM_CALL_ID_PREFIX)):
        first, second = body["choices"]
        [call] = openai_calls(first["message"]["tool_calls"])
        assert (call.id, call.function.name) == (tool_call_id("job9-0", 0, prefix=prefix),
                                                 "get_time")
        assert (first["message"]["content"], first["finish_reason"]) == ("", "tool_calls")
        assert not second["message"].get("tool_calls")
        assert second["finish_reason"] == "length"


def test_the_tool_call_parser_setting_must_be_one_of_vllms() -> None:
    assert Settings.from_env({"JOBSVC_TOOL_CALL_PARSER": "hermes"}).job_limits.tool_call_parser \
        == "hermes"
    assert Settings.from_env({}).job_limits.tool_call_parser is None
    with pytest.raises(ConfigurationError, match="JOBSVC_TOOL_CALL_PARSER"):
        Settings.from_env({"JOBSVC_TOOL_CALL_PARSER": "hermit"})
