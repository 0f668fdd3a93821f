"""SwiGLU MLP and the Qwen sparse mixture-of-experts block (top-k routing plus a gated shared expert).

Math (HF reference: `transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextSparseMoeBlock`,
`Qwen3NextTopKRouter`, `Qwen3NextExperts`; `qwen3_5_moe` is the same block with the top-k weights
always renormalized)::

    p        = softmax(x W_router^T)                  (float32)
    (w, idx) = top_k(p)                                (w renormalized to sum 1 if norm_topk_prob)
    y        = sum_j w_j * E_idx_j(x) + sigmoid(x W_sg^T) * E_shared(x)
    E(x)     = W_down (silu(W_gate x) * (W_up x))      (SwiGLU, Shazeer 2020)

Every function takes all R rows of a verify round at once ([R, hidden]) and runs its matrix
products through `linear` (``linear(x, weight, bias)``, default `F.linear`; an executor passes its
hook, so weights may be `ignis.runtime.linear.Q4Weight`s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ignis.runtime.linear import LinearFn

__all__ = ["SparseMoeWeights", "SwiGLUWeights", "shared_expert_output", "sparse_moe_block", "swiglu_mlp"]


@dataclass(frozen=True)
class SwiGLUWeights:
    """One SwiGLU MLP (dense layer, one routed expert, or the shared expert).

    Attributes:
        gate: [intermediate, hidden] (HF `gate_proj.weight`, or the first half of a fused `gate_up_proj[e]`);
            None when `gate_up` holds it.
        up: [intermediate, hidden] (HF `up_proj.weight`, or the second half of `gate_up_proj[e]`); None
            when `gate_up` holds it.
        down: [hidden, intermediate] (HF `down_proj.weight`).
        gate_up: [2 intermediate, hidden]: gate over up in one weight (one GEMM, its output split in
            halves), or None.
    """

    gate: Any  # torch.Tensor | Q4Weight
    up: Any
    down: Any
    gate_up: Any = None


@dataclass(frozen=True)
class SparseMoeWeights:
    """A sparse MoE block's weights.

    Attributes:
        router: [num_experts, hidden] (HF `mlp.gate.weight`).
        experts: one SwiGLUWeights per routed expert, in expert-index order.
        shared_expert: the always-on expert (HF `mlp.shared_expert.*`).
        shared_expert_gate: [1, hidden] (HF `mlp.shared_expert_gate.weight`), a sigmoid gate per row.
        grouped: the routed experts as weight stacks
            (`ignis.runtime.families.moe_grouped.GroupedExperts`): `sparse_moe_block` then runs
            `grouped_moe_block` (two grouped launches, at most one host sync); None: the reference
            loop over `experts`.
    """

    router: torch.Tensor
    experts: Sequence[SwiGLUWeights]
    shared_expert: SwiGLUWeights
    shared_expert_gate: torch.Tensor
    grouped: Any = None


def swiglu_mlp(x: torch.Tensor, w: SwiGLUWeights, *, linear: LinearFn = F.linear) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` for x [R, hidden] -> [R, hidden], in x's dtype (gate and up from
    one GEMM when `w.gate_up` is set)."""
    if w.gate_up is not None:
        gate, up = linear(x, w.gate_up, None).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, w.down, None)
    return linear(F.silu(linear(x, w.gate, None)) * linear(x, w.up, None), w.down, None)


def route_top_k(
    x: torch.Tensor, router: Any, *, top_k: int, norm_topk_prob: bool, linear: LinearFn = F.linear
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing.

    Args:
        x: [R, hidden].
        router: [num_experts, hidden].

    Returns:
        (weights [R, top_k] in x's dtype, expert indices [R, top_k] int64). The softmax is taken in
        float32 over all experts; with `norm_topk_prob` the k kept probabilities are divided by their sum.
    """
    probs = torch.softmax(linear(x, router, None), dim=-1, dtype=torch.float32)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(x.dtype), top_i


def sparse_moe_block(
    x: torch.Tensor, w: SparseMoeWeights, *, top_k: int, norm_topk_prob: bool, linear: LinearFn = F.linear
) -> torch.Tensor:
    """The sparse MoE block on x [R, hidden] -> [R, hidden] (x's dtype).

    Each routed expert runs once on exactly the rows routed to it (experts visited in index order,
    contributions accumulated with `index_add_`, as HF's eager expert loop does). When `w.experts` is
    an `ignis.runtime.expert_cache.ExpertSlots` (experts in host memory, a device cache of slots), the
    union of the routed experts is made resident through its `resident_groups`, in the same order.
    With `w.grouped` set, `ignis.runtime.families.moe_grouped.grouped_moe_block` runs instead (the
    same block to float rounding).
    """
    if w.grouped is not None:
        from ignis.runtime.families.moe_grouped import grouped_moe_block

        return grouped_moe_block(x, w, top_k=top_k, norm_topk_prob=norm_topk_prob, linear=linear)
    top_w, top_i = route_top_k(x, w.router, top_k=top_k, norm_topk_prob=norm_topk_prob, linear=linear)
    out = torch.zeros_like(x)
    experts = torch.unique(top_i).tolist()
    # an `ignis.runtime.expert_cache.ExpertSlots` makes the experts resident group by group (same order)
    groups = getattr(w.experts, "resident_groups", None)
    for group in groups(experts, rows=x.shape[0]) if groups else ([(e, w.experts[e]) for e in experts],):
        for expert, weights in group:
            rows, slot = torch.where(top_i == expert)
            y = swiglu_mlp(x[rows], weights, linear=linear) * top_w[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
    return out + shared_expert_output(x, w, linear=linear)


def shared_expert_output(
    x: torch.Tensor, w: SparseMoeWeights, *, linear: LinearFn = F.linear
) -> torch.Tensor:
    """The always-on expert of a sparse MoE block on x [R, hidden]: ``sigmoid(x W_sg^T) * E_shared(x)``
    -> [R, hidden] (x's dtype)."""
    return swiglu_mlp(x, w.shared_expert, linear=linear) * torch.sigmoid(
        linear(x, w.shared_expert_gate, None)
    )
