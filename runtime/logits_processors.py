"""Penalties, min_tokens and logprobs over the rows of a verify round, exact under speculation.

Semantics are vLLM's (`vllm/model_executor/layers/utils.py: apply_penalties`, `MinTokensLogitsProcessor`)
and OpenAI's (presence and frequency penalties), applied to the raw logits before temperature,
top-k and top-p (`ignis.runtime.sampling.logits_to_probs`):

1. **Repetition penalty** (Keskar et al. 2019, CTRL; HF `RepetitionPenaltyLogitsProcessor`): a token
   that occurs in the prompt or the output so far has its logit divided by `repetition_penalty` when
   positive, multiplied by it otherwise.
2. **Frequency and presence penalties** (OpenAI): logit -= frequency_penalty x count + presence_penalty
   x (count > 0), count = the token's occurrences in the output so far (the prompt not counted).
3. **min_tokens**: while fewer than `min_tokens` tokens have been output, the EOS ids (unless
   `ignore_eos`) and `stop_token_ids` get logit -inf (unless they are every token of the vocabulary:
   then the row is left as it is).

**Exactness under speculation.** A lane's verify round has rows 0..k over columns [anchor, d_1..d_k]:
row j predicts the output token at index len(output) + j, after the drafts d_1..d_j. Were row j
reached, d_1..d_j would have been committed, so row j is penalised with counts over output + d_1..d_j
and masked by min_tokens at index len(output) + j: exactly the logits decoding without speculation
sees at that position. Acceptance then judges each draft against the same p, so greedy output equals
speculation off and sampling keeps its distribution.

**Logprobs** are vLLM's default ("raw_logprobs"): log_softmax of the model's own logits at the token's
position, before penalties, masks, temperature, top-k and top-p; a committed token's logprob is thus
the same with speculation on or off.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from ignis.runtime.sampling import SamplingParams

__all__ = ["TokenLogprob", "process_rows", "token_logprobs"]


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's logprob and the most likely tokens at its position.

    Attributes:
        token_id: the output token.
        logprob: its log-probability under the model (natural log, float).
        top: (token id, logprob) of the `SamplingParams.logprobs` most likely tokens, most likely first
            (`torch.topk`); empty when 0 were asked.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def process_rows(
    logits: torch.Tensor,  # float [n, vocab]: a lane's verify rows (or [1, vocab] for a first token)
    params: SamplingParams,
    *,
    prompt: Sequence[int],
    output: Sequence[int],
    drafts: Sequence[int] = (),
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:  # float32 [n, vocab] (float64 stays float64): the penalised, masked logits
    """The logits each row's sampling sees (module docstring): row j after output + drafts[:j].

    Args:
        logits: row j predicts the output token at index len(output) + j.
        prompt: the lane's prompt ids (repetition penalty).
        output: the output so far, the anchor included (the tokens emitted before row 0's).
        drafts: d_1..d_k (at least n - 1 of them are read).
        eos_token_ids: the model's EOS ids (masked by min_tokens unless `params.ignore_eos`).

    Raises:
        ValueError: logits is not 2-D, or fewer than n - 1 drafts.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    if len(drafts) < n - 1:
        raise ValueError(f"{n} rows need {n - 1} drafts, got {len(drafts)}")
    x = logits.double() if logits.dtype == torch.float64 else logits.float()
    x = x.clone()
    dev = x.device
    p = params
    if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
        out_ids = torch.tensor(list(output), dtype=torch.int64, device=dev)
        counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(x.dtype)  # [vocab]
        counts = counts.expand(n, vocab).clone()  # [n, vocab]: row j adds d_1..d_j
        for j in range(1, n):
            counts[j:, int(drafts[j - 1])] += 1
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if prompt:
                in_prompt = torch.zeros(vocab, dtype=torch.bool, device=dev)
                in_prompt[torch.tensor(list(prompt), dtype=torch.int64, device=dev)] = True
                seen |= in_prompt
            penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            x = torch.where(seen, penalised, x)
        if p.frequency_penalty != 0.0:
            x = x - p.frequency_penalty * counts
        if p.presence_penalty != 0.0:
            x = x - p.presence_penalty * (counts > 0).to(x.dtype)
    if p.min_tokens > 0:
        stop_ids = sorted({*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)})
        stop_ids = [t for t in stop_ids if 0 <= t < vocab]
        num_masked = min(n, max(0, p.min_tokens - len(output)))
        if stop_ids and num_masked:
            before = x[:num_masked].clone()
            x[:num_masked, stop_ids] = -torch.inf
            # a row left with no finite logit (stop ids covering the vocabulary) keeps its logits:
            # min_tokens cannot be honoured there, and sampling needs some token
            empty = ~torch.isfinite(x[:num_masked]).any(dim=-1)
            if bool(empty.any()):
                x[:num_masked][empty] = before[empty]
    return x


def token_logprobs(
    logits: torch.Tensor,  # float [n, vocab]: the model's raw logits at the tokens' positions
    token_ids: Sequence[int],  # [m <= n]: the output token at each row
    num_top: int,
) -> list[TokenLogprob]:
    """Each token's logprob (log_softmax in float32, or float64 for float64 logits) and the num_top
    most likely tokens at its row; rows past len(token_ids) are not read."""
    m = len(token_ids)
    if m == 0:
        return []
    x = logits[:m]
    x = x.double() if x.dtype == torch.float64 else x.float()
    lp = torch.log_softmax(x, dim=-1)  # [m, vocab]
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * m
    if num_top > 0:
        vals, order = torch.topk(lp, min(num_top, lp.shape[-1]), dim=-1)
        top_vals, top_ids = vals.tolist(), order.tolist()
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(top_ids, top_vals, strict=True)]
    return [TokenLogprob(int(t), float(c), top) for t, c, top in zip(token_ids, chosen, tops, strict=True)]
