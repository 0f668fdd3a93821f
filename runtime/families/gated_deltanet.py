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

import torch
import torch.nn.functional as F

__all__ = [
    "GDN_CHUNK_SIZE",
    "causal_conv1d_silu",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over whole chunks (prefill): same result as the recurrent form.

    Inside a chunk of length L with start state S_0 and cumulative log decay
    ``c_t = g_1 + ... + g_t``, unrolling the recurrence gives the written values
    ``u_t = delta_t`` as the solution of the unit lower-triangular system (WY / UT transform)::

        u_t + sum_{s<t} beta_t exp(c_t - c_s) (k_t . k_s) u_s = beta_t v_t - beta_t exp(c_t) S_0^T k_t

    and then ``o_t = exp(c_t) S_0^T q_t + sum_{s<=t} exp(c_t - c_s) (q_t . k_s) u_s`` and
    ``S_L = exp(c_L) S_0 + sum_s exp(c_L - c_s) k_s u_s^T``. Every exponent is <= 0, so nothing
    overflows.

    Everything that does not depend on S_0 (the triangular solves, the intra-chunk scores, the
    decays) runs for all chunks at once (batched over heads x chunks); only the state hand-over
    ``u = W_v - W_k S``, ``S' = exp(c_L) S + K_end^T u`` walks the chunks in order (two batched
    matmuls a chunk), and the outputs of every chunk are one batched product at the end. A last
    chunk shorter than `chunk_size` is padded with tokens of zero k, v, q, beta and log decay, which
    write nothing, read nothing and leave the state as it is.

    Args:
        q, k, v, g, beta, state: as `gated_delta_rule_recurrent`.
        chunk_size: tokens per chunk (64, as HF / FLA).

    Returns:
        (out [n, heads, v_dim] float32, final state [heads, k_dim, v_dim] float32).
    """
    n, heads, k_dim = q.shape
    v_dim = v.shape[-1]
    num = -(-n // chunk_size)
    pad = num * chunk_size - n
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    c = chunk_size
    # [heads, chunks, c, dim] / [heads, chunks, c] layouts for products batched over heads x chunks.
    qc, kc, vc = (x.reshape(num, c, heads, -1).permute(2, 0, 1, 3).contiguous() for x in (q, k, v))
    bc = beta.reshape(num, c, heads).permute(2, 0, 1)
    cum = g.reshape(num, c, heads).permute(2, 0, 1).cumsum(dim=-1)  # [heads, chunks, c]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # decay[h, m, i, j] = exp(c_i - c_j) for j <= i, else 0.
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    system = (bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([bc.unsqueeze(-1) * vc, (bc * cum.exp()).unsqueeze(-1) * kc], dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w_v, w_k = sol[..., :v_dim], sol[..., v_dim:]  # [heads, chunks, c, v_dim] / [.., k_dim]
    k_end = kc * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # [heads, chunks, c, k_dim]
    # chunk-major copies, so each step reads and writes contiguous [heads, ...] slices in place
    k_end_t = k_end.transpose(-1, -2).transpose(0, 1).contiguous()  # [chunks, heads, k_dim, c]
    w_v_m, w_k_m = w_v.transpose(0, 1).contiguous(), w_k.transpose(0, 1).contiguous()
    chunk_decay = cum[..., -1].exp().transpose(0, 1)[..., None, None].contiguous()  # [chunks, heads, 1, 1]
    u = torch.empty_like(w_v_m)  # [chunks, heads, c, v_dim]
    starts = q.new_empty(num + 1, heads, k_dim, v_dim)  # the state entering each chunk, then the last
    starts[0] = state
    for m in range(num):
        torch.baddbmm(w_v_m[m], w_k_m[m], starts[m], alpha=-1.0, out=u[m])
        torch.baddbmm(starts[m] * chunk_decay[m], k_end_t[m], u[m], out=starts[m + 1])
    attn = (qc @ kc.transpose(-1, -2)) * decay
    # [heads, chunks, c, v_dim]
    out = (qc * cum.exp().unsqueeze(-1)) @ starts[:num].transpose(0, 1) + attn @ u.transpose(0, 1)
    out = out.permute(1, 2, 0, 3).reshape(num * c, heads, v_dim)[:n]
    s = starts[num]
    return out, s
