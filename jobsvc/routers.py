"""Routers: the policies of `jobsvc.policies` applied to one submit's jobs, with their state in
Redis so that any number of producers route as one.

Every router charges the shards' shared load counters (`ShardState`) with each job's load (its
estimated prefill plus its decode load), which workers return when the job ends.
`cache_aware` also keeps, per shard, the block hashes its KV cache is estimated to hold (a
sorted set scored by recency, trimmed to the capacity the shard's worker reported and the
router has learned); a producer holds a short Redis lock while it reads that state, decides
and writes it back, so two producers never decide on stale state. `plan` gives the choices a
router makes on an idle cluster with empty caches, without Redis: the benchmark's standalone
arm follows it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

from jobsvc.affinity import AFFINITY_KEY, LOAD_KEY, ShardState, parse_loads
from jobsvc.errors import BrokerUnavailable
from jobsvc.policies import AffinityPolicy, CacheAwarePolicy, RoundRobinPolicy
from jobsvc.routing import RoutingJob, document_demands, plan_from_scratch
from jobsvc.settings import Settings

log = logging.getLogger(__name__)

ROUND_ROBIN_KEY = "jobsvc:round-robin"
CACHE_KEY_PREFIX = "jobsvc:cache:"
CACHE_CLOCK_KEY = "jobsvc:cache-clock"
# Capacity in blocks per shard: as its worker reported it, and as the router has learned it.
REPORTED_CAPACITY_KEY = "jobsvc:cache-reported"
CAPACITY_KEY = "jobsvc:cache-capacity"
ROUTING_LOCK_KEY = "jobsvc:routing-lock"
# Assumed for a shard whose worker has not reported yet: the order of a 7B model's KV cache on
# one 80 GB GPU (workers report the real figure when their engine starts).
UNREPORTED_CAPACITY_BLOCKS = 1024
# Longest a producer holds the routing lock (routing a large submit takes milliseconds).
_LOCK_SECONDS = 10

# Moves a shard's learned capacity by the summed error of its jobs' cache expectations (in
# blocks), within [longest chain seen, reported capacity], and forgets what no longer fits.
_LEARN = """
for i = 1, #ARGV, 3 do
  local shard, error, floor = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local reported = tonumber(redis.call('HGET', KEYS[1], shard))
  if reported then
    local current = tonumber(redis.call('HGET', KEYS[2], shard)) or reported
    local learned = math.min(reported, math.max(floor, current - error))
    redis.call('HSET', KEYS[2], shard, learned)
    redis.call('ZREMRANGEBYRANK', KEYS[3] .. shard, 0, -learned - 1)
  end
end
return 1
"""


def cache_key(shard: int) -> str:
    return f"{CACHE_KEY_PREFIX}{shard}"


@dataclass(frozen=True)
class Route:
    shard: int
    # Prompt tokens the shard is expected to compute: compared by the worker with what the
    # engine really found cached.
    estimated_prefill: int
    # What the shard is charged: the estimated prefill plus the job's decode load.
    load: int


class Router(ABC):
    def __init__(self, client: redis.Redis, state: ShardState, settings: Settings) -> None:
        self._redis = client
        self._state = state
        self.shards = settings.shards
        self.settings = settings

    @abstractmethod
    def route(self, jobs: Sequence[RoutingJob]) -> list[Route]:
        """Pick a shard per job from the shared state, and charge the shards."""

    @abstractmethod
    def plan(self, jobs: Sequence[RoutingJob]) -> list[int]:
        """The shards `route` picks for these jobs on an idle cluster with empty caches."""


class RoundRobinRouter(Router):
    """The baseline: job after job, shard after shard, from one counter all producers share."""

    def route(self, jobs: Sequence[RoutingJob]) -> list[Route]:
        end = int(self._redis.incrby(ROUND_ROBIN_KEY, len(jobs)))
        shards = [(end - len(jobs) + index) % self.shards for index in range(len(jobs))]
        routes = _estimate_prefill(jobs, shards, held=frozenset())
        self._state.charge(_charges(routes))
        return routes

    def plan(self, jobs: Sequence[RoutingJob]) -> list[int]:
        policy = RoundRobinPolicy(self.shards)
        return [policy.choose(job.keys.blocks, job.prompt_tokens) for job in jobs]


class AffinityRouter(Router):
    """The plain affinity map: a new document goes to the least loaded shard, then sticks."""

    def route(self, jobs: Sequence[RoutingJob]) -> list[Route]:
        demands = document_demands(jobs)
        placements = dict(zip((demand.prefix_key for demand in demands),
                              self._state.place(demands), strict=True))
        shards = [placements[job.keys.prefix_key].shard for job in jobs]
        held = frozenset((placement.shard, key) for key, placement in placements.items()
                         if not placement.is_new)
        return _estimate_prefill(jobs, shards, held)

    def plan(self, jobs: Sequence[RoutingJob]) -> list[int]:
        demands = document_demands(jobs)
        plan = dict(zip((demand.prefix_key for demand in demands),
                        plan_from_scratch(demands, self.shards), strict=True))
        return [plan[job.keys.prefix_key] for job in jobs]


class CacheAwareRouter(Router):
    """Cache overlap against load (`policies.CacheAwarePolicy`), job by job, so that even one
    submit's hot document spreads once its shard is loaded enough."""

    def route(self, jobs: Sequence[RoutingJob]) -> list[Route]:
        lock = self._redis.lock(ROUTING_LOCK_KEY, timeout=_LOCK_SECONDS,
                                blocking_timeout=_LOCK_SECONDS)
        if not lock.acquire():
            raise BrokerUnavailable(
                f"another producer held the routing lock for {_LOCK_SECONDS} s; nothing was "
                "enqueued, submit again")
        try:
            policy, clock = self._load(jobs)
            routes = _decide(policy, jobs)
            self._save(jobs, routes, clock, policy.capacity)
        finally:
            try:
                lock.release()
            except redis.exceptions.LockError:
                # Held past its timeout: another producer may have routed on the state this
                # one was about to write, which costs a cache miss, never a job.
                log.warning("routing took over %d s; the routing lock had expired", _LOCK_SECONDS)
        return routes

    def plan(self, jobs: Sequence[RoutingJob]) -> list[int]:
        return [route.shard for route in _decide(self._policy(), jobs)]

    def _policy(self) -> CacheAwarePolicy:
        return CacheAwarePolicy(self.shards, block_size=self.settings.block_size,
                                capacity_blocks=UNREPORTED_CAPACITY_BLOCKS,
                                weight=self.settings.routing_load_weight,
                                epsilon=self.settings.routing_load_slack)

    def _load(self, jobs: Sequence[RoutingJob]) -> tuple[CacheAwarePolicy, int]:
        """The policy seeded with what the shards hold of these jobs' chains, their loads and
        capacities; and the recency clock reserved for the blocks this submit touches.
        Two round trips: everything but the chains, then the chains whose first block a
        shard holds."""
        chains = list({job.keys.blocks: None for job in jobs if job.keys.blocks})
        firsts = [chain[0] for chain in chains]
        touched = sum(len(job.keys.blocks) for job in jobs)
        with self._redis.pipeline(transaction=False) as pipe:
            pipe.incrby(CACHE_CLOCK_KEY, touched)
            pipe.hgetall(CAPACITY_KEY)
            pipe.hgetall(LOAD_KEY)
            for shard in range(self.shards):
                pipe.zcard(cache_key(shard))
                if firsts:
                    pipe.zmscore(cache_key(shard), firsts)
            clock, capacities, loads, *per_shard = pipe.execute()
        step = 2 if firsts else 1
        sizes = per_shard[0::step]
        candidates = [(shard, chain) for shard in range(self.shards) if firsts
                      for chain, score in zip(chains, per_shard[shard * step + 1], strict=True)
                      if score is not None]
        with self._redis.pipeline(transaction=False) as pipe:
            for shard, chain in candidates:
                pipe.zmscore(cache_key(shard), list(chain))
            scores = pipe.execute() if candidates else []
        policy = self._policy()
        policy.loads[:] = parse_loads(loads, self.shards)
        for shard in range(self.shards):
            learned = capacities.get(str(shard).encode())
            if learned is not None:
                policy.set_capacity(shard, int(learned))
        held: dict[int, list[tuple[float, tuple[bytes, ...]]]] = {}
        for (shard, chain), chain_scores in zip(candidates, scores, strict=True):
            leading = _leading_held(chain_scores)
            held.setdefault(shard, []).append((chain_scores[0], chain[:leading]))
        for shard in range(self.shards):
            prefixes = [prefix for _, prefix in sorted(held.get(shard, ()))]
            policy.seed(shard, prefixes, int(sizes[shard]))
        return policy, int(clock) - touched

    def _save(self, jobs: Sequence[RoutingJob], routes: Sequence[Route], clock: int,
              capacity: Sequence[int]) -> None:
        """Write the touched chains with fresh recency (a chain's first block the freshest, as
        the engine frees a request's blocks tail first), trim each shard to its capacity and
        charge the loads."""
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
            for shard, tokens in _charges(routes).items():
                pipe.hincrby(LOAD_KEY, str(shard), tokens)
            pipe.execute()


class CacheFeedback:
    """What workers tell the cache-aware router: the size of their engine's KV cache when it
    starts (empty), and after each drain of results how far the cached tokens their jobs
    really got fell short of (or beyond) what the router expected."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._learn = client.register_script(_LEARN)

    def engine_started(self, shard: int, capacity_blocks: int) -> None:
        with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(cache_key(shard))
            pipe.hset(REPORTED_CAPACITY_KEY, str(shard), capacity_blocks)
            pipe.hset(CAPACITY_KEY, str(shard), capacity_blocks)
            pipe.execute()

    def jobs_ran(self, errors: Mapping[int, tuple[int, int]]) -> None:
        """`errors` maps a shard to (expected minus actual cached blocks summed over its jobs,
        the longest document chain among them in blocks)."""
        args: list[int | str] = []
        for shard, (error, floor) in errors.items():
            args += [str(shard), error, max(1, floor)]
        if args:
            self._learn(keys=[REPORTED_CAPACITY_KEY, CAPACITY_KEY, CACHE_KEY_PREFIX], args=args)


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


ROUTERS: dict[str, type[Router]] = {
    RoundRobinPolicy.name: RoundRobinRouter,
    AffinityPolicy.name: AffinityRouter,
    CacheAwarePolicy.name: CacheAwareRouter,
}


def make_router(client: redis.Redis, state: ShardState, settings: Settings) -> Router:
    """The router for `settings.routing` (already validated by `Settings`)."""
    return ROUTERS[settings.routing](client, state, settings)


def _decide(policy: CacheAwarePolicy, jobs: Sequence[RoutingJob]) -> list[Route]:
    routes = []
    for keys, prompt, decode in jobs:
        shard, cached = policy.route(keys.blocks, prompt)
        prefill = prompt - cached
        policy.charge(shard, prefill + decode)
        routes.append(Route(shard, prefill, prefill + decode))
    return routes


def _leading_held(scores: Sequence[float | None]) -> int:
    for index, score in enumerate(scores):
        if score is None:
            return index
    return len(scores)


def _estimate_prefill(jobs: Sequence[RoutingJob], shards: Sequence[int],
                      held: frozenset[tuple[int, str]]) -> list[Route]:
    """A job's prefill is its whole prompt unless its shard holds the document already (known
    before, or brought there by an earlier job of the same submit): then only the tail."""
    seen = set(held)
    routes = []
    for (keys, prompt, decode), shard in zip(jobs, shards, strict=True):
        cached = keys.cacheable_tokens if (shard, keys.prefix_key) in seen else 0
        seen.add((shard, keys.prefix_key))
        routes.append(Route(shard, prompt - cached, prompt - cached + decode))
    return routes


def _charges(routes: Sequence[Route]) -> dict[int, int]:
    charges: dict[int, int] = {}
    for route in routes:
        charges[route.shard] = charges.get(route.shard, 0) + route.load
    return charges
