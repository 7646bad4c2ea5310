"""The Responses API's text subset as a batch endpoint: bodies read as chat bodies, what is not
served refused by the Responses field's path, chat field names translated back, and answers
shaped as Response objects the official client's model accepts."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from openai.types.responses import Response

from jobsvc.batchapi.line_requests import (
    CHAT_ENDPOINT,
    RESPONSES_ENDPOINT,
    ChatRequest,
    LineError,
    parse_request,
)
from jobsvc.batchapi.output_lines import Answer, response_body
from jobsvc.batchapi.responses_requests import chat_body, responses_error, responses_param
from jobsvc.validation import JobLimits

pytestmark = pytest.mark.unit

MODEL = "tiny-llama"
LIMITS = JobLimits(max_document_chars=10_000, max_question_chars=10_000, max_stop_chars=32,
                   max_job_bytes=100_000, priority_scheduling=False)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def parsed(body: dict[str, Any]) -> ChatRequest:
    """The request a Responses body makes, as the batch endpoint will read it."""
    try:
        request = parse_request(CHAT_ENDPOINT, chat_body(body), limits=LIMITS)
    except LineError as error:
        raise responses_error(error, body) from None
    assert isinstance(request, ChatRequest)
    return request


def test_a_string_input_is_one_user_message() -> None:
    assert chat_body({"input": "Why is the sky blue?"}) == {
        "messages": [{"role": "user", "content": "Why is the sky blue?"}]}


def test_instructions_lead_a_message_list_as_its_system_message() -> None:
    body = {
        "instructions": "Answer briefly.",
        "input": [
            {"role": "developer", "content": "Use plain words."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Hi"},
                         {"type": "input_text", "text": "there"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Hello", "annotations": []}]},
            {"role": "user", "content": "Again?"},
        ],
    }
    assert chat_body(body)["messages"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "developer", "content": "Use plain words."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                     {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "Again?"},
    ]
    assert parsed(body).messages == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "system", "content": "Use plain words."},
        {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again?"},
    ]


def test_empty_instructions_lead_nothing() -> None:
    assert chat_body({"instructions": "", "input": "q"})["messages"] == [
        {"role": "user", "content": "q"}]


@pytest.mark.parametrize(("text_format", "response_format"), [
    ({"type": "json_schema", "name": "verdict", "schema": SCHEMA, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA,
                                             "strict": True}}),
    ({"type": "json_schema", "name": "v", "schema": SCHEMA, "description": "A verdict"},
     {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA,
                                             "description": "A verdict"}}),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "text"}, {"type": "text"}),
])
def test_text_format_becomes_chats_response_format(
        text_format: dict[str, Any], response_format: dict[str, Any]) -> None:
    body = {"input": "q", "text": {"format": text_format, "verbosity": "medium"}}
    assert chat_body(body)["response_format"] == response_format


def test_text_formats_become_the_structured_output_constraint() -> None:
    schema_format = {"type": "json_schema", "name": "verdict", "schema": SCHEMA}
    request = parsed({"input": "q", "text": {"format": schema_format}})
    assert request.sampling["structured_outputs"] == {"json": SCHEMA}
    request = parsed({"input": "q", "text": {"format": {"type": "json_object"}}})
    assert request.sampling["structured_outputs"] == {"json_object": True}
    assert "structured_outputs" not in parsed({"input": "q",
                                               "text": {"format": {"type": "text"}}}).sampling


def test_sampling_settings_pass_and_settings_that_change_nothing_are_dropped() -> None:
    body = {"model": MODEL, "input": "q", "max_output_tokens": 40, "temperature": 0.2,
            "top_p": 0.9, "metadata": {"run": "7"}, "seed": 3, "user": "u-1", "store": False,
            "service_tier": "auto", "parallel_tool_calls": False, "truncation": "disabled",
            "safety_identifier": "s", "prompt_cache_key": "k", "stream": False,
            "background": False, "tools": [], "tool_choice": "none", "include": [],
            "top_logprobs": 0, "reasoning": None, "previous_response_id": None}
    assert chat_body(body) == {
        "messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 40,
        "model": MODEL, "temperature": 0.2, "top_p": 0.9, "metadata": {"run": "7"}, "seed": 3}
    request = parsed(body)
    assert request.max_tokens == 40
    assert request.sampling == {"temperature": 0.2, "top_p": 0.9, "seed": 3}


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"input": "q", "tools": [{"type": "function", "name": "f"}]}, "tools",
     "unsupported_parameter"),
    ({"input": "q", "tool_choice": "required"}, "tool_choice", "unsupported_parameter"),
    ({"input": "q", "reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
    ({"input": "q", "previous_response_id": "resp_1"}, "previous_response_id",
     "unsupported_parameter"),
    ({"input": "q", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ({"input": "q", "background": True}, "background", "unsupported_parameter"),
    ({"input": "q", "stream": True}, "stream", "unsupported_parameter"),
    ({"input": "q", "include": ["message.output_text.logprobs"]}, "include",
     "unsupported_parameter"),
    ({"input": "q", "top_logprobs": 2}, "top_logprobs", "unsupported_parameter"),
    ({"input": "q", "truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"input": "q", "prompt": {"id": "pmpt_1"}}, "prompt", "unsupported_parameter"),
    ({"input": "q", "max_tool_calls": 2}, "max_tool_calls", "unsupported_parameter"),
    ({"input": "q", "modalities": ["text"]}, "modalities", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": "q"},
                {"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "input[1].type", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "see"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input[0].content[1].type", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "q",
                                              "cache_control": {}}]}]},
     "input[0].content[0].cache_control", "unsupported_parameter"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_text", "text": "a"}]}]},
     "input[0].content[0].type", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "a"}]}]},
     "input[0].content[0].type", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text", "invalid_value"),
    ({"input": [{"role": "user", "content": "q", "name": "bob"}]}, "input[0].name",
     "unsupported_parameter"),
    ({"input": [{"role": "tool", "content": "q"}]}, "input[0].role", "invalid_value"),
    ({"input": [{"role": "user", "content": []}]}, "input[0].content", "invalid_value"),
    ({"input": ["q"]}, "input[0]", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": 7}, "input", "invalid_value"),
    ({"instructions": "be brief"}, "input", "missing_required_parameter"),
    ({"input": "q", "instructions": ["be brief"]}, "instructions", "invalid_value"),
    ({"input": "q", "text": "json"}, "text", "invalid_value"),
    ({"input": "q", "text": {"verbosity": "high"}}, "text.verbosity", "unsupported_parameter"),
    ({"input": "q", "text": {"format": {"type": "grammar"}}}, "text.format.type",
     "invalid_value"),
    ({"input": "q", "text": {"format": {"type": "json_object", "schema": SCHEMA}}},
     "text.format.schema", "unsupported_parameter"),
    ({"input": "q", "text": {"format": {"type": "json_schema", "name": "v", "schema": SCHEMA,
                                        "json_schema": {}}}},
     "text.format.json_schema", "unsupported_parameter"),
    ({"input": "q", "metadata": {"run": 7}}, "metadata.run", "invalid_value"),
    ({"input": "q", "user": 12}, "user", "invalid_value"),
])
def test_what_is_wrong_or_not_served_is_refused_by_its_responses_field(
        body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(LineError) as refused:
        chat_body(body)
    assert (refused.value.param, refused.value.code) == (param, code)
    assert str(refused.value).startswith(param)
    # Named in Responses terms already: translating it again changes nothing.
    again = responses_error(refused.value, body)
    assert (str(again), again.param, again.code) == (str(refused.value), param, code)


@pytest.mark.parametrize(("body", "param", "code", "says"), [
    ({"input": "q", "max_output_tokens": 0}, "max_output_tokens", "invalid_value",
     "max_output_tokens must be between"),
    ({"input": "q", "temperature": 5}, "temperature", "invalid_value", "temperature must be"),
    ({"input": "q", "text": {"format": {"type": "json_schema", "schema": SCHEMA}}},
     "text.format.name", "invalid_value", "text.format.name must be a non-empty string"),
    ({"input": "q", "text": {"format": {"type": "json_schema", "name": "v", "schema": "x"}}},
     "text.format.schema", "invalid_value", "text.format.schema must be an object"),
    ({"input": "q", "text": {"format": {"type": "json_schema", "name": "v", "schema": SCHEMA,
                                        "strict": "yes"}}},
     "text.format.strict", "invalid_value", "text.format.strict must be true or false"),
    ({"input": "q", "model": ""}, "model", "invalid_value", "model must be a string"),
])
def test_values_the_chat_checks_refuse_are_named_by_their_responses_field(
        body: dict[str, Any], param: str, code: str, says: str) -> None:
    with pytest.raises(LineError) as refused:
        parsed(body)
    assert (refused.value.param, refused.value.code) == (param, code)
    assert str(refused.value).startswith(says)
    assert "max_completion_tokens" not in str(refused.value)
    assert "response_format" not in str(refused.value)


@pytest.mark.parametrize(("body", "chat_param", "param"), [
    ({"input": "q"}, None, None),
    ({"input": "q"}, "messages", "input"),
    ({"input": "q"}, "messages[0].content", "input"),
    ({"input": "q", "instructions": "i"}, "messages[0].content", "instructions"),
    ({"input": "q", "instructions": "i"}, "messages[1].content", "input"),
    ({"input": [{"role": "user", "content": "q"}] * 3}, "messages[2].content[1].text",
     "input[2].content[1].text"),
    ({"input": [{"role": "user", "content": "q"}] * 3, "instructions": "i"},
     "messages[2].content[1].text", "input[1].content[1].text"),
    ({"input": [{"role": "user", "content": "q"}], "instructions": ""}, "messages[0].role",
     "input[0].role"),
    ({"input": "q"}, "max_completion_tokens", "max_output_tokens"),
    ({"input": "q"}, "max_tokens", "max_output_tokens"),
    ({"input": "q"}, "response_format", "text.format"),
    ({"input": "q"}, "response_format.type", "text.format.type"),
    ({"input": "q"}, "response_format.json_schema", "text.format"),
    ({"input": "q"}, "response_format.json_schema.schema.properties.ok",
     "text.format.schema.properties.ok"),
    ({"input": "q"}, "temperature", "temperature"),
    ({"input": "q"}, "metadata.run", "metadata.run"),
])
def test_chat_fields_are_named_back_as_the_responses_fields_they_came_from(
        body: dict[str, Any], chat_param: str | None, param: str | None) -> None:
    assert responses_param(chat_param, body) == param


def test_an_error_found_in_the_chat_body_names_the_responses_fields() -> None:
    body = {"instructions": "i", "input": [{"role": "user", "content": "q"}]}
    error = LineError("the prompt of 90 tokens plus max_tokens 50 exceeds the model's context "
                      "of 128 tokens; shorten the messages or lower max_tokens", "max_tokens",
                      "context_length_exceeded")
    translated = responses_error(error, body)
    assert (translated.param, translated.code) == ("max_output_tokens",
                                                   "context_length_exceeded")
    assert str(translated) == ("the prompt of 90 tokens plus max_output_tokens 50 exceeds the "
                               "model's context of 128 tokens; shorten the input or lower "
                               "max_output_tokens")
    error = LineError("messages[1].content[0].text has a lone surrogate; remove it",
                      "messages[1].content[0].text")
    translated = responses_error(error, body)
    assert translated.param == "input[0].content[0].text"
    assert str(translated) == "input[0].content[0].text has a lone surrogate; remove it"


def answer(finish_reason: str | None = "stop", **changes: Any) -> Answer:
    values: dict[str, Any] = {"job_id": "0f8e2c", "text": '{"ok": true}', "prompt_tokens": 30,
                              "completion_tokens": 6, "cached_tokens": 16, "max_tokens": 64,
                              "created": 1_760_000_000, "recorded_finish_reason": finish_reason}
    return Answer(**{**values, **changes})


def extra_fields(model: pydantic.BaseModel, where: str = "response") -> list[str]:
    """Every field the model's class does not declare, at any depth (the client's models
    keep unknown fields instead of refusing them)."""
    found = [f"{where}.{name}" for name in model.model_extra or {}]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if isinstance(item, pydantic.BaseModel):
                found += extra_fields(item, f"{where}.{name}[{index}]")
    return found


def validated(obj: dict[str, Any]) -> Response:
    """The object as the official client reads it with strict validation."""
    response = Response.model_validate(obj, strict=True)
    assert extra_fields(response) == []
    return response


def test_a_completed_answer_is_a_response_the_client_reads() -> None:
    obj = response_body(RESPONSES_ENDPOINT, answer(), MODEL)
    response = validated(obj)
    assert (response.id, response.object, response.status) == ("resp_0f8e2c", "response",
                                                              "completed")
    assert response.created_at == 1_760_000_000 and response.incomplete_details is None
    assert response.output_text == '{"ok": true}'
    message = response.output[0]
    assert (message.type, message.id, message.role, message.status) == (
        "message", "msg_0f8e2c", "assistant", "completed")
    assert [part.type for part in message.content] == ["output_text"]
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (30, 6, 36)
    assert usage.input_tokens_details.cached_tokens == 16
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (response.temperature, response.top_p, response.tools, response.tool_choice) == (
        1.0, 1.0, [], "auto")


def test_an_answer_cut_at_max_output_tokens_is_an_incomplete_response() -> None:
    cut = answer("length", completion_tokens=64)
    response = validated(response_body(RESPONSES_ENDPOINT, cut, MODEL))
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.output_text == '{"ok": true}'
    assert response.completed_at is None


def test_an_older_result_without_a_reason_is_incomplete_when_it_used_every_token() -> None:
    obj = response_body(RESPONSES_ENDPOINT, answer(None, completion_tokens=64, max_tokens=64),
                        MODEL)
    assert validated(obj).status == "incomplete"
    assert validated(response_body(RESPONSES_ENDPOINT, answer(None), MODEL)).status == "completed"


def test_the_response_gives_back_the_settings_its_job_ran_with() -> None:
    schema_sampling = {"temperature": 0.0, "top_p": 0.5, "max_tokens": 64,
                       "structured_outputs": {"json": SCHEMA}}
    response = validated(response_body(RESPONSES_ENDPOINT, answer(sampling=schema_sampling),
                                       MODEL))
    assert (response.temperature, response.top_p, response.max_output_tokens) == (
        0.0, 0.5, 64)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.model_dump(by_alias=True, exclude_none=True) == {
        "type": "json_schema", "name": "response", "schema": SCHEMA}
    plain = validated(response_body(RESPONSES_ENDPOINT, answer(sampling={
        "structured_outputs": {"json_object": True}}), MODEL))
    assert plain.text is not None and plain.text.format is not None
    assert plain.text.format.type == "json_object"
