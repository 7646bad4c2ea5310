"""The load ledger's and the cache estimate's Redis scripts apply the same rules as the Python
policy the simulator runs: on random sequences of charges, releases (of more than was charged,
too), corrections (over values jobsvc never writes, too), capacity reports and learning, and
routing that fills and trims the cache estimates, both end in the same loads, capacities and
least-recently-used blocks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobsvc.keys import CAPACITY_KEY, LOAD_KEY, cache_key
from jobsvc.routing.feedback import CacheFeedback
from jobsvc.routing.job_cost import DEFAULT_CAPACITY_BLOCKS, RoutingJob
from jobsvc.routing.ledger import LARGEST_LOAD, LoadLedger, load_value
from jobsvc.routing.policies import CacheAwarePolicy
from jobsvc.routing.prefix import DocumentKeys, document_keys
from jobsvc.routing.router import make_router
from jobsvc.settings import Settings
from tests.support.environment import ROUTING_REDIS_URL

pytestmark = pytest.mark.integration

SHARDS = 3
BLOCK = 4

_SETTINGS = Settings.from_env({}, redis_url=ROUTING_REDIS_URL, shards=SHARDS,
                              routing="cache_aware", block_size=BLOCK)

# Values in the load hash that jobsvc never writes, and some it does.
_RAW_VALUES = [b"", b"abc", b"-5", b"1.5", b"0x10", b"1e3", b" 7", b"+7", b"007",
               "\u0663".encode(), str(2**52).encode(), str(2**52 + 1).encode(),
               str(2**70).encode()]

_shard = st.integers(0, SHARDS - 1)
_operations = st.lists(st.one_of(
    st.tuples(st.just("charge"), _shard, st.integers(0, 500)),
    st.tuples(st.just("release"), _shard, st.integers(0, 800)),
    st.tuples(st.just("correct"), _shard, st.none() | st.sampled_from(_RAW_VALUES),
              st.integers(-600, 600), st.integers(0, 1000)),
    st.tuples(st.just("report"), _shard, st.integers(1, 12)),
    st.tuples(st.just("learn"), _shard, st.integers(-8, 8), st.integers(0, 6)),
    st.tuples(st.just("route"), st.integers(0, 5), st.integers(0, 6), st.integers(0, 64)),
), max_size=30)


def _document(index: int, blocks: int) -> DocumentKeys:
    """Six documents whose chains share first blocks in pairs (a common preamble), so that
    routing meets partial overlaps."""
    tokens = [index % 3] * BLOCK + [1000 * (index + 1) + position for position in range(BLOCK * 6)]
    return document_keys(tokens[:BLOCK * blocks + 2], BLOCK)


class _Mirror:
    """The Python side: the policy, plus which load fields Redis holds at all (a correction
    takes a shard without one to its true load, as it does one whose value is unreadable)."""

    def __init__(self) -> None:
        self.policy = CacheAwarePolicy(SHARDS, block_size=BLOCK,
                                       capacity_blocks=DEFAULT_CAPACITY_BLOCKS,
                                       weight=_SETTINGS.routing_load_weight,
                                       epsilon=_SETTINGS.routing_load_slack)
        self.recorded: set[int] = set()

    def correct(self, shard: int, raw: bytes | None, delta: int, true_load: int) -> None:
        policy = self.policy
        if raw is None:
            readable = shard in self.recorded and policy.loads[shard] <= LARGEST_LOAD
        else:
            readable = load_value(raw) is not None
        if raw is not None and readable:
            policy.loads[shard] = load_value(raw) or 0
        if not readable:
            policy.loads[shard] = true_load
        elif delta >= 0:
            policy.charge(shard, delta)
        else:
            policy.job_finished(shard, -delta)
        self.recorded.add(shard)


@pytest.fixture()
def broker() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(ROUTING_REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()


def _redis_state(broker: redis.Redis) -> tuple[list[int | bytes], list[int], list[list[bytes]]]:
    """Loads as written (a number past LARGEST_LOAD too), capacities, blocks oldest first."""
    raw = broker.hgetall(LOAD_KEY)
    capacities = broker.hgetall(CAPACITY_KEY)
    loads = [raw.get(str(shard).encode(), b"0") for shard in range(SHARDS)]
    return ([int(load) if load.isdigit() else load for load in loads],
            [int(capacities.get(str(shard).encode(), DEFAULT_CAPACITY_BLOCKS))
             for shard in range(SHARDS)],
            [broker.zrange(cache_key(shard), 0, -1) for shard in range(SHARDS)])


# Each example empties the Redis database itself.
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=_operations)
def test_redis_scripts_and_the_python_policy_end_in_the_same_state(
        broker: redis.Redis, operations: list[tuple]) -> None:
    broker.flushdb()
    ledger = LoadLedger(broker)
    feedback = CacheFeedback(broker)
    router = make_router(broker, ledger, _SETTINGS)
    mirror = _Mirror()
    policy = mirror.policy
    # Every worker reports its cache size when its engine starts, before it runs a job.
    for shard in range(SHARDS):
        feedback.engine_started(shard, 8)
        policy.set_capacity(shard, 8)
    for step, (kind, *args) in enumerate(operations):
        if kind == "charge":
            shard, tokens = args
            ledger.charge({shard: tokens})
            policy.charge(shard, tokens)
            mirror.recorded.add(shard)
        elif kind == "release":
            shard, tokens = args
            ledger.release({shard: tokens})
            policy.job_finished(shard, tokens)
            if tokens:
                mirror.recorded.add(shard)
        elif kind == "correct":
            shard, raw, delta, true_load = args
            if raw is not None:
                broker.hset(LOAD_KEY, str(shard), raw)
            ledger.correct({shard: (delta, true_load)})
            mirror.correct(shard, raw, delta, true_load)
        elif kind == "report":
            shard, capacity = args
            feedback.engine_started(shard, capacity)
            policy.forget(shard)
            policy.set_capacity(shard, capacity)
        elif kind == "learn":
            shard, error, floor = args
            feedback.jobs_ran({shard: (error, floor)})
            policy.learn(shard, error, floor)
        else:
            index, blocks, decode = args
            job = RoutingJob(_document(index, blocks), BLOCK * blocks + 6, decode)
            routed = router.route([job])
            assert routed == policy.route_jobs([job]), (step, kind, args)
            mirror.recorded.add(routed[0].shard)
        loads, capacities, held = _redis_state(broker)
        assert loads == policy.loads, (step, kind, args)
        assert capacities == policy.capacity, (step, kind, args)
        assert held == [list(blocks) for blocks in policy.held], (step, kind, args)
