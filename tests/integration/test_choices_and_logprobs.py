"""Several choices, log probabilities and logit biases on the real engine, through `jobsvc
serve` (the official `openai` client, strict response validation) and through the Python
API; and a priority refused by name while the engine schedules in arrival order."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from tokenizers import Tokenizer

from jobsvc import Client, InvalidJob, JobStatus
from jobsvc.child_processes import LocalWorkers
from jobsvc.settings import Settings
from jobsvc.workloads import document, question
from tests.support.batch_files import COMPLETIONS, line, results, start_batch, wait_for
from tests.support.batch_server import API_KEY, openai_client, server_in_thread

pytestmark = pytest.mark.integration

TIMEOUT = 180


@pytest.fixture()
def api(settings: Settings) -> Any:
    with server_in_thread(replace(settings, api_key=API_KEY)) as url:
        yield openai_client(url)


def _favoured_token(settings: Settings) -> tuple[str, int]:
    """A token that is one whole word of the tiny model's vocabulary, and its ID."""
    tokenizer = Tokenizer.from_file(f"{settings.model}/tokenizer.json")
    ids = tokenizer.encode(" the", add_special_tokens=False).ids
    assert len(ids) == 1, ids
    return tokenizer.decode(ids), ids[0]


def _assert_ranked(top: list[float], sampled: float, count: int) -> None:
    """`count` alternatives, most likely first, none less likely than the sampled token
    unless the sampled token is outside them."""
    assert len(top) == count
    assert top == sorted(top, reverse=True)
    assert all(value <= 0 for value in top)
    assert not top or sampled <= top[0] + 1e-4


def test_a_batchs_lines_get_their_choices_log_probabilities_and_biases(
        api: openai.OpenAI, worker: LocalWorkers, settings: Settings) -> None:
    rng = random.Random(58)
    text = document(rng, 200)
    token, favoured = _favoured_token(settings)

    def chat(custom_id: str, **fields: Any) -> dict[str, Any]:
        return line(custom_id, {"model": "jobsvc", "max_tokens": 6, "messages": [
            {"role": "system", "content": text}, {"role": "user", "content": question(rng)}],
            **fields})

    lines = [chat("logprobs", logprobs=True, top_logprobs=3, temperature=1.0, seed=1),
             chat("choices", n=3, logprobs=True, temperature=1.0),
             chat("bias", temperature=0, logit_bias={str(favoured): 100}, logprobs=True,
                  max_tokens=5),
             chat("priority", priority=1),
             chat("outside", logit_bias={"99999999": 5})]
    completions = [line("completion", {"prompt": f"{text}\n\nQ: {question(rng)}\nA:",
                                       "max_tokens": 5, "logprobs": 2, "n": 2, "best_of": 2,
                                       "temperature": 1.0}, COMPLETIONS)]
    completion_batch = start_batch(api, completions, COMPLETIONS)
    batch = wait_for(api, start_batch(api, lines).id)
    assert batch.status == "completed", batch
    output, errors = results(api, batch)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 2), errors
    bodies = {item["custom_id"]: ChatCompletion.model_validate(item["response"]["body"])
              for item in output}

    body = bodies["logprobs"]
    (choice,) = body.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    steps = choice.logprobs.content
    assert body.usage is not None and len(steps) == body.usage.completion_tokens > 0
    for step in steps:
        assert step.bytes == list(step.token.encode())
        _assert_ranked([top.logprob for top in step.top_logprobs], step.logprob, 3)

    body = bodies["choices"]
    assert [choice.index for choice in body.choices] == [0, 1, 2]
    assert all(choice.finish_reason in ("stop", "length") for choice in body.choices)
    tokens = [len(choice.logprobs.content or []) for choice in body.choices
              if choice.logprobs is not None]
    assert body.usage is not None and sum(tokens) == body.usage.completion_tokens
    assert all(not step.top_logprobs for choice in body.choices
               for step in (choice.logprobs.content or []) if choice.logprobs)

    body = bodies["bias"]
    (choice,) = body.choices
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert {step.token for step in choice.logprobs.content} == {token}

    refusals = {item["custom_id"]: item["response"]["body"]["error"] for item in errors}
    assert (refusals["priority"]["param"], refusals["priority"]["code"]) == (
        "priority", "unsupported_parameter")
    assert refusals["outside"]["param"] == "logit_bias"
    assert "vocabulary" in refusals["outside"]["message"]

    completion_batch = wait_for(api, completion_batch.id)
    output, errors = results(api, completion_batch)
    assert errors == [] and len(output) == 1
    body = Completion.model_validate(output[0]["response"]["body"])
    assert len(body.choices) == 2
    counted = 0
    for choice in body.choices:
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs
        assert logprobs.token_logprobs is not None and logprobs.text_offset is not None
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(
            logprobs.top_logprobs) == len(logprobs.text_offset)
        assert logprobs.text_offset[0] == 0
        for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True):
            assert token in top and 2 <= len(top) <= 3
        counted += len(logprobs.tokens)
    assert body.usage is not None and counted == body.usage.completion_tokens


def test_the_python_api_returns_every_choice_with_its_log_probabilities(
        client: Client, settings: Settings) -> None:
    rng = random.Random(59)
    text = document(rng, 200)
    token, favoured = _favoured_token(settings)
    several = client.submit(text, question(rng), max_tokens=5, temperature=1.0, n=2,
                            logprobs=2)
    biased, plain = client.submit_many([
        {"document": text, "question": question(rng), "max_tokens": 4,
         "logit_bias": {favoured: 100}, "logprobs": 0},
        {"document": text, "question": question(rng), "max_tokens": 4}])
    with pytest.raises(InvalidJob) as refused:
        client.submit(text, question(rng), priority=-1)
    assert refused.value.field == "priority"
    with pytest.raises(InvalidJob) as refused:
        client.submit(text, question(rng), logit_bias={10**8: 1})
    assert refused.value.field == "logit_bias"
    with pytest.raises(InvalidJob) as refused:
        client.submit(text, question(rng), n=0)
    assert refused.value.field == "n"

    several, biased, plain = client.wait([several, biased, plain], timeout=TIMEOUT)
    assert all(record.status is JobStatus.SUCCEEDED for record in (several, biased, plain))
    assert len(several.choices) == 2
    assert sum(choice.completion_tokens for choice in several.choices) == (
        several.completion_tokens)
    assert several.answer == several.choices[0].text
    for choice in several.choices:
        assert choice.logprobs is not None
        assert len(choice.logprobs) == choice.completion_tokens
        for step in choice.logprobs:
            _assert_ranked([logprob for _token, logprob in step.top], step.logprob, 2)

    (choice,) = biased.choices
    assert choice.logprobs is not None and choice.finish_reason == "length"
    assert {step.token for step in choice.logprobs} == {token}
    assert all(step.top == () for step in choice.logprobs)

    (choice,) = plain.choices
    assert (choice.text, choice.logprobs) == (plain.answer, None)
