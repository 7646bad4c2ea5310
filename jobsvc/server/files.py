"""/v1/files: upload (streamed), list, retrieve, content (streamed), delete."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from jobsvc.server.errors import ApiError, not_found
from jobsvc.server.models import FileDeleted, FileList, FileObject
from jobsvc.server.services import services_of
from jobsvc.server.upload import receive_upload, too_large_to_accept

router = APIRouter(prefix="/v1/files")


@router.post("")
async def upload_file(request: Request) -> FileObject:
    services = services_of(request)
    limit = services.settings.max_upload_bytes
    if too_large_to_accept(request.headers.get("content-length"), limit):
        raise ApiError(413, f"the upload is larger than {limit} bytes "
                       "(JOBSVC_MAX_UPLOAD_BYTES)", param="file", code="file_too_large")
    record = await receive_upload(request.stream(), request.headers.get("content-type", ""),
                                  services.files, limit)
    return FileObject.of(record)


@router.get("")
def list_files(request: Request, after: str | None = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
               order: Literal["asc", "desc"] = "desc",
               purpose: str | None = None) -> FileList:
    records, has_more = services_of(request).files.page(
        after=after, limit=limit, ascending=order == "asc", purpose=purpose)
    return FileList.of([FileObject.of(record) for record in records], has_more)


@router.get("/{file_id}")
def retrieve_file(request: Request, file_id: str) -> FileObject:
    record = services_of(request).files.get(file_id)
    if record is None:
        raise not_found("file", file_id, "file_id")
    return FileObject.of(record)


@router.get("/{file_id}/content")
def file_content(request: Request, file_id: str) -> StreamingResponse:
    files = services_of(request).files
    if files.get(file_id) is None:
        raise not_found("file", file_id, "file_id")
    return StreamingResponse(files.chunks(file_id), media_type="application/octet-stream")


@router.delete("/{file_id}")
def delete_file(request: Request, file_id: str) -> FileDeleted:
    if not services_of(request).files.delete(file_id):
        raise not_found("file", file_id, "file_id")
    return FileDeleted(id=file_id, deleted=True)
