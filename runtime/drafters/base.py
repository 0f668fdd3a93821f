"""The drafter protocol: propose draft tokens per lane, and follow each lane's committed tokens.

A drafter proposes up to k tokens after each lane's anchor (DESIGN.md, "The verify round", step 2);
the engine verifies them with the model and tells the drafter what was committed. The drafter's
context advances by committed tokens only (step 5): whatever it computed for its own proposals is
discarded unless a later `commit` confirms it, so a rejected draft leaves no trace in the drafter
either (DFlash2: the tapped target hidden states over its 2,048-position window; MTP: its own KV).

Lifecycle per lane, driven by `ignis.runtime.engine.SpeculativeEngine`:

1. `start_lane(lane_id, prompt_token_ids)` (the whole prompt) after the lane's first prefill forward,
   then `commit([span])` with the prompt's span (positions 0..len(prompt)-1, the first output token as
   the last `next_token_ids` entry). A prompt longer than the engine's prefill budget
   (`max_prefill_tokens`) is prefilled in chunks over several steps: one `commit([span])` per chunk,
   in order (start = the chunk's first position; an inner chunk's last `next_token_ids` entry is the
   next prompt token, the last chunk's is the first output token), so the spans tile the prompt as the
   one span would. No `propose` comes before the last chunk; a lane cancelled between chunks gets
   `end_lane`.
2. Each round the lane drafts in: `propose([request, ...])` (only lanes with num_drafts >= 1), then,
   after acceptance, `commit([span, ...])` with every continuing lane's committed columns.
3. `end_lane(lane_id)` when the lane finishes (stop, length, abort); no commit for its last run,
   unless the engine records the lane's state at the end of its reply (a prompt checkpoint): then the
   last run is committed first and `snapshot_lane` follows.

Prompt checkpoints (`ignis.runtime.checkpoints`): a drafter with `supports_checkpoints` implements
`snapshot_lane(lane_id, num_tokens)` (its context once the lane's first num_tokens tokens are
committed, taken between steps) and `restore_lane(lane_id, prompt_token_ids, snapshot)`, which
replaces `start_lane` for a lane that starts from a checkpoint: the prompt's remaining spans follow
from position `snapshot.num_tokens` on (none when the checkpoint covers the whole prompt).

Positions: the anchor of a lane sits at position `DraftRequest.position` = the number of tokens the
model has committed for the lane (prompt + output - 1); draft j (0-based) is proposed for position
position + 1 + j.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from ignis.runtime.errors import IgnisRuntimeError
from ignis.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from ignis.runtime.checkpoints import DrafterSnapshot

__all__ = ["BaseDrafter", "CommittedSpan", "DraftProposal", "DraftRequest", "Drafter", "DrafterError"]


class DrafterError(IgnisRuntimeError):
    """A drafter broke its protocol (more drafts than asked, a token id outside the vocabulary,
    draft_probs of the wrong shape, a proposal list of the wrong length); the message names the lane."""


@dataclass(frozen=True)
class DraftRequest:
    """What the engine asks of a drafter for one lane in one round.

    Attributes:
        lane_id: the lane.
        num_drafts: k, the most drafts wanted (>= 1); fewer may be returned.
        token_ids: the lane's prompt + output so far (read-only; the engine passes a view of the lane,
            valid during the call: copy it to keep it); the last one is the anchor.
        num_prompt_tokens: how many of token_ids are the prompt.
        params: the lane's sampling parameters (a stochastic drafter may sample at its temperature).
        generator: the lane's random stream, on the engine's device (use it for reproducible seeds).
    """

    lane_id: int
    num_drafts: int
    token_ids: Sequence[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator

    @property
    def anchor_token_id(self) -> int:
        """The lane's anchor: its last token, which the model has not yet been fed."""
        return int(self.token_ids[-1])

    @property
    def position(self) -> int:
        """The anchor's position (tokens the model has committed for this lane)."""
        return len(self.token_ids) - 1


@dataclass(frozen=True)
class DraftProposal:
    """One lane's drafts.

    Attributes:
        draft_token_ids: int64 [k'], 0 <= k' <= num_drafts, token ids in [0, vocab).
        draft_probs: float [k', vocab], q: row j is the distribution draft j was sampled from; None for
            a deterministic drafter (q is then a point mass on each draft). Read only under sampling.
    """

    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None = None


@dataclass(frozen=True)
class CommittedSpan:
    """Columns the model committed for one lane: what a drafter's context advances by.

    Column i (0 <= i < m) is position start + i; `input_token_ids[i]` was fed there and
    `next_token_ids[i]` is the model's token after it (an accepted draft, or the bonus token for the
    last column, which is the lane's new anchor). So input_token_ids[i + 1] == next_token_ids[i].

    Attributes:
        lane_id: the lane.
        start: position of the first column.
        input_token_ids: [m] token ids fed at positions start .. start + m - 1.
        next_token_ids: [m] the token the model committed after each column.
        hidden_states: [m, hidden_size] last decoder layer output before the final norm (executor
            dtype), or None unless the drafter `needs_hidden_states`.
        taps: [m, len(tap_layers) * hidden_size] the drafter's tapped layers, or None without tap_layers.
    """

    lane_id: int
    start: int
    input_token_ids: tuple[int, ...]
    next_token_ids: tuple[int, ...]
    hidden_states: torch.Tensor | None = None
    taps: torch.Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    """A speculative drafter (module docstring for the lifecycle).

    Attributes:
        name: the backend name (`--spec-backend`), e.g. "dflash2", "mtp", or a test drafter's name.
        is_row_budgeted: True when the row budget applies (MTP): drafts per lane =
            min(draft_tokens, draft_rows // lanes - 1); False (DFlash2): draft_tokens per lane.
        needs_hidden_states: the engine requests the model's last hidden states for committed columns.
        tap_layers: decoder layers whose outputs the engine requests (concatenated, in this order).
    """

    name: str
    is_row_budgeted: bool
    needs_hidden_states: bool
    tap_layers: tuple[int, ...]

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        """A lane joined (its prompt, or the prompt's first chunk, was prefilled); the prompt's span
        (or one span per chunk) is committed next."""
        ...

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """One proposal per request, in request order."""
        ...

    def commit(self, spans: Sequence[CommittedSpan]) -> None:
        """Advance each span's lane by its committed columns (and nothing else)."""
        ...

    def end_lane(self, lane_id: int) -> None:
        """The lane finished; drop its context."""
        ...


class BaseDrafter:
    """Convenience base: the protocol's attributes with defaults and no-op lifecycle hooks."""

    name: str = "drafter"
    is_row_budgeted: bool = False
    needs_hidden_states: bool = False
    tap_layers: tuple[int, ...] = ()
    #: whether `snapshot_lane` / `restore_lane` are implemented (prompt checkpoints are off otherwise)
    supports_checkpoints: bool = False

    def snapshot_lane(self, lane_id: int, num_tokens: int) -> DrafterSnapshot | None:
        """The lane's context at num_tokens committed tokens (module docstring); None by default
        (a drafter that cannot be checkpointed: `supports_checkpoints` is False)."""
        return None

    def restore_lane(self, lane_id: int, prompt_token_ids: Sequence[int], snapshot: DrafterSnapshot) -> None:
        """Start a lane from a snapshot (module docstring).

        Raises:
            CheckpointError: this drafter cannot restore (`supports_checkpoints` is False).
        """
        from ignis.runtime.checkpoints import CheckpointError

        raise CheckpointError(f"drafter {self.name!r} cannot restore a lane from a checkpoint")

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        """Nothing to set up by default."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """Subclasses implement this."""
        raise NotImplementedError

    def commit(self, spans: Sequence[CommittedSpan]) -> None:
        """Nothing to advance by default."""

    def end_lane(self, lane_id: int) -> None:
        """Nothing to drop by default."""
