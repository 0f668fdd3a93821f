"""Fused pieces of the hybrid token mixers (the GDN causal conv1d + SiLU; attention's q/k RMSNorm,
partial RoPE and KV write; the gated attention itself), CUDA kernels exported through tvm-ffi, for
CUDA-graphed verify rounds.

Outside its linears a graphed round is bound by its graph nodes, one per small torch kernel. These
three functions replace per-layer chains of them in ``StaticHybridExecutor``'s static rounds:

* ``gdn_conv_silu(qkv, state, slots, weight, windows, out)`` -- once per GDN layer: the gather of the
  lanes' conv states, the concatenation with the round's columns, the depthwise causal conv1d and the
  SiLU (torch: index_select, cat, conv1d, silu, transpose, and the copy of the window into the
  executor's ``_windows`` buffer that `commit` reads)::

      window[l, c] = [state[slots[l], c, :] | qkv[l * n + t, c] for t < n]       (kd + n values)
      out[l, t, c] = round(silu(round(sum_k w[c, k] * window[l, c, t + k])))      k < K = kd + 1

  also writing ``windows[l, c, :kd + n] = window[l, c]``.
* ``qk_norm_rope_kv(q, k, v, wq, wk, cos, sin, pos, slots, kc, vc, q_out, eps)`` -- once per
  full-attention layer: the (1 + w) RMSNorms of the query and key heads, the partial rotate-half
  RoPE on their first ``rot`` dims and the scatter of keys and values into the lanes' caches
  (torch: two norms of 5 kernels, two RoPEs of ~8, two index_put)::

      y = round((x * rsqrt(mean(x^2) + eps)) * w1p)                        per head, float32 math
      o = round(round(y * cos) + round(rotate_half(y) * sin))  on e < rot, y elsewhere
      q_out[r] = o(q[r]);  kc[slots[r // n], pos[r]] = o(k[r]);  vc[slots[r // n], pos[r]] = v[r]

* ``rope_kv(q, k, v, cos, sin, pos, slots, kc, vc, q_out)`` -- the same kernel without the norms,
  once per layer of the llama / qwen2 rounds (``StaticLlamaExecutor``; torch: RoPE of q and k in 4
  kernels and the pool write): ``o = round(round(x * cos) + round(rotate_half(x) * sin))``, bit for
  bit torch's ``x * cos + rotate_half(x) * sin`` in the model dtype.
* ``grouped_attention(q, kc, vc, pos, slots, out, ws_o, ws_ml, max_keys, split_keys, scale)`` -- the
  next kernel without its gate (``out = round(attention)``, out's rows any even stride), once per
  layer of the llama / qwen2 rounds in place of the cache gather, SDPA and the heads' permute.
* ``gated_attention(q, kc, vc, gate, pos, slots, out, ws_o, ws_ml, max_keys, split_keys, scale)`` --
  once per full-attention layer, after ``qk_norm_rope_kv``: grouped-query attention of the round's
  query rows over their lanes' caches, masked at each row's position, times the sigmoid output gate
  (torch: two cache gathers, the mask, cuDNN's SDPA, two head permutes, sigmoid, multiply)::

      o[r, h]   = softmax_t((q[r, h] . K[slots[r // n], t, h // rep]) * scale) V[..]   t <= pos[r]
      out[r, h] = round(round(o[r, h]) * round(sigmoid(gate[r, h])))

  FlashAttention-2's online softmax on mma.m16n8k16 (P in the model dtype, fp32 accumulation), the
  keys split flash-decoding style in `attention_split_keys` pieces merged in split order
  (``gated_attention.cuh``); bf16 / f16, head_dim in `GATED_ATTENTION_HEAD_DIMS`. Its oracle is
  :func:`gated_attention_reference` (the torch path's math).

``round`` is to the model dtype (identity for float32), at the points HF's Qwen3.5 modules and the
torch path round (conv1d and SiLU each in the model dtype; RMSNorm in float32 cast once; RoPE's
products and sum each in the model dtype, cos/sin given in the model dtype). Only the order of the
float32 sums (the conv's, the sum of squares) differs from torch's. Shapes, dtypes and layouts:
``fused_mixers_ffi.cuh``; the kernels: ``fused_mixers.cuh``. :func:`gdn_conv_silu_reference` /
:func:`qk_norm_rope_kv_reference` are the torch paths (the oracles); :func:`gdn_conv_silu_emulated`
/ :func:`qk_norm_rope_kv_emulated` CPU models of the kernels (same order of operations), with the
module's calling convention (outputs written in place), tested against them.

One module holds all three (:data:`FUNCTION_NAMES`); :func:`build_fused_mixers` returns the exported
``.so`` (nvcc, SASS for one arch, no PTX). The kernels allocate nothing and launch on the stream
tvm-ffi reports (torch's current one under ``tvm_ffi.use_torch_stream()``), so they can be captured
in CUDA graphs. The caller is ``ignis.runtime.kernels.fused_mixers.FusedMixersKernel``, which
``StaticHybridExecutor(mixers_module=...)`` (``ignis.runtime.families.hybrid_graphs``) runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ignis.runtime.kernels.fused_mixers import (
    FUNCTION_NAMES,
    GATED_ATTENTION_HEAD_DIMS,
    MAX_CONV_KERNEL,
    MAX_HEAD_DIM,
    attention_split_keys,
    gated_attention_smem_bytes,
)

from .fused_norms import _fma

__all__ = [
    "FUNCTION_NAMES",
    "GATED_ATTENTION_HEAD_DIMS",
    "MAX_CONV_KERNEL",
    "MAX_HEAD_DIM",
    "FusedMixersError",
    "attention_split_keys",
    "build_fused_mixers",
    "gated_attention_reference",
    "gated_attention_smem_bytes",
    "gdn_conv_silu_emulated",
    "gdn_conv_silu_reference",
    "grouped_attention_reference",
    "qk_norm_rope_kv_emulated",
    "qk_norm_rope_kv_reference",
    "rope_kv_emulated",
]


class FusedMixersError(ValueError):
    """The fused mixers cannot be built for this target."""


# --------------------------------------------------------------------------------------------
# Oracles (the torch paths of StaticHybridExecutor) and CPU models of the kernels.


def gdn_conv_silu_reference(qkv: Any, state: Any, slots: Any, weight: Any, n: int) -> tuple[Any, Any]:
    """The torch path (``StaticHybridExecutor._static_gdn``): qkv [L * n, C], state [S, C, K - 1],
    slots [L] int64, weight [C, K], all one dtype. Returns (out [L, n, C], window [L, C, K - 1 + n])
    in that dtype: ``silu(conv1d(window))`` and the window."""
    import torch
    import torch.nn.functional as F

    lanes, ch = slots.shape[0], qkv.shape[-1]
    window = torch.cat([state.index_select(0, slots), qkv.view(lanes, n, ch).transpose(1, 2)], dim=2)
    out = F.silu(F.conv1d(window, weight.unsqueeze(1), None, padding=0, groups=ch)).transpose(1, 2)
    return out, window


def gdn_conv_silu_emulated(qkv: Any, state: Any, slots: Any, weight: Any, windows: Any, out: Any) -> None:
    """CPU model of ``gdn_conv_silu`` with the module's arguments (module docstring): writes
    ``windows[:L, :, :K - 1 + n]`` and ``out`` [L, n, C] (model dtype) in place; per (lane, channel,
    column) a float32 FMA chain over k in order, rounded, then ``y / (1 + exp(-y))`` rounded. A slot
    outside the state's range reads a zero state, as the kernel does."""
    import torch

    lanes, n, ch = out.shape
    kk = weight.shape[1]
    dtype = out.dtype
    valid = (slots >= 0) & (slots < state.shape[0])
    lane_state = torch.where(valid[:, None, None], state.index_select(0, torch.where(valid, slots, 0)), 0)
    window = torch.cat([lane_state, qkv.reshape(lanes, n, ch).transpose(1, 2)], dim=2)
    windows[:lanes, :, : kk - 1 + n] = window
    wf, xf = weight.float(), window.float()
    for t in range(n):
        acc = torch.zeros(lanes, ch, dtype=torch.float32)
        for k in range(kk):
            acc = _fma(wf[None, :, k], xf[:, :, t + k], acc)
        y = acc.to(dtype).float()
        out[:, t] = (y / (1.0 + torch.exp(-y))).to(dtype)


def _rope_reference(x: Any, cos: Any, sin: Any) -> Any:
    rot = cos.shape[-1]
    half = rot // 2
    xr, xp = x[..., :rot], x[..., rot:]
    rotated = __import__("torch").cat((-xr[..., half:], xr[..., :half]), dim=-1)
    return __import__("torch").cat((xr * cos[:, None, :] + rotated * sin[:, None, :], xp), dim=-1)


def qk_norm_rope_kv_reference(
    q: Any,
    k: Any,
    v: Any,
    wq: Any,
    wk: Any,
    cos: Any,
    sin: Any,
    pos: Any,
    slots: Any,
    kc: Any,
    vc: Any,
    eps: float,
) -> Any:
    """The torch path (``StaticHybridExecutor._static_attention``): q [rows, heads, hd], k, v
    [rows, kv_heads, hd] (model dtype), wq, wk = 1 + the norm weights [hd] float32, cos, sin
    [rows, rot] model dtype, pos [rows] int64, slots [L] int64 (rows = L * n), kc, vc
    [S, cap, kv_heads, hd] (written at [slots[r // n], pos[r]]). Returns the query [rows, heads, hd]."""
    import torch.nn.functional as F

    def norm(x: Any, w1p: Any) -> Any:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * w1p).to(x.dtype)

    rows = q.shape[0]
    slot_rows = slots.repeat_interleave(rows // slots.shape[0])
    kc[slot_rows, pos] = _rope_reference(norm(k, wk), cos, sin)
    vc[slot_rows, pos] = v
    return _rope_reference(norm(q, wq), cos, sin)


def _head_norm_emulated(x: Any, w1p: Any, eps: float) -> Any:
    """[rows, heads, hd] -> float32 holding model-dtype values: 32 strided FMA chains per head, an
    xor tree, ``round((x * r) * w1p)``."""
    import torch

    from .fused_norms import _strided_sum_sq, _warp_tree

    hd = x.shape[-1]
    v = x.float()
    total = _warp_tree(_strided_sum_sq(v, 32))[..., 0]
    r = torch.rsqrt(total / hd + torch.tensor(eps, dtype=torch.float32))
    return ((v * r[..., None]) * w1p.float()).to(x.dtype).float()


def _rope_emulated(y: Any, cos: Any, sin: Any, dtype: Any) -> Any:
    import torch

    rot = cos.shape[-1]
    half = rot // 2
    yr = y[..., :rot]
    rotated = torch.cat((-yr[..., half:], yr[..., :half]), dim=-1)
    a = (yr * cos.float()[:, None, :]).to(dtype).float()
    b = (rotated * sin.float()[:, None, :]).to(dtype).float()
    return torch.cat(((a + b).to(dtype), y[..., rot:].to(dtype)), dim=-1)


def qk_norm_rope_kv_emulated(
    q: Any,
    k: Any,
    v: Any,
    wq: Any,
    wk: Any,
    cos: Any,
    sin: Any,
    pos: Any,
    slots: Any,
    kc: Any,
    vc: Any,
    q_out: Any,
    eps: float,
) -> None:
    """CPU model of ``qk_norm_rope_kv`` with the module's arguments (module docstring): writes
    ``q_out`` [rows, heads, hd] and the keys / values into kc / vc at ``[slots[r // n], pos[r]]``
    (rows whose slot or position is out of range write nothing), in the kernel's order of
    operations."""
    qn, kn = _head_norm_emulated(q, wq, eps), _head_norm_emulated(k, wk, eps)
    _rope_kv_write_emulated(qn, kn, v, cos, sin, pos, slots, kc, vc, q_out, q.dtype)


def rope_kv_emulated(
    q: Any,
    k: Any,
    v: Any,
    cos: Any,
    sin: Any,
    pos: Any,
    slots: Any,
    kc: Any,
    vc: Any,
    q_out: Any,
) -> None:
    """CPU model of ``rope_kv`` (``qk_norm_rope_kv`` without the norms: llama / qwen2) with the
    module's arguments: writes ``q_out`` = the rotated q and the rotated keys / the values into kc /
    vc at ``[slots[r // n], pos[r]]`` (rows out of range write nothing). Its torch path is
    `StaticLlamaExecutor`'s `rope_qk` and KV write (the same three roundings: bit-identical)."""
    _rope_kv_write_emulated(q.float(), k.float(), v, cos, sin, pos, slots, kc, vc, q_out, q.dtype)


def _rope_kv_write_emulated(
    q: Any, k: Any, v: Any, cos: Any, sin: Any, pos: Any, slots: Any, kc: Any, vc: Any, q_out: Any, dtype: Any
) -> None:
    """The rotation and the KV write of ``qk_norm_rope_kv`` / ``rope_kv`` from float32 q and k (normed or
    not) [rows, heads, hd]: q_out = round(rope(q)) in `dtype`, kc / vc at ``[slots[r // n], pos[r]]`` =
    round(rope(k)) / v (rows whose slot or position is out of range write nothing)."""
    slot_rows = slots.repeat_interleave(q.shape[0] // slots.shape[0])
    ok = (slot_rows >= 0) & (slot_rows < kc.shape[0]) & (pos >= 0) & (pos < kc.shape[1])
    q_out.copy_(_rope_emulated(q, cos, sin, dtype))
    keys = _rope_emulated(k, cos, sin, dtype)
    kc[slot_rows[ok], pos[ok]] = keys[ok]
    vc[slot_rows[ok], pos[ok]] = v[ok]


def gated_attention_reference(q: Any, kc: Any, vc: Any, gate: Any, pos: Any, slots: Any) -> Any:
    """The torch path of ``StaticHybridExecutor._static_attention`` after the q / k norms (the oracle of
    ``gated_attention``): q [rows, heads, hd], gate [rows, heads, hd] (any strides), kc / vc
    [S, cap, kv_heads, hd], pos [rows] and slots [L] int64 (rows = L * n), one dtype. Returns
    ``round(round(softmax(q K^T * hd^-0.5, keys t <= pos) V) * round(sigmoid(gate)))`` as
    [rows, heads * hd] in q's dtype, attention computed in float32 (rounded once, as SDPA's output);
    zeros for a lane whose slot is out of range or a row with no key (pos < 0), as the kernel."""
    import torch

    rows, heads, hd = q.shape
    lanes = slots.shape[0]
    n, kv_heads = rows // lanes, kc.shape[2]
    rep = heads // kv_heads
    out = torch.zeros(rows, heads, hd, dtype=q.dtype, device=q.device)
    for li in range(lanes):
        s = int(slots[li])
        if not 0 <= s < kc.shape[0]:  # an unknown slot reads no keys: zeros, as the kernel
            continue
        for c in range(n):
            r = li * n + c
            t = max(0, min(int(pos[r]) + 1, kc.shape[1]))
            if t == 0:
                continue
            keys = kc[s, :t].float().repeat_interleave(rep, dim=1)  # [t, heads, hd]
            values = vc[s, :t].float().repeat_interleave(rep, dim=1)
            scores = torch.einsum("he,the->ht", q[r].float(), keys) * hd**-0.5
            o = torch.einsum("ht,the->he", torch.softmax(scores, dim=-1), values).to(q.dtype)
            out[r] = o * torch.sigmoid(gate[r])
    return out.reshape(rows, heads * hd)


def grouped_attention_reference(q: Any, kc: Any, vc: Any, pos: Any, slots: Any) -> Any:
    """The oracle of ``grouped_attention`` (``gated_attention`` without the gate; llama / qwen2):
    `gated_attention_reference` with a gate of +inf (sigmoid exactly 1): ``round(softmax(q K^T *
    hd^-0.5, keys t <= pos) V)`` as [rows, heads * hd] in q's dtype."""
    import torch

    return gated_attention_reference(q, kc, vc, torch.full_like(q, float("inf")), pos, slots)


# --------------------------------------------------------------------------------------------
# Building the module.


def build_fused_mixers(
    target: Any,
    *,
    out_path: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> Path:
    """Compile the fused mixers for a CUDA arch and return the exported ``.so`` path.

    Args:
        target: ``"sm_90"``, ``"sm_120"``... or ``{"kind": "cuda", "arch": "sm_90"}``.
        out_path: where to write it; default a cache file keyed by arch and sources
            (``$IGNIS_CACHE_DIR/fused_mixers/``), reused when present.
        verbose: print ptxas' register and shared-memory report.

    Returns:
        The library, exporting ``gdn_conv_silu``, ``qk_norm_rope_kv`` and ``gated_attention`` (module
        docstring), SASS for that arch only.

    Raises:
        FusedMixersError: not a CUDA target, an arch before sm_80 (the gated attention's mma and
            cp.async), nvcc missing, or nvcc failed (its stderr included).
    """
    from .cuda_build import build_kernel_library

    return build_kernel_library(
        "fused_mixers", target, error=FusedMixersError, out_path=out_path, verbose=verbose
    )
