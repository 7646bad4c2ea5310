"""Prefix hashing: pure functions over token ids, no I/O and no knowledge of queues or shards.

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
    """What routing and storage need to know of a document, computed once from its tokens."""

    # Routes the document: the chained hash of its last full block (of all of it if shorter).
    prefix_key: str
    # Identifies the exact token sequence; stored documents are keyed by it.
    document_key: str
    # Tokens the engine can serve from cache once the document has been seen (full blocks).
    cacheable_tokens: int
    # The chained hash of every full block: what the cache-aware router matches shards on.
    blocks: tuple[bytes, ...]


def document_keys(tokens: Sequence[int], block_size: int) -> DocumentKeys:
    """The document's keys and block chain from its tokens, hashed as the engine keys its cache."""
    hashes = block_hashes(tokens, block_size)
    full = len(hashes) * block_size
    last_full = hashes[-1] if hashes else _EMPTY
    whole = _chain(last_full, tokens[full:]) if full < len(tokens) else last_full
    prefix = last_full if hashes else whole
    return DocumentKeys(prefix.hex(), whole.hex(), full, tuple(hashes))


def adapted(keys: DocumentKeys, adapter: str) -> DocumentKeys:
    """The routing keys of the document run under a LoRA adapter: the engine keys its prefix
    cache by adapter too, so each block's hash is taken again with the adapter's name (blocks
    shared by two documents stay shared under one adapter). The stored document's key stays."""
    salt = adapter.encode()
    blocks = tuple(blake2b(salt + block, digest_size=16).digest() for block in keys.blocks)
    prefix = blake2b(salt + bytes.fromhex(keys.prefix_key), digest_size=16).digest()
    return DocumentKeys(prefix.hex(), keys.document_key, keys.cacheable_tokens, blocks)


def unrouted(document_key: str) -> DocumentKeys:
    """Keys that route a prompt by load alone: no block any shard could hold (an embedding
    job's inputs, whose computation no later job reuses)."""
    return DocumentKeys(document_key, document_key, 0, ())
