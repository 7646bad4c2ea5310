"""Embedding jobs without an engine: the stored vector frames, the sampling that makes a job an
embedding job, an embeddings line's parsing with its refusals named by field, the checks
against the model, and the lines written back in OpenAI's and vLLM's shapes."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from jobsvc.batchapi.line_requests import (
    EMBEDDINGS_ENDPOINT,
    EmbeddingRequest,
    LineError,
    parse_request,
)
from jobsvc.batchapi.output_lines import Answer, FinishedLine, openai_line, vllm_line
from jobsvc.embeddings import (
    VectorFrameError,
    base64_vector,
    embedding_sampling,
    encoding_format,
    input_lengths,
    is_embedding,
    pack_vectors,
    requested_dimensions,
    split_inputs,
    unpack_vectors,
)
from jobsvc.errors import InvalidJob
from jobsvc.prompts import PromptBuilder
from jobsvc.validation import (
    MAX_EMBEDDING_INPUTS,
    ContextExceeded,
    JobLimits,
    check_dimensions,
    check_embedding_prompt,
)

pytestmark = pytest.mark.unit

LIMITS = JobLimits(max_document_chars=100, max_question_chars=100, max_stop_chars=100,
                   max_job_bytes=1 << 20, priority_scheduling=False)
FLOAT32 = st.floats(width=32, allow_nan=False)


@given(st.integers(0, 4).flatmap(lambda width: st.lists(
    st.lists(FLOAT32, min_size=width, max_size=width), max_size=5)))
def test_vector_frames_round_trip_float32_values_exactly(vectors: list[list[float]]) -> None:
    assert unpack_vectors(pack_vectors(vectors)) == vectors


def test_a_frame_holds_little_endian_float32_after_its_header() -> None:
    data = zstandard.ZstdDecompressor().decompress(pack_vectors([[1.0, -2.5], [0.5, 3.0]]))
    assert data[-16:] == struct.pack("<4f", 1.0, -2.5, 0.5, 3.0)
    assert len(data) == 13 + 16


@pytest.mark.parametrize("frame", [
    b"", b"not zstd", zstandard.ZstdCompressor().compress(b"JVEC"),
    zstandard.ZstdCompressor().compress(struct.pack("<4sBII", b"JVEC", 1, 2, 3) + b"\0" * 20),
    zstandard.ZstdCompressor().compress(struct.pack("<4sBII", b"JVEC", 9, 0, 0)),
], ids=["empty", "not-zstd", "short", "wrong-size", "unknown-version"])
def test_anything_but_a_vector_frame_is_refused(frame: bytes) -> None:
    with pytest.raises(VectorFrameError):
        unpack_vectors(frame)


def test_vectors_of_one_job_share_their_length() -> None:
    with pytest.raises(ValueError, match="one length"):
        pack_vectors([[1.0], [1.0, 2.0]])


def test_base64_is_little_endian_float32_as_openai_writes_it() -> None:
    encoded = base64_vector([0.25, -1.0, 3.5])
    assert base64.b64decode(encoded) == struct.pack("<3f", 0.25, -1.0, 3.5)


def test_an_embedding_jobs_sampling_says_where_its_inputs_are_cut() -> None:
    plain = embedding_sampling([3, 2])
    assert plain == {"embed": {"lengths": [3, 2]}}
    assert is_embedding(plain) and not is_embedding({"max_tokens": 16, "temperature": 0})
    asked = embedding_sampling([4], dimensions=64, encoding_format="base64")
    assert asked == {"embed": {"lengths": [4], "dimensions": 64, "encoding_format": "base64"}}
    assert (input_lengths(asked), requested_dimensions(asked), encoding_format(asked)) == (
        (4,), 64, "base64")
    assert (requested_dimensions(plain), encoding_format(plain)) == (None, "float")
    assert split_inputs([1, 2, 3, 4, 5], input_lengths(plain)) == [(1, 2, 3), (4, 5)]
    with pytest.raises(ValueError, match="cannot be cut"):
        split_inputs([1, 2, 3], [3, 2])


def _parse(body: dict[str, Any]) -> EmbeddingRequest:
    parsed = parse_request(EMBEDDINGS_ENDPOINT, body, limits=LIMITS)
    assert isinstance(parsed, EmbeddingRequest)
    return parsed


@pytest.mark.parametrize(("given_input", "inputs"), [
    ("one text", ["one text"]),
    (["a", "b"], ["a", "b"]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6], [7]], [[5, 6], [7]]),
])
def test_an_embeddings_line_takes_every_input_shape_openai_takes(
        given_input: Any, inputs: list[Any]) -> None:
    parsed = _parse({"input": given_input, "model": "m", "user": "u"})
    assert (parsed.inputs, parsed.dimensions, parsed.encoding_format, parsed.model) == (
        inputs, None, "float", "m")
    options = _parse({"input": "x", "dimensions": 64, "encoding_format": "base64"})
    assert (options.dimensions, options.encoding_format) == (64, "base64")


@pytest.mark.parametrize(("body", "param", "code"), [
    ({}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": ""}, "input", "invalid_value"),
    ({"input": ["a", ""]}, "input[1]", "invalid_value"),
    ({"input": ["a", [1, 2]]}, "input[1]", "invalid_value"),
    ({"input": [[1], []]}, "input[1]", "invalid_value"),
    ({"input": [[1, True]]}, "input[0]", "invalid_value"),
    ({"input": [-1, 2]}, "input[0]", "invalid_value"),
    ({"input": "x" * 101}, "input", "invalid_value"),
    ({"input": ["x"] * (MAX_EMBEDDING_INPUTS + 1)}, "input", "invalid_value"),
    ({"input": "x", "dimensions": 0}, "dimensions", "invalid_value"),
    ({"input": "x", "dimensions": "64"}, "dimensions", "invalid_value"),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format", "invalid_value"),
    ({"input": "x", "bogus": 1}, "bogus", "unsupported_parameter"),
    ({"input": "x", "max_tokens": 4}, "max_tokens", "unsupported_parameter"),
])
def test_an_embeddings_line_is_refused_naming_its_field(
        body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(LineError) as refused:
        parse_request(EMBEDDINGS_ENDPOINT, body, limits=LIMITS)
    assert (refused.value.param, refused.value.code) == (param, code)


def test_dimensions_must_be_ones_the_model_can_cut_its_vectors_to() -> None:
    assert check_dimensions(64, [64, 128]) == 64
    assert check_dimensions(100, range(1, 257)) == 100
    for value, supported in ((96, [64, 128]), (300, range(1, 257)), (64, None)):
        with pytest.raises(InvalidJob) as refused:
            check_dimensions(value, supported)
        assert refused.value.field == "dimensions"


def test_each_input_fits_the_vocabulary_and_the_context_on_its_own() -> None:
    check_embedding_prompt([[1] * 10, [2] * 10], context=10, vocabulary=8)
    with pytest.raises(ContextExceeded) as too_long:
        check_embedding_prompt([[1] * 10, [2] * 11], context=10, vocabulary=8)
    assert too_long.value.field == "input[1]"
    with pytest.raises(InvalidJob) as outside:
        check_embedding_prompt([[8]], context=10, vocabulary=8)
    assert outside.value.field == "input"


@pytest.mark.parametrize(("config", "supported"), [
    ({"hidden_size": 256, "matryoshka_dimensions": [64, 256]}, [64, 256]),
    ({"hidden_size": 256, "is_matryoshka": True}, range(1, 257)),
    ({"hidden_size": 256}, None),
])
def test_the_producer_reads_matryoshka_support_where_vllm_does(
        tmp_path: Path, config: dict[str, Any], supported: Any) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert PromptBuilder(str(tmp_path)).matryoshka == supported


def _answer(sampling: dict[str, Any]) -> FinishedLine:
    return FinishedLine("job1", "c1", Answer(
        "job1", "", 5, 0, 0, 0, 1_700_000_000, sampling=sampling,
        embeddings=[[0.5, -1.0], [2.0, 0.25]]))


def test_an_answer_is_openais_embedding_list_and_vllms_with_its_fields_in_order() -> None:
    line = _answer(embedding_sampling([3, 2]))
    body = openai_line(line, endpoint=EMBEDDINGS_ENDPOINT, model="emb")["response"]["body"]
    assert body == {"object": "list", "model": "emb",
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -1.0]},
                             {"object": "embedding", "index": 1, "embedding": [2.0, 0.25]}],
                    "usage": {"prompt_tokens": 5, "total_tokens": 5}}
    vllm = vllm_line(line, endpoint=EMBEDDINGS_ENDPOINT, model="emb")
    vllm_body = vllm["response"]["body"]
    assert list(vllm_body) == ["id", "object", "created", "model", "data", "usage"]
    assert list(vllm_body["data"][0]) == ["index", "object", "embedding"]
    assert vllm_body["usage"] == {"prompt_tokens": 5, "total_tokens": 5, "completion_tokens": 0,
                                  "prompt_tokens_details": None,
                                  "completion_tokens_details": None}
    assert vllm_body["id"] == "embd-job1" and vllm["error"] is None


def test_a_base64_answer_writes_each_vector_as_openai_does() -> None:
    line = _answer(embedding_sampling([3, 2], encoding_format="base64"))
    data = openai_line(line, endpoint=EMBEDDINGS_ENDPOINT, model="emb")["response"]["body"]["data"]
    assert [base64.b64decode(item["embedding"]) for item in data] == [
        struct.pack("<2f", 0.5, -1.0), struct.pack("<2f", 2.0, 0.25)]
