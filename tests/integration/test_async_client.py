"""The asyncio producer on real parts: jobs submitted and awaited from coroutines are answered
by the worker, the event loop runs on while a wait is pending, and a cancelled wait lets go
of its thread. Jobs on `routing_settings` stay queued: no worker consumes that Redis."""

from __future__ import annotations

import asyncio
import random

import pytest
from sqlalchemy import text

from jobsvc import AsyncClient, JobStatus
from jobsvc.child_processes import LocalWorkers
from jobsvc.settings import Settings
from jobsvc.store import Store
from jobsvc.workloads import document, question
from tests.support.waiting import until

pytestmark = pytest.mark.integration

TIMEOUT = 180


def _job(rng: random.Random) -> dict[str, object]:
    return {"document": document(rng, 60), "question": question(rng), "max_tokens": 4}


def _listening(store: Store) -> int:
    """How many connections listen for finished jobs in the store's database."""
    with store.engine.connect() as connection:
        return int(connection.execute(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query LIKE 'LISTEN %'")).scalar_one())


def test_jobs_submitted_and_awaited_from_coroutines_are_answered(
        settings: Settings, worker: LocalWorkers) -> None:
    rng = random.Random(31)

    async def scenario() -> None:
        async with AsyncClient(settings=settings) as client:
            ids = await client.submit_many([_job(rng) for _ in range(3)])
            waited = await client.wait(ids, timeout=TIMEOUT)
            got = [await client.get(job_id) for job_id in ids]
        assert [record.job_id for record in waited] == ids
        assert got == waited
        for record in got:
            assert record.status is JobStatus.SUCCEEDED, record.error
            assert record.answer and record.completion_tokens

    asyncio.run(scenario())


def test_concurrent_submits_from_many_tasks_get_distinct_ids_and_all_finish(
        settings: Settings, worker: LocalWorkers) -> None:
    rng = random.Random(32)
    jobs = [_job(rng) for _ in range(20)]

    async def scenario() -> None:
        async with AsyncClient(settings=settings) as client:
            ids = await asyncio.gather(*(client.submit(**job) for job in jobs))
            assert len(set(ids)) == len(jobs)
            # More waits at once than the pool has threads: the rest queue for one.
            records = await asyncio.gather(*(client.wait(job_id, timeout=TIMEOUT)
                                             for job_id in ids))
        assert [record.job_id for (record,) in records] == ids
        assert all(record.status is JobStatus.SUCCEEDED for (record,) in records)

    asyncio.run(scenario())


def test_the_event_loop_runs_other_coroutines_while_a_wait_is_pending(
        routing_settings: Settings) -> None:
    rng = random.Random(33)

    async def scenario() -> None:
        async with AsyncClient(settings=routing_settings) as client:
            (job_id,) = await client.submit_many([_job(rng)])
            waiting = asyncio.create_task(client.wait(job_id, timeout=TIMEOUT))
            ticks = 0
            while ticks < 5:
                await asyncio.sleep(0.01)
                ticks += 1
                assert not waiting.done()
            # Only the ticker's own cancel ends the wait.
            assert await client.cancel(job_id) is True
            (record,) = await waiting
        assert record.status is JobStatus.CANCELLED

    asyncio.run(scenario())


def test_a_queued_job_is_cancelled_once(routing_settings: Settings) -> None:
    rng = random.Random(34)

    async def scenario() -> None:
        async with AsyncClient(settings=routing_settings) as client:
            job_id = await client.submit(**_job(rng))
            assert (await client.get(job_id)).status is JobStatus.QUEUED
            assert await client.cancel(job_id) is True
            assert (await client.get(job_id)).status is JobStatus.CANCELLED
            assert await client.cancel(job_id) is False

    asyncio.run(scenario())


def test_a_cancelled_wait_lets_go_of_its_thread_and_leaves_the_job_queued(
        routing_settings: Settings, store: Store) -> None:
    rng = random.Random(35)

    async def scenario() -> None:
        # One thread: the get below can run only once the cancelled wait has let go of it.
        async with AsyncClient(settings=routing_settings, max_threads=1,
                               wait_slice=0.2) as client:
            job_id = await client.submit(**_job(rng))
            waiting = asyncio.create_task(client.wait(job_id))
            await asyncio.to_thread(until, "the wait listening", lambda: _listening(store))
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            record = await asyncio.wait_for(client.get(job_id), timeout=30)
            assert record.status is JobStatus.QUEUED
            assert await client.cancel(job_id) is True

    asyncio.run(scenario())


def test_a_wait_in_slices_times_out_once_at_its_own_timeout(routing_settings: Settings) -> None:
    rng = random.Random(36)

    async def scenario() -> None:
        async with AsyncClient(settings=routing_settings, wait_slice=0.1) as client:
            job_id = await client.submit(**_job(rng))
            with pytest.raises(TimeoutError, match=r"the end of a 0\.5 s wait"):
                await client.wait(job_id, timeout=0.5)
            assert await client.pending([job_id]) == 1
            assert await client.cancel_many([job_id]) == [job_id]

    asyncio.run(scenario())
