"""API keys: `Authorization: Bearer KEY` on every endpoint but `/health`, as the OpenAI API takes them.

With a key set (`ignis-run --api-key`, the `IGNIS_API_KEY` environment variable, or the config file's
`api_key`), a request without the header, with another scheme, or with a different key gets 401 and
an OpenAI-style body (`type` "invalid_request_error", `code` "invalid_api_key") and a
`WWW-Authenticate: Bearer` header; the key is compared in constant time (`hmac.compare_digest`) and
never logged. `/health` stays open so that process supervisors and load balancers can probe the server
without the key. The key applies to the TCP listener and the Unix socket alike.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from ignis.runtime.server.errors import error_body

__all__ = ["OPEN_PATHS", "ApiKeyCheck", "check_api_key"]

OPEN_PATHS = frozenset({"/health"})  # answered without a key


def check_api_key(key: str | None) -> str | None:
    """Validate an API key setting: None (no key), else a non-empty string of printable ASCII without
    spaces (what an HTTP header can carry).

    Raises:
        ValueError: an empty key, or one with spaces, control or non-ASCII characters.
    """
    if key is None:
        return None
    if not key or any(not 0x21 <= ord(c) <= 0x7E for c in key):
        raise ValueError(
            "the API key must be a non-empty string of printable ASCII characters without spaces"
        )
    return key


class ApiKeyCheck:
    """Pure ASGI middleware: 401 unless the request carries `Authorization: Bearer <key>` (module
    docstring). Streaming and disconnect detection pass through untouched."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("ascii")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        value = b""
        for name, raw in scope.get("headers", ()):
            if name == b"authorization":
                value = raw
                break
        scheme, _, token = value.strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
            await self.app(scope, receive, send)
            return
        if not value:
            message = (
                "this server needs an API key: send it as the header 'Authorization: Bearer KEY' "
                "(the openai client's api_key)"
            )
        elif scheme.lower() != b"bearer":
            message = "the Authorization header must be 'Bearer KEY'"
        else:
            message = "the API key is not valid"
        body = error_body(message, "invalid_request_error", code="invalid_api_key")
        await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(
            scope, receive, send
        )
