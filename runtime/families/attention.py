"""Scaled dot-product attention with the backends fixed: the llama / qwen2 executor's and the drafters'
(DFlash2, MTP) torch attention calls go through `sdpa`.

PyTorch's SDPA dispatch on CUDA prefers cuDNN's fused attention where it applies, and cuDNN builds an
execution plan for every new problem shape (query length, key length, mask). A verify round's or a
prefill chunk's key length grows with the context, so those plans were built on the request path:
the first requests of a server ran many times slower than later ones with the same shapes. `sdpa`
allows FlashAttention-2, the memory-efficient kernel and the math fallback, which take any shape
without a plan (`torch.nn.attention.sdpa_kernel`); on the CPU the same list is what torch has.

The hybrid executors keep torch's default dispatch: their static rounds fold the GQA groups into
query rows under a mask while the eager executor passes ``enable_gqa``, and cuDNN is the one kernel
that takes both with the same numerics; without it the two paths take different kernels (the
memory-efficient kernel has no GQA) and bf16 MoE routing can flip between them (the CUDA
equivalence tests of `test_hybrid_graphs.py`). Their per-shape plans cost a 2,048-token prefill
chunk of the 27B shape ~12 % (docs/perf, run 112).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["SDPA_BACKENDS", "sdpa"]

#: The backends `sdpa` allows, in torch's order of preference (cuDNN left out: per-shape plans).
SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention(query, key, value, **kwargs)` (same shapes,
    dtypes and keyword arguments) run with only `SDPA_BACKENDS` enabled."""
    with sdpa_kernel(list(SDPA_BACKENDS)):
        return F.scaled_dot_product_attention(query, key, value, **kwargs)
