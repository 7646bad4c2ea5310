"""The demo's workload over two models: each document's questions go to one model, and the
models take the documents in turn."""

from __future__ import annotations

import pytest

from jobsvc.demo import demo_jobs
from jobsvc.workloads import document_questions

pytestmark = pytest.mark.unit


def test_each_document_goes_to_one_model_and_the_models_take_turns() -> None:
    work = document_questions(6, 3, 40, seed=5)
    jobs = demo_jobs(work, ["jobsvc", "jobsvc-b"])
    model_of: dict[str, set[str]] = {}
    for job in jobs:
        model_of.setdefault(job["document"], set()).add(job["model"])
    assert all(len(models) == 1 for models in model_of.values())
    assert sorted(next(iter(models)) for models in model_of.values()) == (
        ["jobsvc"] * 3 + ["jobsvc-b"] * 3)
    assert [job["question"] for job in jobs] == [job.question for job in work]


def test_one_model_takes_every_job() -> None:
    work = document_questions(2, 2, 40, seed=6)
    assert {job["model"] for job in demo_jobs(work, ["jobsvc"])} == {"jobsvc"}
