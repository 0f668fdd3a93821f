"""The fused mixer pieces (GDN conv, attention's q/k norm + RoPE + KV write, gated attention): their
ABI, limits, shared-memory and split formulas, and their binding.

The kernel sources are ``compiler/kernels/fused_mixers.cuh`` and ``gated_attention.cuh`` (built by
``ignis.compiler.kernels.fused_mixers.build_fused_mixers``, which takes the names, limits and
formulas below from here); the math, its sources and the CPU models are in
``ignis.compiler.kernels.fused_mixers``. `StaticHybridExecutor` runs them in static rounds on CUDA
through `FusedMixersKernel`:

* ``gdn_conv_silu``: the GDN conv state gather + causal conv1d + SiLU with the window write;
* ``qk_norm_rope_kv``: attention's q/k (1 + w) RMSNorm + partial RoPE + KV scatter;
* ``gated_attention``: gated GQA attention over the lanes' caches (split over keys when long:
  `attention_split_keys`);
* ``rope_kv``: ``qk_norm_rope_kv`` without the norms, and ``grouped_attention``: ``gated_attention``
  without the gate, which `StaticLlamaExecutor` runs (llama / qwen2).

Every library has the first two (`REQUIRED_FUNCTION_NAMES`); libraries built before
``gated_attention`` or ``rope_kv`` lack them (`OPTIONAL_FUNCTION_NAMES`), which the binding then
leaves to torch.
"""

from __future__ import annotations

import functools

import torch

from ignis.runtime.kernels.module import ModuleFunctions

__all__ = [
    "ATTN_CHUNK",
    "ATTN_MAX_SPLITS",
    "FUNCTION_NAMES",
    "GATED_ATTENTION_HEAD_DIMS",
    "MAX_CONV_KERNEL",
    "MAX_HEAD_DIM",
    "OPTIONAL_FUNCTION_NAMES",
    "REQUIRED_FUNCTION_NAMES",
    "FusedMixersKernel",
    "attention_split_keys",
    "gated_attention_smem_bytes",
]

REQUIRED_FUNCTION_NAMES = ("gdn_conv_silu", "qk_norm_rope_kv")
"""The exports every fused-mixers library has (manifest kernel kinds of the same names)."""
OPTIONAL_FUNCTION_NAMES = ("gated_attention", "rope_kv", "grouped_attention")
"""The exports libraries built before them lack (`FusedMixersKernel.has_gated_attention`,
`FusedMixersKernel.has_rope_kv`, `FusedMixersKernel.has_grouped_attention`)."""
FUNCTION_NAMES = REQUIRED_FUNCTION_NAMES + OPTIONAL_FUNCTION_NAMES
"""Every export of a library, in build order."""

MAX_CONV_KERNEL = 8
"""Largest GDN conv kernel size ``gdn_conv_silu`` takes (``kMaxConvKernel`` in fused_mixers.cuh)."""
MAX_HEAD_DIM = 1024
"""Largest head dim ``qk_norm_rope_kv`` takes (``kMaxHeadDim`` in fused_mixers.cuh)."""
GATED_ATTENTION_HEAD_DIMS = (32, 64, 128, 256)
"""The head dims ``gated_attention`` is compiled for."""
ATTN_CHUNK = 32
"""Keys one shared-memory stage of ``gated_attention`` holds (``kChunk`` in gated_attention.cuh)."""


def gated_attention_smem_bytes(head_dim: int, element_bytes: int = 2) -> int:
    """Dynamic shared memory (bytes) of one ``gated_attention`` block (``gated_attention_smem_bytes`` in
    gated_attention.cuh): 64 query rows and two stages of 32 keys and 32 values, rows of head_dim + 8
    elements -- 101,376 bytes at head_dim 256 in bf16 / f16, the 99 KiB a block that sm_86 / sm_89 /
    sm_120 cards allow at most."""
    return (64 + 4 * 32) * (head_dim + 8) * element_bytes


ATTN_MAX_SPLITS = 32
"""Most key splits of one ``gated_attention`` call: a one-lane round of the 27B shape (4 kv heads) then
runs 128 blocks at long context, one wave on an H200's 132 SMs (48, 64 or 96 splits leave a second,
partial wave: measured slower, docs/perf/log session 12)."""


def attention_split_keys(max_keys: int) -> int:
    """Keys a split of ``gated_attention`` holds when it may read ``max_keys`` keys: at least 256 (one
    split, no combine launch, up to 256 keys), else ``max_keys / ATTN_MAX_SPLITS`` rounded up to the
    kernel's 32-key stages, so at most `ATTN_MAX_SPLITS` splits (a bounded workspace: lanes x kv_heads
    x splits x rows x head_dim fp32) that spread a long context over the SMs (flash-decoding). A row's
    result depends on the keys, its position and this split size only (not on the other lanes or
    columns of the round).

    Raises:
        ValueError: max_keys < 1.
    """
    if max_keys < 1:
        raise ValueError(f"max_keys must be >= 1, got {max_keys}")
    per = -(-max_keys // ATTN_MAX_SPLITS)
    return max(256, -(-per // ATTN_CHUNK) * ATTN_CHUNK)


@functools.cache
def _smem_per_block_optin(device: torch.device) -> int:
    """Bytes of shared memory a block of `device` may opt in to (read once a device: every static
    attention layer asks)."""
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", None)  # torch >= 2.5
    return int(limit if limit is not None else getattr(props, "shared_memory_per_block", 48 * 1024))


class FusedMixersKernel(ModuleFunctions):
    """The fused mixer pieces of a compiled module (static rounds, CUDA only; the math and its source
    are in ``ignis.compiler.kernels.fused_mixers``): the GDN conv1d + SiLU with the window write, and
    attention's q/k (1 + w) RMSNorm + partial RoPE + KV write. Both launch on torch's current stream
    (capturable) and allocate their outputs with torch (the graph's pool when captured).

    Args:
        source: a loaded module holding ``gdn_conv_silu`` and ``qk_norm_rope_kv`` (anything indexable
            by those names: a ``tvm_ffi.Module`` or, for CPU tests, a dict of callables), or the path
            of a ``.so`` built by ``build_fused_mixers`` (loaded with the lean runtime).

    Raises:
        TvmRuntimeError: a path that is missing or cannot be loaded.
        KeyError: a module without those functions.
    """

    function_names = REQUIRED_FUNCTION_NAMES
    optional_function_names = OPTIONAL_FUNCTION_NAMES

    @property
    def has_gated_attention(self) -> bool:
        """Whether the module exports ``gated_attention`` (libraries built before it do not)."""
        return "gated_attention" in self.funcs

    def gated_attention_takes(
        self, dtype: torch.dtype, head_dim: int, device: torch.device | None = None
    ) -> bool:
        """Whether `gated_attention` serves a layer of this dtype and head_dim (bf16 / f16; head_dim
        32, 64, 128 or 256) in this module, on `device` (a CUDA device whose blocks may hold its
        shared memory: `gated_attention_smem_bytes`; not checked for other devices)."""
        return self.has_gated_attention and self._attention_takes(dtype, head_dim, device)

    @property
    def has_grouped_attention(self) -> bool:
        """Whether the module exports ``grouped_attention`` (libraries built before it do not)."""
        return "grouped_attention" in self.funcs

    def grouped_attention_takes(
        self, dtype: torch.dtype, head_dim: int, device: torch.device | None = None
    ) -> bool:
        """Whether `grouped_attention` serves a layer of this dtype and head_dim (the limits of
        `gated_attention_takes`: the same kernel)."""
        return self.has_grouped_attention and self._attention_takes(dtype, head_dim, device)

    def grouped_attention(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        max_keys: int,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """GQA attention over the lanes' caches without a gate (llama / qwen2; the ``gated_attention``
        kernel, "grouped_attention"): ``round(attn(q, K, V))`` as [rows, heads * hd] in q's dtype,
        written into `out` ([rows, heads * hd] with the last dim contiguous and an even row stride,
        e.g. the front columns of a zero-padded activation buffer) or a new tensor. Otherwise as
        `gated_attention`."""
        rows, heads, hd = q.shape
        if out is None:
            out = q.new_empty(rows, heads * hd)
        ws_o, ws_ml, split_keys = self._attention_workspace(q, kc, slots, max_keys)
        args = (q, kc, vc, pos, slots, out, ws_o, ws_ml, max_keys, split_keys, scale)
        self._call("grouped_attention", args, q.is_cuda)
        return out

    def _attention_takes(self, dtype: torch.dtype, head_dim: int, device: torch.device | None) -> bool:
        if dtype not in (torch.bfloat16, torch.float16) or head_dim not in GATED_ATTENTION_HEAD_DIMS:
            return False
        if device is not None and device.type == "cuda":
            return gated_attention_smem_bytes(head_dim) <= _smem_per_block_optin(device)
        return True

    @staticmethod
    def _attention_workspace(
        q: torch.Tensor, kc: torch.Tensor, slots: torch.Tensor, max_keys: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(ws_o, ws_ml, split_keys) of an attention call (`attention_split_keys`; empty workspace
        tensors for one split), allocated with torch."""
        rows, heads, hd = q.shape
        lanes, kv_heads = slots.shape[0], kc.shape[2]
        split_keys = attention_split_keys(max_keys)
        splits = -(-max_keys // split_keys)
        r_pad = -(-(heads // kv_heads) * (rows // lanes) // 64) * 64
        if splits > 1:
            ws_o = torch.empty(lanes, kv_heads, splits, r_pad, hd, dtype=torch.float32, device=q.device)
            ws_ml = torch.empty(lanes, kv_heads, splits, r_pad, 2, dtype=torch.float32, device=q.device)
        else:
            ws_o = ws_ml = torch.empty(0, dtype=torch.float32, device=q.device)
        return ws_o, ws_ml, split_keys

    def gated_attention(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        gate: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        max_keys: int,
        scale: float,
    ) -> torch.Tensor:
        """Gated GQA attention over the lanes' caches (``ignis.compiler.kernels.fused_mixers``,
        "gated_attention"): ``round(round(attn(q, K, V)) * round(sigmoid(gate)))`` as
        [rows, heads * hd] in q's dtype (a new tensor). q [rows, heads, hd] contiguous, gate
        [rows, heads, hd] (hd contiguous), kc / vc [S, cap, kv_heads, hd], pos [rows] and slots [L]
        int64 (rows = L * n); keys from max_keys on (the graph's KV bucket) are never read.
        Allocates the split workspace (`attention_split_keys`) with torch. Raises ValueError /
        TypeError (from the module) on shapes, dtypes or devices it does not take."""
        rows, heads, hd = q.shape
        out = q.new_empty(rows, heads * hd)
        ws_o, ws_ml, split_keys = self._attention_workspace(q, kc, slots, max_keys)
        args = (q, kc, vc, gate, pos, slots, out, ws_o, ws_ml, max_keys, split_keys, scale)
        self._call("gated_attention", args, q.is_cuda)
        return out

    def gdn_conv_silu(
        self,
        qkv: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        weight: torch.Tensor,
        windows: torch.Tensor,
        lanes: int,
        n: int,
    ) -> torch.Tensor:
        """``silu(conv1d([state[slots] | qkv columns]))``, [L, n, C] in qkv's dtype (a new tensor);
        also writes the windows ``windows[:L, :, :K - 1 + n]``. qkv [L * n, C] (any strides), state
        [S, C, K - 1], slots [L] int64, weight [C, K], windows [>= L, C, >= K - 1 + n], one dtype.
        Raises ValueError / TypeError (from the module) on shapes, dtypes or devices it does not
        take."""
        out = qkv.new_empty(lanes, n, qkv.shape[-1])
        self._call("gdn_conv_silu", (qkv, state, slots, weight, windows, out), qkv.is_cuda)
        return out

    @property
    def has_rope_kv(self) -> bool:
        """Whether the module exports ``rope_kv`` (libraries built before it do not)."""
        return "rope_kv" in self.funcs

    def rope_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
    ) -> torch.Tensor:
        """`qk_norm_rope_kv` without the q/k norms (llama / qwen2): the rotated queries [rows, heads,
        hd] in q's dtype (a new tensor); the rotated keys and the values written into kc / vc at
        ``[slots[r // n], pos[r]]``. cos, sin [rows, rot] (sin as HF's, not negated). Same shapes and
        errors as `qk_norm_rope_kv`."""
        q_out = q.new_empty(q.shape)
        self._call("rope_kv", (q, k, v, cos, sin, pos, slots, kc, vc, q_out), q.is_cuda)
        return q_out

    def qk_norm_rope_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        wq: torch.Tensor,
        wk: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """The normed, rotated queries [rows, heads, hd] in q's dtype (a new tensor); the normed,
        rotated keys and the values are written into kc / vc [S, cap, kv_heads, hd] at
        ``[slots[r // n], pos[r]]``. q [rows, heads, hd], k, v [rows, kv_heads, hd] (any strides),
        wq, wk = 1 + the norm weights [hd] float32, cos, sin [rows, rot] and the caches in q's dtype,
        pos [rows] and slots [L] int64 (rows = L * n). Raises ValueError / TypeError (from the
        module) as `gdn_conv_silu`."""
        q_out = q.new_empty(q.shape)
        args = (q, k, v, wq, wk, cos, sin, pos, slots, kc, vc, q_out, eps)
        self._call("qk_norm_rope_kv", args, q.is_cuda)
        return q_out
