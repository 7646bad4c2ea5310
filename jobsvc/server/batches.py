"""/v1/batches: create, list (newest first), retrieve, cancel. The work itself is the
driver's (`jobsvc.batchapi.driver`); these routes only record and show."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from jobsvc.batchapi.lines import ENDPOINTS
from jobsvc.server.errors import ApiError, not_found
from jobsvc.server.models import BatchList, BatchObject, CreateBatch, RequestText
from jobsvc.server.services import services_of
from jobsvc.store.batches import COMPLETION_WINDOW

router = APIRouter(prefix="/v1/batches")

# OpenAI's limits on a batch's metadata.
_METADATA_PAIRS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > _METADATA_PAIRS:
        raise ApiError(400, f"metadata holds at most {_METADATA_PAIRS} pairs",
                       param="metadata")
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY_CHARS or len(value) > _METADATA_VALUE_CHARS:
            raise ApiError(400, f"metadata keys are at most {_METADATA_KEY_CHARS} characters "
                           f"and values at most {_METADATA_VALUE_CHARS}",
                           param=f"metadata.{key[:_METADATA_KEY_CHARS]}")


@router.post("")
def create_batch(request: Request, body: CreateBatch) -> BatchObject:
    """Record a batch over an uploaded `batch` file, with every field checked first; the driver
    validates and runs it from there."""
    services = services_of(request)
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}",
                       param="endpoint", code="invalid_value")
    if body.completion_window != COMPLETION_WINDOW:
        raise ApiError(400, f"completion_window must be {COMPLETION_WINDOW!r}",
                       param="completion_window", code="invalid_value")
    _check_metadata(body.metadata)
    input_file = services.files.get(body.input_file_id)
    if input_file is None:
        raise not_found("file", body.input_file_id, "input_file_id")
    if input_file.purpose != "batch":
        raise ApiError(400, f"file {body.input_file_id} has purpose {input_file.purpose!r}, "
                       "not 'batch'", param="input_file_id", code="invalid_value")
    batch = services.batches.create(
        endpoint=body.endpoint, input_file_id=body.input_file_id,
        completion_window=body.completion_window, metadata=body.metadata,
        window_seconds=services.settings.batch_window_seconds)
    services.wake_driver()
    return BatchObject.of(batch, services.settings.served_model_name)


@router.get("")
def list_batches(request: Request, after: RequestText | None = None,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> BatchList:
    """A page of batches, newest first, continued after `after`."""
    services = services_of(request)
    records, has_more = services.batches.page(after=after, limit=limit)
    model = services.settings.served_model_name
    return BatchList.of([BatchObject.of(record, model) for record in records], has_more)


@router.get("/{batch_id}")
def retrieve_batch(request: Request, batch_id: RequestText) -> BatchObject:
    """The batch as it stands, counts and usage from its jobs."""
    services = services_of(request)
    batch = services.batches.get(batch_id)
    if batch is None:
        raise not_found("batch", batch_id, "batch_id")
    return BatchObject.of(batch, services.settings.served_model_name)


@router.post("/{batch_id}/cancel")
def cancel_batch(request: Request, batch_id: RequestText) -> BatchObject:
    """Mark the batch `cancelling` and wake the driver, which cancels its jobs and ends it; a batch
    past cancelling is shown as it is."""
    services = services_of(request)
    batch = services.batches.request_cancel(batch_id)
    if batch is None:
        raise not_found("batch", batch_id, "batch_id")
    services.wake_driver()
    return BatchObject.of(batch, services.settings.served_model_name)
