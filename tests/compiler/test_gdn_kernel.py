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
    REPLAY_FUNCTION_NAME,
    STASH_FUNCTION_NAME,
    WARPS,
    GdnKernelError,
    build_gdn_recurrent,
    gdn_recurrent_emulated,
    gdn_recurrent_reference,
    gdn_replay_emulated,
    gdn_stash_emulated,
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


def _stash_replay_case(shape, seed, layers=2):
    """Per layer g the inputs of one round over the same lanes: (per-layer args, state [G, S, hv,
    dk, dv], keep [L], pos [L]) with keep covering 0, n and values between, pos a permutation."""
    lanes, n, hk, hv, dk, dv, total = shape
    per = [_inputs(lanes, n, hk, hv, dk, dv, total, seed=seed + g) for g in range(layers)]
    state = torch.stack([p[5] for p in per])  # [G, S, hv, dk, dv]
    slots = per[0][6]
    gen = torch.Generator().manual_seed(seed)
    keep = torch.randint(0, n + 1, (lanes,), generator=gen)
    keep[0] = n
    if lanes > 1:
        keep[1] = 0
    pos = torch.randperm(lanes, generator=gen)
    return per, state, slots, keep, pos


def _assert_replayed(state, before, records, slots, keep, total):
    """state [G, S, ..] after a replay of `before`: lane i's slot holds record[g][keep[i] - 1, i] (its
    state before the round when keep[i] is 0), and every other slot is unchanged."""
    for i in range(len(slots)):
        slot, k = int(slots[i]), int(keep[i])
        for g in range(len(records)):
            want = before[g, slot] if k == 0 else records[g][k - 1, i]
            assert torch.equal(state[g, slot], want), (i, g, k)
    untouched = [s for s in range(total) if s not in set(slots.tolist())]
    assert torch.equal(state[:, untouched], before[:, untouched])


@pytest.mark.parametrize("shape", SHAPES)
def test_stash_and_replay_emulated_equal_the_record(shape: tuple[int, ...]) -> None:
    """The stash path's CPU model: its output equals the record path's bit for bit, and replaying
    keep columns from the stash leaves exactly record[keep - 1] (keep 0: the state untouched), for
    every layer in one call, lanes addressed through pos."""
    lanes, n, hk, hv, dk, dv, total = shape
    per, state, slots, keep, pos = _stash_replay_case(shape, seed=3 * sum(shape))
    stash = torch.zeros(len(per), n + 2, lanes, hk * dk + hv * dv + 2 * hv)  # more columns than n
    records = []
    for g, (mixed, b, a, neg_a, dt_bias, _, _) in enumerate(per):
        args = (mixed, b, a, neg_a, dt_bias, state[g], slots)
        out, rec = gdn_recurrent_emulated(*args, hk)
        out_s, st = gdn_stash_emulated(*args, hk)
        assert torch.equal(out, out_s) and st.shape == (n, lanes, stash.shape[-1])
        stash[g, :n, pos] = st  # lane i's rows at stash lane pos[i]
        records.append(rec)
    before = state.clone()
    gdn_replay_emulated(stash, state, slots, keep, pos, hk)
    _assert_replayed(state, before, records, slots, keep, total)
    # a mutation the comparison catches: one column fewer
    if n > 1:
        again = before.clone()
        gdn_replay_emulated(stash, again, slots, torch.clamp(keep - 1, min=0), pos, hk)
        assert not torch.equal(again, state)


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
    import ignis.runtime.kernels.gdn_recurrent as rt

    src = (Path(kern.__file__).parent / "gdn_recurrent.cuh").read_text()
    for name, value in (("kWarps", WARPS), ("kCols", COLS), ("kChunk", CHUNK), ("kMaxKeyDim", MAX_KEY_DIM)):
        assert re.search(rf"constexpr int {name} = {value};", src), name
    assert re.search(r"constexpr float kL2Eps = 1e-6f;", src)
    assert rt.MAX_KEY_DIM == MAX_KEY_DIM and rt.FUNCTION_NAME == FUNCTION_NAME


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
    for name in (FUNCTION_NAME, STASH_FUNCTION_NAME, REPLAY_FUNCTION_NAME):
        assert name.encode() in path.read_bytes()
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


@pytest.mark.skipif(not HAS_NVCC, reason="needs the CUDA toolkit (nvcc)")
def test_stash_and_replay_exports_check_their_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tvm_ffi

    import ignis.runtime.kernels.tvm_runtime as tvm_runtime
    from ignis.runtime.kernels.gdn_recurrent import GdnRecurrentKernel

    path = build_gdn_recurrent({"kind": "cuda", "arch": "sm_90"}, out_path=tmp_path / "gdn.so")
    module = tvm_ffi.load_module(str(path))
    # the executor's wrapper takes the .so's path or the loaded module (a tvm_ffi.Module is callable:
    # it must not be taken for the function) with all three exports; the function alone, the record
    monkeypatch.setattr(tvm_runtime, "load_module", lambda p, cuda=None: tvm_ffi.load_module(str(p)))
    for source in (path, module):
        kernel = GdnRecurrentKernel(source)
        assert kernel.has_replay and GdnRecurrentKernel(kernel).has_replay
        with pytest.raises(ValueError, match="CUDA device"):  # the round function, not the module
            kernel.func(
                *_inputs(1, 1, 1, 1, 16, 8, 1), torch.empty(1, 1, 1, 16, 8), torch.empty(1, 1, 1, 8), 1, 0.25
            )
    assert not GdnRecurrentKernel(module[FUNCTION_NAME]).has_replay
    stash_f, replay_f = module[STASH_FUNCTION_NAME], module[REPLAY_FUNCTION_NAME]
    hk, hv, dk, dv = 2, 4, 16, 8
    w = hk * dk + hv * dv + 2 * hv
    mixed, b, a, neg_a, dt_bias, state, slots = _inputs(2, 3, hk, hv, dk, dv, 2)
    out = torch.empty(2, 3, hv, dv)
    with pytest.raises(ValueError, match="CUDA device"):
        stash_f(mixed, b, a, neg_a, dt_bias, state, slots, torch.empty(3, 2, w), out, hk, 0.25)
    with pytest.raises(ValueError, match="stash must be"):
        stash_f(mixed, b, a, neg_a, dt_bias, state, slots, torch.empty(3, 2, w + 1), out, hk, 0.25)
    with pytest.raises(ValueError, match=r"stash \[cols, lanes, W\]"):  # a record where the stash goes
        stash_f(mixed, b, a, neg_a, dt_bias, state, slots, torch.empty(3, 2, hv, dk, dv), out, hk, 0.25)
    st = torch.zeros(3, 2, hv, dk, dv)
    i64 = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="CUDA device"):
        replay_f(torch.zeros(3, 4, 2, w), st, i64, i64, i64, hk)
    with pytest.raises(ValueError, match="stash must be"):
        replay_f(torch.zeros(2, 4, 2, w), st, i64, i64, i64, hk)  # layers differ
    with pytest.raises(ValueError, match="stash must be"):
        replay_f(torch.zeros(3, 4, 2, w - 2), st, i64, i64, i64, hk)
    with pytest.raises(TypeError, match="int64"):
        replay_f(torch.zeros(3, 4, 2, w), st, i64, i64.int(), i64, hk)
    with pytest.raises(ValueError, match="one length"):
        replay_f(torch.zeros(3, 4, 2, w), st, i64, i64[:1], i64, hk)
    with pytest.raises(ValueError, match="multiple"):
        replay_f(torch.zeros(3, 4, 2, w), st, i64, i64, i64, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_stash_and_replay_bit_identical_to_the_record(shape: tuple[int, ...]) -> None:
    """On CUDA, the compiled module: the stash round's output equals the record round's bit for
    bit, its stash equals the CPU model's, and one replay launch over every layer leaves exactly
    record[keep - 1] per lane (keep 0, and slots no lane names, untouched)."""
    import os

    import tvm_ffi

    from ignis.runtime.kernels.tvm_runtime import load_module, torch_stream

    path = os.environ.get("IGNIS_GDN_MODULE")
    if not path:
        pytest.skip("no compiled GDN module ($IGNIS_GDN_MODULE)")
    module = load_module(path, cuda=True)
    rec_f, stash_f, replay_f = (module[k] for k in (FUNCTION_NAME, STASH_FUNCTION_NAME, REPLAY_FUNCTION_NAME))
    del tvm_ffi
    lanes, n, hk, hv, dk, dv, total = shape
    per, state, slots, keep, pos = _stash_replay_case(shape, seed=5 * sum(shape), layers=3)
    dev = torch.device("cuda")
    w = hk * dk + hv * dv + 2 * hv
    state_d = state.to(dev)
    stash = torch.full((len(per), n + 1, lanes, w), float("nan"), device=dev)
    records = []
    with torch_stream():
        for g, (mixed, b, a, neg_a, dt_bias, _, _) in enumerate(per):
            args = [t.to(dev) for t in (mixed, b, a, neg_a, dt_bias)] + [state_d[g], slots.to(dev)]
            rec = torch.empty(n, lanes, hv, dk, dv, device=dev)
            out_r, out_s = (torch.empty(lanes, n, hv, dv, device=dev) for _ in range(2))
            rec_f(*args, rec, out_r, hk, dk**-0.5)
            st = torch.empty(n, lanes, w, device=dev)
            stash_f(*args, st, out_s, hk, dk**-0.5)
            assert torch.equal(out_r, out_s)
            _, st_cpu = gdn_stash_emulated(mixed, b, a, neg_a, dt_bias, state[g], slots, hk)
            torch.testing.assert_close(st.cpu(), st_cpu, atol=1e-6, rtol=1e-6)
            stash[g, :n, pos.to(dev)] = st
            records.append(rec)
        before = state_d.clone()
        replay_f(stash, state_d, slots.to(dev), keep.to(dev), pos.to(dev), hk)
    torch.cuda.synchronize()
    _assert_replayed(state_d, before, records, slots, keep, total)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_compiled_round_matches_its_cpu_model(
    shape: tuple[int, ...], dtype: torch.dtype, strided: bool
) -> None:
    """On CUDA, the compiled record round against `gdn_recurrent_emulated` (the kernel's blocking and
    summation order on the CPU): out and every column's state within 1e-5 of the model (the GPU's
    rsqrtf / expf / log1pf differ from torch's by an ulp or two, so not bit for bit), and within
    2e-5 of the torch path (the oracle; the model's own CPU test holds it to 2e-6 / 1e-5). strided: mixed's
    channels two elements apart (any strides are allowed). A row, column or lane mapping error is
    off by O(1); nothing is written outside record[:n, :L]."""
    import os

    from ignis.runtime.kernels.tvm_runtime import load_module, torch_stream

    path = os.environ.get("IGNIS_GDN_MODULE")
    if not path:
        pytest.skip("no compiled GDN module ($IGNIS_GDN_MODULE)")
    rec_f = load_module(path, cuda=True)[FUNCTION_NAME]
    lanes, n, hk, hv, dk, dv, total = shape
    args = _inputs(lanes, n, hk, hv, dk, dv, total, dtype=dtype, seed=3 * sum(shape))
    out_m, rec_m = gdn_recurrent_emulated(*args, hk)
    out_ref, rec_ref = gdn_recurrent_reference(*args, hk)
    dev = torch.device("cuda")
    dargs = [t.to(dev) for t in args]
    if strided:
        mixed = dargs[0]
        wide = torch.zeros(*mixed.shape[:-1], 2 * mixed.shape[-1], dtype=mixed.dtype, device=dev)
        wide[..., ::2] = mixed
        dargs[0] = wide[..., ::2]
    rec = torch.full((n + 1, lanes + 1, hv, dk, dv), float("nan"), device=dev)  # larger than needed
    out = torch.empty(lanes, n, hv, dv, device=dev)
    with torch_stream():
        rec_f(*dargs, rec, out, hk, dk**-0.5)
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), out_m, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rec[:n, :lanes].cpu(), rec_m, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cpu(), out_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(rec[:n, :lanes].cpu(), rec_ref, atol=2e-5, rtol=2e-5)
    assert rec[n:].isnan().all() and rec[:, lanes:].isnan().all()


def test_build_rejects_non_cuda_targets() -> None:
    with pytest.raises(GdnKernelError, match="CUDA only"):
        build_gdn_recurrent("llvm")
    with pytest.raises(GdnKernelError):
        build_gdn_recurrent({"kind": "cuda", "arch": "ampere"})
