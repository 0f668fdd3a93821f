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

__all__ = ["LanePenalties", "TokenLogprob", "process_rows", "token_logprobs"]


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

    The stateless form of `LanePenalties` (which an engine keeps per lane).

    Args:
        logits: row j predicts the output token at index len(output) + j.
        prompt: the lane's prompt ids (repetition penalty).
        output: the output so far, the anchor included (the tokens emitted before row 0's).
        drafts: d_1..d_k (at least n - 1 of them are read).
        eos_token_ids: the model's EOS ids (masked by min_tokens unless `params.ignore_eos`).

    Raises:
        ValueError: logits is not 2-D, or fewer than n - 1 drafts.
    """
    state = LanePenalties(params, prompt, eos_token_ids)
    state.extend(output)
    return state.process(logits, drafts)


class LanePenalties:
    """One lane's running state for the penalties and min_tokens (module docstring): the output's
    token counts and the prompt's token set as [vocab] tensors on the logits' device, built at the
    first `process` and then extended by the tokens emitted since, instead of rebuilt from the whole
    output (and prompt) every round.

    Args:
        params: the lane's sampling parameters.
        prompt: its prompt ids.
        eos_token_ids: the model's EOS ids (masked by min_tokens unless `params.ignore_eos`).
    """

    def __init__(
        self, params: SamplingParams, prompt: Sequence[int], eos_token_ids: Collection[int] = ()
    ) -> None:
        self.params = params
        self.num_output = 0  # output tokens so far (the anchor included)
        self._prompt = tuple(prompt)
        self._eos = tuple(eos_token_ids)
        self._pending: list[int] = []  # emitted, not yet counted
        self._counts: torch.Tensor | None = None  # float32 [vocab]
        self._in_prompt: torch.Tensor | None = None  # bool [vocab], with a repetition penalty

    def extend(self, token_ids: Sequence[int]) -> None:
        """The lane emitted these tokens (counted at the next `process`)."""
        self._pending.extend(int(t) for t in token_ids)
        self.num_output += len(token_ids)

    def process(self, logits: torch.Tensor, drafts: Sequence[int] = ()) -> torch.Tensor:
        """`process_rows` for the lane's output so far: row j after the output and drafts[:j].

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
        p = self.params
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            counts = self._output_counts(vocab, x.device).to(x.dtype)
            counts = counts.expand(n, vocab).clone()  # [n, vocab]: row j adds d_1..d_j
            for j in range(1, n):
                counts[j:, int(drafts[j - 1])] += 1
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                if self._in_prompt is None:
                    self._in_prompt = torch.zeros(vocab, dtype=torch.bool, device=x.device)
                    ids = [t for t in self._prompt if 0 <= t < vocab]
                    if ids:
                        self._in_prompt[torch.tensor(ids, dtype=torch.int64, device=x.device)] = True
                seen |= self._in_prompt
                penalised = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
                x = torch.where(seen, penalised, x)
            if p.frequency_penalty != 0.0:
                x = x - p.frequency_penalty * counts
            if p.presence_penalty != 0.0:
                x = x - p.presence_penalty * (counts > 0).to(x.dtype)
        if p.min_tokens > 0:
            stop_ids = sorted({*p.stop_token_ids, *(() if p.ignore_eos else self._eos)})
            stop_ids = [t for t in stop_ids if 0 <= t < vocab]
            num_masked = min(n, max(0, p.min_tokens - self.num_output))
            if stop_ids and num_masked:
                before = x[:num_masked].clone()
                x[:num_masked, stop_ids] = -torch.inf
                # a row left with no finite logit (stop ids covering the vocabulary) keeps its logits:
                # min_tokens cannot be honoured there, and sampling needs some token
                empty = ~torch.isfinite(x[:num_masked]).any(dim=-1)
                if bool(empty.any()):
                    x[:num_masked][empty] = before[empty]
        return x

    def _output_counts(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        if self._pending:
            ids = torch.tensor([t for t in self._pending if 0 <= t < vocab], dtype=torch.int64, device=device)
            self._counts.index_add_(0, ids, torch.ones(ids.numel(), dtype=torch.float32, device=device))
            self._pending.clear()
        return self._counts


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
