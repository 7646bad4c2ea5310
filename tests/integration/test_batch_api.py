"""The OpenAI Files and Batch APIs of `jobsvc serve`, driven by the official `openai` client
(strict response validation) over the session's real worker."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobsvc.batchapi.ingest import Ingestor
from jobsvc.batchapi.lines import RequestLine
from jobsvc.child_processes import LocalWorkers
from jobsvc.client import Client
from jobsvc.keys import queue_name
from jobsvc.runbatch import run_batch
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.workloads import document, question
from tests.support.batch_files import (
    CHAT,
    COMPLETIONS,
    TIMEOUT,
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

@pytest.fixture(scope="session")
def server_settings(settings: Settings) -> Settings:
    return replace(settings, api_key=API_KEY, batch_lease_seconds=3)


@pytest.fixture()
def api_url(server_settings: Settings) -> Iterator[str]:
    """A server for one test: no other server's driver is left to finish another test's
    batches."""
    with server_in_thread(server_settings) as url:
        yield url


@pytest.fixture()
def api(api_url: str) -> openai.OpenAI:
    return openai_client(api_url)


def test_a_file_comes_back_byte_for_byte_lists_and_deletes(settings: Settings) -> None:
    data = random.Random(3).randbytes((5 << 20) // 2) + b"\r\n\x00 \xff"
    with server_in_thread(replace(settings, api_key=API_KEY)) as url:
        api = openai_client(url)
        uploaded = api.files.create(file=("../../etc/passwd", io.BytesIO(data)),
                                    purpose="batch")
        assert uploaded.bytes == len(data) and uploaded.filename == "../../etc/passwd"
        assert api.files.content(uploaded.id).read() == data
        assert api.files.retrieve(uploaded.id) == uploaded
        second = api.files.create(file=("b.jsonl", io.BytesIO(b"{}")), purpose="batch")
        listed = [item.id for item in api.files.list(limit=1)]
        assert listed.index(second.id) < listed.index(uploaded.id)
        assert len(listed) == len(set(listed))
        assert api.files.delete(uploaded.id).deleted
        with pytest.raises(openai.NotFoundError):
            api.files.content(uploaded.id)


def test_an_upload_over_the_limit_or_without_purpose_batch_is_refused(
        settings: Settings) -> None:
    with server_in_thread(replace(settings, api_key=API_KEY, max_upload_bytes=1000)) as url:
        api = openai_client(url)
        with pytest.raises(openai.APIStatusError) as too_large:
            api.files.create(file=("big.jsonl", io.BytesIO(b"x" * 5000)), purpose="batch")
        assert too_large.value.status_code == 413
        with pytest.raises(openai.BadRequestError) as wrong_purpose:
            api.files.create(file=("a.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
        assert wrong_purpose.value.body["param"] == "purpose"


def test_a_wrong_key_gets_401_and_an_unknown_id_404(api: openai.OpenAI, api_url: str) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        openai_client(api_url, api_key="wrong").models.list()
    assert refused.value.body["code"] == "invalid_api_key"
    unsigned = httpx.get(f"{api_url}/batches")
    assert unsigned.status_code == 401 and unsigned.json()["error"]["type"]
    assert [model.id for model in api.models.list()] == ["jobsvc"]
    with pytest.raises(openai.NotFoundError):
        api.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve("file-nope")
    with pytest.raises(openai.NotFoundError):
        api.batches.cancel("batch_nope")
    with pytest.raises(openai.BadRequestError) as refused:
        api.batches.create(input_file_id=upload(api, b"{}\n"), endpoint="/v1/moderations",
                           completion_window="24h")
    assert refused.value.body["param"] == "endpoint"


def document_lines(rng: random.Random, documents: int, questions: int,
                   body: Callable[[str, str], dict[str, Any]], url: str = CHAT
                   ) -> list[dict[str, Any]]:
    texts = [document(rng, 250) for _ in range(documents)]
    return [line(f"doc{d}-q{q}", body(text, question(rng)), url)
            for q in range(questions) for d, text in enumerate(texts)]


def assert_later_questions_cached(output: list[dict[str, Any]], documents: int) -> None:
    for d in range(documents):
        cached = sorted(item["response"]["body"]["usage"]["prompt_tokens_details"]
                        ["cached_tokens"] for item in output
                        if item["custom_id"].startswith(f"doc{d}-"))
        # The first question computes the document; every later one finds it cached.
        assert all(tokens > 0 for tokens in cached[1:]), cached


def test_a_chat_batch_answers_every_request_once_and_fails_a_bad_line_alone(
        api: openai.OpenAI, worker: LocalWorkers) -> None:
    rng = random.Random(46)
    in_system = document_lines(rng, 2, 3, lambda text, q: {
        "model": "jobsvc", "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": q}]})
    in_user = document_lines(rng, 1, 3, lambda text, q: {
        "max_completion_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": f"{text}\n\nQuestion: {q}"}]})
    for item in in_user:
        item["custom_id"] = item["custom_id"].replace("doc0", "doc2")
    bad = line("bad", {"messages": [{"role": "user", "content": "hi"}], "temperature": 3})
    batch = start_batch(api, [*in_system, bad, *in_user])
    seen_running = wait_for(api, batch.id, lambda b: b.status != "validating")
    assert seen_running.request_counts.total == 10
    batch = wait_for(api, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (9, 1)
    assert batch.completed_at and batch.finalizing_at and batch.in_progress_at
    output, errors = results(api, batch)
    assert sorted(item["custom_id"] for item in output) == sorted(
        item["custom_id"] for item in [*in_system, *in_user])
    for item in output:
        body = item["response"]["body"]
        assert item["response"]["status_code"] == 200 and item["error"] is None
        assert body["object"] == "chat.completion" and body["model"] == "jobsvc"
        assert body["choices"][0]["message"]["role"] == "assistant"
        # Greedy answers that reach max_tokens end for length; shorter ones ended on a stop.
        assert body["usage"]["completion_tokens"] <= 6
        assert body["choices"][0]["finish_reason"] == (
            "length" if body["usage"]["completion_tokens"] == 6 else "stop")
    assert_later_questions_cached(output, 3)
    assert batch.usage.input_tokens_details.cached_tokens > 0
    (refused,) = errors
    assert refused["custom_id"] == "bad" and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "temperature"


def test_a_completions_batch_answers_every_request_once_with_cached_documents(
        api: openai.OpenAI, worker: LocalWorkers) -> None:
    rng = random.Random(47)
    lines = document_lines(rng, 2, 3, lambda text, q: {
        "model": "jobsvc", "prompt": f"{text}\n\nQuestion: {q}\nAnswer:", "max_tokens": 5,
        "temperature": 0, "stop": ["\n\n"]}, COMPLETIONS)
    batch = wait_for(api, start_batch(api, lines, COMPLETIONS).id)
    assert batch.status == "completed" and batch.request_counts.completed == 6
    output, errors = results(api, batch)
    assert errors == [] and batch.error_file_id is None
    assert sorted(item["custom_id"] for item in output) == sorted(
        item["custom_id"] for item in lines)
    assert all(item["response"]["body"]["object"] == "text_completion" for item in output)
    assert_later_questions_cached(output, 2)


def test_a_structurally_bad_file_fails_naming_its_lines(api: openai.OpenAI) -> None:
    good = line("a", {"messages": [{"role": "user", "content": "hi"}]})
    data = jsonl([good]) + b"{not json\n" + jsonl(
        [good, line("b", {"prompt": "x"}, url=COMPLETIONS)])
    batch = api.batches.create(input_file_id=upload(api, data), endpoint=CHAT,
                               completion_window="24h")
    batch = wait_for(api, batch.id)
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None and batch.errors.data is not None
    assert [(error.line, error.param) for error in batch.errors.data] == [
        (2, None), (3, "custom_id"), (4, "url")]
    assert batch.output_file_id is None and batch.error_file_id is None


def test_cancelling_a_batch_whose_requests_wait_cancels_them_and_keeps_what_finished(
        api: openai.OpenAI, worker: LocalWorkers, worker_store: Store) -> None:
    lines = long_requests(40)
    batch = start_batch(api, lines)
    # Cancel once every request is a job: most still wait in the queue behind the first.
    until("every request a job",
          lambda: sum(job_statuses(worker_store, batch.id).values()) >= len(lines), TIMEOUT,
          every=0.05)
    assert api.batches.cancel(batch.id).status == "cancelling"
    batch = wait_for(api, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at and batch.cancelling_at
    output, errors = results(api, batch)
    assert_every_request_once(lines, output, errors)
    assert errors and all(item["error"]["code"] == "batch_cancelled" for item in errors)
    assert batch.request_counts.completed == len(output)
    assert batch.request_counts.failed == len(errors)
    statuses = job_statuses(worker_store, batch.id)
    assert statuses.get("cancelled", 0) == len(errors), statuses
    assert not {"queued", "running"} & set(statuses), statuses


def test_a_batch_past_its_window_expires_with_its_unrun_requests_in_the_error_file(
        server_settings: Settings, worker: LocalWorkers) -> None:
    with server_in_thread(replace(server_settings, batch_window_seconds=2)) as url:
        api = openai_client(url)
        lines = long_requests(30)
        batch = wait_for(api, start_batch(api, lines).id)
        assert batch.status == "expired" and batch.expired_at
        output, errors = results(api, batch)
    assert_every_request_once(lines, output, errors)
    assert errors and all(item["error"]["code"] == "batch_expired" for item in errors)


def test_listing_batches_page_by_page_sees_each_once_newest_first(api: openai.OpenAI) -> None:
    file_id = upload(api, jsonl([line("a", {"messages": [{"role": "user", "content": "x"}],
                                            "model": "other"})]))
    created = [api.batches.create(input_file_id=file_id, endpoint=CHAT,
                                  completion_window="24h").id for _ in range(5)]
    listed = [batch.id for batch in api.batches.list(limit=2)]
    assert len(listed) == len(set(listed))
    assert [batch_id for batch_id in listed if batch_id in created] == created[::-1]


def test_a_line_submitted_again_gets_the_job_it_made_the_first_time(
        routing_settings: Settings, store: Store) -> None:
    with Client(settings=routing_settings) as client:
        ingestor = Ingestor(client, limits=routing_settings.job_limits)
        lines = [RequestLine(number, f"c{number}", {"messages": [
            {"role": "user", "content": f"Question {number}"}], "max_tokens": 3})
            for number in range(1, 6)]
        first = ingestor.ingest("batch_again", CHAT, lines)
        again = ingestor.ingest("batch_again", CHAT, lines[2:])
    assert [outcome.job_id for outcome in again] == [outcome.job_id for outcome in first[2:]]
    assert sum(job_statuses(store, "batch_again").values()) == 5


def test_a_server_killed_mid_batch_is_succeeded_by_another_that_finishes_it_without_duplicates(
        server_settings: Settings, worker: LocalWorkers, worker_store: Store,
        tmp_path: Path) -> None:
    rng = random.Random(9)
    lines = document_lines(rng, 4, 5, lambda text, q: {
        "max_tokens": 24, "ignore_eos": True,
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": q}]})
    first = server_process(server_settings, tmp_path / "first.log")
    first.start()
    try:
        api = openai_client(first.url)
        batch = start_batch(api, lines)
        wait_for(api, batch.id, lambda b: b.status == "in_progress")
    finally:
        first.kill()
    second = server_process(server_settings, tmp_path / "second.log")
    second.start()
    try:
        api = openai_client(second.url)
        batch = wait_for(api, batch.id)
        output, errors = results(api, batch)
    finally:
        second.stop()
    assert batch.status == "completed" and errors == []
    assert_every_request_once(lines, output, errors)
    assert sum(job_statuses(worker_store, batch.id).values()) == len(lines)


def test_run_batch_writes_every_request_in_order_as_vllm_run_batch_does(
        settings: Settings, worker: LocalWorkers, tmp_path: Path) -> None:
    rng = random.Random(12)
    lines = document_lines(rng, 1, 3, lambda text, q: {
        "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": q}]})
    lines.insert(1, line("bad", {"messages": [{"role": "user", "content": "x"}], "n": 0}))
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(jsonl(lines))
    progress = io.StringIO()
    batch = run_batch(settings, source, target, progress_stream=progress)
    assert batch.status == "completed" and (batch.completed, batch.failed) == (3, 1)
    written = [json.loads(raw) for raw in target.read_text().splitlines()]
    assert [item["custom_id"] for item in written] == [item["custom_id"] for item in lines]
    assert all(item["id"].startswith("vllm-") for item in written)
    assert written[1]["response"]["status_code"] == 400 and written[1]["response"]["body"] is None
    assert written[1]["error"]["error"]["param"] == "n"
    assert written[0]["response"]["body"]["object"] == "chat.completion"
    assert f"{batch.id}: 4 of 4 requests" in progress.getvalue()


def test_the_server_serves_the_fleets_metrics_behind_its_key(api_url: str) -> None:
    root = api_url.removesuffix("/v1")
    assert httpx.get(f"{root}/metrics").status_code == 401
    scraped = httpx.get(f"{root}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert scraped.status_code == 200
    families = {family.name: family for family
                in text_string_to_metric_families(scraped.text)}
    queued = {sample.labels["queue"] for sample in families["jobsvc_queue_messages"].samples}
    assert queue_name(0) in queued
    assert {"jobsvc_jobs", "jobsvc_shard_outstanding_load", "jobsvc_batches",
            "jobsvc_model_jobs", "jobsvc_model_workers"} <= set(families)


def test_a_batch_file_with_seeded_lines_among_plain_ones_answers_every_line(
        api: openai.OpenAI, worker: LocalWorkers) -> None:
    """Long prompts whose prefill the engine would split across steps: on CPU builds a seeded
    one used to kill the engine, and with it every line of the file."""
    rng = random.Random(53)
    lines = document_lines(rng, 4, 3, lambda text, q: {
        "model": "jobsvc", "max_tokens": 4, "temperature": 1.0,
        "messages": [{"role": "system", "content": text}, {"role": "user", "content": q}]})
    for number, item in enumerate(lines):
        item["body"]["messages"][0]["content"] *= 3
        if number % 2:
            item["body"]["seed"] = number
    # The same seeded request twice: the same answer.
    again = json.loads(json.dumps(lines[1]))
    again["custom_id"] = "again"
    batch = wait_for(api, start_batch(api, [*lines, again]).id)
    assert batch.status == "completed", batch
    output, errors = results(api, batch)
    assert not errors, errors[:2]
    assert (batch.request_counts.completed, batch.request_counts.failed) == (13, 0)
    answers = {item["custom_id"]: item["response"]["body"]["choices"][0]["message"]["content"]
               for item in output}
    assert answers["again"] == answers[lines[1]["custom_id"]]
    assert min(item["response"]["body"]["usage"]["prompt_tokens"] for item in output) > 2048
