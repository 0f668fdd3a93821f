"""q4_g32 linear kernels: ``y[R, N] = x[R, K] @ dequant(W)[N, K]^T`` for the verify rounds' widths.

Weight layout (the card profile's ``q4_g32``): ``qweight`` is u32 ``[N, K/8]``, nibble ``j`` of word
``c`` holds input feature ``8c + j``; its value is ``(q - 8) * scale``; ``scales`` is f16
``[N, K/32]``. Activations and outputs are f16 or bf16, accumulation is fp32.

Two routes, chosen by measurement (docs/adr/0001-q4-kernel-route.md):

* ``cuda``: a CUDA C++ kernel on tensor cores (``q4_linear.cuh``), built with nvcc and exported
  through tvm-ffi, loaded like every generated module (``tvm_ffi.load_module``). One kernel covers
  1..32 rows (one mma n-tile per 8 rows); the tile configuration is a template argument.
* ``tir``: the TensorIR definition of the same function (:func:`q4_linear_prim_func`), compiled by
  TVM: for ``llvm`` (the ``cpu`` card) as is, for CUDA with dlight's default schedules (the
  measured baseline).

Every exported module holds one function, ``q4_linear(x, qweight, scales, y)`` (destination
passing: ``y`` is written), whatever the route. The CUDA route needs ``in_features % 128 == 0`` and
at most 32 rows, takes any row count up to the width it was built for, embeds SASS for one arch
only (no PTX, checked by :func:`cuda_binary_info`), and uses the tile that
:func:`default_tile_config` picks (measured on the H200, shrunk to other archs' shared memory).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .cuda_build import (
    build_cuda_module,
    cache_dir,
    cuda_arch,
    exports_source,
    find_nvcc,
    sources_hash,
    target_dict,
)

__all__ = [
    "FUNCTION_NAME",
    "Q4KernelError",
    "Q4TileConfig",
    "build_q4_cuda_bundle",
    "build_q4_linear",
    "build_q4_tir_bundle",
    "cuda_binary_info",
    "default_tile_config",
    "pack_q4",
    "q4_linear_prim_func",
    "q4_linear_reference",
    "unpack_q4",
]

FUNCTION_NAME = "q4_linear"
GROUP_SIZE = 32
STEP_K = 128  # the CUDA kernel's k-step: in_features must be a multiple of it
MAX_ROWS = 32
_SUPPORTED_DTYPES = ("float16", "bfloat16")
#: the files whose bytes key the cache of `build_q4_linear`
_SOURCES = ("q4_linear.cuh", "q4_linear_ffi.cuh", "ffi_checks.cuh", "q4_linear.py", "cuda_build.py")


class Q4KernelError(ValueError):
    """A q4 kernel cannot be built for the requested shape, target or configuration."""


# --------------------------------------------------------------------------------------------
# Packing and the float64 reference (numpy only; used by tests and the benchmark).


def pack_q4(q: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes ``q`` (integers 0..15, shape [N, K], K % 8 == 0) into u32 [N, K/8]."""
    q = np.asarray(q)
    if q.ndim != 2 or q.shape[1] % 8:
        raise Q4KernelError(f"pack_q4: need a [N, K] array with K % 8 == 0, got shape {q.shape}")
    if q.size and (q.min() < 0 or q.max() > 15):
        raise Q4KernelError("pack_q4: codes must lie in 0..15")
    q = q.astype(np.uint32).reshape(q.shape[0], q.shape[1] // 8, 8)
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, None, :]
    return np.bitwise_or.reduce(q << shifts, axis=2).astype(np.uint32)


def unpack_q4(qweight: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_q4`: u32 [N, K/8] -> codes uint8 [N, K]."""
    w = np.asarray(qweight).astype(np.uint32)
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, None, :]
    q = (w[:, :, None] >> shifts) & np.uint32(15)
    return q.reshape(w.shape[0], w.shape[1] * 8).astype(np.uint8)


def dequantize_q4(qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 [N, K] weights from u32 [N, K/8] codes and f16 [N, K/32] scales."""
    q = unpack_q4(qweight).astype(np.float64) - 8.0
    s = np.asarray(scales).astype(np.float64)
    return q * np.repeat(s, GROUP_SIZE, axis=1)


def q4_linear_reference(x: np.ndarray, qweight: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64 reference: x [R, K] (any float dtype) -> y [R, N]."""
    return np.asarray(x).astype(np.float64) @ dequantize_q4(qweight, scales).T


# --------------------------------------------------------------------------------------------
# Tile configurations of the CUDA route.


@dataclass(frozen=True)
class Q4TileConfig:
    """Template arguments of ``q4_linear_mma_kernel`` (q4_linear.cuh)."""

    n_tiles: int  # mma n-tiles of 8 activation rows: the kernel takes 1 .. 8 * n_tiles rows
    m_tiles: int  # 16-row output tiles per thread block (reuse of each activation load)
    warps: int  # warps per block, splitting the k-steps (split-K) between them
    stages: int  # depth of each lane's cp.async weight ring (k-steps of weights in flight)
    prefetch_x: bool  # load the next k-step's activations before this step's math
    vec: int = 1  # 16-byte weight chunks a lane streams per row per k-step (k-step = 128 vec);
    # layout "n": k-steps of 128 per pipeline stage (1 or 2)
    x_ring: bool = False  # activations through the cp.async ring too (coalesced, pipelined)
    pdl: bool = True  # programmatic dependent launch (overlap with the previous kernel's tail)
    min_blocks: int = 1  # blocks per SM the register allocation must allow (__launch_bounds__)
    stream_only: bool = False  # diagnostic: stream the weights, skip the math (wrong output)
    frag_prefetch: int = 0  # 1: next k-step's weights read from smem during this step's math; 2: + x
    # "k": the split-K kernel (warps of a block take interleaved k-steps, each with its own
    # activation copies); "n": q4_linear_n_kernel (the block's `warps` share every k-step and split
    # the outputs, the activations go once per block through a shared ring; a cluster of
    # `cluster_k` blocks splits K, reduced through distributed shared memory). "n" ignores
    # prefetch_x / x_ring / vec (always 1).
    layout: str = "k"
    cluster_k: int = 1  # "n" only: blocks per cluster splitting K (1, 2, 4, 8; needs sm_90+)
    early_w: bool = True  # "n" only: a step's weights are issued before the block barrier
    k_span: bool = False  # "n" only: cluster ranks take contiguous spans of k-steps (not every KC-th)
    x_ca: bool = False  # "n" only: activations copied through L1 (cp.async.ca) instead of bypassing it

    def __post_init__(self) -> None:
        if self.layout not in ("k", "n"):
            raise Q4KernelError(f"layout must be 'k' or 'n', got {self.layout!r}")
        if self.cluster_k not in (1, 2, 4, 8):
            raise Q4KernelError(f"cluster_k must be 1, 2, 4 or 8, got {self.cluster_k}")
        if self.layout == "k" and self.cluster_k != 1:
            raise Q4KernelError("cluster_k applies to layout 'n' only")
        if self.layout == "n" and (
            self.vec not in (1, 2) or self.x_ring or self.prefetch_x or self.frag_prefetch
        ):
            raise Q4KernelError("layout 'n' takes vec 1 or 2 and no x_ring/prefetch_x/frag_prefetch")
        if self.layout == "k" and (not self.early_w or self.k_span or self.x_ca):
            raise Q4KernelError("early_w, k_span and x_ca apply to layout 'n' only")
        if not 1 <= self.n_tiles <= MAX_ROWS // 8:
            raise Q4KernelError(f"n_tiles must be 1..{MAX_ROWS // 8}, got {self.n_tiles}")
        if self.m_tiles not in (1, 2, 4, 8):
            raise Q4KernelError(f"m_tiles must be 1, 2, 4 or 8, got {self.m_tiles}")
        if self.warps not in (1, 2, 4, 8, 16, 32):
            raise Q4KernelError(f"warps must be a power of two up to 32, got {self.warps}")
        if self.vec not in (1, 2, 4):
            raise Q4KernelError(f"vec must be 1, 2 or 4, got {self.vec}")
        if not 1 <= self.min_blocks <= 32:
            raise Q4KernelError(f"min_blocks must be 1..32, got {self.min_blocks}")
        if not 2 <= self.stages <= 16:
            raise Q4KernelError(f"stages must be 2..16, got {self.stages}")
        if self.stages * self.stage_bytes < self.m_tiles * self.n_tiles * 512:
            raise Q4KernelError(f"stages={self.stages} too shallow for {self.n_tiles} n-tiles")
        if self.frag_prefetch not in (0, 1, 2):
            raise Q4KernelError(f"frag_prefetch must be 0, 1 or 2, got {self.frag_prefetch}")
        if self.frag_prefetch and (self.vec != 1 or self.stages < 3 or self.stream_only):
            raise Q4KernelError("frag_prefetch needs vec=1, stages >= 3 and the compute mode")
        if self.frag_prefetch == 2 and not self.x_ring:
            raise Q4KernelError("frag_prefetch=2 prefetches the activation ring: needs x_ring")
        if self.smem_bytes > 227 * 1024:
            raise Q4KernelError(f"tile {self.tag} needs {self.smem_bytes} B of shared memory (> 227 KiB)")

    @property
    def max_rows(self) -> int:
        return 8 * self.n_tiles

    @property
    def step_k(self) -> int:
        """Input features per warp k-step: in_features must be a multiple of it."""
        return STEP_K * self.vec

    @property
    def stage_tile_bytes(self) -> int:
        """q4_stage_tile_bytes<V> in q4_linear.cuh."""
        return 2 * 32 * 16 * self.vec + 2 * 32 * max(4, 2 * self.vec)

    @property
    def stage_bytes(self) -> int:
        """Per warp and stage: q4_stage_bytes<NT, MT, V, XR> in q4_linear.cuh (layout "k"); for
        layout "n" the warp's weights only (the activation ring is the block's)."""
        x = 8 * self.n_tiles * (256 * self.vec + 16) if self.x_ring else 0
        return self.m_tiles * self.stage_tile_bytes + x

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per block (q4_smem_bytes_per_warp / q4n_smem_bytes in q4_linear.cuh)."""
        if self.layout == "n":  # vec = k-steps per stage (KS in q4n_smem_bytes)
            return self.vec * self.stages * (self.warps * self.m_tiles * 1280 + 8 * self.n_tiles * 272)
        return self.warps * self.stages * self.stage_bytes

    @property
    def rows_per_block(self) -> int:
        """Output features per thread block."""
        return 16 * self.m_tiles * (self.warps if self.layout == "n" else 1)

    @property
    def tag(self) -> str:
        if self.layout == "n":
            tag = f"n{self.n_tiles}_mt{self.m_tiles}_wn{self.warps}_kc{self.cluster_k}_s{self.stages}"
            if self.vec > 1:
                tag += f"_ks{self.vec}"
            if self.min_blocks > 1:
                tag += f"_mb{self.min_blocks}"
            if not self.early_w:
                tag += "_latew"
            if self.k_span:
                tag += "_kspan"
            if self.x_ca:
                tag += "_xca"
            if self.stream_only:
                tag += "_streamonly"
            return tag if self.pdl else tag + "_nopdl"
        tag = (
            f"nt{self.n_tiles}_mt{self.m_tiles}_w{self.warps}_s{self.stages}_v{self.vec}"
            f"_px{int(self.prefetch_x)}"
        )
        if self.x_ring:
            tag += "_xr"
        if self.min_blocks > 1:
            tag += f"_mb{self.min_blocks}"
        if not self.pdl:
            tag += "_nopdl"
        if self.stream_only:
            tag += "_streamonly"
        if self.frag_prefetch:
            tag += f"_fp{self.frag_prefetch}"
        return tag

    def export_line(self, name: str) -> str:
        def b(v: bool) -> str:
            return "true" if v else "false"

        if self.layout == "n":
            return (
                f"IGNIS_Q4_EXPORT_N({name}, {self.n_tiles}, {self.m_tiles}, {self.warps}, "
                f"{self.cluster_k}, {self.stages}, {b(self.pdl)}, {self.min_blocks}, {b(self.early_w)}, "
                f"{int(self.stream_only)}, {b(self.k_span)}, {b(self.x_ca)}, {self.vec})"
            )
        fp = f", {self.frag_prefetch}" if self.frag_prefetch else ""
        return (
            f"IGNIS_Q4_EXPORT{'_FP' if fp else ''}({name}, {self.n_tiles}, {self.m_tiles}, "
            f"{self.warps}, {self.stages}, {self.vec}, {b(self.prefetch_x)}, {b(self.x_ring)}, "
            f"{int(self.stream_only)}, {b(self.pdl)}, {self.min_blocks}{fp})"
        )


# Tile choices, the fastest measured on the H200 per row bucket (the perf log, docs/perf/log/, q4
# runs 4-15): per family of shapes -- "wide" outputs (>= 8448 features: enough 16-row tiles for 2
# per block and every SM busy, e.g. 17408x5120) and "narrow" ones (e.g. 5120x17408, 320 tiles) --
# the first rule whose max_rows covers the width. Shapes never measured get their family's rule.
# 1..8 rows: the split-K kernel (layout "k"); 9..32 rows: layout "n" (block-shared activations,
# clusters splitting K), the (up, down) pair per bucket chosen on the whole MLP chain (runs 13, 15).
_C = Q4TileConfig
_N = {"layout": "n"}
_SC = {"layout": "n", "k_span": True, "x_ca": True}
_WIDE_RULES: tuple[tuple[int, Q4TileConfig], ...] = (
    # the 4-warp tile up to 3 rows, the 8-warp one from 4 rows on (run 8)
    (3, _C(1, 2, 4, 3, False, x_ring=True, min_blocks=4)),
    (8, _C(1, 2, 8, 3, False, x_ring=True)),
    (16, _C(2, 2, 4, 2, False, cluster_k=4, x_ca=True, **_N)),  # layout "n" beats split-K from 9 rows
    (24, _C(3, 2, 4, 2, False, cluster_k=4, **_SC)),
    (32, _C(4, 2, 4, 2, False, cluster_k=8, **_SC)),
)
_NARROW_RULES: tuple[tuple[int, Q4TileConfig], ...] = (
    (8, _C(1, 1, 8, 4, True)),
    (16, _C(2, 2, 4, 2, False, cluster_k=8, vec=2, **_SC)),
    (24, _C(3, 2, 4, 2, False, cluster_k=8, **_SC)),
    # one m-tile per warp, 8 warps: slower alone than two m-tiles with two k-steps a stage, but the
    # MLP chain with the up tile is faster (run 15)
    (32, _C(4, 1, 8, 2, False, cluster_k=8, **_SC)),
)
WIDE_OUT_FEATURES = 16 * 2 * 264  # 2 tiles per block, 2 blocks per SM on 132 SMs
# Exact (out, in) -> rules overrides, for shapes measured to prefer something else.
TUNED_TILE_CONFIGS: dict[tuple[int, int], tuple[tuple[int, Q4TileConfig], ...]] = {}


# Largest dynamic shared memory one block may take, per SM version (CUDA programming guide).
_MAX_SMEM_PER_BLOCK = {
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_89": 99 * 1024,
    "sm_90": 227 * 1024,
    "sm_100": 227 * 1024,
    "sm_120": 99 * 1024,
}


def _fit_smem(cfg: Q4TileConfig, limit: int) -> Q4TileConfig:
    """Shrink a tile (stages, then the activation ring, then m-tiles, then warps) to fit ``limit``."""
    from dataclasses import replace

    while cfg.smem_bytes > limit:
        if cfg.layout == "n":
            if cfg.stages > 2:
                cfg = replace(cfg, stages=cfg.stages - 1)
            elif cfg.m_tiles > 1:
                cfg = replace(cfg, m_tiles=cfg.m_tiles // 2)
            elif cfg.warps > 1:
                cfg = replace(cfg, warps=cfg.warps // 2)
            else:
                raise Q4KernelError(f"no q4 tile fits in {limit} bytes of shared memory")
            continue
        if cfg.stages > 3 or (cfg.stages == 3 and not cfg.frag_prefetch):
            cfg = replace(cfg, stages=cfg.stages - 1)
        elif cfg.frag_prefetch:  # at 3 stages: drop the prefetch, then keep shrinking the ring
            cfg = replace(cfg, frag_prefetch=0)
        elif cfg.x_ring:
            cfg = replace(cfg, x_ring=False)
        elif cfg.m_tiles > 1:
            cfg = replace(cfg, m_tiles=cfg.m_tiles // 2)
        elif cfg.warps > 1:
            cfg = replace(cfg, warps=cfg.warps // 2)
        else:
            raise Q4KernelError(f"no q4 tile fits in {limit} bytes of shared memory")
    return cfg


def _fit_arch(cfg: Q4TileConfig, arch: str) -> Q4TileConfig:
    """``cfg`` made buildable for ``arch``: clusters need sm_90+, shared memory its per-block limit."""
    from dataclasses import replace

    num = arch[3:].rstrip("a")
    if cfg.cluster_k > 1 and num.isdigit() and int(num) < 90:
        cfg = replace(cfg, cluster_k=1)
    return _fit_smem(cfg, _MAX_SMEM_PER_BLOCK.get(arch.rstrip("a"), 99 * 1024))


def default_tile_config(
    rows: int, out_features: int, in_features: int, *, arch: str = "sm_90"
) -> Q4TileConfig:
    """The tile configuration the CUDA route uses for ``rows`` activation rows on this shape.

    Tuned on the H200 (sm_90); for other archs the same rule, shrunk to the arch's shared-memory
    limit per block (sm_120: 99 KiB) -- built and checked, not measured.
    """
    if not 1 <= rows <= MAX_ROWS:
        raise Q4KernelError(f"rows must be 1..{MAX_ROWS}, got {rows}")
    rules = TUNED_TILE_CONFIGS.get((out_features, in_features)) or (
        _WIDE_RULES if out_features >= WIDE_OUT_FEATURES else _NARROW_RULES
    )
    cfg = next(cfg for max_rows, cfg in rules if rows <= max_rows)
    if cfg.layout == "n" and in_features % cfg.step_k:  # two k-steps per stage need K % 256 == 0
        from dataclasses import replace

        cfg = replace(cfg, vec=1)
    return _fit_arch(cfg, arch)


# --------------------------------------------------------------------------------------------
# Targets.


def _check_shape(out_features: int, in_features: int, rows: int, route: str) -> None:
    if out_features <= 0 or in_features <= 0 or in_features % GROUP_SIZE:
        raise Q4KernelError(
            f"q4_g32 needs in_features % {GROUP_SIZE} == 0 and positive sizes, got "
            f"out={out_features}, in={in_features}"
        )
    if route == "cuda" and in_features % STEP_K:
        raise Q4KernelError(
            f"the CUDA q4 kernel needs in_features % {STEP_K} == 0, got {in_features}; "
            "use route='tir' for this shape"
        )
    if not 1 <= rows <= (MAX_ROWS if route == "cuda" else 1 << 16):
        raise Q4KernelError(f"rows must be 1..{MAX_ROWS} on the CUDA route, got {rows}")


# --------------------------------------------------------------------------------------------
# The CUDA route: nvcc + tvm-ffi.


def build_q4_cuda_bundle(
    arch: str,
    exports: Mapping[str, Q4TileConfig],
    out_path: str | os.PathLike[str],
    *,
    extra_flags: Sequence[str] = (),
    verbose: bool = False,
) -> Path:
    """Compile one shared library that exports ``name(x, qweight, scales, y)`` per config.

    The library holds SASS for ``arch`` only (no PTX), is loaded with ``tvm_ffi.load_module`` and
    launches on the stream tvm-ffi reports (torch's, under ``tvm_ffi.use_torch_stream()``). A tile
    that needs more shared memory per block than ``arch`` allows (the H200-tuned tiles on sm_120)
    is shrunk to fit, as :func:`default_tile_config` does for an explicit arch.
    """
    if not exports:
        raise Q4KernelError("build_q4_cuda_bundle: nothing to export")
    exports = {name: _fit_arch(cfg, arch) for name, cfg in exports.items()}
    for name in exports:
        if not name.isidentifier():
            raise Q4KernelError(f"export name {name!r} is not a C identifier")
    return build_cuda_module(
        exports_source("q4_linear_ffi.cuh", exports),
        arch,
        out_path,
        nvcc=find_nvcc(error=Q4KernelError),
        src_name="q4_linear_module.cu",
        error=Q4KernelError,
        extra_flags=extra_flags,
        verbose=verbose,
    )


# --------------------------------------------------------------------------------------------
# The TensorIR route.


def q4_linear_prim_func(rows: int, out_features: int, in_features: int, dtype: str = "float16"):  # type: ignore[no-untyped-def]
    """The q4_g32 linear as a TensorIR PrimFunc ``(x, qweight, scales, y)``; imports tvm."""
    if dtype not in _SUPPORTED_DTYPES:
        raise Q4KernelError(f"dtype must be one of {_SUPPORTED_DTYPES}, got {dtype!r}")
    _check_shape(out_features, in_features, rows, "tir")
    from .cuda_stub import import_tvm_for_build

    import_tvm_for_build()  # driver or stub before the first `import tvm`, whatever the target
    from tvm import te, tirx

    r_, n_, k_ = rows, out_features, in_features
    x = te.placeholder((r_, k_), dtype, name="x")
    w = te.placeholder((n_, k_ // 8), "uint32", name="qweight")
    s = te.placeholder((n_, k_ // GROUP_SIZE), "float16", name="scales")

    def dequant(n, k):  # type: ignore[no-untyped-def]
        shift = tirx.const(4, "uint32") * (k % 8).astype("uint32")
        q = (w[n, k // 8] >> shift) & tirx.const(15, "uint32")
        return ((q.astype("int32") - 8).astype("float32") * s[n, k // GROUP_SIZE].astype("float32")).astype(
            dtype
        )

    wd = te.compute((n_, k_), dequant, name="dequant")
    k = te.reduce_axis((0, k_), name="k")
    acc = te.compute(
        (r_, n_),
        lambda r, n: te.sum(x[r, k].astype("float32") * wd[n, k].astype("float32"), axis=k),
        name="matmul",
    )
    y = te.compute((r_, n_), lambda r, n: acc[r, n].astype(dtype), name="y")
    return te.create_prim_func([x, w, s, y])


def build_q4_tir_bundle(
    target: Any,
    funcs: Mapping[str, tuple[int, int, int, str]],
    out_path: str | os.PathLike[str],
    *,
    schedule: str = "dlight",
) -> Path:
    """Compile TensorIR q4 linears ``{name: (rows, out, in, dtype)}`` into one exported module.

    ``schedule``: ``"dlight"`` applies dlight's default GPU rules (CUDA targets), ``"none"`` builds
    the plain definition (fine for ``llvm``).
    """
    from .cuda_stub import import_tvm_for_build

    tvm = import_tvm_for_build()
    tdict = target_dict(target, error=Q4KernelError)
    tgt = tvm.target.Target(tdict)
    items = {}
    for name, (rows, n, k, dtype) in funcs.items():
        f = q4_linear_prim_func(rows, n, k, dtype).with_attr("global_symbol", name)
        items[name] = f
    mod = tvm.IRModule(items)
    with tgt:
        if schedule == "dlight" and tdict.get("kind") == "cuda":
            import tvm.s_tir.dlight as dl

            mod = dl.ApplyDefaultSchedule(
                dl.gpu.Matmul(),
                dl.gpu.GEMV(),
                dl.gpu.LowBatchGEMV(),
                dl.gpu.Reduction(),
                dl.gpu.GeneralReduction(),
                dl.gpu.Fallback(),
            )(mod)
        elif schedule not in ("dlight", "none"):
            raise Q4KernelError(f"unknown schedule {schedule!r}")
        ex = tvm.compile(mod, target=tgt)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp.so")
    ex.export_library(str(tmp))
    os.replace(tmp, out_path)
    return out_path


# --------------------------------------------------------------------------------------------
# The one entry point the module pipeline calls.


def build_q4_linear(
    target: Any,
    out_features: int,
    in_features: int,
    rows: int,
    *,
    dtype: str = "float16",
    route: str | None = None,
    tile: Q4TileConfig | None = None,
    out_path: str | os.PathLike[str] | None = None,
) -> Path:
    """Build the q4_g32 linear for ``rows`` activation rows and return the exported ``.so``.

    ``target``: ``{"kind": "cuda", "arch": "sm_90"}`` (or ``"sm_120"``...) or ``{"kind": "llvm"}``.
    ``route``: ``"cuda"`` (default for CUDA targets) or ``"tir"`` (default, and the only one, for
    llvm; dlight schedules on CUDA). The CUDA route's module takes f16 and bf16 activations alike
    (``dtype`` only matters to the TIR route) and any row count up to its compiled width.
    The module exports ``q4_linear(x, qweight, scales, y)``.
    """
    tdict = target_dict(target, error=Q4KernelError)
    kind = tdict.get("kind")
    if route is None:
        route = "cuda" if kind == "cuda" else "tir"
    if route not in ("cuda", "tir") or (route == "cuda" and kind != "cuda"):
        raise Q4KernelError(f"route {route!r} does not apply to target {tdict}")
    _check_shape(out_features, in_features, rows, route)
    if route == "cuda":
        arch = cuda_arch(tdict, error=Q4KernelError)
        cfg = tile or default_tile_config(rows, out_features, in_features, arch=arch)
        limit = _MAX_SMEM_PER_BLOCK.get(arch.rstrip("a"), 99 * 1024)
        if cfg.smem_bytes > limit:
            raise Q4KernelError(
                f"tile {cfg.tag} needs {cfg.smem_bytes} B of shared memory; {arch} allows {limit}"
            )
        if cfg.max_rows < rows:
            raise Q4KernelError(f"tile {cfg.tag} takes at most {cfg.max_rows} rows, asked {rows}")
        if in_features % cfg.step_k:
            raise Q4KernelError(f"tile {cfg.tag} needs in_features % {cfg.step_k} == 0, got {in_features}")
        key = f"cuda|{arch}|{cfg.tag}|{sources_hash(_SOURCES)}"
    else:
        shape = f"{rows}|{out_features}|{in_features}|{dtype}"
        key = f"tir|{sorted(tdict.items())}|{shape}|{sources_hash(_SOURCES)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    dest = Path(out_path) if out_path is not None else cache_dir("q4_linear") / f"q4_linear_{digest}.so"
    if out_path is None and dest.exists():
        return dest
    if route == "cuda":
        return build_q4_cuda_bundle(arch, {FUNCTION_NAME: cfg}, dest)
    return build_q4_tir_bundle(
        tdict,
        {FUNCTION_NAME: (rows, out_features, in_features, dtype)},
        dest,
        schedule="dlight" if kind == "cuda" else "none",
    )


# --------------------------------------------------------------------------------------------
# Checking what an exported module holds.


_EM_CUDA = 190


@dataclass(frozen=True)
class CudaBinaryInfo:
    """What a shared library embeds for the GPU."""

    sass_archs: tuple[str, ...]  # e.g. ("sm_90",): CUDA ELF images (cubins) found
    has_ptx: bool  # PTX text (JIT-compiled by the driver at load time)
    has_cuda_source: bool  # CUDA C source (what TVM embeds when it could not compile)

    @property
    def is_binary_only(self) -> bool:
        return bool(self.sass_archs) and not self.has_ptx and not self.has_cuda_source


def cuda_binary_info(path: str | os.PathLike[str]) -> CudaBinaryInfo:
    """Scan a shared library for embedded cubins (by ELF machine EM_CUDA), PTX and CUDA source."""
    data = Path(path).read_bytes()
    archs: set[str] = set()
    pos = data.find(b"\x7fELF", 1)
    while pos >= 0:
        if pos + 64 <= len(data) and data[pos + 4] == 2:  # 64-bit ELF
            machine = struct.unpack_from("<H", data, pos + 18)[0]
            if machine == _EM_CUDA:
                flags = struct.unpack_from("<I", data, pos + 48)[0]
                abi = data[pos + 8]
                # CUDA >= 12.8 ELF ("ABI version" >= 7): the SM number sits in bits 8..15;
                # older cubins keep it in the low byte.
                sm = (flags >> 8) & 0xFF if abi >= 7 or (flags & 0xFF) < 20 else flags & 0xFF
                archs.add(f"sm_{sm}")
        pos = data.find(b"\x7fELF", pos + 1)
    has_ptx = b".target sm_" in data and b".address_size" in data
    has_src = b"__global__" in data and (b'extern "C"' in data or b"blockIdx" in data)
    return CudaBinaryInfo(tuple(sorted(archs)), has_ptx, has_src)
