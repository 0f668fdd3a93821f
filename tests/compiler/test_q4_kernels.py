"""q4_g32 linear kernels: float64 references on the CPU, cross-compiled binaries, and (on a GPU
host) the CUDA kernels themselves at every verify width."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from ignis.compiler.kernels.q4_linear import (
    FUNCTION_NAME,
    Q4KernelError,
    Q4TileConfig,
    _fit_smem,
    build_q4_linear,
    cuda_binary_info,
    default_tile_config,
    dequantize_q4,
    pack_q4,
    q4_linear_reference,
    unpack_q4,
)

HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _random_q4(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    qw = pack_q4(rng.integers(0, 16, (n, k)))
    scales = ((rng.random((n, k // 32)) + 0.5) / (4.6 * k**0.5)).astype(np.float16)
    return qw, scales


def _rel_err(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref))


# ---------------------------------------------------------------------------------------------
# Layout and reference


def test_pack_roundtrip_and_nibble_order() -> None:
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (5, 64))
    w = pack_q4(q)
    assert w.dtype == np.uint32 and w.shape == (5, 8)
    np.testing.assert_array_equal(unpack_q4(w), q)
    # nibble j of word c holds input feature 8c + j
    assert (int(w[2, 3]) >> 4 * 5) & 15 == q[2, 8 * 3 + 5]


def test_dequantize_matches_definition() -> None:
    rng = np.random.default_rng(2)
    q = rng.integers(0, 16, (3, 64))
    s = rng.random((3, 2)).astype(np.float16)
    wd = dequantize_q4(pack_q4(q), s)
    expected = (q - 8.0) * np.repeat(s.astype(np.float64), 32, axis=1)
    np.testing.assert_array_equal(wd, expected)


def test_pack_rejects_bad_codes() -> None:
    with pytest.raises(Q4KernelError):
        pack_q4(np.full((2, 8), 16))
    with pytest.raises(Q4KernelError):
        pack_q4(np.zeros((2, 7), dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# A fragment-level model of the CUDA kernel's k-step (q4_linear.cuh), bit for bit where it
# matters: the nibble -> (mma slot) permutation, the 0x6400 / 0x4300 dequantization constants,
# and the byte-permuted activation fragments. Runs on the CPU.


def _halves(u: int) -> tuple[np.float16, np.float16]:
    lo, hi = np.array([u & 0xFFFF, u >> 16], dtype=np.uint16).view(np.float16)
    return lo, hi


def _bf16s(u: int) -> tuple[np.float32, np.float32]:
    lo, hi = (np.array([(u & 0xFFFF) << 16, (u >> 16) << 16], dtype=np.uint32)).view(np.float32)
    return lo, hi


def _to_bf16(v: float) -> np.float32:
    """Round a float to bf16 (nearest even), returned as float32."""
    b = np.array([v], dtype=np.float32).view(np.uint32)[0]
    b = (int(b) + 0x7FFF + ((int(b) >> 16) & 1)) & 0xFFFF0000
    return np.array([b], dtype=np.uint32).view(np.float32)[0]


def _dequant_word(q: int, s: float, dtype: str) -> list[tuple[float, float]]:
    """Q4Traits<T>::dequant: out[i] = ((n_i - 8) s, (n_{i+4} - 8) s), as the kernel rounds it."""
    out = []
    if dtype == "float16":
        s16 = np.float16(s)
        lo0, hi0 = (q & 0x000F000F) | 0x64006400, (q & 0x00F000F0) | 0x64006400
        q8 = q >> 8
        lo1, hi1 = (q8 & 0x000F000F) | 0x64006400, (q8 & 0x00F000F0) | 0x64006400
        for word, is_hi in ((lo0, False), (hi0, True), (lo1, False), (hi1, True)):
            pair = []
            for h in _halves(word):
                if is_hi:  # __hfma2(h, 1/16, -72): exact
                    v = np.float16(np.float32(h) * np.float32(1 / 16) - np.float32(72))
                else:  # __hsub2(h, 1032): exact
                    v = np.float16(h - np.float16(1032))
                pair.append(float(np.float16(v * s16)))
            out.append((pair[0], pair[1]))
    else:
        sb = _to_bf16(float(np.float16(s)))
        for i in range(4):
            word = ((q >> (4 * i)) & 0x000F000F) | 0x43004300
            pair = [float(_to_bf16(float(_to_bf16(float(h) - 136.0)) * float(sb))) for h in _bf16s(word)]
            out.append((pair[0], pair[1]))
    return out


def _kstep_model(qw: np.ndarray, scales: np.ndarray, x: np.ndarray, dtype: str) -> np.ndarray:
    """D[16 out rows, 8 act rows] of one m-tile, one n-tile and one 128-feature k-step."""
    d = np.zeros((16, 8))
    for w in range(4):
        for h in range(2):
            a = np.zeros((16, 16))
            b = np.zeros((16, 8))
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                p0 = _dequant_word(int(qw[g, 4 * t + w]), float(scales[g, t]), dtype)
                p1 = _dequant_word(int(qw[g + 8, 4 * t + w]), float(scales[g + 8, t]), dtype)
                regs = [p0[2 * h], p1[2 * h], p0[2 * h + 1], p1[2 * h + 1]]
                # mma.m16n8k16 A fragment: reg0 (g, 2t..), reg1 (g+8, 2t..), reg2 (g, 2t+8..),
                # reg3 (g+8, 2t+8..)
                for reg, (row, col) in zip(
                    regs, [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)], strict=True
                ):
                    a[row, col], a[row, col + 1] = reg
                e = x[g, 32 * t + 8 * w : 32 * t + 8 * w + 8]
                # __byte_perm pairs: h=0 -> (e0,e4), (e1,e5); h=1 -> (e2,e6), (e3,e7)
                b[2 * t, g], b[2 * t + 1, g] = e[2 * h], e[2 * h + 4]
                b[2 * t + 8, g], b[2 * t + 9, g] = e[2 * h + 1], e[2 * h + 5]
            d += a @ b
    return d


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_kernel_fragment_model_matches_reference(dtype: str) -> None:
    rng = np.random.default_rng(3)
    qw, scales = _random_q4(rng, 16, 128)
    x = rng.standard_normal((8, 128)).astype(np.float32)
    x = (
        x.astype(np.float16).astype(np.float64)
        if dtype == "float16"
        else np.array([float(_to_bf16(v)) for v in x.ravel()]).reshape(8, 128)
    )
    d = _kstep_model(qw, scales, x, dtype)
    ref = q4_linear_reference(x, qw, scales)  # [8 act rows, 16 out rows]
    # The only rounding is that of the dequantized weights to the mma's input type.
    tol = 2e-3 if dtype == "float16" else 1e-2
    assert _rel_err(d.T, ref) < tol


# ---------------------------------------------------------------------------------------------
# The TensorIR route on the CPU (llvm), loaded with the lean runtime loader


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_tir_llvm_matches_float64(tmp_path: Path, rows: int) -> None:
    torch = pytest.importorskip("torch")
    from ignis.runtime.kernels.tvm_runtime import load_module

    n, k = 48, 256
    path = build_q4_linear({"kind": "llvm"}, n, k, rows, out_path=tmp_path / f"q4_r{rows}.so")
    f = load_module(path, cuda=False)[FUNCTION_NAME]
    rng = np.random.default_rng(rows)
    qw, scales = _random_q4(rng, n, k)
    x = rng.standard_normal((rows, k)).astype(np.float16)
    y = torch.full((rows, n), float("nan"), dtype=torch.float16)
    f(torch.from_numpy(x), torch.from_numpy(qw), torch.from_numpy(scales), y)
    assert torch.isfinite(y).all()
    assert _rel_err(y.numpy(), q4_linear_reference(x, qw, scales)) < 2e-3


def test_lean_loader_does_not_import_tvm(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    path = build_q4_linear({"kind": "llvm"}, 16, 64, 2, out_path=tmp_path / "q4.so")
    code = textwrap.dedent(f"""
        import sys
        from ignis.runtime.kernels.tvm_runtime import load_module
        mod = load_module({str(path)!r}, cuda=False)
        mod[{FUNCTION_NAME!r}]
        assert "tvm" not in sys.modules, "the lean loader imported tvm"
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# The CUDA route: cross-compiled on a host without a GPU; the exports hold SASS, not PTX/source


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_cuda_route_cross_compiles_to_sass(tmp_path: Path, arch: str) -> None:
    path = build_q4_linear({"kind": "cuda", "arch": arch}, 17408, 5120, 8, out_path=tmp_path / "q4.so")
    info = cuda_binary_info(path)
    assert info.sass_archs == (arch,), info
    assert info.is_binary_only, info


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_tir_route_for_cuda_embeds_a_cubin(tmp_path: Path) -> None:
    """The libcuda stub makes TVM emit a binary, not CUDA source, on a host with no driver."""
    path = build_q4_linear(
        {"kind": "cuda", "arch": "sm_90"}, 256, 512, 1, route="tir", out_path=tmp_path / "q4.so"
    )
    info = cuda_binary_info(path)
    assert info.sass_archs == ("sm_90",) and info.is_binary_only, info


def test_shape_and_width_limits() -> None:
    with pytest.raises(Q4KernelError):
        build_q4_linear({"kind": "cuda", "arch": "sm_90"}, 64, 96, 1)  # in % 128 != 0
    with pytest.raises(Q4KernelError):
        build_q4_linear({"kind": "cuda", "arch": "sm_90"}, 64, 128, 33)
    with pytest.raises(Q4KernelError):
        build_q4_linear({"kind": "llvm"}, 64, 128, 1, route="cuda")
    with pytest.raises(Q4KernelError):
        Q4TileConfig(n_tiles=5, m_tiles=1, warps=8, stages=4, prefetch_x=True)
    with pytest.raises(Q4KernelError):
        Q4TileConfig(n_tiles=1, m_tiles=2, warps=32, stages=8, prefetch_x=True)  # > 227 KiB smem
    assert default_tile_config(8, 17408, 5120).max_rows == 8
    assert default_tile_config(9, 17408, 5120).max_rows == 16


@pytest.mark.parametrize("rows", [1, 4, 8, 16, 24, 32])
@pytest.mark.parametrize("shape", [(17408, 5120), (5120, 17408), (248320, 5120), (1024, 256)])
def test_default_tiles_fit_each_arch(rows: int, shape: tuple[int, int]) -> None:
    for arch, limit in (("sm_90", 227 * 1024), ("sm_120", 99 * 1024)):
        cfg = default_tile_config(rows, *shape, arch=arch)
        assert cfg.max_rows >= rows and cfg.smem_bytes <= limit, (arch, cfg.tag)
    # H200 tiles handed to an sm_120 build are shrunk to fit (what build_q4_cuda_bundle does)
    assert _fit_smem(default_tile_config(rows, *shape), 99 * 1024).smem_bytes <= 99 * 1024


# ---------------------------------------------------------------------------------------------
# On a GPU host: the CUDA kernels against float64, every verify width, both activation dtypes


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda() or not HAS_NVCC, reason="needs a CUDA GPU and nvcc")
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_cuda_kernel_matches_float64_every_width(tmp_path: Path, dtype_name: str) -> None:
    import torch

    from ignis.runtime.kernels.tvm_runtime import load_module, torch_stream

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    dtype = getattr(torch, dtype_name)
    n, k = 272, 1024  # 17 m-tiles: one block covers a partial tile group
    rng = np.random.default_rng(7)
    qw, scales = _random_q4(rng, n, k)
    w_dev = torch.from_numpy(qw.view(np.int32)).cuda()
    s_dev = torch.from_numpy(scales).cuda()
    wd = torch.from_numpy(dequantize_q4(qw, scales)).cuda()
    tol = 2e-3 if dtype_name == "float16" else 1e-2
    built: dict[str, object] = {}  # one build per distinct tile
    for rows in [*range(1, 9), 12, 16, 24, 32]:
        tag = default_tile_config(rows, n, k, arch=arch).tag
        if tag not in built:
            path = build_q4_linear(
                {"kind": "cuda", "arch": arch}, n, k, rows, out_path=tmp_path / f"{tag}.so"
            )
            built[tag] = load_module(path)[FUNCTION_NAME]
        f = built[tag]
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        y = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
        with torch_stream():
            f(x, w_dev, s_dev, y)
        torch.cuda.synchronize()
        assert torch.isfinite(y).all(), f"rows={rows}: output not fully written"
        ref = x.double() @ wd.T
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < tol, f"rows={rows}: rel err {err:.2e}"


def test_frag_prefetch_config_rules() -> None:
    """Fragment prefetch (measured slower in run 8; kept for sweeps): validated, tagged, shrunk."""
    cfg = Q4TileConfig(1, 2, 4, 3, False, x_ring=True, min_blocks=4, frag_prefetch=1)
    assert cfg.tag.endswith("_fp1") and "IGNIS_Q4_EXPORT_FP(" in cfg.export_line("f")
    assert Q4TileConfig(1, 1, 8, 4, True).export_line("f").startswith("IGNIS_Q4_EXPORT(")
    with pytest.raises(Q4KernelError):
        Q4TileConfig(1, 1, 8, 2, True, frag_prefetch=1)  # needs >= 3 stages
    with pytest.raises(Q4KernelError):
        Q4TileConfig(1, 1, 8, 4, True, frag_prefetch=2)  # FP2 prefetches the activation ring
    with pytest.raises(Q4KernelError):
        Q4TileConfig(1, 1, 8, 4, True, vec=2, frag_prefetch=1)
    small = _fit_smem(Q4TileConfig(1, 2, 8, 4, False, x_ring=True, frag_prefetch=2), 99 * 1024)
    assert small.smem_bytes <= 99 * 1024 and small.frag_prefetch in (0, 1, 2)
    # run 9: the 8-warp up tile from 4 rows on
    assert default_tile_config(3, 17408, 5120).warps == 4
    assert default_tile_config(4, 17408, 5120).warps == 8


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_frag_prefetch_tile_cross_compiles(tmp_path: Path) -> None:
    tile = Q4TileConfig(1, 2, 4, 3, False, x_ring=True, min_blocks=4, frag_prefetch=1)
    path = build_q4_linear(
        {"kind": "cuda", "arch": "sm_90"}, 17408, 5120, 4, tile=tile, out_path=tmp_path / "q4.so"
    )
    info = cuda_binary_info(path)
    assert info.sass_archs == ("sm_90",) and info.is_binary_only, info


# ---------------------------------------------------------------------------------------------
# Layout "n" (q4_linear_n_kernel: block-shared activations, cluster split-K): the wide route


def test_n_layout_config_rules() -> None:
    cfg = Q4TileConfig(4, 2, 4, 2, False, layout="n", cluster_k=4)
    assert cfg.tag == "n4_mt2_wn4_kc4_s2" and cfg.rows_per_block == 128
    assert cfg.export_line("f").startswith("IGNIS_Q4_EXPORT_N(f, 4, 2, 4, 4, 2, true, 1, true, 0,")
    # per warp: 2 stages x 2 m-tiles x 1280 B of weights and scales; per block: 2 x 32 rows x 272 B
    assert cfg.smem_bytes == 4 * 2 * 2 * 1280 + 2 * 32 * 272
    tagged = Q4TileConfig(2, 2, 4, 4, False, layout="n", cluster_k=8, k_span=True, x_ca=True)
    assert tagged.tag.endswith("_kspan_xca")
    for bad in (
        {"layout": "m"},
        {"layout": "n", "cluster_k": 3},
        {"layout": "k", "cluster_k": 2},  # clusters only on layout n
        {"layout": "k", "k_span": True},
        {"layout": "n", "x_ring": True},
        {"layout": "n", "vec": 4},  # one or two k-steps per stage only
    ):
        with pytest.raises(Q4KernelError):
            Q4TileConfig(2, 2, 4, 4, False, **bad)
    # clusters need sm_90+: an sm_86 build drops them; sm_120 keeps them, shrunk to 99 KiB
    from ignis.compiler.kernels.q4_linear import _fit_arch

    big = Q4TileConfig(4, 2, 8, 6, False, layout="n", cluster_k=8)
    assert _fit_arch(big, "sm_86").cluster_k == 1
    small = _fit_arch(big, "sm_120")
    assert small.cluster_k == 8 and small.smem_bytes <= 99 * 1024 and small.layout == "n"


def test_wide_rules_use_the_n_layout() -> None:
    """9..32 rows take layout n on both chain shapes (runs 10-12); 1..8 rows stay split-K."""
    for rows in (9, 16, 17, 24, 25, 32):
        for shape in ((17408, 5120), (5120, 17408)):
            assert default_tile_config(rows, *shape).layout == "n", (rows, shape)
    for rows in (1, 4, 8):
        assert default_tile_config(rows, 17408, 5120).layout == "k"


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_n_layout_cross_compiles_to_sass(tmp_path: Path, arch: str) -> None:
    path = build_q4_linear({"kind": "cuda", "arch": arch}, 5120, 17408, 32, out_path=tmp_path / "q4.so")
    info = cuda_binary_info(path)
    assert info.sass_archs == (arch,) and info.is_binary_only, info


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda() or not HAS_NVCC, reason="needs a CUDA GPU and nvcc")
@pytest.mark.parametrize(
    "tile",
    [
        Q4TileConfig(4, 2, 4, 2, False, layout="n", cluster_k=4),
        Q4TileConfig(2, 2, 4, 4, False, layout="n", cluster_k=8, k_span=True, x_ca=True),
        Q4TileConfig(4, 2, 4, 2, False, layout="n", cluster_k=8, vec=2, k_span=True),
        Q4TileConfig(3, 1, 8, 3, False, layout="n", cluster_k=1),
    ],
    ids=lambda c: c.tag,
)
def test_n_layout_matches_float64_and_is_deterministic(tmp_path: Path, tile: Q4TileConfig) -> None:
    """Partial blocks (272 outputs), K = 512 (4 k-steps, 2 stages of two: with 8 cluster ranks some
    get none), every width of the tile, both dtypes; the same inputs twice give the same bits."""
    import torch

    from ignis.runtime.kernels.tvm_runtime import load_module, torch_stream

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    path = build_q4_linear(
        {"kind": "cuda", "arch": arch}, 272, 512, tile.max_rows, tile=tile, out_path=tmp_path / "q4.so"
    )
    f = load_module(path)[FUNCTION_NAME]
    for n, k in ((272, 512), (272, 1024)):
        rng = np.random.default_rng(n + k)
        qw, scales = _random_q4(rng, n, k)
        w_dev = torch.from_numpy(qw.view(np.int32)).cuda()
        s_dev = torch.from_numpy(scales).cuda()
        wd = torch.from_numpy(dequantize_q4(qw, scales)).cuda()
        for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
            for rows in sorted({1, tile.max_rows - 7, tile.max_rows - 1, tile.max_rows}):
                x = torch.randn(rows, k, device="cuda", dtype=dtype)
                ys = []
                for _ in range(2):
                    y = torch.full((rows, n), float("nan"), device="cuda", dtype=dtype)
                    with torch_stream():
                        f(x, w_dev, s_dev, y)
                    ys.append(y)
                torch.cuda.synchronize()
                assert torch.isfinite(ys[0]).all(), f"{tile.tag} rows={rows}: output not fully written"
                assert torch.equal(ys[0], ys[1]), f"{tile.tag} rows={rows}: not deterministic"
                ref = x.double() @ wd.T
                err = ((ys[0].double() - ref).norm() / ref.norm()).item()
                assert err < tol, f"{tile.tag} rows={rows} K={k}: rel err {err:.2e}"
