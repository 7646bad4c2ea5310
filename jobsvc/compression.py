"""zstd for everything big that travels or rests: message bodies, stored documents, answers.

zstandard's (de)compressor objects are not thread-safe, so each thread keeps its own.
"""

from __future__ import annotations

import threading

import zstandard

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# The kombu content-encoding name for our codec; kombu's own "zstd" needs another package.
KOMBU_CODEC = "application/x-jobsvc-zstd"

_local = threading.local()
_level = 3


def set_level(level: int) -> None:
    """Set the process-wide compression level (from settings) before the first compress."""
    global _level
    _level = level
    _local.__dict__.clear()


def compress(data: bytes) -> bytes:
    compressor = getattr(_local, "compressor", None)
    if compressor is None:
        compressor = _local.compressor = zstandard.ZstdCompressor(level=_level)
    return compressor.compress(data)


def decompress(frame: bytes) -> bytes:
    """Decompress one zstd frame; frames without a content size are streamed."""
    decompressor = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    return decompressor.decompressobj().decompress(frame)


def is_zstd_frame(data: bytes) -> bool:
    return data[:4] == ZSTD_MAGIC


def register_kombu_codec() -> None:
    """Make KOMBU_CODEC known to kombu in this process (producers and workers both call it)."""
    from kombu import compression as kombu_compression

    kombu_compression.register(compress, decompress, KOMBU_CODEC)
