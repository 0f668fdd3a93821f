"""The fused row norms, SwiGLU activation and narrow linear: their ABI and their binding.

The kernel source is ``compiler/kernels/fused_norms.cuh`` (built by
``ignis.compiler.kernels.fused_norms.build_fused_norms``, which takes the export names from here);
the math, its source and the CPU models are in ``ignis.compiler.kernels.fused_norms``.
`StaticHybridExecutor` runs them in static rounds on CUDA through `FusedNormsKernel`:

* ``add_rms_norm``: a residual add with the (1 + w) RMSNorm after it;
* ``gated_rms_norm``: the Gated DeltaNet's gated RMSNorm;
* ``silu_mul``: SwiGLU's ``silu(gate) * up``;
* ``narrow_linear``: ``x @ W^T`` for few rows and at most `NARROW_LINEAR_MAX_N` output features;
* ``add_rms_norm_llama``: a residual add with HF's LlamaRMSNorm after it (the weight in the model
  dtype, multiplied after the normed row is rounded), which `StaticLlamaExecutor` runs.

Every library has the first two (`REQUIRED_FUNCTION_NAMES`); libraries built before the others
lack them (`OPTIONAL_FUNCTION_NAMES`), which the binding then leaves to torch.
"""

from __future__ import annotations

from typing import Any

import torch

from ignis.runtime.kernels.module import ModuleFunctions

__all__ = [
    "FUNCTION_NAMES",
    "NARROW_LINEAR_MAX_N",
    "NARROW_LINEAR_MAX_ROWS",
    "OPTIONAL_FUNCTION_NAMES",
    "REQUIRED_FUNCTION_NAMES",
    "SILU_MUL_MAX_ROWS",
    "FusedNormsKernel",
]

REQUIRED_FUNCTION_NAMES = ("add_rms_norm", "gated_rms_norm")
"""The exports every fused-norms library has (manifest kernel kinds of the same names)."""
OPTIONAL_FUNCTION_NAMES = ("silu_mul", "narrow_linear", "add_rms_norm_llama")
"""The exports libraries built before them lack (`FusedNormsKernel.has_silu_mul`,
`FusedNormsKernel.has_narrow_linear`, `FusedNormsKernel.has_add_rms_norm_llama`)."""
FUNCTION_NAMES = REQUIRED_FUNCTION_NAMES + OPTIONAL_FUNCTION_NAMES
"""Every export of a library, in build order."""

#: The activation dtypes the compiled norms' functions take.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Most rows `FusedNormsKernel.silu_mul` is used for (its grid's second dim).
SILU_MUL_MAX_ROWS = 65535
#: Most output features `FusedNormsKernel.narrow_linear` is used for (one block an output feature;
#: wider weights stay on cuBLAS).
NARROW_LINEAR_MAX_N = 1024
#: Most rows `FusedNormsKernel.narrow_linear` is used for: every block re-reads its rows of x, so
#: past this cuBLAS's split-K pair is faster (measured on an H200: docs/perf/).
NARROW_LINEAR_MAX_ROWS = 16


class FusedNormsKernel(ModuleFunctions):
    """The fused row norms of a compiled module, and its SwiGLU activation and narrow linear (static
    rounds, CUDA only; the math and its source are in ``ignis.compiler.kernels.fused_norms``). All
    launch on torch's current stream (capturable) and allocate their outputs with torch (the graph's
    pool when captured).

    Args:
        source: a loaded module holding ``add_rms_norm`` and ``gated_rms_norm``, and ``silu_mul`` /
            ``narrow_linear`` when it has them (anything indexable by those names: a
            ``tvm_ffi.Module`` or, for CPU tests, a dict of callables), or the path of a ``.so``
            built by ``build_fused_norms`` (loaded with the lean runtime).

    Raises:
        TvmRuntimeError: a path that is missing or cannot be loaded.
        KeyError: a module without those functions.
    """

    function_names = REQUIRED_FUNCTION_NAMES
    optional_function_names = OPTIONAL_FUNCTION_NAMES

    @property
    def has_silu_mul(self) -> bool:
        """Whether the module exports ``silu_mul`` (libraries built before it do not)."""
        return "silu_mul" in self.funcs

    @property
    def has_narrow_linear(self) -> bool:
        """Whether the module exports ``narrow_linear`` (libraries built before it do not)."""
        return "narrow_linear" in self.funcs

    @property
    def has_add_rms_norm_llama(self) -> bool:
        """Whether the module exports ``add_rms_norm_llama`` (libraries built before it do not)."""
        return "add_rms_norm_llama" in self.funcs

    def add_rms_norm_llama(
        self,
        h: torch.Tensor,
        d: torch.Tensor,
        w: torch.Tensor,
        eps: float,
        x_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + d, w * RMSNorm(h + d)) with HF LlamaRMSNorm's roundings: ``h_out = round(h + d)``,
        ``x_out = round(w * round(h_out * rsqrt(mean(h_out^2) + eps)))``, float32 math. h, d [rows,
        hidden] one dtype, the hidden dim contiguous; w [hidden] in h's dtype, contiguous. x_out: where
        to write the normed rows ([rows, hidden] in h's dtype, any row stride, the hidden dim
        contiguous: e.g. the front columns of a wider zero-padded buffer), or None (a new tensor).
        Returns (h_out, x_out), h_out a new tensor. Raises ValueError / TypeError (from the module) on
        shapes, dtypes or devices it does not take."""
        h_out = torch.empty_like(h)
        if x_out is None:
            x_out = torch.empty_like(h)
        self._call("add_rms_norm_llama", (h, d, w, h_out, x_out, eps), h.is_cuda)
        return h_out, x_out

    def silu_mul(self, gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``F.silu(gate) * up`` for ``gate, up = gu.chunk(2, -1)``: [rows, I] in gu's dtype
        (bit-identical to torch's), written into `out` ([rows, I], any row stride, the last dim
        contiguous) or a new tensor. gu [rows, 2 I], the last dim contiguous. Raises ValueError /
        TypeError (from the module) as `add_rms_norm`."""
        if out is None:
            out = gu.new_empty(gu.shape[0], gu.shape[1] // 2)
        self._call("silu_mul", (gu, out), gu.is_cuda)
        return out

    def takes_narrow(self, x: torch.Tensor, weight: Any) -> bool:
        """Whether `narrow_linear` takes ``x @ weight^T`` (and is faster than cuBLAS there): the module
        has it, x has 1 .. `NARROW_LINEAR_MAX_ROWS` rows of float32 / bfloat16 / float16, weight is
        a non-empty dense 2-D tensor of x's dtype and device with at most `NARROW_LINEAR_MAX_N`
        rows, and K and both row strides are multiples of 16 bytes with the inner dims contiguous
        and 16-byte aligned data."""
        if not (self.has_narrow_linear and isinstance(weight, torch.Tensor) and x.dim() == 2):
            return False
        if not 1 <= x.shape[0] <= NARROW_LINEAR_MAX_ROWS or x.dtype not in KERNEL_DTYPES:
            return False
        size = x.element_size()
        return (
            weight.dim() == 2
            and weight.numel() > 0
            and weight.dtype == x.dtype
            and weight.device == x.device
            and weight.shape[0] <= NARROW_LINEAR_MAX_N
            and weight.shape[1] == x.shape[1]
            and x.stride(1) == 1
            and weight.stride(1) == 1
            and (x.shape[1] * size) % 16 == 0
            and (x.stride(0) * size) % 16 == 0
            and (weight.stride(0) * size) % 16 == 0
            and x.data_ptr() % 16 == 0
            and weight.data_ptr() % 16 == 0
        )

    def narrow_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight^T`` in one launch (fp32 sums in a fixed order): [rows, N] in x's dtype (a new
        tensor). x [rows, K], weight [N, K] (see `takes_narrow`). Raises ValueError / TypeError (from
        the module) on shapes, alignments, dtypes or devices it does not take."""
        y = x.new_empty(x.shape[0], weight.shape[0])
        self._call("narrow_linear", (x, weight, y), x.is_cuda)
        return y

    def add_rms_norm(
        self, h: torch.Tensor, d: torch.Tensor, w1p: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + d, RMSNorm(h + d) * w1p), both [rows, hidden] in h's dtype (new tensors). h, d
        [rows, hidden] one dtype, the hidden dim contiguous; w1p = 1 + weight, [hidden] float32.
        Raises ValueError / TypeError (from the module) on shapes, dtypes or devices it does not
        take."""
        h_out, x_out = torch.empty_like(h), torch.empty_like(h)
        self._call("add_rms_norm", (h, d, w1p, h_out, x_out, eps), h.is_cuda)
        return h_out, x_out

    def gated_rms_norm(self, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """``w * RMSNorm(x) * silu(z)`` over the last dim, [rows, heads * dim] in z's dtype (a new
        tensor). x [rows, heads, dim] float32 or z's dtype, z [rows, heads, dim], w [dim] in z's
        dtype. Raises ValueError / TypeError (from the module) as `add_rms_norm`."""
        rows, heads, dim = x.shape
        out = z.new_empty(rows, heads * dim)
        self._call("gated_rms_norm", (x, z, w, out, eps), x.is_cuda)
        return out
