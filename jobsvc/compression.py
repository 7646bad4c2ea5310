"""zstd for everything big that travels or rests: message bodies, stored documents and their
tokens, answers.

zstandard's (de)compressor objects are not thread-safe, so each thread keeps its own.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections.abc import Sequence

import zstandard

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# The kombu content-encoding name for our codec; kombu's own "zstd" needs another package.
KOMBU_CODEC = "application/x-jobsvc-zstd"

_local = threading.local()
_level = 3
_max_output = 256 * 1024 * 1024
_CHUNK = 1 << 20
# Token frames: one type byte, then the IDs as little-endian unsigned integers of this width.
_TOKEN_WIDTHS = {b"H": 2, b"I": 4}
# Token frames of fewer IDs are stored uncompressed (neither type byte starts a zstd frame).
RAW_TOKENS_BELOW = 64


class FrameTooLarge(ValueError):
    """A frame decompresses to more than the configured limit (a decompression bomb)."""


def configure(level: int, max_output_bytes: int) -> None:
    """Set the process-wide level and decompression limit (from settings) at start-up."""
    global _level, _max_output
    _level, _max_output = level, max_output_bytes
    _local.__dict__.clear()


def compress(data: bytes) -> bytes:
    """One zstd frame of `data`, at the configured level, with this thread's own compressor."""
    compressor = getattr(_local, "compressor", None)
    if compressor is None:
        compressor = _local.compressor = zstandard.ZstdCompressor(level=_level)
    return compressor.compress(data)


def decompress(frame: bytes) -> bytes:
    """Decompress one zstd frame, refusing output beyond the configured limit."""
    decompressor = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    reader = decompressor.stream_reader(frame)
    parts: list[bytes] = []
    size = 0
    while chunk := reader.read(_CHUNK):
        size += len(chunk)
        if size > _max_output:
            raise FrameTooLarge(f"zstd frame decompresses to over {_max_output} bytes")
        parts.append(chunk)
    return b"".join(parts)


class TextFrameError(ValueError):
    """Bytes that are not a zstd frame of UTF-8 text, or one that inflates past the limit."""


def decompress_text(frame: bytes) -> str:
    """The text of a zstd frame written from a string; anything else raises TextFrameError."""
    try:
        return decompress(frame).decode()
    except (zstandard.ZstdError, FrameTooLarge, UnicodeDecodeError) as error:
        raise TextFrameError(f"not a readable text frame ({error})") from None


class TokenFrameError(ValueError):
    """Bytes that are not a token frame written by `pack_tokens`."""


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token IDs as a frame: a type byte, then 2 bytes per ID when the vocabulary allows (most
    do), else 4; a fraction of the size of the IDs as JSON, and cheap to read back. A frame of
    RAW_TOKENS_BELOW IDs or more is compressed with zstd; a shorter one (a question) is
    kept as it is, since compressing it would save a few bytes for more CPU than the rest of
    its job's record costs."""
    typecode = "H" if max(tokens, default=0) < 1 << 16 else "I"
    ids = array(typecode, tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    frame = typecode.encode() + ids.tobytes()
    return frame if len(tokens) < RAW_TOKENS_BELOW else compress(frame)


def unpack_tokens(frame: bytes) -> tuple[int, ...]:
    """The token IDs of a frame from `pack_tokens`, compressed or not (none, for an
    embedding job's empty question); anything else raises TokenFrameError. A tuple, which the
    garbage collector stops tracking once it has met it (a list it would walk at every
    collection while the document is in use)."""
    try:
        data = decompress(frame) if is_zstd_frame(frame) else frame
    except (zstandard.ZstdError, FrameTooLarge) as error:
        raise TokenFrameError(f"not a readable zstd frame ({error})") from None
    kind, body = data[:1], data[1:]
    width = _TOKEN_WIDTHS.get(kind)
    if width is None or len(body) % width:
        raise TokenFrameError(f"not a token frame: type {kind!r}, {len(body)} bytes of IDs")
    ids = array(kind.decode())
    ids.frombytes(body)
    if sys.byteorder == "big":
        ids.byteswap()
    return tuple(ids)


def is_zstd_frame(data: bytes) -> bool:
    """Whether `data` starts as a zstd frame does, to tell a compressed body from a plain one."""
    return data[:4] == ZSTD_MAGIC


def register_kombu_codec() -> None:
    """Make KOMBU_CODEC known to kombu in this process (producers and workers both call it)."""
    from kombu import compression as kombu_compression

    kombu_compression.register(compress, decompress, KOMBU_CODEC)
