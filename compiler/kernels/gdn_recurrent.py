"""Fused Gated DeltaNet recurrence for verify rounds, as a CUDA kernel exported through tvm-ffi.

One launch runs every column of a round for every lane and value head: per (lane, value head, tile
of 32 value columns) one block keeps its float32 state slice in registers across the columns and,
per column t, folds in the preparation the torch path does around `gated_delta_rule_recurrent`
(``StaticHybridExecutor._static_gdn``):

* q, k: l2-normalized per key head in float32 (``x * rsqrt(sum x^2 + 1e-6)``), q times
  ``k_dim ** -0.5``; value head h reads key head ``h // (v_heads // k_heads)`` (the GQA repeat,
  no copy);
* ``beta = sigmoid(b)`` (float32, rounded to the input dtype as torch's sigmoid of a bf16 tensor
  is), ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32, softplus threshold 20);
* the gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025,
  arXiv:2412.06464, eq. 10; the state layout of HF / FLA, S [k_dim, v_dim])::

      S' = exp(g_t) S;  delta = beta_t (v_t - S'^T k_t);  S_t = S' + k_t delta^T;  o_t = S_t^T q_t

  writing S_t into the round's record buffer (``record[t, lane]``, the layout
  `StaticHybridExecutor.commit` reads) and o_t into ``out``.

FLA's ``fused_recurrent_gated_delta_rule`` (Triton) is the public kernel of this kind; this one is
written from the equations above. ``gdn_recurrent.cuh`` holds the kernel, ``gdn_recurrent_ffi.cuh``
the exported function and its checks; :func:`gdn_recurrent_reference` is the torch path (the
oracle) and :func:`gdn_recurrent_emulated` a CPU model of the kernel (same blocking and reduction
order), tested against it.

:func:`build_gdn_recurrent` returns an exported ``.so`` (nvcc, SASS for one arch, no PTX) holding
``gdn_recurrent(mixed, b, a, neg_a, dt_bias, state, slots, record, out, num_key_heads, scale)``
(:data:`FUNCTION_NAME`):

* ``mixed``: [L, n, conv_dim] float32 / bfloat16 / float16, any strides: the conv + SiLU output,
  channels ``q (k_heads * k_dim) | k (k_heads * k_dim) | v (v_heads * v_dim)``;
* ``b``, ``a``: [L, n, v_heads] in mixed's dtype, any strides (the in_proj_b / in_proj_a outputs);
* ``neg_a`` (``-exp(A_log)``), ``dt_bias``: [v_heads] float32;
* ``state``: [S, v_heads, k_dim, v_dim] float32, read only; ``slots``: [L] int64 (lane l starts
  from ``state[slots[l]]``);
* ``record``: [>= n, >= L, v_heads, k_dim, v_dim] float32, written for t < n, l < L;
* ``out``: [L, n, v_heads, v_dim] contiguous, float32 or mixed's dtype (rounded once), written;
* ``num_key_heads`` (int), ``scale`` (float, ``k_dim ** -0.5``).

Limits: k_dim <= :data:`MAX_KEY_DIM`; v_heads a multiple of num_key_heads. It launches on the stream
tvm-ffi reports (torch's current stream under ``tvm_ffi.use_torch_stream()``), allocates nothing, so
it can be captured in a CUDA graph. Wrong shapes, dtypes or devices raise ``ValueError`` /
``TypeError`` from the module. The caller is ``ignis.runtime.kernels.gdn_recurrent.GdnRecurrentKernel``
for ``ignis.runtime.families.hybrid_graphs`` (``StaticHybridExecutor(gdn_module=...)``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ignis.runtime.kernels.gdn_recurrent import (
    FUNCTION_NAME,
    FUNCTION_NAMES,
    MAX_KEY_DIM,
    REPLAY_FUNCTION_NAME,
    STASH_FUNCTION_NAME,
    gdn_stash_width,
)

__all__ = [
    "CHUNK",
    "COLS",
    "FUNCTION_NAME",
    "FUNCTION_NAMES",
    "MAX_KEY_DIM",
    "REPLAY_FUNCTION_NAME",
    "STASH_FUNCTION_NAME",
    "WARPS",
    "GdnKernelError",
    "build_gdn_recurrent",
    "gdn_recurrent_emulated",
    "gdn_recurrent_reference",
    "gdn_replay_emulated",
    "gdn_stash_emulated",
    "rows_per_thread",
]

"""Every export of the module, in the order the build's manifest lists them."""
WARPS = 8  # kWarps in gdn_recurrent.cuh
COLS = 32  # kCols: value columns per block
CHUNK = 16  # kChunk: round columns staged in shared memory at a time
L2_EPS = 1e-6


class GdnKernelError(ValueError):
    """The GDN kernel cannot be built for this target, or a shape is outside its limits."""


def rows_per_thread(k_dim: int) -> int:
    """R, the key rows each thread keeps (the kernel instance the host side picks for ``k_dim``).

    Raises:
        GdnKernelError: k_dim outside 1..MAX_KEY_DIM.
    """
    if not 1 <= k_dim <= MAX_KEY_DIM:
        raise GdnKernelError(f"k_dim must be 1..{MAX_KEY_DIM}, got {k_dim}")
    for r in (2, 4, 8, 16, 32):
        if k_dim <= WARPS * r:
            return r
    raise AssertionError("unreachable")


def _check(mixed: Any, b: Any, state: Any, slots: Any, num_key_heads: int) -> tuple[int, ...]:
    lanes, n, conv_dim = mixed.shape
    _, hv, dk, dv = state.shape
    if hv % num_key_heads or conv_dim != 2 * num_key_heads * dk + hv * dv:
        raise GdnKernelError(
            f"mixed has {conv_dim} channels and state {tuple(state.shape)}: need v_heads a multiple of "
            f"num_key_heads={num_key_heads} and conv_dim = 2 * k_heads * k_dim + v_heads * v_dim"
        )
    if tuple(b.shape) != (lanes, n, hv) or tuple(slots.shape) != (lanes,):
        raise GdnKernelError(f"b must be [{lanes}, {n}, {hv}] and slots [{lanes}]")
    rows_per_thread(dk)
    return lanes, n, hv, dk, dv


def _prepare(
    mixed: Any, b: Any, a: Any, neg_a: Any, dt_bias: Any, num_key_heads: int, dk: int, dv: int
) -> tuple[Any, ...]:
    """Torch's preparation (as `StaticHybridExecutor._static_gdn`): q, k [L, n, hv, dk] (normalized,
    repeated, q scaled), v [L, n, hv, dv], g, beta [L, n, hv], all float32."""
    import torch.nn.functional as F

    from ignis.runtime.families.gated_deltanet import l2_normalize

    lanes, n, _ = mixed.shape
    hk = num_key_heads
    hv = b.shape[-1]
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q = l2_normalize(q.float().reshape(lanes, n, hk, dk))
    k = l2_normalize(k.float().reshape(lanes, n, hk, dk))
    if hv > hk:
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    q = q * dk**-0.5
    v = v.float().reshape(lanes, n, hv, dv)
    beta = b.sigmoid().float()
    g = neg_a.float() * F.softplus(a.float() + dt_bias.float())
    return q, k, v, g, beta


def gdn_recurrent_reference(
    mixed: Any, b: Any, a: Any, neg_a: Any, dt_bias: Any, state: Any, slots: Any, num_key_heads: int
) -> tuple[Any, Any]:
    """The torch path the kernel replaces: preparation + `gated_delta_rule_recurrent` per lane.

    Args: as the module's function (module docstring), torch tensors on any device.

    Returns:
        (out [L, n, v_heads, v_dim] float32, record [n, L, v_heads, k_dim, v_dim] float32: the
        state after column t of lane l at [t, l]).

    Raises:
        GdnKernelError: inconsistent shapes.
    """
    import torch

    from ignis.runtime.families.gated_deltanet import gated_delta_rule_recurrent

    lanes, n, hv, dk, dv = _check(mixed, b, state, slots, num_key_heads)
    q, k, v, g, beta = _prepare(mixed, b, a, neg_a, dt_bias, num_key_heads, dk, dv)
    out = torch.empty(lanes, n, hv, dv, dtype=torch.float32, device=mixed.device)
    record = torch.empty(n, lanes, hv, dk, dv, dtype=torch.float32, device=mixed.device)
    for i in range(lanes):
        o, states = gated_delta_rule_recurrent(
            q[i], k[i], v[i], g[i], beta[i], state[int(slots[i])], record=True
        )
        out[i], record[:, i] = o, states
    return out, record


def _emulated_inputs(
    mixed: Any, b: Any, a: Any, neg_a: Any, dt_bias: Any, num_key_heads: int, dk: int
) -> tuple:
    """The kernel's staged floats of every column, as its CPU model: q (normalized, scaled), k
    (normalized) [L, n, hk, dk], v [L, n, hv, dv], beta and alpha = exp(g) [L, n, hv], float32."""
    import torch

    lanes, n, _ = mixed.shape
    hk, hv = num_key_heads, b.shape[-1]
    dv = (mixed.shape[-1] - 2 * hk * dk) // hv
    pad = WARPS * rows_per_thread(dk)
    f32, f64 = torch.float32, torch.float64
    x = mixed.float()
    q_raw = x[..., : hk * dk].reshape(lanes, n, hk, dk)
    k_raw = x[..., hk * dk : 2 * hk * dk].reshape(lanes, n, hk, dk)
    v = x[..., 2 * hk * dk :].reshape(lanes, n, hv, dv)

    def l2_factor(t: torch.Tensor) -> torch.Tensor:
        """rsqrt(sum of squares + eps): lane l sums elements l, l + 32, ... then an xor tree."""
        tp = torch.zeros(*t.shape[:-1], ((pad + 31) // 32) * 32, dtype=f32)
        tp[..., :dk] = t
        lanes_sum = torch.zeros(*t.shape[:-1], 32, dtype=f32)
        for m in range(tp.shape[-1] // 32):
            seg = tp[..., m * 32 : (m + 1) * 32]
            lanes_sum = (seg.to(f64) * seg.to(f64) + lanes_sum.to(f64)).to(f32)
        width = 16
        while width:
            idx = torch.arange(32) ^ width
            lanes_sum = lanes_sum + lanes_sum[..., idx]
            width //= 2
        return torch.rsqrt(lanes_sum[..., :1] + L2_EPS)

    q = (q_raw * l2_factor(q_raw)) * dk**-0.5
    k = k_raw * l2_factor(k_raw)
    beta = torch.sigmoid(b.float()).to(mixed.dtype).float()
    ax = a.float() + dt_bias.float()
    sp = torch.where(ax > 20, ax, torch.log1p(torch.exp(ax)))
    alpha = torch.exp(neg_a.float() * sp)  # [L, n, hv]
    return q, k, v, beta, alpha


def _emulated_steps(
    s: Any, k: Any, v: Any, beta: Any, alpha: Any, q: Any, dk: int, on_state: Any = None
) -> Any:
    """The kernel's per-column update in its order of operations, from the padded state s [B, hv,
    pad, dv] over the columns of k [B, n, hv, pad] (repeated to the value heads, zero-padded), v
    [B, n, hv, dv], beta, alpha [B, n, hv]; q like k or None (no output). Calls on_state(t, s) after
    column t; returns (out [B, n, hv, dv] or None, s)."""
    import torch

    f32, f64 = torch.float32, torch.float64
    lanes, n, hv, dv = v.shape
    r_rows = s.shape[2] // WARPS

    def fma(x_: torch.Tensor, y_: torch.Tensor, z_: torch.Tensor) -> torch.Tensor:
        return (x_.to(f64) * y_.to(f64) + z_.to(f64)).to(f32)

    def read(st: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        """sum_i st[.., i, j] vec[.., i]: per-warp FMA chains over R rows, then warps in order."""
        total = torch.zeros(lanes, hv, dv, dtype=f32)
        for w in range(WARPS):
            part = torch.zeros(lanes, hv, dv, dtype=f32)
            for r in range(r_rows):
                i = w * r_rows + r
                part = fma(st[:, :, i], vec[:, :, i, None], part)
            total = total + part
        return total

    out = None if q is None else torch.empty(lanes, n, hv, dv, dtype=f32)
    for t in range(n):
        s = s * alpha[:, t, :, None, None]
        kv = read(s, k[:, t])
        delta = (v[:, t] - kv) * beta[:, t, :, None]  # [B, hv, dv]
        s = fma(k[:, t, :, :, None], delta[:, :, None, :], s)
        if on_state is not None:
            on_state(t, s[:, :, :dk])
        if out is not None:
            out[:, t] = read(s, q[:, t])
    return out, s


def _padded(t: Any, rep: int, pad: int) -> Any:
    """[B, n, hk, dk] -> [B, n, hk * rep, pad] (GQA repeat, zero rows up to pad)."""
    import torch

    t = t.repeat_interleave(rep, dim=2)
    out = torch.zeros(*t.shape[:-1], pad, dtype=torch.float32)
    out[..., : t.shape[-1]] = t
    return out


def gdn_recurrent_emulated(
    mixed: Any, b: Any, a: Any, neg_a: Any, dt_bias: Any, state: Any, slots: Any, num_key_heads: int
) -> tuple[Any, Any]:
    """CPU model of the kernel (float32 torch): the same blocking and order of operations.

    Per block: the state's rows split as WARPS groups of R = `rows_per_thread` (k_dim padded with
    zero rows to WARPS * R); a read ``S'^T k`` and ``S_t^T q`` are, per thread, fused multiply-adds
    over its R rows in ascending order (modelled in float64 and rounded once per step: a float32
    FMA), then the WARPS partials summed in warp order; the l2 sums of squares as the kernel's
    32-lane strided sums and xor-shuffle tree. Returns what the kernel writes: (out [L, n, v_heads,
    v_dim] float32, record [n, L, v_heads, k_dim, v_dim] float32).

    Raises:
        GdnKernelError: inconsistent shapes or k_dim above MAX_KEY_DIM.
    """
    import torch

    lanes, n, hv, dk, dv = _check(mixed, b, state, slots, num_key_heads)
    record = torch.empty(n, lanes, hv, dk, dv, dtype=torch.float32)

    def keep(t: int, st: Any) -> None:
        record[t] = st

    out, _ = _emulated_round(mixed, b, a, neg_a, dt_bias, state, slots, num_key_heads, keep)
    return out, record


def _emulated_round(
    mixed: Any,
    b: Any,
    a: Any,
    neg_a: Any,
    dt_bias: Any,
    state: Any,
    slots: Any,
    num_key_heads: int,
    on_state: Any,
) -> tuple[Any, tuple[Any, ...]]:
    """One round of the CPU model from the lanes' states: (out [L, n, hv, dv], the staged floats
    (q, k, v, beta, alpha) of `_emulated_inputs`); on_state(t, state) after every column."""
    import torch

    lanes, _n, hv, dk, dv = _check(mixed, b, state, slots, num_key_heads)
    pad = WARPS * rows_per_thread(dk)
    q, k, v, beta, alpha = _emulated_inputs(mixed, b, a, neg_a, dt_bias, num_key_heads, dk)
    rep = hv // num_key_heads
    s = torch.zeros(lanes, hv, pad, dv, dtype=torch.float32)
    s[:, :, :dk] = state[slots.long()].float()
    out, _ = _emulated_steps(s, _padded(k, rep, pad), v, beta, alpha, _padded(q, rep, pad), dk, on_state)
    return out, (q, k, v, beta, alpha)


def gdn_stash_emulated(
    mixed: Any, b: Any, a: Any, neg_a: Any, dt_bias: Any, state: Any, slots: Any, num_key_heads: int
) -> tuple[Any, Any]:
    """CPU model of ``gdn_recurrent_stash``: (out [L, n, v_heads, v_dim] float32 as
    `gdn_recurrent_emulated`, stash [n, L, W] float32: per column and lane the normalized k of
    every key head, v, beta and alpha of every value head, W = hk * k_dim + hv * v_dim + 2 * hv).

    Raises:
        GdnKernelError: inconsistent shapes or k_dim above MAX_KEY_DIM.
    """
    import torch

    lanes, n = mixed.shape[:2]
    out, (_q, k, v, beta, alpha) = _emulated_round(
        mixed, b, a, neg_a, dt_bias, state, slots, num_key_heads, None
    )
    stash = torch.cat([k.reshape(lanes, n, -1), v.reshape(lanes, n, -1), beta, alpha], dim=-1).transpose(0, 1)
    return out, stash.contiguous()


def gdn_replay_emulated(stash: Any, state: Any, slots: Any, keep: Any, pos: Any, num_key_heads: int) -> None:
    """CPU model of ``gdn_replay``: for every layer g and lane i, the first keep[i] columns (clamped
    to the stash's) of stash[g, :, pos[i]] run from state[g, slots[i]], the state after the last
    written back in place; keep <= 0, or a slot or pos outside, leaves the lane. stash [G, C, Ls, W],
    state [G, S, hv, dk, dv] float32, slots / keep / pos [m] int64.

    Raises:
        GdnKernelError: a stash row width that does not match the state's heads.
    """
    import torch

    g_layers, num_slots, hv, dk, dv = state.shape
    hk = num_key_heads
    if stash.shape[-1] != gdn_stash_width(hk, hv, dk, dv) or hv % hk:
        raise GdnKernelError(
            f"stash rows of {stash.shape[-1]} floats do not match state {tuple(state.shape)}"
        )
    pad = WARPS * rows_per_thread(dk)
    cols, stash_lanes = stash.shape[1], stash.shape[2]
    for i in range(slots.shape[0]):
        slot, n, p = int(slots[i]), min(int(keep[i]), cols), int(pos[i])
        if n <= 0 or not 0 <= slot < num_slots or not 0 <= p < stash_lanes:
            continue
        rows = stash[:, :n, p].float()  # [G, n, W]
        k = rows[..., : hk * dk].reshape(g_layers, n, hk, dk)
        v = rows[..., hk * dk : hk * dk + hv * dv].reshape(g_layers, n, hv, dv)
        beta = rows[..., hk * dk + hv * dv : hk * dk + hv * dv + hv]
        alpha = rows[..., hk * dk + hv * dv + hv :]
        s = torch.zeros(g_layers, hv, pad, dv, dtype=torch.float32)
        s[:, :, :dk] = state[:, slot].float()
        _, s = _emulated_steps(s, _padded(k, hv // hk, pad), v, beta, alpha, None, dk)
        state[:, slot] = s[:, :, :dk]


# --------------------------------------------------------------------------------------------
# Building the module.


def build_gdn_recurrent(
    target: Any,
    *,
    out_path: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> Path:
    """Compile the fused GDN recurrence for a CUDA arch and return the exported ``.so`` path.

    Args:
        target: ``"sm_90"``, ``"sm_120"``... or ``{"kind": "cuda", "arch": "sm_90"}``.
        out_path: where to write it; default a cache file keyed by arch and sources
            (``$IGNIS_CACHE_DIR/gdn_recurrent/``), reused when present.
        verbose: print ptxas' register and shared-memory report.

    Returns:
        The library, exporting ``gdn_recurrent(...)`` (module docstring), SASS for that arch only.

    Raises:
        GdnKernelError: not a CUDA target, nvcc missing, or nvcc failed (its stderr included).
    """
    from .cuda_build import build_kernel_library

    return build_kernel_library(
        "gdn_recurrent", target, error=GdnKernelError, out_path=out_path, verbose=verbose
    )
