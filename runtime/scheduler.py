"""The lanes scheduler: how many drafts each lane gets in a verify round, and how many lanes may run.

A verify round carries sum over lanes of (drafts + 1) rows. Two drafting policies (seeds:
speculative-decoding, "The row budget"; DESIGN.md, "The verify round", step 1):

- **row-budgeted** (MTP, Flash-Next): the round may take at most `draft_rows` rows across all lanes
  (0 means 8, at most 32), so each active lane drafts

      min(draft_tokens, draft_rows // num_active_lanes - 1), clamped at 0.

  A budget of 8 with 3 draft tokens gives 3 drafts at 1-2 lanes, 1 at 3-4 and none from 5 lanes on:
  a busy server falls back to plain decode rounds. A lane with 0 drafts still takes its one row.
- **fixed** (DFlash2, the 27B): every lane drafts `draft_tokens` (1..7), whatever the lane count.

Per-lane caps (`plan`) then clip each lane's drafts to what can still be used: a lane never drafts past
its `max_tokens` or its context end, because the committed run (drafts + 1 tokens) could not be
emitted anyway. Lanes join and leave only between rounds; `num_to_admit` applies `max_lanes` (a lane
being prefilled holds its lane).

Prefill budget (`plan_prefill`): at most `max_prefill_tokens` prompt tokens are prefilled per step
across all lanes (0: no limit), in arrival order; a prompt longer than what is left is cut, and the
lane continues first at the next step (chunked prefill, as vLLM's `max_num_batched_tokens` and
llama.cpp's `n_batch`), while the active lanes get their verify round every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ignis.runtime.errors import ConfigError

__all__ = [
    "DEFAULT_DRAFT_ROWS",
    "DEFAULT_MAX_PREFILL_TOKENS",
    "MAX_DRAFT_ROWS",
    "MAX_DRAFT_TOKENS",
    "LaneScheduler",
    "check_max_prefill_tokens",
    "drafts_per_lane",
    "effective_draft_rows",
]

MAX_DRAFT_TOKENS = 7  # most drafts per lane per round (--spec-draft-tokens 1..7)
DEFAULT_DRAFT_ROWS = 8  # what --spec-draft-rows 0 means: the widest decode-route width
MAX_DRAFT_ROWS = 32  # widest verify round a profile compiles
DEFAULT_MAX_PREFILL_TOKENS = 2048
"""Prompt tokens prefilled per step across all lanes by default (`max_prefill_tokens`).

2048 is llama.cpp's default `n_batch`, and of the order of vLLM's `max_num_batched_tokens` defaults
(2048 to 8192 by device and entry point). A forward of 2048 columns already runs the GPU's matrix
products at their compute-bound rate, so a longer chunk gains little prefill throughput, while the
active lanes wait for at most one such forward per step instead of a whole long prompt. It is a
multiple of the 64-column chunk of the Gated DeltaNet prefill
(`ignis.runtime.families.gated_deltanet.GDN_CHUNK_SIZE`), so a prompt prefilled alone keeps that chunk
grid; when other prompts share a step's budget its chunk boundaries shift with theirs (the same
columns split differently: float rounding, not a different result). On CPU, where a 2048-token chunk
takes seconds, a smaller value (e.g. 256) keeps the other lanes more responsive at some cost in
prefill throughput.
"""


def check_max_prefill_tokens(value: object) -> int:
    """`max_prefill_tokens` checked: an integer >= 0 (0: no limit, a whole prompt in one step).

    Raises:
        ConfigError: a bool, a non-integer or a negative value.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"max_prefill_tokens {value!r} must be an integer >= 0 (prompt tokens prefilled per step "
            "across all lanes; 0 means no limit)"
        )
    return value


def effective_draft_rows(draft_rows: int) -> int:
    """The row budget that `draft_rows` means: 0 -> 8, otherwise itself (1..32).

    Raises:
        ConfigError: draft_rows is not an integer in 0..32.
    """
    if (
        isinstance(draft_rows, bool)
        or not isinstance(draft_rows, int)
        or not 0 <= draft_rows <= MAX_DRAFT_ROWS
    ):
        raise ConfigError(
            f"spec draft_rows {draft_rows!r} outside 0..{MAX_DRAFT_ROWS} (0 means {DEFAULT_DRAFT_ROWS})"
        )
    return draft_rows or DEFAULT_DRAFT_ROWS


def drafts_per_lane(
    *, draft_tokens: int, num_active_lanes: int, draft_rows: int, is_row_budgeted: bool
) -> int:
    """Drafts each active lane gets this round (module docstring), before per-lane caps.

    Args:
        draft_tokens: k, 0..7 (0: no drafting at all, the `off` backend).
        num_active_lanes: lanes in the round, >= 1.
        draft_rows: the row budget as configured (0 means 8); only read when `is_row_budgeted`.
        is_row_budgeted: True for MTP-like drafters, False for DFlash2-like ones.

    Raises:
        ConfigError: draft_tokens outside 0..7 or draft_rows outside 0..32.
        ValueError: num_active_lanes < 1.
    """
    _check_draft_tokens(draft_tokens, allow_zero=True)
    rows = effective_draft_rows(draft_rows)
    if num_active_lanes < 1:
        raise ValueError(f"num_active_lanes must be >= 1, got {num_active_lanes}")
    if not is_row_budgeted:
        return draft_tokens
    return max(0, min(draft_tokens, rows // num_active_lanes - 1))


def _check_draft_tokens(draft_tokens: int, *, allow_zero: bool) -> None:
    low = 0 if allow_zero else 1
    if (
        isinstance(draft_tokens, bool)
        or not isinstance(draft_tokens, int)
        or not low <= draft_tokens <= MAX_DRAFT_TOKENS
    ):
        raise ConfigError(f"spec draft_tokens {draft_tokens!r} outside {low}..{MAX_DRAFT_TOKENS}")


@dataclass(frozen=True)
class LaneScheduler:
    """Per-round drafting plan and lane admission, validated on construction.

    Raises:
        ConfigError: a field is out of range (named in the message).
    """

    draft_tokens: int  # k: drafts per lane per round, 1..7; 0 = plain decode rounds (backend off)
    draft_rows: int = 0  # row budget across lanes for row-budgeted drafters (0 means 8, at most 32)
    is_row_budgeted: bool = False  # True: MTP-like (budget applies); False: DFlash2-like (k per lane)
    max_lanes: int | None = None  # most lanes decoding or being prefilled at once (>= 1); None = unlimited
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS  # prompt tokens prefilled per step; 0 = unlimited

    def __post_init__(self) -> None:
        check_max_prefill_tokens(self.max_prefill_tokens)
        _check_draft_tokens(self.draft_tokens, allow_zero=True)
        effective_draft_rows(self.draft_rows)
        if self.max_lanes is not None and (
            isinstance(self.max_lanes, bool) or not isinstance(self.max_lanes, int) or self.max_lanes < 1
        ):
            raise ConfigError(f"max_lanes {self.max_lanes!r} must be None or an integer >= 1")

    @property
    def row_budget(self) -> int:
        """The effective row budget (draft_rows with 0 read as 8)."""
        return effective_draft_rows(self.draft_rows)

    def num_drafts(self, num_active_lanes: int) -> int:
        """Drafts per lane for a round of `num_active_lanes` lanes (before per-lane caps)."""
        return drafts_per_lane(
            draft_tokens=self.draft_tokens,
            num_active_lanes=num_active_lanes,
            draft_rows=self.draft_rows,
            is_row_budgeted=self.is_row_budgeted,
        )

    def plan(self, max_useful_drafts: Sequence[int]) -> list[int]:
        """Drafts for each lane of a round.

        Args:
            max_useful_drafts: per active lane (one entry each, in round order), the most drafts whose
                tokens could still be emitted: min(tokens left before max_tokens, tokens left before
                the context end) - 1. Negative values count as 0.

        Returns:
            per lane, min(num_drafts(len(max_useful_drafts)), cap), >= 0.
        """
        if not max_useful_drafts:
            return []
        base = self.num_drafts(len(max_useful_drafts))
        return [max(0, min(base, cap)) for cap in max_useful_drafts]

    def num_to_admit(self, num_active: int, num_waiting: int) -> int:
        """How many waiting lanes may join before the next round (first come, first served); num_active
        counts the lanes decoding and the lanes being prefilled."""
        if self.max_lanes is None:
            return num_waiting
        return max(0, min(num_waiting, self.max_lanes - num_active))

    def plan_prefill(self, num_left: Sequence[int]) -> list[int]:
        """Prompt tokens to prefill this step for each lane of the prefill queue, within the budget.

        Args:
            num_left: per lane, in queue order (the lane being prefilled first, then the waiting lanes
                that may join), the prompt tokens not yet prefilled (>= 1).

        Returns:
            chunk sizes (each >= 1) for the first lanes of the queue, in order: each lane takes what is
            left of its prompt or of the budget, whichever is smaller, until the budget is spent (only
            the last lane planned can be cut). Every lane when max_prefill_tokens is 0.
        """
        if not self.max_prefill_tokens:
            return list(num_left)
        left = self.max_prefill_tokens
        sizes: list[int] = []
        for n in num_left:
            if left <= 0:
                break
            take = min(n, left)
            sizes.append(take)
            left -= take
        return sizes
