"""Prefix hashing and shard choice: pure functions, no I/O.

A document's token blocks (block size = the engine's KV block size) are hashed as a chain, each
block's hash covering its parent's, the same way the engine keys its prefix cache. The hash of
the last full block is the document's prefix key: every question on a document shares it, and
the router sends them all to one shard so the engine there finds the document cached.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import NamedTuple

_EMPTY = b"\x00" * 16


def _chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    return blake2b(parent + array("I", tokens).tobytes(), digest_size=16).digest()


def block_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of `tokens`."""
    hashes: list[bytes] = []
    parent = _EMPTY
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _chain(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class DocumentKeys:
    # Routes the document: the chained hash of its last full block (of all of it if shorter).
    prefix_key: str
    # Identifies the exact token sequence; stored documents are keyed by it.
    document_key: str
    # Tokens the engine can serve from cache once the document has been seen (full blocks).
    cacheable_tokens: int
    # The chained hash of every full block: what the cache-aware router matches shards on.
    blocks: tuple[bytes, ...]


def document_keys(tokens: Sequence[int], block_size: int) -> DocumentKeys:
    hashes = block_hashes(tokens, block_size)
    full = len(hashes) * block_size
    last_full = hashes[-1] if hashes else _EMPTY
    whole = _chain(last_full, tokens[full:]) if full < len(tokens) else last_full
    prefix = last_full if hashes else whole
    return DocumentKeys(prefix.hex(), whole.hex(), full, tuple(hashes))


@dataclass(frozen=True)
class DocumentDemand:
    """What routing one document costs: its prefix key and the load (prefill tokens, decode
    included) its jobs add to a shard that has never seen it versus one that already holds
    it."""

    prefix_key: str
    cost_if_new: int
    cost_if_known: int


@dataclass(frozen=True)
class Placement:
    shard: int
    is_new: bool


class RoutingJob(NamedTuple):
    """A job as a router sees it."""

    keys: DocumentKeys
    prompt_tokens: int
    # What generating its answer adds to its shard's load, in prefill tokens (`decode_load`).
    decode_load: int = 0


def decode_load(max_tokens: int, decode_cost: float) -> int:
    """The load a job's answer puts on its shard: `decode_cost` prefill tokens per output token
    it may generate. A question on a cached document costs its shard mostly decoding: with
    prefill alone in the loads, a shard given a hot document's many questions looks idle
    while it runs them all."""
    return round(decode_cost * max_tokens)


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


def plan_from_scratch(demands: Sequence[DocumentDemand], shards: int) -> list[int]:
    """The shards `ShardState.place` picks for these demands when no shard holds anything
    yet and none has outstanding work (a benchmark's standalone arm follows this plan)."""
    loads = [0] * shards
    plan = []
    for demand in demands:
        shard = least_loaded(loads)
        loads[shard] += demand.cost_if_new
        plan.append(shard)
    return plan


def least_loaded(loads: Sequence[int]) -> int:
    """The shard with the least outstanding work; ties go to the lowest index."""
    return min(range(len(loads)), key=loads.__getitem__)


def queue_name(shard: int) -> str:
    return f"jobs.shard.{shard}"
