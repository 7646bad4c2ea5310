"""What a job costs the shard it is routed to, in prefill tokens: the prompt tokens the shard
still has to compute plus a decode load for its answer. Routers charge these costs to the
shards' load counters, workers return them when the jobs end, and the simulator uses the same
unit. Pure functions over plain values."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from jobsvc.routing.prefix import DocumentKeys

# Prefill tokens one output token (of a job's max_tokens) adds to its shard's load. A question
# on a cached document costs its shard mostly decoding: with prefill alone in the loads, a
# shard given a hot document's many questions looks idle while it runs them all. One output
# token costs an engine about as much as a handful of prompt tokens computed in a batch.
DEFAULT_DECODE_COST = 8.0
# A shard's KV cache in blocks until its worker reports the real size: the order of a 7B
# model's cache on one 80 GB GPU in 128-token blocks.
DEFAULT_CAPACITY_BLOCKS = 1024


def answer_tokens(sampling: Mapping[str, Any]) -> int:
    """Most tokens a job's answers may take: `max_tokens` for each of its `n` choices."""
    return int(sampling.get("max_tokens", 0)) * int(sampling.get("n", 1))


def decode_load(max_tokens: int, decode_cost: float) -> int:
    """The load a job's answer puts on its shard: `decode_cost` prefill tokens per output token
    it may generate."""
    return round(decode_cost * max_tokens)


class RoutingJob(NamedTuple):
    """A job as a router sees it."""

    keys: DocumentKeys
    prompt_tokens: int
    # What generating its answer adds to its shard's load (`decode_load`).
    decode_load: int = 0


@dataclass(frozen=True)
class Route:
    """Where a job goes and what it costs there: the worker returns the same load when the job ends,
    so the shard's counter comes back to zero."""

    shard: int
    # Prompt tokens the shard is expected to compute: compared by the worker with what the
    # engine really found cached.
    estimated_prefill: int
    # What the shard is charged: the estimated prefill plus the job's decode load.
    load: int


@dataclass(frozen=True)
class DocumentDemand:
    """What routing one document costs: its prefix key and the load (prefill tokens, decode
    included) its jobs add to a shard that has never seen it versus one that already holds
    it."""

    prefix_key: str
    cost_if_new: int
    cost_if_known: int

    def cost(self, is_new: bool) -> int:
        """The load the document's jobs add to a shard, depending on whether it is new there."""
        return self.cost_if_new if is_new else self.cost_if_known


def document_demands(jobs: Sequence[RoutingJob]) -> list[DocumentDemand]:
    """One demand per distinct prefix, in first-seen order: every job costs its uncached
    tokens and its decode load, and a shard new to the document also computes the
    document's cacheable blocks once."""
    known_cost: dict[str, int] = {}
    cacheable: dict[str, int] = {}
    for keys, prompt_tokens, decode in jobs:
        known_cost[keys.prefix_key] = (known_cost.get(keys.prefix_key, 0)
                                       + prompt_tokens - keys.cacheable_tokens + decode)
        cacheable[keys.prefix_key] = keys.cacheable_tokens
    return [DocumentDemand(key, cost + cacheable[key], cost) for key, cost in known_cost.items()]


def estimated_routes(jobs: Sequence[RoutingJob], shards: Sequence[int],
                     held: frozenset[tuple[int, str]]) -> list[Route]:
    """The routes of jobs sent to these shards. A job's prefill is its whole prompt unless its
    shard holds the document already (`held`: (shard, prefix key) pairs known before, or
    brought there by an earlier job of the same submit): then only the tail."""
    seen = set(held)
    routes = []
    for (keys, prompt, decode), shard in zip(jobs, shards, strict=True):
        cached = keys.cacheable_tokens if (shard, keys.prefix_key) in seen else 0
        seen.add((shard, keys.prefix_key))
        routes.append(Route(shard, prompt - cached, prompt - cached + decode))
    return routes


def loads_per_shard(charged: Iterable[tuple[int, int]]) -> dict[int, int]:
    """(shard, load) pairs summed per shard: what one pipeline charges or releases."""
    loads: dict[int, int] = {}
    for shard, load in charged:
        loads[shard] = loads.get(shard, 0) + load
    return loads
