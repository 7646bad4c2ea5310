"""A batch file's structure: JSONL lines cut from a stream of chunks, each checked to be a
request of the batch (a JSON object with a `custom_id` of its own, `method` POST, the batch's
`url` and a `body` object). A file that breaks any of this fails as a whole, with the lines
named; what a request asks for is checked later, line by line (`jobsvc.batchapi.requests`).
Pure: bytes in, values out."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jobsvc.batchapi.requests import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT

# OpenAI's limit on requests in one batch file.
MAX_LINES = 50_000
# A failed file lists at most this many of its errors.
MAX_LISTED_ERRORS = 100
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)


def split_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, line without its end) for every non-blank line of the stream,
    holding no more than a chunk and the line that straddles it."""
    number = 0
    pending = b""
    for chunk in chunks:
        pieces = (pending + chunk).split(b"\n")
        pending = pieces.pop()
        for piece in pieces:
            number += 1
            if piece.strip():
                yield number, piece
    if pending.strip():
        yield number + 1, pending


@dataclass(frozen=True)
class FileError:
    """What fails a whole file, where (the batch object's `errors.data` entries)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_api(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "line": self.line,
                "param": self.param}


@dataclass(frozen=True)
class RequestLine:
    line: int
    custom_id: str
    body: dict[str, Any]


class LineStructureError(ValueError):
    def __init__(self, error: FileError) -> None:
        super().__init__(error.message)
        self.error = error


def parse_line(line: int, raw: bytes, endpoint: str) -> RequestLine:
    """The request on one line, or LineStructureError saying why the line is not one."""
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

    def add(self, line: int, raw: bytes) -> None:
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
