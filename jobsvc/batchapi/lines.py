"""A batch file's structure: JSONL lines cut from a stream of chunks, each checked to be a
request of the batch (a JSON object with a `custom_id` of its own, `method` POST, the batch's
`url` and a `body` object). A file that breaks any of this fails as a whole, with the lines
named. A line the server cannot safely take apart or keep (longer than any request the
model's context holds, nested too deep, or with text PostgreSQL and the tokenizer refuse) is
refused alone, before it is parsed or stored, as long as its custom_id can be read; what a
request asks for is checked later, line by line (`jobsvc.batchapi.line_requests`).
Pure: bytes in, values out."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jobsvc.batchapi.line_requests import (
    CHAT_ENDPOINT,
    COMPLETIONS_ENDPOINT,
    EMBEDDINGS_ENDPOINT,
    RESPONSES_ENDPOINT,
    LineError,
)
from jobsvc.validation import first_unstorable, storable

# OpenAI's limit on requests in one batch file.
MAX_LINES = 50_000
# A failed file lists at most this many of its errors.
MAX_LISTED_ERRORS = 100
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, RESPONSES_ENDPOINT, EMBEDDINGS_ENDPOINT)
# Deepest nesting of a line's JSON: Python's parser recurses once per level, and no request
# needs more than a handful.
MAX_DEPTH = 32
# Bytes kept of each end of a line over the cap, to find its custom_id there.
_END_BYTES = 4096
# A line's cap per token of the model's context, and for its envelope and settings: a token
# is at most a few dozen bytes of text, JSON escapes a character in at most twelve, so a
# longer line could never fit the context; it is refused without being parsed or tokenized.
_LINE_BYTES_PER_TOKEN = 64
_LINE_ENVELOPE_BYTES = 64 << 10
# A JSON string literal, and the tokens that nesting is counted on.
_STRING = rb'"(?:[^"\\]|\\.)*"'
_TOKENS = re.compile(_STRING + rb"|[\[\]{}]")
_VALUE = re.compile(rb"\s*:\s*(" + _STRING + rb")")
# The last member of the top-level object, when it is the custom_id.
_LAST_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*(' + _STRING + rb")\s*}\s*$")
# What a line's bytes must hold for its parsed text to hold a NUL or a lone surrogate: a NUL
# byte (also in every UTF-16 or UTF-32 line), an escape of NUL or of a surrogate, or a surrogate
# encoded in UTF-8 (JSON's parser lets those through). A line without any is not searched
# string by string.
_MAY_BE_UNSTORABLE = re.compile(rb"\x00|\\u(?:0000|[dD][89a-fA-F])|\xed[\xa0-\xbf]")


@dataclass(frozen=True)
class OversizedLine:
    """A line longer than the cap: only its size and its two ends are kept."""

    size: int
    limit: int
    head: bytes
    tail: bytes


RawLine = bytes | OversizedLine


def max_line_bytes(context_length: int) -> int:
    """The longest line a request within a context of `context_length` tokens can take."""
    return context_length * _LINE_BYTES_PER_TOKEN + _LINE_ENVELOPE_BYTES


class _LineBuffer:
    """The line being cut: whole up to the cap, its two ends beyond it."""

    def __init__(self, limit: int | None) -> None:
        self._limit = limit
        self._data = bytearray()
        self._size = 0
        self._tail = b""

    def add(self, piece: memoryview) -> None:
        self._size += len(piece)
        if self._limit is None or self._size <= self._limit:
            self._data += piece
            return
        if not self._tail:
            # The cap is passed here: what is held becomes the line's two ends.
            self._tail = bytes(self._data[-_END_BYTES:])
            self._data += piece[:_END_BYTES]
            del self._data[_END_BYTES:]
        self._tail = (self._tail + bytes(piece[-_END_BYTES:]))[-_END_BYTES:]

    def take(self) -> RawLine | None:
        """The line cut so far (None if blank), and an empty buffer for the next one."""
        raw: RawLine | None
        if self._tail and self._limit is not None:
            raw = OversizedLine(self._size, self._limit, bytes(self._data), self._tail)
        else:
            raw = bytes(self._data) if self._data.strip() else None
        self._data = bytearray()
        self._size = 0
        self._tail = b""
        return raw


def split_lines(chunks: Iterable[bytes], cap: int | None = None
                ) -> Iterator[tuple[int, RawLine]]:
    """(line number from 1, line without its end) for every non-blank line of the stream,
    holding no more than a chunk and the line that straddles it; a line longer than `cap`
    bytes comes as an OversizedLine, never held whole."""
    number = 0
    line = _LineBuffer(cap)
    for chunk in chunks:
        view = memoryview(chunk)
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            line.add(view[start:end])
            number += 1
            if (raw := line.take()) is not None:
                yield number, raw
            start = end + 1
        line.add(view[start:])
    if (raw := line.take()) is not None:
        yield number + 1, raw


@dataclass(frozen=True)
class FileError:
    """What fails a whole file, where (the batch object's `errors.data` entries)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_api(self) -> dict[str, Any]:
        """The error as an entry of the batch object's `errors.data`."""
        return {"code": self.code, "message": self.message, "line": self.line,
                "param": self.param}


@dataclass(frozen=True)
class RequestLine:
    """One request line of a batch file, its structure checked; what the body asks for is checked
    later, line by line."""

    line: int
    custom_id: str
    body: dict[str, Any]
    # Why the line fails alone before its body is read (its body is then empty).
    refused: LineError | None = None


class LineStructureError(ValueError):
    """A line that breaks the file's structure, so the whole file fails; `error` says why."""

    def __init__(self, error: FileError) -> None:
        super().__init__(error.message)
        self.error = error


def _custom_id(literal: bytes) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) and value else None


def _leading_custom_id(data: bytes) -> str | None:
    """The custom_id of the top-level object, read without parsing the line (which may be
    nested too deep for the parser, or be only the line's first bytes)."""
    depth = 0
    for token in _TOKENS.finditer(data):
        text = token.group()
        if text in (b"{", b"["):
            depth += 1
        elif text in (b"}", b"]"):
            depth -= 1
        elif depth == 1 and text == b'"custom_id"':
            value = _VALUE.match(data, token.end())
            if value is not None:
                return _custom_id(value.group(1))
    return None


def _depth(data: bytes) -> int:
    """How deep the line's JSON nests (counted only as far as MAX_DEPTH + 1)."""
    if data.count(b"[") + data.count(b"{") <= MAX_DEPTH:
        return 0
    depth = 0
    for token in _TOKENS.finditer(data):
        text = token.group()
        if text in (b"{", b"["):
            depth += 1
            if depth > MAX_DEPTH:
                break
        elif text in (b"}", b"]"):
            depth -= 1
    return depth


def _refused_alone(line: int, custom_id: str | None, error: LineError) -> RequestLine:
    """A line that fails alone, when its custom_id was found; else it fails the file."""
    if custom_id is None:
        raise LineStructureError(FileError(
            error.code, f"line {line}: {error}, and no custom_id was found at its start or "
            "end", line, "custom_id"))
    return RequestLine(line, storable(custom_id), {}, error)


def _may_be_unstorable(raw: bytes) -> bool:
    """Whether the line's text may hold what `first_unstorable` refuses: a line that opens
    with a byte beyond ASCII (a byte order mark: the parser may read it as UTF-16 or UTF-32)
    or holds a byte sequence that can decode to it."""
    if raw[:1] >= b"\x80":
        return True
    # Searching for each byte alone is quicker than the pattern, which few lines need.
    return (b"\\u" in raw or b"\x00" in raw or b"\xed" in raw) and (
        _MAY_BE_UNSTORABLE.search(raw) is not None)


def parse_line(line: int, raw: RawLine, endpoint: str) -> RequestLine:
    """The request on one line, or LineStructureError saying why the line is not one."""
    if isinstance(raw, OversizedLine):
        custom_id = _leading_custom_id(raw.head)
        if custom_id is None and (last := _LAST_CUSTOM_ID.search(raw.tail)):
            custom_id = _custom_id(last.group(1))
        return _refused_alone(line, custom_id, LineError(
            f"the request is {raw.size} bytes, longer than any request the model's context "
            f"can hold ({raw.limit} bytes)", "body", "line_too_long"))
    if _depth(raw) > MAX_DEPTH:
        return _refused_alone(line, _leading_custom_id(raw), LineError(
            f"the request nests deeper than {MAX_DEPTH} levels", "body", "nesting_too_deep"))
    try:
        item = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise LineStructureError(FileError(
            "invalid_json_line", f"line {line} is not valid JSON ({error})", line)) from None
    if not isinstance(item, dict):
        raise LineStructureError(FileError(
            "invalid_request", f"line {line} is not a JSON object", line))
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineStructureError(FileError(
            "missing_required_parameter", f"line {line} has no custom_id (a non-empty string)",
            line, "custom_id"))
    if item.get("method") != "POST":
        raise LineStructureError(FileError(
            "invalid_method", f"line {line}: method must be POST, got {item.get('method')!r}",
            line, "method"))
    if item.get("url") != endpoint:
        raise LineStructureError(FileError(
            "invalid_url", f"line {line}: url must be the batch's endpoint {endpoint}, got "
            f"{item.get('url')!r}", line, "url"))
    body = item.get("body")
    if not isinstance(body, dict):
        raise LineStructureError(FileError(
            "invalid_request", f"line {line}: body must be a JSON object", line, "body"))
    if not _may_be_unstorable(raw):
        return RequestLine(line, custom_id, body)
    if found := first_unstorable(custom_id, "custom_id") or first_unstorable(body):
        param, fault = found
        return _refused_alone(line, custom_id, LineError(
            f"{param} contains {fault}, which can be neither stored nor tokenized; remove it",
            param, "invalid_text"))
    return RequestLine(line, custom_id, body)


@dataclass
class FileCheck:
    """Checks a file's lines one at a time (for custom_ids seen, 8 bytes of hash and a line
    number each): `errors` holds what fails the file, at most MAX_LISTED_ERRORS of them, and
    `failed` is true once there is any."""

    endpoint: str
    requests: int = 0
    errors: list[FileError] = field(default_factory=list)
    failed: bool = False
    _first_line_of: dict[bytes, int] = field(default_factory=dict)

    def add(self, line: int, raw: RawLine) -> None:
        """Check the next line's structure and that its custom_id is new; else the file fails."""
        self.requests += 1
        if self.requests > MAX_LINES:
            self._fail(FileError("too_many_requests", f"the file has more than {MAX_LINES} "
                                 f"requests (line {line} is request {self.requests})", line))
            return
        try:
            request = parse_line(line, raw, self.endpoint)
        except LineStructureError as error:
            self._fail(error.error)
            return
        digest = hashlib.blake2b(request.custom_id.encode(), digest_size=8).digest()
        first = self._first_line_of.setdefault(digest, line)
        if first != line:
            self._fail(FileError(
                "duplicate_custom_id", f"line {line} repeats the custom_id "
                f"{request.custom_id!r} of line {first}", line, "custom_id"))

    def finish(self) -> None:
        """Check what only the end of the file can tell: a file without requests fails."""
        if self.requests == 0:
            self._fail(FileError("empty_file", "the file holds no requests"))

    @property
    def over_limit(self) -> bool:
        """No line after this one can change the verdict: stop reading."""
        return self.requests > MAX_LINES or len(self.errors) >= MAX_LISTED_ERRORS

    def _fail(self, error: FileError) -> None:
        self.failed = True
        if len(self.errors) < MAX_LISTED_ERRORS:
            self.errors.append(error)
