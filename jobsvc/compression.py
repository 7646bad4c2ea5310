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
_max_output = 256 * 1024 * 1024
_CHUNK = 1 << 20


class FrameTooLarge(ValueError):
    """A frame decompresses to more than the configured limit (a decompression bomb)."""


def configure(level: int, max_output_bytes: int) -> None:
    """Set the process-wide level and decompression limit (from settings) at start-up."""
    global _level, _max_output
    _level, _max_output = level, max_output_bytes
    _local.__dict__.clear()


def compress(data: bytes) -> bytes:
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


def is_zstd_frame(data: bytes) -> bool:
    return data[:4] == ZSTD_MAGIC


def register_kombu_codec() -> None:
    """Make KOMBU_CODEC known to kombu in this process (producers and workers both call it)."""
    from kombu import compression as kombu_compression

    kombu_compression.register(compress, decompress, KOMBU_CODEC)
