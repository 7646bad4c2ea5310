"""Batch lines the server cannot safely parse, keep or tokenize: each fails alone with a named
code (or fails the file when its custom_id cannot be read), and no line is held longer than
its cap."""

from __future__ import annotations

import json

import pytest

from jobsvc.batchapi.line_requests import CHAT_ENDPOINT
from jobsvc.batchapi.lines import (
    MAX_DEPTH,
    FileCheck,
    LineStructureError,
    OversizedLine,
    parse_line,
    split_lines,
)

pytestmark = pytest.mark.unit


def raw_line(custom_id: str, body: object) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT_ENDPOINT,
                       "body": body}).encode()


def chat(content: str, **extra: object) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": content}], **extra}


@pytest.mark.parametrize(("raw", "custom_id", "param"), [
    (raw_line("nul\x00id", chat("hi")), "nul\ufffdid", "custom_id"),
    (raw_line("lone\ud800", chat("hi")), "lone\ufffd", "custom_id"),
    (raw_line("a", chat("text \ud83d alone")), "a", "messages[0].content"),
    (raw_line("b", chat("nul \x00")), "b", "messages[0].content"),
    (raw_line("c", chat("hi", stop=["ok", "\udfff"])), "c", "stop[1]"),
    (raw_line("d", chat("hi", metadata={"k\x00": "v"})), "d", "metadata.k\ufffd"),
    # Escapes in upper case, and a surrogate written as UTF-8 bytes, decode to the same.
    (raw_line("e", chat("hi")).replace(b'"hi"', b'"h\\uDBFFi"'), "e", "messages[0].content"),
    (raw_line("f", chat("hi")).replace(b'"hi"', '"h\udc00i"'.encode(errors="surrogatepass")),
     "f", "messages[0].content"),
    ('\ufeff'.encode() + raw_line("g", chat("hi")).replace(b'"hi"', b'"h\\u0000"'), "g",
     "messages[0].content"),
])
def test_text_that_cannot_be_stored_or_tokenized_fails_its_line_alone(
        raw: bytes, custom_id: str, param: str) -> None:
    request = parse_line(7, raw, CHAT_ENDPOINT)
    assert request.refused is not None and request.body == {}
    assert request.custom_id == custom_id
    assert (request.refused.code, request.refused.param) == ("invalid_text", param)
    assert "\x00" not in str(request.refused) and request.custom_id.encode()


@pytest.mark.parametrize("content", ["caf\u00e9 \U0001f600 \u4e2d", "a \\u0000 written out"])
@pytest.mark.parametrize("ascii_only", [True, False])
def test_text_beyond_ascii_and_escaped_backslashes_pass_as_they_are(
        content: str, ascii_only: bool) -> None:
    raw = json.dumps({"custom_id": "ok\u00e9", "method": "POST", "url": CHAT_ENDPOINT,
                      "body": chat(content)}, ensure_ascii=ascii_only).encode()
    request = parse_line(2, raw, CHAT_ENDPOINT)
    assert request.refused is None
    assert (request.custom_id, request.body) == ("ok\u00e9", chat(content))


def test_json_nested_too_deep_fails_its_line_without_being_parsed() -> None:
    depth = 100_000
    raw = b'{"custom_id": "deep", "method": "POST", "url": "/v1/chat/completions", "body": ' \
          + b'{"messages": ' + b"[" * depth + b"]" * depth + b"}}"
    request = parse_line(3, raw, CHAT_ENDPOINT)
    assert request.custom_id == "deep"
    assert request.refused is not None and request.refused.code == "nesting_too_deep"
    nested = {"x": 1}
    for _ in range(MAX_DEPTH - 3):
        nested = {"x": nested}
    assert parse_line(4, raw_line("fine", chat("hi", metadata=nested)),
                      CHAT_ENDPOINT).refused is None


def test_a_line_over_the_cap_is_held_by_its_ends_and_refused_by_its_custom_id() -> None:
    cap = 1000
    first = raw_line("head", chat("x" * 5000))
    last = b'{"method": "POST", "url": "/v1/chat/completions", "body": ' \
           + json.dumps(chat("y" * 5000)).encode() + b', "custom_id": "tail"}'
    nowhere = b'{"method": "POST", "body": ' + json.dumps(chat("z" * 9000)).encode() \
              + b', "custom_id": "middle", "url": "/v1/chat/completions"}'
    data = b"\n".join([raw_line("small", chat("hi")), first, last, nowhere])
    chunks = [data[i:i + 333] for i in range(0, len(data), 333)]
    lines = list(split_lines(chunks, cap))
    assert [number for number, _ in lines] == [1, 2, 3, 4]
    assert isinstance(lines[0][1], bytes)
    for (_, raw), size in zip(lines[1:], (len(first), len(last), len(nowhere)), strict=True):
        assert isinstance(raw, OversizedLine) and raw.size == size
        assert len(raw.head) <= 4096 and len(raw.tail) <= 4096
    refused = [parse_line(number, raw, CHAT_ENDPOINT) for number, raw in lines[1:3]]
    assert [(r.custom_id, r.refused and r.refused.code) for r in refused] == [
        ("head", "line_too_long"), ("tail", "line_too_long")]
    with pytest.raises(LineStructureError) as unnamed:
        parse_line(4, lines[3][1], CHAT_ENDPOINT)
    assert (unnamed.value.error.code, unnamed.value.error.line) == ("line_too_long", 4)


def test_a_file_with_poison_lines_passes_validation_and_a_bad_custom_id_counts_once() -> None:
    check = FileCheck(CHAT_ENDPOINT)
    for number, raw in enumerate([raw_line("a\x00", chat("hi")),
                                  raw_line("b\ud800", chat("hi")),
                                  raw_line("c", chat("\ud800"))], start=1):
        check.add(number, raw)
    check.finish()
    assert not check.failed and check.requests == 3
