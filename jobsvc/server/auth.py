"""Bearer-key authentication: with JOBSVC_API_KEY set, every request must carry
`Authorization: Bearer <key>`, compared in constant time. `RequestBounds` asks it before
anything of a request's body is read."""

from __future__ import annotations

import hmac

from jobsvc.server.errors import ApiError


def key_refusal(api_key: str, authorization: str) -> ApiError | None:
    """The 401 for a request whose Authorization header is `authorization`, or None when it
    carries the key (or no key is asked)."""
    if not api_key:
        return None
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                          api_key.encode()):
        return None
    return ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
