"""What one batch or one line of it can do to the others: nothing. Poison lines end alone as
error lines with named codes, a batch that raises fails alone, a cancelled batch with such a
line ends `cancelled`, request counts move and add up while a large file is read, an input
file cannot be deleted from under its batch, and a line far longer than the model's context
is refused without the server holding it. Driven by the official `openai` client (strict
validation) over the session's real worker."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
from openai.types import Batch
from sqlalchemy import func, select

from jobsvc.child_processes import LocalWorkers
from jobsvc.client import Client
from jobsvc.errors import InvalidJob
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.store.batches import BatchStore
from jobsvc.store.files import FileStore
from jobsvc.store.tables import BatchRow, Job
from tests.support.batch_files import (
    CHAT,
    COMPLETIONS,
    assert_every_request_once,
    job_statuses,
    jsonl,
    line,
    long_requests,
    results,
    start_batch,
    upload,
    wait_for,
)
from tests.support.batch_server import API_KEY, openai_client, server_in_thread, server_process
from tests.support.waiting import until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server_settings(settings: Settings) -> Settings:
    return replace(settings, api_key=API_KEY, batch_lease_seconds=3)


@pytest.fixture()
def api(server_settings: Settings) -> Iterator[openai.OpenAI]:
    """A server for one test, whose driver finishes no other test's batches."""
    with server_in_thread(server_settings) as url:
        yield openai_client(url)


def short(custom_id: str, **extra: Any) -> dict[str, Any]:
    return line(custom_id, {"max_tokens": 2, "temperature": 0, "messages": [
        {"role": "user", "content": f"Say something about {custom_id}."}], **extra})


def deep_line(custom_id: str, depth: int) -> bytes:
    """A request whose messages nest `depth` lists deep (too deep for json.dumps to make)."""
    return (b'{"custom_id": ' + json.dumps(custom_id).encode()
            + b', "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
            + b"[" * depth + b"]" * depth + b"}}\n")


def error_codes(errors: list[dict[str, Any]]) -> dict[str, str]:
    """custom_id -> the code of its error line (a 400's body, or the batch's own)."""
    codes = {}
    for item in errors:
        if item["error"] is not None:
            codes[item["custom_id"]] = item["error"]["code"]
        else:
            codes[item["custom_id"]] = item["response"]["body"]["error"]["code"]
    return codes


def assert_counts_add_up(batch: Batch, output: list[dict[str, Any]],
                         errors: list[dict[str, Any]]) -> None:
    counts = batch.request_counts
    assert counts is not None
    assert (counts.completed, counts.failed) == (len(output), len(errors))
    assert counts.total == counts.completed + counts.failed


def test_poison_lines_end_alone_with_named_codes_and_a_later_batch_completes(
        api: openai.OpenAI, worker: LocalWorkers) -> None:
    good = [short("good-1"), short("good-2")]
    poison = jsonl([*good, short("nul\x00id"), short("lone\ud800"),
                    line("surrogate-message", {"max_tokens": 2, "messages": [
                        {"role": "user", "content": "half a pair \ud83d here"}]}),
                    short("surrogate-stop", stop=["\udfff"])]) + deep_line("deep", 100_000)
    poisoned = api.batches.create(input_file_id=upload(api, poison), endpoint=CHAT,
                                  completion_window="24h")
    later_lines = [short("later-1"), short("later-2")]
    later = start_batch(api, later_lines)
    later = wait_for(api, later.id)
    assert later.status == "completed", later
    assert_every_request_once(later_lines, *results(api, later))
    poisoned = wait_for(api, poisoned.id)
    assert poisoned.status == "completed", poisoned
    output, errors = results(api, poisoned)
    assert sorted(item["custom_id"] for item in output) == ["good-1", "good-2"]
    assert error_codes(errors) == {
        "nul\ufffdid": "invalid_text", "lone\ufffd": "invalid_text",
        "surrogate-message": "invalid_text", "surrogate-stop": "invalid_text",
        "deep": "nesting_too_deep"}
    params = {item["custom_id"]: item["response"]["body"]["error"]["param"] for item in errors}
    assert params["surrogate-stop"] == "stop[0]"
    assert params["surrogate-message"] == "messages[0].content"
    assert_counts_add_up(poisoned, output, errors)


def test_a_batch_that_raises_fails_alone_naming_why_and_a_later_batch_completes(
        api: openai.OpenAI, worker: LocalWorkers, server_settings: Settings) -> None:
    # A batch row naming an endpoint no request can be parsed for (a row written by another
    # version, say): its lines pass the file check, then making them jobs raises.
    store = Store(server_settings.resolved_database_url)
    try:
        foreign = BatchStore(store.engine).create(
            endpoint="/v1/foreign", input_file_id=upload(api, jsonl(
                [{**short("f-1"), "url": "/v1/foreign"}])),
            completion_window="24h", metadata=None, window_seconds=3600)
    finally:
        store.dispose()
    later_lines = [short("after-1")]
    later = wait_for(api, start_batch(api, later_lines).id)
    assert later.status == "completed", later
    failed = wait_for(api, foreign.id)
    assert failed.status == "failed" and failed.failed_at, failed
    assert failed.errors is not None and failed.errors.data
    (error,) = failed.errors.data
    assert error.code == "batch_failed" and "KeyError" in (error.message or "")
    counts = failed.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (1, 0, 1)


def test_a_cancelled_batch_with_a_nul_custom_id_ends_cancelled_with_every_line_once(
        api: openai.OpenAI, worker: LocalWorkers) -> None:
    lines = [short("nul\x00cancel"), *long_requests(24)]
    batch = start_batch(api, lines)
    wait_for(api, batch.id, lambda b: b.status == "in_progress")
    api.batches.cancel(batch.id)
    batch = wait_for(api, batch.id)
    assert batch.status == "cancelled", batch
    output, errors = results(api, batch)
    assert len(output) + len(errors) == len(lines)
    codes = error_codes(errors)
    # Refused when read, or ended by the cancel if the cancel came first: stored either way.
    assert codes.pop("nul\ufffdcancel") in ("invalid_text", "batch_cancelled")
    assert set(codes.values()) <= {"batch_cancelled"}
    assert_counts_add_up(batch, output, errors)


def ingested_line(store: Store, batch_id: str) -> int:
    with store.engine.connect() as connection:
        return int(connection.execute(select(BatchRow.ingested_line)
                                      .where(BatchRow.id == batch_id)).scalar_one())


def test_counts_move_and_add_up_while_a_large_file_is_read_and_its_file_cannot_be_deleted(
        api: openai.OpenAI, worker: LocalWorkers, worker_store: Store) -> None:
    total = 20_000
    lines = [line(f"p{index}", {"prompt": f"Item {index}: a short note", "max_tokens": 1,
                                "temperature": 0}, COMPLETIONS) for index in range(total)]
    batch = start_batch(api, lines, COMPLETIONS)
    wait_for(api, batch.id, lambda b: b.status == "in_progress", timeout=120)
    with pytest.raises(openai.ConflictError) as refused:
        api.files.delete(batch.input_file_id)
    assert refused.value.body["param"] == "file_id" and batch.id in refused.value.message
    assert refused.value.body["code"] == "file_in_use"
    # Read each reading's progress after it: a reading taken before the last line was read
    # shows counts that moved with the first slices' jobs.
    seen_during_ingest: list[tuple[int, int]] = []

    def moved_during_ingest() -> bool:
        current = api.batches.retrieve(batch.id)
        counts = current.request_counts
        assert counts is not None and counts.total == total
        assert counts.completed + counts.failed <= counts.total
        if ingested_line(worker_store, batch.id) < total and counts.completed > 0:
            seen_during_ingest.append((counts.completed, counts.failed))
        return bool(seen_during_ingest) or current.status != "in_progress"

    until("a reading while the file is read", moved_during_ingest, 120, every=0.1)
    assert seen_during_ingest, "every line was read before any count moved"
    api.batches.cancel(batch.id)
    batch = wait_for(api, batch.id)
    assert batch.status == "cancelled", batch
    output, errors = results(api, batch)
    assert_every_request_once(lines, output, errors)
    assert_counts_add_up(batch, output, errors)
    assert api.files.delete(batch.input_file_id).deleted


def test_an_input_file_deleted_from_under_its_batch_fails_the_batch_with_counts_adding_up(
        api: openai.OpenAI, worker: LocalWorkers, worker_store: Store) -> None:
    total = 10_000
    lines = [line(f"g{index}", {"prompt": f"Entry {index}: a short note", "max_tokens": 1},
                  COMPLETIONS) for index in range(total)]
    batch = start_batch(api, lines, COMPLETIONS)
    wait_for(api, batch.id, lambda b: b.status == "in_progress", timeout=120)
    # Past the API's refusal, as a server of another version or an operator's SQL could.
    assert FileStore(worker_store.engine).delete(batch.input_file_id)
    batch = wait_for(api, batch.id)
    assert batch.status == "failed", batch
    assert batch.errors is not None and batch.errors.data
    (error,) = batch.errors.data
    assert error.code == "batch_failed" and batch.input_file_id in (error.message or "")
    counts = batch.request_counts
    assert counts is not None and counts.total == total
    assert counts.completed + counts.failed == total
    assert not {"queued", "running"} & set(job_statuses(worker_store, batch.id))


def test_a_line_far_longer_than_the_context_fails_alone_and_the_server_never_holds_it(
        server_settings: Settings, worker: LocalWorkers, tmp_path: Path) -> None:
    server = server_process(replace(server_settings, max_upload_bytes=64 << 20),
                            tmp_path / "serve.log")
    server.start()
    try:
        api = openai_client(server.url)
        # The first batch loads what every batch uses (tokenizer, template) before measuring.
        assert wait_for(api, start_batch(api, [short("warm")]).id).status == "completed"
        process = psutil.Process(server.pid)
        baseline = process.memory_info().rss
        peak = [baseline]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.02):
                peak[0] = max(peak[0], process.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        huge = line("huge", {"max_tokens": 2, "messages": [
            {"role": "user", "content": "word " * (4 << 20)}]})
        lines = [short("before"), huge, short("after")]
        try:
            batch = wait_for(api, start_batch(api, lines).id)
        finally:
            done.set()
            sampler.join()
        output, errors = results(api, batch)
    finally:
        server.stop()
    assert batch.status == "completed", batch
    assert sorted(item["custom_id"] for item in output) == ["after", "before"]
    assert error_codes(errors) == {"huge": "line_too_long"}
    # Parsed and tokenized whole, a line costs the server many times its size, and even its
    # bytes and their text held whole would pass this bound; held by its ends, it costs a
    # few of the file's chunks.
    assert peak[0] - baseline < 48 << 20, (baseline, peak[0])


@pytest.mark.parametrize("job", [
    {"document": "doc", "question": "q", "stop": ["\ud800"]},
    {"document": "doc", "question": "q", "idempotency_key": "key\x00"},
    {"document": "doc", "question": "q", "idempotency_key": "key\udc00"},
])
def test_submit_refuses_text_the_engine_or_database_cannot_take_and_keeps_nothing(
        client: Client, worker_store: Store, job: dict[str, Any]) -> None:
    before = job_count(worker_store)
    with pytest.raises(InvalidJob, match=r"job 0: (stop|idempotency_key)"):
        client.submit_many([job])
    assert job_count(worker_store) == before


def job_count(store: Store) -> int:
    with store.engine.connect() as connection:
        return int(connection.execute(select(func.count()).select_from(Job)).scalar_one())
