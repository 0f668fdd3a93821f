"""Linear layers for the `cpu` card: TensorIR definitions scheduled for the host CPU, built with LLVM.

Two functions, both destination-passing and row-major (`ignis.formats.manifest` calling convention):

* dense  ``y[W, N] = x[W, K] @ w[N, K]^T``            (f32 for the cpu profile; any float dtype)
* q4_g32 ``y[W, N] = x[W, K] @ dequant(packed, scales)^T`` with packed u32 [N, K/8] and scales
  f16 [N, K/32] in the `.ninfer` layout (nibble j of word c is input 8c + j, value (q - 8) * scale),
  dequantized in registers inside the reduction (float32 accumulation).

Schedule (TensorIR, `tvm.s_tir.Schedule`): the reduction over K is split into a vector of `vec`
lanes and factored out (`rfactor`), so each output element is `vec` partial sums in a local
buffer, vectorized over contiguous input features of x and w; output columns are tiled by
`n_block`, tiles run in parallel over the CPU threads, and inside a tile the rows of the round are
the inner loop, so every weight vector loaded is used by all W rows before it leaves the cache
(the verify round's point: W rows for the weight bytes of one). The partial sums are added in a
fixed order, so results are deterministic; they differ from torch's (another summation order) by
float32 rounding only. `vec` x W stays <= 32 (16 lanes up to 2 rows, 8 beyond): past that, the code
LLVM generates for this schedule on AVX-512 degrades sharply (the cause was not established; the runs:
docs/perf/log/2026-11-30-session-7.md, "CPU route check").

For a target that names its CPU, float32 q4_g32 functions of 5+ rows use `_tile_schedule` instead:
a [64 x 16] tile of the weights is dequantized once into a local buffer and every row's FMAs run
vectorized over the tile's 16 outputs (the per-element schedule dequantizes again for every row).
It pays from a few rows on, where one dequantization serves many FMAs; at 1-2 rows, and on the
generic target (whose dequantization is scalar), the per-element schedule is the faster one and is
kept (figures: docs/perf/README.md, "CPU"; the runs: docs/perf/log/2026-11-30-session-7.md).

Everything here imports `tvm` (the compiler); the runtime loads the exported library with the lean
runtime (`ignis.runtime.kernels.tvm_runtime.load_module`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignis.compiler.build.errors import ModuleBuildError
from ignis.compiler.kernels.cuda_stub import import_tvm_for_build

#: The generic x86-64 / host target (portable to any deployment CPU of the same ISA family).
DEFAULT_TARGET: dict[str, Any] = {"kind": "llvm"}


@dataclass(frozen=True)
class LinearSpec:
    """One function to compile.

    Attributes:
        name: exported symbol (a C identifier).
        kind: "dense" or "q4_g32".
        rows: W, the rows per call (the verify width).
        out_features: N.
        in_features: K (q4_g32: a multiple of 32).
        dtype: activation/output dtype ("float32", "float16", "bfloat16").
    """

    name: str
    kind: str
    rows: int
    out_features: int
    in_features: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ModuleBuildError(f"function name {self.name!r} is not a C identifier")
        if self.kind not in ("dense", "q4_g32"):
            raise ModuleBuildError(f"{self.name}: unknown kind {self.kind!r}")
        if min(self.rows, self.out_features, self.in_features) < 1:
            raise ModuleBuildError(f"{self.name}: sizes must be positive")
        if self.kind == "q4_g32" and self.in_features % 32:
            raise ModuleBuildError(f"{self.name}: q4_g32 needs in_features % 32 == 0, got {self.in_features}")


def _largest_divisor(n: int, candidates: Sequence[int]) -> int:
    return next(c for c in candidates if n % c == 0)


def _q4_weight(packed: Any, scales: Any, n: Any, kk: Any) -> Any:
    """Weight (n, kk) of a q4_g32 layer, float32: nibble kk % 8 of word kk // 8, (q - 8) * scale."""
    from tvm import tirx

    shift = tirx.const(4, "uint32") * (kk % 8).astype("uint32")
    q = (packed[n, kk // 8] >> shift) & tirx.const(15, "uint32")
    return (q.astype("int32") - 8).astype("float32") * scales[n, kk // 32].astype("float32")


def _definition(spec: LinearSpec) -> Any:
    import_tvm_for_build()  # driver or stub before the first `import tvm`: see cuda_stub.py
    from tvm import te

    r_, n_, k_ = spec.rows, spec.out_features, spec.in_features
    x = te.placeholder((r_, k_), spec.dtype, name="x")
    k = te.reduce_axis((0, k_), name="k")
    if spec.kind == "dense":
        w = te.placeholder((n_, k_), spec.dtype, name="w")
        y = te.compute(
            (r_, n_),
            lambda r, n: te.sum(x[r, k].astype("float32") * w[n, k].astype("float32"), axis=k),
            name="acc",
        )
        args = [x, w]
    else:
        packed = te.placeholder((n_, k_ // 8), "uint32", name="packed")
        scales = te.placeholder((n_, k_ // 32), "float16", name="scales")

        y = te.compute(
            (r_, n_),
            lambda r, n: te.sum(x[r, k].astype("float32") * _q4_weight(packed, scales, n, k), axis=k),
            name="acc",
        )
        args = [x, packed, scales]
    if spec.dtype != "float32":
        out = te.compute((r_, n_), lambda r, n: y[r, n].astype(spec.dtype), name="y")
        return te.create_prim_func([*args, out])
    return te.create_prim_func([*args, y])


#: Output features and input features of the dequantized weight tile (`_tile_schedule`).
_TILE_N, _TILE_K = 16, 64


def uses_tile_schedule(spec: LinearSpec, target: dict[str, Any] | None = None) -> bool:
    """Whether `spec` gets the dequantized-tile schedule: a float32 q4_g32 function of 5 or more rows
    for a target that names its CPU (`llvm_mcpu`: vector shifts and FMA), with out_features a multiple
    of 16 and in_features of 64: the targets and widths where dequantizing a tile once for every row
    beats the per-element schedule (on the generic x86-64 target the scalar dequantization
    dominates either way; see the module docstring)."""
    return (
        spec.kind == "q4_g32"
        and spec.dtype == "float32"
        and spec.rows >= 5
        and bool((target or {}).get("mcpu"))
        and spec.out_features % _TILE_N == 0
        and spec.in_features % _TILE_K == 0
    )


def _tile_definition(spec: LinearSpec) -> Any:
    """q4_g32 with the dequantized weight as its own stage, transposed: wdt[k, n] (float32), so a tile
    of it can be computed once and read by every row with the outputs contiguous."""
    import_tvm_for_build()
    from tvm import te

    r_, n_, k_ = spec.rows, spec.out_features, spec.in_features
    x = te.placeholder((r_, k_), "float32", name="x")
    packed = te.placeholder((n_, k_ // 8), "uint32", name="packed")
    scales = te.placeholder((n_, k_ // 32), "float16", name="scales")

    wdt = te.compute((k_, n_), lambda kk, n: _q4_weight(packed, scales, n, kk), name="wdt")
    k = te.reduce_axis((0, k_), name="k")
    y = te.compute((r_, n_), lambda r, n: te.sum(x[r, k] * wdt[k, n], axis=k), name="acc")
    return te.create_prim_func([x, packed, scales, y])


def _tile_schedule(spec: LinearSpec) -> Any:
    """Tiles of 16 output features run in parallel; inside one, each 64-feature slice of the weights is
    dequantized once into a local [64, 16] buffer and every row of the round accumulates into local
    [rows, 16] sums with FMAs vectorized over the 16 outputs (the dequantization is paid once for all
    rows, where the per-element schedule pays it per row). Sums run in k order: deterministic."""
    import tvm.s_tir as s_tir

    sch = s_tir.Schedule(_tile_definition(spec))
    acc, wdt = sch.get_sblock("acc"), sch.get_sblock("wdt")
    r, n, kk = sch.get_loops(acc)
    no, ni = sch.split(n, [None, _TILE_N])
    ko, ki = sch.split(kk, [None, _TILE_K])
    sch.reorder(no, ko, r, ki, ni)
    sch.compute_at(wdt, ko)
    sch.set_scope(wdt, 0, "local")
    local = sch.cache_write(acc, 0, "local")
    sch.reverse_compute_at(local, no)
    sch.vectorize(ni)
    sch.vectorize(sch.get_loops(local)[-1])
    sch.parallel(no)
    sch.decompose_reduction(acc, ko)
    return sch.mod["main"].with_attr("global_symbol", spec.name)


#: Lanes of the per-element schedule's partial sums at 1-2 rows (`_tree_schedule`).
_TREE_LANES = 16


def uses_tree_schedule(spec: LinearSpec, target: dict[str, Any] | None = None) -> bool:
    """Whether `spec` gets `_tree_schedule`: a float32 q4_g32 function of 1-2 rows (those the
    per-element schedule runs with 16 lanes) that `_tile_schedule` does not take."""
    return (
        spec.kind == "q4_g32"
        and spec.dtype == "float32"
        and spec.rows <= 2
        and spec.in_features % _TREE_LANES == 0
        and not uses_tile_schedule(spec, target)
    )


def _tree_definition(spec: LinearSpec) -> Any:
    """q4_g32 as 16 lane partials part[r, n, j] (sums over k = 16 k0 + j, in k0 order) and their
    pairwise sum (j with j + 8, then + 4, + 2, + 1): the rfactor of the per-element schedule with its
    final 16-term sequential sum replaced by a 4-level tree."""
    import_tvm_for_build()
    from tvm import te

    r_, n_, k_ = spec.rows, spec.out_features, spec.in_features
    x = te.placeholder((r_, k_), "float32", name="x")
    packed = te.placeholder((n_, k_ // 8), "uint32", name="packed")
    scales = te.placeholder((n_, k_ // 32), "float16", name="scales")
    k0 = te.reduce_axis((0, k_ // _TREE_LANES), name="k0")
    part = te.compute(
        (r_, n_, _TREE_LANES),
        lambda r, n, j: te.sum(
            x[r, k0 * _TREE_LANES + j] * _q4_weight(packed, scales, n, k0 * _TREE_LANES + j), axis=k0
        ),
        name="part",
    )

    def tree(r: Any, n: Any) -> Any:
        vals = [part[r, n, j] for j in range(_TREE_LANES)]
        while len(vals) > 1:
            half = len(vals) // 2
            vals = [vals[i] + vals[i + half] for i in range(half)]
        return vals[0]

    y = te.compute((r_, n_), tree, name="acc")
    return te.create_prim_func([x, packed, scales, y])


def _tree_schedule(spec: LinearSpec) -> Any:
    """Tiles of 8 output features run in parallel; per output, the 16 lane partials accumulate in
    k0 order, vectorized over the lanes, each weight vector used by every row, then are summed as a
    tree (4 dependent adds instead of 16), which shortens the dependent chain at the end of each
    output. Deterministic (a fixed pairwise order; float32 rounding differs from the per-element
    schedule's sequential sum)."""
    import tvm.s_tir as s_tir

    sch = s_tir.Schedule(_tree_definition(spec))
    acc, part = sch.get_sblock("acc"), sch.get_sblock("part")
    r, n = sch.get_loops(acc)
    no, ni = sch.split(n, [None, _largest_divisor(spec.out_features, (8, 4, 2, 1))])
    sch.reorder(no, ni, r)
    sch.compute_at(part, ni)
    loops = sch.get_loops(part)[2:]  # (r, j, k0), or (j, k0) at one row
    if len(loops) == 3:
        sch.reorder(loops[2], loops[0], loops[1])
    else:
        sch.reorder(loops[1], loops[0])
    lanes, k0 = (loops[1], loops[2]) if len(loops) == 3 else (loops[0], loops[1])
    sch.vectorize(lanes)
    sch.set_scope(part, 0, "local")
    sch.parallel(no)
    sch.decompose_reduction(part, k0)
    return sch.mod["main"].with_attr("global_symbol", spec.name)


def linear_prim_func(spec: LinearSpec, target: dict[str, Any] | None = None) -> Any:
    """The scheduled TensorIR PrimFunc of `spec` (see the module docstring), named `spec.name`; for a
    `target` that names its CPU, q4_g32 rounds of 5+ rows get `_tile_schedule`."""
    import_tvm_for_build()
    import tvm.s_tir as s_tir

    if uses_tile_schedule(spec, target):
        return _tile_schedule(spec)
    if uses_tree_schedule(spec, target):
        return _tree_schedule(spec)
    sch = s_tir.Schedule(_definition(spec))
    block = sch.get_sblock("acc")
    _r, _n, kk = sch.get_loops(block)
    # vec x rows partial sums stay <= 32 (16 lanes at 1-2 rows, 8 from 3): past 32 LLVM's AVX-512 code
    # for this schedule degrades sharply (module docstring); 8 lanes from 3 rows suit the generic target too
    vec = _largest_divisor(spec.in_features, (16, 8, 4, 2, 1) if spec.rows <= 2 else (8, 4, 2, 1))
    if vec > 1:
        _ko, ki = sch.split(kk, [None, vec])
        rf = sch.rfactor(ki, 0)
        r, n, k1 = sch.get_loops(block)
        n_block = _largest_divisor(spec.out_features, (8, 4, 2, 1))
        no, ni = sch.split(n, [None, n_block])
        sch.reorder(no, ni, r, k1)
        sch.compute_at(rf, ni)
        inner = sch.get_loops(rf)[2:]
        # rf loops after compute_at: (k1, r, k0), or (k1, k0) when the row loop has extent 1.
        k0 = inner[-1]
        if len(inner) == 3:
            sch.reorder(inner[2], inner[1], inner[0])
        else:
            sch.reorder(inner[1], inner[0])
        sch.vectorize(inner[0])
        sch.set_scope(rf, 0, "local")
        sch.parallel(no)
        sch.decompose_reduction(rf, k0)
    else:
        r, n, kk = sch.get_loops(block)
        sch.reorder(n, r, kk)
        sch.parallel(n)
    return sch.mod["main"].with_attr("global_symbol", spec.name)


def llvm_target(mcpu: str | None = None) -> dict[str, Any]:
    """The target dict for the cpu card (`{"kind": "llvm"}`, plus `mcpu` when given)."""
    return {**DEFAULT_TARGET, **({"mcpu": mcpu} if mcpu else {})}


def build_llvm_module(
    specs: Sequence[LinearSpec], out_path: str | os.PathLike[str], *, target: dict[str, Any] | None = None
) -> Path:
    """Compile `specs` into one shared library exporting one function each.

    The export is written to a temporary name next to `out_path` and renamed. Building the same
    specs gives the same bytes.

    Raises:
        ModuleBuildError: no specs, repeated names, or TVM failed.
    """
    if not specs:
        raise ModuleBuildError("build_llvm_module: nothing to compile")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ModuleBuildError(f"build_llvm_module: repeated function names in {names}")
    tvm = import_tvm_for_build()

    tgt = tvm.target.Target(target or DEFAULT_TARGET)
    out = Path(out_path)
    tmp = out.with_name(f".{out.name}.tmp.so")
    try:
        mod = tvm.IRModule({s.name: linear_prim_func(s, target) for s in specs})
        with tgt:
            ex = tvm.compile(mod, target=tgt)
        out.parent.mkdir(parents=True, exist_ok=True)
        ex.export_library(str(tmp))
        os.replace(tmp, out)
    except ModuleBuildError:
        raise
    except Exception as exc:  # TVM raises its own error types
        raise ModuleBuildError(f"compiling {len(specs)} linear function(s) for {tgt} failed: {exc}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


__all__ = [
    "DEFAULT_TARGET",
    "LinearSpec",
    "build_llvm_module",
    "linear_prim_func",
    "llvm_target",
    "uses_tile_schedule",
    "uses_tree_schedule",
]
