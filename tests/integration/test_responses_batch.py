"""A `/v1/responses` batch on the real engine through `jobsvc serve` and the official `openai`
client (strict response validation): text in, Response objects out, a JSON schema honoured,
an answer cut at `max_output_tokens` marked incomplete, and what is not served refused by its
Responses field."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import Response
from sqlalchemy import select

from jobsvc.child_processes import LocalWorkers
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.store.tables import Job
from jobsvc.workloads import document, question
from tests.support.batch_files import line, results, start_batch, wait_for
from tests.support.batch_server import API_KEY, openai_client, server_in_thread

pytestmark = pytest.mark.integration

RESPONSES = "/v1/responses"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["label"],
          "properties": {"label": {"enum": ["yes", "no", "unsure"]}}}


@pytest.fixture()
def api(settings: Settings) -> Any:
    with server_in_thread(replace(settings, api_key=API_KEY)) as url:
        yield openai_client(url)


def test_a_responses_batch_answers_in_response_objects_and_refuses_by_field(
        api: openai.OpenAI, worker: LocalWorkers, settings: Settings) -> None:
    rng = random.Random(60)
    text = document(rng, 200)

    def request(custom_id: str, **body: Any) -> dict[str, Any]:
        return line(custom_id, {"model": "jobsvc", "instructions": text, **body}, RESPONSES)

    lines = [
        request("string", input=question(rng), max_output_tokens=8, temperature=0),
        request("messages", max_output_tokens=8, input=[
            {"role": "user", "content": [{"type": "input_text", "text": question(rng)}]}]),
        request("schema", input=question(rng), max_output_tokens=64, temperature=1.0, seed=3,
                text={"format": {"type": "json_schema", "name": "verdict", "schema": SCHEMA,
                                 "strict": True}}),
        request("tools", input="q", tools=[{"type": "function", "name": "f"}]),
        request("zero", input="q", max_output_tokens=0),
        request("image", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/a.png"}]}])]
    batch = wait_for(api, start_batch(api, lines, RESPONSES).id)
    assert batch.status == "completed" and batch.endpoint == RESPONSES, batch
    output, errors = results(api, batch)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 3), errors
    responses = {item["custom_id"]: Response.model_validate(item["response"]["body"])
                 for item in output}

    for custom_id in ("string", "messages"):
        response = responses[custom_id]
        assert response.object == "response" and response.output_text
        assert response.status in ("completed", "incomplete")
        if response.status == "incomplete":
            assert response.incomplete_details is not None
            assert response.incomplete_details.reason == "max_output_tokens"
        usage = response.usage
        assert usage is not None and 0 < usage.output_tokens <= 8
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        assert usage.input_tokens_details.cached_tokens <= usage.input_tokens
    assert responses["string"].temperature == 0
    schema = responses["schema"]
    assert schema.status == "completed", schema
    jsonschema.validate(json.loads(schema.output_text), SCHEMA)
    assert schema.text is not None and schema.text.format is not None
    assert schema.text.format.type == "json_schema"

    refusals = {item["custom_id"]: item["response"]["body"]["error"] for item in errors}
    assert (refusals["tools"]["param"], refusals["tools"]["code"]) == (
        "tools", "unsupported_parameter")
    assert refusals["zero"]["param"] == "max_output_tokens"
    assert refusals["image"]["param"] == "input[0].content[0].type"

    # The instructions are the shared prefix: every question on them is stored and routed
    # as one document.
    store = Store(settings.resolved_database_url)
    try:
        with store.engine.connect() as connection:
            rows = list(connection.execute(select(Job.document_key, Job.shard).where(
                Job.idempotency_key.startswith(batch.id))))
    finally:
        store.dispose()
    assert len(rows) == 3 and len(set(rows)) == 1
