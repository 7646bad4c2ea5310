"""Job validation and the batch message format: pure logic."""

from __future__ import annotations

import pytest

from jobsvc.batching import form_batches
from jobsvc.errors import InvalidJob
from jobsvc.schema import BatchMessage, MessageError, QueuedJob, validate_job

LIMITS = {"max_document_chars": 1000, "max_question_chars": 100}


def test_defaults_are_filled_and_stop_lists_normalised() -> None:
    job = validate_job("doc", "q?", {"stop": ("END",)}, **LIMITS)
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
        validate_job(document, question, {}, **LIMITS)


def _job(job_id: str, document: str) -> QueuedJob:
    return QueuedJob(job_id, document, [7, 8], {"max_tokens": 4}, 10, 42)


def test_batch_message_round_trips_through_its_wire_form() -> None:
    message = BatchMessage(2, [_job("a", "d"), _job("b", "d")])
    assert BatchMessage.from_wire(message.to_wire()) == message


def test_batch_messages_name_documents_and_carry_none() -> None:
    wire = BatchMessage(0, [_job("a", "d")]).to_wire()
    assert wire == {"v": 2, "shard": 0, "jobs": [["a", "d", [7, 8], {"max_tokens": 4}, 10, 42]]}


def test_a_job_enqueued_without_its_load_returns_its_estimated_prefill() -> None:
    """Messages enqueued before loads counted decoding were charged the prefill alone."""
    wire = {"v": 2, "shard": 0, "jobs": [["a", "d", [7, 8], {"max_tokens": 4}, 10]]}
    assert BatchMessage.from_wire(wire).jobs[0].load == 10


@pytest.mark.parametrize("wire", [
    None, [], {"v": 2}, {"v": 2, "shard": "0", "jobs": []},
    # Version 1 carried the documents' tokens; it is refused like any other version.
    {"v": 1, "shard": 0, "documents": {"d": [1]}, "jobs": [["a", "d", [1], {}, 1]]},
    {"v": 3, "shard": 0, "jobs": []},
    {"v": 2, "shard": 0, "jobs": [["a", "", [1], {}, 1]]},
    {"v": 2, "shard": 0, "jobs": [["a", ["d"], [1], {}, 1]]},
    {"v": 2, "shard": 0, "jobs": [["", "d", [1], {}, 1]]},
    {"v": 2, "shard": 0, "jobs": [["a", "d", [1, -2], {}, 1]]},
    {"v": 2, "shard": 0, "jobs": [["a", "d", [1], {"x": 1}, 1]]},
    {"v": 2, "shard": 0, "jobs": [["a", "d", [1], {}]]},
    {"v": 2, "shard": 0, "jobs": [["a", "d", [1], {}, 1, "2"]]},
    {"v": 2, "shard": 0, "jobs": [["a", "d", [1], {}, 1, 2, 3]]},
    {"v": 2, "shard": True, "jobs": []},
    {"v": 2, "shard": 0, "jobs": {"a": "d"}},
])
def test_messages_not_of_our_schema_are_refused(wire: object) -> None:
    with pytest.raises(MessageError):
        BatchMessage.from_wire(wire)


def test_batches_keep_a_documents_questions_together() -> None:
    placed = [(0, _job("a1", "A")), (1, _job("b1", "B")), (0, _job("c1", "C")),
              (0, _job("a2", "A")), (0, _job("c2", "C")), (0, _job("a3", "A"))]
    messages = form_batches(placed, batch_size=4)
    assert [(m.shard, [j.job_id for j in m.jobs]) for m in messages] == [
        (0, ["a1", "a2", "a3", "c1"]), (0, ["c2"]), (1, ["b1"])]
