"""Embedding jobs, in the shape the rest of the service already knows: one job per request (one
per input text in the Python API) whose inputs the engine embeds one request each. The job's
prompt is its inputs' tokens one after another, stored as its document (the prefix) with an
empty question; its sampling says where the prompt is cut into inputs, the dimensions asked
for and how the vectors are written out:
`{"embed": {"lengths": [n1, n2, ...], "dimensions": d, "encoding_format": "base64"}}` (the
last two only when asked). A job whose sampling has no `embed` is a generating job.

The vectors are stored as one zstd frame: a small versioned header, then every vector's values
as little-endian float32 (what the engine computes them in, and what OpenAI's base64 encoding
writes).
Pure: plain values in, plain values (or bytes) out."""

from __future__ import annotations

import base64
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import zstandard

from jobsvc import compression

EMBED = "embed"
# How a request may ask its vectors to be written: JSON numbers, or OpenAI's base64 of
# little-endian float32.
ENCODING_FORMATS = ("float", "base64")
# A frame's header: magic, version, how many vectors, and the length of each.
_HEADER = struct.Struct("<4sBII")
_MAGIC = b"JVEC"
_VERSION = 1


class VectorFrameError(ValueError):
    """Bytes that are not a frame written by `pack_vectors`."""


def embedding_sampling(lengths: Sequence[int], dimensions: int | None = None,
                       encoding_format: str = "float") -> dict[str, Any]:
    """The stored sampling of an embedding job whose inputs have these token counts, in order."""
    embed: dict[str, Any] = {"lengths": [int(length) for length in lengths]}
    if dimensions is not None:
        embed["dimensions"] = int(dimensions)
    if encoding_format != "float":
        embed["encoding_format"] = encoding_format
    return {EMBED: embed}


def is_embedding(sampling: Mapping[str, Any]) -> bool:
    """Whether a job's stored sampling makes it an embedding job (no answer is generated: it is
    routed by load alone and its engine pools instead)."""
    return isinstance(sampling.get(EMBED), Mapping)


def input_lengths(sampling: Mapping[str, Any]) -> tuple[int, ...]:
    """The token count of each input of an embedding job, in order."""
    return tuple(int(length) for length in sampling[EMBED]["lengths"])


def requested_dimensions(sampling: Mapping[str, Any]) -> int | None:
    """The dimensions an embedding job asked its vectors cut to (None: the model's own)."""
    value = sampling[EMBED].get("dimensions")
    return None if value is None else int(value)


def encoding_format(sampling: Mapping[str, Any]) -> str:
    """How an embedding job's vectors are written out: `float` or `base64`."""
    return str(sampling[EMBED].get("encoding_format", "float"))


def split_inputs(prompt: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, ...]]:
    """A stored prompt cut back into its inputs; ValueError if the lengths do not add up to
    it (a prompt that did not read back as the producer stored it)."""
    if sum(lengths) != len(prompt) or any(length <= 0 for length in lengths):
        raise ValueError(f"a prompt of {len(prompt)} tokens cannot be cut into inputs of "
                         f"{list(lengths)} tokens")
    inputs, start = [], 0
    for length in lengths:
        inputs.append(tuple(prompt[start:start + length]))
        start += length
    return inputs


def pack_vectors(vectors: Sequence[Sequence[float]]) -> bytes:
    """Vectors of one length as one zstd frame of float32."""
    width = len(vectors[0]) if vectors else 0
    if any(len(vector) != width for vector in vectors):
        raise ValueError("the vectors of one job must have one length")
    values = array("f", [value for vector in vectors for value in vector])
    if sys.byteorder == "big":
        values.byteswap()
    return compression.compress(_HEADER.pack(_MAGIC, _VERSION, len(vectors), width)
                                + values.tobytes())


def unpack_vectors(frame: bytes) -> list[list[float]]:
    """The vectors of a `pack_vectors` frame; anything else raises VectorFrameError."""
    try:
        data = compression.decompress(frame)
    except (zstandard.ZstdError, compression.FrameTooLarge) as error:
        raise VectorFrameError(f"not a readable zstd frame ({error})") from None
    if len(data) < _HEADER.size:
        raise VectorFrameError(f"not a vector frame: {len(data)} bytes")
    magic, version, count, width = _HEADER.unpack_from(data)
    body = data[_HEADER.size:]
    if magic != _MAGIC or version != _VERSION or len(body) != 4 * count * width:
        raise VectorFrameError(f"not a vector frame of version {_VERSION}: magic {magic!r}, "
                               f"version {version}, {count} x {width} values in "
                               f"{len(body)} bytes")
    values = array("f")
    values.frombytes(body)
    if sys.byteorder == "big":
        values.byteswap()
    flat = values.tolist()
    return [flat[index * width:(index + 1) * width] for index in range(count)]


def base64_vector(vector: Sequence[float]) -> str:
    """A vector as OpenAI's `encoding_format: base64` writes it: base64 of little-endian
    float32."""
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")
