"""/v1/files: upload (spooled, then stored), list, retrieve, content (streamed with its
length), delete."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from jobsvc.server.errors import ApiError, not_found
from jobsvc.server.models import FileDeleted, FileList, FileObject, RequestText
from jobsvc.server.services import services_of
from jobsvc.server.upload import receive_upload

router = APIRouter(prefix="/v1/files")


@router.post("")
async def upload_file(request: Request) -> FileObject:
    """Store an uploaded file, received whole within the limit before the database sees it."""
    services = services_of(request)
    record = await receive_upload(request.stream(), request.headers.get("content-type", ""),
                                  services.files, services.settings.max_upload_bytes)
    return FileObject.of(record)


@router.get("")
def list_files(request: Request, after: RequestText | None = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
               order: Literal["asc", "desc"] = "desc",
               purpose: RequestText | None = None) -> FileList:
    """A page of files, newest first unless asked, optionally of one purpose."""
    records, has_more = services_of(request).files.page(
        after=after, limit=limit, ascending=order == "asc", purpose=purpose)
    return FileList.of([FileObject.of(record) for record in records], has_more)


@router.get("/{file_id}")
def retrieve_file(request: Request, file_id: RequestText) -> FileObject:
    """The file's object, without its bytes."""
    record = services_of(request).files.get(file_id)
    if record is None:
        raise not_found("file", file_id, "file_id")
    return FileObject.of(record)


@router.get("/{file_id}/content")
def file_content(request: Request, file_id: RequestText) -> StreamingResponse:
    """The file's bytes under their Content-Length: should the file be deleted mid-way, the
    body stops short of that length and the client's read fails (`FileVanished`), rather
    than a shorter file passing for the whole."""
    files = services_of(request).files
    record = files.get(file_id)
    if record is None:
        raise not_found("file", file_id, "file_id")
    return StreamingResponse(files.chunks(file_id), media_type="application/octet-stream",
                             headers={"Content-Length": str(record.bytes)})


@router.delete("/{file_id}")
def delete_file(request: Request, file_id: RequestText) -> FileDeleted:
    """Delete a file, unless an unfinished batch still reads it (409)."""
    services = services_of(request)
    # An unfinished batch still reads its input file: deleted, its unread lines could never
    # end with an output or error line.
    batch_id = services.batches.unfinished_reading(file_id)
    if batch_id is not None:
        raise ApiError(409, f"file {file_id} is the input of batch {batch_id}, which has not "
                       "finished; cancel the batch or wait for it to end, then delete the file",
                       param="file_id", code="file_in_use")
    if not services.files.delete(file_id):
        raise not_found("file", file_id, "file_id")
    return FileDeleted(id=file_id, deleted=True)
