"""Every error the server answers, in OpenAI's shape `{"error": {"message", "type", "param",
"code"}}`: a client's mistake is a 4xx naming the field (the official client retries 5xx,
which would only repeat the mistake)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException

from jobsvc.errors import BrokerUnavailable, StorageUnavailable
from jobsvc.validation import storable

log = logging.getLogger(__name__)

# Seconds a client is asked to wait before trying again when the database or Redis is down:
# the official client honours Retry-After on its retries.
RETRY_AFTER_SECONDS = 5


class ApiError(Exception):
    """An error the server answers in OpenAI's shape, with its status: raised anywhere a route finds
    a request wrong."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = headers

    def response(self) -> JSONResponse:
        """The error as its JSON response."""
        return JSONResponse({"error": {"message": str(self), "type": self.kind,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status, headers=self.headers)


def not_found(what: str, object_id: str, param: str | None = None) -> ApiError:
    """The 404 for an object that does not exist, naming its ID and the field that gave it."""
    return ApiError(404, f"no {what} with ID {object_id!r}", param=param, code="not_found")


def _field(location: tuple[Any, ...]) -> str | None:
    """The request field a validation error is about ("body", "query" dropped), as text that
    can be sent back (a metadata key may be anything)."""
    parts = [storable(str(part)) for part in location[1:]] if location else []
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app raises (ours, FastAPI's validation, Starlette's HTTP ones, the
    unexpected) answer in the one shape."""
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        param = _field(tuple(first.get("loc", ())))
        message = f"{param}: {first.get('msg', 'invalid')}" if param else str(
            first.get("msg", "invalid request"))
        return ApiError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, error: HTTPException) -> JSONResponse:
        code = "not_found" if error.status_code == 404 else None
        return ApiError(error.status_code, str(error.detail), code=code,
                        headers=getattr(error, "headers", None)).response()

    @app.exception_handler(StorageUnavailable)
    @app.exception_handler(BrokerUnavailable)
    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    @app.exception_handler(PoolTimeout)
    async def _outage(_request: Request, error: Exception) -> JSONResponse:
        """The database or Redis is down or saturated: a 503 the client may retry later,
        answered (not raised) so that the connection stays usable."""
        log.warning("store unavailable: %s", error)
        reason = str(error) if isinstance(error, (StorageUnavailable, BrokerUnavailable)) else (
            "the database is unavailable; try again later")
        return ApiError(503, reason, kind="server_error", code="service_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)}).response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected error serving a request")
        return ApiError(500, f"internal error ({type(error).__name__})", kind="server_error"
                        ).response()
