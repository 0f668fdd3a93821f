"""Exact sampling distributions of a small model, for the chi-square tests of speculative sampling.

Used by the engine, n-gram and draft-model tests: speculation with any drafter must sample the
model's own distribution (Leviathan et al. 2023, Chen et al. 2023), checked against the distribution
enumerated here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from scipy import stats

from ignis.runtime.sampling import SamplingParams, logits_to_probs


def exact_joint(
    executor: Any, prompt: Sequence[int], params: SamplingParams, vocab: int
) -> tuple[dict[tuple[int, int, int], float], torch.Tensor]:
    """P(t1, t2, t3) after `prompt` and the marginal P(t4), enumerated over every sequence of
    non-zero probability under `params` (float64). `executor` has ``next_logits(tokens) -> [vocab]``
    (the toy executor's); returns (joint {(t1, t2, t3): p}, t4 float64 [vocab])."""

    def p(prefix: tuple[int, ...]) -> torch.Tensor:
        return logits_to_probs(executor.next_logits([*prompt, *prefix]).double(), params).double()

    joint: dict[tuple[int, int, int], float] = {}
    t4 = torch.zeros(vocab, dtype=torch.float64)
    p1 = p(())
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = p((a,))
        for b in torch.nonzero(p2).flatten().tolist():
            p3 = p((a, b))
            for c in torch.nonzero(p3).flatten().tolist():
                joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
                t4 += joint[(a, b, c)] * p((a, b, c))
    return joint, t4


def pooled_chi2(observed: Sequence[float], expected: Sequence[float]) -> float:
    """Chi-square p-value of observed counts against expected counts; cells expecting < 5 are pooled
    into one, and the expected counts are rescaled to the observed total."""
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for o, e in zip(observed, expected, strict=True):
        if e >= 5:
            obs.append(o)
            exp.append(e)
        else:
            pool_o, pool_e = pool_o + o, pool_e + e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    scale = sum(obs) / sum(exp)
    return float(stats.chisquare(obs, [e * scale for e in exp]).pvalue)
