"""Routers: the policies of `routing.policies` applied to one submit's jobs, with their state
in Redis so that any number of producers route as one. Each router loads its policy's state
from Redis, lets the pure policy decide, and writes the state back.

Every router charges the shards' load ledger (`routing.ledger`) with each job's load (its
estimated prefill plus its decode load), which workers return when the job ends.
`cache_aware` also keeps, per shard, the block hashes its KV cache is estimated to hold (a
sorted set scored by recency, trimmed to the capacity the shard's worker reported and the
router has learned); a producer holds a short Redis lock while it reads that state, decides
and writes it back, so two producers never decide on stale state. `plan` gives the choices a
router makes on an idle cluster with empty caches, without Redis: the benchmark's standalone
arm follows it.

Routers route to the live shards (`routing.live`): each policy decides over indices 0..n-1 of
the live set, and the router maps index i to the i-th live shard number.
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import redis

from jobsvc.errors import BrokerUnavailable
from jobsvc.keys import (
    AFFINITY_KEY,
    CACHE_CLOCK_KEY,
    CAPACITY_KEY,
    LOAD_KEY,
    REPORTED_CAPACITY_KEY,
    ROUND_ROBIN_KEY,
    ROUTING_LOCK_KEY,
    cache_key,
)
from jobsvc.routing.affinity import AffinityMap
from jobsvc.routing.job_cost import (
    DEFAULT_CAPACITY_BLOCKS,
    DocumentDemand,
    Route,
    RoutingJob,
    document_demands,
    estimated_routes,
    loads_per_shard,
)
from jobsvc.routing.ledger import LoadLedger, loads_of
from jobsvc.routing.live import LiveShards, ModelShards
from jobsvc.routing.policies import (
    AffinityPolicy,
    CacheAwarePolicy,
    Placement,
    RoundRobinPolicy,
    RoutingPolicy,
    policy_class,
)
from jobsvc.settings import Settings

log = logging.getLogger(__name__)

# Longest a producer holds the routing lock (routing a large submit takes milliseconds).
_LOCK_SECONDS = 10
# A producer that finds the lock held tries again after this pause, doubling up to the last.
_FIRST_LOCK_PAUSE = 0.0005
_LAST_LOCK_PAUSE = 0.05
# Gives back the routing lock only if this producer's token still holds it.
_RELEASE_SCRIPT = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class Router(ABC):
    """A policy made shared: any number of producers route through the state in Redis as one router
    would, and charge the same load counters."""

    def __init__(self, client: redis.Redis, ledger: LoadLedger, settings: Settings) -> None:
        self._redis = client
        self._ledger = ledger
        self.shards = settings.shards
        self.settings = settings
        self._live = LiveShards(client, settings.shards)

    @abstractmethod
    def route(self, jobs: Sequence[RoutingJob], model: str | None = None) -> list[Route]:
        """Pick a shard per job among those of `model` (None: the settings' served model)
        from the shared state, and charge the shards."""

    @abstractmethod
    def plan(self, jobs: Sequence[RoutingJob]) -> list[int]:
        """The shards `route` picks for these jobs on an idle cluster of the configured shards
        with empty caches."""

    def model_shards(self, model: str | None = None) -> ModelShards:
        """The shards `model`'s jobs go to now (None: the settings' served model), and whether
        a live worker serves it there (read at most every `LIVE_SET_SECONDS`)."""
        return self._live.shards(self.settings.served_model_name if model is None else model)

    def live_shards(self, model: str | None = None) -> tuple[int, ...]:
        """The shards this router routes `model`'s jobs to now."""
        return self.model_shards(model).shards


class RoundRobinRouter(Router):
    """`RoundRobinPolicy` dealing from one count of jobs that all producers share."""

    def route(self, jobs: Sequence[RoutingJob], model: str | None = None) -> list[Route]:
        """Deal the jobs in turn over the live shards, from the count all producers share."""
        live = self.live_shards(model)
        end = int(self._redis.incrby(ROUND_ROBIN_KEY, len(jobs)))
        routes = _on_shards(_deal(RoundRobinPolicy(len(live), first=end - len(jobs)), jobs), live)
        self._ledger.charge(loads_per_shard((route.shard, route.load) for route in routes))
        return routes

    def plan(self, jobs: Sequence[RoutingJob]) -> list[int]:
        """The shards a fresh count would deal these jobs to."""
        return [route.shard for route in _deal(RoundRobinPolicy(self.shards), jobs)]


class AffinityRouter(Router):
    """`AffinityPolicy` over the affinity map (`AffinityMap`) and the loads in Redis, placing
    one submit's documents in one read and one write."""

    def __init__(self, client: redis.Redis, ledger: LoadLedger, settings: Settings) -> None:
        super().__init__(client, ledger, settings)
        self._affinity = AffinityMap(client, ledger)

    def route(self, jobs: Sequence[RoutingJob], model: str | None = None) -> list[Route]:
        """Place each document on the live shard that holds it, or on the least loaded one if new,
        and claim the new placements; a race lost to another producer takes its shard."""
        live = self.live_shards(model)
        demands = document_demands(jobs)
        placed, departed, loads = self._affinity.placements_and_loads(
            [demand.prefix_key for demand in demands], live)
        index = {shard: position for position, shard in enumerate(live)}
        policy = AffinityPolicy(len(live))
        policy.loads[:] = loads
        policy.shard_of.update({key: index[shard] for key, shard in placed.items()})
        chosen = [replace(placement, shard=live[placement.shard])
                  for placement in policy.place_documents(demands)]
        placements = self._affinity.claim(demands, chosen, departed)
        return _placed_routes(jobs, demands, placements)

    def plan(self, jobs: Sequence[RoutingJob]) -> list[int]:
        """The shards a fresh affinity map would place these jobs on."""
        demands = document_demands(jobs)
        placements = AffinityPolicy(self.shards).place_documents(demands)
        return [route.shard for route in _placed_routes(jobs, demands, placements)]


class CacheAwareRouter(Router):
    """`CacheAwarePolicy` seeded with the part of the shared cache estimate that the submit's
    chains touch, under the routing lock."""

    def route(self, jobs: Sequence[RoutingJob], model: str | None = None) -> list[Route]:
        """Route the jobs on the shards' cache estimates under the routing lock, so two producers
        never decide on the same stale estimate. The lock is taken in the round trip that reads
        the estimate and given back in the one that writes it."""
        live = self.live_shards(model)
        token = uuid.uuid4().hex.encode()
        policy, clock = self._load(jobs, live, token)
        try:
            routes = _on_shards(policy.route_jobs(jobs), live)
            released = self._save(jobs, routes, clock, dict(zip(live, policy.capacity,
                                                                strict=True)), token)
        except BaseException:
            self._redis.eval(_RELEASE_SCRIPT, 1, ROUTING_LOCK_KEY, token)
            raise
        if not released:
            # Held past its timeout: another producer may have routed on the state this one
            # was about to write, which costs a cache miss, never a job.
            log.warning("routing took over %d s; the routing lock had expired", _LOCK_SECONDS)
        return routes

    def plan(self, jobs: Sequence[RoutingJob]) -> list[int]:
        """The shards the policy picks for these jobs on empty caches."""
        return [route.shard for route in self._policy(self.shards).route_jobs(jobs)]

    def _policy(self, shards: int) -> CacheAwarePolicy:
        return CacheAwarePolicy(shards, block_size=self.settings.block_size,
                                capacity_blocks=DEFAULT_CAPACITY_BLOCKS,
                                weight=self.settings.routing_load_weight,
                                epsilon=self.settings.routing_load_slack)

    def _load(self, jobs: Sequence[RoutingJob], live: Sequence[int], token: bytes
              ) -> tuple[CacheAwarePolicy, int]:
        """Take the routing lock under `token`, then the policy over the live shards (by index)
        seeded with what they hold of these jobs' chains, their loads and capacities; and the
        recency clock reserved for the blocks this submit touches.
        Two round trips: the lock and everything but the chains, then the chains whose first
        block a shard holds. A producer that finds the lock held waits for it with the lock's
        command alone, then reads (what it read beside the refused lock may be stale)."""
        chains = list({job.keys.blocks: None for job in jobs if job.keys.blocks})
        firsts = [chain[0] for chain in chains]
        touched = sum(len(job.keys.blocks) for job in jobs)
        state = self._read_state(live, firsts, touched, lock=token)
        if state is None:
            self._wait_for_lock(token)
            state = self._read_state(live, firsts, touched, lock=None)
        assert state is not None
        clock, capacities, loads, per_shard = state
        try:
            return self._seeded(live, chains, firsts, capacities, loads, per_shard), (
                int(clock) - touched)
        except BaseException:
            self._redis.eval(_RELEASE_SCRIPT, 1, ROUTING_LOCK_KEY, token)
            raise

    def _read_state(self, live: Sequence[int], firsts: list[bytes], touched: int, *,
                    lock: bytes | None) -> tuple[Any, Any, Any, list[Any]] | None:
        """The recency clock reserved for `touched` blocks, capacities, loads and each live
        shard's size and first blocks held, in one round trip; taking the routing lock under
        `lock` first if given, and None (nothing reserved) if another producer holds it."""
        with self._redis.pipeline(transaction=False) as pipe:
            if lock is not None:
                pipe.set(ROUTING_LOCK_KEY, lock, nx=True, px=_LOCK_SECONDS * 1000)
            pipe.incrby(CACHE_CLOCK_KEY, touched)
            pipe.hgetall(CAPACITY_KEY)
            pipe.hgetall(LOAD_KEY)
            for shard in live:
                pipe.zcard(cache_key(shard))
                if firsts:
                    pipe.zmscore(cache_key(shard), firsts)
            replies = pipe.execute()
        if lock is not None:
            locked, *replies = replies
            if not locked:
                return None
        clock, capacities, loads, *per_shard = replies
        return clock, capacities, loads, per_shard

    def _wait_for_lock(self, token: bytes) -> None:
        """Take the routing lock under `token` once the producer holding it lets go, or raise
        BrokerUnavailable after `_LOCK_SECONDS`."""
        deadline = time.monotonic() + _LOCK_SECONDS
        pause = _FIRST_LOCK_PAUSE
        while not self._redis.set(ROUTING_LOCK_KEY, token, nx=True, px=_LOCK_SECONDS * 1000):
            if time.monotonic() > deadline:
                raise BrokerUnavailable(
                    f"another producer held the routing lock for {_LOCK_SECONDS} s; nothing "
                    "was enqueued, submit again")
            time.sleep(pause)
            pause = min(pause * 2, _LAST_LOCK_PAUSE)

    def _seeded(self, live: Sequence[int], chains: list[tuple[bytes, ...]],
                firsts: list[bytes], capacities: Mapping[bytes, bytes],
                loads: Mapping[bytes, bytes], per_shard: list[Any]) -> CacheAwarePolicy:
        """The policy seeded from what the lock's round trip read, reading the chains whose
        first block a shard holds."""
        step = 2 if firsts else 1
        sizes = per_shard[0::step]
        candidates = [(index, chain) for index in range(len(live)) if firsts
                      for chain, score in zip(chains, per_shard[index * step + 1], strict=True)
                      if score is not None]
        with self._redis.pipeline(transaction=False) as pipe:
            for index, chain in candidates:
                pipe.zmscore(cache_key(live[index]), list(chain))
            scores = pipe.execute() if candidates else []
        policy = self._policy(len(live))
        policy.loads[:] = loads_of(loads, live)
        for index, shard in enumerate(live):
            learned = capacities.get(str(shard).encode())
            if learned is not None:
                policy.set_capacity(index, int(learned))
        held: dict[int, list[tuple[float, tuple[bytes, ...]]]] = {}
        for (index, chain), chain_scores in zip(candidates, scores, strict=True):
            leading = _leading_held(chain_scores)
            held.setdefault(index, []).append((chain_scores[0], chain[:leading]))
        for index in range(len(live)):
            prefixes = [prefix for _, prefix in sorted(held.get(index, ()))]
            policy.seed(index, prefixes, int(sizes[index]))
        return policy

    def _save(self, jobs: Sequence[RoutingJob], routes: Sequence[Route], clock: int,
              capacity: Mapping[int, int], token: bytes) -> bool:
        """Write the touched chains with fresh recency (a chain's first block the freshest, as
        the engine frees a request's blocks tail first), trim each shard to its capacity,
        charge the loads and give back the routing lock `token` holds; returns whether the
        lock was still held."""
        recency: dict[int, dict[bytes, int]] = {}
        for job, route in zip(jobs, routes, strict=True):
            scores = recency.setdefault(route.shard, {})
            for block in reversed(job.keys.blocks):
                clock += 1
                scores[block] = clock
        with self._redis.pipeline(transaction=False) as pipe:
            for shard, scores in recency.items():
                if scores:
                    pipe.zadd(cache_key(shard), scores)
                    pipe.zremrangebyrank(cache_key(shard), 0, -capacity[shard] - 1)
            self._ledger.charge(loads_per_shard((route.shard, route.load) for route in routes),
                                pipe=pipe)
            pipe.eval(_RELEASE_SCRIPT, 1, ROUTING_LOCK_KEY, token)
            return bool(pipe.execute()[-1])


def reset_routing_state(client: redis.Redis, shards: int) -> None:
    """Forget every routing decision and load (the benchmark starts each burst from idle shards
    with empty caches); reported capacities stay."""
    reported = client.hgetall(REPORTED_CAPACITY_KEY)
    with client.pipeline(transaction=True) as pipe:
        pipe.delete(ROUND_ROBIN_KEY, CACHE_CLOCK_KEY, CAPACITY_KEY, AFFINITY_KEY, LOAD_KEY,
                    *(cache_key(shard) for shard in range(shards)))
        if reported:
            pipe.hset(CAPACITY_KEY, mapping=reported)
        pipe.execute()


def forget_shard(client: redis.Redis, shard: int) -> None:
    """Forget what routing knows of a shard that left the fleet: its load, its cache estimate
    and capacities, and every affinity entry naming it (one pass over the affinity map; a
    producer that placed a document there meanwhile loses nothing, the document is placed
    anew at its next submit)."""
    name = str(shard)
    with client.pipeline(transaction=True) as pipe:
        pipe.hdel(LOAD_KEY, name)
        pipe.delete(cache_key(shard))
        pipe.hdel(CAPACITY_KEY, name)
        pipe.hdel(REPORTED_CAPACITY_KEY, name)
        pipe.execute()
    named = name.encode()
    stale = [key for key, value in client.hscan_iter(AFFINITY_KEY, count=10_000)
             if value == named]
    for start in range(0, len(stale), 10_000):
        client.hdel(AFFINITY_KEY, *stale[start:start + 10_000])


# The Redis-backed router of each policy.
ROUTERS: dict[type[RoutingPolicy], type[Router]] = {
    RoundRobinPolicy: RoundRobinRouter,
    AffinityPolicy: AffinityRouter,
    CacheAwarePolicy: CacheAwareRouter,
}


def make_router(client: redis.Redis, ledger: LoadLedger, settings: Settings) -> Router:
    """The router for `settings.routing` (already validated by `Settings`)."""
    return ROUTERS[policy_class(settings.routing)](client, ledger, settings)


def _deal(policy: RoundRobinPolicy, jobs: Sequence[RoutingJob]) -> list[Route]:
    shards = [policy.choose(job.keys.blocks, job.prompt_tokens) for job in jobs]
    return estimated_routes(jobs, shards, held=frozenset())


def _on_shards(routes: Sequence[Route], live: Sequence[int]) -> list[Route]:
    """Routes a policy chose by live-set index, with the shard numbers they stand for."""
    return [replace(route, shard=live[route.shard]) for route in routes]


def _placed_routes(jobs: Sequence[RoutingJob], demands: Sequence[DocumentDemand],
                   placements: Sequence[Placement]) -> list[Route]:
    """Each job goes where its document was placed; documents known there before are held."""
    by_key = dict(zip((demand.prefix_key for demand in demands), placements, strict=True))
    shards = [by_key[job.keys.prefix_key].shard for job in jobs]
    held = frozenset((placement.shard, key) for key, placement in by_key.items()
                     if not placement.is_new)
    return estimated_routes(jobs, shards, held)


def _leading_held(scores: Sequence[float | None]) -> int:
    for index, score in enumerate(scores):
        if score is None:
            return index
    return len(scores)
