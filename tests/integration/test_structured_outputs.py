"""Structured outputs on the real engine: OpenAI's `response_format` and vLLM's
`structured_outputs` through `jobsvc serve` (the official `openai` client, strict response
validation) and through the Python API. The model's weights are random, so every constraint
here closes within a few dozen sampled tokens: enumerated values, choices, a bounded regex."""

from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from typing import Any

import jsonschema
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from sqlalchemy import select

from jobsvc import Client, InvalidJob, JobStatus
from jobsvc.child_processes import LocalWorkers
from jobsvc.dispatch import PreparedJob
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.store.tables import Job
from jobsvc.workloads import document, question
from tests.support.batch_files import COMPLETIONS, line, results, start_batch, wait_for
from tests.support.batch_server import API_KEY, openai_client, server_in_thread

pytestmark = pytest.mark.integration

TIMEOUT = 180
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["label", "grade"],
          "properties": {"label": {"enum": ["yes", "no", "unsure"]},
                         "grade": {"enum": [1, 2, 3]}}}
JSON_SCHEMA = {"type": "json_schema",
               "json_schema": {"name": "grade", "schema": SCHEMA, "strict": True}}
# xgrammar and its fallback both refuse this type.
BAD_SCHEMA = {"type": "json_schema",
              "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}}
CHOICES = ["positive", "negative", "neutral"]
REGEX = r"[0-9]{3}-[a-c]{2}"


@pytest.fixture()
def api(settings: Settings) -> Any:
    with server_in_thread(replace(settings, api_key=API_KEY)) as url:
        yield openai_client(url)


def _stored_jobs(settings: Settings, where: Any) -> list[Job]:
    store = Store(settings.resolved_database_url)
    try:
        with store.engine.connect() as connection:
            return list(connection.execute(select(Job.document_key, Job.shard).where(where)))
    finally:
        store.dispose()


def test_a_batchs_formatted_lines_answer_inside_their_constraints_and_share_the_document(
        api: openai.OpenAI, worker: LocalWorkers, settings: Settings) -> None:
    rng = random.Random(56)
    text = document(rng, 200)

    def chat(custom_id: str, **fields: Any) -> dict[str, Any]:
        return line(custom_id, {"model": "jobsvc", "temperature": 1.0, "max_tokens": 200,
                                "messages": [{"role": "system", "content": text},
                                             {"role": "user", "content": question(rng)}],
                                **fields})

    lines = [chat("schema-1", response_format=JSON_SCHEMA, seed=1),
             chat("schema-2", response_format=JSON_SCHEMA, seed=2),
             chat("object", response_format={"type": "json_object"}, seed=3, max_tokens=64),
             chat("choice", structured_outputs={"choice": CHOICES}),
             chat("regex", structured_outputs={"regex": REGEX}),
             chat("text", response_format={"type": "text"}, max_tokens=4),
             chat("bad", response_format=BAD_SCHEMA),
             chat("tag", response_format={"type": "structural_tag", "format": {}})]
    completions = [line(f"completion-{kind}", {
        "prompt": f"{text}\n\nQuestion: {question(rng)}\nAnswer:", "max_tokens": 32,
        "structured_outputs": constraint}, COMPLETIONS)
        for kind, constraint in (("choice", {"choice": CHOICES}), ("regex", {"regex": REGEX}))]
    batch = start_batch(api, lines)
    completion_batch = wait_for(api, start_batch(api, completions, COMPLETIONS).id)
    batch = wait_for(api, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 2)
    output, errors = results(api, batch)
    bodies = {item["custom_id"]: ChatCompletion.model_validate(item["response"]["body"])
              for item in output}
    answers = {custom_id: (body.choices[0].message.content, body.choices[0].finish_reason)
               for custom_id, body in bodies.items()}
    for custom_id in ("schema-1", "schema-2"):
        content, finish_reason = answers[custom_id]
        assert finish_reason == "stop", content
        jsonschema.validate(json.loads(content), SCHEMA)
    content, finish_reason = answers["object"]
    # A free JSON object may still be writing a string when max_tokens ends it.
    if finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert finish_reason == "length" and content.lstrip().startswith("{"), content
    assert answers["choice"][0] in CHOICES
    assert re.fullmatch(REGEX, answers["regex"][0])
    refusals = {item["custom_id"]: item["response"] for item in errors}
    assert refusals["bad"]["status_code"] == 400
    assert refusals["bad"]["body"]["error"]["param"] == "response_format"
    assert "cannot be compiled" in refusals["bad"]["body"]["error"]["message"]
    assert refusals["tag"]["body"]["error"]["code"] == "unsupported_parameter"
    # The format is the job's own: every question on the document shares its stored prefix.
    stored = _stored_jobs(settings, Job.idempotency_key.startswith(batch.id))
    assert len(stored) == 6 and len({(row.document_key, row.shard) for row in stored}) == 1

    assert completion_batch.status == "completed", completion_batch
    output, errors = results(api, completion_batch)
    assert errors == []
    texts = {item["custom_id"]: Completion.model_validate(item["response"]["body"])
             .choices[0].text for item in output}
    assert texts["completion-choice"] in CHOICES
    assert re.fullmatch(REGEX, texts["completion-regex"])


def test_the_python_api_takes_openai_and_vllm_constraints_and_refuses_what_cannot_compile(
        client: Client, settings: Settings) -> None:
    rng = random.Random(57)
    text = document(rng, 200)
    ids = [client.submit(text, question(rng), max_tokens=200, temperature=1.0, seed=4,
                         response_format=JSON_SCHEMA),
           client.submit(text, question(rng), max_tokens=16,
                         structured_outputs={"choice": CHOICES}),
           *client.submit_many([
               {"document": text, "question": question(rng), "max_tokens": 32,
                "structured_outputs": {"regex": REGEX}},
               {"document": text, "question": question(rng), "max_tokens": 200,
                "temperature": 1.0, "seed": 5,
                "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}])]
    with pytest.raises(InvalidJob) as refused:
        client.submit(text, question(rng), response_format=BAD_SCHEMA)
    assert refused.value.field == "response_format"
    with pytest.raises(InvalidJob) as refused:
        client.submit_many([{"document": text, "question": "q"},
                            {"document": text, "question": "q",
                             "structured_outputs": {"regex": "("}}])
    assert refused.value.field == "structured_outputs"
    records = client.wait(ids, timeout=TIMEOUT)
    assert all(record.status is JobStatus.SUCCEEDED for record in records), records
    schema_answer, choice_answer, regex_answer, compact_answer = (
        record.answer for record in records)
    jsonschema.validate(json.loads(schema_answer), SCHEMA)
    assert choice_answer in CHOICES
    assert re.fullmatch(REGEX, regex_answer)
    jsonschema.validate(json.loads(compact_answer), SCHEMA)
    stored = _stored_jobs(settings, Job.id.in_(ids))
    assert len({(row.document_key, row.shard) for row in stored}) == 1


def test_a_constraint_the_engine_refuses_fails_its_job_alone(client: Client) -> None:
    """What passed no validator (`submit_prepared` takes sampling as checked) and the engine
    refuses ends its job failed with the engine's reason; its message-mate answers."""
    prefix = list(range(100, 140))
    jobs = [PreparedJob("engine refusal document", prefix, "q", [7, 8], {
                "max_tokens": 8, "structured_outputs": {"regex": "("}},
                        model=client.settings.served_model_name),
            PreparedJob("engine refusal document", prefix, "q", [9, 10], {
                "max_tokens": 8, "structured_outputs": {"choice": CHOICES}},
                        model=client.settings.served_model_name)]
    refused, answered = client.wait(client.submit_prepared(jobs), timeout=TIMEOUT)
    assert refused.status is JobStatus.FAILED and "regex" in refused.error, refused.error
    assert answered.status is JobStatus.SUCCEEDED and answered.answer in CHOICES
