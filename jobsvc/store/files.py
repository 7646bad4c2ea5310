"""Files in PostgreSQL as numbered chunks of at most CHUNK_BYTES: a file is written a chunk at a
time and read back a chunk at a time, so no file is ever whole in memory. A file becomes
visible only when its last chunk commits, and a reader that finds a chunk gone says so."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any

from sqlalchemy import delete, insert, select, update
from sqlalchemy.engine import Connection, Engine

from jobsvc.store.dialect import dialect_of
from jobsvc.store.paging import page_rows
from jobsvc.store.records import utcnow
from jobsvc.store.tables import FileChunk, StoredFile

CHUNK_BYTES = 1 << 20


class FileVanished(RuntimeError):
    """A file was deleted while it was read: the bytes read so far are not the file, and
    whoever reads them must not take them for it."""


@dataclass(frozen=True)
class FileRecord:
    """A stored file as the API shows it, without its bytes."""

    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: datetime


def new_file_id() -> str:
    """A fresh file ID, in OpenAI's `file-` form."""
    return f"file-{uuid.uuid4().hex}"


def _record(row: Any) -> FileRecord:
    return FileRecord(row.id, row.filename, row.purpose, row.bytes, row.created_at)


class FileWriter:
    """Writes one file in one transaction: full chunks go to the database as they fill, the
    file's row when it is closed. Leaving the `with` block on an exception keeps nothing.
    The transaction lasts as long as the writing: feed it from what is at hand (a local
    file, a spooled upload, results), never from a client that may stall."""

    def __init__(self, engine: Engine, filename: str, purpose: str, *,
                 connection: Connection | None = None) -> None:
        self.file_id = new_file_id()
        self._filename = filename
        self._purpose = purpose
        self._engine = engine
        self._own_connection = connection is None
        self._connection = connection
        self._buffer = bytearray()
        self._seq = 0
        self.size = 0
        self.record: FileRecord | None = None

    def __enter__(self) -> FileWriter:
        if self._connection is None:
            self._connection = self._engine.connect()
            self._connection.begin()
        # The row first, so that chunks can point at it; its size is set when it closes.
        self._connection.execute(insert(StoredFile).values(
            id=self.file_id, filename=self._filename, purpose=self._purpose, bytes=0,
            created_at=utcnow()))
        return self

    def write(self, data: bytes) -> None:
        """Add bytes to the file; every full chunk goes to the database at once, so memory holds at
        most one chunk."""
        self.size += len(data)
        self._buffer += data
        while len(self._buffer) >= CHUNK_BYTES:
            self._flush(bytes(self._buffer[:CHUNK_BYTES]))
            del self._buffer[:CHUNK_BYTES]

    def _flush(self, chunk: bytes) -> None:
        assert self._connection is not None
        self._connection.execute(insert(FileChunk).values(file_id=self.file_id, seq=self._seq,
                                                          data=chunk))
        self._seq += 1

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self._connection is not None
        try:
            if exc_type is None:
                if self._buffer:
                    self._flush(bytes(self._buffer))
                    self._buffer.clear()
                created = self._connection.execute(
                    update(StoredFile).where(StoredFile.id == self.file_id)
                    .values(bytes=self.size, filename=self._filename)
                    .returning(StoredFile)).one()
                self.record = _record(created)
                if self._own_connection:
                    self._connection.commit()
            elif self._own_connection:
                self._connection.rollback()
        finally:
            if self._own_connection:
                self._connection.close()


class FileStore:
    """Every read and write of the files table and its chunks, in one place."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._sql = dialect_of(engine)

    def writer(self, filename: str, purpose: str, *,
               connection: Connection | None = None) -> FileWriter:
        """A writer for a new file; inside `connection`'s transaction if one is given."""
        return FileWriter(self._engine, filename, purpose, connection=connection)

    def get(self, file_id: str) -> FileRecord | None:
        """The file `file_id` (its row, not its bytes); None: no such file."""
        with self._engine.connect() as connection:
            row = connection.execute(select(StoredFile).where(StoredFile.id == file_id)).first()
        return None if row is None else _record(row)

    def page(self, *, after: str | None, limit: int, ascending: bool,
             purpose: str | None) -> tuple[list[FileRecord], bool]:
        """Up to `limit` files after the file `after` in creation order (newest first unless
        `ascending`), and whether more follow."""
        query = select(StoredFile)
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        with self._engine.connect() as connection:
            rows, more = page_rows(connection, query, StoredFile.created_at, StoredFile.id,
                                   after=after, limit=limit, ascending=ascending)
        return [_record(row) for row in rows], more

    def delete(self, file_id: str) -> bool:
        """Delete a file and, by cascade, its chunks; false: there was no such file."""
        with self._engine.begin() as connection:
            return connection.execute(
                delete(StoredFile).where(StoredFile.id == file_id)).rowcount > 0

    def chunks(self, file_id: str) -> Iterator[bytes]:
        """The file's bytes, a chunk per query, so no more than one chunk is held and no
        transaction waits on the reader. A file deleted before its last byte is read raises
        FileVanished rather than ending early: a short file is not the file."""
        with self._engine.connect() as connection:
            size = connection.execute(select(StoredFile.bytes).where(
                StoredFile.id == file_id)).scalar_one_or_none()
        if size is None:
            raise FileVanished(f"file {file_id} was deleted before it was read")
        read = seq = 0
        while read < size:
            with self._engine.connect() as connection:
                data = self._sql.bytes_scalar(connection, select(FileChunk.data).where(
                    FileChunk.file_id == file_id, FileChunk.seq == seq))
            if data is None:
                raise FileVanished(f"file {file_id} was deleted after {read} of its "
                                   f"{size} bytes were read")
            yield data
            read += len(data)
            seq += 1
