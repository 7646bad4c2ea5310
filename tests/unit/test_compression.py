"""Token frames, the form in which each document's tokens are stored for workers: pure logic."""

from __future__ import annotations

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from jobsvc import compression
from jobsvc.compression import TokenFrameError, pack_tokens, unpack_tokens

pytestmark = pytest.mark.unit


@given(st.lists(st.integers(0, (1 << 32) - 1), max_size=300))
def test_token_frames_round_trip_any_ids(tokens: list[int]) -> None:
    assert unpack_tokens(pack_tokens(tokens)) == tuple(tokens)


def test_ids_of_a_small_vocabulary_take_two_bytes_each() -> None:
    small, large = pack_tokens([1, 65535, 7]), pack_tokens([1, 65536, 7])
    assert (small[:1], len(small)) == (b"H", 1 + 3 * 2)
    assert (large[:1], len(large)) == (b"I", 1 + 3 * 4)


def test_short_frames_are_kept_as_they_are_and_long_ones_compressed() -> None:
    short = list(range(compression.RAW_TOKENS_BELOW - 1))
    long = list(range(compression.RAW_TOKENS_BELOW)) * 4
    assert not compression.is_zstd_frame(pack_tokens(short))
    packed = pack_tokens(long)
    assert compression.is_zstd_frame(packed)
    assert zstandard.ZstdDecompressor().decompress(packed)[:1] == b"H"
    assert unpack_tokens(packed) == tuple(long)


def _frame(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize("frame", [
    b"", b"not zstd at all", b"H\x01\x00\x02", _frame(b""), _frame(b"H\x01\x00\x02"),
    _frame(b"I\x01\x00\x00\x00\x02\x00"), _frame(b"Q\x01\x00"), _frame(b"[1, 2, 3]"),
    _frame(b"H\x01\x00")[:-3],
], ids=["empty", "not-zstd", "odd-raw-uint16", "empty-frame", "odd-uint16", "short-uint32",
        "unknown-type", "json", "truncated"])
def test_anything_but_a_token_frame_is_refused(frame: bytes) -> None:
    with pytest.raises(TokenFrameError):
        unpack_tokens(frame)


def test_a_frame_that_inflates_past_the_limit_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compression, "_max_output", 1 << 20)
    with pytest.raises(TokenFrameError, match="readable"):
        unpack_tokens(_frame(b"H" + b"\x00" * (4 << 20)))
