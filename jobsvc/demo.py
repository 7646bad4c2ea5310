"""`jobsvc demo`: the whole pipeline on one machine with embedded defaults — local workers
with the tiny CPU model, Redis for the queues, SQLite unless a database URL is given."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import redis

from jobsvc.client import Client
from jobsvc.errors import ConfigurationError
from jobsvc.local import LocalWorkers
from jobsvc.migrate import upgrade_to_head
from jobsvc.schema import JobStatus
from jobsvc.settings import Settings
from jobsvc.store import JobRecord
from jobsvc.workloads import document_questions


def _say(text: str, *, same_line: bool = False) -> None:
    end = "" if same_line and sys.stdout.isatty() else "\n"
    prefix = "\r\x1b[K" if same_line and sys.stdout.isatty() else ""
    print(f"{prefix}{text}", end=end, flush=True)


def _check_redis(url: str) -> None:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=3).ping()
    except redis.RedisError as error:
        raise ConfigurationError(
            f"cannot reach Redis at {url} ({error}); start one (redis-server) or set "
            "JOBSVC_REDIS_URL") from None


def run_demo(settings: Settings, *, documents: int, questions: int, words: int) -> None:
    _check_redis(settings.redis_url)
    workers = LocalWorkers(settings, Path("jobsvc-logs"))
    settings = workers.settings
    upgrade_to_head(settings.resolved_database_url)
    _say(f"database: {settings.resolved_database_url}")
    _say(f"starting {settings.shards} worker(s) with model {settings.model} "
         f"(logs in {workers.log_dir}/)")
    with workers, Client(settings=settings) as client:
        workers.start(progress=lambda line: _say(line, same_line=True))
        _say("")
        jobs = document_questions(documents, questions, words, seed=int(time.time()))
        started = time.monotonic()
        ids = client.submit_many(
            {"document": job.document, "question": job.question, "max_tokens": 16}
            for job in jobs)
        _say(f"submitted {len(ids)} jobs ({documents} documents x {questions} questions)")
        while pending := client.pending(ids):
            _say(f"progress: {len(ids) - pending} of {len(ids)} jobs finished", same_line=True)
            time.sleep(0.5)
        records = client.wait(ids)
        elapsed = time.monotonic() - started
        _say("")
        _print_summary(settings, records, elapsed)


def _print_summary(settings: Settings, records: list[JobRecord], elapsed: float) -> None:
    statuses = {status.value: sum(r.status == status for r in records) for status in JobStatus}
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens or 0 for r in records)
    shards: dict[int, int] = {}
    for record in records:
        shards[record.shard] = shards.get(record.shard, 0) + 1
    example = next((r for r in records if r.answer is not None), records[0])
    lines = [
        "=== jobsvc demo summary ===",
        f"jobs: {len(records)}  " + "  ".join(f"{k}: {v}" for k, v in statuses.items() if v),
        f"throughput: {len(records) / elapsed:.1f} req/s over {elapsed:.1f} s "
        "(submit to last result)",
        f"prefix-cache hit rate: {cached / max(prompt, 1):.3f} "
        f"({cached} of {prompt} prompt tokens served from cache)",
        f"jobs per shard: {dict(sorted(shards.items()))}",
        f"results are in: {settings.resolved_database_url} (tables jobs, results, batch_stats)",
        f"look at one: .venv/bin/python -c \"from jobsvc import Client; "
        f"print(Client().get('{example.job_id}'))\"",
        f"  -> {example.status.value}: {example.answer!r}",
        "watch queues in Flower: .venv/bin/jobsvc flower  (then http://127.0.0.1:"
        f"{settings.flower_port}/)",
    ]
    _say("\n".join(lines))
