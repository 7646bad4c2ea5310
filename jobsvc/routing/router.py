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
from functools import cached_property
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
# What cache-aware routing reads, in one round trip: the routing lock taken (unless ARGV[1] is
# empty: already held), the recency clock advanced by the blocks the submit touches, the
# capacities and loads, and per live shard its estimate's size and, for each of the submit's
# chains whose first block the shard holds, every block's score (false where it holds none).
# KEYS: lock, clock, capacities, loads, then the live shards' estimates.
# ARGV: token, lock milliseconds, blocks touched, number of chains, then each chain's length
# and blocks.
_READ_SCRIPT = """
if ARGV[1] ~= '' and not redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return false
end
local reply = {redis.call('incrby', KEYS[2], ARGV[3]), redis.call('hgetall', KEYS[3]),
               redis.call('hgetall', KEYS[4])}
local starts, lengths, firsts, at = {}, {}, {}, 5
for c = 1, tonumber(ARGV[4]) do
  lengths[c] = tonumber(ARGV[at])
  starts[c] = at + 1
  firsts[c] = ARGV[at + 1]
  at = at + lengths[c] + 1
end
-- The scores of members from..to of `list` in `key`, 1,000 at a time (Lua's unpack is bounded).
local function scores(key, list, from, to)
  local found = {}
  for first = from, to, 1000 do
    local part = redis.call('zmscore', key, unpack(list, first, math.min(first + 999, to)))
    for k = 1, #part do found[#found + 1] = part[k] end
  end
  return found
end
for s = 5, #KEYS do
  local held = {redis.call('zcard', KEYS[s])}
  local heads = scores(KEYS[s], firsts, 1, #firsts)
  for c = 1, #starts do
    held[#held + 1] = heads[c] and scores(KEYS[s], ARGV, starts[c], starts[c] + lengths[c] - 1)
  end
  reply[#reply + 1] = held
end
return reply
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
        recency clock reserved for the blocks this submit touches. One round trip
        (`_READ_SCRIPT`); a producer that finds the lock held waits for it with the lock's
        command alone, then reads."""
        chains = list({job.keys.blocks: None for job in jobs if job.keys.blocks})
        touched = sum(len(job.keys.blocks) for job in jobs)
        state = self._read_state(live, chains, touched, lock=token)
        if state is None:
            self._wait_for_lock(token)
            state = self._read_state(live, chains, touched, lock=None)
        assert state is not None
        try:
            clock, capacities, loads, *per_shard = state
            return self._seeded(live, chains, _pairs(capacities), _pairs(loads),
                                per_shard), int(clock) - touched
        except BaseException:
            self._redis.eval(_RELEASE_SCRIPT, 1, ROUTING_LOCK_KEY, token)
            raise

    def _read_state(self, live: Sequence[int], chains: list[tuple[bytes, ...]], touched: int,
                    *, lock: bytes | None) -> list[Any] | None:
        """What `_READ_SCRIPT` reads, taking the routing lock under `lock` first if given; None
        (nothing reserved) if another producer holds it."""
        arguments: list[bytes | int] = [lock or b"", _LOCK_SECONDS * 1000, touched, len(chains)]
        for chain in chains:
            arguments.append(len(chain))
            arguments.extend(chain)
        reply = self._read(keys=[ROUTING_LOCK_KEY, CACHE_CLOCK_KEY, CAPACITY_KEY, LOAD_KEY,
                                 *(cache_key(shard) for shard in live)], args=arguments)
        return None if reply is None else list(reply)

    @cached_property
    def _read(self) -> Any:
        return self._redis.register_script(_READ_SCRIPT)

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
                capacities: Mapping[bytes, bytes], loads: Mapping[bytes, bytes],
                per_shard: list[Any]) -> CacheAwarePolicy:
        """The policy seeded from what the read gave: per live shard, its estimate's size and,
        for each chain, the scores of its blocks if the shard holds its first block."""
        policy = self._policy(len(live))
        policy.loads[:] = loads_of(loads, live)
        for index, shard in enumerate(live):
            learned = capacities.get(str(shard).encode())
            if learned is not None:
                policy.set_capacity(index, int(learned))
        for index, (size, *held_chains) in enumerate(per_shard):
            held = sorted((float(scores[0]), chain[:_leading_held(scores)])
                          for chain, scores in zip(chains, held_chains, strict=True)
                          if scores is not None)
            policy.seed(index, [prefix for _, prefix in held], int(size))
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


def _pairs(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    """A hash as a script returns it (field, value, field, value, ...) as a dict."""
    return dict(zip(flat[0::2], flat[1::2], strict=True))


def _leading_held(scores: Sequence[bytes | None]) -> int:
    for index, score in enumerate(scores):
        if score is None:
            return index
    return len(scores)
