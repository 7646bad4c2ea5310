"""Job validation and the batch message format: pure logic."""

from __future__ import annotations

import pytest

from jobsvc.errors import InvalidJob
from jobsvc.messages import PlacedJob, form_messages
from jobsvc.wire import JobLimits, MessageError, QueueMessage, validate_job

pytestmark = pytest.mark.unit

LIMITS = JobLimits(max_document_chars=1000, max_question_chars=100, max_stop_chars=10,
                   max_job_bytes=1024)


def test_defaults_are_filled_and_stop_lists_normalised() -> None:
    job = validate_job("doc", "q?", {"stop": ("END",)}, LIMITS)
    assert job.sampling == {"max_tokens": 64, "temperature": 0.0, "stop": ["END"]}


@pytest.mark.parametrize(("document", "question", "message"), [
    ("x" * 1001, "q", "over the limit"),
    ("doc", "q" * 101, "over the limit"),
    ("doc\x00", "q", "NUL"),
    ("doc", "\ud800", "surrogate"),
])
def test_text_limits_and_encodings_are_enforced(document: str, question: str,
                                                message: str) -> None:
    with pytest.raises(InvalidJob, match=message):
        validate_job(document, question, {}, LIMITS)


@pytest.mark.parametrize(("sampling", "message"), [
    ({"stop": ["x" * 11]}, "stop has a string of 11 characters.*JOBSVC_MAX_STOP_CHARS"),
    ({"stop": ["x"] * 17}, "stop must be a list of at most 16"),
    ({"stop": ["x" * 10] * 16, "max_tokens": 8}, None),
])
def test_stop_strings_are_bounded_in_number_and_length(sampling: dict[str, object],
                                                       message: str | None) -> None:
    if message is None:
        assert validate_job("doc", "q", sampling, LIMITS).sampling["stop"] == sampling["stop"]
        return
    with pytest.raises(InvalidJob, match=message):
        validate_job("doc", "q", sampling, LIMITS)


def test_a_job_larger_encoded_than_a_worker_reads_is_refused_naming_the_limit() -> None:
    with pytest.raises(InvalidJob, match="JOBSVC_MAX_JOB_BYTES"):
        validate_job("doc", "q" * 100, {"stop": ["\u2603" * 10] * 16}, LIMITS)


def test_batch_message_round_trips_through_its_wire_form() -> None:
    message = QueueMessage(2, ["a", "b"], "m1")
    assert QueueMessage.from_wire(message.to_wire(), "m1") == message


def test_batch_messages_carry_job_ids_and_nothing_that_decides_an_answer() -> None:
    assert QueueMessage(0, ["a"], "m1").to_wire() == {"v": 3, "shard": 0, "jobs": ["a"]}


@pytest.mark.parametrize("wire", [
    None, [], "not json at all", [1, 2, 3], {"v": 3}, {"v": 3, "shard": "0", "jobs": []},
    # Version 2 carried questions, sampling and loads; it is refused like any other version.
    {"v": 2, "shard": 0, "jobs": [["a", "d", [1], {}, 1, 1]]},
    {"v": 3, "shard": 0, "jobs": [""]},
    {"v": 3, "shard": 0, "jobs": ["a" * 65]},
    {"v": 3, "shard": 0, "jobs": [["a", "d"]]},
    {"v": 3, "shard": True, "jobs": []},
    {"v": 3, "shard": 0, "jobs": {"a": "d"}},
])
def test_messages_not_of_our_schema_are_refused(wire: object) -> None:
    with pytest.raises(MessageError):
        QueueMessage.from_wire(wire, "m1")


def test_batches_keep_a_documents_questions_together() -> None:
    placed = [PlacedJob("a1", 0, "A"), PlacedJob("b1", 1, "B"), PlacedJob("c1", 0, "C"),
              PlacedJob("a2", 0, "A"), PlacedJob("c2", 0, "C"), PlacedJob("a3", 0, "A")]
    messages = form_messages(placed, batch_size=4)
    assert [(m.shard, m.job_ids) for m in messages] == [
        (0, ["a1", "a2", "a3", "c1"]), (0, ["c2"]), (1, ["b1"])]
    assert len({m.message_id for m in messages}) == 3
