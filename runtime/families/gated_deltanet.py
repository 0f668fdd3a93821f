"""Gated DeltaNet token mixing: causal depthwise conv1d, the gated delta rule (recurrent and chunked).

Source: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (ICLR 2025,
arXiv:2412.06464), eq. (10): ``S_t = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T``,
``o_t = S_t q_t``; the chunked form uses the WY / UT-transform representation of Yang et al.,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length" (NeurIPS 2024, §3).
The HF reference is `transformers.models.qwen3_5.modeling_qwen3_5` (`torch_recurrent_gated_delta_rule`,
`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`); this module is an independent implementation
checked against it by the tests.

State layout follows HF (and the FLA kernels): the recurrent state of one head is ``S`` with shape
[k_head_dim, v_head_dim] (the transpose of the paper's), so a read is ``k^T S`` and a write adds
``k (x) delta``. With ``alpha_t = exp(g_t)`` (``g_t <= 0``, log space) one step is::

    S'      = exp(g_t) * S_{t-1}
    delta_t = beta_t * (v_t - S'^T k_t)
    S_t     = S' + k_t delta_t^T
    o_t     = S_t^T q_t

Every function here works on one lane (no batch dimension) with the heads batched; the recurrence
math is done in float32 whatever the model dtype.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

__all__ = [
    "GDN_CHUNK_SIZE",
    "causal_conv1d_silu",
    "gated_delta_prefill",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_rms_norm_lean",
    "l2_normalize",
]

GDN_CHUNK_SIZE = 64
"""Chunk length of the chunked (prefill) algorithm, as in HF and FLA."""


def causal_conv1d_silu(x_ext: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv1d followed by SiLU over a window that already holds the conv state.

    Args:
        x_ext: [channels, kernel - 1 + n], model dtype: the layer's conv state (the previous
            kernel - 1 input columns, zeros for a fresh lane) followed by the n new input columns.
        weight: [channels, kernel], model dtype (HF's `conv1d.weight` [channels, 1, kernel] squeezed).

    Returns:
        [channels, n] in the model dtype: ``silu(sum_t weight[:, t] * x_ext[:, j + t])`` for column j,
        i.e. HF's `causal_conv1d_fn` / `causal_conv1d_update` (no bias: the checkpoints have none).
    """
    channels = weight.shape[0]
    out = F.conv1d(x_ext.unsqueeze(0), weight.unsqueeze(1), None, padding=0, groups=channels)
    return F.silu(out.squeeze(0))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA / HF `l2norm` convention, eps inside)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_rms_norm_lean(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """The GDN output norm ``weight * rmsnorm(x) * silu(gate)`` over the last dim in five passes.

    HF's `Qwen3_5RMSNormGated` with its casts: the norm in float32 rounded to x's dtype (torch's
    fused ``rms_norm``, float32 inside), times the weight (in place when it has x's dtype), times
    ``silu(gate)`` taken in float32, the product rounded once into x's dtype (in place). Same values
    as `hybrid_executor.gated_rms_norm` up to the float32 rounding of the norm's reduction.

    Args:
        x: [..., dim], the model dtype (the rule's output rounded as HF rounds it).
        gate: [..., dim], any float dtype and strides. weight: [dim].

    Returns:
        [..., dim] in x's dtype, a new tensor.
    """
    dtype = x.dtype
    y = F.rms_norm(x, (x.shape[-1],), eps=eps)
    y = y.mul_(weight) if weight.dtype == dtype else weight * y
    sg = gate.to(torch.float32, copy=True)
    F.silu(sg, inplace=True)
    return torch.mul(y, sg, out=y) if y.dtype == dtype else (y * sg).to(dtype)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    record: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time (decode and verify rounds).

    Args:
        q: [n, heads, k_dim] float32, l2-normalized and already scaled by k_dim ** -0.5.
        k: [n, heads, k_dim] float32, l2-normalized.
        v: [n, heads, v_dim] float32.
        g: [n, heads] float32 log decay (<= 0).
        beta: [n, heads] float32 write strength in (0, 1).
        state: [heads, k_dim, v_dim] float32, the state before the first token (not modified).
        record: keep the state after every token instead of only the last.

    Returns:
        (out [n, heads, v_dim] float32, states) where states is [n, heads, k_dim, v_dim] (the state
        after token t at index t) when `record`, else the final state [heads, k_dim, v_dim].
    """
    n = q.shape[0]
    out = q.new_empty(v.shape)
    states = q.new_empty((n, *state.shape)) if record else None
    s = state
    alpha = g.exp()
    for t in range(n):
        s = s * alpha[t, :, None, None]
        read = torch.bmm(k[t].unsqueeze(1), s).squeeze(1)  # [heads, v_dim] = k^T S
        delta = (v[t] - read) * beta[t, :, None]
        s = s + k[t].unsqueeze(2) * delta.unsqueeze(1)
        out[t] = torch.bmm(q[t].unsqueeze(1), s).squeeze(1)
        if states is not None:
            states[t] = s
    return out, (states if states is not None else s)


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    chunk_size: int = GDN_CHUNK_SIZE,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over whole chunks (prefill): same result as the recurrent form.

    Inside a chunk of length L with start state S_0 and cumulative log decay
    ``c_t = g_1 + ... + g_t``, unrolling the recurrence gives the written values
    ``u_t = delta_t`` as the solution of the unit lower-triangular system (WY / UT transform)::

        u_t + sum_{s<t} beta_t exp(c_t - c_s) (k_t . k_s) u_s = beta_t v_t - beta_t exp(c_t) S_0^T k_t

    i.e. ``u = W_v - W_k S_0`` with ``[W_v | W_k]`` the solution for the right-hand sides
    ``[beta_t v_t | beta_t exp(c_t) k_t]``; then ``o_t = exp(c_t) S_0^T q_t + sum_{s<=t} exp(c_t - c_s)
    (q_t . k_s) u_s`` and ``S_L = B + (exp(c_L) I - P) S_0`` with ``B = K_end^T W_v``,
    ``P = K_end^T W_k``, ``K_end[s] = exp(c_L - c_s) k_s`` (as FLA's `chunk_gated_delta_rule`). Every
    exponent is <= 0, so nothing overflows. Everything but the state hand-over runs for all chunks
    at once (`_chunked_rule`).

    Args:
        q: [n, key_heads, k_dim] float32, l2-normalized and already scaled by k_dim ** -0.5;
            key_heads divides heads and value head h reads key head h // (heads // key_heads)
            (GQA-style sharing, HF's ``repeat_interleave``), key_heads == heads included.
        k: [n, key_heads, k_dim] float32, l2-normalized.
        v, g, beta, state: as `gated_delta_rule_recurrent` (v [n, heads, v_dim] any float dtype).
        chunk_size: tokens per chunk (64, as HF / FLA).
        out: [n, heads, v_dim] of any float dtype and strides to write the output into (cast there,
            in the one copy out of the chunk-major layout), or None for a new float32 tensor.

    Returns:
        (out [n, heads, v_dim]: `out`, or float32, final state [heads, k_dim, v_dim] float32, a
        tensor of its own, not a view of the call's temporaries).
    """
    n = k.shape[0]
    num = -(-n // chunk_size)
    qk = _chunk_major(torch.stack((q, k), dim=1), num, chunk_size)
    chunked, final = _chunked_rule(qk, v, g, beta, state, n, q_log_scale=0.0)
    return _store_token_major(chunked, n, out), final


def gated_delta_prefill(
    qk: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    eps: float = 1e-6,
    chunk_size: int = GDN_CHUNK_SIZE,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One lane's Gated DeltaNet prefill from the conv output: l2 norms, q scaling and the chunked rule.

    Equals ``gated_delta_rule_chunked(l2_normalize(q.float()) * k_dim ** -0.5,
    l2_normalize(k.float()), v.float(), g, beta, state)`` up to float32 rounding (HF's
    `torch_chunk_gated_delta_rule` with ``use_qk_l2norm_in_kernel=True``), without materializing
    the normalized, head-repeated or float copies: q and k are copied once into the chunk-major
    float32 buffer and normalized there by one ``rms_norm`` (``l2norm(x) = rms_norm(x, eps / k_dim)
    * k_dim ** -0.5``); q's extra ``k_dim ** -0.5`` is folded into the exponents that multiply q's
    products; v is read where it lies.

    Args:
        qk: [n, 2, key_heads, k_dim] (q then k: the conv output's first 2 * key_heads * k_dim
            channels), any float dtype and strides.
        v: [n, heads, v_dim], any float dtype and strides; key_heads divides heads.
        g: [n, heads] float32 log decay (<= 0); beta: [n, heads] float32 in [0, 1].
        state: [heads, k_dim, v_dim] float32 (not modified).
        eps: the l2 norm's epsilon (inside the square root, as FLA / HF).
        chunk_size: tokens per chunk.
        out: as `gated_delta_rule_chunked`.

    Returns:
        As `gated_delta_rule_chunked`.
    """
    n, _, _, dk = qk.shape
    num = -(-n // chunk_size)
    buf = _chunk_major(qk, num, chunk_size)
    weight = torch.full((dk,), dk**-0.5, dtype=torch.float32, device=buf.device)
    buf = F.rms_norm(buf, (dk,), weight, eps / dk)
    chunked, final = _chunked_rule(buf, v, g, beta, state, n, q_log_scale=-0.5 * math.log(dk))
    return _store_token_major(chunked, n, out), final


def _chunk_major(qk: torch.Tensor, num: int, c: int) -> torch.Tensor:
    """[n, 2, hk, dk] (any dtype, strides) -> a new float32 [num, hk, 2, c, dk] (rows past n zero)."""
    n, two, hk, dk = qk.shape
    if num * c != n:
        qk = F.pad(qk, (0, 0, 0, 0, 0, 0, 0, num * c - n))
    out = torch.empty(num, hk, two, c, dk, dtype=torch.float32, device=qk.device)
    out.copy_(qk.view(num, c, two, hk, dk).permute(0, 3, 2, 1, 4))
    return out


def _chunked_rule(
    qk: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    n: int,
    *,
    q_log_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule on chunk-major inputs (`gated_delta_rule_chunked` has the maths).

    qk: [num, hk, 2, c, dk] float32 contiguous, q (index 0; the rule uses it times
    exp(q_log_scale)) and k (index 1) l2-normalized, rows past n zero; v [n, hv, dv] any float
    dtype, g / beta [n, hv] float32, state [hv, dk, dv] float32. Returns (out [num, hv, c, dv]
    float32 chunk-major, final state [hv, dk, dv] float32).

    Layout: chunk-major ([num, heads, ...]) throughout, so every batched product is one
    bmm over num x heads on views (no copies), and the hand-over's operands for chunk m are
    contiguous slices. Launches: ~30 for all chunks plus one ``baddbmm_`` per chunk for the state
    hand-over ``S_{m+1} = B_m - (P_m - exp(c_L) I) S_m``, written in place into a buffer that
    already holds B_m (no copy, no separate decay multiply). Key heads are shared by broadcasting
    (no repeated copies of q / k): the scores q.k and k.k are computed per key head and the
    per-value-head decays multiply them. Every in-place product writes a contiguous tensor (a
    strided one costs a per-batch loop on the CPU).
    """
    num, hk, _, c, dk = qk.shape
    hv, dv = v.shape[1], v.shape[2]
    if hv % hk:
        raise ValueError(f"{hv} value heads do not share {hk} key heads evenly")
    rep = hv // hk
    big = num * c
    dev = qk.device
    if big != n:  # padded tokens: zero v, beta and log decay write nothing and keep the state
        v = F.pad(v, (0, 0, 0, 0, 0, big - n))
        g, beta = (F.pad(x, (0, 0, 0, big - n)) for x in (g, beta))
    cum = g.view(num, c, hv).transpose(1, 2).cumsum(-1).contiguous()  # [num, hv, c]
    bt = beta.view(num, c, hv).transpose(1, 2)  # [num, hv, c]
    # row terms of the decays: [num, hv, 2, c] = (c_t + log q_scale, c_t + log beta_t), and their
    # exponentials (q_scale exp(c_t) for the outputs, beta_t exp(c_t) for the right-hand side)
    rows = torch.empty(num, hv, 2, c, dtype=torch.float32, device=dev)
    torch.add(cum, q_log_scale, out=rows[:, :, 0])
    torch.add(cum, bt.log(), out=rows[:, :, 1])
    rows_exp = rows.exp()
    # e[0] = exp(c_i - c_j) q_scale (j <= i), the scores' decay; e[1] = beta_i exp(c_i - c_j) (the
    # system, strictly lower part read); both 0 above the diagonal
    e = torch.empty(2, num, hv, c, c, dtype=torch.float32, device=dev)
    torch.sub(rows.unsqueeze(-1), cum[:, :, None, None, :], out=e.permute(1, 2, 0, 3, 4))
    e.masked_fill_(_above_diagonal(c, dev), float("-inf")).exp_()
    # [q; k] k^T per key head and chunk, times the decays (broadcast over the rep value heads)
    k3 = qk[:, :, 1].view(num * hk, c, dk)
    scores = torch.bmm(qk.view(num * hk, 2 * c, dk), k3.transpose(1, 2)).view(num, hk, 1, 2, c, c)
    e6 = e.view(2, num, hk, rep, c, c).permute(1, 2, 3, 0, 4, 5)
    torch.mul(e6, scores, out=e6)
    del scores
    # right-hand sides [beta v | beta exp(c) k], solved in place: [W_v | W_k]
    rhs = torch.empty(num, hv, c, dv + dk, dtype=torch.float32, device=dev)
    torch.mul(bt.unsqueeze(-1), v.view(num, c, hv, dv).transpose(1, 2), out=rhs[..., :dv])
    k5 = qk[:, :, 1].unsqueeze(2)  # [num, hk, 1, c, dk]
    fk = rows_exp[:, :, 1].view(num, hk, rep, c, 1)  # beta_t exp(c_t)
    torch.mul(fk, k5, out=rhs[..., dv:].view(num, hk, rep, c, dk))
    torch.linalg.solve_triangular(e[1], rhs, upper=False, unitriangular=True, out=rhs)
    rhs3 = rhs.view(num * hv, c, dv + dk)
    w_v, w_k = rhs3[..., :dv], rhs3[..., dv:]
    # the hand-over: s_all[m + 1] = B_m, then S_{m+1} = B_m - (P_m - exp(c_L) I) S_m in place
    fe = (cum[..., -1:] - cum).exp().view(num, hk, rep, c, 1)
    k_end_t = torch.mul(fe, k5).view(num * hv, c, dk).transpose(1, 2)  # exp(c_L - c_s) k_s, [.., dk, c]
    s_all = torch.empty(num + 1, hv, dk, dv, dtype=torch.float32, device=dev)
    torch.bmm(k_end_t, w_v, out=s_all[1:].view(num * hv, dk, dv))
    p = torch.bmm(k_end_t, w_k).view(num, hv, dk, dk)
    del k_end_t
    p.diagonal(dim1=-2, dim2=-1).sub_(cum[..., -1:].exp())
    s_all[0].copy_(state)
    for m in range(num):
        s_all[m + 1].baddbmm_(p[m], s_all[m], alpha=-1.0)
    del p
    final = s_all[num].clone()  # its own memory: the buffer goes with this call
    starts = s_all[:num].view(num * hv, dk, dv)  # the state entering each chunk
    # out = exp(c_t) q_t S + A (W_v - W_k S) = (exp(c_t) q_t - A W_k) S + A W_v with A the decayed
    # causal scores e[0]: no u materialized, every in-place product on a contiguous buffer
    a_sc = e[0].view(num * hv, c, c)
    qd = torch.mul(rows_exp[:, :, 0].view(num, hk, rep, c, 1), qk[:, :, 0].unsqueeze(2))
    qd = qd.view(num * hv, c, dk).baddbmm_(a_sc, w_k, alpha=-1.0)
    out = torch.bmm(qd, starts).baddbmm_(a_sc, w_v)
    return out.view(num, hv, c, dv), final


@functools.lru_cache(maxsize=8)
def _above_diagonal(c: int, device: torch.device) -> torch.Tensor:
    """[c, c] bool, True above the diagonal (j > i): the entries a causal chunk never reads."""
    return torch.ones(c, c, dtype=torch.bool, device=device).triu_(1)


def _store_token_major(chunked: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """Write the first n tokens of chunked [num, hv, c, dv] (token m * c + i) into out [n, hv, dv] (any
    float dtype and strides: the cast happens in the copy) or, with out None, a new float32 tensor."""
    _, hv, c, dv = chunked.shape
    if out is None:
        out = chunked.new_empty(n, hv, dv)
    full, rest = divmod(n, c)
    src = chunked.transpose(1, 2)  # [num, c, hv, dv]
    if full:
        out[: full * c].view(full, c, hv, dv).copy_(src[:full])
    if rest:
        out[full * c :].copy_(src[full, :rest])
    return out
