"""Exact top-k over the last dimension, ties to the smaller index (the drafter's candidate selection).

The tie rule: values descending; equal values by ascending index; NaN ranks above +inf (all NaNs
equal, so by index); ``-0.0`` equals ``+0.0``. The result is exactly
``torch.sort(x, dim=-1, descending=True, stable=True)`` cut to ``k`` columns, and agrees with
``torch.topk`` whenever the top ``k + 1`` values are distinct (torch leaves the order among equal
values unspecified). Values are the input's own elements, bit for bit.

Two implementations, the same result:

* the compiled CUDA module (built by ``ignis.compiler.kernels.topk.build_topk`` from
  ``compiler/kernels/topk.cuh``, exported ``topk``; load it with :func:`load_topk_module`): used by
  :func:`topk` for CUDA float32 / bfloat16 / float16 input with 1 <= k <= `MAX_K` and
  V <= `MAX_VOCAB`;
* torch otherwise (:func:`topk_torch`, any device): ``torch.topk`` gives the set up to the ties at
  its k-th value; those are resolved to the smallest indices over the whole row, and the k are
  ordered by (value descending, index ascending). On a GPU a fixed sequence of about 25 torch ops
  with no host synchronisation and no branch on the data (it runs on "meta" tensors; meant to be
  captured in a CUDA graph: a `gpu` test checks it); on the CPU the whole-row work runs only for
  rows tied at the boundary. 5 of its ops read a whole row (isnan, ==, where, cumsum, topk).

The kernel's ABI lives here (the compiler's builder and CPU model import it): the export name, the
group and tile sizes, the limits, and the workspace formula (`workspace_numel`).

The compiled module comes from an artifact (`ignis.runtime.artifact.Artifact.topk_module`, the
manifest's `kernels` entry of kind "topk"), which the server attaches to the DFlash2 drafter on CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CAP",
    "FUNCTION_NAME",
    "GROUP",
    "MAX_K",
    "MAX_VOCAB",
    "TILE",
    "TopKModule",
    "load_topk_module",
    "topk",
    "topk_torch",
    "workspace_numel",
]

#: The exported function of a top-k library (and its manifest kernel kind).
FUNCTION_NAME = "topk"
#: Elements per group (``kGroup`` in topk.cuh): the first kernel keeps one maximum a group.
GROUP = 128
#: Elements per warp tile (32 groups).
TILE = 32 * GROUP
#: Largest k (``kMaxK``).
MAX_K = 64
#: Keys in the select kernel's shared buffer (``kCap``).
CAP = 8192
#: Largest vocabulary (1,048,576: one buffer holds 32 keys a tile).
MAX_VOCAB = (CAP // 32) * TILE
_MAX_ROWS = 65535
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def workspace_numel(rows: int, vocab: int) -> int:
    """int64 elements of scratch the kernel needs for ``rows`` rows of ``vocab`` columns (32 group
    maxima a tile and row).

    Raises:
        ValueError: rows < 1 or vocab outside 1..MAX_VOCAB.
    """
    if rows < 1 or not 1 <= vocab <= MAX_VOCAB:
        raise ValueError(f"need rows >= 1 and 1 <= V <= {MAX_VOCAB}, got rows={rows}, V={vocab}")
    return rows * 32 * (-(-vocab // TILE))


class TopKModule:
    """The compiled top-k function of a loaded module, with its workspace sizing.

    Args:
        func: the module's ``topk(x, values, indices, workspace)`` (a tvm-ffi function).
        dtypes: the input dtypes the module was built for (the manifest entry's ``dtypes``:
            "float32", "bfloat16", "float16"); None: all three.

    Raises:
        ValueError: a dtype name outside those three.
    """

    def __init__(self, func: Any, *, dtypes: tuple[str, ...] | None = None) -> None:
        self.func = func
        if dtypes is None:
            self.dtypes: tuple[torch.dtype, ...] = _KERNEL_DTYPES
        else:
            unknown = sorted(set(dtypes) - set(_DTYPE_NAMES))
            if unknown:
                raise ValueError(f"the compiled top-k takes {sorted(_DTYPE_NAMES)}, not {unknown}")
            self.dtypes = tuple(_DTYPE_NAMES[d] for d in dtypes)

    def supports(self, x: torch.Tensor, k: int) -> bool:
        """Whether the kernel takes ``x`` [..., V] and ``k`` (CUDA, dtype, k and V limits)."""
        if not x.is_cuda or x.dtype not in self.dtypes or x.dim() < 1:
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
        workspace = torch.empty(workspace_numel(rows, vocab), dtype=torch.int64, device=x.device)
        with torch.cuda.device(x.device), tvm_ffi.use_torch_stream():
            self.func(x2, values, indices, workspace)
        shape = (*x.shape[:-1], k)
        return values.view(shape), indices.view(shape)


def load_topk_module(
    path: str | Path, *, name: str = FUNCTION_NAME, dtypes: tuple[str, ...] | None = None
) -> TopKModule:
    """Load a library built by ``ignis.compiler.kernels.topk.build_topk`` (lean TVM runtime).

    Args:
        path: the ``.so``.
        name: the exported function (the manifest entry's ``name``).
        dtypes: the input dtypes it was built for (None: float32, bfloat16 and float16).

    Raises:
        TvmRuntimeError: the file is missing or cannot be loaded, or lacks the function.
    """
    from ignis.runtime.kernels.tvm_runtime import TvmRuntimeError, load_module

    module = load_module(path, cuda=True)
    try:
        func = module[name]
    except Exception as exc:  # tvm_ffi raises AttributeError or its own errors
        raise TvmRuntimeError(f"compiled module {path} has no function {name!r}: {exc}") from exc
    return TopKModule(func, dtypes=dtypes)


# Rank space: float64, finite, ordered like the tie rule's values (NaN above +inf, -0.0 == +0.0).
# Exact for float32 / bfloat16 / float16 values, whose magnitudes stay below 3.4e38.
_NAN_RANK = 2.0e300
_INF_RANK = 1.0e300
_LOW_RANK = -3.0e300  # below every rank: a candidate that must not be chosen


def _rank(v: torch.Tensor) -> torch.Tensor:
    """float64 copy of a float32 / bfloat16 / float16 tensor ordered like the tie rule (3 ops)."""
    r = v.to(torch.float64)  # a copy: never the caller's tensor
    return r.nan_to_num_(nan=_NAN_RANK, posinf=_INF_RANK, neginf=-_INF_RANK).add_(0.0)  # -0.0 + 0.0 = +0.0


def topk_torch(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tie rule in torch, any device: (values [..., k] in x's dtype, indices int64 [..., k]).

    float32 / bfloat16 / float16, per row of ``x`` [rows, V], with ``t`` the row's k-th value:

    * on a GPU (any device but the CPU), :func:`_topk_fixed`: a fixed sequence of ops with no host
      synchronisation and no branch on the data (it runs on "meta" tensors): ``torch.topk``'s set,
      its elements equal to ``t`` replaced by the smallest-index elements equal to ``t`` over the
      whole row (a running count and a binary search), ordered by (value descending, index
      ascending);
    * on the CPU, where a branch on the data costs nothing: ``torch.topk(x, k + 1)``; rows whose
      k-th and (k+1)-th values differ (the usual case for logits) keep its set, ordered the same
      way; only rows tied at the boundary take :func:`_topk_fixed`.

    float64 (either device): ``torch.topk(x, k + 1)`` and a stable sort of those candidates; rows
    tied at the boundary take the stable sort of the whole row.

    Raises:
        TypeError: x is not a float tensor.
        RuntimeError: k > V.
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
    if x.dtype == torch.float64:
        idx = _topk_float64(x2, k)
    elif x.device.type == "cpu":
        idx = _topk_branching(x2, k)
    else:
        idx = _topk_fixed(x2, k)
    return _gather_bits(x2, idx).view(*lead, k), idx.view(*lead, k)


def _order(idx: torch.Tensor, rank: torch.Tensor, k: int) -> torch.Tensor:
    """The first ``k`` of candidates ``idx`` [rows, n] (int64) by (``rank`` descending, index
    ascending): a sort by index, then a stable sort by rank (float64, finite, no -0.0)."""
    by_index, perm = torch.sort(idx, dim=-1)
    order = torch.sort(rank.gather(-1, perm), dim=-1, descending=True, stable=True).indices
    return by_index.gather(-1, order[:, :k])


def _topk_fixed(x2: torch.Tensor, k: int) -> torch.Tensor:
    """Indices int64 [rows, k] of the tie rule for ``x2`` [rows, V] float32 / bfloat16 / float16,
    1 <= k <= V, with no host synchronisation:

    1. ``torch.topk(x2, k, sorted=False)``: every element above the k-th value ``t`` (under the rule:
       NaN above +inf, -0.0 == +0.0), and some of those equal to ``t``;
    2. those above ``t`` are kept; those equal to ``t`` are dropped (rank below everything);
    3. over the whole row, the j-th element equal to ``t`` is where their running count first
       reaches j (``cumsum`` then ``searchsorted``), j = 1..k (V, clamped to V - 1, past the last);
    4. the 2k candidates by (value descending, index ascending), first k: every element above ``t``
       then the smallest-index elements equal to ``t`` (there are at least as many as topk held,
       and the padding repeats the largest index, after them).
    """
    rows, vocab = x2.shape
    vals, idx = torch.topk(x2, k, dim=-1, sorted=False)
    r = _rank(vals)  # [rows, k]
    kpos = r.argmin(dim=-1, keepdim=True)
    t_rank = r.gather(-1, kpos)  # [rows, 1]: the k-th value, ranked
    t = vals.gather(-1, kpos)  # the same value in x's dtype
    above = torch.where(r > t_rank, r, _LOW_RANK)
    tied = torch.where(torch.isnan(t), torch.isnan(x2), x2 == t)  # [rows, V]
    count = tied.cumsum(dim=-1, dtype=torch.int32)
    first = torch.searchsorted(count, _ordinals(rows, k, x2.device))  # [rows, k]
    cand = torch.cat([idx, first.clamp_max_(vocab - 1)], dim=-1)  # [rows, 2k]
    return _order(cand, torch.cat([above, t_rank.expand(rows, k)], dim=-1), k)


def _topk_branching(x2: torch.Tensor, k: int) -> torch.Tensor:
    """Like `_topk_fixed` (same arguments and result), with a branch on the data: rows not tied at
    the boundary are ordered from ``torch.topk(x2, k + 1)`` alone; the others take `_topk_fixed`."""
    vocab = x2.shape[1]
    vals, idx = torch.topk(x2, min(k + 1, vocab), dim=-1)  # sorted: NaN first, the rule's order
    r = _rank(vals)
    out = _order(idx[:, :k], r[:, :k], k)
    if k < vocab:
        tied = (r[:, k - 1] == r[:, k]).nonzero().flatten()
        if tied.numel():
            out[tied] = _topk_fixed(x2[tied], k)
    return out


def _topk_float64(x2: torch.Tensor, k: int) -> torch.Tensor:
    """The tie rule's indices [rows, k] for float64 ``x2`` [rows, V] (the rank space cannot hold
    it): ``torch.topk(x2, k + 1)``, its k by a stable sort; rows tied at the boundary take the
    stable sort of the whole row. ``+ 0.0`` turns -0.0 into +0.0 (equal under the rule)."""
    vocab = x2.shape[1]
    vals, idx = torch.topk(x2, min(k + 1, vocab), dim=-1)
    cand = torch.sort(idx[:, :k], dim=-1).values  # ascending indices: the stable sort keeps them so
    pos = torch.sort(x2.gather(-1, cand) + 0.0, dim=-1, descending=True, stable=True).indices  # NaN first
    out = cand.gather(-1, pos)
    if k < vocab:
        a, b = vals[:, k - 1], vals[:, k]
        tied = ((a == b) | (torch.isnan(a) & torch.isnan(b))).nonzero().flatten()
        if tied.numel():
            whole = torch.sort(x2[tied] + 0.0, dim=-1, descending=True, stable=True).indices
            out[tied] = whole[:, :k]
    return out


_ORDINALS: dict[tuple[int, int, str], torch.Tensor] = {}


def _ordinals(rows: int, k: int, device: torch.device) -> torch.Tensor:
    """int32 [rows, k] holding 1..k in every row (cached per shape and device)."""
    key = (rows, k, str(device))
    t = _ORDINALS.get(key)
    if t is None:
        if len(_ORDINALS) > 64:
            _ORDINALS.clear()
        t = torch.arange(1, k + 1, dtype=torch.int32, device=device).repeat(rows, 1)
        _ORDINALS[key] = t
    return t


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
