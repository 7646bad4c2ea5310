"""The whole job path on real parts: producer → Redis → Celery worker with vLLM → PostgreSQL."""

from __future__ import annotations

import base64
import json
import random
from dataclasses import replace

import pytest
import redis
from sqlalchemy import select, update

from jobsvc import Client, JobNotFound, JobStatus
from jobsvc.child_processes import LocalWorkers
from jobsvc.compression import decompress, decompress_text, is_zstd_frame
from jobsvc.keys import LOAD_KEY, queue_name
from jobsvc.routing.job_cost import decode_load
from jobsvc.routing.ledger import loads_of
from jobsvc.settings import Settings
from jobsvc.store import Store, utcnow
from jobsvc.store.tables import Document, Job, Result
from jobsvc.workloads import document, document_questions, question
from tests.support.waiting import until

pytestmark = pytest.mark.integration

TIMEOUT = 180


def test_submitted_jobs_succeed_with_answers_and_token_counts(client: Client) -> None:
    jobs = document_questions(documents=3, questions_per_document=2, words_per_document=300,
                              seed=11)
    ids = client.submit_many({"document": job.document, "question": job.question,
                              "max_tokens": 12, "ignore_eos": True} for job in jobs)
    records = client.wait(ids, timeout=TIMEOUT)
    assert [record.job_id for record in records] == ids
    for record in records:
        assert record.status is JobStatus.SUCCEEDED, record.error
        assert record.answer
        assert record.prompt_tokens > 300
        assert record.completion_tokens == 12
        # Cached tokens come in whole KV blocks, and never the whole prompt.
        assert record.cached_tokens is not None
        assert record.cached_tokens % client.settings.block_size == 0
        assert 0 <= record.cached_tokens < record.prompt_tokens
        assert record.submitted_at <= record.started_at <= record.finished_at


def test_shard_loads_return_to_where_they_were_once_the_jobs_end(client: Client,
                                                                settings: Settings) -> None:
    """Each job's load, its answer's decode load included, is charged at submit and paid back
    by the worker when the job ends, so the loads count only outstanding work."""
    broker = redis.Redis.from_url(settings.redis_url)

    def total_load() -> int:
        return sum(loads_of(broker.hgetall(LOAD_KEY), range(settings.shards)))

    before = total_load()
    jobs = document_questions(documents=2, questions_per_document=3, words_per_document=300,
                              seed=12)
    ids = client.submit_many({"document": job.document, "question": job.question,
                              "max_tokens": 12, "ignore_eos": True} for job in jobs)
    assert total_load() - before > len(ids) * decode_load(12, settings.routing_decode_cost) > 0
    client.wait(ids, timeout=TIMEOUT)
    # The worker returns the loads just after it commits the results the wait saw.
    until("the loads paid back", lambda: total_load() == before, 10, every=0.05)


def test_single_submit_returns_an_id_that_get_resolves(client: Client) -> None:
    rng = random.Random(5)
    job_id = client.submit(document(rng, 120), question(rng), max_tokens=4)
    (record,) = client.wait([job_id], timeout=TIMEOUT)
    assert record.status is JobStatus.SUCCEEDED
    assert client.get(job_id) == record


def test_questions_on_one_document_share_a_shard_and_hit_the_prefix_cache(
        client: Client) -> None:
    rng = random.Random(21)
    text = document(rng, 700)
    ids = client.submit_many({"document": text, "question": question(rng), "max_tokens": 4}
                             for _ in range(5))
    records = client.wait(ids, timeout=TIMEOUT)
    assert len({record.shard for record in records}) == 1
    assert all(record.status is JobStatus.SUCCEEDED for record in records)
    cached = sorted(record.cached_tokens or 0 for record in records)
    # The first question computes the document; every later one is served from the cache.
    assert all(tokens > 0 for tokens in cached[1:]), cached


def test_stored_answers_are_zstd_frames_of_the_answer(client: Client) -> None:
    rng = random.Random(8)
    job_id = client.submit(document(rng, 100), question(rng), max_tokens=6)
    (record,) = client.wait([job_id], timeout=TIMEOUT)
    store = Store(client.settings.resolved_database_url)
    with store.engine.connect() as connection:
        raw = connection.execute(
            select(Result.answer_zst).where(Result.job_id == job_id)).scalar_one()
    store.dispose()
    assert is_zstd_frame(raw)
    assert record.answer and decompress_text(raw) == record.answer


def test_unknown_job_id_raises_job_not_found(client: Client) -> None:
    with pytest.raises(JobNotFound):
        client.get("0" * 32)
    with pytest.raises(JobNotFound):
        client.cancel("0" * 32)
    with pytest.raises(JobNotFound):
        client.wait(["0" * 32], timeout=1)


def test_cancelled_job_ends_cancelled_and_stays_so(client: Client) -> None:
    rng = random.Random(13)
    job_id = client.submit(document(rng, 200), question(rng), max_tokens=200,
                           ignore_eos=True)
    assert client.cancel(job_id) is True
    (record,) = client.wait([job_id], timeout=TIMEOUT)
    assert record.status is JobStatus.CANCELLED
    assert record.answer is None
    assert client.cancel(job_id) is False


@pytest.mark.parametrize("noticed_by", ["cancel notice", "store check"])
def test_cancelling_a_running_job_aborts_it_in_the_engine(
        client: Client, worker: LocalWorkers, worker_store: Store, noticed_by: str) -> None:
    """The worker hears of a cancel from the notice on the cancel channel or, were the notice
    lost, from its periodic check of the store; its log says which."""
    rng = random.Random(17 if noticed_by == "cancel notice" else 18)
    job_id = client.submit(document(rng, 100), question(rng), max_tokens=3000,
                           ignore_eos=True)
    until("the job started", lambda: client.get(job_id).status is not JobStatus.QUEUED, 60,
          every=0.05)
    if noticed_by == "cancel notice":
        assert client.get(job_id).status is JobStatus.RUNNING
        assert client.cancel(job_id) is True
        (record,) = client.wait([job_id], timeout=TIMEOUT)
        assert record.status is JobStatus.CANCELLED
    else:
        # Cancelled in the store alone, as if the notice on the cancel channel never arrived.
        with worker_store.engine.begin() as connection:
            connection.execute(update(Job).where(Job.id == job_id).values(
                status=JobStatus.CANCELLED.value, finished_at=utcnow()))
    aborted = f"aborts cancelled job {job_id} ({noticed_by})"
    until(f"the worker logs {aborted!r}",
          lambda: aborted in worker.log_path(0).read_text(errors="replace"))


def test_queue_messages_name_documents_without_carrying_them(routing_settings: Settings) -> None:
    work = document_questions(documents=8, questions_per_document=4, words_per_document=500,
                              seed=31)
    jobs = [{"document": job.document, "question": job.question, "max_tokens": 16}
            for job in work]
    with Client(settings=replace(routing_settings, shards=1)) as producer:
        producer.submit_many(jobs)
    broker = redis.Redis.from_url(routing_settings.redis_url)
    entries = broker.lrange(queue_name(0), 0, -1)
    # Celery's body is [args, kwargs, options]; our batch is the only argument.
    batches = [json.loads(decompress(base64.b64decode(json.loads(entry)["body"])))[0][0]
               for entry in entries]
    assert sum(len(batch["jobs"]) for batch in batches) == len(jobs)
    assert all(set(batch) == {"v", "shard", "jobs"} for batch in batches)
    raw = sum(len(json.dumps(job)) for job in jobs)
    assert 16 * sum(map(len, entries)) < raw


@pytest.mark.parametrize("tokens_zst", [None, b"not a token frame"],
                         ids=["recorded-without-tokens", "unreadable-tokens"])
def test_a_document_without_readable_tokens_runs_on_its_text(
        client: Client, worker: LocalWorkers, tokens_zst: bytes | None) -> None:
    rng = random.Random(41 if tokens_zst is None else 43)
    text = document(rng, 400)
    first = client.submit(text, question(rng), max_tokens=4)
    client.wait([first], timeout=TIMEOUT)
    store = Store(client.settings.resolved_database_url)
    with store.engine.begin() as connection:
        key = connection.execute(select(Job.document_key).where(Job.id == first)).scalar_one()
        connection.execute(update(Document).where(Document.key == key)
                           .values(tokens_zst=tokens_zst))
    store.dispose()
    job_id = client.submit(text, question(rng), max_tokens=4)
    (record,) = client.wait([job_id], timeout=TIMEOUT)
    assert record.status is JobStatus.SUCCEEDED, record.error
    # The engine found the first job's document in its cache: the tokens the worker made of
    # the text start with the very blocks the producer recorded.
    assert (record.cached_tokens or 0) >= client.settings.block_size
    if tokens_zst is not None:
        assert f"document {key}: not a" in worker.log_path(0).read_text(errors="replace")


@pytest.mark.stops_worker
def test_a_warm_shutdown_stops_the_worker_and_its_engine_cleanly(worker: LocalWorkers) -> None:
    log = worker.log_path(0)
    written_before = log.stat().st_size
    processes = list(worker.processes)
    worker.stop()
    assert [process.returncode for process in processes] == [0] * len(processes)
    shutdown_output = log.read_bytes()[written_before:].decode(errors="replace")
    # The engine is torn down by the worker, not left to the interpreter's exit, where
    # vLLM's finaliser fails on modules already unloaded.
    assert "engine stopped" in shutdown_output
    assert "Traceback" not in shutdown_output, shutdown_output[-3000:]


def test_an_answer_records_why_the_engine_ended_it(client: Client,
                                                   worker_store: Store) -> None:
    rng = random.Random(19)
    job_id = client.submit(document(rng, 60), question(rng), max_tokens=5, ignore_eos=True)
    (record,) = client.wait([job_id], timeout=TIMEOUT)
    assert record.status is JobStatus.SUCCEEDED and record.completion_tokens == 5
    with worker_store.engine.connect() as connection:
        reason = connection.execute(
            select(Result.finish_reason).where(Result.job_id == job_id)).scalar_one()
    assert reason == "length"
