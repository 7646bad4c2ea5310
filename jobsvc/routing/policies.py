"""Shard choice policies: pure decision logic over a job's prefix block chain and the shards'
outstanding work, with no I/O. Each policy exists once, here: the Redis-backed routers
(`routing.router`) load a policy's state from Redis, let it decide and write the state back,
and the simulator (`jobsvc.simulate`) runs the same objects over simulated shards.

A job is described by its document's chained block hashes (`routing.prefix.block_hashes`; any
hashable ids will do, the simulator uses ints) and its prompt length in tokens. Each policy
keeps its state in plain lists and dicts, one entry per shard, so that the Redis-backed version
shared by many producers can mirror it key for key.

Outstanding work is whatever unit the caller charges (prefill tokens in the service, the cost
model's work units in the simulator): the caller charges the chosen shard and releases the
work when the job finishes; every policy reads the same `loads`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from jobsvc.errors import ConfigurationError
from jobsvc.routing.job_cost import DocumentDemand, Route, RoutingJob

# Prefill tokens one unit of outstanding work is worth. At 1 (work counted in prefill tokens)
# the cost would be when this job's prefill ends on the shard, the best choice for this job
# alone; but a recomputed prefix is work the system pays for good, while a queue that is longer
# than another's evens out as later jobs go to the shorter one. At 0.25 a shard keeps getting a
# document's jobs until its queue is four of that document's prefills longer than another's.
# Swept with `jobsvc simulate` on the generated workloads: smaller weights let queues drift
# apart, larger ones recompute prefixes the cache held; 0.25 kept makespans nearest the best.
DEFAULT_WEIGHT = 0.25
# Slack of the bounded-load rule: a shard above (1 + epsilon) x the mean outstanding work, plus
# one prompt (so that an idle cluster is not all "above the mean" once one job is queued), is
# not eligible. 0.25 is the balance factor consistent hashing with bounded loads is usually run
# with; the weight already keeps loads close, so the bound acts only when a prefix is worth
# more than any queue (a very long hot document, or a weight near 0) and then caps its shard.
DEFAULT_EPSILON = 0.25


def least_loaded(loads: Sequence[int]) -> int:
    """The shard with the least outstanding work; ties go to the lowest index."""
    return min(range(len(loads)), key=loads.__getitem__)


@dataclass(frozen=True)
class Placement:
    """A document's shard, and whether the shard must compute it whole: the two differ in cost."""

    shard: int
    # The document was not held by any shard before: its shard computes it whole.
    is_new: bool


class RoutingPolicy(ABC):
    """Chooses a shard per job; callers keep `loads` current with `charge`/`job_finished`."""

    name: ClassVar[str]

    def __init__(self, shards: int) -> None:
        if shards < 1:
            raise ConfigurationError(f"a routing policy needs at least one shard, got {shards}")
        # Outstanding work per shard: charged when a job is routed there, released when it ends.
        self.loads: list[int] = [0] * shards

    @abstractmethod
    def choose(self, blocks: Sequence[Hashable], prompt_tokens: int) -> int:
        """The shard for a job whose document has this block chain; records the choice (the
        shard will hold the chain once the job has run) but does not charge the shard."""

    def charge(self, shard: int, work: int) -> None:
        """Add `work` to the shard's outstanding load (a job routed there)."""
        self.loads[shard] += work

    def job_finished(self, shard: int, work: int) -> None:
        """Release what the job was charged; never below zero, so that a lost counter cannot
        attract every new document."""
        self.loads[shard] = max(0, self.loads[shard] - work)

    def reindex(self, sources: Sequence[int | None]) -> None:
        """Follow a change of the shard set: new index i is old index `sources[i]`, or a shard
        that joined (None) and starts idle and empty. What a departed shard held is forgotten,
        as the Redis-backed routers forget it (`routing.router.forget_shard`)."""
        if not sources:
            raise ConfigurationError("a routing policy needs at least one shard, got 0")
        self.loads = [0 if old is None else self.loads[old] for old in sources]

    def state_entries(self) -> int:
        """Entries of routing state this policy keeps (what the shared state in Redis holds
        for it): one load per shard, plus what the policy remembers of documents."""
        return len(self.loads)


class RoundRobinPolicy(RoutingPolicy):
    """The baseline that ignores both prefixes and load."""

    name = "round_robin"

    def __init__(self, shards: int, first: int = 0) -> None:
        """`first`: jobs dealt before this one (by every producer sharing the count)."""
        super().__init__(shards)
        self.next_shard = first % shards

    def choose(self, blocks: Sequence[Hashable], prompt_tokens: int) -> int:
        """The next shard in turn, whatever the job."""
        shard = self.next_shard
        self.next_shard = (shard + 1) % len(self.loads)
        return shard

    def reindex(self, sources: Sequence[int | None]) -> None:
        """Follow a change of the shard set, keeping the turn within it."""
        super().reindex(sources)
        self.next_shard %= len(self.loads)


class AffinityPolicy(RoutingPolicy):
    """The plain affinity map: a new document goes to the least loaded shard and stays there,
    however hot it becomes. Given only a block chain (`choose`), a document shorter than one
    block has no key and nothing to reuse, and is not remembered; the router keys every
    document by its prefix key (`place`)."""

    name = "affinity"

    def __init__(self, shards: int) -> None:
        super().__init__(shards)
        # The document's prefix key (its last block hash, `DocumentKeys.prefix_key`) -> its shard.
        self.shard_of: dict[Hashable, int] = {}

    def choose(self, blocks: Sequence[Hashable], prompt_tokens: int) -> int:
        """The shard of the document's last block, placing it if new; a document without a full
        block goes to the least loaded shard."""
        if not blocks:
            return least_loaded(self.loads)
        return self.place(blocks[-1]).shard

    def place(self, key: Hashable) -> Placement:
        """The shard of the document with this prefix key: where it went before, or else the
        least loaded shard, where it stays."""
        shard = self.shard_of.get(key)
        if shard is not None:
            return Placement(shard, False)
        shard = self.shard_of[key] = least_loaded(self.loads)
        return Placement(shard, True)

    def reindex(self, sources: Sequence[int | None]) -> None:
        """Follow a change of the shard set; a departed shard's documents are placed anew."""
        super().reindex(sources)
        new_index = {old: new for new, old in enumerate(sources) if old is not None}
        self.shard_of = {key: new_index[old] for key, old in self.shard_of.items()
                         if old in new_index}

    def state_entries(self) -> int:
        """The loads plus one entry per document placed."""
        return super().state_entries() + len(self.shard_of)

    def place_documents(self, demands: Sequence[DocumentDemand]) -> list[Placement]:
        """Place one submit's documents in turn, each charged with all of its jobs before the
        next is placed, so that a document with many questions weighs on its shard at once."""
        placements = []
        for demand in demands:
            placement = self.place(demand.prefix_key)
            self.charge(placement.shard, demand.cost(placement.is_new))
            placements.append(placement)
        return placements


class CacheAwarePolicy(RoutingPolicy):
    """Cost of a shard = prompt tokens it would still have to prefill for this job + weight x its
    outstanding work, over the shards within (1 + epsilon) x the mean outstanding work plus one
    prompt.

    Per shard it keeps an estimate of the blocks its KV cache holds: an LRU in the order the
    shard will run its jobs, bounded by the shard's capacity in blocks, so entries the cache can
    no longer hold are forgotten. Overlap is the longest prefix of the job's chain present; a
    chained hash stands for its whole prefix, so documents sharing a leading part (a common
    preamble, an earlier version) overlap for exactly that part. Chains are touched from their
    last block to their first, as the engine frees them, so a prefix outlives its tail.
    """

    name = "cache_aware"

    def __init__(self, shards: int, *, block_size: int, capacity_blocks: int,
                 weight: float = DEFAULT_WEIGHT, epsilon: float = DEFAULT_EPSILON) -> None:
        super().__init__(shards)
        if block_size < 1 or capacity_blocks < 1:
            raise ConfigurationError(
                f"block size and cache capacity must be >= 1 block, got {block_size} tokens "
                f"and {capacity_blocks} blocks")
        if weight < 0 or epsilon < 0:
            raise ConfigurationError(
                f"weight and epsilon must be >= 0, got {weight} and {epsilon}")
        self.block_size = block_size
        # What a shard that joins is assumed to hold until its worker reports.
        self.default_capacity = capacity_blocks
        self.weight = weight
        self.epsilon = epsilon
        # Blocks each shard is estimated to hold, least recently used first.
        self.held: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in range(shards)]
        # The shards estimated to hold each chain's first block: only they can have an overlap,
        # so a job looks at them rather than at every shard.
        self.holders: dict[Hashable, set[int]] = {}
        # What each shard's cache holds as the router has learned it, and what its worker
        # reported as its size (the learned value never exceeds the report).
        self.capacity: list[int] = [capacity_blocks] * shards
        self.reported_capacity: list[int] = [capacity_blocks] * shards
        # Blocks a shard holds beyond those loaded into `held` (see `seed`).
        self.unseen: list[int] = [0] * shards

    def overlap(self, shard: int, blocks: Sequence[Hashable]) -> int:
        """Blocks of the chain's prefix the shard is estimated to hold."""
        held = self.held[shard]
        count = 0
        for block in blocks:
            if block not in held:
                break
            count += 1
        return count

    def choose(self, blocks: Sequence[Hashable], prompt_tokens: int) -> int:
        """The shard `route` picks for the job."""
        return self.route(blocks, prompt_tokens)[0]

    def route(self, blocks: Sequence[Hashable], prompt_tokens: int) -> tuple[int, int]:
        """`choose`, with the tokens the chosen shard is expected to have cached: the caller
        charges the rest as prefill and hands the expectation back to `observe`."""
        loads, held = self.loads, self.held
        # A shard that holds none of the chain costs the full prompt, so of those only the least
        # loaded can win, and it is always within the limit, being at most the mean. Of several
        # idle shards, the one holding least keeps the most documents cached overall.
        least = min(loads)
        best = loads.index(least)
        if least == 0 and loads.count(0) > 1:
            best = min((shard for shard, load in enumerate(loads) if load == 0),
                       key=lambda shard: len(held[shard]) + self.unseen[shard])
        best_cost, best_cached = prompt_tokens + self.weight * least, 0
        if not blocks:
            return best, 0
        limit = (1 + self.epsilon) * sum(loads) / len(loads) + prompt_tokens
        # What a shard holding the whole chain would cost before its load: a holder that cannot
        # beat the best even so is not worth walking (a hot document is held everywhere).
        floor = prompt_tokens - len(blocks) * self.block_size
        for shard in self.holders.get(blocks[0], ()):
            load = loads[shard]
            if load > limit or floor + self.weight * load > best_cost:
                continue
            cached = self.overlap(shard, blocks) * self.block_size
            cost = prompt_tokens - cached + self.weight * load
            if cost < best_cost or (cost == best_cost and shard < best):
                best, best_cost, best_cached = shard, cost, cached
        self._touch(best, blocks)
        return best, best_cached

    def route_jobs(self, jobs: Sequence[RoutingJob]) -> list[Route]:
        """`route` one submit's jobs in turn, each charged before the next is routed, so that
        even one submit's hot document spreads once its shard is loaded enough."""
        routes = []
        for keys, prompt, decode in jobs:
            shard, cached = self.route(keys.blocks, prompt)
            prefill = prompt - cached
            self.charge(shard, prefill + decode)
            routes.append(Route(shard, prefill, prefill + decode))
        return routes

    def observe(self, shard: int, blocks: Sequence[Hashable], cached_tokens: int,
                expected_tokens: int) -> None:
        """Learn from a worker's report on a job it ran: it found `cached_tokens` of the chain
        cached where `route` expected `expected_tokens`.

        The shard now holds the whole chain, whoever sent it there. A shorter hit than expected
        means the cache keeps fewer blocks than the estimate assumed (decode blocks and other
        requests take room too), a longer one that it keeps more (`learn`)."""
        self.learn(shard, (expected_tokens - cached_tokens) // self.block_size, len(blocks))
        self._touch(shard, blocks)

    def learn(self, shard: int, error_blocks: int, floor_blocks: int) -> None:
        """Move the shard's learned capacity down by `error_blocks` (up if negative), within
        the longest chain seen (`floor_blocks`, at least one block) and the reported size, and
        forget what no longer fits. Workers' reports make Redis do the same
        (`routing.feedback`)."""
        self.capacity[shard] = min(self.reported_capacity[shard],
                                   max(floor_blocks, 1, self.capacity[shard] - error_blocks))
        self._evict(shard)

    def seed(self, shard: int, prefixes: Sequence[Sequence[Hashable]], total_held: int) -> None:
        """Load the part of a shard's estimate that matters for the jobs at hand from a store
        shared by many routers: the held leading blocks of their chains, least recently used
        first, and how many blocks the shard holds in all (the rest only break ties)."""
        for prefix in prefixes:
            if prefix:
                self._touch(shard, prefix)
        self.unseen[shard] = max(0, total_held - len(self.held[shard]))

    def set_capacity(self, shard: int, capacity_blocks: int) -> None:
        """A worker's report of its KV cache size in blocks (after a start or a resize)."""
        if capacity_blocks < 1:
            raise ConfigurationError(f"shard {shard} reported a cache of {capacity_blocks} blocks")
        self.reported_capacity[shard] = self.capacity[shard] = capacity_blocks
        self._evict(shard)

    def reindex(self, sources: Sequence[int | None]) -> None:
        """Follow a change of the shard set: a shard that joined starts empty at the default
        capacity, one that left takes its estimate with it."""
        default = self.default_capacity
        super().reindex(sources)
        self.held = [OrderedDict() if old is None else self.held[old] for old in sources]
        self.capacity = [default if old is None else self.capacity[old] for old in sources]
        self.reported_capacity = [default if old is None else self.reported_capacity[old]
                                  for old in sources]
        self.unseen = [0 if old is None else self.unseen[old] for old in sources]
        new_index = {old: new for new, old in enumerate(sources) if old is not None}
        holders: dict[Hashable, set[int]] = {}
        for block, shards in self.holders.items():
            kept = {new_index[old] for old in shards if old in new_index}
            if kept:
                holders[block] = kept
        self.holders = holders

    def state_entries(self) -> int:
        """Loads and capacities, every block estimated held, and the index of first blocks."""
        return (super().state_entries() + 2 * len(self.capacity)
                + sum(len(held) for held in self.held) + len(self.holders))

    def forget(self, shard: int, blocks: Sequence[Hashable] | None = None) -> None:
        """Drop blocks the shard reports evicted, or everything when it restarted."""
        held = self.held[shard]
        for block in list(held) if blocks is None else blocks:
            if block in held:
                del held[block]
                self._unindex(shard, block)

    def _touch(self, shard: int, blocks: Sequence[Hashable]) -> None:
        held = self.held[shard]
        for block in reversed(blocks):
            if block in held:
                held.move_to_end(block)
            else:
                held[block] = None
        shards = self.holders.get(blocks[0])
        if shards is None:
            self.holders[blocks[0]] = {shard}
        else:
            shards.add(shard)
        self._evict(shard)

    def _evict(self, shard: int) -> None:
        held, holders = self.held[shard], self.holders
        for _ in range(len(held) - self.capacity[shard]):
            block = held.popitem(last=False)[0]
            if block in holders:
                self._unindex(shard, block)

    def _unindex(self, shard: int, block: Hashable) -> None:
        shards = self.holders.get(block)
        if shards is not None:
            shards.discard(shard)
            if not shards:
                del self.holders[block]


# The one registry of policies, by the name JOBSVC_ROUTING and `--policy` take.
POLICIES: dict[str, type[RoutingPolicy]] = {
    policy.name: policy for policy in (RoundRobinPolicy, AffinityPolicy, CacheAwarePolicy)}
POLICY_NAMES = tuple(POLICIES)


def policy_class(name: str) -> type[RoutingPolicy]:
    """The policy called `name` (JOBSVC_ROUTING_POLICY); ConfigurationError, naming the choices, for
    any other name."""
    policy = POLICIES.get(name)
    if policy is None:
        raise ConfigurationError(
            f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    return policy


def make_policy(name: str, shards: int, *, block_size: int, capacity_blocks: int,
                weight: float = DEFAULT_WEIGHT,
                epsilon: float = DEFAULT_EPSILON) -> RoutingPolicy:
    """The policy called `name` (JOBSVC_ROUTING, or a simulation's --policy). Block size and
    cache capacity are asked of every caller so that switching policies needs no other change."""
    policy = policy_class(name)
    if policy is CacheAwarePolicy:
        return CacheAwarePolicy(shards, block_size=block_size, capacity_blocks=capacity_blocks,
                                weight=weight, epsilon=epsilon)
    return policy(shards)
