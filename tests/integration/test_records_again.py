"""Rows recorded a second time, as a slice submitted again after a restart records them: a
job whose idempotency key is held maps to the job holding it, and a batch line keeps its first
row, whichever way the store inserts them."""

from __future__ import annotations

import uuid

import pytest

from jobsvc.store import NewDocument, Store
from jobsvc.store.batches import BatchStore, LineOutcome
from jobsvc.store.files import FileStore
from tests.support.jobs import new_job

pytestmark = pytest.mark.integration


def test_a_keyed_job_recorded_again_maps_to_the_job_that_holds_its_key(
        store: Store, embedded: Store) -> None:
    for repository in (store, embedded):
        document = NewDocument(uuid.uuid4().hex, "d", (1,))
        keys = [f"again:{uuid.uuid4().hex}" for _ in range(3)]
        first = [new_job(uuid.uuid4().hex, document.key, idempotency_key=key)
                 for key in keys[:2]]
        assert repository.record_submitted([document], first) == {}
        again = [new_job(uuid.uuid4().hex, document.key, idempotency_key=key) for key in keys]
        assert repository.record_submitted([document], again) == {
            again[0].job_id: first[0].job_id, again[1].job_id: first[1].job_id}
        assert repository.jobs_by_key([*keys, "again:none"]) == {
            keys[0]: first[0].job_id, keys[1]: first[1].job_id, keys[2]: again[2].job_id}


def test_a_batch_line_recorded_again_keeps_its_first_row(store: Store) -> None:
    batches, files = BatchStore(store.engine), FileStore(store.engine)
    with files.writer("lines.jsonl", "batch") as writer:
        writer.write(b"{}\n")
    batch = batches.create(endpoint="/v1/chat/completions", input_file_id=writer.file_id,
                           completion_window="24h", metadata=None, window_seconds=60)
    assert [claimed.id for claimed in batches.claim("driver", 60, only=batch.id)] == [batch.id]
    refused = {"status_code": 400, "error": {"code": "invalid_value"}}
    plan = {"parser": None}
    first = [LineOutcome(1, "a", uuid.uuid4().hex, None, plan),
             LineOutcome(2, "b", None, refused)]
    batches.record_lines(batch.id, "driver", 60, first, 2)
    batches.record_lines(batch.id, "driver", 60, [
        LineOutcome(2, "b", uuid.uuid4().hex, None), LineOutcome(3, "c", None, refused)], 3)
    rows = [row for page in batches.output_pages(batch.id) for row in page]
    assert [(row.line, row.custom_id, row.job_id, row.error, row.tool_plan) for row in rows] == [
        (1, "a", first[0].job_id, None, plan), (2, "b", None, refused, None),
        (3, "c", None, refused, None)]
    assert (batches.tally(batch.id).lines, batches.tally(batch.id).failed) == (3, 2)
