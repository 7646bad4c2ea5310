"""Batch files as the Batch API reads them: lines cut from chunks, the structure that fails
a whole file, the content that fails one line, the cut into shared prefix + own suffix, and
the shapes of output lines, OpenAI's and `vllm run-batch`'s."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from importlib import metadata
from math import inf
from typing import Any

import pytest

from jobsvc import compression
from jobsvc.batchapi.chat_template import ChatTemplate, split_prompt
from jobsvc.batchapi.driver import file_line
from jobsvc.batchapi.line_requests import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    ChatRequest,
    CompletionRequest,
    LineError,
    parse_request,
)
from jobsvc.batchapi.lines import MAX_LINES, FileCheck, split_lines
from jobsvc.batchapi.output_lines import (
    Answer,
    FinishedLine,
    Refused,
    ended_error,
    jsonl,
    openai_line,
    response_body,
    vllm_line,
)
from jobsvc.choices import (
    LOWEST_LOGPROB,
    Choice,
    TokenLogprob,
    decode_choices,
    encode_choices,
)
from jobsvc.settings import TINY_MODEL
from jobsvc.store.batches import OutputRow
from jobsvc.validation import JobLimits

pytestmark = pytest.mark.unit

LIMITS = JobLimits(max_document_chars=1000, max_question_chars=100, max_stop_chars=100,
                   max_job_bytes=1 << 20, priority_scheduling=False)


def request(custom_id: str, body: dict[str, object], url: str = CHAT_ENDPOINT) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": body}).encode()


def test_lines_are_cut_across_chunk_boundaries_and_blank_lines_keep_their_numbers() -> None:
    chunks = [b'{"a":', b'1}\n\n{"b"', b':2}\n', b'{"c":3}']
    assert list(split_lines(chunks)) == [(1, b'{"a":1}'), (3, b'{"b":2}'), (4, b'{"c":3}')]


def test_a_file_fails_with_the_line_of_each_structural_error() -> None:
    check = FileCheck(CHAT_ENDPOINT)
    lines = [request("a", {}), b"not json", request("a", {}),
             request("b", {}, url="/v1/embeddings"),
             json.dumps({"custom_id": "c", "method": "GET", "url": CHAT_ENDPOINT,
                         "body": {}}).encode(),
             json.dumps({"method": "POST", "url": CHAT_ENDPOINT, "body": {}}).encode()]
    for number, raw in enumerate(lines, start=1):
        check.add(number, raw)
    check.finish()
    assert check.failed
    assert [(error.line, error.param) for error in check.errors] == [
        (2, None), (3, "custom_id"), (4, "url"), (5, "method"), (6, "custom_id")]
    assert "line 1" in check.errors[1].message


def test_a_file_of_more_than_the_limit_of_requests_fails_and_an_empty_one_too() -> None:
    check = FileCheck(COMPLETIONS_ENDPOINT)
    for number in range(1, MAX_LINES + 2):
        check.add(number, request(str(number), {"prompt": "x"}, COMPLETIONS_ENDPOINT))
        if check.over_limit:
            break
    assert check.failed and check.errors[-1].code == "too_many_requests"
    empty = FileCheck(CHAT_ENDPOINT)
    empty.finish()
    assert empty.failed and empty.errors[0].code == "empty_file"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "q"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "q"}], "n": 129}, "n"),
    ({"messages": [{"role": "user", "content": "q"}], "stream": True}, "stream"),
    ({"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function"}]},
     "tools[0].function"),
    ({"messages": [{"role": "user", "content": "q"}], "logprobs": 3}, "logprobs"),
    ({"messages": [{"role": "user", "content": "q"}], "top_logprobs": 3}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "q"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "q"}], "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "q"}], "logit_bias": {"7": 101}},
     "logit_bias[7]"),
    ({"messages": [{"role": "user", "content": "q"}], "priority": 1}, "priority"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "q"}], "temperature": 2.5}, "temperature"),
    ({"messages": [{"role": "user", "content": "q"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "q"}], "model": 7}, "model"),
    ({"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "q"}], "frobnicate": 1}, "frobnicate"),
    ({"messages": []}, "messages"),
])
def test_a_chat_line_asking_for_what_is_not_served_fails_naming_the_field(
        body: dict[str, object], param: str) -> None:
    with pytest.raises(LineError) as refused:
        parse_request(CHAT_ENDPOINT, body, limits=LIMITS)
    assert refused.value.param == param
    assert refused.value.to_api()["type"] == "invalid_request_error"


def test_sampling_maps_from_both_endpoints_with_openai_defaults() -> None:
    chat = parse_request(CHAT_ENDPOINT, {
        "model": "jobsvc", "messages": [{"role": "developer", "content": "be brief"},
                                        {"role": "user", "content": [
                                            {"type": "text", "text": "a"},
                                            {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "max_tokens": 99, "top_p": 0.5, "seed": 3, "stop": "END",
        "presence_penalty": 0.1, "top_k": 5, "repetition_penalty": 1.1},
        limits=LIMITS)
    assert isinstance(chat, ChatRequest)
    assert chat.max_tokens == 7
    assert chat.messages == [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": "a\nb"}]
    assert chat.sampling == {"temperature": 1.0, "top_p": 0.5, "seed": 3, "stop": ["END"],
                             "presence_penalty": 0.1, "top_k": 5, "repetition_penalty": 1.1}
    unlimited = parse_request(CHAT_ENDPOINT, {"messages": [{"role": "user", "content": "q"}]},
                              limits=LIMITS)
    assert unlimited.max_tokens is None
    completion = parse_request(COMPLETIONS_ENDPOINT, {"prompt": ["text"], "temperature": 0},
                               limits=LIMITS)
    assert isinstance(completion, CompletionRequest)
    assert (completion.prompt, completion.max_tokens, completion.sampling) == (
        "text", 16, {"temperature": 0})
    with pytest.raises(LineError) as refused:
        parse_request(COMPLETIONS_ENDPOINT, {"prompt": "x", "echo": True},
                      limits=LIMITS)
    assert refused.value.param == "echo"


def test_a_lines_structured_output_becomes_its_jobs_constraint_or_a_named_refusal() -> None:
    schema = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}}}
    chat = parse_request(CHAT_ENDPOINT, {
        "messages": [{"role": "user", "content": "q"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "label", "schema": schema}}},
        limits=LIMITS)
    assert chat.sampling["structured_outputs"] == {"json": schema}
    completion = parse_request(COMPLETIONS_ENDPOINT, {
        "prompt": "q", "structured_outputs": {"choice": ["a", "b"]}},
        limits=LIMITS)
    assert completion.sampling["structured_outputs"] == {"choice": ["a", "b"]}
    for body, param, code in [
            ({"response_format": {"type": "structural_tag"}}, "response_format.type",
             "unsupported_parameter"),
            ({"structured_outputs": {"regex": "("}}, "structured_outputs", "invalid_value")]:
        with pytest.raises(LineError) as refused:
            parse_request(CHAT_ENDPOINT, {"messages": [{"role": "user", "content": "q"}],
                                          **body}, limits=LIMITS)
        assert (refused.value.param, refused.value.code) == (param, code)


def test_a_document_is_the_shared_prefix_wherever_a_request_puts_it() -> None:
    template = ChatTemplate(str(TINY_MODEL))
    document = "First paragraph.\n\nSecond paragraph."
    layouts = [
        lambda q: [{"role": "system", "content": document}, {"role": "user", "content": q}],
        lambda q: [{"role": "user", "content": f"{document}\n\nQuestion: {q}"}],
        lambda q: [{"role": "user", "content": document}, {"role": "user", "content": q}],
    ]
    for layout in layouts:
        first, second = (template.split(layout(q)) for q in ("Who?", "Where?"))
        assert first.prefix == second.prefix and document in first.prefix
        assert "Who?" in first.suffix and first.suffix.endswith("<|assistant|>\n")
        assert first.prefix + first.suffix == template.render(layout("Who?"))
    assert (split_prompt(f"{document}\n\nQ: Who?").prefix
            == split_prompt(f"{document}\n\nQ: Where?").prefix)
    assert split_prompt(f"{document}\n\nQ: Who?").prefix == document
    assert split_prompt("no break").prefix == ""


def test_a_conversation_splits_alike_whatever_was_split_before() -> None:
    shared = ChatTemplate(str(TINY_MODEL))
    conversations = [
        [{"role": "system", "content": "Doc.\n\nMore."}, {"role": "user", "content": q}]
        for q in ("Who?", "Why?\n\nReally?")] + [
        [{"role": "system", "content": "Doc.\n\nMore."}, {"role": "assistant", "content": "Hi."}],
        [{"role": "system", "content": "Other."}, {"role": "user", "content": "Who?"}],
    ]
    for conversation in conversations * 2:
        assert shared.split(conversation) == ChatTemplate(str(TINY_MODEL)).split(conversation)


def test_response_bodies_carry_usage_with_cached_tokens_and_a_finish_reason() -> None:
    answer = Answer("j1", "hi", prompt_tokens=10, completion_tokens=4, cached_tokens=8,
                    max_tokens=4, created=1)
    chat = response_body(CHAT_ENDPOINT, answer, "jobsvc")
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == "hi"
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    text = response_body(COMPLETIONS_ENDPOINT, answer, "jobsvc")
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "hi"
    # The engine's recorded reason wins; without one (older results) the token count decides.
    assert replace(answer, completion_tokens=3).finish_reason == "stop"
    assert replace(answer, recorded_finish_reason="stop").finish_reason == "stop"


def test_run_batch_lines_take_vllms_shape() -> None:
    answer = Answer("j", "hi", prompt_tokens=1, completion_tokens=1, cached_tokens=0,
                    max_tokens=4, created=1)
    ok = vllm_line(FinishedLine("j", "a", answer), endpoint=CHAT_ENDPOINT, model="jobsvc")
    assert ok["id"] == "vllm-j"
    assert ok["response"]["request_id"] == "vllm-batch-j"
    bad = vllm_line(FinishedLine("k", "b", Refused(400, {
        "message": "m", "type": "invalid_request_error", "param": "n", "code": "x"})),
        endpoint=CHAT_ENDPOINT, model="jobsvc")
    assert bad["response"] == {"status_code": 400, "request_id": "vllm-batch-k", "body": None}
    assert bad["error"] == {"error": {"message": "m", "type": "invalid_request_error",
                                      "param": "n", "code": 400}}


def _kept(shaped: Any, rendered: Any) -> bool:
    """Whether `shaped` holds every field of `rendered` with its value, at any depth."""
    if isinstance(rendered, dict):
        return isinstance(shaped, dict) and all(
            key in shaped and _kept(shaped[key], value) for key, value in rendered.items())
    if isinstance(rendered, list):
        return (isinstance(shaped, list) and len(shaped) == len(rendered)
                and all(map(_kept, shaped, rendered)))
    return bool(shaped == rendered)


# The fields vLLM's server writes that the renderer leaves out, by endpoint: the body's, a
# choice's, and (chat) its message's; both endpoints' usage adds the same.
_VLLM_ADDS = {
    CHAT_ENDPOINT: ({"service_tier", "system_fingerprint", "prompt_logprobs", "prompt_token_ids",
                     "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics"},
                    {"stop_reason", "token_ids", "routed_experts"},
                    {"refusal", "annotations", "audio", "function_call", "reasoning"}),
    COMPLETIONS_ENDPOINT: ({"service_tier", "system_fingerprint", "kv_transfer_params",
                            "ec_transfer_params", "metrics"},
                           {"stop_reason", "token_ids", "prompt_logprobs", "prompt_token_ids",
                            "routed_experts"}, set()),
}


@pytest.mark.parametrize("endpoint", [CHAT_ENDPOINT, COMPLETIONS_ENDPOINT])
def test_run_batch_bodies_add_vllms_own_fields_to_the_rendered_answer(endpoint: str) -> None:
    choices = (Choice("hi", "stop", 2, None, "ou"), Choice("yo", "stop", 3, None, 7),
               Choice("hey there", "length", 4))
    answer = Answer("j", "hi", prompt_tokens=5, completion_tokens=9, cached_tokens=4,
                    max_tokens=4, created=1, choices=choices, created_cache_tokens=1)
    rendered = response_body(endpoint, answer, "jobsvc")
    line = FinishedLine("j", "a", answer)
    body = vllm_line(line, endpoint=endpoint, model="jobsvc")["response"]["body"]
    # What the answer says is the renderer's, unchanged; OpenAI's shape adds nothing.
    assert _kept(body, rendered)
    assert openai_line(line, endpoint=endpoint, model="jobsvc")["response"]["body"] == rendered
    body_fields, choice_fields, message_fields = _VLLM_ADDS[endpoint]
    assert body.keys() - rendered.keys() == body_fields
    assert body["system_fingerprint"] == f"jobsvc-{metadata.version('jobsvc')}"
    assert [choice["stop_reason"] for choice in body["choices"]] == ["ou", 7, None]
    for shaped, plain in zip(body["choices"], rendered["choices"], strict=True):
        assert shaped.keys() - plain.keys() == choice_fields
        assert all(shaped[name] is None for name in choice_fields - {"stop_reason"})
        if message_fields:
            assert shaped["message"].keys() - plain["message"].keys() == message_fields
            assert all(shaped["message"][name] is None for name in message_fields)
    assert body["usage"]["completion_tokens_details"] is None
    assert body["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 4, "created_cache_tokens": 1, "multimodal_tokens": None}
    assert all(body[name] is None for name in body_fields - {"system_fingerprint"})


def test_a_choices_frame_keeps_stop_reasons_and_refuses_an_unknown_version() -> None:
    choices = (Choice("a", "stop", 2, None, "ou"), Choice("b", "stop", 3, None, 7),
               Choice("c", "length", 4, (TokenLogprob("c", -inf, (("c", -0.5),)),)))
    decoded = decode_choices(encode_choices(choices))
    assert decoded[:2] == choices[:2]
    assert decoded[2].logprobs == (TokenLogprob("c", LOWEST_LOGPROB, (("c", -0.5),)),)
    unknown = compression.compress(json.dumps({"v": 99, "choices": []}).encode())
    with pytest.raises(ValueError, match="version 99"):
        decode_choices(unknown)


_FINISHED_AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
_CREATED = 1767323045


def _row(line: int, custom_id: str, job_id: str | None = None, *, status: str | None = None,
         error: dict[str, Any] | None = None, job_error: str | None = None,
         answer: str | None = None, completion_tokens: int | None = None,
         finish_reason: str | None = None, stop_reason: str | None = None) -> OutputRow:
    """A line as the batch store gives it: 12 prompt tokens, 8 of them cached, 5 allowed; an
    answer a stop string ended stored with its choices frame, as the worker stores it."""
    ran = status in ("succeeded", "failed")
    frame = None if stop_reason is None else encode_choices(
        [Choice(answer or "", finish_reason, completion_tokens or 0, None, stop_reason)])
    return OutputRow(line, custom_id, job_id, error, status, job_error,
                     12 if job_id else None, 5 if job_id else 0,
                     _FINISHED_AT if ran else None, answer, completion_tokens,
                     8 if answer is not None else None, finish_reason, {"max_tokens": 5},
                     frame)


def _usage(completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": 12, "completion_tokens": completion_tokens,
            "total_tokens": 12 + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 8}}


_CHAT_BODY = {"id": "chatcmpl-j1", "object": "chat.completion", "created": _CREATED,
              "model": "jobsvc", "choices": [{
                  "index": 0, "message": {"role": "assistant", "content": 'héllo ✓ "q"'},
                  "finish_reason": "stop", "logprobs": None}],
              "usage": _usage(3)}
_TEXT_BODY = {"id": "cmpl-j2", "object": "text_completion", "created": _CREATED,
              "model": "jobsvc", "choices": [{"index": 0, "text": "five",
                                              "finish_reason": "length", "logprobs": None}],
              "usage": _usage(5)}


# The same bodies as `vllm run-batch` writes them: vLLM's fields in its order, nulls for what
# no request of jobsvc's asks for, the stop string that ended an answer, the system's name.
def _vllm_usage(completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": 12, "total_tokens": 12 + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 8, "created_cache_tokens": None,
                                      "multimodal_tokens": None},
            "completion_tokens_details": None}


_FINGERPRINT = f"jobsvc-{metadata.version('jobsvc')}"
_TRANSFERS = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
_VLLM_CHAT_BODY = {
    "id": "chatcmpl-j1", "object": "chat.completion", "created": _CREATED, "model": "jobsvc",
    "choices": [{"index": 0, "message": {
        "role": "assistant", "content": 'héllo ✓ "q"', "refusal": None, "annotations": None,
        "audio": None, "function_call": None, "reasoning": None},
        "logprobs": None, "finish_reason": "stop", "stop_reason": "ou", "token_ids": None,
        "routed_experts": None}],
    "service_tier": None, "system_fingerprint": _FINGERPRINT, "usage": _vllm_usage(3),
    "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None, **_TRANSFERS}
_VLLM_TEXT_BODY = {
    "id": "cmpl-j2", "object": "text_completion", "created": _CREATED, "model": "jobsvc",
    "choices": [{"index": 0, "text": "five", "logprobs": None, "finish_reason": "length",
                 "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                 "prompt_token_ids": None, "routed_experts": None}],
    "service_tier": None, "system_fingerprint": _FINGERPRINT, "usage": _vllm_usage(5),
    **_TRANSFERS}
_REFUSAL = {"message": "max_tokens must be at least 1", "type": "invalid_request_error",
            "param": "max_tokens", "code": "invalid_value"}
# A line without a job is named by a hash of its batch and line number.
_UNNAMED = "8978b9e27d4d04748932e1cb"
_CANCELLED = ended_error("cancelled")

# endpoint, the batch's ending, the row, its file, its OpenAI line, its `vllm run-batch` line
_RENDERED: list[tuple[str, str, OutputRow, str, dict[str, Any], dict[str, Any]]] = [
    (CHAT_ENDPOINT, "expired",
     _row(1, "a", "j1", status="succeeded", answer='héllo ✓ "q"', completion_tokens=3,
          finish_reason="stop", stop_reason="ou"), "output",
     {"id": "batch_req_j1", "custom_id": "a", "response": {
         "status_code": 200, "request_id": "req_j1", "body": _CHAT_BODY}, "error": None},
     {"id": "vllm-j1", "custom_id": "a", "response": {
         "status_code": 200, "request_id": "vllm-batch-j1", "body": _VLLM_CHAT_BODY},
      "error": None}),
    (COMPLETIONS_ENDPOINT, "expired",
     _row(2, "b", "j2", status="succeeded", answer="five", completion_tokens=5), "output",
     {"id": "batch_req_j2", "custom_id": "b", "response": {
         "status_code": 200, "request_id": "req_j2", "body": _TEXT_BODY}, "error": None},
     {"id": "vllm-j2", "custom_id": "b", "response": {
         "status_code": 200, "request_id": "vllm-batch-j2", "body": _VLLM_TEXT_BODY},
      "error": None}),
    (CHAT_ENDPOINT, "expired",
     _row(3, "c", "j3", status="failed", job_error="the engine died"), "error",
     {"id": "batch_req_j3", "custom_id": "c", "response": {
         "status_code": 500, "request_id": "req_j3", "body": {"error": {
             "message": "the engine died", "type": "server_error", "param": None,
             "code": "job_failed"}}}, "error": None},
     {"id": "vllm-j3", "custom_id": "c", "response": {
         "status_code": 500, "request_id": "vllm-batch-j3", "body": None},
      "error": {"error": {"message": "the engine died", "type": "server_error",
                          "param": None, "code": 500}}}),
    (CHAT_ENDPOINT, "expired",
     _row(5, "e", error={"status_code": 400, "error": _REFUSAL}), "error",
     {"id": f"batch_req_{_UNNAMED}", "custom_id": "e", "response": {
         "status_code": 400, "request_id": f"req_{_UNNAMED}", "body": {"error": _REFUSAL}},
      "error": None},
     {"id": f"vllm-{_UNNAMED}", "custom_id": "e", "response": {
         "status_code": 400, "request_id": f"vllm-batch-{_UNNAMED}", "body": None},
      "error": {"error": {**_REFUSAL, "code": 400}}}),
    (COMPLETIONS_ENDPOINT, "cancelled", _row(8, "h", "j8", status="queued"), "error",
     {"id": "batch_req_j8", "custom_id": "h", "response": None, "error": _CANCELLED},
     {"id": "vllm-j8", "custom_id": "h", "response": None,
      "error": {"error": {**_CANCELLED, "type": "BatchError", "param": None}}}),
]


@pytest.mark.parametrize(("endpoint", "ending", "row", "file", "openai", "vllm"), _RENDERED,
                         ids=["answered chat", "answered completion at its limit",
                              "job failed", "refused at ingest", "unrun at a cancel"])
def test_a_finished_row_renders_to_the_same_openai_and_vllm_lines_byte_for_byte(
        endpoint: str, ending: str, row: OutputRow, file: str, openai: dict[str, Any],
        vllm: dict[str, Any]) -> None:
    kind, line = file_line("batch_1", ending, row, tokenizer_model="ops/tiny-llama")
    assert kind == file

    def exact(expected: dict[str, Any]) -> bytes:
        # Key order, compact separators and unescaped text are part of the bytes.
        return json.dumps(expected, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    assert jsonl(openai_line(line, endpoint=endpoint, model="jobsvc")) == exact(openai)
    assert jsonl(vllm_line(line, endpoint=endpoint, model="jobsvc")) == exact(vllm)
