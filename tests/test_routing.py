"""Prefix hashing, demands and placement plans: pure logic."""

from __future__ import annotations

from jobsvc.routing import (
    RoutingJob,
    block_hashes,
    decode_load,
    document_demands,
    document_keys,
    least_loaded,
    plan_from_scratch,
    queue_name,
)


def test_block_hashes_are_chained_so_equal_blocks_after_different_prefixes_differ() -> None:
    a = block_hashes([1, 2, 3, 4, 9, 9], block_size=2)
    b = block_hashes([5, 6, 3, 4, 9, 9], block_size=2)
    assert len(a) == 3
    assert a[1] != b[1] and a[2] != b[2]
    assert block_hashes([1, 2, 3, 4, 7], block_size=2) == a[:2]


def test_partial_last_block_is_not_hashed_into_the_prefix_key() -> None:
    one = document_keys([1, 2, 3, 4, 5], block_size=2)
    two = document_keys([1, 2, 3, 4, 6], block_size=2)
    assert one.prefix_key == two.prefix_key
    assert one.document_key != two.document_key
    assert one.cacheable_tokens == 4


def test_a_document_shorter_than_a_block_still_gets_distinct_keys() -> None:
    short = document_keys([1, 2, 3], block_size=8)
    other = document_keys([1, 2, 4], block_size=8)
    assert short.cacheable_tokens == 0
    assert short.prefix_key != other.prefix_key


def test_demands_charge_the_document_once_and_each_question_its_uncached_part() -> None:
    doc = document_keys(list(range(10)), block_size=4)  # 8 cacheable tokens
    demands = document_demands([RoutingJob(doc, 13), RoutingJob(doc, 12)])
    assert len(demands) == 1
    assert demands[0].cost_if_known == (13 - 8) + (12 - 8)
    assert demands[0].cost_if_new == demands[0].cost_if_known + 8


def test_a_jobs_decode_load_counts_in_its_documents_demand() -> None:
    doc = document_keys(list(range(10)), block_size=4)
    plain = document_demands([RoutingJob(doc, 13), RoutingJob(doc, 12)])[0]
    decoding = document_demands([RoutingJob(doc, 13, 128), RoutingJob(doc, 12, 128)])[0]
    assert decoding.cost_if_known == plain.cost_if_known + 256
    assert decoding.cost_if_new == plain.cost_if_new + 256
    assert decode_load(16, 8.0) == 128
    assert decode_load(16, 0.0) == 0


def test_plan_from_scratch_sends_each_new_document_to_the_least_loaded_shard() -> None:
    big = document_demands([RoutingJob(document_keys(list(range(100)), 4), 100)])
    small = [document_demands([RoutingJob(document_keys([n] * 10, 4), 10)])[0] for n in (1, 2, 3)]
    assert plan_from_scratch([*big, *small], shards=2) == [0, 1, 1, 1]
    assert least_loaded([3, 1, 1]) == 1
    assert queue_name(3) == "jobs.shard.3"
