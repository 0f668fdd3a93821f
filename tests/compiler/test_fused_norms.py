"""The fused row norms (residual add + (1 + w) RMSNorm; the GDN gated RMSNorm), the SwiGLU activation
and the narrow linear: their CPU models against the torch paths of `StaticHybridExecutor`, and
cross-compiled binaries (nvcc). The GPU comparison is tests/runtime/test_hybrid_graphs.py (marker
`gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kernel_module_checks import HAS_NVCC, check_sass_and_exports, load_on_host_or_skip

from ignis.compiler.kernels.fused_norms import (
    FUNCTION_NAMES,
    FusedNormsError,
    add_rms_norm_emulated,
    add_rms_norm_llama_emulated,
    add_rms_norm_llama_reference,
    add_rms_norm_reference,
    build_fused_norms,
    gated_rms_norm_emulated,
    gated_rms_norm_reference,
    narrow_linear_emulated,
    narrow_linear_reference,
    silu_mul_emulated,
    silu_mul_reference,
)
from ignis.runtime.families.hybrid_executor import gated_rms_norm, rms_norm_one_plus
from ignis.runtime.families.moe import SwiGLUWeights, swiglu_mlp

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of b's dtype at b's magnitude."""
    eps = torch.finfo(b.dtype).eps
    return (a.float() - b.float()).abs() / (b.float().abs().clamp_min(1e-30) * eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 1), (1, 5120), (3, 300), (8, 257), (64, 64)])
def test_add_rms_norm_model_matches_torch(dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + hidden)
    h = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    d = torch.randn(rows, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype) * 0.1
    w1p = 1.0 + w.float()
    eps = 1e-6
    h_ref, x_ref = add_rms_norm_reference(h, d, w1p, eps)
    h_em, x_em = add_rms_norm_emulated(h, d, w1p, eps)
    assert h_em.dtype == x_em.dtype == dtype
    assert torch.equal(h_em, h_ref)  # the add rounds once, as torch's
    # the reference is HybridExecutor's norm (the oracle the executor is tested against)
    torch.testing.assert_close(
        x_ref, rms_norm_one_plus(h_ref, w, eps), atol=0, rtol=0 if dtype == torch.float32 else 1e-2
    )
    if dtype == torch.float32:
        torch.testing.assert_close(x_em, x_ref, atol=1e-6, rtol=2e-6)
    else:  # only the sum of squares' order differs: at most one rounding step apart
        close = _ulps(x_em, x_ref) <= 1.0
        assert close.all(), (x_em[~close], x_ref[~close])
        assert (x_em == x_ref).float().mean() > 0.97


def test_add_rms_norm_model_is_not_the_plain_norm() -> None:
    """The (1 + w) weight and the residual both matter: a model dropping either fails."""
    h, d = torch.randn(2, 64), torch.randn(2, 64)
    w1p = 1.0 + torch.randn(64)
    _, x = add_rms_norm_emulated(h, d, w1p, 1e-6)
    _, x_no_res = add_rms_norm_emulated(h, torch.zeros_like(d), w1p, 1e-6)
    _, x_no_w = add_rms_norm_emulated(h, d, torch.ones(64), 1e-6)
    assert not torch.allclose(x, x_no_res) and not torch.allclose(x, x_no_w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 1), (1, 576), (3, 300), (8, 1536), (64, 64)])
def test_add_rms_norm_llama_model_matches_the_llama_norm(dtype: torch.dtype, rows: int, hidden: int) -> None:
    """The llama kernel's model against HF LlamaRMSNorm after the residual add (`LlamaExecutor._norm`,
    two roundings: the normed row cast to the dtype, then the weight product): only the sum of
    squares' order differs."""
    from ignis.runtime.families.llama import LlamaExecutor

    g = torch.Generator().manual_seed(rows * 1000 + hidden + 7)
    h = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    d = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (1.0 + torch.randn(hidden, generator=g) * 0.1).to(dtype)
    eps = 1e-5
    h_ref, x_ref = add_rms_norm_llama_reference(h, d, w, eps)
    h_em, x_em = add_rms_norm_llama_emulated(h, d, w, eps)
    assert h_em.dtype == x_em.dtype == dtype
    assert torch.equal(h_em, h_ref)
    ex = LlamaExecutor.__new__(LlamaExecutor)  # only _rms_norm's config is read
    ex.config = type("C", (), {"rms_norm_eps": eps})()
    hf = ex._rms_norm(h_ref, w)  # HF's LlamaRMSNorm
    torch.testing.assert_close(x_ref, hf, atol=1e-6 if dtype == torch.float32 else 0, rtol=1e-2)
    if dtype == torch.float32:
        torch.testing.assert_close(x_em, x_ref, atol=1e-6, rtol=2e-6)
    else:  # the normed row may round to the neighbouring value; the weight product then rounds again
        close = _ulps(x_em, x_ref) <= 2.0
        assert close.all(), (x_em[~close], x_ref[~close])
        assert (x_em == x_ref).float().mean() > 0.97


def test_add_rms_norm_llama_model_rounds_twice() -> None:
    """The llama kernel rounds the normed row before the weight product (HF LlamaRMSNorm), unlike
    add_rms_norm's one rounding of the scaled row: on bf16 rows they differ somewhere."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(8, 576, generator=g).to(torch.bfloat16)
    d = torch.randn(8, 576, generator=g).to(torch.bfloat16)
    w = (1.0 + torch.randn(576, generator=g) * 0.3).to(torch.bfloat16)
    _, x_llama = add_rms_norm_llama_emulated(h, d, w, 1e-5)
    _, x_once = add_rms_norm_emulated(h, d, w.float(), 1e-5)
    assert not torch.equal(x_llama, x_once)
    _, x_ref = add_rms_norm_llama_reference(h, d, w, 1e-5)
    assert (x_llama == x_ref).float().mean() > (x_once == x_ref).float().mean()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_f32", [False, True])
@pytest.mark.parametrize(("rows", "heads", "dim"), [(1, 1, 1), (1, 48, 128), (5, 3, 40), (16, 4, 200)])
def test_gated_rms_norm_model_matches_torch(
    dtype: torch.dtype, x_f32: bool, rows: int, heads: int, dim: int
) -> None:
    g = torch.Generator().manual_seed(rows * 100 + heads * 10 + dim)
    x = torch.randn(rows, heads, dim, generator=g).to(dtype)
    if x_f32:  # float32 holding model-dtype values (the torch recurrence's output)
        x = x.float()
    zbig = torch.randn(rows, heads, 2 * dim, generator=g).to(dtype) * 4
    z = zbig[..., ::2]  # strided, as qwen3_next's grouped projection
    w = (1.0 + 0.2 * torch.randn(dim, generator=g)).to(dtype)
    eps = 1e-6
    ref = gated_rms_norm_reference(x, z, w, eps)
    em = gated_rms_norm_emulated(x, z, w, eps)
    assert em.shape == ref.shape == (rows, heads * dim) and em.dtype == ref.dtype == dtype
    torch.testing.assert_close(
        ref.view(rows, heads, dim),
        gated_rms_norm(x.to(dtype), z, w, eps),
        atol=1e-6,
        rtol=1e-5 if dtype == torch.float32 else 1e-2,
    )
    if dtype == torch.float32:
        torch.testing.assert_close(em, ref, atol=1e-6, rtol=1e-5)
    else:  # the rounded y may land one step apart; then the two later roundings follow
        close = _ulps(em, ref) <= 3.0
        assert close.all(), (em[~close], ref[~close])
        assert (em == ref).float().mean() > 0.95


def test_gated_rms_norm_model_uses_the_gate() -> None:
    x, z, w = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(16)
    a = gated_rms_norm_emulated(x, z, w, 1e-6)
    b = gated_rms_norm_emulated(x, -z, w, 1e-6)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 1), (1, 17408), (3, 37), (64, 96)])
def test_silu_mul_model_matches_the_mlp(dtype: torch.dtype, rows: int, inter: int) -> None:
    """The CPU model of silu_mul against `swiglu_mlp`'s activation (the torch path): bit for bit in
    the half types (the same float32 formula, rounded at the same points), within a float32 step in
    float32 (the CPU's vectorized silu is another formula); a model that swapped gate and up, or
    skipped the rounding of silu, would differ."""
    g = torch.Generator().manual_seed(rows * 7 + inter)
    gu = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    ref, em = silu_mul_reference(gu), silu_mul_emulated(gu)
    assert em.shape == (rows, inter) and em.dtype == dtype
    # the oracle is what the executor's `swiglu_mlp` hands its down projection after the stacked
    # gate|up GEMM (this fails if the MLP's activation and `silu_mul_reference` drift apart)
    down = torch.zeros(1, inter, dtype=dtype)
    seen: list[torch.Tensor] = []

    def linear(x: torch.Tensor, w: torch.Tensor, b: object) -> torch.Tensor:
        if w is gu:  # the stacked gate|up "GEMM" returns gu itself
            return gu
        assert w is down
        seen.append(x)
        return x

    mlp = SwiGLUWeights(gate=None, up=None, down=down, gate_up=gu)
    swiglu_mlp(torch.zeros(rows, 1, dtype=dtype), mlp, linear=linear)
    assert torch.equal(seen[0], ref)
    if dtype == torch.float32:
        torch.testing.assert_close(em, ref, atol=1e-6, rtol=2e-7)
    else:
        assert torch.equal(em, ref)
    if inter > 1:
        swapped = torch.cat([gu[:, inter:], gu[:, :inter]], dim=1)
        assert not torch.equal(silu_mul_emulated(swapped), em)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 96, 5120), (8, 96, 5120), (9, 5, 1024 + 512), (3, 1, 64)])
def test_narrow_linear_model_matches_torch(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    """The CPU model of narrow_linear against float64 and torch's F.linear: float32 sums in another
    order, so within a few float32 steps of the exact sum before the final rounding (a dropped chunk,
    a wrong element pairing or a row mix-up is off by far more)."""
    g = torch.Generator().manual_seed(rows * 31 + n + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    exact = x.double() @ w.double().T
    em = narrow_linear_emulated(x, w)
    assert em.shape == (rows, n) and em.dtype == dtype
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-30  # float32 sums of k terms
    step = torch.finfo(dtype).eps * exact.abs()  # the final rounding (half a step) and slack
    assert bool(((em.double() - exact).abs() <= bound + step).all())
    ref = narrow_linear_reference(x, w)
    assert bool(((em.double() - ref.double()).abs() <= 2 * (bound + step)).all())


def _narrow_literal(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """narrow_linear as its kernel reads (fused_norms.cuh), one scalar at a time: thread t of
    LIN_THREADS walks chunks t, t + LIN_THREADS, .. (16 bytes each), an FMA per element in order; each
    warp's 32 sums meet in an xor-shuffle tree (lane 0's value); the warp sums are added in order."""
    import numpy as np

    from ignis.compiler.kernels.fused_norms import LIN_THREADS

    per = 16 // x.element_size()
    xs, ws = x.float().numpy(), w.float().numpy()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    chunks = x.shape[1] // per
    for r in range(x.shape[0]):
        for n in range(w.shape[0]):
            acc = [np.float32(0)] * LIN_THREADS
            for c in range(chunks):
                t = c % LIN_THREADS
                for e in range(per):
                    k = c * per + e  # an FMA: the exact product and sum, rounded once to float32
                    acc[t] = np.float32(float(xs[r, k]) * float(ws[n, k]) + float(acc[t]))
            total = np.float32(0)
            for q in range(LIN_THREADS // 32):
                lanes = acc[q * 32 : (q + 1) * 32]
                for o in (16, 8, 4, 2, 1):
                    lanes = [np.float32(lanes[i] + lanes[i ^ o]) for i in range(32)]
                total = np.float32(total + lanes[0])
            out[r, n] = float(total)
    return out.to(x.dtype)


def test_narrow_linear_model_is_the_kernel_order() -> None:
    """The vectorized CPU model of narrow_linear equals a scalar reading of the kernel's order past
    the chunks a thread loads at once: K = 8,800 is 2,200 float32 chunks (4 elements) over 512
    threads -- threads 0-151 take a fifth -- and 1,100 bfloat16 chunks (8 elements) -- threads 0-75
    take a third. Float32 sums within a float32 step (the model's FMA is emulated in float64: a rare
    double rounding) and mostly equal; bfloat16 outputs within a step and mostly equal."""
    from ignis.compiler.kernels.fused_norms import narrow_linear_emulated

    g = torch.Generator().manual_seed(3)
    for dtype, step in ((torch.float32, 2**-23), (torch.bfloat16, 2**-7)):
        x = torch.randn(2, 8800, generator=g).to(dtype)
        w = (torch.randn(3, 8800, generator=g) * 0.05).to(dtype)
        lit = _narrow_literal(x, w).double()
        em = narrow_linear_emulated(x, w).double()
        assert bool(((em - lit).abs() <= step * lit.abs()).all()), dtype
        assert (em == lit).float().mean() >= 0.5, dtype


def test_build_rejects_non_cuda_targets() -> None:
    with pytest.raises(FusedNormsError):
        build_fused_norms("llvm")
    with pytest.raises(FusedNormsError):
        build_fused_norms({"kind": "cuda", "arch": "gfx90a"})


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_build_emits_sass_and_all_exports(arch: str, tmp_path: Path) -> None:
    path = build_fused_norms(arch, out_path=tmp_path / f"norms_{arch}.so")
    check_sass_and_exports(
        path,
        arch,
        FUNCTION_NAMES,
        ("add_rms_norm_kernel", "gated_rms_norm_kernel", "silu_mul_kernel", "narrow_linear_kernel"),
    )


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_module_loads_and_checks_arguments(tmp_path: Path) -> None:
    """The exports load here (no GPU: tvm-ffi still checks what it can before launching)."""
    pytest.importorskip("tvm_ffi")
    path = build_fused_norms("sm_90", out_path=tmp_path / "norms.so")
    mod = load_on_host_or_skip(path)
    h = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="CUDA device"):
        mod["add_rms_norm"](h, h, torch.ones(8), torch.empty_like(h), torch.empty_like(h), 1e-6)
    with pytest.raises(ValueError, match="w1p"):
        mod["add_rms_norm"](h, h, torch.ones(7), torch.empty_like(h), torch.empty_like(h), 1e-6)
    with pytest.raises(TypeError, match="float32"):
        mod["add_rms_norm"](
            h, h, torch.ones(8, dtype=torch.float16), torch.empty_like(h), torch.empty_like(h), 1e-6
        )
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="out must be"):
        mod["gated_rms_norm"](x, x, torch.ones(4), torch.empty(2, 11), 1e-6)
    with pytest.raises(TypeError, match="z's dtype"):
        mod["gated_rms_norm"](x, x, torch.ones(4, dtype=torch.bfloat16), torch.empty(2, 12), 1e-6)
    gu = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="CUDA device"):
        mod["silu_mul"](gu, torch.empty(2, 4))
    with pytest.raises(ValueError, match="gu must be"):
        mod["silu_mul"](gu, torch.empty(2, 3))
    with pytest.raises(TypeError, match="gu's dtype"):
        mod["silu_mul"](gu, torch.empty(2, 4, dtype=torch.float16))
    xl, wl = torch.zeros(3, 16), torch.zeros(5, 16)
    with pytest.raises(ValueError, match="CUDA device"):
        mod["narrow_linear"](xl, wl, torch.empty(3, 5))
    with pytest.raises(ValueError, match="w must be"):
        mod["narrow_linear"](xl, torch.zeros(5, 8), torch.empty(3, 5))
    with pytest.raises(TypeError, match="x's dtype"):
        mod["narrow_linear"](xl, wl.half(), torch.empty(3, 5))


def test_cpu_models_use_the_kernels_thread_counts() -> None:
    """The CPU models' thread counts (their order of float32 sums) are the CUDA source's."""
    import re

    from ignis.compiler.kernels import fused_norms

    src = (Path(fused_norms.__file__).parent / "fused_norms.cuh").read_text()
    for const, value in (("kAddThreads", fused_norms.ADD_THREADS), ("kLinThreads", fused_norms.LIN_THREADS)):
        found = re.search(rf"constexpr int {const} = (\d+);", src)
        assert found is not None and int(found.group(1)) == value, const
