"""Exact top-k over the last dimension, ties to the smaller index (the drafter's candidate selection).

The tie rule: values descending; equal values by ascending index; NaN ranks above +inf (all NaNs
equal, so by index); ``-0.0`` equals ``+0.0``. The result is exactly
``torch.sort(x, dim=-1, descending=True, stable=True)`` cut to ``k`` columns, and agrees with
``torch.topk`` whenever the top ``k + 1`` values are distinct (torch leaves the order among equal
values unspecified). Values are the input's own elements, bit for bit.

Two implementations, the same result:

* the compiled CUDA module (``ignis.compiler.kernels.topk``, exported ``topk``; load it with
  :func:`load_topk_module`): used by :func:`topk` for CUDA float32 / bfloat16 / float16 input with
  1 <= k <= 64 and V <= 1,048,576;
* torch otherwise (:func:`topk_torch`, any device): ``torch.topk(x, k + 1)``, its k re-ordered by
  the unique int64 keys ``ord(value) << 32 | (2**32 - 1 - index)``; rows tied at the k-th value are
  redone with ``torch.topk`` over all V keys (float64: the stable sort).

Measured on an H200 (docs/perf-drafts/topk.md), V = 248,320 float32, 1-8 rows, k = 8-64: the
module 30-38 us of device time against torch.topk's 70-76 us; eagerly the wrapper costs 44-84 us
and the torch path 0.42-0.73 ms (torch.topk alone 0.10-0.15 ms).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["MAX_K", "MAX_VOCAB", "TopKModule", "load_topk_module", "topk", "topk_torch"]

#: Limits of the compiled kernel (ignis.compiler.kernels.topk: MAX_K, MAX_VOCAB, TILE).
MAX_K = 64
_TILE = 4096
MAX_VOCAB = 256 * _TILE
_MAX_ROWS = 65535
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TopKModule:
    """The compiled top-k function of a loaded module, with its workspace sizing.

    Args:
        func: the module's ``topk(x, values, indices, workspace)`` (a tvm-ffi function).
    """

    def __init__(self, func: Any) -> None:
        self.func = func

    def supports(self, x: torch.Tensor, k: int) -> bool:
        """Whether the kernel takes ``x`` [..., V] and ``k`` (CUDA, dtype, k and V limits)."""
        if not x.is_cuda or x.dtype not in _KERNEL_DTYPES or x.dim() < 1:
            return False
        vocab = x.shape[-1]
        rows = x.numel() // vocab if vocab else 0
        return 1 <= k <= MAX_K and k <= vocab <= MAX_VOCAB and 1 <= rows <= _MAX_ROWS

    def __call__(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [..., k] in x's dtype, indices int64 [..., k]) of ``x`` [..., V] on the GPU.

        Launches on torch's current stream (capturable in a CUDA graph after one eager call).

        Raises:
            ValueError: ``supports(x, k)`` is False.
        """
        if not self.supports(x, k):
            raise ValueError(
                f"the compiled top-k takes CUDA float32/bfloat16/float16 [..., V] with 1 <= k <= {MAX_K}, "
                f"k <= V <= {MAX_VOCAB}; got {x.dtype} {tuple(x.shape)} on {x.device}, k={k}"
            )
        import tvm_ffi

        vocab = x.shape[-1]
        x2 = x.reshape(-1, vocab).contiguous()
        rows = x2.shape[0]
        values = torch.empty((rows, k), dtype=x.dtype, device=x.device)
        indices = torch.empty((rows, k), dtype=torch.int64, device=x.device)
        workspace = torch.empty(rows * 32 * (-(-vocab // _TILE)), dtype=torch.int64, device=x.device)
        with torch.cuda.device(x.device), tvm_ffi.use_torch_stream():
            self.func(x2, values, indices, workspace)
        shape = (*x.shape[:-1], k)
        return values.view(shape), indices.view(shape)


def load_topk_module(path: str | Path) -> TopKModule:
    """Load a module built by ``ignis.compiler.kernels.topk.build_topk`` (lean TVM runtime).

    Raises:
        TvmRuntimeError: the file is missing or cannot be loaded.
    """
    from ignis.runtime.tvm_runtime import load_module

    return TopKModule(load_module(path, cuda=True)["topk"])


def _sort_keys(x: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """int64 keys of ``x`` [..., n] at column indices ``index`` (default 0..n-1), ordered like the
    tie rule (larger key = earlier) and unique per row."""
    xf = x.float()
    bits = xf.view(torch.int32)
    sord = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order map
    sord = torch.where(xf == 0, torch.zeros_like(sord), sord)  # -0.0 == +0.0
    sord = torch.where(torch.isnan(xf), torch.full_like(sord, 0x7FFFFFFF), sord)  # NaN above +inf
    if index is None:
        index = torch.arange(x.shape[-1], device=x.device, dtype=torch.int64).expand(x.shape)
    low = 0xFFFFFFFF - index
    return (sord.to(torch.int64) << 32) | low


def topk_torch(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tie rule in torch, any device: (values [..., k] in x's dtype, indices int64 [..., k]).

    ``torch.topk(x, k + 1)`` first: where the k-th and (k+1)-th values differ (the usual case for
    logits) its set is the answer, re-ordered by key; rows with a tie at the boundary are redone
    over all V keys (or the stable sort for float64).

    Raises:
        RuntimeError: from torch when k > V.
    """
    if not x.is_floating_point():
        raise TypeError(f"topk: x must be a float tensor, got {x.dtype}")
    vocab = x.shape[-1]
    if k > vocab:
        raise RuntimeError(f"topk: k={k} is larger than the last dimension {vocab}")
    if k == 0 or x.numel() == 0:
        return x[..., :k], torch.empty((*x.shape[:-1], k), dtype=torch.int64, device=x.device)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, vocab)
    vals, idx = torch.topk(x2, min(k + 1, vocab), dim=-1)
    idx = idx[:, :k]
    if k < vocab:
        a, b = vals[:, k - 1], vals[:, k]
        tie = (a == b) | (torch.isnan(a) & torch.isnan(b))
    else:
        tie = torch.zeros(x2.shape[0], dtype=torch.bool, device=x.device)
    if x.dtype == torch.float64:
        cand = torch.sort(idx, dim=-1).values  # ascending indices: the stable sort keeps them so
        v = x2.gather(-1, cand)
        v = torch.where(v == 0, torch.zeros_like(v), v)  # -0.0 == +0.0
        pos = torch.sort(v, dim=-1, descending=True, stable=True).indices  # NaN first
        idx = cand.gather(-1, pos)
    else:
        keys = _sort_keys(x2.gather(-1, idx), idx)
        idx = idx.gather(-1, torch.sort(keys, dim=-1, descending=True).indices)
    rows = tie.nonzero().flatten()
    if rows.numel():
        slow = x2[rows]
        if x.dtype == torch.float64:
            idx[rows] = torch.sort(slow, dim=-1, descending=True, stable=True).indices[:, :k]
        else:
            idx[rows] = torch.topk(_sort_keys(slow), k, dim=-1).indices
    return _gather_bits(x2, idx).view(*lead, k), idx.view(*lead, k)


def _gather_bits(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x.gather(-1, idx)`` through an integer view: bit-exact (torch's CPU gather of bfloat16
    rewrites NaN payloads)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(x.element_size())
    if ints is None:
        return x.gather(-1, idx)
    return x.contiguous().view(ints).gather(-1, idx).view(x.dtype)


def topk(x: torch.Tensor, k: int, *, module: TopKModule | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``k`` of ``x`` [..., V] along the last dimension, under the tie rule (module docstring).

    Args:
        x: float tensor [..., V], any device.
        k: 1..V.
        module: the compiled kernel; used when it ``supports(x, k)``, else torch.

    Returns:
        (values [..., k] in x's dtype, bit-identical to x's elements; indices int64 [..., k]).

    Raises:
        RuntimeError: from torch when k > V.
    """
    if module is not None and module.supports(x, k):
        return module(x, k)
    return topk_torch(x, k)
