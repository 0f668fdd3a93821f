"""Server-sent event bytes of the generation streams, and a pre-serialized template for the chunks
that differ only in their text (and token id).

`sse(obj)` is one event, `data: <compact JSON>\\n\\n` (UTF-8, non-ASCII unescaped). A stream's chunks
between its first and its last token are all the same JSON but for the text delta and, with
`return_token_ids`, the token id: `ChunkTemplate` serializes that chunk once with placeholder values
and later splices each token's JSON-escaped text (and id) in, giving the bytes `sse` would give for the
same object, at a fraction of the cost (no dict, no encoder per chunk).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["SSE_DONE", "ChunkTemplate", "sse"]

SSE_DONE = b"data: [DONE]\n\n"

_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
_encode_str: Callable[[str], str] = json.encoder.encode_basestring  # type: ignore[attr-defined]

# Placeholders no real chunk holds: a text with a NUL and an id past any vocabulary.
_TEXT = "\x00ignis-chunk-text\x00"
_TOKEN = 9_007_199_254_740_993


def sse(obj: Mapping[str, Any]) -> bytes:
    """One server-sent event of `obj` as compact JSON (non-ASCII characters unescaped)."""
    return b"data: " + _encoder.encode(obj).encode() + b"\n\n"


class ChunkTemplate:
    """The bytes of a stream's middle chunks, spliced from a template.

    Args:
        make: (text, token id) -> the chunk object (e.g. `{**head, "choices": [choice]}`); called once
            here with placeholders. Every other value of the chunk must not depend on its arguments.
        with_token: the chunk carries the token id (`return_token_ids`).

    Raises:
        ValueError: the placeholders do not appear exactly once each in the serialized chunk (the
            caller then serializes each chunk itself).
    """

    def __init__(self, make: Callable[[str, int], Mapping[str, Any]], *, with_token: bool) -> None:
        raw = sse(make(_TEXT, _TOKEN))
        text = _encode_str(_TEXT).encode()
        parts = raw.split(text)
        if len(parts) != 2:
            raise ValueError("the text placeholder is not in the chunk exactly once")
        self._with_token = with_token
        if with_token:
            rest = parts[1].split(str(_TOKEN).encode())
            if len(rest) != 2 or str(_TOKEN).encode() in parts[0]:
                raise ValueError("the token placeholder is not in the chunk exactly once")
            self._parts = (parts[0], rest[0], rest[1])
        else:
            if str(_TOKEN).encode() in raw:
                raise ValueError("the chunk holds the token placeholder without with_token")
            self._parts = (parts[0], parts[1], b"")

    def render(self, text: str, token: int) -> bytes:
        """The event bytes of the chunk with this text delta and token id (ignored without with_token):
        equal to `sse(make(text, token))`."""
        head, mid, tail = self._parts
        if self._with_token:
            return b"".join((head, _encode_str(text).encode(), mid, str(int(token)).encode(), tail))
        return b"".join((head, _encode_str(text).encode(), mid))
