"""A multipart upload streamed into the file store as it arrives: the `file` part's bytes go
to a FileWriter a chunk at a time (never the whole file in memory, nor on disk first), other
form fields are kept if small, and an upload past its limit is refused the moment it passes.
The uploader's filename is kept as data only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from jobsvc.batchapi.filestore import CHUNK_BYTES, FileRecord, FileStore, FileTooLarge
from jobsvc.server.errors import ApiError

# Form fields other than the file are short (`purpose`): anything longer is refused.
_MAX_FIELD_BYTES = 1024
# Multipart framing around the file: boundaries, part headers and the small fields.
_FRAMING_BYTES = 64 * 1024


@dataclass
class _Form:
    """What the parser's callbacks have seen so far."""

    fields: dict[str, bytearray] = field(default_factory=dict)
    filename: str | None = None
    file_parts: int = 0
    pending: bytearray = field(default_factory=bytearray)
    _headers: dict[bytes, bytes] = field(default_factory=dict)
    _header_field: bytearray = field(default_factory=bytearray)
    _header_value: bytearray = field(default_factory=bytearray)
    _current: str | None = None
    _is_file: bool = False

    def callbacks(self) -> dict[str, object]:
        return {"on_part_begin": self._part_begin, "on_header_field": self._header_field_data,
                "on_header_value": self._header_value_data, "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished, "on_part_data": self._data}

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
        self._current = name
        if name == "file":
            self._is_file = True
            self.file_parts += 1
            self.filename = options.get(b"filename", b"").decode("utf-8", "replace")
        else:
            self.fields[name] = bytearray()

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self.pending += data[start:end]
        elif self._current is not None:
            value = self.fields[self._current]
            value += data[start:end]
            if len(value) > _MAX_FIELD_BYTES:
                raise ApiError(400, f"form field {self._current!r} is too long",
                               param=self._current)


async def receive_upload(stream: AsyncIterator[bytes], content_type: str, files: FileStore,
                         limit: int) -> FileRecord:
    """Store the `file` part of a multipart body (with `purpose=batch`) as a new file."""
    kind, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise ApiError(400, "send the file as multipart/form-data with fields file and "
                       "purpose", param="file")
    form = _Form()
    parser = MultipartParser(boundary, form.callbacks())  # type: ignore[arg-type]
    writer = files.writer("", "batch", limit=limit)
    await run_in_threadpool(writer.__enter__)
    try:
        async for chunk in stream:
            parser.write(chunk)
            if form.file_parts > 1:
                raise ApiError(400, "send one file per upload", param="file")
            if len(form.pending) >= CHUNK_BYTES:
                await run_in_threadpool(writer.write, bytes(form.pending))
                form.pending.clear()
        parser.finalize()
        if form.pending:
            await run_in_threadpool(writer.write, bytes(form.pending))
        _check(form)
        writer.rename(form.filename or "")
    except FileTooLarge as error:
        await run_in_threadpool(writer.__exit__, type(error), error, None)
        raise ApiError(413, str(error), param="file", code="file_too_large") from None
    except BaseException as error:
        await run_in_threadpool(writer.__exit__, type(error), error, None)
        raise
    await run_in_threadpool(writer.__exit__, None, None, None)
    assert writer.record is not None
    return writer.record


def _check(form: _Form) -> None:
    if form.file_parts != 1:
        raise ApiError(400, "the form has no file field", param="file",
                       code="missing_required_parameter")
    purpose = form.fields.get("purpose")
    if purpose is None:
        raise ApiError(400, "the form has no purpose field", param="purpose",
                       code="missing_required_parameter")
    if bytes(purpose) != b"batch":
        raise ApiError(400, f"purpose must be 'batch', got {purpose.decode(errors='replace')!r}",
                       param="purpose", code="invalid_value")


def too_large_to_accept(content_length: str | None, limit: int) -> bool:
    """True when the declared body is bigger than any upload within `limit` could be."""
    return content_length is not None and content_length.isdigit() and (
        int(content_length) > limit + _FRAMING_BYTES)
