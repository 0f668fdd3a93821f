"""The fused Gated DeltaNet recurrence: its CPU model against the torch path (`gated_delta_rule_recurrent`
after the executor's preparation), its limits, and cross-compiled binaries (nvcc) with their argument
checks. The GPU comparison is tests/runtime/test_hybrid_graphs.py (marker `gpu`)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ignis.compiler.kernels.gdn_recurrent import (
    CHUNK,
    COLS,
    FUNCTION_NAME,
    MAX_KEY_DIM,
    WARPS,
    GdnKernelError,
    build_gdn_recurrent,
    gdn_recurrent_emulated,
    gdn_recurrent_reference,
    rows_per_thread,
)
from ignis.runtime.families.gated_deltanet import gated_delta_rule_recurrent, l2_normalize

HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()


def _inputs(lanes, n, hk, hv, dk, dv, slots_total, *, dtype=torch.float32, decay="mixed", seed=0):
    g = torch.Generator().manual_seed(seed)
    conv_dim = 2 * hk * dk + hv * dv
    mixed = torch.randn(lanes, n, conv_dim, generator=g).to(dtype)
    b = torch.randn(lanes, n, hv, generator=g).to(dtype)
    a = torch.randn(lanes, n, hv, generator=g).to(dtype)
    if decay == "near0":  # g ~ -1e-6: alpha ~ 1, the state keeps everything
        neg_a, dt_bias = torch.full((hv,), -1e-6), torch.full((hv,), -12.0)
    elif decay == "large":  # g ~ -300: alpha underflows to 0, every column starts afresh
        neg_a, dt_bias = torch.full((hv,), -30.0), torch.full((hv,), 10.0)
    else:
        neg_a = -torch.exp(torch.empty(hv).uniform_(-3.0, 2.5, generator=g))
        dt_bias = torch.randn(hv, generator=g)
    state = torch.randn(slots_total, hv, dk, dv, generator=g) * 0.3
    slots = torch.randperm(slots_total, generator=g)[:lanes]
    return mixed, b, a, neg_a, dt_bias, state, slots


SHAPES = [  # lanes, n, k_heads, v_heads, k_dim, v_dim, state slots
    (1, 1, 1, 1, 16, 8, 1),
    (2, 5, 2, 4, 16, 8, 3),  # the tiny test configs' GDN: GQA 2, k_dim != v_dim
    (3, 8, 2, 6, 128, 128, 5),  # the 27B head dims, GQA 3
    (2, 20, 1, 2, 40, 70, 2),  # more columns than a staged chunk; dims not multiples of 32
    (1, 3, 1, 3, 256, 33, 1),  # the largest k_dim
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("decay", ["mixed", "near0", "large"])
def test_emulated_kernel_matches_the_torch_path(shape: tuple[int, ...], decay: str) -> None:
    lanes, n, hk, hv, dk, dv, total = shape
    args = _inputs(lanes, n, hk, hv, dk, dv, total, decay=decay, seed=sum(shape))
    out_ref, rec_ref = gdn_recurrent_reference(*args, hk)
    out, rec = gdn_recurrent_emulated(*args, hk)
    assert out.shape == (lanes, n, hv, dv) and rec.shape == (n, lanes, hv, dk, dv)
    assert out.dtype == rec.dtype == torch.float32
    torch.testing.assert_close(out, out_ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(rec, rec_ref, atol=2e-6, rtol=1e-5)
    if decay == "large":  # the state before the round is forgotten at once
        assert float(rec[0].abs().max()) < 1.0
    if decay == "near0":  # ... or kept: the first column's state is the old one plus a rank-1 write
        slot0 = int(args[-1][0])
        assert float((rec[0, 0] - args[5][slot0]).abs().max()) < 1.0


def test_reference_is_the_per_lane_recurrence_with_gqa_repeat() -> None:
    """The oracle spelled out once by hand for one lane: l2 norm, q scale, key head h // rep."""
    hk, hv, dk, dv = 2, 6, 16, 8
    mixed, b, a, neg_a, dt_bias, state, slots = _inputs(2, 4, hk, hv, dk, dv, 2, seed=9)
    out, rec = gdn_recurrent_reference(mixed, b, a, neg_a, dt_bias, state, slots, hk)
    lane = 1
    q, k, v = mixed[lane].split([hk * dk, hk * dk, hv * dv], dim=-1)
    heads = torch.arange(hv) // (hv // hk)
    q = l2_normalize(q.reshape(4, hk, dk))[:, heads] * dk**-0.5
    k = l2_normalize(k.reshape(4, hk, dk))[:, heads]
    g = neg_a * F.softplus(a[lane] + dt_bias)
    o, states = gated_delta_rule_recurrent(
        q, k, v.reshape(4, hv, dv), g, b[lane].sigmoid(), state[int(slots[lane])], record=True
    )
    torch.testing.assert_close(out[lane], o, atol=0, rtol=0)
    torch.testing.assert_close(rec[:, lane], states, atol=0, rtol=0)


def test_emulated_kernel_bf16_inputs_round_beta_like_torch() -> None:
    """bf16 inputs: sigmoid(b) is rounded to bf16 as torch's sigmoid of a bf16 tensor."""
    args = _inputs(2, 6, 2, 4, 128, 128, 2, dtype=torch.bfloat16, seed=4)
    out_ref, rec_ref = gdn_recurrent_reference(*args, 2)
    out, rec = gdn_recurrent_emulated(*args, 2)
    torch.testing.assert_close(out, out_ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(rec, rec_ref, atol=2e-6, rtol=1e-5)
    # the tolerance sees the rounding: beta left in float32 (b widened first) is outside it
    mixed, b, a, *rest = args
    out_f32_beta, _ = gdn_recurrent_reference(mixed.float(), b.float(), a.float(), *rest, 2)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out, out_f32_beta, atol=2e-6, rtol=1e-5)


def test_limits_and_shape_errors() -> None:
    assert [rows_per_thread(d) for d in (1, 16, 17, 64, 65, 128, 129, 256)] == [2, 2, 4, 8, 16, 16, 32, 32]
    with pytest.raises(GdnKernelError, match="k_dim"):
        rows_per_thread(MAX_KEY_DIM + 1)
    args = list(_inputs(1, 2, 2, 4, 16, 8, 1))
    with pytest.raises(GdnKernelError, match="multiple"):
        gdn_recurrent_emulated(*args, 3)
    args[1] = args[1][:, :1]
    with pytest.raises(GdnKernelError, match="b must be"):
        gdn_recurrent_reference(*args, 2)


def test_constants_match_the_header() -> None:
    import ignis.compiler.kernels.gdn_recurrent as kern
    import ignis.runtime.families.hybrid_graphs as hg

    src = (Path(kern.__file__).parent / "gdn_recurrent.cuh").read_text()
    for name, value in (("kWarps", WARPS), ("kCols", COLS), ("kChunk", CHUNK), ("kMaxKeyDim", MAX_KEY_DIM)):
        assert re.search(rf"constexpr int {name} = {value};", src), name
    assert re.search(r"constexpr float kL2Eps = 1e-6f;", src)
    assert hg._GDN_MAX_KEY_DIM == MAX_KEY_DIM and hg.GDN_FUNCTION_NAME == FUNCTION_NAME


# ---------------------------------------------------------------------------------------------
# Cross-compiled binaries (nvcc on the build host; no GPU needed)


@pytest.mark.skipif(not HAS_NVCC, reason="needs the CUDA toolkit (nvcc)")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_build_holds_sass_for_its_arch_only(tmp_path: Path, arch: str) -> None:
    from ignis.compiler.build.modules import check_cuda_binary
    from ignis.compiler.kernels.q4_linear import cuda_binary_info

    path = build_gdn_recurrent({"kind": "cuda", "arch": arch}, out_path=tmp_path / f"gdn_{arch}.so")
    check_cuda_binary(path, arch)
    assert cuda_binary_info(path).sass_archs == (arch,)
    assert FUNCTION_NAME.encode() in path.read_bytes()
    if arch != "sm_90":
        return
    # the exported function loads without a GPU and checks its arguments before any CUDA call
    import tvm_ffi

    f = tvm_ffi.load_module(str(path))[FUNCTION_NAME]
    hk, hv, dk, dv = 2, 4, 16, 8
    mixed, b, a, neg_a, dt_bias, state, slots = _inputs(2, 3, hk, hv, dk, dv, 2)
    record = torch.empty(3, 2, hv, dk, dv)
    out = torch.empty(2, 3, hv, dv)
    ok = [mixed, b, a, neg_a, dt_bias, state, slots, record, out]

    def call(**swap):
        args = list(ok)
        names = ["mixed", "b", "a", "neg_a", "dt_bias", "state", "slots", "record", "out"]
        for key, value in swap.items():
            args[names.index(key)] = value
        f(*args, hk, 0.25)

    with pytest.raises(ValueError, match="CUDA device"):
        call()
    with pytest.raises(ValueError, match="channels"):
        call(mixed=mixed[..., 1:])
    with pytest.raises(TypeError, match="float32"):
        call(state=state.double())
    with pytest.raises(TypeError, match="int64"):
        call(slots=slots.int())
    with pytest.raises(TypeError, match="mixed's dtype"):
        call(b=b.half())
    with pytest.raises(ValueError, match="record must be"):
        call(record=record[:2])
    with pytest.raises(ValueError, match="out must be"):
        call(out=torch.empty(2, 3, dv, hv).transpose(2, 3))
    with pytest.raises(ValueError, match="k_dim"):
        f(
            torch.empty(1, 1, 2 * 300 + 8),
            torch.empty(1, 1, 1),
            torch.empty(1, 1, 1),
            torch.empty(1),
            torch.empty(1),
            torch.empty(1, 1, 300, 8),
            torch.zeros(1, dtype=torch.int64),
            torch.empty(1, 1, 1, 300, 8),
            torch.empty(1, 1, 1, 8),
            1,
            0.1,
        )


def test_build_rejects_non_cuda_targets() -> None:
    with pytest.raises(GdnKernelError, match="CUDA only"):
        build_gdn_recurrent("llvm")
    with pytest.raises(GdnKernelError):
        build_gdn_recurrent({"kind": "cuda", "arch": "ampere"})
