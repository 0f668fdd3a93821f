"""The fused Gated DeltaNet recurrence: its ABI (export names, limits, the stash row) and its binding.

The kernel source is ``compiler/kernels/gdn_recurrent.cuh`` (built by
``ignis.compiler.kernels.gdn_recurrent.build_gdn_recurrent``, which takes the names and limits below
from here); the math, its source and the CPU model are in ``ignis.compiler.kernels.gdn_recurrent``.
`StaticHybridExecutor` runs it in static rounds on CUDA through `GdnRecurrentKernel`.

A library exports three functions (manifest kernel kinds of the same names):

* ``gdn_recurrent``: one round over every lane, writing the record (the state after every column);
* ``gdn_recurrent_stash``: the same round writing a stash instead (what each column fed the
  recurrence, `gdn_stash_width` floats a column and lane);
* ``gdn_replay``: the commit, replaying the kept columns of the stash from the committed state.

Libraries without the last two (built before them) serve record rounds only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ignis.runtime.kernels.module import optional_export

if TYPE_CHECKING:
    import torch

    from ignis.runtime.families.qwen3_5 import HybridConfig

__all__ = [
    "FUNCTION_NAME",
    "FUNCTION_NAMES",
    "MAX_KEY_DIM",
    "REPLAY_FUNCTION_NAME",
    "STASH_FUNCTION_NAME",
    "GdnRecurrentKernel",
    "gdn_stash_width",
]

FUNCTION_NAME = "gdn_recurrent"
"""The record round's export (and manifest kernel kind)."""
STASH_FUNCTION_NAME = "gdn_recurrent_stash"
"""The round that writes the stash instead of the record."""
REPLAY_FUNCTION_NAME = "gdn_replay"
"""The commit's replay of the kept columns from the stash."""
FUNCTION_NAMES = (FUNCTION_NAME, STASH_FUNCTION_NAME, REPLAY_FUNCTION_NAME)
"""Every export of a library, in build order."""
MAX_KEY_DIM = 256
"""Largest key head dim the kernel takes (``kMaxKeyDim`` in gdn_recurrent.cuh)."""


def gdn_stash_width(num_key_heads: int, v_heads: int, k_dim: int, v_dim: int) -> int:
    """Floats in one stash row of the fused GDN recurrence: the normalized k of every key head, v,
    beta and the decay of every value head."""
    return num_key_heads * k_dim + v_heads * v_dim + 2 * v_heads


class GdnRecurrentKernel:
    """The fused Gated DeltaNet recurrence of a compiled module (static rounds, CUDA only).

    One launch per GDN layer and round replaces the per-column torch loop of the executor's
    recurrence and the preparation before it (q/k l2 norms, the q scale, the GQA repeat, sigmoid(b),
    the decay); the math and its source are in ``ignis.compiler.kernels.gdn_recurrent``. It launches
    on torch's current stream (capturable).

    A module that also exports ``gdn_recurrent_stash`` and ``gdn_replay`` (`has_replay`) runs rounds
    that keep no per-column states: the round writes a small stash of what it consumed per column
    (`round_stash`) and the commit replays the kept columns from it, every GDN layer in one launch
    (`replay`). The state equals the record path's bit for bit; the record (4 x k_dim x v_dim bytes
    a head, column and lane: 9.7 GB for the 27B shape at 8 lanes x 8 columns) is not allocated.

    Args:
        source: the module's ``gdn_recurrent`` function (a tvm-ffi function: record rounds only), a
            loaded module (or a dict, for CPU tests) holding it and optionally the two others, or the
            path of a ``.so`` built by ``build_gdn_recurrent`` (loaded with the lean runtime,
            ``ignis.runtime.kernels.tvm_runtime.load_module``).

    Raises:
        TvmRuntimeError: a path that is missing or cannot be loaded.
    """

    def __init__(self, source: Any) -> None:
        self.stash_func: Any = None
        self.replay_func: Any = None
        if isinstance(source, GdnRecurrentKernel):
            self.stash_func, self.replay_func = source.stash_func, source.replay_func
            source = source.func
        if isinstance(source, str | os.PathLike):
            from ignis.runtime.kernels.tvm_runtime import load_module

            source = load_module(source, cuda=True)
        # a module (tvm_ffi.Module, which is callable too: its "main") or a dict of functions
        if isinstance(source, Mapping) or hasattr(source, "get_function"):
            module = source
            source = module[FUNCTION_NAME]
            stash = optional_export(module, STASH_FUNCTION_NAME)
            replay = optional_export(module, REPLAY_FUNCTION_NAME)
            if stash is not None and replay is not None:
                self.stash_func, self.replay_func = stash, replay
        self.func = source

    @property
    def has_replay(self) -> bool:
        """Whether rounds run with the stash and commits replay (`round_stash`, `replay`)."""
        return self.stash_func is not None and self.replay_func is not None

    @staticmethod
    def supports(config: HybridConfig) -> bool:
        """Whether the kernel takes this config's GDN shapes (k_dim <= `MAX_KEY_DIM`, v_heads a
        multiple of k_heads)."""
        return (
            config.linear_key_head_dim <= MAX_KEY_DIM
            and config.linear_num_value_heads % config.linear_num_key_heads == 0
        )

    def _run(self, func: Any, args: tuple[Any, ...], on_cuda: bool) -> None:
        if not on_cuda:  # a CPU stand-in (tests: the kernel's CPU model)
            func(*args)
            return
        from ignis.runtime.kernels.tvm_runtime import torch_stream

        with torch_stream():
            func(*args)

    def __call__(
        self,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        neg_a: torch.Tensor,
        dt_bias: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        record: torch.Tensor,
        out: torch.Tensor,
        num_key_heads: int,
        scale: float,
    ) -> None:
        """Run a round: mixed [L, n, conv_dim] (conv + SiLU output, model dtype, any strides), b, a
        [L, n, v_heads] (model dtype), neg_a = -exp(A_log) and dt_bias [v_heads] float32, state
        [S, v_heads, k_dim, v_dim] float32 (read), slots [L] int64, record [>= n, >= L, v_heads,
        k_dim, v_dim] float32 (record[t, l] = state after column t), out [L, n, v_heads, v_dim]
        (float32 or the model dtype, written). Raises ValueError / TypeError (from the module) on
        shapes, dtypes or devices it does not take."""
        args = (mixed, b, a, neg_a, dt_bias, state, slots, record, out, num_key_heads, scale)
        self._run(self.func, args, mixed.is_cuda)

    def round_stash(
        self,
        mixed: torch.Tensor,
        b: torch.Tensor,
        a: torch.Tensor,
        neg_a: torch.Tensor,
        dt_bias: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        stash: torch.Tensor,
        out: torch.Tensor,
        num_key_heads: int,
        scale: float,
    ) -> None:
        """Run a round as `__call__`, writing the stash [>= n, >= L, W] float32 (W =
        `gdn_stash_width`; stash[t, l] = what column t of lane l fed the recurrence) instead of a
        record. Raises ValueError / TypeError (from the module) on what it does not take."""
        args = (mixed, b, a, neg_a, dt_bias, state, slots, stash, out, num_key_heads, scale)
        self._run(self.stash_func, args, mixed.is_cuda)

    def replay(
        self,
        stash: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        keep: torch.Tensor,
        pos: torch.Tensor,
        num_key_heads: int,
    ) -> None:
        """Commit: for every layer g and lane i < m, run the first keep[i] columns of stash[g, :,
        pos[i]] from state[g, slots[i]] and write the state after the last back in place (keep 0
        leaves the lane). stash [G, C, Ls, W] float32, state [G, S, v_heads, k_dim, v_dim]
        float32, slots / keep / pos [m] int64. One launch. Raises ValueError / TypeError (from the
        module) on what it does not take."""
        self._run(self.replay_func, (stash, state, slots, keep, pos, num_key_heads), state.is_cuda)
