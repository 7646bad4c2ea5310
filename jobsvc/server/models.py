"""The response objects, each field the official `openai` client's types declare pinned
(`FileObject`, `Batch`, `BatchRequestCounts`, `BatchUsage`, `BatchError`, `Model`, the cursor
pages), the one request body the server parses as JSON, and the text a request may give."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel

from jobsvc.store.batches import BatchRecord, Tally
from jobsvc.store.files import FileRecord
from jobsvc.validation import text_fault


def _storable(value: str) -> str:
    if fault := text_fault(value):
        raise ValueError(f"contains {fault}; remove it")
    return value


# Text a request gives that the server stores or looks up (IDs, cursors, names, metadata):
# PostgreSQL's text refuses what `text_fault` names, so it is the client's 400, naming the
# field, before the database is asked.
RequestText = Annotated[str, AfterValidator(_storable)]


def _seconds(moment: datetime | None) -> int | None:
    return None if moment is None else int(moment.timestamp())


class FileObject(BaseModel):
    """A file as the client's `FileObject` declares it."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None

    @classmethod
    def of(cls, record: FileRecord) -> FileObject:
        """The API object of a stored file."""
        return cls(id=record.id, bytes=record.bytes, created_at=_seconds(record.created_at),
                   filename=record.filename, purpose=record.purpose)


class FileDeleted(BaseModel):
    """What deleting a file answers."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool


class FileList(BaseModel):
    """A cursor page of files, as the client's pager reads it."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, files: list[FileObject], has_more: bool) -> FileList:
        """The page of these files, its first and last IDs set for the pager."""
        return cls(data=files, first_id=files[0].id if files else None,
                   last_id=files[-1].id if files else None, has_more=has_more)


class BatchError(BaseModel):
    """One reason a batch failed, pointing at a line and field where there is one."""

    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    """A failed batch's reasons, as a list object."""

    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchRequestCounts(BaseModel):
    """How many of a batch's requests there are, and how many succeeded or failed."""

    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    """The input tokens served from the prefix cache."""

    cached_tokens: int


class OutputTokensDetails(BaseModel):
    """Reasoning tokens: always 0 here, present because the client's type requires it."""

    reasoning_tokens: int


class BatchUsage(BaseModel):
    """The tokens a batch's succeeded requests used, as the client's `BatchUsage` declares them."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


# The usage of a batch no request has counted in yet.
_NO_USAGE = Tally(0, 0, 0, 0, 0, 0, 0).usage()


class BatchObject(BaseModel):
    """A batch as the client's `Batch` declares it, every field present."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed",
                    "expired", "cancelling", "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    errors: BatchErrors | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None

    @classmethod
    def of(cls, batch: BatchRecord, model: str) -> BatchObject:
        """The API object of a stored batch, times in epoch seconds."""
        stamps = {name: _seconds(getattr(batch, name)) for name in (
            "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
            "expired_at", "cancelling_at", "cancelled_at")}
        return cls(
            id=batch.id, endpoint=batch.endpoint, model=model,
            input_file_id=batch.input_file_id, completion_window=batch.completion_window,
            status=batch.status, output_file_id=batch.output_file_id,
            error_file_id=batch.error_file_id,
            errors=(None if batch.errors is None else BatchErrors(
                data=[BatchError(**error) for error in batch.errors])),
            created_at=_seconds(batch.created_at), **stamps,
            request_counts=BatchRequestCounts(total=batch.total, completed=batch.completed,
                                              failed=batch.failed),
            usage=BatchUsage(**(batch.usage or _NO_USAGE)), metadata=batch.metadata)


class BatchList(BaseModel):
    """A cursor page of batches, as the client's pager reads it."""

    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool

    @classmethod
    def of(cls, batches: list[BatchObject], has_more: bool) -> BatchList:
        """The page of these batches, its first and last IDs set for the pager."""
        return cls(data=batches, first_id=batches[0].id if batches else None,
                   last_id=batches[-1].id if batches else None, has_more=has_more)


class CreateBatch(BaseModel):
    """POST /v1/batches. `endpoint` and `completion_window` are checked by the route, which
    names the field in its 400."""

    input_file_id: RequestText
    endpoint: str
    completion_window: str
    metadata: dict[RequestText, RequestText] | None = None
    output_expires_after: dict[str, Any] | None = None


class ModelObject(BaseModel):
    """A served model or adapter, as the client's `Model` declares it, with what vLLM's server
    adds: the weights it runs (`root`), the model an adapter adapts (`parent`), its context."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jobsvc"
    root: str
    parent: str | None = None
    max_model_len: int
    # `generate` or `embed`: the requests it answers.
    task: str


class ModelList(BaseModel):
    """The list `/v1/models` answers."""

    object: Literal["list"] = "list"
    data: list[ModelObject]


class Health(BaseModel):
    """What `/health` answers while the server runs."""

    status: Literal["ok"] = "ok"


