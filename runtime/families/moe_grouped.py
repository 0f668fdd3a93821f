"""The sparse MoE block with its routed experts run as two grouped launches (gate|up, down) over
expert stacks, and at most one host sync per layer.

Same block as `ignis.runtime.families.moe.sparse_moe_block` (HF's Qwen3-Next / Qwen3.5-MoE sparse
block): router linear, float32 softmax, top-k, renormalization, SwiGLU experts weighted by their
routing weights, plus the sigmoid-gated shared expert. What differs is how the routed experts run:
`sparse_moe_block`'s reference loop syncs the host to list the routed experts and runs each one on
its rows (a ``nonzero`` sync, two linears, the SwiGLU and an ``index_add`` per expert); here every
(row, choice) pair runs at once against its expert's slot of a weight stack:

    h  = gate_up(x, ids)                      [R, k, 2 I]   x's dtype
    y  = w * down(silu(gate(h)) * up(h), ids) [R, k, H]     float32 (w: the routing weights)
    out = sum_j y[:, j]                       [R, H]        summed in float32, cast to x's dtype

with ids [R, k] the slot of each pair's expert. On CUDA with the compiled grouped kernels
(`ignis.runtime.kernels.moe_experts.MoeExpertsKernel`: q4_g32 row-major stacks) these are two
launches (the SwiGLU fused into the second); elsewhere (the CPU, dense stacks) the torch path runs
each slot's pairs through the executor's linear hook, gate, up and down apart, as the reference loop
does (q4 weights dequantized to x's dtype by `ignis.runtime.linear.torch_linear`, or an artifact's
compiled CPU functions). The kernels' result for a pair does not depend on which other pairs run
with it; the torch path's depends on them only through the GEMM's float32 blocking.

Slots: with every expert resident (`GroupedExperts.slots` None) the stacks hold all experts and the
slot of a pair is its expert index: routing, kernels and the sum stay on the device, no host sync
(a CUDA graph can capture the layer). With an expert cache (`ignis.runtime.expert_cache.ExpertSlots`
built ``stacked``) the [R, k] expert ids are copied to the host once (pinned memory, one event
wait): the union of the routed experts is made resident group by group (`ExpertSlots.slot_groups`:
hits and misses counted per distinct expert per forward, as the reference loop does), and for each
group the pairs of its experts run with their slot ids (built on the host from that copy, uploaded
without a sync) while the other pairs are masked (-1). Every pair runs exactly once, in the group
of its expert, with the same code as resident, so the output with any cache size equals the
resident output bit for bit.

Numerics against the reference loop: the same maths to float rounding: the kernels sum in float32
over exactly dequantized weights (the reference's torch path rounds the weights to x's dtype
first), gate and up come from one product, and the k weighted expert outputs are added in float32
in choice order (the reference adds them in x's dtype in expert-index order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ignis.runtime.families.moe import SparseMoeWeights, route_top_k, shared_expert_output
from ignis.runtime.linear import LinearFn, Q4Weight, torch_linear

__all__ = [
    "GroupedExperts",
    "combine_moe_output",
    "grouped_moe_block",
    "load_expert_stacks",
    "run_cached_experts",
    "stack_experts",
    "use_grouped",
]


@dataclass(frozen=True)
class GroupedExperts:
    """A MoE layer's routed experts as two stacks, for `grouped_moe_block`.

    Attributes:
        gate_up: [S, 2 I, H]: slot s's gate rows over its up rows (a row-major `Q4Weight` or a dense
            tensor of the executor's dtype), on the device.
        down: [S, H, I], the same kind.
        kernel: the compiled grouped kernels (`MoeExpertsKernel`), or None: the torch path.
        slots: the layer's `ignis.runtime.expert_cache.ExpertSlots` (built ``stacked``; the stacks
            are its slot buffers), or None: every expert resident, slot = expert index.
    """

    gate_up: Any
    down: Any
    kernel: Any = None
    slots: Any = None

    @property
    def uses_kernel(self) -> bool:
        """Whether the kernels run these stacks: a kernel binding and row-major q4 stacks."""
        return self.kernel is not None and _q4_stack(self.gate_up) and _q4_stack(self.down)

    @property
    def capturable(self) -> bool:
        """Whether the layer runs without a host sync (every expert resident, compiled kernels on
        CUDA): a CUDA graph may capture it."""
        return self.slots is None and self.uses_kernel and self.gate_up.device.type == "cuda"


def _q4_stack(w: Any) -> bool:
    return isinstance(w, Q4Weight) and not w.is_tiled and len(w.lead) == 1 and w.in_features % 32 == 0


def stack_experts(gates: list[Any], ups: list[Any], downs: list[Any]) -> tuple[Any, Any]:
    """Per-expert weights -> (gate_up [E, 2 I, H], down [E, H, I]) stacks (a copy), on their device:
    row-major `Q4Weight`s (a tiled one is untiled first) or dense tensors.

    Raises:
        TypeError: q4 and dense weights mixed.
    """

    def rm(w: Any) -> Any:
        return w.to_row_major() if isinstance(w, Q4Weight) else w

    gates, ups, downs = [rm(w) for w in gates], [rm(w) for w in ups], [rm(w) for w in downs]
    every = [*gates, *ups, *downs]
    if all(isinstance(w, Q4Weight) for w in every):
        gate_up = Q4Weight(
            torch.stack([torch.cat([g.packed, u.packed]) for g, u in zip(gates, ups, strict=True)]),
            torch.stack([torch.cat([g.scales, u.scales]) for g, u in zip(gates, ups, strict=True)]),
        )
        down = Q4Weight(torch.stack([d.packed for d in downs]), torch.stack([d.scales for d in downs]))
        return gate_up, down
    if any(isinstance(w, Q4Weight) for w in every):
        raise TypeError("stack_experts: q4_g32 and dense expert weights mixed")
    gate_up = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)])
    return gate_up, torch.stack(list(downs))


def use_grouped(
    device: torch.device, kernel: Any, weights: Mapping[str, Any], prefix: str, linear: Any = None
) -> bool:
    """Whether a MoE layer (routed experts under ``{prefix}.experts.``) runs `grouped_moe_block`: on
    CUDA with the compiled kernels and q4_g32 experts; off CUDA (its torch path) unless the linear
    hook runs compiled functions (an artifact's CPU modules serve the experts' own shapes, and may
    want them tiled: the reference loop keeps them)."""
    if device.type != "cuda":
        compiled = getattr(linear, "compiled", None)
        return compiled is None or not len(compiled)
    first = weights.get(f"{prefix}.experts.gate_up_proj", weights.get(f"{prefix}.experts.0.gate_proj.weight"))
    return kernel is not None and isinstance(first, Q4Weight)


def load_expert_stacks(
    weights: Mapping[str, Any], prefix: str, num_experts: int, *, device: torch.device, dtype: torch.dtype
) -> tuple[Any, Any]:
    """A MoE layer's routed experts as device stacks for the grouped block: (gate_up [E, 2 I, H],
    down [E, H, I]) from the fused checkpoint stacks (``{prefix}.experts.gate_up_proj`` /
    ``down_proj``, moved as they are) or the per-expert tensors (stacked: a copy); q4 weights
    row-major (the kernels' layout: a tiled one is untiled), dense ones cast to `dtype`."""

    def move(w: Any) -> Any:
        if isinstance(w, Q4Weight):
            return w.to_row_major().to(device).contiguous()
        return w.detach().to(device=device, dtype=dtype).contiguous()

    if f"{prefix}.experts.gate_up_proj" in weights:
        return move(weights[f"{prefix}.experts.gate_up_proj"]), move(weights[f"{prefix}.experts.down_proj"])
    n = range(num_experts)
    gate_up, down = stack_experts(
        [weights[f"{prefix}.experts.{e}.gate_proj.weight"] for e in n],
        [weights[f"{prefix}.experts.{e}.up_proj.weight"] for e in n],
        [weights[f"{prefix}.experts.{e}.down_proj.weight"] for e in n],
    )
    return move(gate_up), move(down)


def grouped_moe_block(
    x: torch.Tensor,
    w: SparseMoeWeights,
    *,
    top_k: int,
    norm_topk_prob: bool,
    linear: LinearFn = F.linear,
) -> torch.Tensor:
    """The sparse MoE block on x [R, hidden] -> [R, hidden] (x's dtype), its routed experts run from
    `w.grouped` (a `GroupedExperts`; module docstring). The router, the shared expert and its gate
    run through `linear` as in `sparse_moe_block`."""
    g: GroupedExperts = w.grouped
    top_w, top_i = route_top_k(x, w.router, top_k=top_k, norm_topk_prob=norm_topk_prob, linear=linear)
    route_w = top_w.float()
    rows, hidden = x.shape
    y = torch.empty((rows, top_k, hidden), dtype=torch.float32, device=x.device)
    if g.slots is None:
        ids = top_i.to(torch.int32)
        _run_pairs(x, ids, ids if not x.is_cuda else None, route_w, g, y, linear)
    else:
        host = g.slots.routing.to_host(top_i)  # the layer's one host sync (preallocated pinned buffer)
        run_cached_experts(x, host, route_w, g, y, linear)
    return combine_moe_output(y, shared_expert_output(x, w, linear=linear), x.dtype)


def combine_moe_output(y: torch.Tensor, shared: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The block's output from the weighted expert outputs y [R, k, H] float32 and the gated shared
    expert's output [R, H]: the k outputs summed in float32, cast to `dtype` (x's), plus shared."""
    return y.sum(dim=1).to(dtype) + shared


def run_cached_experts(
    x: torch.Tensor,
    host_ids: np.ndarray,
    route_w: torch.Tensor,
    g: GroupedExperts,
    y: torch.Tensor,
    linear: LinearFn = F.linear,
    issued: Callable[[], None] | None = None,
) -> None:
    """The routed experts of a layer with an expert cache, into y [R, k, H] float32: the union of the
    routed experts (host_ids [R, k] int64, on the host) made resident group by group
    (`ExpertSlots.slot_groups`), and each group's pairs run with their slot ids (the others masked).
    x [R, H] and route_w [R, k] float32 on the device; every pair runs exactly once.

    `issued`: called once the copies of the layer's last group are issued and before that group's
    launches (router lookahead queues the next layer's prefetch there: behind this layer's copies
    on the copy stream, ahead of this layer's kernels on the host)."""
    routing = g.slots.routing
    timer = g.slots.timer
    experts = np.unique(host_ids).tolist()
    last = max(len(experts) - 1, 0) // g.slots.num_slots  # the index of the last group
    for i, group in enumerate(g.slots.slot_groups(experts, rows=x.shape[0])):
        if i == last and issued is not None:
            issued()
            issued = None
            if timer is not None:
                timer.lap("prefetch")
        sid, sid_host = routing.slot_ids(i, len(g.slots), group, host_ids)
        _run_pairs(x, sid, sid_host, route_w, g, y, linear)
        if timer is not None:
            timer.lap("launch")
    if issued is not None:  # no group ran (no rows)
        issued()


def _run_pairs(
    x: torch.Tensor,
    ids: torch.Tensor,
    ids_host: torch.Tensor | None,
    route_w: torch.Tensor,
    g: GroupedExperts,
    y: torch.Tensor,
    linear: LinearFn,
) -> None:
    """Run the pairs whose slot id (ids [R, k], int32, on x's device) is >= 0 into y [R, k, H]
    float32 (weighted down outputs); the other pairs' rows of y are left as they are. ids_host: the
    same ids on the host when known (the torch path needs them; None: copied here).

    Without the kernels, each slot's pairs run its gate, up and down weights through `linear` (the
    executor's hook: an artifact's compiled CPU functions serve the experts' shapes; `F.linear`
    is replaced by `torch_linear` for q4 stacks), as the reference loop runs them."""
    if g.uses_kernel and g.kernel.takes(x, g.gate_up) and g.kernel.takes(x, g.down):
        g.kernel.swiglu_experts(x, ids, g.gate_up, g.down, route_w, y)
        return
    if linear is F.linear:
        linear = torch_linear
    rows, top_k = ids.shape
    inter = g.down.shape[-1]
    flat = (ids_host if ids_host is not None else ids.cpu()).reshape(-1).long()
    y_pairs = y.view(rows * top_k, -1)
    w_pairs = route_w.reshape(-1)
    for slot in sorted(set(flat.tolist())):
        if slot < 0:
            continue
        sel = (flat == slot).nonzero().flatten().to(x.device)
        xs, gate_up = x[sel // top_k], g.gate_up[slot]
        act = F.silu(linear(xs, gate_up[:inter], None)) * linear(xs, gate_up[inter:], None)
        y_pairs[sel] = linear(act, g.down[slot], None).float() * w_pairs[sel, None]
