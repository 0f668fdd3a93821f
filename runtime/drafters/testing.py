"""Test drafters: known acceptance behaviour without real drafter weights.

- `ReferenceDrafter` replays a known output (the speculation-off output of each prompt): always right
  (`always_right`), always wrong (`always_wrong`: every draft differs from the reference token at its
  position), right with probability p (`right_with_probability`, seeded), or right for a scripted
  number of drafts per round (`num_correct`, for exact metric tests). Deterministic: q is a point mass.
- `BigramDrafter`: stochastic and model-independent. Draft j is sampled from a fixed random bigram
  distribution q(. | previous token) = softmax(W[previous] / temperature), and q is returned, so the
  rejection-sampling path sees a non-trivial q.
- `ModelDrafter`: drafts with any `Executor` (e.g. a copy of the target itself), keeping its own lane
  states that advance by committed spans only. mode "sample" draws from the model's distribution
  (the lane's sampling params, or `temperature` instead of the lane's), returning q; with the target's
  own weights and params q = p, so every draft is accepted. mode "greedy" drafts the argmax (point
  mass q); mode "worst" drafts the argmin (outside any top-k/top-p support, so always rejected).

Helpers the drafter tests share: `random_tokens` (seeded token ids), `draft_request` (one lane's
`DraftRequest` with its own seeded generator), `greedy_then_wrong` (drafts of which exactly n are
accepted), `chi2_pvalue` (goodness of fit of sampled drafts to q).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence

import torch

from ignis.runtime.drafters.base import BaseDrafter, CommittedSpan, DraftProposal, DraftRequest
from ignis.runtime.errors import StateError
from ignis.runtime.families.base import Executor, LaneState
from ignis.runtime.sampling import SamplingParams, logits_to_probs

__all__ = [
    "BigramDrafter",
    "ModelDrafter",
    "ReferenceDrafter",
    "always_right",
    "always_wrong",
    "chi2_pvalue",
    "draft_request",
    "greedy_then_wrong",
    "random_tokens",
    "right_with_probability",
]


class ReferenceDrafter(BaseDrafter):
    """Drafts from a reference output per prompt; each draft is right or deliberately wrong.

    Draft j of a lane whose output has L tokens so far targets reference[L + j]. A right draft equals
    it; a wrong one is a different token, drawn uniformly from the other vocab_size - 1 ids. Drafts
    stop where the reference ends (fewer than asked, possibly none).

    Args:
        references: prompt token ids (as a tuple) -> the reference output token ids for that prompt.
        vocab_size: the model's vocabulary size (wrong tokens are drawn in [0, vocab_size)).
        p_correct: probability that each draft is right (independently), when `num_correct` is None.
        num_correct: a script: in a lane's r-th proposal (r = 0, 1, ...) the first num_correct[r]
            drafts are right and the rest wrong (cycling when r passes the end); overrides p_correct.
        seed: seeds the drafter's own `random.Random` (wrong tokens, right-or-wrong coin flips).
        is_row_budgeted: act as a row-budgeted (MTP-like) drafter.
        name: the backend name reported.

    Raises:
        ValueError: p_correct outside [0, 1], vocab_size < 2, or a lane whose prompt has no reference.
    """

    def __init__(
        self,
        references: Mapping[tuple[int, ...], Sequence[int]],
        *,
        vocab_size: int,
        p_correct: float = 1.0,
        num_correct: Sequence[int] | None = None,
        seed: int = 0,
        is_row_budgeted: bool = False,
        name: str = "reference",
    ) -> None:
        if not 0.0 <= p_correct <= 1.0:
            raise ValueError(f"p_correct must be in [0, 1], got {p_correct}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2 for wrong drafts, got {vocab_size}")
        self.references = {tuple(k): list(v) for k, v in references.items()}
        self.vocab_size = vocab_size
        self.p_correct = p_correct
        self.num_correct = None if num_correct is None else list(num_correct)
        self.rng = random.Random(seed)
        self.is_row_budgeted = is_row_budgeted
        self.name = name
        self._lanes: dict[int, tuple[tuple[int, ...], int]] = {}  # lane -> (prompt, proposals so far)

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        prompt = tuple(prompt_token_ids)
        if prompt not in self.references:
            raise ValueError(f"lane {lane_id}: no reference output for prompt {list(prompt)[:8]}...")
        self._lanes[lane_id] = (prompt, 0)

    def end_lane(self, lane_id: int) -> None:
        self._lanes.pop(lane_id, None)

    def _wrong(self, token: int) -> int:
        return (token + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        out = []
        for req in requests:
            prompt, r = self._lanes[req.lane_id]
            self._lanes[req.lane_id] = (prompt, r + 1)
            ref = self.references[prompt]
            done = len(req.token_ids) - req.num_prompt_tokens
            right = None if self.num_correct is None else self.num_correct[r % len(self.num_correct)]
            drafts = []
            for j in range(min(req.num_drafts, len(ref) - done)):
                truth = ref[done + j]
                ok = (j < right) if right is not None else self.rng.random() < self.p_correct
                drafts.append(truth if ok else self._wrong(truth))
            out.append(DraftProposal(torch.tensor(drafts, dtype=torch.int64)))
        return out


def always_right(
    references: Mapping[tuple[int, ...], Sequence[int]], *, vocab_size: int, is_row_budgeted: bool = False
) -> ReferenceDrafter:
    """Every draft equals the reference (greedy speculation then accepts all of them)."""
    return ReferenceDrafter(
        references, vocab_size=vocab_size, p_correct=1.0, is_row_budgeted=is_row_budgeted, name="always-right"
    )


def always_wrong(
    references: Mapping[tuple[int, ...], Sequence[int]],
    *,
    vocab_size: int,
    seed: int = 0,
    is_row_budgeted: bool = False,
) -> ReferenceDrafter:
    """Every draft differs from the reference (greedy speculation then accepts none)."""
    return ReferenceDrafter(
        references,
        vocab_size=vocab_size,
        p_correct=0.0,
        seed=seed,
        is_row_budgeted=is_row_budgeted,
        name="always-wrong",
    )


def right_with_probability(
    references: Mapping[tuple[int, ...], Sequence[int]],
    p: float,
    *,
    vocab_size: int,
    seed: int = 0,
    is_row_budgeted: bool = False,
) -> ReferenceDrafter:
    """Each draft equals the reference with probability p, independently (seeded)."""
    return ReferenceDrafter(
        references,
        vocab_size=vocab_size,
        p_correct=p,
        seed=seed,
        is_row_budgeted=is_row_budgeted,
        name=f"right-p{p:g}",
    )


class BigramDrafter(BaseDrafter):
    """Samples drafts from a fixed random bigram table and returns q (module docstring).

    Args:
        vocab_size: the model's vocabulary size.
        seed: seeds the table W (float64 [vocab, vocab], standard normal * `scale`).
        temperature: q(. | prev) = softmax(W[prev] / temperature), > 0.
        scale: spread of W's entries.
        is_row_budgeted: act as a row-budgeted (MTP-like) drafter.
    """

    name = "bigram"

    def __init__(
        self,
        vocab_size: int,
        *,
        seed: int = 0,
        temperature: float = 1.0,
        scale: float = 2.0,
        is_row_budgeted: bool = False,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(vocab_size, vocab_size, generator=g, dtype=torch.float64) * scale
        self.q_table = torch.softmax(
            table / temperature, dim=-1
        ).float()  # [vocab, vocab]: row = previous token
        self.is_row_budgeted = is_row_budgeted

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        out = []
        for req in requests:
            prev, drafts, probs = req.anchor_token_id, [], []
            for _ in range(req.num_drafts):
                q = self.q_table[prev].to(req.generator.device)  # [vocab]
                prev = int(torch.multinomial(q, 1, generator=req.generator).item())
                drafts.append(prev)
                probs.append(q)
            out.append(DraftProposal(torch.tensor(drafts, dtype=torch.int64), torch.stack(probs)))
        return out


class ModelDrafter(BaseDrafter):
    """Drafts with an `Executor` of its own, whose lanes advance by committed spans only.

    Proposing for a lane runs [anchor], then [anchor, d_1], ... from the lane's committed state
    (each forward is discarded with `commit(num_keep=0)`), so nothing the drafter computes for its own
    proposals survives; `commit` feeds each span's input tokens for real.

    Args:
        executor: any Executor (its vocabulary must match the target's).
        mode: "sample" (draws from q, returns q), "greedy" (argmax, q = point mass) or "worst"
            (argmin, q = point mass).
        temperature: for mode "sample", sample at this temperature with no top-k/top-p instead of the
            lane's own params (None: the lane's params, so q equals the target's p for the same model).
        is_row_budgeted: act as a row-budgeted (MTP-like) drafter.
    """

    def __init__(
        self,
        executor: Executor,
        *,
        mode: str = "sample",
        temperature: float | None = None,
        is_row_budgeted: bool = False,
    ) -> None:
        if mode not in ("sample", "greedy", "worst"):
            raise ValueError(f"mode must be 'sample', 'greedy' or 'worst', got {mode!r}")
        self.executor = executor
        self.mode = mode
        self.temperature = temperature
        self.is_row_budgeted = is_row_budgeted
        self.name = f"model-{mode}"
        self._states: dict[int, LaneState] = {}

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        self._states[lane_id] = self.executor.new_lane()

    def end_lane(self, lane_id: int) -> None:
        self._states.pop(lane_id, None)

    def commit(self, spans: Sequence[CommittedSpan]) -> None:
        states = [self._states[s.lane_id] for s in spans]
        for st, s in zip(states, spans, strict=True):
            if st.num_tokens != s.start:
                raise StateError(
                    f"lane {s.lane_id}: span starts at {s.start}, drafter state holds {st.num_tokens}"
                )
        cols = [torch.tensor(s.input_token_ids, dtype=torch.int64) for s in spans]
        self.executor.forward(states, cols, logits="last", record=False)
        self.executor.commit(states, [len(s.input_token_ids) for s in spans])

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for j in range(max(r.num_drafts for r in requests)):
            live = [i for i, r in enumerate(requests) if r.num_drafts > j]
            states = [self._states[requests[i].lane_id] for i in live]
            cols = [torch.tensor([requests[i].anchor_token_id, *drafts[i]], dtype=torch.int64) for i in live]
            out = self.executor.forward(states, cols, logits="last", record=True)
            self.executor.commit(states, [0] * len(live))
            for i, lg in zip(live, out.logits, strict=True):
                row = lg[-1]  # [vocab]
                if self.mode == "greedy":
                    drafts[i].append(int(row.argmax().item()))
                elif self.mode == "worst":
                    drafts[i].append(int(row.argmin().item()))
                else:
                    params = requests[i].params
                    if self.temperature is not None:
                        params = dataclasses.replace(params, temperature=self.temperature, top_k=0, top_p=1.0)
                    q = logits_to_probs(row, params)
                    gen = requests[i].generator
                    drafts[i].append(int(torch.multinomial(q.to(gen.device), 1, generator=gen).item()))
                    probs[i].append(q)
        return [
            DraftProposal(torch.tensor(d, dtype=torch.int64), torch.stack(p) if p else None)
            for d, p in zip(drafts, probs, strict=True)
        ]


# ---------------------------------------------------------------- helpers of the drafter tests


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    """n token ids uniform in [0, vocab), the same for the same (n, seed, vocab)."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def draft_request(
    lane: int, tokens: Sequence[int], k: int, params: SamplingParams | None = None, seed: int = 0
) -> DraftRequest:
    """A request for k drafts after `tokens` (all but the last are the prompt; the last is the anchor),
    greedy unless `params` says otherwise, with a generator seeded by `seed`."""
    return DraftRequest(
        lane_id=lane,
        num_drafts=k,
        token_ids=tuple(tokens),
        num_prompt_tokens=len(tokens) - 1,
        params=params if params is not None else SamplingParams(temperature=0),
        generator=torch.Generator().manual_seed(seed),
    )


def greedy_then_wrong(executor: Executor, seq: Sequence[int], n: int, k: int, vocab: int) -> list[int]:
    """k drafts after seq (whose last token is the anchor): the executor's own greedy next n tokens,
    then a wrong one (so greedy verification accepts exactly n), then `random_tokens(k, seed=n)`.

    Runs on a fresh probe lane of `executor` (prefill of seq, then n single-token steps).
    """
    probe = executor.new_lane()
    o = executor.forward([probe], [torch.tensor(list(seq))], logits="last", record=False)
    executor.commit([probe], [len(seq)])
    nxt, truth = int(o.logits[0][-1].argmax()), []
    for _ in range(n):
        truth.append(nxt)
        o = executor.forward([probe], [torch.tensor([nxt])], logits="last")
        executor.commit([probe], [1])
        nxt = int(o.logits[0][-1].argmax())
    return [*truth, (nxt + 1) % vocab, *random_tokens(k, n, vocab)][:k]


def chi2_pvalue(counts: torch.Tensor, q: torch.Tensor) -> float:
    """Chi-square goodness of fit of counts [V] (draws per token) to probabilities q [V] (any scale).

    Bins expecting fewer than 5 draws are lumped into one, which joins the largest bin when it still
    expects fewer than 5. Needs scipy (a test dependency).
    """
    from scipy import stats

    expected = q / q.sum() * counts.sum()
    big = expected >= 5
    obs = [*counts[big].tolist(), float(counts[~big].sum())]
    exp = [*expected[big].tolist(), float(expected[~big].sum())]
    if exp[-1] < 5:  # too few to stand alone: fold into the largest bin
        obs[0] += obs.pop()
        exp[0] += exp.pop()
    return float(stats.chisquare(obs, exp).pvalue)
