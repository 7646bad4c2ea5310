"""Tool calling on the real engine, as vLLM's server serves it: batch lines with `tools`
through `jobsvc serve` (the official `openai` client, strict response validation) and through
`jobsvc run-batch` (vLLM's shape of call IDs). The model's weights are random, so the tools'
parameters take enumerated values only, which a constrained answer closes quickly."""

from __future__ import annotations

import io
import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion

from jobsvc.batchapi.tool_calls import OPENAI_CALL_ID_PREFIX, VLLM_CALL_ID_PREFIX
from jobsvc.child_processes import LocalWorkers
from jobsvc.runbatch import run_batch
from jobsvc.settings import Settings
from jobsvc.workloads import document, question
from tests.support.batch_files import jsonl, line, results, start_batch, wait_for
from tests.support.batch_server import API_KEY, openai_client, server_in_thread

pytestmark = pytest.mark.integration

WEATHER = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}},
           "required": ["unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}},
        "required": ["zone"], "additionalProperties": False}
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} now",
                                           "parameters": parameters}}
         for name, parameters in PARAMETERS.items()]
WEATHER_ONLY = {"type": "function", "function": {"name": "get_weather"}}
# A conversation that called a tool and has its result.
EARLIER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"unit": "c"}'}}


@pytest.fixture()
def api(settings: Settings) -> Any:
    with server_in_thread(replace(settings, api_key=API_KEY)) as url:
        yield openai_client(url)


def _chat_lines(rng: random.Random) -> list[dict[str, Any]]:
    text = document(rng, 120)

    def chat(custom_id: str, **fields: Any) -> dict[str, Any]:
        return line(custom_id, {"model": "jobsvc", "temperature": 1.0, "max_tokens": 300,
                                "messages": [{"role": "system", "content": text},
                                             {"role": "user", "content": question(rng)}],
                                **fields})

    return [chat("named", tools=TOOLS, tool_choice=WEATHER_ONLY, seed=1),
            chat("required", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                 n=2, seed=2),
            chat("none", tools=TOOLS, tool_choice="none", max_tokens=6),
            chat("auto", tools=TOOLS, max_tokens=6),
            line("conversation", {"max_tokens": 6, "tools": TOOLS, "messages": [
                {"role": "user", "content": "What is the weather?"},
                {"role": "assistant", "content": None, "tool_calls": [EARLIER_CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]}),
            chat("unknown-function", tools=TOOLS, tool_choice={
                "type": "function", "function": {"name": "get_news"}}),
            chat("bad-parameters", tools=[{"type": "function", "function": {
                "name": "get_weather", "parameters": {"type": "strnig"}}}],
                 tool_choice=WEATHER_ONLY),
            chat("functions", functions=[{"name": "get_weather"}])]


def _assert_valid_call(call: Any, prefix: str, names: tuple[str, ...]) -> None:
    assert call.id.startswith(prefix) and call.type == "function"
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_batchs_tool_choices_answer_with_calls_that_fit_the_tools_or_with_text(
        api: openai.OpenAI, worker: LocalWorkers) -> None:
    lines = _chat_lines(random.Random(61))
    batch = wait_for(api, start_batch(api, lines).id)
    assert batch.status == "completed", batch
    output, errors = results(api, batch)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 3), errors
    bodies = {item["custom_id"]: ChatCompletion.model_validate(item["response"]["body"])
              for item in output}

    [named] = bodies["named"].choices
    assert named.finish_reason == "stop", named
    [call] = named.message.tool_calls or []
    _assert_valid_call(call, OPENAI_CALL_ID_PREFIX, ("get_weather",))
    assert named.message.content == ""

    required = bodies["required"].choices
    assert len(required) == 2
    for choice in required:
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls or []
        _assert_valid_call(call, OPENAI_CALL_ID_PREFIX, ("get_weather", "get_time"))
    # Each choice's calls have IDs of their own.
    assert len({choice.message.tool_calls[0].id for choice in required
                if choice.message.tool_calls}) == 2

    for custom_id in ("none", "auto", "conversation"):
        [choice] = bodies[custom_id].choices
        assert isinstance(choice.message.content, str) and not choice.message.tool_calls
        assert choice.finish_reason in ("stop", "length")

    refusals = {item["custom_id"]: item["response"] for item in errors}
    assert {custom_id: (refusal["status_code"], refusal["body"]["error"]["param"],
                        refusal["body"]["error"]["code"])
            for custom_id, refusal in refusals.items()} == {
        "unknown-function": (400, "tool_choice.function.name", "invalid_value"),
        "bad-parameters": (400, "tools[0].function.parameters", "invalid_value"),
        "functions": (400, "functions", "unsupported_parameter")}
    assert "get_news" in refusals["unknown-function"]["body"]["error"]["message"]


def test_run_batch_reads_auto_answers_with_the_configured_parser_and_names_calls_as_vllm(
        settings: Settings, worker: LocalWorkers, tmp_path: Path) -> None:
    rng = random.Random(62)
    lines = [line("named", {"max_tokens": 300, "temperature": 1.0, "seed": 3,
                            "tools": TOOLS, "tool_choice": WEATHER_ONLY,
                            "messages": [{"role": "user", "content": question(rng)}]}),
             line("auto", {"max_tokens": 12, "tools": TOOLS,
                           "messages": [{"role": "user", "content": question(rng)}]})]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(lines))
    batch = run_batch(replace(settings, tool_call_parser="hermes"), source, target,
                      progress_stream=io.StringIO())
    assert batch.status == "completed" and (batch.completed, batch.failed) == (2, 0)
    written = {item["custom_id"]: item for item in
               (json.loads(raw) for raw in target.read_text().splitlines())}
    named = ChatCompletion.model_validate(written["named"]["response"]["body"])
    [call] = named.choices[0].message.tool_calls or []
    _assert_valid_call(call, VLLM_CALL_ID_PREFIX, ("get_weather",))
    # Random weights write no call syntax: the parser finds none, and the answer is text.
    [auto] = ChatCompletion.model_validate(written["auto"]["response"]["body"]).choices
    assert isinstance(auto.message.content, str) and not auto.message.tool_calls
    assert auto.finish_reason in ("stop", "length")
