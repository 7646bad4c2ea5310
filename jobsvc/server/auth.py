"""Bearer-key authentication: with JOBSVC_API_KEY set, every request must carry
`Authorization: Bearer <key>`, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import Request

from jobsvc.server.errors import ApiError


def bearer_key_check(api_key: str) -> Callable[[Request], None]:
    """A dependency that refuses a request without the key (none when the key is empty)."""
    expected = api_key.encode()

    def check(request: Request) -> None:
        if not expected:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 expected):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                           code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    return check
