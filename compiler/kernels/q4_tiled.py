"""Build the tiled q4_g32 CUDA kernel (`q4_tiled.cuh`) into tvm-ffi modules.

The kernel reads the tiled weight layout of `ignis.runtime.kernels.q4_tiled` (the runtime re-lays q4_g32
weights once when it places them on a CUDA device) and splits the work stream-K over the GPU; see
the header's comment and docs/adr/0004-q4-tiled-stream-k.md. Each exported function is
``NAME(x [R, K], qweight [T, K/128, 256] u32, scales [T, K/128, 64] f16, y [R, N])`` for
``1 <= R <= 8 * n_tiles``, f16 or bf16 activations.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from .cuda_build import build_cuda_module, exports_source, find_nvcc, sm_number
from .q4_linear import Q4KernelError

#: Rows the tiled kernel takes (8 n-tiles: 8 lanes x 8 columns of a verify round in one call; the
#: row-major mma kernel of `q4_linear` stops at its MAX_ROWS, 32).
MAX_ROWS = 64

__all__ = ["MAX_ROWS", "TiledConfig", "build_q4_tiled_module", "tiled_config_for", "tiled_source"]


@dataclass(frozen=True)
class TiledConfig:
    """Template arguments of ``q4_tiled_kernel``.

    Attributes:
        n_tiles: mma n-tiles of 8 activation rows (the function takes 1 .. 8 n_tiles rows); above 4
            (33-64 rows) the activations are read word by word in the mma loop (``x_smem`` only).
        m_tiles: 16-row weight tiles a warp streams per unit (each activation load feeds them all).
        warps: warps per block.
        depth: units in each warp's register ring (depth - 1 units of weights in flight).
        post_scale: apply the group scales to the mma results in fp32 instead of to the weights.
        min_blocks: ``__launch_bounds__`` minimum blocks per SM (caps registers per thread).
        blocks_per_sm: resident blocks per SM launched (0: as many as the occupancy allows).
        pdl: programmatic dependent launch.
        ring: 0: weights global -> registers;
            2: each lane streams its own pieces through a private cp.async ring in shared memory
            (``depth - 1`` units in flight, waited for by commit-group counting).
        x_double: the next unit's activations are loaded into registers before this unit's math
            (else only prefetched into L1).
        stream_only: diagnostic: stream the weights, skip the math (wrong output).
        no_fixup: diagnostic: every warp stores its partial sums directly, no workspace (wrong
            output wherever a group is shared), to measure what the fixups cost.
        no_wait: diagnostic: the fixups without their wait (nothing parked, the first worker reads
            its still-empty slots once: wrong output), to measure what the wait at the end costs.
        math_only: diagnostic: the ring's first units loaded, then their bits flipped a unit instead
            of the next units' loads, and no fixups (wrong output): what the math costs without the
            weight stream (ring 0 only).
        x_smem: the stream-K workers are blocks (a unit: ``warps * m_tiles`` tiles x one k-step,
            each warp its own tiles) whose activations are copied into shared memory once;
            ``blocks_per_sm`` (0: 1) blocks a SM. Takes ring 0 or 2.
        x_bulk: with ``x_smem``, the activations are staged by bulk copies (the copy engine, one
            per row and span of k-steps, completing on mbarriers) instead of per-thread 16-byte
            cp.async copies.
        x_ring: with ``x_bulk``, 2..8: the activations stream through a ring of that many slots of
            ``x_ring_k`` k-steps each (bulk copies a row and slot, a full and an empty mbarrier a
            slot, refilled as the units advance) instead of being staged for the block's whole span
            of k-steps, so the shared memory does not grow with the span (33-64 rows in one
            launch); 0: whole span.
        x_ring_k: k-steps a ring slot (1..8).
    """

    n_tiles: int = 1
    m_tiles: int = 1
    warps: int = 4
    depth: int = 4
    post_scale: bool = True
    min_blocks: int = 4
    blocks_per_sm: int = 0
    pdl: bool = True
    ring: int = 0
    x_double: bool = False
    stream_only: bool = False
    x_smem: bool = False
    no_fixup: bool = False
    no_wait: bool = False
    x_bulk: bool = False
    x_ring: int = 0
    x_ring_k: int = 1
    math_only: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.n_tiles <= MAX_ROWS // 8:
            raise Q4KernelError(f"n_tiles must be 1..{MAX_ROWS // 8}, got {self.n_tiles}")
        if self.m_tiles not in (1, 2, 4):
            raise Q4KernelError(f"m_tiles must be 1, 2 or 4, got {self.m_tiles}")
        if self.warps not in (1, 2, 4, 8, 16):
            raise Q4KernelError(f"warps must be 1, 2, 4, 8 or 16, got {self.warps}")
        if self.depth < 2:
            raise Q4KernelError(f"depth must be at least 2, got {self.depth}")
        if not 1 <= self.min_blocks <= 32 or not 0 <= self.blocks_per_sm <= 32:
            raise Q4KernelError("min_blocks must be 1..32 and blocks_per_sm 0..32")
        if self.ring not in (0, 2) or (self.ring == 0 and self.depth > 8) or self.depth > 16:
            raise Q4KernelError(
                f"ring must be 0 (depth <= 8) or 2 (depth <= 16), got {self.ring}, {self.depth}"
            )
        if self.ring == 2 and self.depth < 3:
            raise Q4KernelError("ring 2 needs depth >= 3")
        if self.stream_only + self.no_fixup + self.no_wait + self.math_only > 1:
            raise Q4KernelError("stream_only, no_fixup, no_wait and math_only are exclusive diagnostics")
        if self.math_only and self.ring:
            raise Q4KernelError("math_only takes ring 0")
        if self.x_smem and self.x_double:
            raise Q4KernelError("x_smem takes no x_double")
        if self.n_tiles > 4 and not self.x_smem:
            raise Q4KernelError("more than 4 n-tiles need x_smem (activations read from shared memory)")
        if self.x_bulk and not self.x_smem:
            raise Q4KernelError("x_bulk needs x_smem")
        if self.x_ring and not (self.x_bulk and 2 <= self.x_ring <= 8):
            raise Q4KernelError(f"x_ring must be 0 or 2..8 with x_bulk, got {self.x_ring}")
        if not 1 <= self.x_ring_k <= 8 or (self.x_ring_k > 1 and not self.x_ring):
            raise Q4KernelError(f"x_ring_k must be 1..8 (above 1 only with x_ring), got {self.x_ring_k}")
        if self.ring and self.smem_bytes > 227 * 1024:
            raise Q4KernelError(
                f"{self.tag} needs {self.smem_bytes} bytes of shared memory a block (> 227 KiB)"
            )

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory a block for the weight rings (tiled_lane_ring_bytes in q4_tiled.cuh
        times warps; x_smem adds the activations at launch)."""
        if self.ring == 2:
            return self.warps * self.depth * self.m_tiles * 1536
        return 0

    @property
    def diagnostic(self) -> bool:
        """A diagnostic variant (wrong output by design): timed, never used."""
        return self.stream_only or self.no_fixup or self.no_wait or self.math_only

    @property
    def max_rows(self) -> int:
        return 8 * self.n_tiles

    @property
    def tag(self) -> str:
        scale = "post" if self.post_scale else "pre"
        tag = f"t{self.n_tiles}_mt{self.m_tiles}_w{self.warps}_d{self.depth}_{scale}_mb{self.min_blocks}"
        if self.blocks_per_sm:
            tag += f"_b{self.blocks_per_sm}"
        if self.ring:
            tag += "_cpa"
        if self.x_double:
            tag += "_xdb"
        if self.stream_only:
            tag += "_streamonly"
        if self.x_ring:
            tag += f"_xr{self.x_ring}" + (f"k{self.x_ring_k}" if self.x_ring_k > 1 else "")
        elif self.x_smem:
            tag += "_xb" if self.x_bulk else "_xs"
        if self.no_fixup:
            tag += "_nofixup"
        if self.no_wait:
            tag += "_nowait"
        if self.math_only:
            tag += "_mathonly"
        return tag if self.pdl else tag + "_nopdl"

    def export_line(self, name: str) -> str:
        b = {True: "true", False: "false"}
        # the kernel's MODE: kModeCompute 0, or kModeStreamOnly / kModeNoFixup / kModeNoWait / kModeMathOnly
        flags = (self.stream_only, self.no_fixup, self.no_wait, self.math_only)
        mode = next((i + 1 for i, on in enumerate(flags) if on), 0)
        xs = 3 if self.x_ring else 2 if self.x_bulk else int(self.x_smem)  # the kernel's XS
        return (
            f"IGNIS_Q4T_EXPORT({name}, {self.n_tiles}, {self.m_tiles}, {self.warps}, {self.depth}, "
            f"{b[self.post_scale]}, {self.min_blocks}, {self.blocks_per_sm}, {b[self.pdl]}, {self.ring}, "
            f"{b[self.x_double]}, {mode}, {xs}, {self.x_ring}, {self.x_ring_k})"
        )


def tiled_source(exports: Mapping[str, TiledConfig]) -> str:
    """The ``.cu`` translation unit exporting each (name, config), and ``q4_g32_tiled_dequant``
    (`q4_dequant.cuh`: the tiled weights as row-major bf16 / f16, the prefill route of
    ``ignis.runtime.linear.LinearBackend``)."""
    dequant = '#include "q4_dequant.cuh"\nIGNIS_Q4_DEQUANT_EXPORT()\n'
    return exports_source("q4_tiled_ffi.cuh", exports) + dequant


def build_q4_tiled_module(
    arch: str,
    exports: Mapping[str, TiledConfig],
    out_path: str | os.PathLike[str],
    *,
    verbose: bool = False,
) -> Path:
    """Compile the exports into one module with SASS for ``arch`` (``sm_90``, ``sm_120``, ...).

    Raises:
        Q4KernelError: no exports, a bad name, nvcc missing or failing.
    """
    if not exports:
        raise Q4KernelError("build_q4_tiled_module: nothing to export")
    for name in exports:
        if not name.isidentifier():
            raise Q4KernelError(f"export name {name!r} is not a C identifier")
    if not arch.startswith("sm_") or not arch[3:].isdigit() or int(arch[3:]) < 80:
        raise Q4KernelError(f"the tiled q4 kernel needs sm_80 or newer, got {arch!r}")
    for name, cfg in exports.items():
        if cfg.x_bulk and not _has_bulk_copies(arch):
            raise Q4KernelError(f"{name}: x_bulk needs sm_90 or newer (bulk copies), got {arch!r}")
    return build_cuda_module(
        tiled_source(exports),
        arch,
        out_path,
        nvcc=find_nvcc(error=Q4KernelError),
        src_name="q4_tiled_module.cu",
        error=Q4KernelError,
        verbose=verbose,
    )


# Configuration per n-tile count (rows 1-8, 9-16, .., 57-64), the fastest measured on the H200 with
# the tiled q4 benchmark (the perf log, docs/perf/log/: tiled runs 1-16, and the runs named below):
# blocks of 16 warps, one a SM (128 registers a thread), activations staged in shared memory once per
# block -- by bulk copies on sm_90 and newer (faster than cp.async staging: run 30), by cp.async
# before (no bulk copies there) --, a 3-unit register ring of weights, shared groups finished by
# their first worker (self-announcing partials: runs 18-19); scales applied after the mma up to 16
# rows, folded into the weights above. The same configuration serves every shape (no shared memory
# is reserved at build time; the launch sizes the activation buffer, splits the call over tile ranges
# or 16-row slices when it does not fit, and falls back to the warp kernel last). 33-64 rows (5-8
# n-tiles) read the activations word by word in the mma loop. At 41-64 rows (6-8 n-tiles) the
# activations of a block's whole span of k-steps do not fit in shared memory, and splitting the
# launch over tile ranges costs a launch each (runs 62-68); they stream through a ring of 2 slots of
# 4 k-steps instead (runs 69-71). The ring is slower wherever the whole span fits (run 71), so 1-40
# rows keep whole-span staging. Without bulk copies (before sm_90) both fall back to cp.async
# whole-span staging.
_RULES: dict[int, TiledConfig] = {
    nt: TiledConfig(
        n_tiles=nt,
        warps=16,
        depth=3,
        post_scale=nt <= 2,
        min_blocks=1,
        blocks_per_sm=1,
        x_smem=True,
        x_bulk=True,
        x_ring=2 if nt >= 6 else 0,
        x_ring_k=4 if nt >= 6 else 1,
    )
    for nt in range(1, MAX_ROWS // 8 + 1)
}


def tiled_config_for(rows: int, out_features: int, in_features: int, arch: str) -> TiledConfig:
    """The configuration the build uses for ``rows`` (1..64) on an [out, in] q4_g32 weight.

    Raises:
        Q4KernelError: rows outside 1..64, in_features not a positive multiple of 128, or a
            malformed ``arch``.
    """
    if not 1 <= rows <= MAX_ROWS:
        raise Q4KernelError(f"the tiled q4 kernel takes 1..{MAX_ROWS} rows, got {rows}")
    if in_features <= 0 or in_features % 128 or out_features < 1:
        raise Q4KernelError(
            f"the tiled q4 kernel needs in_features % 128 == 0, got [{out_features}, {in_features}]"
        )
    rule = _RULES[(rows + 7) // 8]
    return rule if _has_bulk_copies(arch) else replace(rule, x_bulk=False, x_ring=0, x_ring_k=1)


def _has_bulk_copies(arch: str) -> bool:
    """Whether ``arch`` (``sm_NN``) has the copy engine's bulk copies and mbarrier transaction
    counts (PTX ``cp.async.bulk``, ``mbarrier.expect_tx``: sm_90 and newer)."""
    number = sm_number(arch)
    if number is None:
        raise Q4KernelError(f"arch must be sm_NN (e.g. sm_90, sm_120), got {arch!r}")
    return number >= 90
