"""Errors the server turns into HTTP responses with an OpenAI-style body.

Every error a client can cause is an `APIError` carrying its HTTP status and the OpenAI error fields:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

`APIError` and its subclasses never reach uvicorn: the app's exception handlers render them.
"""

from __future__ import annotations

from typing import Any

from ignis.runtime.errors import IgnisRuntimeError

__all__ = [
    "APIError",
    "EngineFailedError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "ServerBusyError",
    "ServerUnavailableError",
    "error_body",
]


def error_body(
    message: str, type_: str, *, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """The OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(IgnisRuntimeError):
    """A request failed in a way the client is told about.

    Attributes:
        status_code: the HTTP status (4xx for the client's mistakes, 5xx for the server's state).
        type: the OpenAI error type ("invalid_request_error", "not_found_error", ...).
        param: the request field at fault, or None.
        code: a short machine-readable code, or None.
        headers: extra response headers (e.g. Retry-After).
    """

    status_code = 400
    type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body of the response."""
        return error_body(self.message, self.type, param=self.param, code=self.code)


class InvalidRequestError(APIError):
    """400: the request is malformed, mistyped, out of range, or cannot be served (prompt too long)."""


class ModelNotFoundError(APIError):
    """404: the request names a model this server does not serve."""

    status_code = 404
    type = "not_found_error"


class ServerBusyError(APIError):
    """503 with Retry-After: every lane is busy and the waiting queue is full."""

    status_code = 503
    type = "server_overloaded_error"


class ServerUnavailableError(APIError):
    """503: the server is shutting down or its lane loop is not running."""

    status_code = 503
    type = "service_unavailable_error"


class EngineFailedError(APIError):
    """500: the engine failed while the request ran (the server restarted its lanes)."""

    status_code = 500
    type = "server_error"
