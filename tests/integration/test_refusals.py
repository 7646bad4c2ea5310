"""Bad input is refused at submit time with InvalidJob and leaves no trace; messages that are
not ours are refused by the worker, which keeps serving real jobs."""

from __future__ import annotations

import base64
import json
import random
import uuid
from typing import Any

import pytest
import redis
import zstandard
from sqlalchemy import func, select

from jobsvc import Client, InvalidJob, JobStatus
from jobsvc.batchapi.ingest import Ingestor
from jobsvc.batchapi.line_requests import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT
from jobsvc.batchapi.lines import RequestLine
from jobsvc.child_processes import LocalWorkers
from jobsvc.compression import KOMBU_CODEC
from jobsvc.keys import AFFINITY_KEY, ALL_QUEUES_PATTERN, dead_letter_key, queue_name
from jobsvc.store import Store
from jobsvc.store.tables import Job
from jobsvc.transport import RUN_MESSAGE_TASK
from jobsvc.workloads import document, question

pytestmark = pytest.mark.integration

GOOD_DOCUMENT = "A short document about the lighthouse keeper and her seven cats."
GOOD_QUESTION = "How many cats are there?"

BAD_JOBS: list[tuple[str, dict[str, Any]]] = [
    ("document", {"document": ""}),
    ("document", {"document": "   \n\t"}),
    ("document", {"document": None}),
    ("document", {"document": b"bytes are not text"}),
    ("document", {"document": 42}),
    ("question", {"question": ""}),
    ("question", {"question": ["a", "list"]}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -5}),
    ("max_tokens", {"max_tokens": 2.5}),
    ("max_tokens", {"max_tokens": True}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": "hot"}),
    ("temperature", {"temperature": 2.5}),
    ("top_p", {"top_p": 1.5}),
    ("top_p", {"top_p": 0}),
    ("unknown sampling key", {"beam_width": 4}),
    ("stop", {"stop": "not-a-list"}),
    ("stop", {"stop": ["x" * 1001]}),
    ("stop", {"stop": ["y" * 17_000_000] * 16}),
    ("min_tokens", {"min_tokens": 50, "max_tokens": 10}),
    ("context", {"max_tokens": 5000}),
    ("context", {"document": "lighthouse " * 6000}),
]


def _trace(store: Store, url: str) -> tuple[int, dict[str, int], int]:
    with store.engine.connect() as connection:
        jobs = connection.execute(select(func.count()).select_from(Job)).scalar_one()
    broker = redis.Redis.from_url(url)
    queues = {key.decode(): broker.llen(key) for key in broker.keys(ALL_QUEUES_PATTERN)}
    return jobs, queues, broker.hlen(AFFINITY_KEY)


@pytest.mark.parametrize(("field", "change"), BAD_JOBS,
                         ids=[f"{field}-{index}" for index, (field, _) in enumerate(BAD_JOBS)])
def test_bad_input_raises_invalid_job_naming_the_field_and_leaves_no_trace(
        routing_settings, field: str, change: dict[str, Any]) -> None:
    store = Store(routing_settings.resolved_database_url)
    with Client(settings=routing_settings) as client:
        before = _trace(store, routing_settings.redis_url)
        job = {"document": GOOD_DOCUMENT, "question": GOOD_QUESTION, **change}
        with pytest.raises(InvalidJob) as raised:
            client.submit_many([{"document": GOOD_DOCUMENT, "question": GOOD_QUESTION}, job])
        assert field.split()[0] in str(raised.value)
        assert str(raised.value).startswith("job 1:")
        assert _trace(store, routing_settings.redis_url) == before
    store.dispose()


@pytest.mark.parametrize("endpoint", [CHAT_ENDPOINT, COMPLETIONS_ENDPOINT])
def test_min_tokens_over_max_tokens_is_refused_alike_by_submit_and_by_a_batch_line(
        routing_settings, endpoint: str) -> None:
    store = Store(routing_settings.resolved_database_url)
    body: dict[str, Any] = {"max_tokens": 8, "min_tokens": 9}
    if endpoint == CHAT_ENDPOINT:
        body["messages"] = [{"role": "system", "content": GOOD_DOCUMENT},
                            {"role": "user", "content": GOOD_QUESTION}]
    else:
        body["prompt"] = f"{GOOD_DOCUMENT}\n\n{GOOD_QUESTION}"
    with Client(settings=routing_settings) as client:
        before = _trace(store, routing_settings.redis_url)
        with pytest.raises(InvalidJob) as refused:
            client.submit_many([{"document": GOOD_DOCUMENT, "question": GOOD_QUESTION,
                                 "max_tokens": 8, "min_tokens": 9}])
        ingestor = Ingestor(client, limits=routing_settings.job_limits)
        (line,) = ingestor.ingest(f"batch_{uuid.uuid4().hex}", endpoint,
                                  [RequestLine(1, "min-over-max", body)])
        assert _trace(store, routing_settings.redis_url) == before
    store.dispose()
    message = "min_tokens must not exceed max_tokens"
    assert (str(refused.value), refused.value.field) == (f"job 0: {message}", "min_tokens")
    assert line.job_id is None
    assert line.error == {"status_code": 400, "error": {
        "message": message, "type": "invalid_request_error", "param": "min_tokens",
        "code": "invalid_value"}}


def test_submit_refuses_a_non_mapping_job(routing_settings) -> None:
    with Client(settings=routing_settings) as client, pytest.raises(InvalidJob, match="mapping"):
        client.submit_many(["just a string"])


def _push_raw(url: str, queue: str, envelope: dict[str, Any]) -> None:
    redis.Redis.from_url(url).lpush(queue, json.dumps(envelope))


def _envelope(body: str, content_type: str, task: str = RUN_MESSAGE_TASK,
              encoding: str = "utf-8") -> dict[str, Any]:
    """A kombu/Celery message envelope as the Redis transport stores it."""
    task_id = str(uuid.uuid4())
    return {
        "body": body, "content-encoding": encoding, "content-type": content_type,
        "headers": {"lang": "py", "task": task, "id": task_id, "root_id": task_id,
                    "parent_id": None, "group": None, "retries": 0, "argsrepr": "",
                    "kwargsrepr": "", "origin": "test", "ignore_result": True},
        "properties": {"correlation_id": task_id, "reply_to": "", "delivery_mode": 2,
                       "delivery_info": {"exchange": "", "routing_key": queue_name(0)},
                       "priority": 0, "body_encoding": "utf-8",
                       "delivery_tag": str(uuid.uuid4())},
    }


def _bomb() -> dict[str, Any]:
    """A tiny zstd frame that would inflate beyond the worker's message size limit."""
    frame = zstandard.ZstdCompressor(level=1).compress(b"[" + b" " * (64 << 20) + b"]")
    envelope = _envelope(base64.b64encode(frame).decode(), "application/json")
    envelope["headers"]["compression"] = KOMBU_CODEC
    envelope["properties"]["body_encoding"] = "base64"
    return envelope


def test_worker_refuses_foreign_messages_and_keeps_serving(client: Client,
                                                           worker: LocalWorkers) -> None:
    url = client.settings.redis_url
    queue = queue_name(0)
    wrong_schema = json.dumps([[{"v": 99, "jobs": "nope"}], {}, {}])
    hostile = [
        _envelope("{this is not json", "application/json"),
        _envelope("gANdcQAu", "application/x-python-serialize", encoding="binary"),
        _envelope(wrong_schema, "application/json"),
        # A batch of the previous wire version, which carried its documents' tokens.
        _envelope(json.dumps([[{"v": 1, "shard": 0, "documents": {"d": [1, 2]},
                                "jobs": [["x", "d", [3], {}, 1]]}], {}, {}]),
                  "application/json"),
        _envelope(json.dumps([[{"v": 2, "shard": 0, "jobs": [["x", None, [3], {}, 1]]}],
                              {}, {}]), "application/json"),
        _envelope(json.dumps([[], {}, {}]), "application/json"),
        _envelope(json.dumps([[1], {}, {}]), "application/json", task="not.our.task"),
        _envelope("plain words", "text/plain"),
        _envelope("a: yaml", "application/x-yaml"),
        _bomb(),
    ]
    # Items that are no message envelope at all: they go to the queue's dead-letter list.
    garbage = [b"not json at all", json.dumps([1, 2, 3]).encode(), b"\xff\xfe not UTF-8",
               json.dumps({"body": 1}).encode(),
               json.dumps({**_envelope("x", "application/json"), "properties": []}).encode()]
    broker = redis.Redis.from_url(url)
    dead_letters = dead_letter_key(queue)
    broker.delete(dead_letters)
    for envelope in hostile:
        _push_raw(url, queue, envelope)
    for item in garbage:
        broker.lpush(queue, item)
    rng = random.Random(3)
    job_id = client.submit(document(rng, 80), question(rng), max_tokens=4)
    (record,) = client.wait([job_id], timeout=180)
    assert record.status is JobStatus.SUCCEEDED
    assert all(process.poll() is None for process in worker.processes)
    assert broker.llen(queue) == 0
    # Kept as kombu read them: bytes that are not UTF-8 come back replaced.
    assert sorted(broker.lrange(dead_letters, 0, -1)) == sorted(
        item.decode(errors="replace").encode() for item in garbage)
    log = worker.log_path(0).read_text(errors="replace")
    assert "refused message" in log
    assert "moved a malformed item" in log
