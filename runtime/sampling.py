"""Sampling parameters, the model's distribution p after temperature / top-k / top-p, per-lane random streams.

Semantics (the same as vLLM's sampler and HF transformers' `TemperatureLogitsWarper` ->
`TopKLogitsWarper` -> `TopPLogitsWarper` chain, applied in that order to one row of logits):

1. **Temperature.** `temperature == 0` means greedy: p is a point mass on the argmax (ties go to the
   lowest token id, `torch.argmax`'s rule), and top-k / top-p are irrelevant. Otherwise the logits are
   divided by `temperature`.
2. **Top-k.** `top_k > 0` keeps every token whose (tempered) logit is >= the k-th largest logit, so
   tokens tied with the k-th are all kept (HF and vLLM both threshold on the k-th value). `top_k` of 0
   (or vLLM's -1) disables it, as does `top_k >= vocab_size`.
3. **Top-p (nucleus, Holtzman et al. 2020).** On the renormalized distribution left by top-k, sort the
   tokens by probability, descending (a stable sort, so ties keep id order), and keep token i when the
   probability mass strictly before it is < `top_p`: the smallest prefix whose mass reaches `top_p`,
   never fewer than one token. This is HF's rule (drop a token when the ascending cumulative sum up to
   it is <= 1 - top_p) restated. `top_p == 1` disables it.
4. p = softmax over the kept tokens; every other token has probability exactly 0.

The verify round (DESIGN.md, step 4) applies this to the model's logits to get `target_probs`, and a
stochastic drafter applies it (or its own variant) to get `draft_probs`; the acceptance rule then keeps
the output distribution equal to this p (see `ignis.runtime.acceptance`).

Random streams: each lane owns one `torch.Generator` (`LaneRandom`). A request's `seed` seeds it, so a
seeded request is reproducible for the same engine configuration (backend, draft tokens, row budget:
the number of uniforms drawn per round depends on the drafts); unseeded requests get a fresh seed from
the OS (`secrets`), so they differ from each other.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ignis.runtime.errors import IgnisRuntimeError

if TYPE_CHECKING:
    from ignis.runtime.grammar import Grammar

__all__ = [
    "MAX_LOGPROBS",
    "LaneRandom",
    "SamplingParams",
    "SamplingParamsError",
    "logits_to_probs",
    "sample_token",
]

_MAX_SEED = (
    2**64 - 1
)  # torch.Generator.manual_seed accepts [-2**63, 2**64 - 1]; we take the non-negative half


class SamplingParamsError(IgnisRuntimeError, ValueError):
    """A request's sampling parameter is mistyped or out of range (the message names it and the range)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling and stopping parameters (vLLM's names and meanings), validated on construction.

    Raises:
        SamplingParamsError: a field has the wrong type or is out of range (see each field).
    """

    temperature: float = 1.0  # >= 0, finite; 0 = greedy (argmax), which ignores top_k / top_p
    top_k: int = 0  # keep the k most likely tokens (ties with the k-th kept); 0 or -1 = off
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 = off
    seed: int | None = None  # seeds the lane's random stream (0 <= seed < 2**64); None = fresh from the OS
    max_tokens: int | None = None  # most output tokens (>= 1), stop token included; None = until context end
    stop: tuple[str, ...] = ()  # stop strings (non-empty); output text ends before the first occurrence
    stop_token_ids: tuple[int, ...] = ()  # token ids that end the output (the stop token is the last token)
    ignore_eos: bool = False  # don't stop on the model's EOS token ids (stop_token_ids still stop)
    grammar: Grammar | None = None  # constrain the output to a grammar (`ignis.runtime.grammar`)
    # Penalties and min_tokens (vLLM's meanings; `ignis.runtime.logits_processors` applies them):
    presence_penalty: float = 0.0  # in [-2, 2]: minus this from the logit of every token already output
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this x the token's count in the output
    repetition_penalty: float = 1.0  # [0.01, 100]: a prompt or output token's logit /= (if > 0) or *=
    min_tokens: int = 0  # EOS and stop_token_ids are masked, stop strings unchecked, before this many
    logprobs: int | None = None  # report each output token's logprob and this many top ones; None = off

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise SamplingParamsError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError(f"top_k must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, int | float) or isinstance(p, bool) or not (0.0 < p <= 1.0):
            raise SamplingParamsError(f"top_p must be a number in (0, 1] (1 = off), got {p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise SamplingParamsError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise SamplingParamsError(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or any(not isinstance(s, str) or not s for s in stop):
            raise SamplingParamsError(
                f"stop must be a string or a sequence of non-empty strings, got {self.stop!r}"
            )
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, Sequence) or any(not _is_int(i) or i < 0 for i in ids):
            raise SamplingParamsError(
                f"stop_token_ids must be a sequence of integers >= 0, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_penalties_and_logprobs(self)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    @property
    def processes_logits(self) -> bool:
        """True when a penalty or min_tokens changes the logits before p (`logits_processors`)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
        )

    @property
    def is_greedy(self) -> bool:
        """True when temperature is 0: argmax decoding and greedy acceptance."""
        return self.temperature == 0


MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's limit)
MIN_REPETITION_PENALTY = 0.01  # logits divided by less could overflow float32 (and mean nothing)


def _check_penalties_and_logprobs(params: SamplingParams) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(params, name)
        if not isinstance(v, int | float) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
            raise SamplingParamsError(f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")
    rp = params.repetition_penalty
    if not isinstance(rp, int | float) or isinstance(rp, bool) or not MIN_REPETITION_PENALTY <= rp <= 100.0:
        raise SamplingParamsError(
            f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY}, 100] (1 = off), got {rp!r}"
        )
    if not _is_int(params.min_tokens) or params.min_tokens < 0:
        raise SamplingParamsError(f"min_tokens must be an integer >= 0, got {params.min_tokens!r}")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise SamplingParamsError(
            f"min_tokens ({params.min_tokens}) must be <= max_tokens ({params.max_tokens})"
        )
    lp = params.logprobs
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
        raise SamplingParamsError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {lp!r}")


def logits_to_probs(
    logits: torch.Tensor,  # float [n, vocab] (or [vocab]): raw model logits, any float dtype
    params: SamplingParams,
) -> torch.Tensor:  # float32 [n, vocab] (or [vocab]): p, each row sums to 1, zeros outside the kept set
    """The model's distribution p after temperature, top-k and top-p (module docstring, steps 1-4).

    Greedy params give one-hot rows at the argmax. Rows are independent. Computed in float32 (float64
    input stays float64).

    Raises:
        ValueError: logits is not 1-D or 2-D.
    """
    if logits.dim() not in (1, 2):
        raise ValueError(f"logits must be [vocab] or [n, vocab], got shape {tuple(logits.shape)}")
    squeeze = logits.dim() == 1
    x = logits.unsqueeze(0) if squeeze else logits
    x = x.double() if x.dtype == torch.float64 else x.float()
    vocab = x.shape[-1]
    if params.is_greedy:
        out = torch.zeros_like(x)
        out.scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
        return out.squeeze(0) if squeeze else out
    x = x / params.temperature
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        x = x.masked_fill(x < kth, -math.inf)
    if params.top_p < 1.0:
        probs_sorted, order = torch.sort(torch.softmax(x, dim=-1), dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted  # [n, vocab]
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # never drop the most likely token
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf)
    out = torch.softmax(x, dim=-1)
    return out.squeeze(0) if squeeze else out


def sample_token(
    probs: torch.Tensor,  # float [vocab]: a distribution (need not be normalized; must have positive mass)
    generator: torch.Generator,
) -> int:
    """Draw one token id from probs with the lane's generator (`torch.multinomial`)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


class LaneRandom:
    """A lane's random stream: one `torch.Generator` per device, created on first use from the lane's seed.

    Args:
        seed: the request's seed, or None for a fresh one from the OS (`secrets.randbits(63)`), so two
            unseeded lanes never share a stream in practice.

    Attributes:
        seed: the seed actually used (report it so an unseeded run can be replayed).
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = secrets.randbits(63) if seed is None else seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """The lane's generator on `device` (the device of the tensors it draws for)."""
        dev = torch.device(device)
        gen = self._generators.get(dev)
        if gen is None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(self.seed)
            self._generators[dev] = gen
        return gen
