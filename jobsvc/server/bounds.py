"""The bounds of one request, kept outermost, before any route reads a byte of it: the key
first (an unauthenticated body is never read), then a cap on the body (the upload limit for
an upload, a small one for every other body) and a read timeout while it arrives, so that no
client, flooding or stalled, holds more memory than its cap or its connection for long."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jobsvc.server.auth import key_refusal
from jobsvc.server.errors import ApiError

# Every body but an upload's is a small JSON object: OpenAI's largest batch request (16
# metadata pairs of 64 + 512 characters, each escaped as \uXXXX) fits with room to spare.
JSON_BODY_BYTES = 256 * 1024
# Multipart framing around an upload's file: boundaries, part headers and the small fields.
FRAMING_BYTES = 64 * 1024
UPLOAD_ROUTE = ("POST", "/v1/files")


def _too_large(cap: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {cap} bytes",
                    code="request_too_large")


def _stalled(timeout: float) -> ApiError:
    return ApiError(408, f"no part of the request body came for {timeout:g} s "
                    "(JOBSVC_BODY_READ_TIMEOUT)", code="request_timeout")


class _BoundedBody:
    """`receive` with the body's bytes counted against `cap` and each wait for more of it
    limited to `timeout`; once the body is whole, waits (for a disconnect) are the app's."""

    def __init__(self, receive: Receive, cap: int, timeout: float) -> None:
        self._receive = receive
        self._cap = cap
        self._timeout = timeout
        self.received = 0
        self.whole = False

    async def __call__(self) -> Message:
        if self.whole:
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), self._timeout)
        except TimeoutError:
            raise _stalled(self._timeout) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self._cap:
                raise _too_large(self._cap)
            self.whole = not message.get("more_body", False)
        return message


class RequestBounds:
    """ASGI middleware: the key, then the body's cap and read timeout. An upload's body is
    streamed on to its route; any other body is read here, whole and within its cap, first.
    A response given before the body was all read closes the connection, so the rest of the
    body is never read either."""

    def __init__(self, app: ASGIApp, *, api_key: str, upload_bytes: int,
                 read_timeout: float) -> None:
        self.app = app
        self._api_key = api_key
        self._upload_cap = upload_bytes + FRAMING_BYTES
        self._timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1"): value.decode("latin-1")
                   for name, value in scope["headers"]}
        upload = (scope["method"], scope["path"].rstrip("/")) == UPLOAD_ROUTE
        cap = self._upload_cap if upload else JSON_BODY_BYTES
        body = _BoundedBody(receive, cap, self._timeout)

        async def send_closing_early(message: Message) -> None:
            if message["type"] == "http.response.start" and not body.whole:
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"connection", b"close")]}
            await send(message)

        refusal = key_refusal(self._api_key, headers.get("authorization", ""))
        declared = headers.get("content-length", "")
        if refusal is None and declared.isdigit() and int(declared) > cap:
            refusal = _too_large(cap)
        if refusal is None and not upload:
            try:
                replay = await _read_whole(body)
            except ApiError as error:
                refusal = error
            else:
                if replay is None:  # the client left before its body was whole
                    return
                receive = replay
        if refusal is not None:
            await refusal.response()(scope, receive, send_closing_early)
            return
        await self.app(scope, body if upload else receive, send_closing_early)


async def _read_whole(body: _BoundedBody) -> Receive | None:
    """Read a body within its bounds; a `receive` that gives it again, then what follows
    (None when the client disconnected first)."""
    data = bytearray()
    while not body.whole:
        message = await body()
        if message["type"] != "http.request":
            return None
        data += message.get("body", b"")
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await body()
        replayed = True
        return {"type": "http.request", "body": bytes(data), "more_body": False}

    return replay
