"""The wire format: the versioned queue message a producer publishes, and the job statuses."""

from __future__ import annotations

import pytest

from jobsvc.wire import ACTIVE_STATUSES, FINISHED_STATUSES, JobStatus, MessageError, QueueMessage

pytestmark = pytest.mark.unit


def test_message_round_trips_through_its_wire_form() -> None:
    message = QueueMessage(2, ["a", "b"], "m1")
    assert QueueMessage.from_wire(message.to_wire(), "m1") == message


def test_messages_carry_job_ids_and_nothing_that_decides_an_answer() -> None:
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


def test_every_status_is_finished_or_active_and_active_ones_come_in_order() -> None:
    assert ACTIVE_STATUSES == ("queued", "running")
    assert {status for status in JobStatus if status.finished} == FINISHED_STATUSES
    assert len(FINISHED_STATUSES) + len(ACTIVE_STATUSES) == len(JobStatus)
