"""Prefix hashing: block chains and document keys."""

from __future__ import annotations

import pytest

from jobsvc.routing.prefix import block_hashes, document_keys

pytestmark = pytest.mark.unit


def test_block_hashes_are_chained_so_equal_blocks_after_different_prefixes_differ() -> None:
    a = block_hashes([1, 2, 3, 4, 9, 9], block_size=2)
    b = block_hashes([5, 6, 3, 4, 9, 9], block_size=2)
    assert len(a) == 3
    assert a[1] != b[1] and a[2] != b[2]
    assert block_hashes([1, 2, 3, 4, 7], block_size=2) == a[:2]


def test_partial_last_block_is_not_hashed_into_the_prefix_key() -> None:
    one = document_keys([1, 2, 3, 4, 5], block_size=2)
    two = document_keys([1, 2, 3, 4, 6], block_size=2)
    assert one.prefix_key == two.prefix_key
    assert one.document_key != two.document_key
    assert one.cacheable_tokens == 4


def test_a_document_shorter_than_a_block_still_gets_distinct_keys() -> None:
    short = document_keys([1, 2, 3], block_size=8)
    other = document_keys([1, 2, 4], block_size=8)
    assert short.cacheable_tokens == 0
    assert short.prefix_key != other.prefix_key
