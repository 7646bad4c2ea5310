"""Batch files as the Batch API reads them: lines cut from chunks, the structure that fails
a whole file, the content that fails one line, the cut into shared prefix + own suffix, and
the shapes of output lines."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from jobsvc.batchapi.lines import MAX_LINES, FileCheck, split_lines
from jobsvc.batchapi.rendering import ChatTemplate, split_prompt
from jobsvc.batchapi.requests import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    ChatRequest,
    CompletionRequest,
    LineError,
    parse_request,
)
from jobsvc.batchapi.responses import Answer, response_body
from jobsvc.runbatch import to_vllm_line
from jobsvc.settings import TINY_MODEL

pytestmark = pytest.mark.unit


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
    ({"messages": [{"role": "user", "content": "q"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "q"}], "stream": True}, "stream"),
    ({"messages": [{"role": "user", "content": "q"}], "tools": [{"type": "function"}]},
     "tools"),
    ({"messages": [{"role": "user", "content": "q"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "q"}], "temperature": 2.5}, "temperature"),
    ({"messages": [{"role": "user", "content": "q"}], "top_p": 0}, "top_p"),
    ({"messages": [{"role": "user", "content": "q"}], "model": "gpt-4o"}, "model"),
    ({"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "q"}], "frobnicate": 1}, "frobnicate"),
    ({"messages": []}, "messages"),
])
def test_a_chat_line_asking_for_what_is_not_served_fails_naming_the_field(
        body: dict[str, object], param: str) -> None:
    with pytest.raises(LineError) as refused:
        parse_request(CHAT_ENDPOINT, body, served_model="jobsvc", max_stop_chars=100)
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
        served_model="jobsvc", max_stop_chars=100)
    assert isinstance(chat, ChatRequest)
    assert chat.max_tokens == 7
    assert chat.messages == [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": "a\nb"}]
    assert chat.sampling == {"temperature": 1.0, "top_p": 0.5, "seed": 3, "stop": ["END"],
                             "presence_penalty": 0.1, "top_k": 5, "repetition_penalty": 1.1}
    unlimited = parse_request(CHAT_ENDPOINT, {"messages": [{"role": "user", "content": "q"}]},
                              served_model="jobsvc", max_stop_chars=100)
    assert unlimited.max_tokens is None
    completion = parse_request(COMPLETIONS_ENDPOINT, {"prompt": ["text"], "temperature": 0},
                               served_model="jobsvc", max_stop_chars=100)
    assert isinstance(completion, CompletionRequest)
    assert (completion.prompt, completion.max_tokens, completion.sampling) == (
        "text", 16, {"temperature": 0})
    with pytest.raises(LineError) as refused:
        parse_request(COMPLETIONS_ENDPOINT, {"prompt": "x", "echo": True},
                      served_model="jobsvc", max_stop_chars=100)
    assert refused.value.param == "echo"


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
    ok = to_vllm_line({"id": "batch_req_j", "custom_id": "a", "error": None, "response": {
        "status_code": 200, "request_id": "req_j", "body": {"object": "chat.completion"}}})
    assert ok["id"] == "vllm-j" and ok["response"]["body"] == {"object": "chat.completion"}
    bad = to_vllm_line({"id": "batch_req_k", "custom_id": "b", "error": None, "response": {
        "status_code": 400, "request_id": "req_k", "body": {"error": {
            "message": "m", "type": "invalid_request_error", "param": "n", "code": "x"}}}})
    assert bad["response"] == {"status_code": 400, "request_id": "vllm-batch-k", "body": None}
    assert bad["error"] == {"error": {"message": "m", "type": "invalid_request_error",
                                      "param": "n", "code": 400}}
