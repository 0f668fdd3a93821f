"""Logprobs in the OpenAI response shapes, from the engine's `TokenLogprob`s.

- Chat (`"logprobs": true`, `"top_logprobs": N`): `choices[i].logprobs = {"content": [entry, ...]}`,
  entry = `{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}`.
- Completions (`"logprobs": N`): `choices[i].logprobs = {"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}` (the legacy shape; `top_logprobs` is a list of {token: logprob} maps, or None when
  N is 0; `text_offset` counts characters of the completion from 0).

A token's string is its text alone (`decode([id])`, special tokens included), its `bytes` that text's
UTF-8 bytes (a byte-level token that ends inside a character decodes to U+FFFD). A streamed chunk
carries its one token's entry. The logprobs are the model's own (`ignis.runtime.logits_processors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ignis.runtime.logits_processors import TokenLogprob
from ignis.runtime.server.errors import InvalidRequestError
from ignis.runtime.server.model import ChatTokenizer
from ignis.runtime.server.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["chat_logprobs", "choice_logprobs", "completion_logprobs", "requested_logprobs"]


def _token_text(tokenizer: ChatTokenizer, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def _entry(tokenizer: ChatTokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = _token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: ChatTokenizer, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat shape: {"content": [one entry per token]}."""
    return {
        "content": [
            {
                **_entry(tokenizer, lp.token_id, lp.logprob),
                "top_logprobs": [_entry(tokenizer, t, v) for t, v in lp.top],
            }
            for lp in logprobs
        ]
    }


def completion_logprobs(
    tokenizer: ChatTokenizer, logprobs: Sequence[TokenLogprob], *, num_top: int, text_offset: int = 0
) -> dict[str, Any]:
    """The legacy completions shape; `text_offset` is the first token's character offset."""
    tokens = [_token_text(tokenizer, lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": (
            [{_token_text(tokenizer, t): v for t, v in lp.top} for lp in logprobs] if num_top else None
        ),
        "text_offset": offsets,
    }


def requested_logprobs(req: ChatCompletionRequest | CompletionRequest) -> int | None:
    """Top logprobs per token the request asks for (0: only the chosen token's), or None for none.

    Raises:
        InvalidRequestError: chat top_logprobs without logprobs true (OpenAI refuses it too).
    """
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError('top_logprobs needs "logprobs": true', param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def choice_logprobs(
    tokenizer: ChatTokenizer,
    req: ChatCompletionRequest | CompletionRequest,
    logprobs: Sequence[TokenLogprob],
    text_offset: int = 0,
) -> dict[str, Any] | None:
    """A choice's `logprobs` object in the endpoint's shape, or None when the request did not ask."""
    num = requested_logprobs(req)
    if num is None:
        return None
    if isinstance(req, CompletionRequest):
        return completion_logprobs(tokenizer, logprobs, num_top=num, text_offset=text_offset)
    return chat_logprobs(tokenizer, logprobs)
