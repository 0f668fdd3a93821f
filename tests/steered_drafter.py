"""`SteeredDrafter`: a real drafter whose proposals are partly replaced by a reference output, so a
spec-on / spec-off exactness test sees accepted and rejected drafts in every round (shared by
tests/runtime/test_spec_exactness_families.py and tests/runtime/test_grammar.py)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ignis.runtime.drafters.base import BaseDrafter, DraftProposal, DraftRequest


class SteeredDrafter(BaseDrafter):
    """Wraps a real drafter: it proposes every round as usual, then the first n of its drafts are
    replaced by the reference output (n uniform in 0..k per proposal, seeded); the rest stay its own."""

    def __init__(self, inner, refs: dict[tuple[int, ...], tuple[int, ...]], seed: int = 0) -> None:
        self.inner = inner
        self.name = f"steered-{inner.name}"
        self.is_row_budgeted = inner.is_row_budgeted
        self.needs_hidden_states = inner.needs_hidden_states
        self.tap_layers = inner.tap_layers
        self.refs = refs
        self.rng = random.Random(seed)
        self.prompts: dict[int, tuple[int, ...]] = {}

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        self.prompts[lane_id] = tuple(prompt_token_ids)
        self.inner.start_lane(lane_id, prompt_token_ids)

    def end_lane(self, lane_id: int) -> None:
        self.inner.end_lane(lane_id)

    def commit(self, spans) -> None:
        self.inner.commit(spans)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        out = []
        for req, prop in zip(requests, self.inner.propose(requests), strict=True):
            ref = self.refs[self.prompts[req.lane_id]]
            done = len(req.token_ids) - req.num_prompt_tokens
            drafts = prop.draft_token_ids.tolist()
            n = self.rng.randint(0, len(drafts))
            for j in range(n):
                if done + j < len(ref):
                    drafts[j] = ref[done + j]
            out.append(DraftProposal(torch.tensor(drafts, dtype=torch.int64)))
        return out
