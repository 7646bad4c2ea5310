"""A multipart upload, received whole before the database sees any of it: the `file` part's
bytes go to a spool (in memory up to a chunk, then a temporary file), the few other form
fields are kept if short, and the file is written to the store in one short transaction only
once the body has ended with its closing boundary. So a stalled upload holds no database
connection, and a cut-short or malformed one leaves nothing. The uploader's filename is kept
as data only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from tempfile import SpooledTemporaryFile
from typing import IO

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from jobsvc.server.errors import ApiError
from jobsvc.store.files import CHUNK_BYTES, FileRecord, FileStore
from jobsvc.validation import text_fault

# Form fields other than the file are short (`purpose`): anything longer is refused.
_MAX_FIELD_BYTES = 1024
# The file, `purpose` and the few optional fields OpenAI defines (`expires_after[...]`).
_MAX_PARTS = 8


def _incomplete(why: str) -> ApiError:
    return ApiError(400, f"{why}; nothing was kept, send the whole file again", param="file",
                    code="incomplete_upload")


@dataclass
class _Form:
    """What the parser's callbacks have seen so far; the file's bytes are in `spool`."""

    spool: IO[bytes]
    limit: int
    fields: dict[str, bytearray] = field(default_factory=dict)
    filename: str | None = None
    file_parts: int = 0
    file_bytes: int = 0
    parts: int = 0
    ended: bool = False
    _headers: dict[bytes, bytes] = field(default_factory=dict)
    _header_field: bytearray = field(default_factory=bytearray)
    _header_value: bytearray = field(default_factory=bytearray)
    _current: str | None = None
    _is_file: bool = False

    def callbacks(self) -> dict[str, object]:
        return {"on_part_begin": self._part_begin, "on_header_field": self._header_field_data,
                "on_header_value": self._header_value_data, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished, "on_part_data": self._data,
                "on_end": self._end}

    def _part_begin(self) -> None:
        self._headers = {}
        self._current = None
        self._is_file = False

    def _header_field_data(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        self._headers[bytes(self._header_field).lower()] = bytes(self._header_value)
        self._header_field.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition"))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        self.parts += 1
        if self.parts > _MAX_PARTS:
            raise ApiError(400, f"the form has more than {_MAX_PARTS} fields; send file and "
                           "purpose", param="file", code="too_many_fields")
        self._current = name
        if name == "file":
            self._is_file = True
            self.file_parts += 1
            if self.file_parts > 1:
                raise ApiError(400, "send one file per upload", param="file")
            self.filename = options.get(b"filename", b"").decode("utf-8", "replace")
        else:
            self.fields[name] = bytearray()

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self.file_bytes += end - start
            if self.file_bytes > self.limit:
                raise ApiError(413, f"the file is larger than {self.limit} bytes "
                               "(JOBSVC_MAX_UPLOAD_BYTES)", param="file", code="file_too_large")
            # A chunk of the body at most; once the spool is on disk, the page cache takes it.
            self.spool.write(data[start:end])
        elif self._current is not None:
            value = self.fields[self._current]
            value += data[start:end]
            if len(value) > _MAX_FIELD_BYTES:
                raise ApiError(400, f"form field {self._current!r} is too long",
                               param=self._current)

    def _end(self) -> None:
        self.ended = True


async def receive_upload(stream: AsyncIterator[bytes], content_type: str, files: FileStore,
                         limit: int) -> FileRecord:
    """Store the `file` part of a multipart body (with `purpose=batch`) as a new file."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise ApiError(400, "send the file as multipart/form-data with fields file and "
                       "purpose", param="file")
    with SpooledTemporaryFile(max_size=CHUNK_BYTES) as spool:
        form = _Form(spool, limit)
        try:
            parser = MultipartParser(boundary, form.callbacks())  # type: ignore[arg-type]
            async for chunk in stream:
                parser.write(chunk)
        except FormParserError as error:
            raise ApiError(400, f"the multipart body is malformed ({error})", param="file",
                           code="invalid_multipart") from None
        except ClientDisconnect:
            raise _incomplete("the client left before the upload ended") from None
        if not form.ended:
            raise _incomplete("the upload ends before the form's closing boundary")
        _check(form)
        spool.seek(0)
        return await run_in_threadpool(_store, files, spool, form.filename or "")


def _store(files: FileStore, spool: IO[bytes], filename: str) -> FileRecord:
    """The whole upload into the store, read from the spool: the transaction lasts as long
    as a local read, whatever the client did."""
    with files.writer(filename, "batch") as writer:
        while chunk := spool.read(CHUNK_BYTES):
            writer.write(chunk)
    assert writer.record is not None
    return writer.record


def _check(form: _Form) -> None:
    if form.file_parts != 1:
        raise ApiError(400, "the form has no file field", param="file",
                       code="missing_required_parameter")
    if fault := text_fault(form.filename or ""):
        raise ApiError(400, f"the file's name contains {fault}; rename it", param="file",
                       code="invalid_value")
    purpose = form.fields.get("purpose")
    if purpose is None:
        raise ApiError(400, "the form has no purpose field", param="purpose",
                       code="missing_required_parameter")
    if bytes(purpose) != b"batch":
        raise ApiError(400, f"purpose must be 'batch', got {purpose.decode(errors='replace')!r}",
                       param="purpose", code="invalid_value")
