"""Batch files and batches as tests make and read them through the official `openai` client:
request lines, uploads, waiting for a batch to end, its output and error lines."""

from __future__ import annotations

import io
import json
import random
import time
from collections.abc import Callable
from typing import Any

import openai
from openai.types import Batch
from sqlalchemy import func, select

from jobsvc.store import Store
from jobsvc.store.tables import Job
from jobsvc.workloads import document, question

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FINAL = ("completed", "failed", "expired", "cancelled")
TIMEOUT = 240


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def line(custom_id: str, body: dict[str, Any], url: str = CHAT) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def upload(api: openai.OpenAI, data: bytes) -> str:
    return api.files.create(file=("requests.jsonl", io.BytesIO(data)), purpose="batch").id


def start_batch(api: openai.OpenAI, lines: list[dict[str, Any]], endpoint: str = CHAT
                ) -> Batch:
    return api.batches.create(input_file_id=upload(api, jsonl(lines)), endpoint=endpoint,
                              completion_window="24h", metadata={"test": "yes"})


def wait_for(api: openai.OpenAI, batch_id: str, done: Callable[[Batch], bool] = (
        lambda batch: batch.status in FINAL), timeout: float = TIMEOUT) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = api.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.1)


def file_lines(api: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(raw) for raw in api.files.content(file_id).read().splitlines()]


def results(api: openai.OpenAI, batch: Batch) -> tuple[list[dict[str, Any]],
                                                       list[dict[str, Any]]]:
    return file_lines(api, batch.output_file_id), file_lines(api, batch.error_file_id)


def long_requests(count: int) -> list[dict[str, Any]]:
    rng = random.Random(count)
    text = document(rng, 200)
    return [line(f"r{index}", {"max_tokens": 400, "ignore_eos": True, "messages": [
        {"role": "system", "content": text}, {"role": "user", "content": question(rng)}]})
        for index in range(count)]


def assert_every_request_once(lines: list[dict[str, Any]], output: list[dict[str, Any]],
                              errors: list[dict[str, Any]]) -> None:
    assert sorted(item["custom_id"] for item in [*output, *errors]) == sorted(
        item["custom_id"] for item in lines)


def job_statuses(store: Store, batch_id: str) -> dict[str, int]:
    """How many of the batch's jobs are in each status."""
    with store.engine.connect() as connection:
        return dict(connection.execute(
            select(Job.status, func.count()).where(Job.idempotency_key.startswith(batch_id))
            .group_by(Job.status)).all())
