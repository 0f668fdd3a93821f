"""Errors the server turns into HTTP responses with an OpenAI-style body.

Every error a client can cause is an `APIError` carrying its HTTP status and the OpenAI error fields:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

`APIError` and its subclasses never reach uvicorn: the app's exception handlers render them.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ignis.runtime.errors import IgnisRuntimeError

__all__ = [
    "APIError",
    "EngineFailedError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "ServerBusyError",
    "ServerUnavailableError",
    "describe_validation_errors",
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


# ---------------------------------------------------------------- validation errors in the client's words

# What each field that takes several forms accepts (keys: the field's path with list indexes as "[]").
_UNION_FORMS = {
    "prompt": "a text, a list of token ids (integers >= 0), or a list holding exactly one of these",
    "stop": "a string or a list of strings (1 to 256 characters each)",
    "messages[].content": 'a string, a list of text parts ({"type": "text", "text": "..."}), or null',
    "tool_choice": '"none", "auto", "required", or an object',
}
# Pydantic's names for the members of a union ("str", "list[constrained-int]", ...): never shown.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|dict\[.*|list\[.*|constrained-.*|function-.*|[A-Z]\w*)$")
_TYPE_ERRORS = {
    "missing": "is required",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a JSON object",
    "model_type": "must be a JSON object",
    "model_attributes_type": "must be a JSON object",
}
_MAX_SHOWN_CHARS = 40  # a rejected value is quoted up to this many characters


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, Sequence):
        return "a list"
    return "a value of another type"


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = _json_kind(value)
    return text if len(text) <= _MAX_SHOWN_CHARS else text[: _MAX_SHOWN_CHARS - 3] + "..."


def _path(loc: Sequence[Any]) -> str:
    """("messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _is_tag(part: Any) -> bool:
    return isinstance(part, str) and _UNION_TAG.match(part) is not None


def _what_is_wrong(err: Mapping[str, Any]) -> str:
    kind = str(err.get("type", ""))
    ctx = err.get("ctx") or {}
    value = err.get("input")
    if kind in _TYPE_ERRORS:
        text = _TYPE_ERRORS[kind]
        return text if kind in ("missing", "finite_number") else f"{text}, got {_json_kind(value)}"
    bounds = {
        "greater_than_equal": ("must be >= {}", "ge"),
        "greater_than": ("must be > {}", "gt"),
        "less_than_equal": ("must be <= {}", "le"),
        "less_than": ("must be < {}", "lt"),
        "too_short": ("must hold at least {} item(s)", "min_length"),
        "too_long": ("must hold at most {} item(s)", "max_length"),
        "string_too_long": ("must be at most {} characters", "max_length"),
        "literal_error": ("must be one of {}", "expected"),
    }
    if kind == "too_short" and ctx.get("min_length") == 1:
        return "must not be empty"
    if kind in bounds:
        template, key = bounds[kind]
        got = f"{len(value)} items" if kind in ("too_short", "too_long") and isinstance(value, list) else None
        bound = ctx.get(key, "?")
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"{template.format(bound)}, got {got or _shown(value)}"
    if kind == "string_too_short":
        return (
            "must not be empty"
            if ctx.get("min_length") == 1
            else f"must be at least {ctx.get('min_length')} characters"
        )
    return "is not valid"


def describe_validation_errors(
    errors: Sequence[Mapping[str, Any]], known_fields: Collection[str] = ()
) -> tuple[str, str | None]:
    """A client-facing 400 message for pydantic validation errors of a request body.

    Args:
        errors: `ValidationError.errors()` (FastAPI's, whose locations start with "body").
        known_fields: the request's top-level field names: an unknown field's sentence suggests the
            closest of them (`difflib`), e.g. "max_token is not a known field; did you mean max_tokens?".

    Returns:
        (message, param): one sentence per wrong field (at most 5, ";"-joined), each naming the field
        as the client wrote it ("messages[0].content"), what is allowed and what was sent; `param` is
        the first wrong field, or None when the body as a whole is wrong. Pydantic's internal names
        (union member tags such as "list[constrained-int]", class names) never appear.
    """
    # Group the errors of one field: the branches of a union count as one field.
    groups: dict[tuple[Any, ...], list[tuple[tuple[Any, ...], Mapping[str, Any]]]] = {}
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if loc[:1] == ("body",):
            loc = loc[1:]
        cut = next((i for i, part in enumerate(loc) if _is_tag(part)), len(loc))
        groups.setdefault(loc[:cut], []).append((loc[cut + 1 :] if cut < len(loc) else (), err))
    sentences: list[str] = []
    params: list[str] = []
    for field, members in groups.items():
        name = _path(field)
        if len(members) > 1 or any(_is_tag(p) for p in tuple(members[0][1].get("loc", ()))):
            # A union: the branch that got furthest names the real fault; none got past the type: the forms.
            def depth(member: tuple[tuple[Any, ...], Mapping[str, Any]]) -> tuple[int, int]:
                rest, err = member
                return len(rest), 0 if err.get("type") in _TYPE_ERRORS else 1

            rest, err = max(members, key=depth)
            if not rest and err.get("type") in _TYPE_ERRORS:
                key = re.sub(r"\[\d+\]", "[]", name)
                forms = _UNION_FORMS.get(key, "another form")
                sentences.append(f"{name} must be {forms}, got {_json_kind(err.get('input'))}")
                params.append(name)
                continue
            field, err = field + tuple(p for p in rest if not _is_tag(p)), err
            name = _path(field)
        else:
            err = members[0][1]
        if not name:
            sentences.append(
                "the request body must be a JSON object"
                if err.get("type") in _TYPE_ERRORS
                else "the request body is not valid"
            )
            continue
        if err.get("type") == "extra_forbidden":
            close = difflib.get_close_matches(str(field[-1]), list(known_fields), n=1) if field else []
            hint = f"; did you mean {close[0]}?" if close else " (the request fields are listed at /docs)"
            sentences.append(f"{name} is not a known field{hint}")
        else:
            sentences.append(f"{name} {_what_is_wrong(err)}")
        params.append(name)
    message = "; ".join(sentences[:5]) or "the request body is not valid"
    return message, (params[0] if params else None)
