"""Routing policies as pure decision logic: no Redis, no engine. The Redis-backed routers and
the simulator both run these."""

from __future__ import annotations

import pytest

from jobsvc.errors import ConfigurationError
from jobsvc.routing.job_cost import Route, RoutingJob, document_demands
from jobsvc.routing.policies import (
    POLICIES,
    POLICY_NAMES,
    AffinityPolicy,
    CacheAwarePolicy,
    Placement,
    RoundRobinPolicy,
    least_loaded,
    make_policy,
    policy_class,
)
from jobsvc.routing.prefix import DocumentKeys, document_keys

pytestmark = pytest.mark.unit

BLOCK = 16
# Chains of four blocks; the ints stand for chained block hashes.
DOC_A = [1, 2, 3, 4]
DOC_B = [11, 12, 13, 14]
DOC_C = [21, 22, 23, 24]
PROMPT = 4 * BLOCK + 8


def cache_aware(shards: int = 4, capacity: int = 100, **options: float) -> CacheAwarePolicy:
    return CacheAwarePolicy(shards, block_size=BLOCK, capacity_blocks=capacity, **options)


def test_round_robin_cycles_through_the_shards_whatever_the_document_and_load() -> None:
    policy = RoundRobinPolicy(3)
    policy.charge(1, 1000)
    assert [policy.choose(DOC_A, PROMPT) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    # Dealing on from where other producers left off.
    dealt_on = RoundRobinPolicy(3, first=7)
    assert [dealt_on.choose(DOC_A, PROMPT) for _ in range(4)] == [1, 2, 0, 1]


def test_affinity_sends_a_new_document_to_the_least_loaded_shard_and_then_sticks() -> None:
    policy = AffinityPolicy(4)
    policy.charge(0, 5)
    policy.charge(2, 3)
    assert policy.choose(DOC_A, PROMPT) == 1
    policy.charge(1, 10_000)
    assert policy.choose(DOC_A, PROMPT) == 1
    assert policy.choose(DOC_B, PROMPT) == 3
    # A document shorter than one block has no prefix to keep; it just goes where load is least.
    policy.charge(3, 1)
    assert policy.choose([], 10) == 3


def test_affinity_places_a_submits_documents_each_with_all_its_jobs_charged() -> None:
    big = document_keys(list(range(100)), 4)
    small = [document_keys([n] * 10, 4) for n in (1, 2, 3)]
    demands = document_demands([RoutingJob(big, 100), *(RoutingJob(doc, 10) for doc in small),
                                RoutingJob(big, 100)])
    policy = AffinityPolicy(2)
    assert policy.place_documents(demands) == [
        Placement(0, True), Placement(1, True), Placement(1, True), Placement(1, True)]
    assert policy.loads == [demands[0].cost_if_new, sum(d.cost_if_new for d in demands[1:])]
    # A document placed before stays put and is charged as known there.
    policy.loads[:] = [0, 1000]
    again = document_demands([RoutingJob(small[0], 10)])
    assert policy.place_documents(again) == [Placement(1, False)]
    assert policy.loads == [0, 1000 + again[0].cost_if_known]
    assert least_loaded([3, 1, 1]) == 1


def test_finished_work_is_released_but_never_below_zero() -> None:
    policy = AffinityPolicy(2)
    policy.charge(0, 100)
    policy.job_finished(0, 60)
    assert policy.loads == [40, 0]
    policy.job_finished(0, 60)
    assert policy.loads == [0, 0]


def test_cache_aware_prefers_the_shard_holding_the_prefix_over_an_idle_one() -> None:
    policy = cache_aware()
    assert policy.choose(DOC_A, PROMPT) == 0
    policy.charge(0, 100)
    # Shard 0 saves 64 prefill tokens and costs 0.25 x 100 of queue: it wins.
    assert policy.choose(DOC_A, PROMPT) == 0
    # A new document goes to the least loaded shard.
    assert policy.choose(DOC_B, PROMPT) == 1


def test_cache_aware_gives_up_the_prefix_when_the_queue_costs_more_than_recomputing() -> None:
    policy = cache_aware()
    policy.choose(DOC_A, PROMPT)
    policy.charge(0, 4 * 64 + 4)
    assert policy.choose(DOC_A, PROMPT) == 1
    # Both shards now hold it; the less loaded one gets it.
    assert policy.choose(DOC_A, PROMPT) == 1


def test_cache_aware_counts_a_shared_leading_part_and_prefers_the_longest() -> None:
    policy = cache_aware(shards=2)
    policy.choose(DOC_A, PROMPT)
    policy.charge(0, 1000)
    edited = [1, 2, 5, 6]  # the same first two blocks as DOC_A, then different text
    assert policy.choose(edited, PROMPT) == 1
    policy.charge(1, 1000)
    assert policy.overlap(0, [1, 2, 3, 9]) == 3
    assert policy.overlap(1, [1, 2, 3, 9]) == 2
    assert policy.choose([1, 2, 3, 9], PROMPT) == 0
    assert policy.choose([1, 2, 5, 7], PROMPT) == 1
    # Overlap is a prefix: later blocks count for nothing once an earlier one is missing.
    assert policy.overlap(0, [99, 2, 3, 4]) == 0


def test_cache_aware_shares_a_preamble_with_a_loaded_shard_rather_than_an_idle_one() -> None:
    policy = cache_aware()
    policy.choose(DOC_A, PROMPT)
    policy.charge(0, 80)
    assert policy.choose([1, 2, 3, 8], PROMPT) == 0


def test_cache_aware_never_picks_a_shard_above_the_load_bound() -> None:
    # With no weight on load, only the bound keeps the holder of a hot prefix from taking all.
    policy = cache_aware(weight=0.0, epsilon=0.25)
    policy.choose(DOC_A, PROMPT)
    policy.charge(0, 300)
    for shard in (1, 2, 3):
        policy.charge(shard, 200)
    # Limit: 1.25 x mean (225) + one prompt (72) = 353.25.
    assert policy.choose(DOC_A, PROMPT) == 0
    # 380 against a limit of 1.25 x 245 + 72 = 378.25.
    policy.charge(0, 80)
    assert policy.choose(DOC_A, PROMPT) == 1


def three_documents_on_shard_0(capacity: int) -> CacheAwarePolicy:
    """Two shards, the second busy, so that DOC_A, DOC_B and DOC_C, in turn, go to the first."""
    policy = cache_aware(shards=2, capacity=capacity)
    policy.charge(1, 10)
    for doc in (DOC_A, DOC_B, DOC_C):
        assert policy.choose(doc, PROMPT) == 0
    return policy


def test_cache_aware_forgets_what_the_cache_can_no_longer_hold() -> None:
    policy = three_documents_on_shard_0(capacity=8)
    assert [policy.overlap(0, doc) for doc in (DOC_A, DOC_B, DOC_C)] == [0, 4, 4]
    policy.charge(0, 20)
    assert policy.choose(DOC_A, PROMPT) == 1
    assert policy.choose(DOC_C, PROMPT) == 0


def test_a_touched_prefix_outlives_its_tail() -> None:
    policy = cache_aware(shards=1, capacity=6)
    policy.choose(DOC_A, PROMPT)
    policy.choose([31, 32], 2 * BLOCK)
    policy.choose([41], BLOCK)
    # The oldest blocks go first, and within a chain the tail is older than the head.
    assert policy.overlap(0, DOC_A) == 3


def test_cache_aware_forgets_reported_evictions_and_restarts() -> None:
    policy = cache_aware()
    policy.choose(DOC_A, PROMPT)
    policy.choose(DOC_B, PROMPT)
    policy.forget(0, [3])
    assert policy.overlap(0, DOC_A) == 2
    policy.forget(1)
    assert policy.overlap(1, DOC_B) == 0
    assert policy.overlap(0, DOC_A) == 2


def test_a_seeded_partial_view_routes_like_the_full_state() -> None:
    # A router sharing its state through Redis loads only the chains at hand, plus how much
    # each shard holds in all: shard 0 holds DOC_A's first two blocks and 30 blocks besides.
    policy = cache_aware(shards=3)
    policy.seed(0, [DOC_A[:2]], total_held=32)
    policy.seed(1, [], total_held=5)
    assert policy.overlap(0, DOC_A) == 2
    assert policy.route(DOC_A, PROMPT) == (0, 2 * BLOCK)
    policy.charge(0, PROMPT)
    # Of the idle shards, the one holding least (counting what was not loaded) gets DOC_B.
    assert policy.route(DOC_B, PROMPT) == (2, 0)


def test_cache_aware_route_tells_the_tokens_expected_cached_on_the_chosen_shard() -> None:
    policy = cache_aware()
    assert policy.route(DOC_A, PROMPT) == (0, 0)
    policy.charge(0, 40)
    assert policy.route([1, 2, 3, 8], PROMPT) == (0, 3 * BLOCK)
    assert policy.route(DOC_B, PROMPT) == (1, 0)


def test_cache_aware_routes_a_submit_job_by_job_charging_each_before_the_next() -> None:
    policy = cache_aware(shards=2)
    keys = DocumentKeys("a", "a", 4 * BLOCK, tuple(DOC_A))
    routes = policy.route_jobs([RoutingJob(keys, PROMPT, 10)] * 3)
    assert routes[:2] == [Route(0, PROMPT, PROMPT + 10), Route(0, 8, 18)]
    assert policy.loads == [sum(route.load for route in routes if route.shard == shard)
                            for shard in range(2)]


def test_cache_aware_learns_from_reports_where_a_document_is_held() -> None:
    policy = cache_aware()
    policy.choose(DOC_A, PROMPT)
    # Another producer sent DOC_A to shard 2, whose worker reports the job it ran there.
    policy.observe(2, DOC_A, cached_tokens=0, expected_tokens=0)
    policy.charge(0, 50)
    assert policy.choose(DOC_A, PROMPT) == 2


def test_cache_aware_learns_the_cache_capacity_from_misses_and_hits() -> None:
    policy = three_documents_on_shard_0(capacity=12)
    # The worker found none of DOC_C cached where four blocks were expected: its cache keeps
    # four blocks fewer than assumed, and the oldest document is forgotten.
    policy.observe(0, DOC_C, cached_tokens=0, expected_tokens=4 * BLOCK)
    assert policy.capacity[0] == 8
    assert [policy.overlap(0, doc) for doc in (DOC_A, DOC_B, DOC_C)] == [0, 4, 4]
    # A longer hit than expected gives the room back, up to the size the worker reported.
    policy.observe(0, DOC_B, cached_tokens=4 * BLOCK, expected_tokens=0)
    policy.observe(0, DOC_B, cached_tokens=4 * BLOCK, expected_tokens=0)
    assert policy.capacity[0] == 12
    policy.set_capacity(0, 4)
    assert policy.capacity[0] == 4
    assert [policy.overlap(0, doc) for doc in (DOC_B, DOC_C)] == [4, 0]


def test_make_policy_builds_every_named_policy_and_refuses_others() -> None:
    assert POLICY_NAMES == tuple(POLICIES) == ("round_robin", "affinity", "cache_aware")
    for name in POLICY_NAMES:
        assert policy_class(name).name == name
        policy = make_policy(name, 8, block_size=BLOCK, capacity_blocks=64)
        assert policy.name == name
        assert policy.loads == [0] * 8
    with pytest.raises(ConfigurationError, match="cache_aware"):
        make_policy("fastest", 8, block_size=BLOCK, capacity_blocks=64)
    with pytest.raises(ConfigurationError, match="at least one shard"):
        make_policy("affinity", 0, block_size=BLOCK, capacity_blocks=64)
