"""The `structured` workload asks both arms for the same constraint: the service stores it
from each job's `response_format`, and the standalone arm hands its engine SamplingParams made
from that same stored sampling by the workers' own function."""

from __future__ import annotations

import pytest
from vllm.sampling_params import StructuredOutputsParams

from jobsvc.bench.options import STRUCTURED_SCHEMA, BenchOptions, bench_jobs, output_tokens
from jobsvc.bench.standalone import as_job, engine_sampling
from jobsvc.settings import Settings
from jobsvc.validation import validate_job
from jobsvc.workers.engine import sampling_params

pytestmark = pytest.mark.bench


def test_structured_jobs_are_the_reuse_jobs_each_asking_for_the_schema() -> None:
    structured = bench_jobs(BenchOptions(workload="structured", words=30), trial=1)
    reuse = bench_jobs(BenchOptions(workload="reuse", words=30), trial=1)
    assert ([(job["document"], job["question"]) for job in structured]
            == [(job["document"], job["question"]) for job in reuse])
    for job in structured:
        assert job["response_format"] == {
            "type": "json_schema",
            "json_schema": {"name": "verdict", "schema": STRUCTURED_SCHEMA, "strict": True}}
        # Random weights close the enumerated object only when they sample, and past the
        # end of the object only the end of sequence fits.
        assert job["temperature"] == 1.0 and "ignore_eos" not in job
    # A seed per job: both arms of a pair sample the same answers.
    assert len({job["seed"] for job in structured}) == len(structured)
    assert output_tokens(BenchOptions(workload="structured")) is None


def test_the_standalone_arm_hands_the_engine_the_constraint_the_service_stores() -> None:
    limits = Settings.from_env({}).job_limits
    jobs = bench_jobs(BenchOptions(workload="structured", words=30), trial=2)[:8]
    # What `Client.submit_many` stores for each job, and what a worker builds from it.
    stored = [validate_job(job, limits).sampling for job in jobs]
    assert all(sampling["structured_outputs"] == {"json": STRUCTURED_SCHEMA}
               for sampling in stored)
    service = [sampling_params(sampling) for sampling in stored]

    standalone_jobs = [as_job(job, limits) for job in jobs]
    assert [sampling for _, _, sampling in standalone_jobs] == stored
    standalone = list(engine_sampling(sampling for _, _, sampling in standalone_jobs).values())

    assert len(standalone) == len(service)
    for ours, theirs in zip(standalone, service, strict=True):
        assert ours.structured_outputs == theirs.structured_outputs
        assert ours.structured_outputs == StructuredOutputsParams(json=STRUCTURED_SCHEMA)
        assert (ours.seed, ours.temperature, ours.max_tokens, ours.ignore_eos) == (
            theirs.seed, theirs.temperature, theirs.max_tokens, theirs.ignore_eos)
