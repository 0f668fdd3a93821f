"""The exact top-k kernel: the tie rule of the reference, the kernel's key encoding, a CPU model of
both kernels against the reference, cross-compiled binaries (nvcc) and their argument checks."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ignis.compiler.kernels.topk import (
    FUNCTION_NAME,
    GROUP,
    MAX_K,
    MAX_VOCAB,
    TopKKernelError,
    build_topk,
    encode_keys,
    encode_ord,
    topk_emulated,
    topk_reference,
    workspace_numel,
)

HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
NAN, INF = float("nan"), float("inf")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# ---------------------------------------------------------------------------------------------
# The reference: the tie rule


def test_reference_orders_ties_by_smaller_index_nan_first_and_zeros_equal() -> None:
    x = torch.tensor([[1.0, 3.0, NAN, 3.0, -0.0, INF, 0.0, NAN, -INF, 1.0, -0.0]])
    v, i = topk_reference(x, 11)
    assert i.tolist() == [[2, 7, 5, 1, 3, 0, 9, 4, 6, 10, 8]]
    # values are the input's own bits: -0.0 stays -0.0
    assert _bits(v).tolist() == _bits(x[0, i[0]])[None].tolist()
    assert torch.signbit(v[0, 7]) and not torch.signbit(v[0, 8])
    # cut to k: the first of equal values by index
    assert topk_reference(x, 4)[1].tolist() == [[2, 7, 5, 1]]


def test_reference_matches_torch_topk_without_ties() -> None:
    x = torch.randn(4, 3000, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    v, i = topk_reference(x, 64)
    tv, ti = torch.topk(x, 64)
    assert torch.equal(i, ti) and torch.equal(v, tv)


# ---------------------------------------------------------------------------------------------
# The key encoding (ord_bits / make_key in topk.cuh)


def test_ord_encoding_is_monotone_and_canonical() -> None:
    f32 = np.float32
    tiny = np.finfo(np.float32).smallest_subnormal
    big, normal = np.finfo(f32).max, np.finfo(f32).tiny
    above_one = np.nextafter(f32(1.0), f32(2.0))
    ladder = np.array(
        [-INF, -big, -1.0, -normal, -tiny, 0.0, tiny, 2 * tiny, normal, 1.0, above_one, big, INF, NAN],
        dtype=np.float32,
    )
    o = encode_ord(ladder).astype(np.int64)
    assert (np.diff(o) > 0).all(), o
    assert o.min() > 0  # 0 is the kernel's padding key
    # -0.0 == +0.0; every NaN (any sign, any payload) is the largest
    z = encode_ord(np.array([0.0, -0.0], dtype=np.float32))
    assert z[0] == z[1] == 0x80000000
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], dtype=np.uint32).view(np.float32)
    assert (encode_ord(nans) == 0xFFFFFFFF).all()
    assert encode_ord(np.array([INF], dtype=np.float32))[0] < 0xFFFFFFFF


def test_ord_encoding_agrees_with_float_order_on_random_bits() -> None:
    rng = np.random.default_rng(5)
    x = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[~np.isnan(x)]
    o = encode_ord(x)
    a, b = x[:-1], x[1:]
    oa, ob = o[:-1], o[1:]
    assert ((a < b) == (oa < ob)).all() and ((a == b) == (oa == ob)).all()
    # round trip away from the canonicalised values: the map is a bijection there
    nz = x != 0
    back = np.where(
        o[nz] & np.uint32(0x80000000), o[nz] & np.uint32(0x7FFFFFFF), ~o[nz] & np.uint32(0xFFFFFFFF)
    ).astype(np.uint32)
    assert (back == x[nz].view(np.uint32)).all()


def test_keys_are_unique_and_break_ties_by_smaller_index() -> None:
    x = np.array([[2.0, 2.0, -0.0, 0.0, NAN, NAN]], dtype=np.float32)
    k = encode_keys(x)[0]
    assert len(set(k.tolist())) == 6
    assert k[0] > k[1] and k[2] > k[3] and k[4] > k[5] and k[5] > k[0]
    # the low 32 bits give the index back
    assert ((np.uint64(0xFFFFFFFF) - (k & np.uint64(0xFFFFFFFF))) == np.arange(6)).all()


def test_runtime_rank_orders_values_like_the_kernel_keys() -> None:
    """runtime/kernels/topk.py's float64 rank space orders any two values as the kernel's ord bits do
    (NaN above +inf, -0.0 equal to +0.0), for float32, bfloat16 and float16."""
    from ignis.runtime.kernels.topk import _rank

    g = torch.Generator().manual_seed(2)
    x = torch.randn(400, generator=g) * 1e4
    x[::7] = NAN
    x[1::11] = -0.0
    x[4::11] = 0.0
    x[2::13] = INF
    x[3::17] = -INF
    x[5::19] = torch.finfo(torch.float32).max
    x[6::23] = torch.finfo(torch.float32).tiny / 8  # subnormal
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        r = _rank(xd).numpy()
        o = encode_ord(xd.float().numpy()).astype(np.int64)
        assert np.isfinite(r).all()
        assert (np.sign(np.subtract.outer(r, r)) == np.sign(np.subtract.outer(o, o))).all(), dtype
        assert torch.equal(_bits(xd), _bits(x.to(dtype)))  # the input is not modified


# ---------------------------------------------------------------------------------------------
# The CPU model of both kernels against the reference


def _tie_heavy(kind: str, rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=gen) * 3
    if kind == "quantized":
        return torch.clamp(torch.round(x / 2), -4, 4)
    if kind == "bf16":
        return x.bfloat16().float()
    if kind == "equal":
        return torch.full((rows, vocab), 0.5)
    if kind == "special":
        x = torch.round(x)
        x[:, ::211] = NAN
        x[:, 5::307] = INF
        x[:, 9::13] = -INF
        x[:, 1::3] = 0.0
        x[:, 2::3] = -0.0
        return x
    if kind == "ascending":  # every element beats the ones before: the worst case for streaming
        return torch.arange(vocab, dtype=torch.float32).repeat(rows, 1)
    return x


@pytest.mark.parametrize("kind", ["randn", "quantized", "bf16", "equal", "special", "ascending"])
@pytest.mark.parametrize(("vocab", "k"), [(248_320, 64), (248_320, 16), (4097, 64), (300, 1), (64, 64)])
def test_emulated_kernel_matches_reference(kind: str, vocab: int, k: int) -> None:
    gen = torch.Generator().manual_seed(vocab + k)
    x = _tie_heavy(kind, 2, vocab, gen)
    rv, ri = topk_reference(x, k)
    for ev in (4, 8):  # float32 and 16-bit group layouts
        v, i = topk_emulated(x.numpy(), k, vector_elems=ev)
        assert np.array_equal(i, ri.numpy()), (kind, ev)
        assert np.array_equal(v.view(np.int32), _bits(rv).numpy()), (kind, ev)


def test_emulated_kernel_limits_and_workspace() -> None:
    assert workspace_numel(1, 248_320) == 32 * 61  # 61 tiles of 4096, 32 groups of 128 each
    assert workspace_numel(8, 4096) == 8 * 32 and workspace_numel(1, 4097) == 64
    assert workspace_numel(1, MAX_VOCAB) == 8192
    assert GROUP * MAX_K <= 8192  # the select kernel's candidate buffer holds k groups
    with pytest.raises(TopKKernelError):
        workspace_numel(1, MAX_VOCAB + 1)
    with pytest.raises(TopKKernelError):
        topk_emulated(np.zeros((1, 100), np.float32), MAX_K + 1)
    with pytest.raises(TopKKernelError):
        topk_emulated(np.zeros((1, 10), np.float32), 11)


def test_runtime_limits_match_the_kernel() -> None:
    import ignis.compiler.kernels.topk as kern
    import ignis.runtime.kernels.topk as rt

    assert (rt.MAX_K, rt.MAX_VOCAB, rt.TILE) == (kern.MAX_K, kern.MAX_VOCAB, kern.TILE)
    src = (Path(kern.__file__).parent / "topk.cuh").read_text()
    assert f"kGroup = {kern.GROUP};" in src and f"kMaxK = {kern.MAX_K};" in src
    assert f"kCap = {kern.CAP};" in src


# ---------------------------------------------------------------------------------------------
# Cross-compiled binaries (nvcc on the build host; no GPU needed)


@pytest.mark.skipif(not HAS_NVCC, reason="needs the CUDA toolkit (nvcc)")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_build_holds_sass_for_its_arch_only(tmp_path: Path, arch: str) -> None:
    from ignis.compiler.build.modules import check_cuda_binary
    from ignis.compiler.kernels.q4_linear import cuda_binary_info

    path = build_topk({"kind": "cuda", "arch": arch}, out_path=tmp_path / f"topk_{arch}.so")
    check_cuda_binary(path, arch)
    assert cuda_binary_info(path).sass_archs == (arch,)
    assert FUNCTION_NAME.encode() in path.read_bytes()
    if arch != "sm_90":
        return
    # the exported function loads without a GPU and checks its arguments before any CUDA call
    import tvm_ffi

    f = tvm_ffi.load_module(str(path))[FUNCTION_NAME]
    x = torch.randn(2, 1000)
    v, i, w = torch.empty(2, 8), torch.empty(2, 8, dtype=torch.int64), torch.empty(64, dtype=torch.int64)
    with pytest.raises(ValueError, match="CUDA device"):
        f(x, v, i, w)
    with pytest.raises(ValueError, match=r"k must be 1\.\.64"):
        f(x, torch.empty(2, 65), torch.empty(2, 65, dtype=torch.int64), w)
    with pytest.raises(TypeError, match="int64"):
        f(x, v, i.int(), w)
    with pytest.raises(TypeError, match="x's dtype"):
        f(x, v.half(), i, w)
    with pytest.raises(ValueError, match="at least 64 elements"):
        f(x, v, i, w[:10])


def test_build_rejects_non_cuda_targets() -> None:
    with pytest.raises(TopKKernelError, match="CUDA only"):
        build_topk("llvm")
    with pytest.raises(TopKKernelError):
        build_topk({"kind": "cuda", "arch": "ampere"})


def test_the_dtypes_an_artifact_records_are_the_ones_the_module_dispatches() -> None:
    """compiler/build/modules.py records KERNELS["topk"] dtypes in the manifest; the runtime then
    offers the kernel exactly those: they must be what topk_ffi.cuh dispatches on."""
    import ignis.compiler.kernels.topk as kern
    from ignis.compiler.build.modules import KERNELS
    from ignis.formats.manifest import KERNEL_ABIS

    src = (Path(kern.__file__).parent / "topk_ffi.cuh").read_text()
    dispatched = {
        name
        for name, pattern in (
            ("float32", "dtype_is(x, kDLFloat, 32)"),
            ("bfloat16", "dtype_is(x, kDLBfloat, 16)"),
            ("float16", "dtype_is(x, kDLFloat, 16)"),
        )
        if pattern in src
    }
    file, dtypes = KERNELS["topk"].file, KERNELS["topk"].dtypes
    assert set(dtypes) == dispatched and list(dtypes) == sorted(dtypes) and file == "topk.so"
    assert KERNEL_ABIS["topk"] == 1 and FUNCTION_NAME == "topk"
