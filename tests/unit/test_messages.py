"""Cutting routed jobs into queue messages: pure logic."""

from __future__ import annotations

import pytest

from jobsvc.messages import PlacedJob, form_messages

pytestmark = pytest.mark.unit


def test_messages_keep_a_documents_questions_together() -> None:
    placed = [PlacedJob("a1", 0, "A"), PlacedJob("b1", 1, "B"), PlacedJob("c1", 0, "C"),
              PlacedJob("a2", 0, "A"), PlacedJob("c2", 0, "C"), PlacedJob("a3", 0, "A")]
    messages = form_messages(placed, batch_size=4)
    assert [(m.shard, m.job_ids) for m in messages] == [
        (0, ["a1", "a2", "a3", "c1"]), (0, ["c2"]), (1, ["b1"])]
    assert len({m.message_id for m in messages}) == 3
