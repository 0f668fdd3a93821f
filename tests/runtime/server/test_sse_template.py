"""`ChunkTemplate`: spliced chunk bytes equal the serialized chunk for any text and token id."""

from __future__ import annotations

import pytest

from ignis.runtime.server.sse import ChunkTemplate, sse

TEXTS = [
    "",
    "a",
    ' "quoted" ',
    "back\\slash",
    "\n\t\r\x00\x1f",
    "é€😀",
    "\u2028\u2029",
    "</script>",
    "\ufffd",
]


def _chunk(text: str, token: int, *, with_ids: bool, model: str = "m") -> dict[str, object]:
    choice: dict[str, object] = {
        "index": 0,
        "delta": {"content": text},
        "logprobs": None,
        "finish_reason": None,
    }
    if with_ids:
        choice["token_ids"] = [token]
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": model,
        "choices": [choice],
    }


@pytest.mark.parametrize("with_ids", [False, True])
def test_render_equals_the_serialized_chunk(with_ids: bool) -> None:
    template = ChunkTemplate(lambda t, tok: _chunk(t, tok, with_ids=with_ids), with_token=with_ids)
    for text in TEXTS:
        for token in (0, 7, 151_643):
            assert template.render(text, token) == sse(_chunk(text, token, with_ids=with_ids))


def test_a_placeholder_in_a_fixed_field_is_refused() -> None:
    """A model named like the text placeholder cannot be templated (the caller serializes each chunk)."""
    with pytest.raises(ValueError, match="text placeholder"):
        ChunkTemplate(
            lambda t, tok: _chunk(t, tok, with_ids=False, model="\x00ignis-chunk-text\x00"), with_token=False
        )
    with pytest.raises(ValueError, match="token placeholder"):
        ChunkTemplate(lambda t, tok: _chunk(t, tok, with_ids=False, model=str(tok)), with_token=True)


def test_sse_is_compact_utf8_json() -> None:
    assert sse({"a": "é", "b": [1, None]}) == 'data: {"a":"é","b":[1,null]}\n\n'.encode()
