"""The grouped routed-expert linears of the sparse MoE block: their ABI, torch reference and binding.

The kernel source is ``compiler/kernels/moe_experts.cuh`` (host side ``moe_experts_ffi.cuh``, built by
``ignis.compiler.kernels.moe_experts.build_moe_experts``, which takes the export names from here).
For a round of R rows routed to top_k experts each, one launch runs every (row, choice) pair
against the expert slot it chose, over a row-major q4_g32 stack of expert weights (packed
[S, N, K/8] u32, scales [S, N, K/32] f16: `ignis.runtime.linear.Q4Weight`'s row-major layout, one
stack member per slot):

* ``moe_q4_gate_up(x [R, K], ids [R, k] i32, packed, scales, y [R, k, N])``: y[r, j] = x[r] @ W_ids[r,j]^T,
  rounded once to x's dtype;
* ``moe_q4_down(h [R, k, W], ids, packed, scales, route_w [R, k] f32, y [R, k, N] f32)``: y[r, j] =
  route_w[r, j] * (a[r, j] @ W_ids[r,j]^T) in float32, with a = h (W = K) or, for W = 2K,
  ``a = F.silu(gate) * up`` of h = [gate | up] in h's dtype (SwiGLU fused into the load).

Sums are float32 over exactly dequantized weights ((code - 8) * scale); each slot's weights are read
once per launch however many rows chose it; a pair whose slot id is outside [0, S) is skipped (its
output is not written), so an expert cache can run the pairs of the experts resident now and mask
the rest. A pair's result does not depend on the other pairs of the launch. At most `MAX_PAIRS`
pairs (R x k) per launch: the binding splits more rows into several launches.

`grouped_q4_reference` is the same maths in torch (the oracle of the GPU tests and the CPU stand-in
of the binding's tests).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ignis.runtime.kernels.module import ModuleFunctions

__all__ = [
    "FUNCTION_NAMES",
    "KERNEL_DTYPES",
    "MAX_PAIRS",
    "REQUIRED_FUNCTION_NAMES",
    "MoeExpertsKernel",
    "grouped_q4_reference",
    "reference_module",
]

REQUIRED_FUNCTION_NAMES = ("moe_q4_gate_up", "moe_q4_down")
"""Every export of a library (manifest kernel kinds of the same names), in build order."""
FUNCTION_NAMES = REQUIRED_FUNCTION_NAMES

#: Most (row, choice) pairs one launch takes (kMaxPairs in moe_experts.cuh).
MAX_PAIRS = 1024
#: The activation dtypes the compiled functions take.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_q4_reference(
    x: torch.Tensor,
    ids: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    *,
    route_w: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernels' maths in torch (float32 over exactly dequantized weights).

    Args:
        x: gate_up: [R, K] (every choice of row r reads x[r]); down: [R, k, K] or [R, k, 2K] (then the
            input is ``F.silu(gate) * up`` in x's dtype).
        ids: [R, k] integer slot ids; a pair with an id outside [0, S) is skipped.
        packed, scales: the row-major q4_g32 stack [S, N, K/8] u32/i32 and [S, N, K/32] f16.
        route_w: down: [R, k] float32 weights (the output is float32, weighted); None: gate_up (the
            output is rounded to x's dtype).
        out: the output [R, k, N] to write the pairs into (skipped pairs keep their values); None: a new
            zero-filled tensor.

    Returns:
        `out`: [R, k, N], x's dtype (gate_up) or float32 (down).
    """
    from ignis.runtime.linear import dequantize_q4

    rows, top_k = ids.shape
    n, k = int(packed.shape[1]), int(packed.shape[2]) * 8
    if route_w is None:
        act = x.float()[:, None, :].expand(rows, top_k, k)
        dtype = x.dtype
    else:
        act = x
        if x.shape[-1] == 2 * k:
            gate, up = x.chunk(2, dim=-1)
            act = F.silu(gate) * up
        act = act.float()
        dtype = torch.float32
    if out is None:
        out = torch.zeros((rows, top_k, n), dtype=dtype, device=x.device)
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < packed.shape[0])
    for slot in torch.unique(flat[valid]).tolist():
        sel = (flat == slot).nonzero().flatten()
        w = dequantize_q4(packed[slot], scales[slot], torch.float32)
        y = act.reshape(rows * top_k, k)[sel] @ w.T
        if route_w is not None:
            y = route_w.reshape(-1)[sel, None].float() * y
        out.view(rows * top_k, n)[sel] = y.to(out.dtype)
    return out


class MoeExpertsKernel(ModuleFunctions):
    """The grouped expert linears of a compiled module (module docstring). Both launch on torch's
    current stream (capturable: no allocation, no host sync).

    Args:
        source: a loaded module holding ``moe_q4_gate_up`` and ``moe_q4_down`` (anything indexable by
            those names: a ``tvm_ffi.Module`` or, for CPU tests, a dict of callables with the same
            arguments), or the path of a ``.so`` built by ``build_moe_experts`` (loaded with the lean
            runtime).

    Raises:
        TvmRuntimeError: a path that is missing or cannot be loaded.
        KeyError: a module without those functions.
    """

    function_names = REQUIRED_FUNCTION_NAMES

    @staticmethod
    def takes(x: torch.Tensor, stack: Any) -> bool:
        """Whether the kernels take activations `x` [R, K] against `stack` (a gate_up or down
        stack): a row-major `ignis.runtime.linear.Q4Weight` [S, N, K] on x's device, K a multiple of
        32, x float32 / bfloat16 / float16 with at least one row."""
        from ignis.runtime.linear import Q4Weight

        return (
            isinstance(stack, Q4Weight)
            and not stack.is_tiled
            and len(stack.lead) == 1
            and stack.in_features % 32 == 0
            and stack.device == x.device
            and x.dtype in KERNEL_DTYPES
            and x.shape[0] >= 1
        )

    def gate_up(self, x: torch.Tensor, ids: torch.Tensor, stack: Any) -> torch.Tensor:
        """x [R, K] against the slots ids [R, k] (int32, -1: skipped) of `stack` (row-major Q4Weight
        [S, N, K]): [R, k, N] in x's dtype (skipped pairs' outputs are not written: uninitialized).
        More than `MAX_PAIRS` pairs run as several launches. Raises ValueError / TypeError (from the
        module) on shapes, dtypes or devices it does not take."""
        rows, top_k = ids.shape
        y = x.new_empty((rows, top_k, stack.out_features))
        step = max(1, MAX_PAIRS // top_k)
        if rows <= step:  # one launch: the tensors as they are (no views to build)
            self._call("moe_q4_gate_up", (x, ids, stack.packed, stack.scales, y), x.is_cuda)
            return y
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            args = (x[r0:r1], ids[r0:r1], stack.packed, stack.scales, y[r0:r1])
            self._call("moe_q4_gate_up", args, x.is_cuda)
        return y

    def down(
        self,
        h: torch.Tensor,
        ids: torch.Tensor,
        stack: Any,
        route_w: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """h [R, k, W] (W = K, or 2K = [gate | up] whose SwiGLU is the input) against the slots ids of
        `stack` [S, N, K], weighted by route_w [R, k] float32, into out [R, k, N] float32 (skipped
        pairs keep their values); returns `out`. h, route_w and out contiguous."""
        rows, top_k = ids.shape
        step = max(1, MAX_PAIRS // top_k)
        if rows <= step:
            self._call("moe_q4_down", (h, ids, stack.packed, stack.scales, route_w, out), h.is_cuda)
            return out
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            args = (h[r0:r1], ids[r0:r1], stack.packed, stack.scales, route_w[r0:r1], out[r0:r1])
            self._call("moe_q4_down", args, h.is_cuda)
        return out

    def swiglu_experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        gate_up: Any,
        down: Any,
        route_w: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """`gate_up` then `down` (the SwiGLU experts of every pair: h = gate_up(x), out = route_w *
        down(silu(gate(h)) * up(h))) with both launches under one stream context (one
        ``torch.cuda.current_stream`` query and one tvm-ffi stream switch for the two)."""
        if not x.is_cuda:
            return self.down(self.gate_up(x, ids, gate_up), ids, down, route_w, out)
        with self._stream():
            return self.down(self.gate_up(x, ids, gate_up), ids, down, route_w, out)


def reference_module() -> dict[str, Any]:
    """A dict stand-in for the compiled module with the exports' signatures, running
    `grouped_q4_reference` (CPU tests of the binding and of the block's kernel path)."""

    def gate_up(x: Any, ids: Any, packed: Any, scales: Any, y: Any) -> None:
        grouped_q4_reference(x, ids, packed, scales, out=y)

    def down(x: Any, ids: Any, packed: Any, scales: Any, route_w: Any, y: Any) -> None:
        grouped_q4_reference(x, ids, packed, scales, route_w=route_w, out=y)

    return {"moe_q4_gate_up": gate_up, "moe_q4_down": down}
