"""`--spec-backend draft-model`: a smaller model of the same tokenizer drafts k tokens autoregressively.

Classic speculative decoding (Leviathan et al. 2023, Chen et al. 2023; vLLM's and llama.cpp's
"draft model"): any ignis model (an `Executor` plus its tokenizer) drafts for the target, provided the
two tokenizers agree (`check_tokenizers_match`: the same token at every id, the same special ids and
end-of-sequence ids; otherwise `TokenizerMismatchError` names the first differing id).

The drafter keeps its own state per lane (its KV cache / recurrent state, in its own executor) and
advances it by committed tokens only, through the executor's forward/commit protocol
(`ignis.runtime.families.base.Executor`), so any family works, hybrids included. Per lane it tracks
the lane's *confirmed* tokens (prompt + output, the anchor last) and how many of them its state holds
(`num_fed`, a prefix). A round runs one of two schedules.

Kept drafts (the executor can rewind: `rewind(states, num_tokens)`, see `rewinder_for`):

1. `propose`, step 1: one forward of the confirmed tokens not yet fed, the anchor last (the prompt on
   the lane's first proposal; else the anchor, plus the last draft when the target accepted all k),
   committed whole; its last logits give d_1.
2. Steps j = 2..k: one forward of the single column [d_{j-1}], committed at once (speculatively);
   its logits give d_j. After step k the state holds d_1 .. d_{k-1} past the confirmed tokens.
3. `commit(span)`: the state is rewound to the confirmed tokens it holds: the longest prefix of
   d_1 .. d_{k-1} equal to the committed tokens (the accepted drafts, min(accepted, k - 1)) stays, the
   rest is dropped. No forward runs at commit.

   So a round costs k forwards of one column each, plus at most one catch-up column in step 1 (d_k,
   when every draft was accepted): k or k + 1 columns.

Re-run drafts (no rewind; the hybrid families, wrappers): the protocol allows one uncommitted
forward per lane and no rollback of committed tokens, so a draft can only be kept once confirmed:

1. step 1 as above;
2. steps j = 2..k: one forward of [d_1 .. d_{j-1}] (`record=True`), whose last logits give d_j.
   Steps 2..k-1 are discarded (`commit(0)`); the last one (columns d_1 .. d_{k-1}) is left *pending*;
3. `commit(span)`: the pending forward is committed for its longest prefix equal to the confirmed
   tokens (the accepted drafts, min(accepted, k - 1) columns).

   So a round costs k forwards of 1 + 1 + 2 + .. + (k - 1) columns (plus the one or two confirmed
   tokens of step 1): step j re-runs d_1 .. d_{j-2}.

Both schedules give the same drafts (the draft logits of a position do not depend on how the columns
were batched, up to float rounding: bit for bit on the float64 toy model of the tests). A rejected
draft leaves no trace: the state after a round equals the state from feeding the confirmed tokens
alone (tests check it bit for bit on a recurrent toy model and to float tolerance on llama / qwen2).

Drafting rule: under greedy decoding (temperature 0) d_j is the argmax of the draft logits and q is a
point mass (`draft_probs` None). Under sampling d_j is drawn from q = the draft logits through the
lane's own sampling parameters (temperature, top-k, top-p: `ignis.runtime.sampling.logits_to_probs`)
with the lane's random stream, and q is returned, so the engine's rejection sampling keeps the
target's distribution exactly. Draft logits are fitted to the target's vocabulary size: ids past it
are masked out (-inf), missing ids get probability 0.

A lane whose next proposal would pass the draft model's `max_position_embeddings` gets zero drafts
(plain decode rows) instead of an error, and so does, for the rest of its life, a lane whose context
holds an id past the draft model's vocabulary (a wider target vocabulary's padding id, sampled).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ignis.runtime.checkpoints import DrafterSnapshot
from ignis.runtime.drafters import DRAFTERS, register_drafter
from ignis.runtime.drafters.base import BaseDrafter, CommittedSpan, DraftProposal, DraftRequest
from ignis.runtime.drafters.common import DrafterFitError
from ignis.runtime.errors import ConfigError, StateError
from ignis.runtime.families.base import Executor, LaneState
from ignis.runtime.sampling import logits_to_probs, sample_token
from ignis.runtime.tokenizer import Tokenizer, TokenizerSpec

__all__ = [
    "DraftModelDrafter",
    "Rewind",
    "TokenizerMismatchError",
    "build_draft_model_drafter",
    "check_tokenizers_match",
    "rewinder_for",
]

#: ``rewind(states, num_tokens)``: drop the committed tokens of lane i past its first num_tokens[i]
#: (0 <= num_tokens[i] <= state.num_tokens, no pending forward); afterwards the state equals the state
#: reached by feeding those first tokens alone. Raises StateError otherwise, changing nothing.
Rewind = Callable[[Sequence[LaneState], Sequence[int]], None]


def rewinder_for(executor: Any) -> Rewind | None:
    """The executor's rewind (`Rewind`): its own `rewind` method (`LlamaExecutor.rewind` for llama and
    qwen2), else None (the drafter then re-runs drafts: module docstring)."""
    own = getattr(executor, "rewind", None)
    if callable(own):
        return own  # type: ignore[no-any-return]
    return None


class TokenizerMismatchError(DrafterFitError):
    """The draft model's tokenizer differs from the target's.

    Attributes:
        token_id: the first id at which they differ.
        what: "vocabulary" (the token spelled at that id), "special" (special in one only) or "eos"
            (ends generation in one only).
        target_token / draft_token: the token at that id in each (None where the id is absent).
    """

    def __init__(
        self, message: str, *, token_id: int, what: str, target_token: str | None, draft_token: str | None
    ) -> None:
        super().__init__(message)
        self.token_id = token_id
        self.what = what
        self.target_token = target_token
        self.draft_token = draft_token


def _as_tokenizer(t: Tokenizer | TokenizerSpec) -> Tokenizer:
    return t if isinstance(t, Tokenizer) else Tokenizer(t)


def check_tokenizers_match(target: Tokenizer | TokenizerSpec, draft: Tokenizer | TokenizerSpec) -> None:
    """Check that a draft model's tokenizer equals the target's, id by id.

    Compared, in order: the vocabulary (the token spelled at every id, added tokens included, over
    the larger of the two sizes), the special ids (added tokens marked special), the end-of-sequence
    ids, and the ids of the named special tokens (bos_token, eos_token, ...). Merges and
    pre-tokenizers are not compared: with equal vocabularies the target verifies whatever the draft
    proposes, so they only affect acceptance, never correctness.

    Raises:
        TokenizerMismatchError: naming the first differing id and the token each side has there.
    """
    t, d = _as_tokenizer(target), _as_tokenizer(draft)
    tv = {i: s for s, i in t.backend.get_vocab(with_added_tokens=True).items()}
    dv = {i: s for s, i in d.backend.get_vocab(with_added_tokens=True).items()}
    for i in range(max(len(tv), len(dv), max(tv, default=-1) + 1, max(dv, default=-1) + 1)):
        if tv.get(i) != dv.get(i):
            raise TokenizerMismatchError(
                f"draft model's tokenizer differs from the target's at id {i}: target {tv.get(i)!r}, "
                f"draft {dv.get(i)!r} (vocabularies of {len(tv)} and {len(dv)} tokens); use a draft model "
                f"of the target's tokenizer",
                token_id=i,
                what="vocabulary",
                target_token=tv.get(i),
                draft_token=dv.get(i),
            )
    for what, ts, ds in (
        ("special", set(t.special_token_ids), set(d.special_token_ids)),
        ("eos", set(t.eos_token_ids), set(d.eos_token_ids)),
        (
            "special",
            {i for i in (t.token_to_id(s) for s in t.spec.special_tokens.values() if s) if i is not None},
            {i for i in (d.token_to_id(s) for s in d.spec.special_tokens.values() if s) if i is not None},
        ),
    ):
        diff = sorted(ts ^ ds)
        if diff:
            i = diff[0]
            label = "a special token" if what == "special" else "an end-of-sequence id"
            raise TokenizerMismatchError(
                f"draft model's tokenizer differs from the target's at id {i} ({tv.get(i)!r}): {label} in "
                f"the {'target' if i in ts else 'draft'} only",
                token_id=i,
                what=what,
                target_token=tv.get(i),
                draft_token=dv.get(i),
            )


@dataclass(eq=False)
class _Lane:
    state: LaneState
    confirmed: list[int]  # the lane's tokens (prompt + output), the anchor last once known
    pending: list[int] | None = None  # columns of the uncommitted forward, after `confirmed[:num_fed]`
    speculative: list[int] = field(default_factory=list)  # drafts committed past the confirmed ones
    num_proposals: int = 0
    num_fed_columns: int = 0  # columns run through the draft model for this lane (cost counter)
    is_disabled: bool = False  # a token the draft model cannot embed was committed: no more drafts


class DraftModelDrafter(BaseDrafter):
    """Drafts with a smaller model of the target's tokenizer (module docstring for the algorithm).

    Args:
        executor: the draft model's executor (any family).
        tokenizer: the draft model's tokenizer (checked against `target_tokenizer` when both are given).
        target_tokenizer: the target's tokenizer.
        vocab_size: the target's vocabulary size (rows of its logits); default: the draft model's
            `config.vocab_size`. Draft logits are cut or padded to it.
        is_row_budgeted: act as a row-budgeted backend (min(draft_tokens, draft_rows // lanes - 1)
            drafts per lane, like MTP) instead of draft_tokens per lane.
        owner: an object kept alive as long as the drafter (e.g. the memory-mapped artifact whose
            zero-copy views the executor's weights are); closed by `close()` if it has `close`.
        keep_drafts: the round schedule (module docstring): True keeps drafts and rewinds (the
            executor must be rewindable, `rewinder_for`), False re-runs them, None (default) keeps
            them wherever the executor can rewind.

    Attributes:
        keeps_drafts: whether the kept-drafts schedule runs.

    Raises:
        TokenizerMismatchError: the tokenizers differ (the first differing id is named).
        ConfigError: no vocab_size given and the draft config has none; keep_drafts=True with an
            executor that cannot rewind.
    """

    name = "draft-model"

    def __init__(
        self,
        executor: Executor,
        *,
        tokenizer: Tokenizer | TokenizerSpec | None = None,
        target_tokenizer: Tokenizer | TokenizerSpec | None = None,
        vocab_size: int | None = None,
        is_row_budgeted: bool = False,
        owner: Any = None,
        keep_drafts: bool | None = None,
    ) -> None:
        if tokenizer is not None and target_tokenizer is not None:
            check_tokenizers_match(target_tokenizer, tokenizer)
        draft_vocab = getattr(executor.config, "vocab_size", None)
        if vocab_size is None:
            vocab_size = draft_vocab
        if vocab_size is None:
            raise ConfigError("draft-model: give vocab_size (the draft config has no vocab_size)")
        self.executor = executor
        self.vocab_size = int(vocab_size)
        self.is_row_budgeted = bool(is_row_budgeted)
        self.max_positions: int | None = getattr(executor.config, "max_position_embeddings", None)
        pool_max = getattr(executor, "max_context", None)  # static executors: fixed-capacity lane slots
        if isinstance(pool_max, int):
            self.max_positions = pool_max if self.max_positions is None else min(self.max_positions, pool_max)
        self.draft_vocab_size: int = int(draft_vocab if draft_vocab is not None else vocab_size)
        self.owner = owner
        self._rewind: Rewind | None = rewinder_for(executor) if keep_drafts is not False else None
        if keep_drafts and self._rewind is None:
            raise ConfigError(
                f"draft-model: keep_drafts=True needs an executor that can rewind; "
                f"{type(executor).__name__} cannot (use keep_drafts=None or False)"
            )
        self.keeps_drafts = self._rewind is not None
        self._lanes: dict[int, _Lane] = {}

    @classmethod
    def from_artifact(
        cls,
        path: str | Path,
        *,
        target_tokenizer: Tokenizer | TokenizerSpec,
        vocab_size: int | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        verify: str = "fast",
        is_row_budgeted: bool = False,
        keep_drafts: bool | None = None,
    ) -> DraftModelDrafter:
        """A drafter over an ignis artifact directory (`ignis-build` output) of the draft model.

        The artifact's executor is built with `Artifact.make_executor(device=, dtype=)` (dtype None:
        the card profile's) and its stored tokenizer is checked against `target_tokenizer`.
        `keep_drafts` as in the constructor.

        Raises:
            ConfigError: the artifact stores no tokenizer (the match cannot be checked), or as the
                constructor.
            TokenizerMismatchError: the tokenizers differ.
            the `ignis.formats` / `ignis.runtime.artifact` errors of `load_artifact` (invalid artifact).
        """
        from ignis.runtime.artifact import load_artifact

        art = load_artifact(path, verify=verify)  # type: ignore[arg-type]
        try:
            spec = art.tokenizer_spec()
            if spec is None:
                raise ConfigError(
                    f"{path}: the draft artifact stores no tokenizer; its match with the "
                    f"target's cannot be checked"
                )
            check_tokenizers_match(target_tokenizer, spec)
            executor = art.make_executor(device=device, dtype=dtype)
            drafter = cls(
                executor,
                vocab_size=vocab_size,
                is_row_budgeted=is_row_budgeted,
                owner=art,
                keep_drafts=keep_drafts,
            )
        except BaseException:
            art.close()
            raise
        return drafter

    def close(self) -> None:
        """Drop every lane and close the owner (e.g. unmap the artifact)."""
        self._lanes.clear()
        close = getattr(self.owner, "close", None)
        if callable(close):
            close()

    # ---- lanes -------------------------------------------------------------------------------

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        """A fresh draft state; the prompt is fed by the lane's first proposal (lazily)."""
        self._lanes[lane_id] = _Lane(self.executor.new_lane(), [int(t) for t in prompt_token_ids])

    def end_lane(self, lane_id: int) -> None:
        """Drop the lane's state (a pending forward is dropped with it); an executor with a
        `release_lane(state)` method (pooled lane slots) gets the state back."""
        lane = self._lanes.pop(lane_id, None)
        release = getattr(self.executor, "release_lane", None)
        if lane is not None and callable(release):
            release(lane.state)

    @property
    def supports_checkpoints(self) -> bool:  # type: ignore[override]
        """Whether the draft executor's lane state can be captured (`ignis.runtime.checkpoints`)."""
        from ignis.runtime.checkpoints import model_state_io

        return model_state_io(self.executor) is not None

    def snapshot_lane(self, lane_id: int, num_tokens: int) -> DrafterSnapshot:
        """The draft model's own state for the lane: the confirmed tokens it holds (``num_fed`` <=
        num_tokens, meta) as the draft executor's canonical tensors (`ignis.runtime.checkpoints`).
        Taken between rounds (no pending forward, no speculative drafts). Truncatable where the draft
        executor's state is (attention only) or when it holds nothing yet (its prompt is fed lazily).

        Raises:
            StateError: unknown lane, or a lane with an unresolved round.
        """
        from ignis.runtime.checkpoints import capture_model_state, model_state_io

        lane = self._lanes.get(lane_id)
        if lane is None:
            raise StateError(f"draft-model: snapshot of lane {lane_id}, which did not start")
        if lane.pending is not None or lane.speculative:
            raise StateError(f"draft-model: lane {lane_id} has an unresolved round; commit first")
        fed = int(lane.state.num_tokens)
        if fed > num_tokens:
            raise StateError(
                f"draft-model: lane {lane_id} holds {fed} tokens, past the checkpoint's {num_tokens}"
            )
        io = model_state_io(self.executor)
        assert io is not None
        truncatable = fed == 0 or io.is_truncatable(self.executor)
        tensors = capture_model_state(self.executor, lane.state) if fed else {}
        meta = {"num_fed": fed, "is_truncatable": int(truncatable), "is_disabled": int(lane.is_disabled)}
        return DrafterSnapshot(num_tokens=int(num_tokens), tensors=tensors, meta=meta)

    def restore_lane(self, lane_id: int, prompt_token_ids: Sequence[int], snapshot: DrafterSnapshot) -> None:
        """Start the lane with its draft state restored (the tokens of the prompt it does not hold yet
        are fed by its first proposal, as for a fresh lane). `snapshot.num_tokens` is the position the
        target restores at: a truncatable snapshot may come with one below the position it was taken
        at, and then at most that many of its tokens are restored.

        Raises:
            CheckpointError: the tensors do not fit the draft executor.
        """
        from ignis.runtime.checkpoints import restore_model_state

        self.start_lane(lane_id, prompt_token_ids)
        lane = self._lanes[lane_id]
        fed = min(int(snapshot.meta.get("num_fed", 0)), int(snapshot.num_tokens), len(prompt_token_ids))
        if fed:
            try:
                restore_model_state(self.executor, lane.state, snapshot.tensors, fed)
            except Exception:
                self.end_lane(lane_id)
                raise
        lane.is_disabled = bool(snapshot.meta.get("is_disabled", 0)) and fed == int(
            snapshot.meta.get("num_fed", 0)
        )

    def num_fed(self, lane_id: int) -> int:
        """Tokens the lane's draft state holds; between rounds (after `commit`) these are confirmed
        tokens, a prefix of the lane's tokens without the anchor."""
        return int(self._lanes[lane_id].state.num_tokens)

    def lane_tokens(self, lane_id: int) -> tuple[int, ...]:
        """The lane's confirmed tokens as the drafter knows them (prompt + output, the anchor last)."""
        return tuple(self._lanes[lane_id].confirmed)

    def lane_state(self, lane_id: int) -> LaneState:
        """The lane's draft executor state (read-only use: tests, inspection)."""
        return self._lanes[lane_id].state

    def num_columns_run(self, lane_id: int) -> int:
        """Columns the draft model has run for the lane so far (its cost, in rows)."""
        return self._lanes[lane_id].num_fed_columns

    @staticmethod
    def _num_valid(lane: _Lane) -> int:
        """Confirmed tokens the lane's state holds (its committed tokens minus speculative drafts)."""
        return int(lane.state.num_tokens) - len(lane.speculative)

    @staticmethod
    def _keep(drafts: Sequence[int], truth: Sequence[int]) -> int:
        """Length of the longest common prefix of drafts and truth."""
        keep = 0
        for a, b in zip(drafts, truth, strict=False):
            if a != b:
                break
            keep += 1
        return keep

    def _resolve(self, lanes: Sequence[_Lane]) -> None:
        """Keep each lane's drafts for their longest prefix equal to the confirmed tokens, never the
        last confirmed token (the anchor, which the next step 1 feeds): commit that prefix of the
        pending forward (re-run schedule) or rewind the speculative drafts past it (kept drafts)."""
        todo = [lane for lane in lanes if lane.pending is not None]
        if todo:
            keeps = []
            for lane in todo:
                assert lane.pending is not None
                start = lane.state.num_tokens
                keeps.append(self._keep(lane.pending, lane.confirmed[start : len(lane.confirmed) - 1]))
            self.executor.commit([lane.state for lane in todo], keeps)
            for lane in todo:
                lane.pending = None
        spec = [lane for lane in lanes if lane.speculative]
        if spec:
            assert self._rewind is not None
            targets = []
            for lane in spec:
                base = self._num_valid(lane)
                keep = self._keep(lane.speculative, lane.confirmed[base : len(lane.confirmed) - 1])
                targets.append(base + keep)
            back = [(lane, n) for lane, n in zip(spec, targets, strict=True) if n < lane.state.num_tokens]
            if back:
                self._rewind([lane.state for lane, _ in back], [n for _, n in back])
            for lane in spec:
                lane.speculative = []

    # ---- rounds ------------------------------------------------------------------------------

    def commit(self, spans: Sequence[CommittedSpan]) -> None:
        """Record each span's committed tokens and keep the accepted prefix of the pending drafts.

        Raises:
            StateError: an unknown lane, or a span that contradicts the tokens the drafter holds
                (a start past the lane's end, or different tokens at a position already known).
        """
        lanes = []
        for s in spans:
            lane = self._lanes.get(s.lane_id)
            if lane is None:
                raise StateError(f"draft-model: commit for lane {s.lane_id}, which did not start")
            inputs = [int(t) for t in s.input_token_ids]
            if not inputs or len(s.next_token_ids) != len(inputs):
                raise StateError(
                    f"draft-model: lane {s.lane_id}: a span needs m >= 1 inputs and m next tokens"
                )
            known = lane.confirmed
            if (
                s.start > len(known)
                or known[s.start : s.start + len(inputs)] != inputs[: len(known) - s.start]
            ):
                raise StateError(
                    f"draft-model: lane {s.lane_id}: span at {s.start} ({inputs[:4]}...) contradicts the "
                    f"{len(known)} tokens the drafter holds"
                )
            if self._num_valid(lane) > s.start + len(inputs):
                raise StateError(
                    f"draft-model: lane {s.lane_id}: the draft state holds {self._num_valid(lane)} "
                    f"confirmed tokens, past the span's end {s.start + len(inputs)}"
                )
            lane.confirmed = known[: s.start] + inputs + [int(s.next_token_ids[-1])]
            lanes.append(lane)
        self._resolve(lanes)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """float [..., draft vocab] -> float [..., target vocab]: cut, or padded with -inf."""
        v = logits.shape[-1]
        if v == self.vocab_size:
            return logits
        if v > self.vocab_size:
            return logits[..., : self.vocab_size]
        pad = logits.new_full((*logits.shape[:-1], self.vocab_size - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def _draw(self, row: torch.Tensor, req: DraftRequest) -> tuple[int, torch.Tensor | None]:
        """One draft from a draft-logits row (float [vocab]); q (float [target vocab]) when sampling."""
        row = self._fit(row.float())
        if req.params.is_greedy:
            return int(row.argmax().item()), None
        q = logits_to_probs(row, req.params)  # [vocab]
        return sample_token(q.to(req.generator.device), req.generator), q

    def _steps_kept(
        self,
        requests: Sequence[DraftRequest],
        lanes: Sequence[_Lane],
        wanted: Sequence[int],
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]],
    ) -> None:
        """Steps 2..k of the kept-drafts schedule: [d_{j-1}] alone, committed speculatively."""
        for j in range(2, max(wanted, default=0) + 1):
            live = [i for i, k in enumerate(wanted) if k >= j]
            states = [lanes[i].state for i in live]
            cols = [torch.tensor(drafts[i][-1:], dtype=torch.int64) for i in live]
            out = self.executor.forward(states, cols, logits="last", record=False)
            self.executor.commit(states, [1] * len(live))
            for i, lg in zip(live, out.logits, strict=True):
                lanes[i].num_fed_columns += 1
                lanes[i].speculative.append(drafts[i][-1])
                tok, q = self._draw(lg[-1], requests[i])
                drafts[i].append(tok)
                if q is not None:
                    probs[i].append(q)

    def _steps_rerun(
        self,
        requests: Sequence[DraftRequest],
        lanes: Sequence[_Lane],
        wanted: Sequence[int],
        drafts: list[list[int]],
        probs: list[list[torch.Tensor]],
    ) -> None:
        """Steps 2..k of the re-run schedule: [d_1 .. d_{j-1}] on the confirmed prefix; the last step
        stays pending."""
        for j in range(2, max(wanted, default=0) + 1):
            live = [i for i, k in enumerate(wanted) if k >= j]
            states = [lanes[i].state for i in live]
            cols = [torch.tensor(drafts[i], dtype=torch.int64) for i in live]
            out = self.executor.forward(states, cols, logits="last", record=True)
            ends = [i for i in live if wanted[i] == j]
            if len(ends) < len(live):
                self.executor.commit(
                    [lanes[i].state for i in live if wanted[i] > j], [0] * (len(live) - len(ends))
                )
            for i, c, lg in zip(live, cols, out.logits, strict=True):
                lanes[i].num_fed_columns += c.numel()
                if wanted[i] == j:
                    lanes[i].pending = c.tolist()
                tok, q = self._draw(lg[-1], requests[i])
                drafts[i].append(tok)
                if q is not None:
                    probs[i].append(q)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """k drafts per request, k forwards of the draft model (module docstring: which columns).

        Returns:
            per request, int64 [k'] draft ids (k' = num_drafts, or 0 where the lane cannot draft:
            the draft context's end, an id past the draft vocabulary) and, when sampling, q: float32
            [k', target vocab] (None under greedy).

        Raises:
            StateError: a request for a lane that did not start, or whose tokens contradict the
                drafter's (the engine and the drafter disagree about the lane).
        """
        lanes: list[_Lane] = []
        for req in requests:
            lane = self._lanes.get(req.lane_id)
            if lane is None:
                raise StateError(f"draft-model: proposal for lane {req.lane_id}, which did not start")
            tokens = req.token_ids
            fed = self._num_valid(lane)
            if len(tokens) < len(lane.confirmed) or any(
                int(tokens[i]) != lane.confirmed[i] for i in range(max(fed - 1, 0), len(lane.confirmed))
            ):
                raise StateError(
                    f"draft-model: lane {req.lane_id}: the request's {len(tokens)} tokens contradict the "
                    f"{len(lane.confirmed)} the drafter holds"
                )
            lane.confirmed.extend(int(t) for t in tokens[len(lane.confirmed) :])
            lanes.append(lane)
        self._resolve(lanes)  # a proposal without a commit in between (not what the engine does)

        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        wanted = []
        for req, lane in zip(requests, lanes, strict=True):
            k = int(req.num_drafts)
            if self.max_positions is not None and len(lane.confirmed) + k - 1 > self.max_positions:
                k = 0  # the draft model's context would end inside this round: plain decode row
            if not lane.is_disabled and any(
                t >= self.draft_vocab_size for t in lane.confirmed[lane.state.num_tokens :]
            ):
                lane.is_disabled = True  # e.g. a padding id of a wider target vocabulary was sampled
            if lane.is_disabled:
                k = 0
            wanted.append(k)
            lane.num_proposals += 1

        # step 1: the confirmed tokens not yet fed (the anchor last), committed whole
        live = [i for i, k in enumerate(wanted) if k > 0]
        if live:
            states = [lanes[i].state for i in live]
            cols = [
                torch.tensor(lanes[i].confirmed[lanes[i].state.num_tokens :], dtype=torch.int64) for i in live
            ]
            out = self.executor.forward(states, cols, logits="last", record=False)
            self.executor.commit(states, [c.numel() for c in cols])
            for i, c, lg in zip(live, cols, out.logits, strict=True):
                lanes[i].num_fed_columns += c.numel()
                tok, q = self._draw(lg[-1], requests[i])
                drafts[i].append(tok)
                if q is not None:
                    probs[i].append(q)

        if self._rewind is not None:
            self._steps_kept(requests, lanes, wanted, drafts, probs)
        else:
            self._steps_rerun(requests, lanes, wanted, drafts, probs)

        return [
            DraftProposal(torch.tensor(d, dtype=torch.int64), torch.stack(p) if p else None)
            for d, p in zip(drafts, probs, strict=True)
        ]


def build_draft_model_drafter(
    *,
    target_tokenizer: Tokenizer | TokenizerSpec,
    artifact: str | Path | None = None,
    executor: Executor | None = None,
    tokenizer: Tokenizer | TokenizerSpec | None = None,
    target_config: Any = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    verify: str = "fast",
    is_row_budgeted: bool = False,
    keep_drafts: bool | None = None,
) -> DraftModelDrafter:
    """The registered `draft-model` factory (`--spec-backend draft-model --spec-draft-model ARTIFACT`).

    Give either `artifact` (an `ignis-build` output directory of the draft model) or `executor` and
    `tokenizer` (a draft model built in Python, e.g. from `ignis.compiler.importers.load_checkpoint`).

    Args:
        target_tokenizer: the target's tokenizer (spec); the draft's must match it.
        target_config: the target's family config; its `vocab_size` sizes the drafts' q (default:
            the draft model's vocabulary size).
        device, dtype, verify: for `artifact` (see `DraftModelDrafter.from_artifact`).
        keep_drafts: the round schedule (`DraftModelDrafter`; None: kept drafts where the executor
            can rewind).

    Raises:
        ConfigError: neither an artifact nor executor + tokenizer, or both.
        TokenizerMismatchError: the tokenizers differ; plus the artifact loader's errors.
    """
    vocab_size = getattr(target_config, "vocab_size", None)
    if (artifact is None) == (executor is None):
        raise ConfigError(
            "draft-model: give a draft artifact directory, or a draft executor and its tokenizer"
        )
    if artifact is not None:
        return DraftModelDrafter.from_artifact(
            artifact,
            target_tokenizer=target_tokenizer,
            vocab_size=vocab_size,
            device=device,
            dtype=dtype,
            verify=verify,
            is_row_budgeted=is_row_budgeted,
            keep_drafts=keep_drafts,
        )
    if tokenizer is None:
        raise ConfigError(
            "draft-model: a draft executor needs its tokenizer (to check it against the target's)"
        )
    assert executor is not None
    return DraftModelDrafter(
        executor,
        tokenizer=tokenizer,
        target_tokenizer=target_tokenizer,
        vocab_size=vocab_size,
        is_row_budgeted=is_row_budgeted,
        keep_drafts=keep_drafts,
    )


if "draft-model" not in DRAFTERS:
    register_drafter("draft-model", build_draft_model_drafter)
