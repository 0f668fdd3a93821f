"""`--spec-backend ngram`: prompt lookup decoding, drafts copied from the lane's own context.

Algorithm (Saxena 2023, "Prompt Lookup Decoding", github.com/apoorvumang/prompt-lookup-decoding;
vLLM's `NgramProposer`): take the last n tokens of the lane's context (prompt + output, the anchor
last), for n = prompt_lookup_max down to prompt_lookup_min; find an earlier occurrence of those n
tokens in the context; propose the tokens that followed it. The longest n with a match wins; among
the occurrences of that n-gram the most recent one wins (the freshest copy is the likeliest to be
repeated: code edits, quoted input, lists). No match for any n: zero drafts (the lane then takes its
plain decode row).

Periodic extension: when the match is so recent that fewer than k tokens follow it before the end of
the context (the context ends in a repeating pattern of period P = len - match_end), the drafts
continue the period (token j of the continuation is context[match_end + (j mod P)]), as if the
pattern went on repeating. vLLM stops at the context's end instead; `is_periodic=False` does that.

Cost: an index per lane maps every n-gram (prompt_lookup_min <= n <= prompt_lookup_max) of the
context to the end of its most recent occurrence; it is extended by the tokens added since the lane's
previous proposal (O(new tokens * n range) per proposal, O(context * n range) memory per lane), and a
proposal is max_n - min_n + 1 dictionary look-ups: no rescan of the context, nothing quadratic.

Deterministic: q is a point mass (`draft_probs` None), so under sampling a draft d is accepted with
probability p(d) (the standard rule with q = 1 at d), which keeps the model's distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ignis.runtime.checkpoints import DrafterSnapshot
from ignis.runtime.drafters import DRAFTERS, register_drafter
from ignis.runtime.drafters.base import BaseDrafter, DraftProposal, DraftRequest
from ignis.runtime.errors import ConfigError

__all__ = ["NgramDrafter", "build_ngram_drafter", "propose_ngram"]

MAX_LOOKUP = 64  # the largest prompt_lookup_max accepted (longer n-grams only cost index memory)


def propose_ngram(
    token_ids: Sequence[int],
    num_drafts: int,
    *,
    prompt_lookup_min: int,
    prompt_lookup_max: int,
    is_periodic: bool = True,
) -> list[int]:
    """Reference implementation (a direct scan, O(context * n range)): the drafts for one context.

    Same rule as `NgramDrafter` (module docstring), written plainly for tests and one-off use.

    Args:
        token_ids: the lane's context, the anchor last.
        num_drafts: k, the most drafts wanted.

    Returns:
        0..num_drafts token ids.
    """
    toks = list(token_ids)
    length = len(toks)
    for n in range(min(prompt_lookup_max, length - 1), prompt_lookup_min - 1, -1):
        suffix = toks[length - n :]
        # most recent occurrence ending at e < length (e = index just past the match)
        for e in range(length - 1, n - 1, -1):
            if toks[e - n : e] == suffix:
                return _continuation(toks, e, num_drafts, is_periodic)
    return []


def _continuation(toks: Sequence[int], end: int, num_drafts: int, is_periodic: bool) -> list[int]:
    length = len(toks)
    if not is_periodic:
        return list(toks[end : end + num_drafts])
    period = length - end
    return [toks[end + (j % period)] for j in range(num_drafts)]


@dataclass
class _LaneIndex:
    tokens: list[int] = field(default_factory=list)  # the context indexed so far
    # n-gram (as a tuple) -> end (exclusive) of its most recent occurrence whose next token is known,
    # i.e. end <= len(tokens) - 1; the context's own suffix is added once a token follows it.
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)


class NgramDrafter(BaseDrafter):
    """Prompt lookup drafter (module docstring). Needs no model; keeps an n-gram index per lane.

    Args:
        prompt_lookup_min: the shortest n-gram matched (>= 1). 1 matches almost every token of prose
            (many drafts, most rejected); 2-3 trades drafts for acceptance.
        prompt_lookup_max: the longest n-gram matched (prompt_lookup_min..64); longer matches are
            tried first.
        is_periodic: continue a repeating suffix past the context's end (module docstring).
        is_row_budgeted: act as a row-budgeted backend (drafts per lane = min(draft_tokens,
            draft_rows // lanes - 1), like MTP) instead of draft_tokens per lane (like DFlash2).
            Drafts are free here, but every draft costs a verify row.

    Raises:
        ConfigError: prompt_lookup_min < 1 or prompt_lookup_max outside prompt_lookup_min..64.
    """

    name = "ngram"

    def __init__(
        self,
        *,
        prompt_lookup_min: int = 2,
        prompt_lookup_max: int = 4,
        is_periodic: bool = True,
        is_row_budgeted: bool = False,
    ) -> None:
        if prompt_lookup_min < 1:
            raise ConfigError(f"ngram: prompt_lookup_min must be >= 1, got {prompt_lookup_min}")
        if not prompt_lookup_min <= prompt_lookup_max <= MAX_LOOKUP:
            raise ConfigError(
                f"ngram: prompt_lookup_max must be in prompt_lookup_min..{MAX_LOOKUP} "
                f"({prompt_lookup_min}..{MAX_LOOKUP}), got {prompt_lookup_max}"
            )
        self.prompt_lookup_min = int(prompt_lookup_min)
        self.prompt_lookup_max = int(prompt_lookup_max)
        self.is_periodic = bool(is_periodic)
        self.is_row_budgeted = bool(is_row_budgeted)
        self._lanes: dict[int, _LaneIndex] = {}

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        """Index the prompt (its n-grams ending before its last token)."""
        lane = _LaneIndex()
        self._lanes[lane_id] = lane
        self._extend(lane, prompt_token_ids)

    def end_lane(self, lane_id: int) -> None:
        """Drop the lane's index."""
        self._lanes.pop(lane_id, None)

    supports_checkpoints = True

    def snapshot_lane(self, lane_id: int, num_tokens: int) -> DrafterSnapshot:
        """Nothing to keep: the index is a function of the tokens, rebuilt by `restore_lane`. Valid
        for any prefix of the checkpoint's tokens (`is_truncatable`)."""
        return DrafterSnapshot(num_tokens=int(num_tokens), meta={"is_truncatable": 1})

    def restore_lane(self, lane_id: int, prompt_token_ids: Sequence[int], snapshot: DrafterSnapshot) -> None:
        """Index the prompt, as `start_lane` (O(prompt) dictionary inserts, no model work)."""
        self.start_lane(lane_id, prompt_token_ids)

    def _extend(self, lane: _LaneIndex, token_ids: Sequence[int]) -> None:
        """Bring the index up to `token_ids` (which must extend the indexed context)."""
        toks = lane.tokens
        old = len(toks)
        new = len(token_ids)
        if new < old or (old and token_ids[old - 1] != toks[old - 1]):
            # the context is not an extension of the indexed one (a protocol misuse): rebuild
            lane.tokens, lane.last_end = [], {}
            toks, old = lane.tokens, 0
        toks.extend(int(t) for t in token_ids[old:new])
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        index = lane.last_end
        # the n-grams ending at e (exclusive) become usable once token e exists: e = old .. new - 1
        for e in range(max(old, 1), new):
            for n in range(lo, min(hi, e) + 1):
                index[tuple(toks[e - n : e])] = e

    def _lookup(self, lane: _LaneIndex, num_drafts: int) -> list[int]:
        toks = lane.tokens
        length = len(toks)
        index = lane.last_end
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            end = index.get(tuple(toks[length - n :]))
            if end is not None:
                return _continuation(toks, end, num_drafts, self.is_periodic)
        return []

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """Drafts per request (module docstring); `draft_probs` is None (a point mass)."""
        out = []
        for req in requests:
            lane = self._lanes.get(req.lane_id)
            if lane is None:  # a lane the drafter never saw start: index it now
                lane = self._lanes[req.lane_id] = _LaneIndex()
            self._extend(lane, req.token_ids)
            drafts = self._lookup(lane, req.num_drafts)
            out.append(DraftProposal(torch.tensor(drafts, dtype=torch.int64)))
        return out


def build_ngram_drafter(
    *,
    prompt_lookup_min: int = 2,
    prompt_lookup_max: int = 4,
    is_periodic: bool = True,
    is_row_budgeted: bool = False,
) -> NgramDrafter:
    """The registered `ngram` factory (`--spec-backend ngram`); arguments as `NgramDrafter`.

    Raises:
        ConfigError: as `NgramDrafter`.
    """
    return NgramDrafter(
        prompt_lookup_min=prompt_lookup_min,
        prompt_lookup_max=prompt_lookup_max,
        is_periodic=is_periodic,
        is_row_budgeted=is_row_budgeted,
    )


if "ngram" not in DRAFTERS:
    register_drafter("ngram", build_ngram_drafter)
