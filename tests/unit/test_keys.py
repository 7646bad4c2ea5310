"""Redis key and queue names: the queue names are public (Flower, metrics, operators)."""

from __future__ import annotations

import fnmatch

import pytest

from jobsvc.keys import ALL_QUEUES_PATTERN, cache_key, queue_name

pytestmark = pytest.mark.unit


def test_shard_queues_keep_their_public_names_and_one_pattern_matches_them_all() -> None:
    assert queue_name(3) == "jobs.shard.3"
    assert all(fnmatch.fnmatchcase(queue_name(shard), ALL_QUEUES_PATTERN) for shard in (0, 12))
    assert not fnmatch.fnmatchcase(cache_key(0), ALL_QUEUES_PATTERN)
