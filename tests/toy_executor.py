"""A tiny random model implementing the `Executor` protocol exactly, for the round-loop tests.

Two "layers", like a hybrid family, so rollback is exercised on both kinds of state:

- layer 0, recurrent (Gated-DeltaNet-like): x_t = E[token] + P[position]; a causal depthwise conv over
  the last `conv_kernel_size` inputs (its *conv state* holds the previous K - 1 inputs), c_t = silu(conv);
  a gated linear recurrence h_t = a_t * h_{t-1} + (1 - a_t) * tanh(B c_t), a_t = sigmoid(W_a c_t + b_a)
  (its *recurrent state* is h); output y0_t = c_t + h_t.
- layer 1, attention: causal single-head softmax attention over y0 of every position so far, with a
  KV cache; output y1_t = y0_t + W_out attn_t.
- final RMS norm and a head: logits_t = logit_scale * W_head norm(y1_t).

Arithmetic is float64 and strictly column by column, so the logits of a position are bit-identical
however the columns are batched (one forward of n columns, n forwards of one column, any lane mix):
greedy speculation-on versus speculation-off comparisons are exact, with no near-tie noise at all.

`commit` follows the protocol: keys of every column are appended on `forward` and trimmed on commit;
with `record=True` the conv and recurrent state after every column are recorded and the one after the
committed prefix is kept; with `record=False` only a full (or empty) commit is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from ignis.runtime.errors import StateError
from ignis.runtime.families.base import FamilyConfig, ForwardOutput


@dataclass(frozen=True)
class ToyConfig(FamilyConfig):
    """The toy model's shape (HF-style names)."""

    model_type: ClassVar[str] = "toy"
    vocab_size: int = 50  # tokens
    hidden_size: int = 16  # width of every layer
    max_position_embeddings: int = 256  # context limit in tokens
    conv_kernel_size: int = 3  # causal conv window of the recurrent layer
    logit_scale: float = 4.0  # multiplies the head's output (sharper or flatter distributions)
    seed: int = 0  # weights are torch.randn from this seed

    def __post_init__(self) -> None:
        self._require(self.vocab_size >= 2 and self.hidden_size >= 1, "vocab_size >= 2 and hidden_size >= 1")
        self._require(self.conv_kernel_size >= 1, "conv_kernel_size >= 1")


@dataclass
class _Pending:
    num_columns: int
    record: bool
    keys: np.ndarray  # [n, H]
    values: np.ndarray  # [n, H]
    hs: list[np.ndarray]  # recorded h after each column (or only the last when record=False)
    convs: list[np.ndarray]  # recorded conv state after each column (likewise)


@dataclass
class ToyLaneState:
    """One lane: KV cache of layer 1, conv + recurrent state of layer 0, and the pending forward."""

    keys: np.ndarray  # [t, H] committed keys
    values: np.ndarray  # [t, H]
    h: np.ndarray  # [H] recurrent state after the last committed token
    conv: np.ndarray  # [K-1, H] the last K-1 committed inputs (zeros before position 0)
    committed: int = 0
    pending: _Pending | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        """Committed tokens whose effect the state holds."""
        return self.committed


class ToyExecutor:
    """The toy model (module docstring). Implements `ignis.runtime.families.base.Executor`.

    The arithmetic runs in numpy (float64): per-column torch calls cost ~10x more on a small CPU.
    Instrumentation for tests: `calls` lists, per forward, the column count of every lane and whether
    it was a `record` forward.
    """

    device = torch.device("cpu")

    def __init__(self, config: ToyConfig | None = None) -> None:
        self.config = config or ToyConfig()
        c = self.config
        g = torch.Generator().manual_seed(c.seed)
        H, V, K = c.hidden_size, c.vocab_size, c.conv_kernel_size

        def randn(*shape: int, scale: float = 1.0) -> np.ndarray:
            return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).numpy()

        self.embed = randn(V, H)
        self.conv_w = randn(K, H, scale=1 / math.sqrt(K))
        self.w_a = randn(H, H, scale=1 / math.sqrt(H))
        self.b_a = randn(H, scale=0.5)
        self.w_b = randn(H, H, scale=1 / math.sqrt(H))
        self.w_q = randn(H, H, scale=1 / math.sqrt(H))
        self.w_k = randn(H, H, scale=1 / math.sqrt(H))
        self.w_v = randn(H, H, scale=1 / math.sqrt(H))
        self.w_out = randn(H, H, scale=1 / math.sqrt(H))
        self.w_head = randn(V, H, scale=1 / math.sqrt(H))
        self.pos = randn(c.max_position_embeddings, H, scale=0.5)  # last: a longer context only adds rows
        self.calls: list[tuple[list[int], bool]] = []

    def new_lane(self) -> ToyLaneState:
        H, K = self.config.hidden_size, self.config.conv_kernel_size
        return ToyLaneState(
            keys=np.zeros((0, H)), values=np.zeros((0, H)), h=np.zeros(H), conv=np.zeros((K - 1, H))
        )

    def _column(
        self, token: int, position: int, h: np.ndarray, conv: np.ndarray, keys: np.ndarray, values: np.ndarray
    ):
        x = self.embed[token] + self.pos[position]  # [H]
        window = np.concatenate([conv, x[None]])  # [K, H]
        u = (window * self.conv_w).sum(0)
        c = u / (1.0 + np.exp(-u))  # silu
        a = 1.0 / (1.0 + np.exp(-(self.w_a @ c + self.b_a)))
        h = a * h + (1 - a) * np.tanh(self.w_b @ c)
        y0 = c + h
        k, v, q = self.w_k @ y0, self.w_v @ y0, self.w_q @ y0
        keys = np.concatenate([keys, k[None]])
        values = np.concatenate([values, v[None]])
        s = keys @ q / math.sqrt(self.config.hidden_size)
        w = np.exp(s - s.max())
        y1 = y0 + self.w_out @ ((w / w.sum()) @ values)
        normed = y1 / math.sqrt(float((y1 * y1).mean()) + 1e-6)
        logits = self.config.logit_scale * (self.w_head @ normed)
        return logits, y0, y1, h, window[1:], keys, values

    def forward(
        self,
        states: Sequence[ToyLaneState],
        columns: Sequence[torch.Tensor],
        *,
        logits: str = "all",
        record: bool = True,
        output_hidden_states: bool = False,
        tap_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        if len(states) != len(columns):
            raise ValueError(f"{len(states)} states but {len(columns)} column tensors")
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        if any(t not in (0, 1) for t in tap_layers):
            raise ValueError(f"the toy model has layers 0 and 1, got tap_layers {tuple(tap_layers)}")
        for i, (st, col) in enumerate(zip(states, columns, strict=True)):
            if st.pending is not None:
                raise StateError(f"lane {i}: forward while a previous forward is not committed")
            if col.dim() != 1 or col.numel() < 1:
                raise StateError(f"lane {i}: columns must be int64 [n >= 1], got {tuple(col.shape)}")
            if st.committed + col.numel() > self.config.max_position_embeddings:
                raise StateError(
                    f"lane {i}: {st.committed} + {col.numel()} columns pass max_position_embeddings "
                    f"{self.config.max_position_embeddings}"
                )
            if int(col.min()) < 0 or int(col.max()) >= self.config.vocab_size:
                raise StateError(f"lane {i}: token ids outside [0, {self.config.vocab_size})")
        self.calls.append(([c.numel() for c in columns], record))
        out_logits, out_hidden, out_taps = [], [], []
        for st, col in zip(states, columns, strict=True):
            h, conv, keys, values = st.h, st.conv, st.keys, st.values
            hs, convs, lg, hid, taps = [], [], [], [], []
            n = col.numel()
            for j, tok in enumerate(col.tolist()):
                row, y0, y1, h, conv, keys, values = self._column(
                    tok, st.committed + j, h, conv, keys, values
                )
                lg.append(row)
                hid.append(y1)
                if tap_layers:
                    taps.append(np.concatenate([(y0, y1)[t] for t in tap_layers]))
                if record or j == n - 1:
                    hs.append(h)
                    convs.append(conv)
            t0 = st.keys.shape[0]
            st.pending = _Pending(
                num_columns=n, record=record, keys=keys[t0:], values=values[t0:], hs=hs, convs=convs
            )
            stacked = torch.from_numpy(np.stack(lg if logits == "all" else lg[-1:])).float()
            out_logits.append(stacked)
            if output_hidden_states:
                out_hidden.append(torch.from_numpy(np.stack(hid)))
            if tap_layers:
                out_taps.append(torch.from_numpy(np.stack(taps)))
        return ForwardOutput(
            logits=out_logits,
            hidden_states=out_hidden if output_hidden_states else None,
            taps=out_taps if tap_layers else None,
        )

    def commit(self, states: Sequence[ToyLaneState], num_keep: Sequence[int]) -> None:
        if len(states) != len(num_keep):
            raise ValueError(f"{len(states)} states but {len(num_keep)} num_keep entries")
        for i, (st, keep) in enumerate(zip(states, num_keep, strict=True)):
            p = st.pending
            if p is None:
                raise StateError(f"lane {i}: commit without a pending forward")
            if not 0 <= keep <= p.num_columns:
                raise StateError(f"lane {i}: num_keep {keep} outside 0..{p.num_columns}")
            if not p.record and keep not in (0, p.num_columns):
                raise StateError(
                    f"lane {i}: a record=False forward committed partially ({keep}/{p.num_columns})"
                )
        for st, keep in zip(states, num_keep, strict=True):
            p = st.pending
            assert p is not None
            if keep:
                idx = keep - 1 if p.record else 0
                st.keys = np.concatenate([st.keys, p.keys[:keep]])
                st.values = np.concatenate([st.values, p.values[:keep]])
                st.h, st.conv = p.hs[idx], p.convs[idx]
                st.committed += keep
            st.pending = None

    # ------------------------------------------------------------------ test helpers

    def state_after(self, tokens: Sequence[int]) -> ToyLaneState:
        """A fresh lane fed `tokens` in one record=False forward and committed whole."""
        st = self.new_lane()
        if tokens:
            self.forward([st], [torch.tensor(list(tokens), dtype=torch.int64)], record=False)
            self.commit([st], [len(tokens)])
        return st

    @staticmethod
    def states_equal(a: ToyLaneState, b: ToyLaneState) -> bool:
        """Bitwise equality of every committed tensor and the token count."""
        return (
            a.committed == b.committed
            and a.pending is None
            and b.pending is None
            and all(
                np.array_equal(x, y)
                for x, y in ((a.keys, b.keys), (a.values, b.values), (a.h, b.h), (a.conv, b.conv))
            )
        )

    def next_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """float32 [vocab]: the logits after feeding `tokens` (a reference, no speculation)."""
        st = self.new_lane()
        out = self.forward([st], [torch.tensor(list(tokens), dtype=torch.int64)], logits="last", record=False)
        self.commit([st], [0])
        return out.logits[0][-1]
