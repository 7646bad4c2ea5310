"""The uneven-popularity workload: deterministic, skewed, in range, and readable as a bench file."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from itertools import pairwise
from pathlib import Path

import pytest

from jobsvc.workloads import (
    document_questions,
    popularity_counts,
    read_jsonl_jobs,
    uneven_jobs,
    write_jsonl_jobs,
)

pytestmark = pytest.mark.unit


def test_popularity_counts_cover_every_job_most_asked_first() -> None:
    counts = popularity_counts(256, 96)
    assert sum(counts) == 256 and len(counts) == 96
    assert min(counts) == 1
    assert counts == sorted(counts, reverse=True)


@pytest.mark.parametrize(("jobs", "documents"), [(10, 0), (10, 11)])
def test_popularity_counts_refuse_impossible_shapes(jobs: int, documents: int) -> None:
    with pytest.raises(ValueError, match="documents"):
        popularity_counts(jobs, documents)


def test_uneven_jobs_are_the_same_for_the_same_seed() -> None:
    assert uneven_jobs(jobs=40, documents=12, seed=5) == uneven_jobs(jobs=40, documents=12, seed=5)
    assert uneven_jobs(jobs=40, documents=12, seed=5) != uneven_jobs(jobs=40, documents=12, seed=6)


def test_a_few_documents_draw_most_questions_and_most_are_asked_once_or_twice() -> None:
    popularity = Counter(job.document for job in uneven_jobs())
    ranked = [count for _, count in popularity.most_common()]
    assert len(ranked) == 96 and sum(ranked) == 256
    assert ranked[0] >= 32 and sum(ranked[:5]) >= 256 // 3
    assert sum(count <= 2 for count in ranked) >= len(ranked) * 3 // 4


def test_document_lengths_spread_over_the_word_range() -> None:
    words = sorted({len(job.document.split()) for job in uneven_jobs(words=(110, 820))})
    # A document ends at the end of a sentence, which runs up to 17 words past the target.
    assert words[0] >= 110 and words[-1] <= 820 + 17
    assert words[0] < 200 and words[-1] > 700


def test_questions_of_a_document_are_spread_over_the_burst() -> None:
    jobs = uneven_jobs()
    hottest = Counter(job.document for job in jobs).most_common(1)[0][0]
    positions = [index for index, job in enumerate(jobs) if job.document == hottest]
    assert positions[-1] - positions[0] > len(jobs) // 2
    repeats = sum(a.document == b.document for a, b in pairwise(jobs))
    assert repeats < len(jobs) // 10


def test_written_jobs_read_back_as_bench_jobs(tmp_path: Path) -> None:
    jobs = uneven_jobs(jobs=30, documents=10, words=(20, 40))
    path = tmp_path / "workloads" / "uneven.jsonl"
    write_jsonl_jobs(path, jobs)
    assert read_jsonl_jobs(path) == [asdict(job) for job in jobs]


def test_document_questions_ask_every_document_once_per_round_in_varying_order() -> None:
    jobs = document_questions(8, 3, 20, seed=5)
    rounds = [jobs[start:start + 8] for start in range(0, 24, 8)]
    documents = {job.document for job in jobs}
    assert len(documents) == 8
    assert all({job.document for job in batch} == documents for batch in rounds)
    orders = [[job.document for job in batch] for batch in rounds]
    assert orders[0] != orders[1] or orders[1] != orders[2]
    # Round robin over 2 shards no longer keeps every document on one shard by accident.
    shards_of = {doc: {index % 2 for index, job in enumerate(jobs) if job.document == doc}
                 for doc in documents}
    assert any(len(shards) == 2 for shards in shards_of.values())
