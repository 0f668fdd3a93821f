"""Exact top-k over a row's full vocabulary (the drafter's candidate selection), as a CUDA kernel.

Order (the *tie rule*): values descending; equal values by ascending index; NaN ranks above +inf
(every NaN equal to every other, so NaNs by index); ``-0.0`` equals ``+0.0``. That is
``torch.sort(x, dim=-1, descending=True, stable=True)`` cut to ``k`` columns
(:func:`topk_reference`), and ``torch.topk``'s own order wherever the top ``k + 1`` values are
distinct (torch leaves the order of equal values unspecified; on CUDA its radix select also puts
``+0.0`` above ``-0.0``, which this rule treats as equal). Returned values are the input's own
bits (a NaN keeps its payload, ``-0.0`` stays ``-0.0``).

Every element gets a unique 64-bit key, ``ord(value) << 32 | (0xFFFFFFFF - index)``
(:func:`encode_keys`); the top ``k`` keys, descending, are the answer. ``topk.cuh`` holds the two
kernels (per-group maxima over 128-element groups, then one block per row that keeps the groups of
the ``k`` largest maxima, filters and sorts their elements); :func:`topk_emulated` is a CPU model
of both, the same index arithmetic and sorting network, tested against the reference.

:func:`build_topk` returns an exported ``.so`` (nvcc, SASS for one arch, no PTX) holding
``topk(x, values, indices, workspace)`` (:data:`FUNCTION_NAME`):

* ``x``: [rows, V] float32, bfloat16 or float16, contiguous, CUDA; rows 1..65535,
  V 1..:data:`MAX_VOCAB`;
* ``values``: [rows, k] in x's dtype (written), k = 1..:data:`MAX_K` and k <= V;
* ``indices``: [rows, k] int64 (written);
* ``workspace``: 1-d int64, at least :func:`workspace_numel` ``(rows, V)`` elements (scratch).

It launches on the stream tvm-ffi reports (torch's current stream under
``tvm_ffi.use_torch_stream()``), so it can be captured in a CUDA graph after one eager call (the
first call reserves 64 KiB of shared memory per block). Wrong shapes, dtypes or devices raise
``ValueError`` / ``TypeError`` from the module. ``ignis.runtime.kernels.topk.topk`` is the caller.
The per-row select kernel's two bitonic sorts dominate its time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ignis.runtime.kernels import topk as _abi
from ignis.runtime.kernels.topk import CAP, FUNCTION_NAME, GROUP, MAX_K, MAX_VOCAB, TILE

__all__ = [
    "FUNCTION_NAME",
    "GROUP",
    "MAX_K",
    "MAX_VOCAB",
    "TopKKernelError",
    "build_topk",
    "encode_keys",
    "encode_ord",
    "topk_emulated",
    "topk_reference",
    "workspace_numel",
]



class TopKKernelError(ValueError):
    """The top-k kernel cannot be built for this target, or a shape is outside its limits."""


def workspace_numel(rows: int, vocab: int) -> int:
    """int64 elements of scratch the kernel needs for ``rows`` rows of ``vocab`` columns.

    Raises:
        TopKKernelError: rows < 1 or vocab outside 1..MAX_VOCAB.
    """
    try:
        return _abi.workspace_numel(rows, vocab)
    except ValueError as exc:
        raise TopKKernelError(str(exc)) from exc


# --------------------------------------------------------------------------------------------
# The reference and the key encoding (CPU).


def topk_reference(x: Any, k: int) -> tuple[Any, Any]:
    """The tie rule itself: ``torch.sort(x, -1, descending=True, stable=True)`` cut to ``k``.

    ``x``: torch tensor [..., V] (any float dtype, any device). Returns (values [..., k] in x's
    dtype, indices int64 [..., k]). Run it on the CPU: torch's CUDA sort of bfloat16 does not rank
    NaN first (seen on an H200 with torch 2.11: +inf came before NaN), its CPU sort does.
    """
    import torch

    v, i = torch.sort(x, dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


def encode_ord(x: np.ndarray) -> np.ndarray:
    """``ord_bits`` of topk.cuh: float array (f32 / f16 / bf16 bit patterns widened) -> uint32.

    ``x``: a numpy float32 array (widen float16 / bfloat16 first: exact). NaN -> 0xFFFFFFFF,
    +0 and -0 -> 0x80000000, otherwise the sign-flip order map; never 0.
    """
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    mag = u & np.uint32(0x7FFFFFFF)
    out = np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint32)
    out = np.where(mag == 0, np.uint32(0x80000000), out)
    return np.where(mag > np.uint32(0x7F800000), np.uint32(0xFFFFFFFF), out).astype(np.uint32)


def encode_keys(x: np.ndarray) -> np.ndarray:
    """The kernel's 64-bit keys of a float32 array [..., V]: ``ord << 32 | (0xFFFFFFFF - index)``."""
    o = encode_ord(x).astype(np.uint64)
    idx = np.arange(x.shape[-1], dtype=np.uint64)
    return (o << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - idx)


def _bitonic_sort_desc(s: np.ndarray) -> np.ndarray:
    """The kernel's sorting network (bitonic_sort_desc), stage by stage, on a power-of-two array."""
    s = s.copy()
    n = len(s)
    t = np.arange(n // 2)
    size = 2
    while size <= n:
        stride = size // 2
        while stride > 0:
            i = 2 * t - (t & (stride - 1))
            j = i + stride
            desc = (i & size) == 0
            a, b = s[i], s[j]
            swap = (a < b) == desc
            s[i] = np.where(swap, b, a)
            s[j] = np.where(swap, a, b)
            stride //= 2
        size *= 2
    return s


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def topk_emulated(x: np.ndarray, k: int, *, vector_elems: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """CPU model of the two kernels: (values [rows, k] like ``x``, indices int64 [rows, k]).

    ``x``: numpy [rows, V] float32 (the values bf16 / f16 would widen to); ``vector_elems``: 4 for
    float32, 8 for 16-bit inputs (elements per 16-byte load, which decides the group layout).

    Raises:
        TopKKernelError: k or V outside the kernel's limits.
    """
    rows, vocab = x.shape
    if not 1 <= k <= min(MAX_K, vocab):
        raise TopKKernelError(f"k must be 1..{MAX_K} and <= V = {vocab}, got {k}")
    ev = vector_elems
    tiles = workspace_numel(1, vocab) // 32
    m = tiles * 32
    keys_all = encode_keys(x)
    # kernel 1: group g = (tile, lane) holds elements tile*TILE + j*32*ev + lane*ev + c
    g_tile = np.arange(m) // 32
    g_lane = np.arange(m) % 32
    e = np.arange(GROUP)
    elem = g_tile[:, None] * TILE + (e // ev)[None, :] * (32 * ev) + g_lane[:, None] * ev + (e % ev)[None, :]
    valid = elem < vocab
    vals_out = np.empty((rows, k), dtype=x.dtype)
    idx_out = np.empty((rows, k), dtype=np.int64)
    for r in range(rows):
        kr = np.where(valid, keys_all[r][np.minimum(elem, vocab - 1)], np.uint64(0))
        gm = kr.max(axis=1)  # [m]: the key of each group's first largest element (or 0)
        # kernel 2
        p1 = _next_pow2(max(m, 2))
        s = _bitonic_sort_desc(np.concatenate([gm, np.zeros(p1 - m, np.uint64)]))
        thresh = s[k - 1] if m >= k else np.uint64(0)
        nsel = min(m, k)
        sel = [
            -1 if s[q] == 0 else _group_of(int(np.uint64(0xFFFFFFFF) - (s[q] & np.uint64(0xFFFFFFFF))), ev)
            for q in range(nsel)
        ]
        cand = [kr[g][kr[g] >= thresh] for g in sel if g >= 0]
        c = np.concatenate(cand) if cand else np.zeros(0, np.uint64)
        c = c[c != 0]  # padding slots (elements past V) hold 0 and are skipped by the kernel
        assert len(c) <= nsel * GROUP <= CAP
        p2 = _next_pow2(max(len(c), 2))
        s2 = _bitonic_sort_desc(np.concatenate([c, np.zeros(p2 - len(c), np.uint64)]))
        idx = (np.uint64(0xFFFFFFFF) - (s2[:k] & np.uint64(0xFFFFFFFF))).astype(np.int64)
        idx_out[r] = idx
        vals_out[r] = x[r, idx]
    return vals_out, idx_out


def _group_of(i: int, ev: int) -> int:
    tile, rem = divmod(i, TILE)
    return tile * 32 + (rem % (32 * ev)) // ev


# --------------------------------------------------------------------------------------------
# Building the module.


def build_topk(
    target: Any,
    *,
    out_path: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> Path:
    """Compile the top-k module for a CUDA arch and return the exported ``.so`` path.

    Args:
        target: ``"sm_90"``, ``"sm_120"``... or ``{"kind": "cuda", "arch": "sm_90"}``.
        out_path: where to write it; default a cache file keyed by arch and sources
            (``$IGNIS_CACHE_DIR/topk/``), reused when present.
        verbose: print ptxas' register and shared-memory report.

    Returns:
        The library, exporting ``topk(x, values, indices, workspace)`` (module docstring), with SASS
        for that arch only.

    Raises:
        TopKKernelError: not a CUDA target, nvcc missing, or nvcc failed (its stderr included).
    """
    from .cuda_build import build_kernel_library

    return build_kernel_library(
        "topk", target, error=TopKKernelError, out_path=out_path, verbose=verbose
    )
