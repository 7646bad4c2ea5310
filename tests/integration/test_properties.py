"""Property-based checks of the producer API: every input is either accepted (and then
recorded, enqueued and acceptable to the engine's sampling parameters) or refused with
InvalidJob, leaving nothing behind; never any other error."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from jobsvc import Client, InvalidJob, JobStatus
from jobsvc.keys import ALL_QUEUES_PATTERN
from jobsvc.store import Store
from jobsvc.store.tables import Job
from jobsvc.validation import SAMPLING_KEYS, JobLimits, validate_job

pytestmark = pytest.mark.integration

LIMITS = JobLimits(max_document_chars=5000, max_question_chars=500, max_stop_chars=1000,
                   max_job_bytes=1 << 20, priority_scheduling=False)

anything = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.binary(max_size=10), st.lists(st.text(max_size=5), max_size=3))
texts = st.one_of(st.text(max_size=300), anything)
sampling = st.dictionaries(
    st.one_of(st.sampled_from(sorted(SAMPLING_KEYS)), st.text(max_size=8)),
    st.one_of(anything, st.integers(0, 64), st.floats(0, 2)), max_size=4)


@given(document=texts, question=texts, options=sampling)
@settings(max_examples=400, deadline=None)
def test_validation_accepts_or_refuses_with_invalid_job_only(
        document: Any, question: Any, options: dict[str, Any]) -> None:
    try:
        job = validate_job({**options, "document": document, "question": question}, LIMITS)
    except InvalidJob:
        return
    from vllm import SamplingParams

    # Whatever we accept, the engine accepts too.
    SamplingParams(**job.sampling)
    assert isinstance(job.document, str) and job.document.strip()


def _trace(store: Store, url: str) -> tuple[int, int]:
    with store.engine.connect() as connection:
        jobs = connection.execute(select(func.count()).select_from(Job)).scalar_one()
    broker = redis.Redis.from_url(url)
    return jobs, sum(broker.llen(key) for key in broker.keys(ALL_QUEUES_PATTERN))


@given(document=texts, question=texts, options=sampling)
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_submit_either_records_and_enqueues_or_refuses_leaving_no_trace(
        routing_settings, document: Any, question: Any, options: dict[str, Any]) -> None:
    store = Store(routing_settings.resolved_database_url)
    with Client(settings=routing_settings) as client:
        jobs_before, queued_before = _trace(store, routing_settings.redis_url)
        try:
            (job_id,) = client.submit_many([{"document": document, "question": question,
                                             **options}])
        except InvalidJob:
            assert _trace(store, routing_settings.redis_url) == (jobs_before, queued_before)
        else:
            assert client.get(job_id).status is JobStatus.QUEUED
            assert _trace(store, routing_settings.redis_url) == (jobs_before + 1,
                                                                 queued_before + 1)
    store.dispose()
