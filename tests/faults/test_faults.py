"""Fault tests on private servers (loopback only, bounded in time): every job must end in
exactly one final state whatever fails in between. Each scenario adds a row to the table
printed at the end of the test run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from sqlalchemy import func, insert, select

from jobsvc import BrokerUnavailable, Client, InvalidJob, JobStatus, StorageUnavailable
from jobsvc.child_processes import WorkerStartError, settings_environment
from jobsvc.compression import compress, pack_tokens
from jobsvc.keys import queue_name
from jobsvc.store import NewJob, utcnow
from jobsvc.store.tables import Document, Job
from jobsvc.transport import make_celery, publish
from jobsvc.wire import QueueMessage
from jobsvc.workers.celery_app import EXIT_ENGINE_DEAD
from jobsvc.workloads import document_questions
from tests.support.engine_killer import KILLER_PREFIX
from tests.support.environment import FAULT_TABLE
from tests.support.fault_tally import Harness, engine_core_of, running_harness, tally
from tests.support.waiting import until

pytestmark = pytest.mark.faults

FINISH_TIMEOUT = 240


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    with running_harness(6391, 5441, Path(tmp_path_factory.mktemp("fault-logs")),
                         requeue_interval=2, stranded_grace=5, max_attempts=1, batch_size=16,
                         worker_concurrency=4, visibility_timeout=8,
                         worker_hooks="tests.support.engine_killer:EngineKiller") as running:
        yield running


def _burst(client: Client, jobs: int, seed: int, max_tokens: int = 24) -> list[str]:
    work = document_questions(jobs // 4, 4, 250, seed=seed)
    return client.submit_many({"document": job.document, "question": job.question,
                               "max_tokens": max_tokens, "ignore_eos": True} for job in work)


def _wait_until_finished(client: Client, ids: list[str], count: int) -> None:
    until(f"{count} jobs of the burst finished",
          lambda: len(ids) - client.pending(ids) >= count, 120, every=0.1)


def _tally(harness: Harness, scenario: str, ids: list[str]) -> dict[str, int]:
    return tally(harness.client, harness.settings.resolved_database_url, scenario, ids,
                 FINISH_TIMEOUT)


def _admitted(harness: Harness, ids: list[str]) -> int:
    """How many of these jobs a worker has admitted to its engine."""
    with harness.store.engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(Job).where(
            Job.id.in_(ids), Job.started_at.is_not(None))).scalar_one()


def _attempts(harness: Harness, ids: list[str]) -> set[int]:
    with harness.store.engine.connect() as connection:
        return set(connection.execute(select(Job.attempts).where(Job.id.in_(ids))).scalars())


def test_a_batch_stalled_past_the_visibility_timeout_is_delivered_once(
        harness: Harness) -> None:
    client = harness.client
    # A frozen engine holds the batch past the visibility timeout (plus kombu's 1 s restore
    # scan) however fast this host generates: the worker claims the job and waits on it.
    stall = 1.5 * harness.settings.visibility_timeout + 1
    engine_core = engine_core_of(harness)
    engine_core.suspend()
    try:
        job_id = client.submit(document_questions(1, 1, 80, seed=100)[0].document, "long?",
                               max_tokens=8, ignore_eos=True)
        until("the worker claimed the job", lambda: _attempts(harness, [job_id]) == {1}, 60,
              every=0.05)
        time.sleep(stall)
    finally:
        engine_core.resume()
    (record,) = client.wait([job_id], timeout=FINISH_TIMEOUT)
    assert record.status is JobStatus.SUCCEEDED
    assert (record.finished_at - record.started_at).total_seconds() > stall
    # No second delivery claimed it: the worker kept renewing its lease.
    assert _attempts(harness, [job_id]) == {1}


def _enqueue_by_hand(harness: Harness, documents: dict[str, tuple[bytes, bytes]],
                     first_id: str = "") -> list[str]:
    """Record one job per document, stored as given (text frame, token frame) as no producer
    would store it, and enqueue them all in one batch message; returns the job IDs. The first
    job's ID starts with `first_id`."""
    job_ids = {key: uuid.uuid4().hex for key in documents}
    first = next(iter(job_ids))
    job_ids[first] = first_id + job_ids[first][len(first_id):]
    message = QueueMessage(0, list(job_ids.values()), uuid.uuid4().hex)
    with harness.store.engine.begin() as connection:
        connection.execute(insert(Document), [
            {"key": key, "text_zst": text_zst, "tokens_zst": tokens_zst, "tokens": 3,
             "created_at": utcnow()} for key, (text_zst, tokens_zst) in documents.items()])
    harness.store.record_submitted([], [
        NewJob(job_ids[key], key, "?", (5,), {"max_tokens": 4}, harness.settings.served_model_name,
               shard=0, prompt_tokens=4,
               estimated_prefill=4, load=4, message_id=message.message_id)
        for key in documents])
    publish(make_celery(harness.settings), redis.Redis.from_url(harness.settings.redis_url),
            [message])
    return list(job_ids.values())


def test_an_engine_request_that_raises_fails_only_its_job(harness: Harness) -> None:
    client = harness.client
    good = _burst(client, 8, seed=101)
    # A job whose prompt holds a token the model does not have: the engine refuses it.
    (bad_id,) = _enqueue_by_hand(harness, {"f" * 32: (b"", pack_tokens([1, 2, 10_000_000]))})
    row = _tally(harness, "engine request raises", [*good, bad_id])
    assert row["lost"] == 0 and row["duplicated"] == 0
    assert row["failed"] == 1 and row["succeeded"] == len(good)
    assert client.get(bad_id).error


def test_a_job_whose_document_does_not_read_back_fails_and_its_batch_runs(
        harness: Harness) -> None:
    readable, unreadable = "a" * 32, "b" * 32
    good_id, bad_id = _enqueue_by_hand(harness, {
        readable: (compress(b"text"), pack_tokens([7, 8, 9])),
        unreadable: (b"not a text frame", b"not a token frame")})
    row = _tally(harness, "document does not read back", [good_id, bad_id])
    assert row["lost"] == 0 and row["duplicated"] == 0
    assert row["failed"] == 1 and row["succeeded"] == 1
    record = harness.client.get(bad_id)
    assert record.status is JobStatus.FAILED
    assert f"document {unreadable} does not read back" in (record.error or "")


def test_cancelled_while_queued_never_runs_and_while_running_is_aborted(
        harness: Harness) -> None:
    client = harness.client
    # A full batch per worker thread keeps them all busy, so the next message waits queued.
    busy = _burst(client, harness.settings.worker_concurrency * harness.settings.batch_size,
                  seed=102, max_tokens=64)
    queued_victims = _burst(client, 4, seed=107)
    for job_id in queued_victims:
        assert client.cancel(job_id)
    running = until("a running job", lambda: next(
        (job_id for job_id in busy if client.get(job_id).status is JobStatus.RUNNING), None),
        60, every=0.05)
    client.cancel(running)
    row = _tally(harness, "cancel queued + running", [*busy, *queued_victims])
    assert row["lost"] == 0 and row["duplicated"] == 0 and row["failed"] == 0
    assert all(client.get(job_id).started_at is None for job_id in queued_victims)
    assert client.get(running).status is JobStatus.CANCELLED
    assert row["cancelled"] == 5


def test_postgres_down_for_20_seconds_mid_burst_loses_nothing(harness: Harness) -> None:
    client = harness.client
    ids = _burst(client, 48, seed=103, max_tokens=48)
    _wait_until_finished(client, ids, 4)
    harness.postgres.stop()
    broker = redis.Redis.from_url(harness.settings.redis_url)
    queued_before = broker.llen(queue_name(0))
    try:
        with pytest.raises(StorageUnavailable, match="nothing was enqueued"):
            client.submit("a document while the database is down", "is it kept?")
        assert broker.llen(queue_name(0)) == queued_before
        with pytest.raises(StorageUnavailable):
            client.get(ids[0])
        with pytest.raises(StorageUnavailable):
            client.wait(ids, timeout=5)
        time.sleep(20)
    finally:
        harness.postgres.start()
    row = _tally(harness, "PostgreSQL stopped 20 s", ids)
    assert row == {**row, "succeeded": len(ids), "lost": 0, "duplicated": 0}


def test_redis_restart_mid_burst_requeues_what_it_lost(harness: Harness) -> None:
    client = harness.client
    # Far more batches than the worker runs or reserves at once: some wait in Redis.
    ids = _burst(client, 12 * harness.settings.batch_size, seed=104, max_tokens=16)
    _wait_until_finished(client, ids, 4)
    broker = redis.Redis.from_url(harness.settings.redis_url)
    assert broker.llen(queue_name(0)) > 0
    harness.redis_server.stop()
    try:
        with pytest.raises(BrokerUnavailable):
            client.submit("a document while Redis is down", "is it kept?")
    finally:
        harness.redis_server.start()
    row = _tally(harness, "Redis restarted", ids)
    assert row == {**row, "succeeded": len(ids), "lost": 0, "duplicated": 0}
    assert all(process.poll() is None for process in harness.workers.processes)


def test_seeded_jobs_among_plain_ones_all_succeed(harness: Harness) -> None:
    # Documents longer than a step's share of the engine's token budget: on CPU hosts a
    # seeded request whose prefill was split over steps killed the engine.
    work = document_questions(4, 4, 1200, seed=112)
    ids = harness.client.submit_many(
        {"document": job.document, "question": job.question, "max_tokens": 8,
         "temperature": 1.0, **({"seed": index} if index % 2 else {})}
        for index, job in enumerate(work))
    row = _tally(harness, "seeded among plain", ids)
    assert row == {**row, "succeeded": len(ids), "lost": 0, "duplicated": 0}
    assert _attempts(harness, ids) == {1}


def _gone_with_the_worker(processes: list[psutil.Process]) -> None:
    """Every process the worker had started ends with it, in bounded time."""
    _gone, alive = psutil.wait_procs(processes, timeout=30)
    for leftover in alive:
        leftover.kill()
    assert not alive, [process.pid for process in alive]


def test_kill_9_of_a_worker_mid_burst_ends_its_engine_and_delivers_its_batches_again(
        harness: Harness) -> None:
    client = harness.client
    ids = _burst(client, 48, seed=105, max_tokens=48)
    _wait_until_finished(client, ids, 4)
    worker = harness.workers.processes[0]
    started = psutil.Process(worker.pid).children(recursive=True)
    assert any("EngineCore" in process.name() for process in started)
    # The worker's main process alone, as the kernel's OOM killer or a supervisor would.
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    _gone_with_the_worker(started)
    harness.workers.processes.clear()
    harness.workers.start()
    row = _tally(harness, "worker kill -9, engine ends with it", ids)
    assert row == {**row, "succeeded": len(ids), "lost": 0, "duplicated": 0}


def _died_of_its_engine(harness: Harness) -> None:
    """Wait for the worker to exit on its engine's death, with everything it started."""
    worker = harness.workers.processes[0]
    try:
        started = psutil.Process(worker.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        started = []  # reaped already, by a start that saw it exit
    assert worker.wait(timeout=FINISH_TIMEOUT) == EXIT_ENGINE_DEAD
    _gone_with_the_worker(started)
    harness.workers.processes.clear()


def _restarted_to_die(harness: Harness) -> None:
    """Start the worker where a job that kills its engine waits for it, and see it die so:
    it may die before it has answered the start's ping."""
    with contextlib.suppress(WorkerStartError):
        harness.workers.start()
    _died_of_its_engine(harness)


def test_a_job_that_kills_its_engine_fails_alone_and_what_piles_up_meanwhile_runs_once(
        harness: Harness) -> None:
    """Three restarts serve two scenarios. A job kills the engine in company: the other
    messages' jobs in that engine run again, each message's together with nothing else in the
    engine, and succeed; the culprit's message runs so too and the culprit kills the engine
    again; its group halves, to one job each, and the culprit kills it once more, alone, and
    fails by itself while its message-mate succeeds. Meanwhile a broken or hostile broker
    holds things for the worker while it is down (copies, a forgery, garbage, lost
    messages)."""
    client, queue = harness.client, queue_name(0)
    broker = redis.Redis.from_url(harness.settings.redis_url)
    # Fewer messages than the worker runs at once, long enough to be running still when the
    # culprit's message starts beside them.
    ids = _burst(client, (harness.settings.worker_concurrency - 1) * harness.settings.batch_size,
                 seed=106, max_tokens=64)
    until("the burst's jobs all admitted", lambda: _admitted(harness, ids) == len(ids), 120,
          every=0.05)
    # A message of two: the fewer the culprit's mates, the fewer the halvings (and restarts)
    # until it runs alone.
    culprit, mate = _enqueue_by_hand(harness, {
        uuid.uuid4().hex: (compress(b"text"), pack_tokens([7 + n, 8, 9])) for n in range(2)},
        first_id=KILLER_PREFIX)
    _died_of_its_engine(harness)
    # Some of the burst's jobs died with the engine: they are the other messages' suspects.
    assert client.pending(ids) > 0

    queued_before = broker.llen(queue)
    lost = _burst(client, 8, seed=110)
    # kombu pushes at the head: the newest messages, this burst's, are lost.
    lost_messages = broker.llen(queue) - queued_before
    assert lost_messages > 0
    for _ in range(lost_messages):
        broker.lpop(queue)
    work = document_questions(4, 4, 120, seed=111)
    asked = {job_id: 3 + index % 5 for index, job_id in enumerate(client.submit_many(
        {"document": job.document, "question": job.question, "max_tokens": 3 + index % 5,
         "ignore_eos": True} for index, job in enumerate(work)))}
    for item in broker.lrange(queue, 0, -1):
        broker.lpush(queue, item, item, item)
    # A message of our own format naming real jobs, not theirs: it must run nothing.
    publish(make_celery(harness.settings), broker, [QueueMessage(0, list(asked),
                                                                 uuid.uuid4().hex)])
    broker.lpush(queue, b"not json at all", b"[1,2,3]")
    # Killed again by the culprit's message, with nothing else in the engine; then by the
    # culprit alone.
    _restarted_to_die(harness)
    _restarted_to_die(harness)
    harness.workers.start()

    row = _tally(harness, "a job kills its engine, 3 times", [*ids, mate, culprit])
    assert row == {**row, "succeeded": len(ids) + 1, "failed": 1, "lost": 0,
                   "duplicated": 0}
    assert "ran alone" in (client.get(culprit).error or "")
    # The other messages' jobs ran again in groups, never alone (a run alone is an attempt);
    # the culprit and its mate each ran alone once.
    assert _attempts(harness, ids) == {1}
    assert _attempts(harness, [culprit, mate]) == {2}
    row = _tally(harness, "copies x3, forgery, garbage, lost messages", [*asked, *lost])
    assert row == {**row, "succeeded": len(asked) + len(lost), "lost": 0, "duplicated": 0}
    records = {job_id: client.get(job_id) for job_id in asked}
    assert {job_id: record.completion_tokens for job_id, record in records.items()} == asked
    assert _attempts(harness, list(asked)) == {1}
    assert all(process.poll() is None for process in harness.workers.processes)
    (after,) = client.wait([client.submit("One more document.", "Still there?",
                                          max_tokens=4)], timeout=FINISH_TIMEOUT)
    assert after.status is JobStatus.SUCCEEDED


def _no_jobs_row(scenario: str) -> None:
    """A row for a scenario that must keep jobs from being made at all."""
    FAULT_TABLE.append({"scenario": scenario, "submitted": 0, "succeeded": 0, "failed": 0,
                        "cancelled": 0, "lost": 0, "duplicated": 0})


_KILLED_PRODUCER = """
import os, signal, sys
import jobsvc.dispatch
from jobsvc import Client

def die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

# Killed where a crash hurts most: its jobs are recorded, their messages not yet sent.
jobsvc.dispatch.publish = die
with Client() as client:
    client.submit_many({"document": f"Report {n % 4}: the harbour froze in {n % 4 + 1900}.",
                        "question": f"{sys.argv[1]} {n}", "max_tokens": 6} for n in range(40))
"""


def test_a_producer_killed_between_recording_and_enqueueing_strands_no_job(
        harness: Harness) -> None:
    marker = f"killed-producer-{uuid.uuid4().hex}"
    producer = subprocess.run(
        [sys.executable, "-c", _KILLED_PRODUCER, marker], capture_output=True, timeout=120,
        env={**os.environ, **settings_environment(harness.settings)})
    assert producer.returncode == -signal.SIGKILL, producer.stderr.decode()[-2000:]
    with harness.store.engine.connect() as connection:
        ids = list(connection.execute(
            select(Job.id).where(Job.question.startswith(marker))).scalars())
    assert len(ids) == 40
    row = _tally(harness, "producer kill -9 mid-submit", ids)
    assert row == {**row, "succeeded": len(ids), "lost": 0, "duplicated": 0}


def test_a_17_million_character_stop_string_is_refused_at_submit(harness: Harness) -> None:
    with pytest.raises(InvalidJob, match="stop"):
        harness.client.submit("A document.", "A question?", stop=["x" * 17_000_000] * 16)
    _no_jobs_row("17M-char stop strings refused")


def test_no_password_reaches_output_or_a_command_line(harness: Harness,
                                                      tmp_path: Path) -> None:
    secret = f"pw-{uuid.uuid4().hex}"
    database = harness.postgres.url.replace("postgres@", f"postgres:{secret}@")
    env = {**os.environ, "JOBSVC_DATABASE_URL": database,
           "JOBSVC_REDIS_URL": f"redis://:{secret}@127.0.0.1:6399/0",
           "JOBSVC_FLOWER_PORT": "5599", "FLOWER_BASIC_AUTH": f"operator:{secret}"}
    migrate = subprocess.run([sys.executable, "-m", "jobsvc", "migrate"], env=env,
                             capture_output=True, timeout=120)
    assert migrate.returncode == 0, migrate.stderr.decode()[-2000:]
    assert b"***" in migrate.stdout
    assert secret.encode() not in migrate.stdout + migrate.stderr
    log = tmp_path / "flower.log"
    with log.open("wb") as out:
        flower = subprocess.Popen([sys.executable, "-m", "jobsvc", "flower"], env=env,
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        # Running (behind its password), and saying where it listens and on which broker.
        deadline = time.monotonic() + 60
        while b"Broker:" not in log.read_bytes() and time.monotonic() < deadline:
            assert flower.poll() is None, log.read_text(errors="replace")
            time.sleep(0.2)
        assert flower.poll() is None, log.read_text(errors="replace")
        command_line = " ".join(psutil.Process(flower.pid).cmdline())
    finally:
        flower.terminate()
        flower.wait(timeout=30)
    assert "flower" in command_line
    assert secret not in command_line
    assert b"Broker: redis://:***@127.0.0.1:6399/0" in log.read_bytes()
    assert secret.encode() not in log.read_bytes()
    _no_jobs_row("credentials in output")
