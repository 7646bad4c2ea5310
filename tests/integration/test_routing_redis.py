"""Shard placement through the shared Redis state, with several producers at once."""

from __future__ import annotations

import random
import threading
from dataclasses import replace

import pytest
import redis

from jobsvc import Client
from jobsvc.keys import CAPACITY_KEY, LOAD_KEY, cache_key, queue_name
from jobsvc.routing.feedback import CacheFeedback
from jobsvc.routing.job_cost import Route, RoutingJob
from jobsvc.routing.ledger import LoadLedger, loads_of
from jobsvc.routing.policies import POLICIES
from jobsvc.routing.prefix import DocumentKeys, document_keys
from jobsvc.routing.router import ROUTERS, Router, make_router, reset_routing_state
from jobsvc.settings import Settings
from jobsvc.workloads import document, question

pytestmark = pytest.mark.integration


def test_all_questions_on_a_document_go_to_one_shard_and_new_documents_spread(
        routing_settings) -> None:
    rng = random.Random(2)
    documents = [document(rng, 150) for _ in range(8)]
    with Client(settings=routing_settings) as client:
        ids = client.submit_many({"document": text, "question": question(rng)}
                                 for _ in range(3) for text in documents)
        records = [client.get(job_id) for job_id in ids]
    shards_of = {}
    for index, record in enumerate(records):
        shards_of.setdefault(documents[index % len(documents)], set()).add(record.shard)
    assert all(len(shards) == 1 for shards in shards_of.values())
    # Eight equal new documents over eight idle shards: the least-loaded rule spreads them.
    assert len({next(iter(shards)) for shards in shards_of.values()}) == 8
    broker = redis.Redis.from_url(routing_settings.redis_url)
    assert sum(broker.llen(queue_name(shard)) for shard in range(8)) >= 8
    assert all(int(value) > 0 for value in broker.hgetall(LOAD_KEY).values())


@pytest.mark.parametrize("policy", ["affinity", "cache_aware"])
def test_racing_producers_agree_on_the_shard_of_a_new_document(routing_settings,
                                                               policy: str) -> None:
    rng = random.Random(4)
    # Long enough that a shard holding one is worth all four producers' questions, decode
    # loads and all.
    texts = [document(rng, 600) for _ in range(12)]
    settings = replace(routing_settings, routing=policy)
    broker = redis.Redis.from_url(settings.redis_url)
    # Busy shards, so that a few more prompts never push one past cache_aware's load bound.
    broker.hset(LOAD_KEY, mapping={str(shard): 100_000 for shard in range(settings.shards)})
    producers = [Client(settings=settings) for _ in range(4)]
    for producer in producers:
        producer.submit("warm-up document for the tokenizer", "warm?")
    placed: dict[int, list[int]] = {index: [] for index in range(len(texts))}
    barrier = threading.Barrier(len(producers))

    def produce(producer: Client) -> None:
        for index, text in enumerate(texts):
            barrier.wait()
            job_id = producer.submit(text, "which shard?")
            placed[index].append(producer.get(job_id).shard)

    threads = [threading.Thread(target=produce, args=(p,)) for p in producers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for producer in producers:
        producer.close()
    assert all(len(shards) == len(producers) for shards in placed.values())
    assert all(len(set(shards)) == 1 for shards in placed.values()), placed


def test_every_policy_has_a_redis_backed_router() -> None:
    assert set(ROUTERS) == set(POLICIES.values())


def _router(settings: Settings, policy: str = "cache_aware", **changes: object) -> Router:
    routed = replace(settings, routing=policy, block_size=4, **changes)
    broker = redis.Redis.from_url(routed.redis_url)
    return make_router(broker, LoadLedger(broker), routed)


def _doc(first: int, blocks: int = 4, body: int | None = None) -> DocumentKeys:
    """A document of `blocks` full 4-token blocks plus two more tokens; equal `first` values
    give equal first blocks (a shared preamble), the body differs with `body`."""
    start = (first if body is None else body) * 1000
    tokens = [first] * 4 + [start + index for index in range(4 * (blocks - 1) + 2)]
    return document_keys(tokens, block_size=4)


def test_cache_aware_routes_later_questions_to_the_shard_holding_the_document(
        routing_settings) -> None:
    router = _router(routing_settings)
    doc = _doc(1)
    first = router.route([RoutingJob(doc, 20)])[0]
    assert first.estimated_prefill == 20
    # Another producer, another submit: the estimate in Redis brings it to the same shard,
    # which is expected to compute only the question tail.
    again = _router(routing_settings).route([RoutingJob(doc, 20)])[0]
    assert again == Route(first.shard, 20 - doc.cacheable_tokens, 20 - doc.cacheable_tokens)
    # A document sharing only its first block goes there too when loads are even, expecting
    # that block cached.
    redis.Redis.from_url(routing_settings.redis_url).delete(LOAD_KEY)
    edited = _doc(1, body=99)
    assert edited.blocks[0] == doc.blocks[0] and edited.blocks[1] != doc.blocks[1]
    assert router.route([RoutingJob(edited, 20)])[0] == Route(first.shard, 20 - 4, 20 - 4)


def test_cache_aware_reads_a_chain_longer_than_one_slice_of_its_read(routing_settings) -> None:
    # 2,500 blocks: the estimate's read takes a held chain's scores 1,000 blocks at a time.
    router = _router(routing_settings)
    redis.Redis.from_url(routing_settings.redis_url).hset(CAPACITY_KEY, mapping={
        str(shard): 10_000 for shard in range(routing_settings.shards)})
    long = _doc(3, blocks=2_500)
    tokens = 4 * 2_500 + 2
    first = router.route([RoutingJob(long, tokens)])[0]
    again = _router(routing_settings).route([RoutingJob(long, tokens)])[0]
    assert again == Route(first.shard, tokens - long.cacheable_tokens,
                          tokens - long.cacheable_tokens)

def test_cache_aware_spreads_a_hot_document_within_one_submit(routing_settings) -> None:
    router = _router(routing_settings)
    hot = _doc(2, blocks=8)
    routes = router.route([RoutingJob(hot, 40)] * 64)
    per_shard = [sum(route.shard == shard for route in routes) for shard in range(8)]
    assert sum(per_shard) == 64 and max(per_shard) < 64
    # Every shard that got the document computes it once and serves its other jobs from cache.
    assert sum(route.estimated_prefill == 40 for route in routes) == sum(
        count > 0 for count in per_shard)
    assert router.plan([RoutingJob(hot, 40)] * 64) == [route.shard for route in routes]


def test_decode_loads_keep_a_hot_documents_shard_from_looking_idle(routing_settings) -> None:
    """A question on a document its shard holds costs little prefill but a whole answer of
    decoding. Charged only the prefill, the hot document's shard looks nearly idle and draws
    the new documents too; charged the decode load as well, both shards get equal work."""
    broker = redis.Redis.from_url(routing_settings.redis_url)
    hot, others = _doc(20, blocks=8), [_doc(30 + index, blocks=8) for index in range(6)]
    decode = 128  # 16 output tokens at 8 prefill tokens each

    def work_per_shard(charged_decode: int) -> list[int]:
        reset_routing_state(broker, 2)
        jobs = ([RoutingJob(hot, 36, charged_decode)] * 12
                + [RoutingJob(doc, 36, charged_decode) for doc in others])
        routes = _router(routing_settings, shards=2).route(jobs)
        loads = loads_of(broker.hgetall(LOAD_KEY), range(2))
        assert loads == [sum(route.load for route in routes if route.shard == shard)
                         for shard in range(2)]
        return [sum(route.estimated_prefill + decode for route in routes
                    if route.shard == shard) for shard in range(2)]

    prefill_only = work_per_shard(0)
    assert max(prefill_only) > 2 * min(prefill_only)
    with_decode = work_per_shard(decode)
    assert max(with_decode) <= 1.1 * min(with_decode)


def test_worker_feedback_sets_and_learns_the_cache_capacity(routing_settings) -> None:
    broker = redis.Redis.from_url(routing_settings.redis_url)
    feedback = CacheFeedback(broker)
    router = _router(routing_settings, shards=1)
    feedback.engine_started(0, capacity_blocks=10)
    router.route([RoutingJob(_doc(3), 20), RoutingJob(_doc(4), 20)])
    assert broker.zcard(cache_key(0)) == 8
    # Jobs found 5 blocks fewer cached than expected: the cache keeps less than estimated,
    # so the router shrinks its capacity and forgets the least recently used blocks.
    feedback.jobs_ran({0: (5, 4)})
    assert int(broker.hget(CAPACITY_KEY, "0")) == 5
    assert broker.zcard(cache_key(0)) == 5
    # Never below the longest chain seen, never above the reported size.
    feedback.jobs_ran({0: (50, 4)})
    assert int(broker.hget(CAPACITY_KEY, "0")) == 4
    feedback.jobs_ran({0: (-50, 4)})
    assert int(broker.hget(CAPACITY_KEY, "0")) == 10
    # A restarted engine holds nothing.
    feedback.engine_started(0, capacity_blocks=12)
    assert broker.zcard(cache_key(0)) == 0
    assert router.route([RoutingJob(_doc(3), 20)])[0].estimated_prefill == 20


def test_concurrent_cache_aware_producers_lose_no_state(routing_settings) -> None:
    documents = [_doc(10 + index) for index in range(48)]
    routes: dict[int, Route] = {}

    def produce(start: int) -> None:
        router = _router(routing_settings)
        for index in range(start, len(documents), 4):
            routes[index] = router.route([RoutingJob(documents[index], 20)])[0]

    threads = [threading.Thread(target=produce, args=(start,)) for start in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    broker = redis.Redis.from_url(routing_settings.redis_url)
    loads = broker.hgetall(LOAD_KEY)
    assert sum(int(value) for value in loads.values()) == 48 * 20
    for index, route in routes.items():
        held = broker.zmscore(cache_key(route.shard), list(documents[index].blocks))
        assert all(score is not None for score in held)
    # Equal documents over idle shards: the load term spreads them evenly.
    per_shard = [sum(route.shard == shard for route in routes.values()) for shard in range(8)]
    assert max(per_shard) - min(per_shard) <= 1


def test_round_robin_deals_jobs_in_turn_across_producers(routing_settings) -> None:
    first, second = _router(routing_settings, "round_robin"), _router(routing_settings,
                                                                        "round_robin")
    doc = _doc(5)
    shards = [route.shard for route in first.route([RoutingJob(doc, 20)] * 5)]
    shards += [route.shard for route in second.route([RoutingJob(doc, 20)] * 5)]
    assert shards == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
