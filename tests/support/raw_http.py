"""HTTP/1.1 over a plain socket, for the requests the official client cannot make: a body
that stalls, stops short or is still being sent when the answer comes, and several requests
on one kept-alive connection."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from tests.support.batch_server import API_KEY


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        """The `error` object of an OpenAI-shaped error body."""
        return json.loads(self.body)["error"]  # type: ignore[no-any-return]


def head(method: str, target: str, *, headers: dict[str, str] | None = None,
         key: str | None = API_KEY) -> bytes:
    """A request's line and headers (the key's, unless `key` is None)."""
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """A body in chunked transfer coding: no length declared up front."""
    for piece in pieces:
        yield b"%x\r\n%s\r\n" % (len(piece), piece)
    yield b"0\r\n\r\n"


def connect(port: int, timeout: float = 30) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def read_reply(connection: socket.socket) -> Reply:
    """One response (with a Content-Length body, as every answer of the server has)."""
    data = b""
    while b"\r\n\r\n" not in data:
        received = connection.recv(65536)
        if not received:
            raise ConnectionError(f"closed before a whole response head: {data!r}")
        data += received
    raw_head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = raw_head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in
               (line.partition(":") for line in header_lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        received = connection.recv(65536)
        if not received:
            raise ConnectionError("closed inside a response body")
        body += received
    return Reply(int(status_line.split()[1]), headers, body[:length])


def exchange(port: int, request_head: bytes, body: Iterable[bytes] = (),
             timeout: float = 30) -> tuple[Reply, int]:
    """Send `request_head`, then `body` from another thread while the answer is read (the
    server may answer before the body is all sent, and stop reading it); the answer and how
    many body bytes were sent before the server stopped taking them or answered."""
    connection = connect(port, timeout)
    sent = 0

    def send_body() -> None:
        nonlocal sent
        try:
            for piece in body:
                connection.sendall(piece)
                sent += len(piece)
        except OSError:
            return

    try:
        connection.sendall(request_head)
        sender = threading.Thread(target=send_body, daemon=True)
        sender.start()
        reply = read_reply(connection)
        return reply, sent
    finally:
        connection.close()
