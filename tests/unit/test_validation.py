"""Every check of a job's values, whichever way the job comes in: pure logic."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from jobsvc.errors import InvalidJob
from jobsvc.validation import (
    MAX_IDEMPOTENCY_KEY_CHARS,
    MAX_LOGPROB_ENTRIES,
    ContextExceeded,
    JobLimits,
    Unsupported,
    check_prompt,
    check_sampling,
    check_sampling_value,
    first_unstorable,
    storable,
    validate_job,
)

pytestmark = pytest.mark.unit

LIMITS = JobLimits(max_document_chars=1000, max_question_chars=100, max_stop_chars=10,
                   max_job_bytes=1024, priority_scheduling=False)


def job(document: Any = "doc", question: Any = "q", **fields: Any) -> dict[str, Any]:
    return {"document": document, "question": question, **fields}


def test_defaults_are_filled_and_stop_lists_normalised() -> None:
    accepted = validate_job(job(question="q?", stop=("END",)), LIMITS)
    assert accepted.sampling == {"max_tokens": 64, "temperature": 0.0, "stop": ["END"]}
    assert (accepted.document, accepted.question, accepted.idempotency_key) == (
        "doc", "q?", None)


@pytest.mark.parametrize(("document", "question", "message"), [
    ("x" * 1001, "q", "over the limit"),
    ("doc", "q" * 101, "over the limit"),
    ("doc\x00", "q", "NUL"),
    ("doc", "\ud800", "surrogate"),
])
def test_text_limits_and_encodings_are_enforced(document: str, question: str,
                                                message: str) -> None:
    with pytest.raises(InvalidJob, match=message):
        validate_job(job(document, question), LIMITS)


@pytest.mark.parametrize(("sampling", "message"), [
    ({"stop": ["x" * 11]}, "stop has a string of 11 characters.*JOBSVC_MAX_STOP_CHARS"),
    ({"stop": ["x"] * 17}, "stop must be a list of at most 16"),
    ({"stop": ["x" * 10] * 16, "max_tokens": 8}, None),
])
def test_stop_strings_are_bounded_in_number_and_length(sampling: dict[str, object],
                                                       message: str | None) -> None:
    if message is None:
        assert validate_job(job(**sampling), LIMITS).sampling["stop"] == sampling["stop"]
        return
    with pytest.raises(InvalidJob, match=message):
        validate_job(job(**sampling), LIMITS)


@pytest.mark.parametrize("stop", [["\ud800"], ["ok", "a\x00"]])
def test_a_stop_string_the_engine_cannot_take_is_refused(stop: list[str]) -> None:
    with pytest.raises(InvalidJob, match=r"stop has a string with a (lone surrogate|NUL)"):
        validate_job(job(stop=stop), LIMITS)


def test_a_job_larger_encoded_than_a_worker_reads_is_refused_naming_the_limit() -> None:
    with pytest.raises(InvalidJob, match="JOBSVC_MAX_JOB_BYTES"):
        validate_job(job(question="q" * 100, stop=["\u2603" * 10] * 16), LIMITS)


@pytest.mark.parametrize(("fields", "field"), [
    ({"document": None}, "document"),
    ({"question": ""}, "question"),
    ({"temperature": 2.5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": 1.5}, "top_k"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"seed": float("nan")}, "seed"),
    ({"beam_width": 4}, "beam_width"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
])
def test_a_refusal_names_its_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidJob) as refused:
        validate_job(job(**fields), LIMITS)
    assert refused.value.field == field and field in str(refused.value)


def test_a_job_that_is_no_mapping_is_refused() -> None:
    with pytest.raises(InvalidJob, match="expected a mapping, got str"):
        validate_job("just a string", LIMITS)


@pytest.mark.parametrize(("key", "message"), [
    ("", "a string of 1 to 128"),
    ("k" * (MAX_IDEMPOTENCY_KEY_CHARS + 1), "a string of 1 to 128"),
    (42, "a string of 1 to 128"),
    ("key\x00", "contains a NUL"),
    ("key\udc00", "contains a lone surrogate"),
])
def test_idempotency_keys_are_short_storable_strings(key: object, message: str) -> None:
    with pytest.raises(InvalidJob, match=message) as refused:
        validate_job(job(idempotency_key=key), LIMITS)
    assert refused.value.field == "idempotency_key"


def test_an_idempotency_key_is_kept_apart_from_the_sampling() -> None:
    accepted = validate_job(job(idempotency_key="k" * MAX_IDEMPOTENCY_KEY_CHARS), LIMITS)
    assert accepted.idempotency_key == "k" * MAX_IDEMPOTENCY_KEY_CHARS
    assert "idempotency_key" not in accepted.sampling


def test_sampling_alone_is_checked_as_a_jobs_is() -> None:
    assert check_sampling({"temperature": 1.0, "stop": ("a",)}, 10, priority_scheduling=False) == {
        "temperature": 1.0, "stop": ["a"]}
    with pytest.raises(InvalidJob, match="top_p") as refused:
        check_sampling({"top_p": 0}, 10, priority_scheduling=False)
    assert refused.value.field == "top_p"


def test_a_value_is_refused_under_the_name_its_caller_gave_it() -> None:
    with pytest.raises(InvalidJob, match=r"^max_completion_tokens must be") as refused:
        check_sampling_value("max_tokens", 0, 10, field="max_completion_tokens")
    assert refused.value.field == "max_completion_tokens"


def test_a_prompt_and_its_answer_must_fit_the_context_naming_what_to_shrink() -> None:
    check_prompt(90, {"max_tokens": 10}, 100, 1000, prompt_field="messages")
    with pytest.raises(ContextExceeded, match="shorten the messages or lower max_tokens") as long:
        check_prompt(90, {"max_tokens": 11}, 100, 1000, prompt_field="messages")
    assert long.value.field == "max_tokens"
    with pytest.raises(ContextExceeded) as longer:
        check_prompt(100, {"max_tokens": 0}, 100, 1000, prompt_field="prompt")
    assert longer.value.field == "prompt"


def test_a_prompt_of_a_single_token_is_refused_naming_its_field() -> None:
    with pytest.raises(InvalidJob, match="document is too short") as short:
        check_prompt(1, {"max_tokens": 4}, 100, 1000, prompt_field="document")
    assert short.value.field == "document" and not isinstance(short.value, ContextExceeded)


def test_min_tokens_is_checked_against_the_max_tokens_the_prompt_leaves() -> None:
    check_prompt(90, {"max_tokens": 10, "min_tokens": 10}, 100, 1000, prompt_field="messages")
    with pytest.raises(InvalidJob, match="min_tokens must not exceed max_tokens") as refused:
        check_prompt(90, {"max_tokens": 10, "min_tokens": 11}, 100, 1000, prompt_field="messages")
    assert refused.value.field == "min_tokens"


def test_log_probabilities_are_bounded_per_job_and_biases_name_the_models_tokens() -> None:
    context = 1 << 22
    within = {"max_tokens": MAX_LOGPROB_ENTRIES // 21, "logprobs": 20}
    check_prompt(90, within, context, 1000, prompt_field="prompt")
    for over in ({**within, "n": 2}, {**within, "max_tokens": within["max_tokens"] + 1}):
        with pytest.raises(InvalidJob, match="log probabilities") as refused:
            check_prompt(90, over, context, 1000, prompt_field="prompt")
        assert refused.value.field == "logprobs"
    check_prompt(90, {"max_tokens": 10 * MAX_LOGPROB_ENTRIES, "n": 2}, 1 << 30, 1000,
                 prompt_field="prompt")
    with pytest.raises(InvalidJob) as refused:
        validate_job(job(max_tokens=MAX_LOGPROB_ENTRIES, logprobs=0, n=2), LIMITS)
    assert refused.value.field == "logprobs"
    check_prompt(90, {"max_tokens": 8, "logit_bias": {"999": 5}}, 100, 1000,
                 prompt_field="prompt")
    with pytest.raises(InvalidJob, match="vocabulary") as refused:
        check_prompt(90, {"max_tokens": 8, "logit_bias": {"1000": 5}}, 100, 1000,
                     prompt_field="prompt")
    assert refused.value.field == "logit_bias"


def test_the_first_unstorable_string_of_a_json_value_is_found_with_its_path() -> None:
    body = {"messages": [{"role": "user", "content": "fine"},
                         {"role": "user", "content": "nul \x00"}], "k\ud800": "v"}
    assert first_unstorable(body) == ("messages[1].content", "a NUL character")
    assert first_unstorable({"k\ud800": "v"}) == ("k\ufffd", "a lone surrogate")
    assert first_unstorable({"a": [1, None, "ok"]}) is None
    assert storable("a\x00b\udfff") == "a\ufffdb\ufffd"


LABEL_SCHEMA = {"type": "object", "properties": {"label": {"enum": ["yes", "no"]}},
                "required": ["label"]}


@pytest.mark.parametrize(("fields", "constraint"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "label", "schema": LABEL_SCHEMA, "strict": True}}}, {"json": LABEL_SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": None}, None),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, {"regex": "[0-9]{3}"}),
    ({"structured_outputs": {"json": LABEL_SCHEMA, "disable_any_whitespace": True}},
     {"json": LABEL_SCHEMA, "disable_any_whitespace": True}),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
     {"grammar": 'root ::= "a" | "b"'}),
])
def test_a_structured_output_is_stored_as_vllms_constraint(
        fields: dict[str, Any], constraint: dict[str, Any] | None) -> None:
    sampling = validate_job(job(**fields), replace(LIMITS, max_job_bytes=4096)).sampling
    assert sampling.get("structured_outputs") == constraint
    assert "response_format" not in sampling


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"structured_outputs": {"regex": "("}}, "structured_outputs", "cannot be compiled"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs",
     "cannot be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "cannot be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/missing"}}}}, "response_format",
     "cannot be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": LABEL_SCHEMA}}},
     "response_format.json_schema.name", "non-empty string"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "must be one of"),
    ({"response_format": "json"}, "response_format.type", "must be one of"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object",
     "must be true"),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs",
     "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": ["a"]}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json",
     "JSON schema"),
    ({"structured_outputs": {"choice": ["a\x00"]}}, "structured_outputs.choice[0]", "NUL"),
    ({"structured_outputs": {"json": {"maximum": float("nan")}}}, "structured_outputs",
     "JSON values only"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
])
def test_a_constraint_the_backend_cannot_take_is_refused_naming_its_field(
        fields: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(InvalidJob, match=message) as refused:
        validate_job(job(**fields), LIMITS)
    assert refused.value.field == field and not isinstance(refused.value, Unsupported)


@pytest.mark.parametrize(("fields", "field"), [
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
])
def test_a_constraint_not_served_is_refused_as_unsupported(fields: dict[str, Any],
                                                           field: str) -> None:
    with pytest.raises(Unsupported) as refused:
        validate_job(job(**fields), LIMITS)
    assert refused.value.field == field


def test_a_schema_counts_toward_the_jobs_encoded_size() -> None:
    big = {"type": "object", "properties": {f"field_{i}": {"enum": ["a", "b"]}
                                            for i in range(40)}}
    with pytest.raises(InvalidJob, match="JOBSVC_MAX_JOB_BYTES"):
        validate_job(job(structured_outputs={"json": big}), LIMITS)
