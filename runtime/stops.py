"""Stop conditions, checked token by token inside a committed run (DESIGN.md, "The verify round", step 6).

A verify round commits a run of 1..k+1 tokens at once; the lane's output must be exactly what plain
decoding would emit, so every token of the run is checked in order and the run is cut at the first
stop: tokens past it are never emitted, streamed or counted, and `max_tokens` is never exceeded.

Conditions, in the order they are checked for each token (vLLM's order):

1. **Stop token** -> finish_reason "stop". One of the request's `stop_token_ids` (stop_reason = that
   id) or one of the model's EOS ids (unless `ignore_eos`; stop_reason None). The stop token is the
   last output token (it is emitted and counted, like vLLM's output token ids).
2. **Stop string** -> finish_reason "stop", stop_reason = the string. The output is detokenized after
   every token with the caller's `detokenize(output_token_ids) -> str` (so this module depends on no
   tokenizer); a stop string may span several tokens. The first occurrence (lowest index; among
   strings at the same index, the one listed first) ends the output: `text` is cut just before it,
   and the token that completed it is the last output token.
3. **Context end** -> finish_reason "length": prompt + output reached `max_context` tokens (the token
   that reaches it is emitted; it would never be fed to the model).
4. **max_tokens** -> finish_reason "length": the output holds `max_tokens` tokens.

While the output holds fewer than `min_tokens` tokens only 3 and 4 are checked (vLLM): a stop string
then ends the output only if it ends past the text of the first min_tokens - 1 tokens. (EOS and
`stop_token_ids` cannot be chosen there: `ignis.runtime.logits_processors` masks them.)

Streaming text: while a lane runs, a suffix of `text` that is a proper prefix of some stop string may
still turn into a stop, so only `text[:stream_text_end]` is safe to send (`stop_string_holdback`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence

from ignis.runtime.errors import StateError
from ignis.runtime.sampling import SamplingParams, SamplingParamsError

__all__ = [
    "FINISH_ABORT",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Detokenize",
    "StopChecker",
    "stop_string_holdback",
]

FINISH_STOP = "stop"  # a stop token or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context end
FINISH_ABORT = "abort"  # cancelled by the caller (set by the engine, never by StopChecker)

Detokenize = Callable[[Sequence[int]], str]  # output token ids -> text (full decode of the output so far)


def stop_string_holdback(text: str, stop: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string (0 if none).

    Those characters must be held back from a stream until the next token decides them.
    """
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class StopChecker:
    """One lane's output so far and its stop state.

    Args:
        params: the request's parameters (max_tokens, stop, stop_token_ids, ignore_eos).
        num_prompt_tokens: prompt length (for the context end).
        eos_token_ids: the model's end-of-sequence ids.
        max_context: the lane's context limit in tokens (prompt + output); None = unlimited.
        detokenize: output token ids -> text; required when `params.stop` is non-empty.

    Raises:
        SamplingParamsError: stop strings without a detokenize callback.
        ValueError: num_prompt_tokens < 1, or the prompt already fills max_context.

    Attributes:
        output_token_ids: every emitted output token, in order.
        text: the detokenized output, cut before a stop string; maintained only with stop strings ("").
        finish_reason: None while running, else "stop", "length" or "abort".
        stop_reason: the stop token id or stop string that finished the lane, else None.
    """

    def __init__(
        self,
        params: SamplingParams,
        *,
        num_prompt_tokens: int,
        eos_token_ids: Collection[int] = (),
        max_context: int | None = None,
        detokenize: Detokenize | None = None,
    ) -> None:
        if params.stop and detokenize is None:
            raise SamplingParamsError(
                f"stop strings {params.stop!r} need a detokenize callback; none was given"
            )
        if num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {num_prompt_tokens}")
        if max_context is not None and num_prompt_tokens >= max_context:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens leaves no room in a context of {max_context}"
            )
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.max_context = max_context
        self._eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._stop_any = self._stop_ids | self._eos  # every token id that stops the lane
        self._detokenize = detokenize
        self.output_token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._stop_search_from = 0  # stop strings must end past this text length (min_tokens)

    @property
    def is_finished(self) -> bool:
        """True once a stop condition (or an abort) has ended the lane."""
        return self.finish_reason is not None

    @property
    def num_tokens_left(self) -> int | None:
        """Output tokens that may still be emitted before max_tokens or the context end (None: no limit)."""
        limits = []
        if self.params.max_tokens is not None:
            limits.append(self.params.max_tokens - len(self.output_token_ids))
        if self.max_context is not None:
            limits.append(self.max_context - self.num_prompt_tokens - len(self.output_token_ids))
        return min(limits) if limits else None

    @property
    def stream_text_end(self) -> int:
        """How much of `text` may be streamed now (everything once finished)."""
        if self.is_finished or not self.params.stop:
            return len(self.text)
        return len(self.text) - stop_string_holdback(self.text, self.params.stop)

    def append(self, token_id: int) -> bool:
        """Emit one token and check it. Returns True when it finished the lane.

        Raises:
            StateError: the lane is already finished.
        """
        if self.is_finished:
            raise StateError(f"token {token_id} appended after the lane finished ({self.finish_reason})")
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        if len(self.output_token_ids) < self.params.min_tokens:  # vLLM: no stop checks before min_tokens
            if self.params.stop:
                assert self._detokenize is not None
                self.text = self._detokenize(self.output_token_ids)
                self._stop_search_from = len(self.text)
            return self._check_length()
        if token_id in self._stop_ids:
            return self._finish(FINISH_STOP, token_id)
        if token_id in self._eos:
            return self._finish(FINISH_STOP, None)
        if self.params.stop:
            assert self._detokenize is not None
            text = self._detokenize(self.output_token_ids)
            hit: tuple[int, str] | None = None
            for s in self.params.stop:
                # a stop string must end past the text of the first min_tokens - 1 tokens
                at = text.find(s, max(0, self._stop_search_from - len(s) + 1))
                if at >= 0 and (hit is None or at < hit[0]):
                    hit = (at, s)
            if hit is not None:
                self.text = text[: hit[0]]
                return self._finish(FINISH_STOP, hit[1])
            self.text = text
        return self._check_length()

    def _check_length(self) -> bool:
        if (
            self.max_context is not None
            and self.num_prompt_tokens + len(self.output_token_ids) >= self.max_context
        ):
            return self._finish(FINISH_LENGTH, None)
        if self.params.max_tokens is not None and len(self.output_token_ids) >= self.params.max_tokens:
            return self._finish(FINISH_LENGTH, None)
        return False

    def extend(self, token_ids: Iterable[int]) -> int:
        """Emit a committed run token by token, stopping at the first stop.

        Returns:
            how many tokens of the run were emitted (the stop token included); the rest are dropped.

        Raises:
            StateError: the lane is already finished.
        """
        if self.is_finished:
            raise StateError(f"run appended after the lane finished ({self.finish_reason})")
        if not self.params.stop and len(self.output_token_ids) >= self.params.min_tokens:
            return self._extend_ids(token_ids)
        num = 0
        for t in token_ids:
            num += 1
            if self.append(t):
                break
        return num

    def _extend_ids(self, token_ids: Iterable[int]) -> int:
        """`extend` without stop strings and past min_tokens: the run cut at the first stop token or at
        the length limit with list operations (the same checks, in `append`'s order, as one pass)."""
        run = [int(t) for t in token_ids]
        left = self.num_tokens_left
        n = len(run) if left is None else min(len(run), left)
        stops = self._stop_any
        if stops and not stops.isdisjoint(run[:n]):
            for j in range(n):
                t = run[j]
                if t in stops:  # a stop token is checked before the length (`append`)
                    self.output_token_ids.extend(run[: j + 1])
                    self._finish(FINISH_STOP, t if t in self._stop_ids else None)
                    return j + 1
        self.output_token_ids.extend(run[:n])
        self._check_length()
        return n

    def abort(self) -> None:
        """Finish the lane as cancelled (no-op when already finished)."""
        if not self.is_finished:
            self.finish_reason = FINISH_ABORT

    def _finish(self, reason: str, stop_reason: int | str | None) -> bool:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return True
