"""The control plane's speed: what a producer pays to hand jobs to the service through the
public `jobsvc.Client` while no worker runs, each figure beside the machine's own limit for
the same work, measured in the same run.

    python -m jobsvc.bench.controlplane [--shards 8] [--single 2000] [--calls-of 100 1000]
        [--jobs 20000] [--held 200000] [--json PATH] [--reset]

Four sections, each with wall time and this process's CPU (`time.process_time`):
  submit       `Client.submit` one job at a time; beside it one Redis PING plus one
               PostgreSQL `SELECT 1`, the round trips no submit can go below
  submit_many  jobs per second in calls of each size; beside them a raw `COPY` of the very rows
               the service wrote into a temporary copy of the jobs table (no indexes, no WAL),
               one COPY per call, and the very messages the service queued pushed back in one
               Redis pipeline: ceilings, not targets
  async_client the same calls through `AsyncClient`, awaited from one task
  held         with many jobs waiting: one reconciliation round, what `jobsvc status` reads,
               `Client.get`, and what the waiting jobs cost in Redis memory and database bytes

It runs on the configured database and Redis (JOBSVC_DATABASE_URL, JOBSVC_REDIS_URL), which
must be PostgreSQL and a Redis database of the benchmark's own: it migrates the schema, then
refuses to start unless the jobs table and the Redis database are empty. `--reset` empties
them first: it deletes every job, result and document and flushes that whole Redis database.
The jobs it submits stay queued; reset or drop both afterwards. Prints the result as JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import cycle
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import redis
from psycopg import sql
from sqlalchemy import make_url

from jobsvc import AsyncClient, Client
from jobsvc.fleet import FleetReader
from jobsvc.keys import ALL_QUEUES_PATTERN, RECONCILED_KEY, shard_of_queue
from jobsvc.migrate import upgrade_to_head
from jobsvc.reconcile import Reconciler
from jobsvc.settings import Settings
from jobsvc.status import status_report
from jobsvc.store import Store
from jobsvc.store.tables import Document, Job
from jobsvc.transport import make_celery
from jobsvc.workloads import document, question

DOCUMENT_CHARS = 1500
MAX_TOKENS = 16
# One-at-a-time submits draw from a small pool; calls take ~QUESTIONS_PER_DOCUMENT questions
# of each document, from a pool large enough that a call of 1,000 repeats none.
SINGLE_POOL = 50
CALL_POOL = 200
QUESTIONS_PER_DOCUMENT = 10
HELD_CALL = 1000
WARM_SUBMITS = 20
ROUND_TRIPS = 200
REPEATS = 3
GETS = 200
# The benchmark's own key for pushing messages back; deleted at once.
_SCRATCH_KEY = "bench:controlplane:scratch"

T = TypeVar("T")


@dataclass
class Spent:
    """Wall and CPU seconds added up over the blocks timed with `spending`."""

    wall: float = 0.0
    cpu: float = 0.0


@contextmanager
def spending(spent: Spent) -> Iterator[None]:
    """Add the block's wall time and this process's CPU time to `spent`."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        spent.wall += time.perf_counter() - wall
        spent.cpu += time.process_time() - cpu


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50, p95 and p99 of durations, in milliseconds."""
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return {f"p{q}_ms": round(1000 * cuts[q - 1], 3) for q in (50, 95, 99)}


def timed(call: Callable[[], object], times: int) -> list[float]:
    """The wall time of each of `times` calls."""
    durations = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        durations.append(time.perf_counter() - started)
    return durations


def machine(client: redis.Redis, conn: psycopg.Connection) -> dict[str, Any]:
    """What the figures were measured on."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo
                  if line.startswith("model name")), "unknown")
    memory_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    try:
        revision: str | None = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
            capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        revision = None
    server_version = conn.execute("SHOW server_version").fetchone()
    return {"cpus": os.cpu_count(), "cpu_model": model, "memory_bytes": memory_kib * 1024,
            "python": platform.python_version(), "git_rev": revision,
            "redis": client.info("server")["redis_version"],
            "postgresql": server_version[0] if server_version else None}


def postgres_conninfo(database_url: str) -> str:
    """The database URL as psycopg takes it; refuses anything but PostgreSQL."""
    url = make_url(database_url)
    if url.get_backend_name() != "postgresql":
        raise SystemExit(f"the control-plane benchmark needs PostgreSQL (JOBSVC_DATABASE_URL), "
                         f"not {url.get_backend_name()}")
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def make_ready(settings: Settings, client: redis.Redis, conn: psycopg.Connection,
               reset: bool) -> None:
    """Migrate, then empty the database's jobs and the Redis database if asked, else refuse
    to measure on top of someone's jobs (or add to them)."""
    upgrade_to_head(settings.resolved_database_url)
    if reset:
        conn.execute(sql.SQL("TRUNCATE {}, {} CASCADE").format(
            sql.Identifier(Job.__tablename__), sql.Identifier(Document.__tablename__)))
        client.flushdb()
    jobs = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
        sql.Identifier(Job.__tablename__))).fetchone()
    keys = client.dbsize()
    if (jobs and jobs[0]) or keys:
        raise SystemExit(
            f"the database holds {jobs[0] if jobs else '?'} jobs and the Redis database {keys} "
            "keys: point JOBSVC_DATABASE_URL and JOBSVC_REDIS_URL at a database and a Redis "
            "database of the benchmark's own, or pass --reset to delete every job, result and "
            "document there and flush that Redis database")


def documents(seed: int, count: int) -> list[str]:
    """`count` documents of exactly DOCUMENT_CHARS characters."""
    rng = random.Random(seed)
    pool = []
    for _ in range(count):
        text = ""
        while len(text) < DOCUMENT_CHARS:
            text += document(rng, DOCUMENT_CHARS // 4)
        pool.append(text[:DOCUMENT_CHARS])
    return pool


def calls(pool: Sequence[str], rng: random.Random, jobs: int,
          size: int) -> Iterator[list[dict[str, Any]]]:
    """`jobs` jobs in calls of `size`, QUESTIONS_PER_DOCUMENT questions to each document, the
    documents taken from `pool` in turn (so they repeat across calls)."""
    turn = cycle(pool)
    for start in range(0, jobs, size):
        count = min(size, jobs - start)
        call: list[dict[str, Any]] = []
        while len(call) < count:
            text = next(turn)
            call.extend({"document": text, "question": question(rng), "max_tokens": MAX_TOKENS}
                        for _ in range(min(QUESTIONS_PER_DOCUMENT, count - len(call))))
        yield call


def round_trip_limit(client: redis.Redis, conn: psycopg.Connection) -> dict[str, float]:
    """p50 of a Redis PING and of a PostgreSQL `SELECT 1`: one round trip to each, which any
    submit that records and enqueues pays at least; and of a one-row INSERT committed on its
    own, what any write that must survive a crash pays (the WAL flushed to disk)."""
    ping = statistics.median(timed(client.ping, ROUND_TRIPS))
    select = statistics.median(timed(lambda: conn.execute("SELECT 1").fetchone(), ROUND_TRIPS))
    conn.execute("CREATE TABLE IF NOT EXISTS bench_commit (n integer)")
    commit = statistics.median(timed(
        lambda: conn.execute("INSERT INTO bench_commit VALUES (1)"), ROUND_TRIPS))
    conn.execute("DROP TABLE bench_commit")
    return {"redis_ping_p50_ms": round(1000 * ping, 3),
            "postgres_select1_p50_ms": round(1000 * select, 3),
            "postgres_insert_commit_p50_ms": round(1000 * commit, 3),
            "limit_round_trips_ms": round(1000 * (ping + select), 3)}


def measure_submit(service: Client, count: int, client: redis.Redis,
                   conn: psycopg.Connection) -> dict[str, Any]:
    """`Client.submit` one job at a time, after WARM_SUBMITS untimed ones."""
    rng = random.Random(1)
    pool = documents(1, SINGLE_POOL)
    for _ in range(WARM_SUBMITS):
        service.submit(rng.choice(pool), question(rng), max_tokens=MAX_TOKENS)
    spent, durations = Spent(), []
    for _ in range(count):
        text, asked = rng.choice(pool), question(rng)
        with spending(spent):
            started = time.perf_counter()
            service.submit(text, asked, max_tokens=MAX_TOKENS)
            durations.append(time.perf_counter() - started)
    return {"submits": count, "documents": SINGLE_POOL, **percentiles_ms(durations),
            "wall_s": round(spent.wall, 3),
            "cpu_ms_per_submit": round(1000 * spent.cpu / count, 3),
            **round_trip_limit(client, conn)}


def queue_lengths(client: redis.Redis) -> dict[bytes, int]:
    """Every shard queue's length."""
    names = [key for key in client.scan_iter(match=ALL_QUEUES_PATTERN, count=1000)
             if shard_of_queue(key) is not None]
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.llen(name)
    return dict(zip(names, pipe.execute(), strict=True))


def new_messages(client: redis.Redis, before: dict[bytes, int]) -> list[bytes]:
    """The messages queued since `before`: kombu pushes to the head of a queue, and with no
    worker nothing leaves it."""
    pipe = client.pipeline(transaction=False)
    for name, length in queue_lengths(client).items():
        if length > before.get(name, 0):
            pipe.lrange(name, 0, length - before.get(name, 0) - 1)
    return [message for batch in pipe.execute() for message in batch]


def copy_rows_per_s(conn: psycopg.Connection, rows: int, size: int) -> float:
    """The newest `rows` rows of the jobs table copied back, one `COPY FROM` of `size` rows per
    transaction, into a temporary table of the same columns (no indexes, no WAL): rows per
    second of the COPYs and their commits alone."""
    jobs = sql.Identifier(Job.__tablename__)
    exported = bytearray()
    with conn.cursor() as cursor:
        with cursor.copy(sql.SQL(
                "COPY (SELECT * FROM {} ORDER BY submitted_at DESC LIMIT {}) TO STDOUT").format(
                jobs, rows)) as copy:
            for data in copy:
                exported += data
        lines = bytes(exported).split(b"\n")[:-1]
        cursor.execute(sql.SQL("CREATE TEMP TABLE copy_limit (LIKE {} INCLUDING DEFAULTS)")
                       .format(jobs))
        spent = Spent()
        for start in range(0, len(lines), size):
            chunk = b"\n".join(lines[start:start + size]) + b"\n"
            with spending(spent), conn.transaction(), cursor.copy(
                    "COPY copy_limit FROM STDIN") as copy:
                copy.write(chunk)
        cursor.execute("DROP TABLE copy_limit")
    return len(lines) / spent.wall


def pipeline_seconds(client: redis.Redis, messages: Sequence[bytes]) -> float:
    """Push `messages` to a scratch list in one pipeline; the wall time of that pipeline."""
    pipe = client.pipeline(transaction=False)
    for message in messages:
        pipe.lpush(_SCRATCH_KEY, message)
    started = time.perf_counter()
    pipe.execute()
    elapsed = time.perf_counter() - started
    client.delete(_SCRATCH_KEY)
    return elapsed


def measure_calls(service: Client, jobs: int, size: int, client: redis.Redis,
                  conn: psycopg.Connection) -> dict[str, Any]:
    """`jobs` jobs through `Client.submit_many` in calls of `size`, with the COPY and
    pipeline ceilings for the same rows and messages."""
    pool, rng = documents(2, CALL_POOL), random.Random(size)
    work = list(calls(pool, rng, jobs, size))
    before = queue_lengths(client)
    spent = Spent()
    with spending(spent):
        for call in work:
            service.submit_many(call)
    messages = new_messages(client, before)
    pushed = pipeline_seconds(client, messages)
    return {"call_size": size, "jobs": jobs, "calls": len(work),
            "jobs_per_s": round(jobs / spent.wall, 1), "wall_s": round(spent.wall, 3),
            "cpu_ms_per_job": round(1000 * spent.cpu / jobs, 4),
            "messages": len(messages),
            "jobs_per_message": round(jobs / len(messages), 2) if messages else None,
            "message_bytes_mean": round(statistics.fmean(map(len, messages))) if messages
            else None,
            "copy_rows_per_s": round(copy_rows_per_s(conn, jobs, size), 1),
            "redis_pipeline_jobs_per_s": round(jobs / pushed, 1)}


def hold(service: Client, jobs: int) -> tuple[list[str], Spent]:
    """Submit `jobs` jobs in calls of HELD_CALL, reporting progress on standard error."""
    pool, rng = documents(2, CALL_POOL), random.Random(3)
    ids: list[str] = []
    spent = Spent()
    for call in calls(pool, rng, jobs, HELD_CALL):
        with spending(spent):
            ids.extend(service.submit_many(call))
        if len(ids) % (20 * HELD_CALL) == 0 or len(ids) == jobs:
            print(f"held: {len(ids)}/{jobs} jobs submitted", file=sys.stderr, flush=True)
    return ids, spent


def repeated(call: Callable[[], T]) -> tuple[list[float], list[float], list[T]]:
    """The wall and CPU seconds of each of REPEATS calls, and what each returned."""
    walls, cpus, returned = [], [], []
    for _ in range(REPEATS):
        spent = Spent()
        with spending(spent):
            returned.append(call())
        walls.append(round(spent.wall, 4))
        cpus.append(round(spent.cpu, 4))
    return walls, cpus, returned


def database_bytes(conn: psycopg.Connection) -> tuple[int, int]:
    """The jobs and documents tables' total size (with indexes and TOAST) and the job count."""
    row = conn.execute(sql.SQL(
        "SELECT pg_total_relation_size({jobs_name}) + pg_total_relation_size({documents_name}),"
        " (SELECT count(*) FROM {jobs})").format(
        jobs_name=Job.__tablename__, documents_name=Document.__tablename__,
        jobs=sql.Identifier(Job.__tablename__))).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def measure_held(service: Client, settings: Settings, jobs: int, client: redis.Redis,
                 conn: psycopg.Connection) -> dict[str, Any]:
    """With `jobs` more jobs waiting: a reconciliation round, `jobsvc status`, `Client.get`,
    and the memory and bytes the waiting jobs take."""
    store = Store(settings.resolved_database_url)
    try:
        reconciler = Reconciler(settings, redis.Redis.from_url(settings.redis_url), store,
                                make_celery(settings))
        # As in a running fleet, rounds have run before the jobs arrive.
        reconciler.run_round()
        ids, spent = hold(service, jobs)
        # As autovacuum would soon after such an insert (where it is off, plans otherwise
        # rest on an empty table's statistics).
        conn.execute(sql.SQL("ANALYZE {}, {}").format(sql.Identifier(Job.__tablename__),
                                                     sql.Identifier(Document.__tablename__)))
        round_walls, round_cpus, reports = repeated(reconciler.run_round)
        # As after a Redis restart that kept its queues but not reconciliation's progress:
        # every unfinished job's message is checked once.
        client.delete(RECONCILED_KEY)
        full = Spent()
        with spending(full):
            reports.append(reconciler.run_round())
        reader = FleetReader(settings, client, store)
        status_walls, status_cpus, _ = repeated(lambda: status_report(reader.read()))
    finally:
        store.dispose()
    sample = random.Random(4).sample(ids, min(GETS, len(ids)))
    get_spent, gets = Spent(), []
    for job_id in sample:
        with spending(get_spent):
            started = time.perf_counter()
            service.get(job_id)
            gets.append(time.perf_counter() - started)
    total_bytes, count = database_bytes(conn)
    return {"held_jobs": jobs, "jobs_in_table": count,
            "submit_jobs_per_s": round(jobs / spent.wall, 1),
            "submit_cpu_ms_per_job": round(1000 * spent.cpu / jobs, 4),
            "reconcile_round_s": round_walls, "reconcile_round_cpu_s": round_cpus,
            "reconcile_check_all_s": round(full.wall, 3),
            # A round that sent or moved jobs did more than check: its time is not a check's.
            "reconcile_requeued_or_moved": sum(report.requeued + report.moved
                                               for report in reports),
            "status_s": status_walls, "status_cpu_s": status_cpus,
            "get_ms": round(1000 * statistics.median(gets), 3),
            "get_cpu_ms": round(1000 * get_spent.cpu / len(sample), 3),
            "queue_messages": sum(queue_lengths(client).values()),
            "redis_used_memory_bytes": int(client.info("memory")["used_memory"]),
            "postgres_bytes_per_job": round(total_bytes / count) if count else None}


async def measure_async(settings: Settings, count: int, jobs: int) -> dict[str, Any]:
    """`AsyncClient.submit` one job at a time and `submit_many` in calls of HELD_CALL, awaited
    from one task, as an asyncio producer would."""
    rng = random.Random(5)
    single_pool, pool = documents(1, SINGLE_POOL), documents(2, CALL_POOL)
    async with AsyncClient(settings=settings) as service:
        for _ in range(WARM_SUBMITS):
            await service.submit(rng.choice(single_pool), question(rng), max_tokens=MAX_TOKENS)
        durations = []
        for _ in range(count):
            text, asked = rng.choice(single_pool), question(rng)
            started = time.perf_counter()
            await service.submit(text, asked, max_tokens=MAX_TOKENS)
            durations.append(time.perf_counter() - started)
        spent = Spent()
        with spending(spent):
            for call in calls(pool, rng, jobs, HELD_CALL):
                await service.submit_many(call)
    return {"submits": count, **percentiles_ms(durations), "call_size": HELD_CALL,
            "jobs": jobs, "jobs_per_s": round(jobs / spent.wall, 1)}


def run(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    """Every section on a ready database and Redis database."""
    client = redis.Redis.from_url(settings.redis_url)
    with psycopg.connect(postgres_conninfo(settings.resolved_database_url),
                         autocommit=True) as conn:
        make_ready(settings, client, conn, args.reset)
        result: dict[str, Any] = {"machine": machine(client, conn), "shards": settings.shards,
                                  "routing": settings.routing,
                                  "document_chars": DOCUMENT_CHARS, "max_tokens": MAX_TOKENS,
                                  "redis_used_memory_at_start_bytes":
                                      int(client.info("memory")["used_memory"])}
        with Client(settings=settings) as service:
            result["submit"] = measure_submit(service, args.single, client, conn)
            result["submit_many"] = [measure_calls(service, args.jobs, size, client, conn)
                                     for size in args.calls_of]
            result["async_client"] = asyncio.run(measure_async(settings, args.single // 2,
                                                               args.jobs))
            result["held"] = measure_held(service, settings, args.held, client, conn)
    client.close()
    return result


def main() -> None:
    """`python -m jobsvc.bench.controlplane`: measure, print the result as JSON."""
    parser = argparse.ArgumentParser(prog="python -m jobsvc.bench.controlplane",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--single", type=int, default=2000, help="one-at-a-time submits")
    parser.add_argument("--calls-of", type=int, nargs="+", default=[100, 1000],
                        help="jobs per submit_many call, one section each")
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs per call size")
    parser.add_argument("--held", type=int, default=200_000,
                        help="jobs submitted to wait before the held section")
    parser.add_argument("--json", type=Path, help="write the result here too")
    parser.add_argument("--reset", action="store_true",
                        help="delete every job, result and document in the database and flush "
                             "the Redis database first")
    args = parser.parse_args()
    settings = replace(Settings.from_env(), shards=args.shards)
    settings.validate()
    result = run(settings, args)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
