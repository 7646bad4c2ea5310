"""The tables of the batch API (migration 0007), beside the job tables of `jobsvc.store`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, ForeignKey, Integer, LargeBinary, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from jobsvc.store import Base

# None is SQL NULL, not the JSON value null: "has an error" is `error IS NOT NULL`.
_JSON = JSON(none_as_null=True)


class StoredFile(Base):
    """An uploaded or produced file; its bytes are its chunks, in order."""

    __tablename__ = "files"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    # Whatever the uploader called it: shown back, never used as a path.
    filename: Mapped[str] = mapped_column(Text)
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class FileChunk(Base):
    """One chunk of a file's bytes: files are written and read a chunk at a time, never whole."""

    __tablename__ = "file_chunks"
    file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"),
                                         primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class BatchRow(Base):
    """A batch as the API shows it, plus how far its driver got and who drives it."""

    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(8))
    batch_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", _JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)
    # The end a batch in `finalizing` or `cancelling` is being taken to: completed,
    # cancelled or expired.
    ending: Mapped[str | None] = mapped_column(String(16))
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(_JSON)
    total: Mapped[int] = mapped_column(Integer, server_default="0")
    completed: Mapped[int] = mapped_column(Integer, server_default="0")
    failed: Mapped[int] = mapped_column(Integer, server_default="0")
    # The last line of the input file that has its row in batch_lines (0: none yet).
    ingested_line: Mapped[int] = mapped_column(Integer, server_default="0")
    usage: Mapped[dict[str, int] | None] = mapped_column(_JSON)
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    # The server driving the batch, and until when its claim holds unless renewed.
    driver: Mapped[str | None] = mapped_column(String(64))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class BatchLine(Base):
    """One request line of a batch: its job, or the error that kept it from becoming one."""

    __tablename__ = "batch_lines"
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"),
                                          primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(Text)
    job_id: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[dict[str, Any] | None] = mapped_column(_JSON)
