"""Acceptance: which of a lane's draft tokens the model keeps, and the model's own token after them.

A lane's verify round runs the columns [anchor, d_1, ..., d_k] through the model. Row i of the model's
output (i = 0..k) is the model's prediction for the token after column i, so row i judges draft
d_{i+1} and row k predicts the token after the last draft. Vocabulary (vLLM's, used everywhere):

- `draft_token_ids`  int64 [k]: d_1..d_k, the drafter's proposal for one lane (k may be 0).
- `target_probs`     float [k+1, vocab]: p, the model's distribution at each row after temperature,
                     top-k and top-p (`ignis.runtime.sampling.logits_to_probs`).
- `draft_probs`      float [k, vocab] or None: q, the distribution each draft was sampled from;
                     None means a greedy (deterministic) drafter, whose q is a point mass on its draft.
- `target_token_ids` int64 [k+1]: the model's argmax at each row (greedy acceptance).
- bonus token: the model's own token after the accepted drafts. When every draft is accepted it is
  drawn from p at row k (the *bonus* token proper); after a rejection at row n it is the *recovered*
  token drawn from the residual distribution at row n. Either way it becomes the lane's next anchor.

The committed run is the accepted drafts plus that token: 1..k+1 tokens (`AcceptanceResult`).

Greedy acceptance is exact by construction: every committed token is the model's argmax given the
tokens before it. Rejection sampling (Leviathan, Kalman & Matias 2023, "Fast Inference from
Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling", Algorithm 2) keeps the output distribution exactly p:

    for i = 1..k:  accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
    first rejection at i:  emit x ~ norm(max(0, p_i - q_i)) and stop
    all accepted:          emit x ~ p_{k+1}

so P(emit x at a position) = min(p(x), q(x)) + (1 - sum_y min(p(y), q(y))) * norm(max(0, p - q))(x) = p(x).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "AcceptanceResult",
    "PendingAcceptance",
    "greedy_accept",
    "greedy_accept_ids",
    "rejection_sample",
    "rejection_sample_on_device",
]


@dataclass(frozen=True)
class AcceptanceResult:
    """One lane's outcome of a verify round.

    Attributes:
        output_token_ids: int64 [num_accepted + 1], on the inputs' device: the committed run, i.e. the
            accepted drafts d_1..d_n followed by the bonus (or recovered) token, the lane's next anchor.
        num_accepted: n, how many drafts were accepted (0..k). The executor keeps n + 1 columns
            (the anchor and the n accepted drafts).
    """

    output_token_ids: torch.Tensor
    num_accepted: int

    @property
    def bonus_token_id(self) -> int:
        """The model's own token after the accepted drafts (the last token of the run)."""
        return int(self.output_token_ids[-1].item())


def _check_drafts(draft_token_ids: torch.Tensor, num_rows: int, what: str) -> int:
    if draft_token_ids.dim() != 1:
        raise ValueError(f"draft_token_ids must be 1-D [k], got shape {tuple(draft_token_ids.shape)}")
    k = draft_token_ids.numel()
    if num_rows != k + 1:
        raise ValueError(f"{what} must have k + 1 = {k + 1} rows for {k} drafts, got {num_rows}")
    return k


def greedy_accept(
    draft_token_ids: torch.Tensor,  # int64 [k]: d_1..d_k
    target_token_ids: torch.Tensor,  # int64 [k+1]: the model's argmax at rows 0..k
) -> AcceptanceResult:
    """Greedy acceptance: the longest prefix of drafts equal to the model's argmax, plus the model's token.

    n = the largest n with d_i == target_token_ids[i-1] for all i <= n; the run is
    target_token_ids[:n+1] (equal to d_1..d_n followed by the model's argmax at row n).

    Raises:
        ValueError: shapes disagree (target_token_ids must have k + 1 entries).
    """
    if target_token_ids.dim() != 1:
        raise ValueError(f"target_token_ids must be 1-D [k+1], got shape {tuple(target_token_ids.shape)}")
    k = _check_drafts(draft_token_ids, target_token_ids.shape[0], "target_token_ids")
    matches = draft_token_ids == target_token_ids[:k]  # bool [k]
    n = int(torch.cumprod(matches.to(torch.int64), dim=0).sum().item()) if k else 0
    return AcceptanceResult(
        output_token_ids=target_token_ids[: n + 1].to(torch.int64).clone(), num_accepted=n
    )


def greedy_accept_ids(
    draft_token_ids: Sequence[int], target_token_ids: Sequence[int]
) -> tuple[list[int], int]:
    """`greedy_accept` on host ids: (the committed run, n accepted), the same rule.

    The engine's batched form: every greedy lane's argmax and drafts come to the host in one
    transfer, then each lane's run is found here without touching the device.

    Raises:
        ValueError: len(target_token_ids) != len(draft_token_ids) + 1.
    """
    k = len(draft_token_ids)
    if len(target_token_ids) != k + 1:
        raise ValueError(
            f"target_token_ids must have k + 1 = {k + 1} entries for {k} drafts, got {len(target_token_ids)}"
        )
    n = 0
    while n < k and draft_token_ids[n] == target_token_ids[n]:
        n += 1
    return list(target_token_ids[: n + 1]), n


@dataclass(frozen=True)
class PendingAcceptance:
    """`rejection_sample_on_device`'s outcome, still on the device (nothing read back yet).

    Attributes:
        padded_run: int64 [k+1]: the accepted drafts d_1..d_n, the bonus (or recovered) token at index
            n, then the remaining drafts (ignored).
        num_accepted: int64 0-dim tensor, n.
    """

    padded_run: torch.Tensor
    num_accepted: torch.Tensor

    def resolve(self, host: Sequence[int] | None = None) -> tuple[list[int], int]:
        """(the committed run, n) on the host. `host`: `[n, *padded_run]` already read back (the
        engine reads every lane's in one copy); None reads them here (one sync)."""
        if host is None:
            host = torch.cat([self.num_accepted.view(1), self.padded_run]).tolist()
        n = int(host[0])
        return [int(t) for t in host[1 : n + 2]], n

    def host_tensor(self) -> torch.Tensor:
        """int64 [k+2]: n then the padded run (what `resolve` reads)."""
        return torch.cat([self.num_accepted.view(1), self.padded_run])


def rejection_sample_on_device(
    draft_token_ids: torch.Tensor,  # int64 [k]: d_1..d_k
    target_probs: torch.Tensor,  # float [k+1, vocab]: p at rows 0..k
    draft_probs: torch.Tensor | None,  # float [k, vocab]: q for each draft, or None for a point mass at d_i
    generator: torch.Generator,
) -> PendingAcceptance:
    """`rejection_sample` without a host sync: the same draws from `generator` in the same order (k
    uniforms, then one `torch.multinomial` over the same distribution), so the same outcome for the
    same stream; n and the run stay on the device (`PendingAcceptance`).

    Raises:
        ValueError: shapes disagree.
    """
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [k+1, vocab], got shape {tuple(target_probs.shape)}")
    k = _check_drafts(draft_token_ids, target_probs.shape[0], "target_probs")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs must be [k, vocab] = {(k, target_probs.shape[1])}, got {tuple(draft_probs.shape)}"
        )
    device = target_probs.device
    p = target_probs.double()
    if k == 0:
        last = torch.multinomial(p[0], 1, generator=generator)  # [1]
        return PendingAcceptance(last, torch.zeros((), dtype=torch.int64, device=device))
    rows = torch.arange(k, device=device)
    drafts = draft_token_ids.to(device=device, dtype=torch.int64)
    p_d = p[rows, drafts]  # [k]
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.double()[rows, drafts]  # [k]
    u = torch.rand(k, generator=generator, device=device, dtype=torch.float64)  # [k]
    accepted = u * q_d < p_d  # [k]
    n = torch.cumprod(accepted.to(torch.int64), dim=0).sum()  # 0-dim, 0..k
    r = n.clamp(max=k - 1).view(1)  # the rejected row when n < k
    p_r = p.index_select(0, r)[0]  # [vocab]
    if draft_probs is None:
        residual = p_r.clone()
        d_r = drafts.index_select(0, r)
        residual.scatter_(0, d_r, (residual.gather(0, d_r) - 1.0).clamp_min(0.0))
    else:
        residual = (p_r - draft_probs.double().index_select(0, r)[0]).clamp_min(0.0)  # [vocab]
    # After a rejection: the residual (p itself if rounding left it no mass); all accepted: p_k.
    rejected = torch.where(residual.sum() > 0.0, residual, p_r)
    dist = torch.where(n < k, rejected, p[k])
    last = torch.multinomial(dist, 1, generator=generator)  # [1]
    run = torch.cat([drafts, last])  # [k+1]
    run = run.scatter(0, n.view(1), last)  # the token at index n; drafts after it are ignored
    return PendingAcceptance(run, n)


def rejection_sample(
    draft_token_ids: torch.Tensor,  # int64 [k]: d_1..d_k
    target_probs: torch.Tensor,  # float [k+1, vocab]: p at rows 0..k
    draft_probs: torch.Tensor | None,  # float [k, vocab]: q for each draft, or None for a point mass at d_i
    generator: torch.Generator,
) -> AcceptanceResult:
    """Speculative rejection sampling (Leviathan et al. 2023 Alg. 1; Chen et al. 2023 Alg. 2).

    Draws k uniforms u_i in [0, 1) from `generator` (always k, whatever the outcome, so the stream's
    consumption depends only on k), accepts d_i while u_i * q_i(d_i) < p_i(d_i) (i.e. u_i < p/q, with
    probability min(1, p/q); a draft with q = 0 is accepted iff p > 0), then draws one token with
    `torch.multinomial`: from norm(max(0, p_n - q_n)) after a rejection at row n (q_n a one-hot of d_n
    when `draft_probs` is None), or from p_k when all drafts were accepted. If the residual has no mass
    (possible only through rounding, since a rejection implies p_n(d_n) < q_n(d_n)), p_n is used.
    Arithmetic is float64. With k = 0 this is plain sampling from p_0.

    Raises:
        ValueError: shapes disagree.
    """
    pending = rejection_sample_on_device(draft_token_ids, target_probs, draft_probs, generator)
    n = int(pending.num_accepted.item())
    return AcceptanceResult(output_token_ids=pending.padded_run[: n + 1].clone(), num_accepted=n)
