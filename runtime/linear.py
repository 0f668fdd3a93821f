"""Linear-layer dispatch for the verify round: torch dense, q4_g32 torch reference, compiled TVM modules.

The executors compute every linear layer of a round on all R rows at once. `LinearBackend` is the
one function they call for it, in place of `torch.nn.functional.linear`:

    y = linear(x, weight, bias)    # x [..., K]; weight torch [N, K] or Q4Weight [N, K]; -> [..., N]

Dispatch, per call, with R = the rows of x (all leading dims flattened):

1. When the artifact has compiled modules: the width is the smallest compiled width W >= R; the
   module function for (weight kind, N, K, x dtype) at W runs on x padded with zero rows to W (no
   padding for dynamic-row modules), writing y [W, N]; the first R rows are returned (+ bias).
2. R above every compiled width (a prompt's prefill): a tiled q4 weight on CUDA with at least
   `DEQUANT_MIN_ROWS` rows is dequantized to x's dtype by the module's ``q4_g32_tiled_dequant`` and
   runs one `F.linear` (cuBLAS); another q4 weight runs the compiled functions on chunks of the
   widest width; a dense weight runs torch.
3. No function for that width and shape (a module missing, or a shape the build did not cover):
   torch, with one logged warning per (width, kind, N, K, dtype).
4. Torch: `F.linear` for a dense weight; for a `Q4Weight` the reference dequantizes the weight to
   x's dtype on the fly (exact: (q - 8) * scale; a tiled weight is untiled first, slower) and then
   runs `F.linear`.

The weight kind of a `Q4Weight` is its layout's (`Q4_KINDS`): a row-major one runs "q4_g32"
functions (`name(x, packed [N, K/8], scales [N, K/32], y)`), a tiled one "q4_g32_tiled" functions
(`name(x, codes [T, K/128, 256], scales [T, K/128, 64], y)`, the CUDA tiled kernel).

Tiled placement: when the artifact's CUDA modules serve a q4 shape with "q4_g32_tiled" functions,
the weights of that shape must be in the tiled layout on the device. `LinearBackend.place` does it
for one weight (after its copy to the device: tile it there, then the row-major copy can be
dropped, so the peak is about one extra weight plus ~16 x `TILE_CHUNK_BYTES` of temporaries) and
runs each tiled function of that shape at the fewest and the most rows the dispatch gives it (the
kernel's workspace grows on a call that needs more, which cannot happen during CUDA-graph capture:
every weight is placed before the first capture).
`tile_decision` is the rule (CPU-testable); `Artifact` places the weights it loads, and
`WeightLoader` / the executors place the ones they fuse or receive (`place_weight`).

`LinearBackend.counts` counts calls per route ("compiled", "torch", "fallback"), so tests and
benchmarks can see which path ran.

Executors that take the hook receive linear weights that are dense tensors or `Q4Weight`s (q4_g32
artifacts keep their codes when compiled modules run them); they fuse weights with `cat_rows`, move
them with `to_device`, and may index a `Q4Weight`'s leading dims or slice its rows (`w[e]`,
`w[e, :I]`), never its input dimension. A tiled `Q4Weight` takes row slices on 16-row tile boundaries
only and fuses only when every part's N % 16 == 0: executors fuse row-major weights and place the
result (`place_weight`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ignis.runtime.kernels.q4_tiled import (
    GROUP,
    STEP_K,
    TILE_ROWS,
    Q4TiledLayoutError,
    pad_q4_columns,
    q4_codes,
    tile_q4,
    tiled_shapes,
    untile_q4,
)

__all__ = [
    "Q4_KINDS",
    "ROW_MAJOR",
    "TILED",
    "CompiledLinears",
    "LinearBackend",
    "LinearFn",
    "Q4TiledLayoutError",
    "Q4Weight",
    "cat_rows",
    "dequantize_q4",
    "place_weight",
    "row_splits_of",
    "tile_decision",
    "to_device",
    "torch_linear",
]

log = logging.getLogger("ignis.runtime.linear")

#: Q4Weight layouts: the stored row-major q4_g32 one and the CUDA tiled kernel's
#: (`ignis.runtime.kernels.q4_tiled`).
ROW_MAJOR = "row_major"
TILED = "tiled"

#: Manifest function kind per Q4Weight layout (`formats.manifest.FUNCTION_KINDS`).
Q4_KINDS = {ROW_MAJOR: "q4_g32", TILED: "q4_g32_tiled"}
_Q4_KIND_SET = frozenset(Q4_KINDS.values())

#: Codes bytes `Q4Weight.to_tiled` re-lays per step (its temporaries are ~16x that).
TILE_CHUNK_BYTES = 16 * 1024 * 1024

#: torch dtype -> the activation dtype names used in the manifest.
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}

#: The executors' linear hook: ``linear(x [..., K], weight [N, K], bias [N] | None) -> [..., N]``
#: (`F.linear`, or a `LinearBackend`, which also takes `Q4Weight`s).
LinearFn = Callable[..., torch.Tensor]

# Bound once at import: the torch route must not re-enter a hook that replaced F.linear.
_F_LINEAR = F.linear


def dequantize_q4(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize q4_g32 parts: value of input i = (q_i - 8) * scales[..., i // 32], computed exactly.

    Args:
        packed: uint32 or int32 [*lead, K/8]; nibble j of word c holds input 8c + j.
        scales: float16 [*lead, K/32].
        dtype: result dtype (float32 is exact; bf16/f16 round the exact product once).

    Returns:
        [*lead, K] of `dtype`, on packed's device.

    Raises:
        ValueError: the part shapes do not match.
    """
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 8 != scales.shape[-1] * 32:
        raise ValueError(
            f"q4_g32 parts do not match: packed {tuple(packed.shape)}, scales {tuple(scales.shape)}"
        )
    k = packed.shape[-1] * 8
    values = q4_codes(packed).to(torch.float32) - 8
    out = values.reshape(*packed.shape[:-1], k // 32, 32) * scales.to(torch.float32).unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], k).to(dtype)


@dataclass(frozen=True)
class Q4Weight:
    """A q4_g32 linear weight [N, K] (or a stack [*lead, N, K]) as its two parts, in one of two layouts.

    * "row_major" (the stored layout, `formats/q4.py`; the default): packed uint32 (or int32)
      [*lead, N, K/8], scales float16 [*lead, N, K/32].
    * "tiled" (what the CUDA tiled kernel streams, `ignis.runtime.kernels.q4_tiled`): packed
      [*lead, T, S, 256] (uint32 or int32), scales float16 [*lead, T, S, 64], T = ceil(N / 16),
      S = ceil(K / 128); N is kept in `rows` (the last tile's padding rows dequantize to 0), and a K
      that is not a multiple of 128 in `cols` (the last k-step's columns past K: code 8, scale 0,
      dequantizing to exactly 0; the tiled functions then take activations padded with zero columns
      to S * 128, `padded_in_features`). Made by `to_tiled()`, undone by `to_row_major()`.

    Attributes:
        packed: the codes, as above.
        scales: the group scales, as above.
        layout: "row_major" or "tiled".
        rows: N for a tiled weight; None for a row-major one (N is then the parts' shape).
        cols: K for a tiled weight whose last k-step is padded; None otherwise (K is then S * 128,
            or the row-major parts' shape).

    Raises (at construction):
        ValueError: the parts do not match each other or their layout, wrong dtypes, an unknown
            layout, `rows` given for a row-major weight or outside ((T - 1) * 16, T * 16] for a tiled
            one, `cols` given for a row-major weight or, for a tiled one, not a multiple of 32 in
            ((S - 1) * 128, S * 128). (`Q4TiledLayoutError`, a ValueError, for tiled parts.)
    """

    packed: torch.Tensor
    scales: torch.Tensor
    layout: str = ROW_MAJOR
    rows: int | None = None
    cols: int | None = None

    def __post_init__(self) -> None:
        p, s = self.packed, self.scales
        if s.dtype != torch.float16 or p.dtype not in (torch.uint32, torch.int32):
            raise ValueError(f"Q4Weight needs u32/i32 packed and f16 scales, got {p.dtype}, {s.dtype}")
        if self.layout == ROW_MAJOR:
            if self.rows is not None or self.cols is not None:
                raise ValueError(
                    f"a row-major Q4Weight takes no rows / cols (got {self.rows} / {self.cols}): N and K "
                    f"are its shape's"
                )
            if p.dim() < 2 or p.shape[:-1] != s.shape[:-1] or p.shape[-1] * 8 != s.shape[-1] * 32:
                raise ValueError(
                    f"Q4Weight parts do not match: packed {tuple(p.shape)}, scales {tuple(s.shape)}"
                )
        elif self.layout == TILED:
            if p.dim() < 3 or p.shape[-1] != 256 or s.shape[:-1] != p.shape[:-1] or s.shape[-1] != 64:
                raise Q4TiledLayoutError(
                    f"tiled Q4Weight parts must be [*lead, T, S, 256] and [*lead, T, S, 64], got packed "
                    f"{tuple(p.shape)}, scales {tuple(s.shape)}"
                )
            t = int(p.shape[-3])
            rows_ok = isinstance(self.rows, int) and not isinstance(self.rows, bool)
            if not rows_ok or not (t - 1) * TILE_ROWS < self.rows <= t * TILE_ROWS:
                raise Q4TiledLayoutError(
                    f"a tiled Q4Weight of {t} tiles holds {(t - 1) * 16 + 1}..{t * 16} rows, "
                    f"got rows={self.rows!r}"
                )
            if self.cols is not None:
                steps = int(p.shape[-2])
                cols_ok = isinstance(self.cols, int) and not isinstance(self.cols, bool)
                if not cols_ok or self.cols % GROUP or not (steps - 1) * STEP_K < self.cols < steps * STEP_K:
                    raise Q4TiledLayoutError(
                        f"a padded tiled Q4Weight of {steps} k-steps holds a multiple of {GROUP} in "
                        f"({(steps - 1) * STEP_K}, {steps * STEP_K}) input columns, got cols={self.cols!r}"
                    )
        else:
            raise ValueError(f"Q4Weight layout must be {ROW_MAJOR!r} or {TILED!r}, got {self.layout!r}")

    @property
    def is_tiled(self) -> bool:
        """The parts are in the tiled layout."""
        return self.layout == TILED

    @property
    def lead(self) -> tuple[int, ...]:
        """The leading (stack) dims, e.g. (E,) for an expert stack; () for one weight."""
        return tuple(self.packed.shape[: -3 if self.is_tiled else -2])

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [*lead, N, K] (the same in both layouts)."""
        return (*self.lead, self.out_features, self.in_features)

    @property
    def out_features(self) -> int:
        """N."""
        if self.is_tiled:
            assert self.rows is not None
            return self.rows
        return int(self.scales.shape[-2])

    @property
    def in_features(self) -> int:
        """K (the model's; a padded tiled weight's `cols`)."""
        if self.is_tiled:
            return self.cols if self.cols is not None else int(self.scales.shape[-2]) * STEP_K
        return int(self.scales.shape[-1]) * 32

    @property
    def padded_in_features(self) -> int:
        """The K the parts hold: S * 128 for a tiled weight (K, or K padded with zero columns), K
        for a row-major one. Activations of a tiled function have this many columns."""
        if self.is_tiled:
            return int(self.scales.shape[-2]) * STEP_K
        return self.in_features

    @property
    def device(self) -> torch.device:
        """Where the parts live."""
        return self.packed.device

    def __getitem__(self, index: Any) -> Q4Weight:
        """Index the leading dims or slice the rows (never the K axis): w[e], w[e, :I], w[a:b].

        A row-major weight takes any index torch takes on its parts' leading axes. A tiled weight
        takes ints and slices: the lead dims by any int or slice, the row axis only by a step-1 slice
        that starts on a 16-row tile boundary and stops on one or at N (it then slices the tile axis
        and the result has the slice's rows).

        Raises:
            Q4TiledLayoutError: (tiled) a row slice off the 16-row tile boundaries, a row index that is
                an int, a step other than 1, an index into the K axis, or an index type other than int
                and slice (Ellipsis, None, tensors).
        """
        if not self.is_tiled:
            p, s = self.packed[index], self.scales[index]
            return Q4Weight(p, s)
        items = index if isinstance(index, tuple) else (index,)
        nl = len(self.lead)
        for it in items:
            if not isinstance(it, int | slice) or isinstance(it, bool):
                raise Q4TiledLayoutError(
                    f"a tiled Q4Weight takes int and slice indices only, got {type(it).__name__}"
                )
        if len(items) > nl + 1:
            raise Q4TiledLayoutError(
                f"index {index!r} reaches the K axis of a tiled Q4Weight {self.shape}; only the lead dims "
                f"and the rows may be indexed"
            )
        rows = self.out_features
        if len(items) == nl + 1:
            r = items[-1]
            if isinstance(r, int):
                raise Q4TiledLayoutError(
                    f"a tiled Q4Weight cannot select one row (index {r}); slice whole 16-row tiles"
                )
            start, stop, step = r.indices(rows)
            if step != 1 or stop <= start or start % TILE_ROWS or (stop % TILE_ROWS and stop != rows):
                raise Q4TiledLayoutError(
                    f"row slice {r.start}:{r.stop}:{r.step} of a tiled Q4Weight with {rows} rows is not on "
                    f"16-row tile boundaries (start a multiple of 16, stop a multiple of 16 or {rows}, "
                    f"step 1, non-empty); slice the row-major weight before tiling it (`to_row_major()`)"
                )
            tiles = slice(start // TILE_ROWS, -(-stop // TILE_ROWS))
            items = (*items[:-1], tiles)
            rows = stop - start
        return Q4Weight(self.packed[items], self.scales[items], TILED, rows, self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense tensor [*lead, N, K] of `dtype` (exact in float32; a tiled weight is
        untiled first, exactly)."""
        w = self.to_row_major()
        return dequantize_q4(w.packed, w.scales, dtype)

    def to(self, device: torch.device | str) -> Q4Weight:
        """The same weight (same layout) on `device`."""
        return Q4Weight(self.packed.to(device), self.scales.to(device), self.layout, self.rows, self.cols)

    def contiguous(self) -> Q4Weight:
        """Both parts contiguous (no copy when they already are)."""
        if self.packed.is_contiguous() and self.scales.is_contiguous():
            return self
        return Q4Weight(self.packed.contiguous(), self.scales.contiguous(), self.layout, self.rows, self.cols)

    def to_tiled(self, *, chunk_bytes: int = TILE_CHUNK_BYTES, pad_k: bool = False) -> Q4Weight:
        """The tiled form (`ignis.runtime.kernels.q4_tiled.tile_q4`), computed on the weight's device; itself
        when already tiled.

        Tiles `chunk_bytes` of codes at a time (whole 16-row tiles, one stack member at a time), so the
        transform's temporaries stay ~16 x chunk_bytes whatever the weight's size; the result is the
        same as one `tile_q4` call.

        Args:
            pad_k: a K that is not a multiple of 128 is padded with zero columns (code 8, scale 0)
                to the next one (`pad_q4_columns`; the result's `cols` is K).

        Raises:
            Q4TiledLayoutError: K is not a multiple of 128 (and pad_k is off).
        """
        if self.is_tiled:
            return self
        n, k = self.out_features, self.in_features
        kp = -(-k // STEP_K) * STEP_K if pad_k else k
        (t, s, _), _ = tiled_shapes(n, kp)
        lead = self.lead
        packed = self.packed.reshape(-1, n, k // 8)
        scales = self.scales.reshape(-1, n, k // 32)
        # int32 storage (uint32 tensors support few ops on every device); viewed back at the end
        codes = torch.empty((packed.shape[0], t, s, 256), dtype=torch.int32, device=packed.device)
        tsc = scales.new_empty((packed.shape[0], t, s, 64))
        row_bytes = k // 2
        step = max(TILE_ROWS, (chunk_bytes // max(1, row_bytes)) // TILE_ROWS * TILE_ROWS)
        for m in range(packed.shape[0]):
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                c, sc = tile_q4(*pad_q4_columns(packed[m, r0:r1], scales[m, r0:r1], kp))
                tiles = slice(r0 // TILE_ROWS, r0 // TILE_ROWS + c.shape[0])
                codes[m, tiles] = c.view(torch.int32) if c.dtype == torch.uint32 else c
                tsc[m, tiles] = sc
        out = codes.view(torch.uint32) if packed.dtype == torch.uint32 else codes
        cols = k if kp != k else None
        return Q4Weight(out.reshape(*lead, t, s, 256), tsc.reshape(*lead, t, s, 64), TILED, n, cols)

    def to_row_major(self) -> Q4Weight:
        """The stored row-major form (`ignis.runtime.kernels.q4_tiled.untile_q4`, exact); itself when already
        row-major."""
        if not self.is_tiled:
            return self
        assert self.rows is not None
        p, s = untile_q4(self.packed, self.scales, self.rows)
        if self.cols is not None:  # drop the padding columns
            p, s = p[..., : self.cols // 8].contiguous(), s[..., : self.cols // GROUP].contiguous()
        return Q4Weight(p, s)

    @staticmethod
    def cat_rows(weights: Sequence[Q4Weight]) -> Q4Weight:
        """Concatenate along the output rows (a fused projection such as q|k|v); all K equal.

        Row-major weights concatenate their parts' rows. Tiled weights concatenate along the tile
        axis, which needs every part's N to be a multiple of 16 (no padding rows inside the result).

        Raises:
            Q4TiledLayoutError: a mix of layouts, or tiled parts with N % 16 != 0 (fuse the row-major
                weights first and tile the result).
        """
        layouts = {w.layout for w in weights}
        if layouts == {TILED}:
            bad = [w.out_features for w in weights if w.out_features % TILE_ROWS]
            if len({w.cols for w in weights}) > 1:
                ks = [w.in_features for w in weights]
                raise Q4TiledLayoutError(f"cat_rows of tiled Q4Weights needs one in_features, got {ks}")
            if bad:
                raise Q4TiledLayoutError(
                    f"cat_rows of tiled Q4Weights needs every part's out_features to be a multiple of "
                    f"{TILE_ROWS}, got {[w.out_features for w in weights]}; fuse the row-major weights "
                    f"before tiling"
                )
            return Q4Weight(
                torch.cat([w.packed for w in weights], dim=-3),
                torch.cat([w.scales for w in weights], dim=-3),
                TILED,
                sum(w.out_features for w in weights),
                weights[0].cols,
            )
        if len(layouts) > 1:
            raise Q4TiledLayoutError(
                "cat_rows: cannot fuse row-major and tiled Q4Weights; fuse the row-major weights "
                "before tiling (or `to_row_major()` the tiled ones)"
            )
        return Q4Weight(
            torch.cat([w.packed for w in weights], dim=-2), torch.cat([w.scales for w in weights], dim=-2)
        )


def cat_rows(weights: Sequence[torch.Tensor | Q4Weight]) -> torch.Tensor | Q4Weight:
    """Concatenate linear weights along their output rows (a fused q|k|v or gate|up projection).

    Dense tensors go through `torch.cat(dim=0)`; `Q4Weight`s through `Q4Weight.cat_rows`.

    Raises:
        TypeError: a mix of dense and q4 weights.
    """
    if all(isinstance(w, Q4Weight) for w in weights):
        return Q4Weight.cat_rows([w for w in weights if isinstance(w, Q4Weight)])
    if any(isinstance(w, Q4Weight) for w in weights):
        raise TypeError("cat_rows: cannot fuse dense and q4_g32 weights into one")
    return torch.cat([w for w in weights if isinstance(w, torch.Tensor)], dim=0)


def to_device(
    weight: torch.Tensor | Q4Weight, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor | Q4Weight:
    """Move a linear weight to `device`; a dense weight is also cast to `dtype` (a `Q4Weight` keeps
    its packed codes and f16 scales)."""
    if isinstance(weight, Q4Weight):
        return weight.to(device)
    return weight.to(device=device, dtype=dtype) if dtype is not None else weight.to(device)


def row_splits_of(name: str) -> int:
    """How many equal row blocks the executors slice a stored linear weight into before a linear runs
    on them: 2 for a fused expert stack ``*gate_up_proj`` [E, 2 I, K] (``w[e, :I]``, ``w[e, I:]``),
    else 1 (the rule of the build's `linear_shapes`)."""
    return 2 if name.endswith("gate_up_proj") else 1


def tile_decision(shape: Sequence[int], served: Collection[tuple[int, int]], *, row_splits: int = 1) -> bool:
    """Whether a row-major q4 weight of logical `shape` [*lead, N, K] goes to the tiled layout.

    Yes when K % 32 == 0, N splits into `row_splits` equal blocks of R rows that a tiled function
    serves ((R, K) in `served`; for K % 128 != 0 only a function built with ``padded_in_features``
    serves it, and the weight is then tiled with `Q4Weight.to_tiled(pad_k=True)`) and, when the
    weight is sliced (`row_splits` > 1), R % 16 == 0 (the slices must fall on tile boundaries; a stack
    that cannot be sliced so stays row-major and its linears run wherever a row-major function or
    torch serves them). Lead dims (expert stacks) are indexed whole-row and do not matter.

    Args:
        shape: [*lead, N, K].
        served: the (N, K) shapes a "q4_g32_tiled" function serves (`CompiledLinears.tiled_shapes`).
        row_splits: `row_splits_of(name)`.

    Raises:
        ValueError: shape has fewer than 2 dims or row_splits < 1.
    """
    if len(shape) < 2 or row_splits < 1:
        raise ValueError(
            f"tile_decision: need a shape [*lead, N, K] and row_splits >= 1, got {shape}, {row_splits}"
        )
    n, k = int(shape[-2]), int(shape[-1])
    if k <= 0 or k % GROUP or n % row_splits:
        return False
    part = n // row_splits
    if row_splits > 1 and part % TILE_ROWS:
        return False
    return (part, k) in served


def place_weight(linear: Any, weight: Any, *, row_splits: int = 1) -> Any:
    """`linear.place(weight, row_splits=...)` when the hook is a `LinearBackend` (or has `place`),
    else `weight` unchanged (torch's `F.linear`, or a dense weight)."""
    place = getattr(linear, "place", None)
    if place is None or not isinstance(weight, Q4Weight):
        return weight
    return place(weight, row_splits=row_splits)


class WeightLoader:
    """Fetches a module's weights by name onto one device and dtype: plain tensors (embeddings, norms,
    convolution kernels) and linear weights (dense or `Q4Weight`, which keeps its packed dtype).

    Args:
        weights: name -> tensor or `Q4Weight`.
        device: where every fetched weight lands.
        dtype: the dtype of fetched dense weights.
        source: named in errors (e.g. "mtp weights").
        linear: the executor's linear hook; a `LinearBackend` places each fetched q4 linear weight
            in the layout its compiled functions take (`place_weight`; tiled on CUDA when served).

    Raises (from `plain`):
        TypeError: a `Q4Weight` where only a plain tensor is allowed.
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor | Q4Weight],
        device: torch.device,
        dtype: torch.dtype,
        *,
        source: str,
        linear: Any = None,
    ) -> None:
        self.weights, self.device, self.dtype, self.source = weights, device, dtype, source
        self.hook = linear

    def plain(self, name: str) -> torch.Tensor:
        """A non-linear weight as a dense tensor on the device, in the dtype."""
        t = self.weights[name]
        if isinstance(t, Q4Weight):
            raise TypeError(f"{self.source}: {name} is q4_g32; only linear weights may be Q4Weight")
        return t.detach().to(device=self.device, dtype=self.dtype)

    def linear(self, name: str) -> torch.Tensor | Q4Weight:
        """A linear weight (dense or Q4Weight, placed for the hook: `place_weight`) on the device."""
        t = self.weights[name]
        w = to_device(t if isinstance(t, Q4Weight) else t.detach(), self.device, self.dtype)
        return place_weight(self.hook, w, row_splits=row_splits_of(name))

    def optional(self, name: str) -> torch.Tensor | None:
        """`plain(name)`, or None when the checkpoint has no such tensor (e.g. an absent bias)."""
        return self.plain(name) if name in self.weights else None

    def optional_linear(self, name: str) -> torch.Tensor | Q4Weight | None:
        """`linear(name)`, or None when absent."""
        return self.linear(name) if name in self.weights else None


def torch_linear(
    x: torch.Tensor, weight: torch.Tensor | Q4Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch route: `F.linear`, dequantizing a `Q4Weight` to x's dtype first (x [..., K], or
    [..., K'] pre-padded for a padded tiled weight: its first K columns are used)."""
    if isinstance(weight, Q4Weight):
        if x.shape[-1] != weight.in_features:
            x = x[..., : weight.in_features]
        return _F_LINEAR(x, weight.dequantize(x.dtype), bias)
    return _F_LINEAR(x, weight, bias)


DEQUANT_FUNCTION_NAME = "q4_g32_tiled_dequant"
"""The export of a tiled q4 module that dequantizes tiled weights (`compiler/kernels/q4_dequant.cuh`)."""

DEQUANT_MIN_ROWS = 256
"""Fewest rows of a q4 linear (above every compiled width) that run as dequantize + one GEMM instead
of chunks of the widest compiled width: the dequantized weight is written and read once (~4.5 bytes a
weight) where each chunk streams the codes again, so the GEMM route wins from a few chunks on (the
crossover is measured in docs/perf)."""


def find_dequant(module: Any) -> Any:
    """The module's `DEQUANT_FUNCTION_NAME` function, or None (a module built without it)."""
    try:
        return module[DEQUANT_FUNCTION_NAME]
    except Exception:  # tvm_ffi raises AttributeError / its own errors for a missing export
        return None


@dataclass(frozen=True)
class _Fn:
    call: Any  # the tvm_ffi function
    dynamic_rows: bool
    cuda: bool
    module: str = ""  # the library file (functions of one file share the tiled kernel's workspace)


class CompiledLinears:
    """The compiled linear functions of an artifact, by (width, kind, N, K, dtype).

    Args:
        functions: (width, kind, out_features, in_features, dtype) -> (tvm_ffi function, dynamic_rows,
            is_cuda) or (..., module file); kind "dense", "q4_g32" or "q4_g32_tiled".
        widths: every width the artifact was built for (ascending), whether or not a module loaded.
        dequant: the tiled modules' ``q4_g32_tiled_dequant(codes [B, T, S, 256], scales [B, T, S, 64],
            out [B, N, K] bf16|f16)`` (`compiler/kernels/q4_dequant.cuh`), or None: the prefill route
            of `LinearBackend` (`DEQUANT_MIN_ROWS`).
    """

    def __init__(
        self,
        functions: Mapping[tuple[int, str, int, int, str], tuple[Any, ...]],
        widths: Sequence[int],
        *,
        dequant: Any = None,
    ) -> None:
        self._fns = {k: _Fn(*v) for k, v in functions.items()}
        self.widths = tuple(sorted(set(widths)))
        self.dequant = dequant
        # Weight kinds the build compiled at all: a CUDA build compiles q4_g32 functions only and keeps
        # small precise linears (router, gates) dense on purpose, so those run on torch by design.
        self.kinds = frozenset(key[1] for key in self._fns)

    def tiled_shapes(self, *, cuda: bool) -> frozenset[tuple[int, int]]:
        """The (N, K) shapes a "q4_g32_tiled" function serves at some width, among the CUDA functions
        (`cuda=True`) or the others (a host / test function)."""
        return frozenset(
            (key[2], key[3]) for key, fn in self._fns.items() if key[1] == Q4_KINDS[TILED] and fn.cuda == cuda
        )

    def functions_for(self, kind: str, n: int, k: int) -> list[tuple[tuple[int, str, int, int, str], _Fn]]:
        """Every (key, function) of `kind` for an [n, k] weight, over widths and dtypes."""
        return [(key, fn) for key, fn in self._fns.items() if key[1:4] == (kind, n, k)]

    def __len__(self) -> int:
        return len(self._fns)

    def width_for(self, rows: int) -> int | None:
        """The smallest width >= rows, or None when rows exceeds every width."""
        return next((w for w in self.widths if w >= rows), None)

    def get(self, width: int, kind: str, n: int, k: int, dtype: str) -> _Fn | None:
        """The function for this width and shape, or None."""
        return self._fns.get((width, kind, n, k, dtype))

    @classmethod
    def load(cls, artifact_dir: str | Path, manifest: Any) -> CompiledLinears:
        """Load every module of `manifest` (an `ignis.formats.Manifest`) with the lean TVM runtime.

        A module that cannot be loaded (no TVM runtime libraries on this host, CUDA modules without a
        GPU: one warning for all of them) is skipped with a logged warning; its widths then fall back
        to torch.
        """
        from ignis.runtime.kernels.tvm_runtime import TvmRuntimeError, load_module

        root = Path(artifact_dir)
        loaded: dict[str, Any] = {}
        functions: dict[tuple[int, str, int, int, str], tuple[Any, ...]] = {}
        dequant = None
        cuda_files = sorted({e.file for e in manifest.modules if e.target.get("kind") == "cuda"})
        if cuda_files and not torch.cuda.is_available():
            log.warning(
                "no CUDA device: the artifact's %d CUDA module(s) are not loaded; linears run on torch",
                len(cuda_files),
            )
            loaded = dict.fromkeys(cuda_files)
        for entry in manifest.modules:
            is_cuda = entry.target.get("kind") == "cuda"
            if entry.file not in loaded:
                try:
                    loaded[entry.file] = load_module(root / entry.file, cuda=is_cuda)
                except (TvmRuntimeError, ImportError, OSError) as exc:
                    log.warning(
                        "compiled module %s not loaded (%s); widths it serves run on torch", entry.file, exc
                    )
                    loaded[entry.file] = None
            mod = loaded[entry.file]
            if mod is None:
                continue
            for fn in entry.functions:
                try:
                    call = mod[fn.name]
                except Exception as exc:  # tvm_ffi raises AttributeError / its own errors
                    log.warning("module %s lacks function %s (%s)", entry.file, fn.name, exc)
                    continue
                key = (entry.width, fn.kind, fn.out_features, fn.in_features, fn.dtype)
                functions[key] = (call, entry.dynamic_rows, is_cuda, entry.file)
                if dequant is None and is_cuda and fn.kind == Q4_KINDS[TILED]:
                    dequant = find_dequant(mod)
        return cls(functions, manifest.widths, dequant=dequant)


class LinearBackend:
    """`linear(x, weight, bias)` with the dispatch of the module docstring.

    Args:
        compiled: the artifact's compiled functions, or None (torch only).

    Attributes:
        counts: calls per route: "compiled" (a q4 weight with R above every width runs as chunks of
            the widest, one count per chunk), "torch" (a dense weight with R above every width, no
            rows, no modules at all, or a
            weight kind the build compiles no function for, e.g. dense gates beside q4 modules),
            "fallback" (a module function was missing for the width and shape: logged once),
            "dequant" (a tiled q4 weight at `DEQUANT_MIN_ROWS` rows or more: dequantized + one GEMM).
    """

    def __init__(self, compiled: CompiledLinears | None = None) -> None:
        self.compiled = compiled
        self.counts = {"compiled": 0, "torch": 0, "fallback": 0, "dequant": 0}
        self._warned: set[tuple[int, str, int, int, str]] = set()
        self._reserved: set[tuple[str, tuple[int, str, int, int, str]]] = set()
        self._lock = threading.Lock()

    def place(self, weight: torch.Tensor | Q4Weight, *, row_splits: int = 1) -> torch.Tensor | Q4Weight:
        """The weight in the layout the compiled functions take, on its current device.

        A row-major `Q4Weight` whose shape the compiled "q4_g32_tiled" functions of its device kind
        serve (`tile_decision` over `CompiledLinears.tiled_shapes`) is tiled there (`to_tiled`; the
        caller drops the row-major one) and each CUDA tiled function of its shape runs on it (rows
        of zeros: the fewest and the most its width serves, once per function) so that the
        kernel's workspace has its final size before any CUDA-graph capture. Anything else (dense,
        tiled already, no tiled function for it, no compiled modules) is returned as is.

        Args:
            weight: [*lead, N, K], on the device it will run on.
            row_splits: `row_splits_of(name)`: the executor slices it into that many row blocks.

        Returns:
            The weight, tiled or unchanged.

        Raises:
            RuntimeError: (from a CUDA function) the warm-up call failed, e.g. during a capture.
        """
        if not isinstance(weight, Q4Weight) or weight.is_tiled or self.compiled is None:
            return weight
        served = self.compiled.tiled_shapes(cuda=weight.device.type == "cuda")
        if not served or not tile_decision(weight.shape, served, row_splits=row_splits):
            return weight
        tiled = weight.to_tiled(pad_k=True)  # K % 128 != 0: served only by a padded function
        self._reserve(tiled, row_splits)
        return tiled

    def _reserve(self, tiled: Q4Weight, row_splits: int) -> None:
        """Run each CUDA tiled function serving `tiled` (one stack member, one row block) at the
        fewest and at the most rows the dispatch gives it (the function of width W serves the rows
        above the next smaller compiled width up to W), once per function.

        The kernel's workspace need depends on the rows (it is largest at one end of that range: a
        call whose activations do not fit in shared memory, e.g. 19+ rows on a 248,320 x 5,120
        head, runs the warp variant, which needs more workspace than the block variant at fewer
        rows). The workspace cannot grow during a CUDA-graph capture (`q4_tiled_ffi.cuh`), so every
        function runs at both ends of its rows before any capture."""
        if self.compiled is None or tiled.device.type != "cuda":
            return
        sub = tiled
        while sub.lead:
            sub = sub[0]
        if row_splits > 1:
            sub = sub[: sub.out_features // row_splits]
        n, k = sub.out_features, sub.in_features
        kp = sub.padded_in_features  # the activations' columns (K padded for a padded function)
        sub = sub.contiguous()
        widths = self.compiled.widths
        for key, fn in self.compiled.functions_for(Q4_KINDS[TILED], n, k):
            dtype = _TORCH_DTYPES.get(key[4])
            if not fn.cuda or dtype is None or (fn.module, key) in self._reserved:
                continue
            self._reserved.add((fn.module, key))
            from ignis.runtime.kernels.tvm_runtime import torch_stream

            width = key[0]
            fewest = 1 + max((w for w in widths if w < width), default=0)
            for rows in sorted({fewest, width}):
                x = torch.zeros((rows, kp), dtype=dtype, device=sub.packed.device)
                y = x.new_empty((rows, n))
                with torch_stream():
                    fn.call(x, sub.packed, sub.scales, y)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor | Q4Weight, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """y = x @ weight^T + bias.

        Args:
            x: [..., K], float32 / bfloat16 / float16; for a tiled weight padded to K' =
                `padded_in_features` columns also [..., K'] with zeros past K (the executor's
                pre-padded activations: no padding copy); a [..., K] x is padded here.
            weight: dense [N, K] (x's dtype) or `Q4Weight` [N, K] (row-major: "q4_g32" functions;
                tiled: "q4_g32_tiled" functions, parts [T, K'/128, 256] / [T, K'/128, 64]).
            bias: [N] or None.

        Returns:
            [..., N] in x's dtype.
        """
        compiled = self.compiled
        if compiled is None or not compiled.widths:
            self.counts["torch"] += 1
            return torch_linear(x, weight, bias)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        rows = int(x2.shape[0])
        if (
            rows >= DEQUANT_MIN_ROWS
            and rows > compiled.widths[-1]
            and compiled.dequant is not None
            and isinstance(weight, Q4Weight)
            and weight.layout == TILED
            and x2.is_cuda
            and x2.dtype in (torch.bfloat16, torch.float16)
        ):
            # A prefill chunk: one GEMM on the weight dequantized once, instead of streaming the codes
            # once per widest-width chunk of rows.
            self.counts["dequant"] += 1
            y = _F_LINEAR(x2[:, : weight.in_features], self.dequantize(weight, x2.dtype), bias)
            return y.reshape(*lead, weight.out_features)
        if rows > compiled.widths[-1] and isinstance(weight, Q4Weight):
            # A q4 weight wider than every compiled width (e.g. 64 rows where a profile stops at 32): run the
            # compiled modules on chunks of the widest width rather than dequantizing on torch, each
            # writing its rows of one output (no concatenation: no copy of the output). A dense weight
            # at that many rows goes to torch's GEMM (cuBLAS / MKL), which is built for it.
            step = compiled.widths[-1]
            y = x2.new_empty((rows, weight.out_features))
            for i in range(0, rows, step):
                dst = y[i : i + step]
                part = self._linear_2d(x2[i : i + step], weight, bias, dst)
                if part.data_ptr() != dst.data_ptr():
                    dst.copy_(part)
            return y.reshape(*lead, weight.out_features)
        n = weight.out_features if isinstance(weight, Q4Weight) else int(weight.shape[0])
        return self._linear_2d(x2, weight, bias).reshape(*lead, n)

    def dequantize(self, weight: Q4Weight, dtype: torch.dtype) -> torch.Tensor:
        """A tiled `Q4Weight` [*lead, N, K] (on CUDA) as a row-major [*lead, N, K] tensor of `dtype`
        (bfloat16 / float16) by the compiled ``q4_g32_tiled_dequant``: the values of `dequantize_q4`,
        (code - 8) * scale rounded once to `dtype`. A padded weight (`Q4Weight.cols`) is dequantized
        whole and its first K columns returned (a view, rows `padded_in_features` apart).

        Raises:
            ValueError: the backend has no dequantization function or the weight is not tiled.
        """
        compiled = self.compiled
        if compiled is None or compiled.dequant is None or weight.layout != TILED:
            raise ValueError("dequantize needs a tiled q4 weight and a module with q4_g32_tiled_dequant")
        lead = tuple(weight.packed.shape[:-3])
        t, s = int(weight.packed.shape[-3]), int(weight.packed.shape[-2])
        n, k, kp = weight.out_features, weight.in_features, weight.padded_in_features
        out = torch.empty((*lead, n, kp), dtype=dtype, device=weight.packed.device)
        codes = weight.packed.contiguous().reshape(-1, t, s, 256)
        scales = weight.scales.contiguous().reshape(-1, t, s, 64)
        from ignis.runtime.kernels.tvm_runtime import torch_stream

        with torch_stream():
            compiled.dequant(codes, scales, out.view(-1, n, kp))
        return out if kp == k else out[..., :k]  # a padded weight: its zero columns left out

    def _linear_2d(
        self,
        x2: torch.Tensor,
        weight: torch.Tensor | Q4Weight,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`__call__` on x2 [rows, K], rows <= the widest compiled width or a dense weight: [rows, N].
        out: a contiguous [rows, N] the compiled function writes when it can (else a new tensor)."""
        compiled = self.compiled
        assert compiled is not None
        rows = int(x2.shape[0])
        width = compiled.width_for(rows) if rows > 0 else None
        if width is None:
            self.counts["torch"] += 1
            return torch_linear(x2, weight, bias)
        is_q4 = isinstance(weight, Q4Weight)
        n = weight.out_features if isinstance(weight, Q4Weight) else int(weight.shape[0])
        kx = int(x2.shape[1])  # K, or a padded tiled weight's padded K (pre-padded activations)
        k = weight.in_features if isinstance(weight, Q4Weight) else kx
        dtype = _DTYPE_NAMES.get(x2.dtype, str(x2.dtype))
        kind = Q4_KINDS[weight.layout] if isinstance(weight, Q4Weight) else "dense"
        if kind not in compiled.kinds and not (is_q4 and compiled.kinds & _Q4_KIND_SET):
            # by design (see CompiledLinears.kinds): not a missing module. A q4 weight in a layout no
            # function takes while the build compiled q4 functions is a missing function (logged).
            self.counts["torch"] += 1
            return torch_linear(x2, weight, bias)
        fn = compiled.get(width, kind, n, k, dtype)
        if fn is None or (not is_q4 and isinstance(weight, torch.Tensor) and weight.dtype != x2.dtype):
            key = (width, kind, n, k, dtype)
            with self._lock:
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning(
                        "no compiled %s linear [%d, %d] %s for width %d (rows %d): running on torch",
                        kind,
                        n,
                        k,
                        dtype,
                        width,
                        rows,
                    )
            self.counts["fallback"] += 1
            return torch_linear(x2, weight, bias)
        kp = weight.padded_in_features if isinstance(weight, Q4Weight) else kx
        if (fn.dynamic_rows or rows == width) and kx == kp:
            xp = x2.contiguous()
        else:  # padding rows up to the width, or zero columns up to a padded weight's K
            xp = x2.new_zeros((rows if fn.dynamic_rows else width, kp))
            xp[:rows, :kx] = x2
        direct = out is not None and out.is_contiguous() and xp.shape[0] == rows and bias is None
        y = out if direct else x2.new_empty((xp.shape[0], n))
        if isinstance(weight, Q4Weight):
            w = weight.contiguous()
            args: tuple[Any, ...] = (xp, w.packed, w.scales, y)
        else:
            args = (xp, weight.contiguous(), y)
        if fn.cuda:
            from ignis.runtime.kernels.tvm_runtime import torch_stream

            with torch_stream():
                fn.call(*args)
        else:
            fn.call(*args)
        result = y[:rows]
        if bias is not None:
            result = result + bias
        self.counts["compiled"] += 1
        return result
