"""The grouped q4_g32 routed-expert linears of the sparse MoE block (decode-sized rounds), CUDA
kernels exported through tvm-ffi.

``moe_q4_gate_up`` and ``moe_q4_down`` run every (row, choice) pair of a round against the expert
slot it was routed to in one launch each (the ABI, limits and the torch reference are in
``ignis.runtime.kernels.moe_experts``; the kernel in ``moe_experts.cuh``, its argument checks in
``moe_experts_ffi.cuh``). What they replace: the per-expert loop of
``ignis.runtime.families.moe.sparse_moe_block`` -- a host sync to list the routed experts, and per
expert a ``nonzero`` (another sync), two one-row q4 linears, the SwiGLU and an ``index_add``.
The idea is llama.cpp's ``mul_mat_id`` (MMVQ for few rows) and vLLM's ``fused_moe``: group the
pairs by expert on the device and stream each routed expert's weights once.

:func:`build_moe_experts` returns the exported ``.so`` (nvcc, SASS for one arch, no PTX). The
kernels allocate nothing and launch on the stream tvm-ffi reports (torch's current one under
``tvm_ffi.use_torch_stream()``), so they can be captured in CUDA graphs. The caller is
``ignis.runtime.kernels.moe_experts.MoeExpertsKernel``, which the executors' grouped MoE block
(``ignis.runtime.families.moe_grouped``) runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ignis.runtime.kernels.moe_experts import FUNCTION_NAMES

__all__ = ["FUNCTION_NAMES", "MoeExpertsError", "build_moe_experts"]


class MoeExpertsError(ValueError):
    """The grouped MoE expert kernels cannot be built for this target."""


def build_moe_experts(
    target: Any,
    *,
    out_path: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> Path:
    """Compile the grouped MoE expert kernels for a CUDA arch and return the exported ``.so`` path.

    Args:
        target: ``"sm_90"``, ``"sm_120"``... or ``{"kind": "cuda", "arch": "sm_90"}``.
        out_path: where to write it; default a cache file keyed by arch and sources
            (``$IGNIS_CACHE_DIR/moe_experts/``), reused when present.
        verbose: print ptxas' register and shared-memory report.

    Returns:
        The library, exporting :data:`FUNCTION_NAMES`, SASS for that arch only.

    Raises:
        MoeExpertsError: not a CUDA target, nvcc missing, or nvcc failed (its stderr included).
    """
    from .cuda_build import build_kernel_library

    return build_kernel_library(
        "moe_experts", target, error=MoeExpertsError, out_path=out_path, verbose=verbose
    )
