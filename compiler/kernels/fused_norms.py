"""Fused row norms of the hybrid decoder layers (residual add + (1 + w) RMSNorm; the GDN gated
RMSNorm), the SwiGLU activation and a narrow dense linear, CUDA kernels exported through tvm-ffi,
for CUDA-graphed verify rounds.

Outside its linears a graphed round is bound by its graph nodes, one per small torch kernel. These five
functions replace the most frequent chains:

* ``add_rms_norm(h, d, w1p, h_out, x_out, eps)`` -- twice per decoder layer (after the mixer and
  after the MLP, the latter fused with the next layer's input norm, or the final norm)::

      h_out = round(h + d);  x_out = round((h_out * rsqrt(mean(h_out^2) + eps)) * w1p)

  (``StaticHybridExecutor``'s ``h = h + mixed; x = _norm(h, w)``: an add, a cast, ``F.rms_norm``,
  a multiply and a cast, 4-5 kernels; ``round`` is to the model dtype, the norm in float32 as HF's
  ``Qwen3_5RMSNorm``; ``w1p = 1 + weight`` in float32).
* ``gated_rms_norm(x, z, w, out, eps)`` -- once per GDN layer (HF ``Qwen3_5RMSNormGated``)::

      y = round(x * rsqrt(mean(x^2) + eps));  out = round(round(w * y) * silu(z))

  over the last dim of x, z [rows, heads, dim] (``gated_rms_norm`` in hybrid_executor.py: 6-7
  kernels).
* ``add_rms_norm_llama(h, d, w, h_out, x_out, eps)`` -- the same add and norm with HF
  LlamaRMSNorm's roundings, twice per llama / qwen2 decoder layer (``StaticLlamaExecutor``)::

      h_out = round(h + d);  x_out = round(w * round(h_out * rsqrt(mean(h_out^2) + eps)))

  (w in the model dtype; the torch path: an add, a cast, ``F.rms_norm``, a cast and a multiply).
* ``silu_mul(gu, out)`` -- once per dense MLP (HF ``act_fn(gate_proj(x)) * up_proj(x)`` on the
  stacked gate|up GEMM's output ``gu = [gate | up]``, [rows, 2 I])::

      out = round(round(silu(gate)) * up)          silu(v) = v / (1 + exp(-v)), float32 math

  (torch: ``F.silu(gate) * up``, two kernels; bit-identical to them: the same float32 formula as
  ATen's ``silu_kernel`` and the same roundings).
* ``narrow_linear(x, w, y)`` -- once per GDN layer, the b|a projection ``y = x @ w^T`` for a dense
  weight of few output features ([2 v_heads, hidden] = [96, 5120] on the 27B: cuBLAS runs it as a
  split-K GEMM plus its reduction, 2 kernels), one
  launch with fp32 accumulation in a fixed order (not cuBLAS's: the sums agree to float32 rounding).

All compute in float32 and round at the points the torch path does; only the order of the float32
sums differs (the norms' sum of squares, the linear's dot products). Shapes, dtypes and layouts:
``fused_norms_ffi.cuh``; the kernels: ``fused_norms.cuh``. The ``*_reference`` functions are the
torch paths (the oracles), the ``*_emulated`` ones CPU models of the kernels (same reduction order),
tested against them.

One module holds the five functions (:data:`FUNCTION_NAMES`): one build, one file to carry and load,
one argument-checking header; all are small per-row pieces of the same rounds. Older modules without
``silu_mul`` and ``narrow_linear`` export only the norms; the runtime takes those two as optional
(``ignis.runtime.kernels.fused_norms.OPTIONAL_FUNCTION_NAMES``). :func:`build_fused_norms` returns
the exported ``.so`` (nvcc, SASS for one arch, no PTX). The kernels allocate nothing and launch on
the stream tvm-ffi reports (torch's current one under ``tvm_ffi.use_torch_stream()``), so they can be
captured in CUDA graphs. The caller is ``ignis.runtime.kernels.fused_norms.FusedNormsKernel``, which
``StaticHybridExecutor(norms_module=...)`` (``ignis.runtime.families.hybrid_graphs``) runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ignis.runtime.kernels.fused_norms import FUNCTION_NAMES

__all__ = [
    "ADD_THREADS",
    "FUNCTION_NAMES",
    "FusedNormsError",
    "add_rms_norm_emulated",
    "add_rms_norm_llama_emulated",
    "add_rms_norm_llama_reference",
    "add_rms_norm_reference",
    "build_fused_norms",
    "gated_rms_norm_emulated",
    "gated_rms_norm_reference",
    "narrow_linear_emulated",
    "narrow_linear_reference",
    "silu_mul_emulated",
    "silu_mul_reference",
]

ADD_THREADS = 512  # kAddThreads in fused_norms.cuh
LIN_THREADS = 512  # kLinThreads in fused_norms.cuh


class FusedNormsError(ValueError):
    """The fused norms cannot be built for this target."""


# --------------------------------------------------------------------------------------------
# Oracles (the torch paths of StaticHybridExecutor) and CPU models of the kernels.


def add_rms_norm_reference(h: Any, d: Any, w1p: Any, eps: float) -> tuple[Any, Any]:
    """The torch path: ``h_out = h + d`` (model dtype), ``x_out = (F.rms_norm(h_out.float()) * w1p)``
    cast to the model dtype. h, d [rows, hidden] (one dtype), w1p [hidden] float32. Returns
    (h_out, x_out), both [rows, hidden] in h's dtype."""
    import torch.nn.functional as F

    h_out = h + d
    y = F.rms_norm(h_out.float(), (h_out.shape[-1],), eps=eps)
    return h_out, (y * w1p).to(h.dtype)


def add_rms_norm_llama_reference(h: Any, d: Any, w: Any, eps: float) -> tuple[Any, Any]:
    """The torch path of `StaticLlamaExecutor` (HF LlamaRMSNorm after the residual add): ``h_out = h +
    d`` (model dtype), ``x_out = w * F.rms_norm(h_out.float()).to(dtype)``. h, d [rows, hidden] (one
    dtype), w [hidden] in h's dtype. Returns (h_out, x_out), both [rows, hidden] in h's dtype."""
    import torch.nn.functional as F

    h_out = h + d
    return h_out, w * F.rms_norm(h_out.float(), (h_out.shape[-1],), eps=eps).to(h.dtype)


def gated_rms_norm_reference(x: Any, z: Any, w: Any, eps: float) -> Any:
    """The torch path (``StaticHybridExecutor._gdn_output``'s norm): x [rows, heads, dim] float32 or
    z's dtype, z [rows, heads, dim], w [dim] in z's dtype. Returns [rows, heads * dim] in z's dtype."""
    import torch.nn.functional as F

    rows, heads, dim = x.shape
    y = F.rms_norm(x.float(), (dim,), eps=eps).to(z.dtype)
    return ((w * y) * F.silu(z.float())).to(z.dtype).reshape(rows, heads * dim)


def _fma(x: Any, y: Any, z: Any) -> Any:
    """A float32 fused multiply-add, emulated: the product exact in float64, the sum rounded to float64
    and then to float32 (twice: rarely one float32 step from a hardware FMA's single rounding)."""
    return (x.double() * y.double() + z.double()).float()


def _strided_sum_sq(v: Any, threads: int) -> Any:
    """[..., n] float32 -> [..., threads]: thread t's FMA chain over elements t, t + threads, ..."""
    import torch

    n = v.shape[-1]
    padded = torch.zeros(*v.shape[:-1], -(-n // threads) * threads, dtype=torch.float32)
    padded[..., :n] = v
    acc = torch.zeros(*v.shape[:-1], threads, dtype=torch.float32)
    for m in range(padded.shape[-1] // threads):
        seg = padded[..., m * threads : (m + 1) * threads]
        acc = _fma(seg, seg, acc)
    return acc


def _warp_tree(acc: Any) -> Any:
    """[..., 32k] -> [..., k]: each warp's xor-shuffle tree (all lanes end equal; lane 0 returned)."""
    import torch

    w = acc.reshape(*acc.shape[:-1], -1, 32)
    width = 16
    while width:
        w = w + w[..., torch.arange(32) ^ width]
        width //= 2
    return w[..., 0]


def _round(v: Any, dtype: Any) -> Any:
    return v.to(dtype).float()


def add_rms_norm_emulated(h: Any, d: Any, w1p: Any, eps: float) -> tuple[Any, Any]:
    """CPU model of ``add_rms_norm`` (float32 torch, the kernel's order of operations): the add
    rounded to h's dtype; per row ADD_THREADS strided FMA chains of squares, warp xor trees, the warp
    sums added in warp order; ``x = round((h_out * rsqrt(sum / hidden + eps)) * w1p)``. Same
    arguments and returns as :func:`add_rms_norm_reference`."""
    h_out, v, r = _add_and_rsqrt_emulated(h, d, eps)
    return h_out, ((v * r[:, None]) * w1p.float()).to(h.dtype)


def _add_and_rsqrt_emulated(h: Any, d: Any, eps: float) -> tuple[Any, Any, Any]:
    """The add and the row's 1/rms of the add_rms_norm kernel, in its order of operations: h_out =
    round(h + d) in h's dtype, v = float32(h_out) [rows, hidden], r = rsqrt(sum of squares / hidden +
    eps) [rows] float32 (ADD_THREADS strided FMA chains, warp xor trees, warp sums in warp order)."""
    import torch

    h_out = (h.float() + d.float()).to(h.dtype)
    v = h_out.float()
    warps = _warp_tree(_strided_sum_sq(v, ADD_THREADS))
    total = torch.zeros(v.shape[0], dtype=torch.float32)
    for w in range(warps.shape[-1]):
        total = total + warps[:, w]
    return h_out, v, torch.rsqrt(total / v.shape[-1] + torch.tensor(eps, dtype=torch.float32))


def add_rms_norm_llama_emulated(h: Any, d: Any, w: Any, eps: float) -> tuple[Any, Any]:
    """CPU model of ``add_rms_norm_llama``: the sum of squares as :func:`add_rms_norm_emulated`
    (the same kernel), then ``x = round(w * round(h_out * rsqrt(sum / hidden + eps)))``. Same
    arguments and returns as :func:`add_rms_norm_llama_reference`."""
    h_out, v, r = _add_and_rsqrt_emulated(h, d, eps)
    return h_out, (w.float() * _round(v * r[:, None], h.dtype)).to(h.dtype)


def gated_rms_norm_emulated(x: Any, z: Any, w: Any, eps: float) -> Any:
    """CPU model of ``gated_rms_norm``: per (row, head) one warp's 32 strided FMA chains and xor
    tree; ``y = round(x * r)``, ``round(round(w * y) * z / (1 + exp(-z)))``. Same arguments and
    return as :func:`gated_rms_norm_reference`."""
    import torch

    rows, heads, dim = x.shape
    dtype = z.dtype
    v = x.float()
    total = _warp_tree(_strided_sum_sq(v, 32))[..., 0]  # [rows, heads]
    r = torch.rsqrt(total / dim + torch.tensor(eps, dtype=torch.float32))
    y = _round(v * r[..., None], dtype)
    wy = _round(w.float() * y, dtype)
    zf = z.float()
    return (wy * (zf / (1.0 + torch.exp(-zf)))).to(dtype).reshape(rows, heads * dim)


def silu_mul_reference(gu: Any) -> Any:
    """The torch path (``swiglu_mlp``): ``F.silu(gate) * up`` with ``gate, up = gu.chunk(2, -1)``.
    gu [rows, 2 I] float32 / bfloat16 / float16. Returns [rows, I] in gu's dtype."""
    import torch.nn.functional as F

    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_emulated(gu: Any) -> Any:
    """CPU model of ``silu_mul``: ``round(round(g / (1 + exp(-g))) * u)`` in float32 (the kernel's
    formula; equal to :func:`silu_mul_reference` up to the CPU's and CUDA's exp). Same arguments and
    return as :func:`silu_mul_reference`."""
    import torch

    dtype = gu.dtype
    inter = gu.shape[-1] // 2
    g, u = gu[..., :inter].float(), gu[..., inter:].float()
    s = _round(g / (1.0 + torch.exp(-g)), dtype)
    return (s * u).to(dtype)


def narrow_linear_reference(x: Any, w: Any) -> Any:
    """The torch path: ``F.linear(x, w)``. x [rows, K], w [N, K], one dtype. Returns [rows, N]."""
    import torch.nn.functional as F

    return F.linear(x, w)


def narrow_linear_emulated(x: Any, w: Any) -> Any:
    """CPU model of ``narrow_linear`` (float32 torch, the kernel's order): per (row, n) LIN_THREADS
    FMA chains, thread t over the 16-byte chunks t, t + LIN_THREADS, .. of the K dim (elements in
    order within a chunk), warp xor trees, the warp sums added in warp order. Same arguments and
    return as :func:`narrow_linear_reference`."""
    import torch

    dtype = x.dtype
    rows, k = x.shape
    n = w.shape[0]
    per = 16 // x.element_size()  # elements a chunk
    chunks = k // per
    xf = x.float().reshape(rows, 1, chunks, per)
    wf = w.float().reshape(1, n, chunks, per)
    steps = -(-chunks // LIN_THREADS)
    acc = torch.zeros(rows, n, LIN_THREADS, dtype=torch.float32)
    for j in range(steps):
        lo, hi = j * LIN_THREADS, min(chunks, (j + 1) * LIN_THREADS)
        for e in range(per):
            xe = xf[:, :, lo:hi, e].expand(rows, n, hi - lo)
            we = wf[:, :, lo:hi, e].expand(rows, n, hi - lo)
            acc[..., : hi - lo] = _fma(xe, we, acc[..., : hi - lo])
    warps = _warp_tree(acc)
    total = torch.zeros(rows, n, dtype=torch.float32)
    for q in range(warps.shape[-1]):
        total = total + warps[..., q]
    return total.to(dtype)


# --------------------------------------------------------------------------------------------
# Building the module.


def build_fused_norms(
    target: Any,
    *,
    out_path: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> Path:
    """Compile the fused norms for a CUDA arch and return the exported ``.so`` path.

    Args:
        target: ``"sm_90"``, ``"sm_120"``... or ``{"kind": "cuda", "arch": "sm_90"}``.
        out_path: where to write it; default a cache file keyed by arch and sources
            (``$IGNIS_CACHE_DIR/fused_norms/``), reused when present.
        verbose: print ptxas' register and shared-memory report.

    Returns:
        The library, exporting :data:`FUNCTION_NAMES` (module docstring), SASS for that arch only.

    Raises:
        FusedNormsError: not a CUDA target, nvcc missing, or nvcc failed (its stderr included).
    """
    from .cuda_build import build_kernel_library

    return build_kernel_library(
        "fused_norms", target, error=FusedNormsError, out_path=out_path, verbose=verbose
    )
