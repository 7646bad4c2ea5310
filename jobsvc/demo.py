"""`jobsvc demo`: the whole pipeline on one machine with embedded defaults — local workers
with the tiny CPU model, Redis for the queues (a private one when none answers), SQLite unless
a database URL is given."""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis

from jobsvc.child_processes import LocalWorkers
from jobsvc.client import Client
from jobsvc.console import StatusLine
from jobsvc.errors import ConfigurationError
from jobsvc.migrate import upgrade_to_head
from jobsvc.private_redis import PrivateRedis
from jobsvc.settings import Settings, masked_url
from jobsvc.store import JobRecord
from jobsvc.wire import JobStatus
from jobsvc.workloads import WorkloadJob, document_questions


def _say(text: str) -> None:
    print(text, flush=True)


def _redis_answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError):
        return False
    except redis.RedisError as error:
        raise ConfigurationError(
            f"Redis at {masked_url(url)} answered with an error ({error}); "
            "fix JOBSVC_REDIS_URL") from None
    finally:
        client.close()
    return True


def _broker(settings: Settings, stack: ExitStack) -> Settings:
    """These settings if their Redis answers, else settings for a private Redis that lives as
    long as `stack`: like the embedded SQLite, nothing needs to run before the demo."""
    if _redis_answers(settings.redis_url):
        return settings
    server = stack.enter_context(PrivateRedis())
    _say(f"no Redis answers at {masked_url(settings.redis_url)}: started a private one for "
         f"this run at {server.url} ({server.binary.name}, pid {server.pid}, no persistence)")
    return replace(settings, redis_url=server.url)


def run_demo(settings: Settings, *, documents: int, questions: int, words: int,
             second_model: str | None = None) -> None:
    """Run a generated workload through local workers and print what came back, so a newcomer sees
    the whole pipeline work with nothing to set up. With `second_model` (weights), a second
    worker serves them under the name `<served name>-b` on a shard of its own, and every other
    document's questions go to it."""
    # Left in reverse order: the workers' warm shutdown still reaches a private Redis.
    with ExitStack() as stack:
        given_redis_url = settings.redis_url
        settings = _broker(settings, stack)
        workers = stack.enter_context(LocalWorkers(settings, Path("jobsvc-logs")))
        settings = workers.settings
        upgrade_to_head(settings.resolved_database_url)
        _say(f"database: {masked_url(settings.resolved_database_url)}")
        _say(f"starting {settings.shards} worker(s) with model {settings.model} "
             f"(logs in {workers.log_dir}/)")
        fleet = [workers]
        models = [settings.served_model_name]
        if second_model is not None:
            models.append(f"{settings.served_model_name}-b")
            second = replace(settings, model=second_model, served_model_name=models[1])
            fleet.append(stack.enter_context(LocalWorkers(
                second, workers.log_dir, shards=[settings.shards])))
            _say(f"starting 1 worker with model {second_model} as {models[1]!r} on shard "
                 f"{settings.shards}")
        client = stack.enter_context(Client(settings=settings))
        status = StatusLine()
        for group in fleet:
            group.spawn()
        for group in fleet:
            group.wait_ready(progress=status.update)
        status.finish()
        jobs = document_questions(documents, questions, words, seed=int(time.time()))
        started = time.monotonic()
        ids = client.submit_many(demo_jobs(jobs, models))
        _say(f"submitted {len(ids)} jobs ({documents} documents x {questions} questions)")
        records = client.wait(ids, progress=True)
        elapsed = time.monotonic() - started
        _print_summary(settings, records, elapsed,
                       redis_stays=settings.redis_url == given_redis_url)


def demo_jobs(work: Sequence[WorkloadJob], models: Sequence[str]) -> list[dict[str, Any]]:
    """The demo's jobs: each document's questions for one model, the models taking the
    documents in turn."""
    order = {text: index for index, text in enumerate(dict.fromkeys(
        job.document for job in work))}
    return [{"document": job.document, "question": job.question, "max_tokens": 16,
             "model": models[order[job.document] % len(models)]} for job in work]


def _print_summary(settings: Settings, records: list[JobRecord], elapsed: float, *,
                   redis_stays: bool) -> None:
    statuses = {status.value: sum(r.status == status for r in records) for status in JobStatus}
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens or 0 for r in records)
    shards: dict[int, int] = {}
    models: dict[str, int] = {}
    for record in records:
        shards[record.shard] = shards.get(record.shard, 0) + 1
        models[record.model] = models.get(record.model, 0) + 1
    example = next((r for r in records if r.answer is not None), records[0])
    lines = [
        "=== jobsvc demo summary ===",
        f"jobs: {len(records)}  " + "  ".join(f"{k}: {v}" for k, v in statuses.items() if v),
        f"throughput: {len(records) / elapsed:.1f} req/s over {elapsed:.1f} s "
        "(submit to last result)",
        f"prefix-cache hit rate: {cached / max(prompt, 1):.3f} "
        f"({cached} of {prompt} prompt tokens served from cache)",
        f"jobs per shard: {dict(sorted(shards.items()))}",
        f"jobs per model: {dict(sorted(models.items()))}",
        f"results are in: {masked_url(settings.resolved_database_url)} "
        "(tables jobs, results, batch_stats)",
        f"look at one: .venv/bin/python -c \"from jobsvc import Client; "
        f"print(Client().get('{example.job_id}'))\"",
        f"  -> {example.status.value}: {example.answer!r}",
    ]
    if redis_stays:
        lines.append("watch queues in Flower: FLOWER_BASIC_AUTH=user:password "
                     f".venv/bin/jobsvc flower  (then http://127.0.0.1:{settings.flower_port}/)")
    _say("\n".join(lines))
