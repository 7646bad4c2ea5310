"""What routing a job costs its shard: demands, decode loads, estimated prefill, charges."""

from __future__ import annotations

import pytest

from jobsvc.routing.job_cost import (
    Route,
    RoutingJob,
    decode_load,
    document_demands,
    estimated_routes,
    loads_per_shard,
)
from jobsvc.routing.prefix import document_keys

pytestmark = pytest.mark.unit


def test_demands_charge_the_document_once_and_each_question_its_uncached_part() -> None:
    doc = document_keys(list(range(10)), block_size=4)  # 8 cacheable tokens
    demands = document_demands([RoutingJob(doc, 13), RoutingJob(doc, 12)])
    assert len(demands) == 1
    assert demands[0].cost_if_known == (13 - 8) + (12 - 8)
    assert demands[0].cost_if_new == demands[0].cost_if_known + 8
    assert demands[0].cost(is_new=True) == demands[0].cost_if_new
    assert demands[0].cost(is_new=False) == demands[0].cost_if_known


def test_a_jobs_decode_load_counts_in_its_documents_demand() -> None:
    doc = document_keys(list(range(10)), block_size=4)
    plain = document_demands([RoutingJob(doc, 13), RoutingJob(doc, 12)])[0]
    decoding = document_demands([RoutingJob(doc, 13, 128), RoutingJob(doc, 12, 128)])[0]
    assert decoding.cost_if_known == plain.cost_if_known + 256
    assert decoding.cost_if_new == plain.cost_if_new + 256
    assert decode_load(16, 8.0) == 128
    assert decode_load(16, 0.0) == 0


def test_a_document_is_prefilled_whole_once_per_shard_unless_the_shard_held_it() -> None:
    doc = document_keys(list(range(10)), block_size=4)  # 8 cacheable tokens
    jobs = [RoutingJob(doc, 13, 5)] * 3
    assert estimated_routes(jobs, [0, 1, 0], held=frozenset()) == [
        Route(0, 13, 18), Route(1, 13, 18), Route(0, 5, 10)]
    assert estimated_routes(jobs, [1, 1, 0], held=frozenset({(1, doc.prefix_key)})) == [
        Route(1, 5, 10), Route(1, 5, 10), Route(0, 13, 18)]


def test_loads_are_summed_per_shard_in_first_seen_order() -> None:
    assert loads_per_shard([(2, 5), (0, 1), (2, 7)]) == {2: 12, 0: 1}
    assert list(loads_per_shard([(2, 5), (0, 1)])) == [2, 0]
    assert loads_per_shard([]) == {}
