"""The fused mixer pieces (GDN conv1d + SiLU with the window write; q/k RMSNorm + partial RoPE + KV
write): their CPU models against the torch paths of `StaticHybridExecutor` (and `HybridExecutor`'s
ops), and cross-compiled binaries (nvcc). The GPU comparison is tests/runtime/test_hybrid_graphs.py
(marker `gpu`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from kernel_module_checks import HAS_NVCC, check_sass_and_exports, load_on_host_or_skip

from ignis.compiler.kernels.fused_mixers import (
    FUNCTION_NAMES,
    FusedMixersError,
    attention_split_keys,
    build_fused_mixers,
    gated_attention_reference,
    gated_attention_smem_bytes,
    gdn_conv_silu_emulated,
    gdn_conv_silu_reference,
    qk_norm_rope_kv_emulated,
    qk_norm_rope_kv_reference,
)
from ignis.runtime.families.gated_deltanet import causal_conv1d_silu
from ignis.runtime.families.hybrid_executor import _apply_rope, rms_norm_one_plus

HAS_GXX = shutil.which("g++") is not None
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the last place of b's dtype at b's magnitude (at least the smallest normal)."""
    eps = torch.finfo(b.dtype).eps
    return (a.float() - b.float()).abs() / (b.float().abs().clamp_min(torch.finfo(b.dtype).tiny) * eps)


def _conv_case(dtype: torch.dtype, lanes: int, n: int, ch: int, kk: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(lanes * n, ch + 7, generator=g).to(dtype)
    qkv = wide[:, 3 : 3 + ch]  # a strided view, as a slice of a fused projection
    slots_total = lanes + 2
    state = torch.randn(slots_total, ch, kk - 1, generator=g).to(dtype)
    slots = torch.randperm(slots_total, generator=g)[:lanes]
    weight = (torch.randn(ch, 1, kk, generator=g) * 0.5).to(dtype).squeeze(1)
    return qkv, state, slots, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lanes", "n", "ch", "kk"), [(1, 1, 1, 4), (1, 8, 300, 4), (3, 5, 129, 2), (2, 32, 64, 4), (4, 3, 40, 8)]
)
def test_gdn_conv_model_matches_torch(dtype: torch.dtype, lanes: int, n: int, ch: int, kk: int) -> None:
    qkv, state, slots, weight = _conv_case(dtype, lanes, n, ch, kk, lanes * 100 + n * 10 + kk)
    out_ref, window_ref = gdn_conv_silu_reference(qkv, state, slots, weight, n)
    windows = torch.full((lanes + 1, ch, kk - 1 + n + 2), 7.0, dtype=dtype)
    out = torch.empty(lanes, n, ch, dtype=dtype)
    gdn_conv_silu_emulated(qkv, state, slots, weight, windows, out)
    assert torch.equal(windows[:lanes, :, : kk - 1 + n], window_ref)
    assert (windows[lanes:] == 7).all() and (windows[:, :, kk - 1 + n :] == 7).all()  # nothing else written
    if dtype == torch.float32:
        torch.testing.assert_close(out, out_ref, atol=1e-6, rtol=1e-5)
        # HybridExecutor's per-lane op (the executor's oracle) agrees too
        for i in range(lanes):
            torch.testing.assert_close(
                out[i], causal_conv1d_silu(window_ref[i], weight).transpose(0, 1), atol=1e-6, rtol=1e-5
            )
    else:  # the conv's sum order differs: at most one rounding step of the conv (then SiLU)
        torch.testing.assert_close(
            out.float(), out_ref.float(), atol=4 * torch.finfo(dtype).eps, rtol=4 * torch.finfo(dtype).eps
        )
        assert (out == out_ref).float().mean() > 0.95


def test_gdn_conv_model_uses_the_state_of_each_lanes_slot() -> None:
    qkv, state, slots, weight = _conv_case(torch.float32, 2, 3, 16, 4, 5)
    out = torch.empty(2, 3, 16)
    gdn_conv_silu_emulated(qkv, state, slots, weight, torch.empty(2, 16, 6), out)
    out_swapped = torch.empty(2, 3, 16)
    gdn_conv_silu_emulated(qkv, state, slots.flip(0), weight, torch.empty(2, 16, 6), out_swapped)
    assert not torch.allclose(out, out_swapped)
    ref, _ = gdn_conv_silu_reference(qkv, state, slots.flip(0), weight, 3)
    torch.testing.assert_close(out_swapped, ref, atol=1e-6, rtol=1e-5)


def _attn_case(dtype: torch.dtype, lanes: int, n: int, nh: int, nkv: int, hd: int, rot: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = lanes * n
    qg = (torch.randn(rows, nh, 2 * hd, generator=g) * 2).to(dtype)
    q = qg[..., :hd]  # the executor's view of the gated q projection
    k = torch.randn(rows, nkv, hd, generator=g).to(dtype)
    v = torch.randn(rows, nkv, hd, generator=g).to(dtype)
    wq_raw = (torch.randn(hd, generator=g) * 0.1).to(dtype)
    wk_raw = (torch.randn(hd, generator=g) * 0.1).to(dtype)
    slots_total, cap = lanes + 1, 40
    slots = torch.randperm(slots_total, generator=g)[:lanes]
    past = torch.randint(0, cap - n, (lanes,), generator=g)
    pos = (past[:, None] + torch.arange(n)[None, :]).reshape(-1)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / max(rot, 1)))
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    kc = torch.randn(slots_total, cap, nkv, hd, generator=g).to(dtype)
    vc = torch.randn(slots_total, cap, nkv, hd, generator=g).to(dtype)
    return q, k, v, wq_raw, wk_raw, cos, sin, pos, slots, kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("lanes", "n", "nh", "nkv", "hd", "rot"),
    [(1, 1, 4, 2, 64, 16), (2, 8, 6, 2, 256, 64), (3, 4, 2, 1, 32, 32), (1, 5, 4, 4, 48, 12)],
)
def test_qk_norm_rope_kv_model_matches_torch(
    dtype: torch.dtype, lanes: int, n: int, nh: int, nkv: int, hd: int, rot: int
) -> None:
    q, k, v, wq_raw, wk_raw, cos, sin, pos, slots, kc, vc = _attn_case(
        dtype, lanes, n, nh, nkv, hd, rot, hd + n
    )
    wq, wk = 1.0 + wq_raw.float(), 1.0 + wk_raw.float()
    eps = 1e-6
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = qk_norm_rope_kv_reference(q, k, v, wq, wk, cos, sin, pos, slots, kc_ref, vc_ref, eps)
    # the reference is HybridExecutor's norm + RoPE (the executor's oracle)
    torch.testing.assert_close(
        q_ref,
        _apply_rope(rms_norm_one_plus(q, wq_raw, eps), cos, sin),
        atol=0 if dtype == torch.float32 else 0.05,
        rtol=1e-6 if dtype == torch.float32 else 0.02,
    )
    q_out = torch.empty(q.shape, dtype=dtype)
    qk_norm_rope_kv_emulated(q, k, v, wq, wk, cos, sin, pos, slots, kc, vc, q_out, eps)
    slot_rows = slots.repeat_interleave(n)
    assert torch.equal(vc, vc_ref)  # values copied as they are
    written = torch.zeros(kc.shape[:2], dtype=torch.bool)
    written[slot_rows, pos] = True
    assert torch.equal(kc[~written], kc_ref[~written])  # nothing else written
    for got, want in ((q_out, q_ref), (kc[slot_rows, pos], kc_ref[slot_rows, pos])):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # the sum of squares' order differs: a rounding step of y, through the rotation
            torch.testing.assert_close(
                got.float(),
                want.float(),
                atol=4 * torch.finfo(dtype).eps * 4,
                rtol=4 * torch.finfo(dtype).eps,
            )
            assert (got == want).float().mean() > 0.95
    assert not torch.equal(q_out[..., :rot], q[..., :rot]) or rot == 0


def test_qk_norm_rope_kv_model_drops_out_of_range_rows() -> None:
    q, k, v, wq_raw, wk_raw, cos, sin, pos, slots, kc, vc = _attn_case(torch.float32, 2, 3, 2, 1, 16, 8, 1)
    pos = pos.clone()
    pos[1] = kc.shape[1]  # past the capacity
    before_k, before_v = kc.clone(), vc.clone()
    q_out = torch.empty(q.shape)
    qk_norm_rope_kv_emulated(q, k, v, 1 + wq_raw, 1 + wk_raw, cos, sin, pos, slots, kc, vc, q_out, 1e-6)
    changed = (kc != before_k).any(-1).any(-1) | (vc != before_v).any(-1).any(-1)  # [S, cap]
    assert int(changed.sum()) == 5 and not changed[slots[0], kc.shape[1] - 1]


def test_build_rejects_non_cuda_targets() -> None:
    with pytest.raises(FusedMixersError):
        build_fused_mixers({"kind": "llvm"})
    with pytest.raises(FusedMixersError):
        build_fused_mixers({"kind": "cuda", "arch": "gfx90a"})


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc (the arch is checked after nvcc is found)")
def test_build_refuses_archs_before_sm_80() -> None:
    """The gated attention's mma.m16n8k16 and cp.async need sm_80: an older arch is refused by name."""
    with pytest.raises(FusedMixersError, match="sm_80 or newer, got 'sm_75'"):
        build_fused_mixers("sm_75")


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_build_emits_sass_and_both_exports(arch: str, tmp_path: Path) -> None:
    path = build_fused_mixers(arch, out_path=tmp_path / f"mixers_{arch}.so")
    kernels = ("gdn_conv_silu_kernel", "qk_norm_rope_kv_kernel", "gated_attention_kernel")
    check_sass_and_exports(path, arch, FUNCTION_NAMES, kernels)


@pytest.mark.skipif(not HAS_NVCC, reason="needs nvcc")
def test_module_loads_and_checks_arguments(tmp_path: Path) -> None:
    """The exports load here (no GPU: tvm-ffi still checks what it can before launching)."""
    pytest.importorskip("tvm_ffi")
    path = build_fused_mixers("sm_90", out_path=tmp_path / "mixers.so")
    mod = load_on_host_or_skip(path)
    qkv, state, slots = torch.zeros(6, 8), torch.zeros(4, 8, 3), torch.tensor([0, 2])
    w, win, out = torch.zeros(8, 4), torch.zeros(2, 8, 6), torch.empty(2, 3, 8)
    with pytest.raises(ValueError, match="CUDA device"):
        mod["gdn_conv_silu"](qkv, state, slots, w, win, out)
    with pytest.raises(ValueError, match="windows must be"):
        mod["gdn_conv_silu"](qkv, state, slots, w, torch.zeros(2, 8, 5), out)
    with pytest.raises(TypeError, match="int64"):
        mod["gdn_conv_silu"](qkv, state, slots.int(), w, win, out)
    with pytest.raises(TypeError, match="qkv's dtype"):
        mod["gdn_conv_silu"](qkv, state.bfloat16(), slots, w, win, out)
    q, k = torch.zeros(6, 4, 16), torch.zeros(6, 2, 16)
    cos, pos, kc = torch.zeros(6, 8), torch.zeros(6, dtype=torch.long), torch.zeros(3, 10, 2, 16)
    one = torch.ones(16)
    with pytest.raises(ValueError, match="CUDA device"):
        mod["qk_norm_rope_kv"](q, k, k, one, one, cos, cos, pos, slots, kc, kc, torch.empty(6, 4, 16), 1e-6)
    with pytest.raises(ValueError, match="rot must be even"):
        mod["qk_norm_rope_kv"](
            q, k, k, one, one, cos[:, :7], cos[:, :7], pos, slots, kc, kc, torch.empty(6, 4, 16), 1e-6
        )
    with pytest.raises(TypeError, match="float32"):
        mod["qk_norm_rope_kv"](
            q, k, k, one.half(), one, cos, cos, pos, slots, kc, kc, torch.empty(6, 4, 16), 1e-6
        )
    # gated_attention(q, kc, vc, gate, pos, slots, out, ws_o, ws_ml, max_keys, split_keys, scale)
    qa, kca = torch.zeros(6, 4, 32, dtype=torch.bfloat16), torch.zeros(3, 10, 2, 32, dtype=torch.bfloat16)
    outa, ws = torch.empty(6, 128, dtype=torch.bfloat16), torch.empty(0)
    with pytest.raises(ValueError, match="CUDA device"):
        mod["gated_attention"](qa, kca, kca, qa, pos, slots, outa, ws, ws, 10, 256, 0.1)
    with pytest.raises(ValueError, match="head_dim must be"):
        mod["gated_attention"](q, kc, kc, q, pos, slots, torch.empty(6, 64), ws, ws, 10, 256, 0.1)
    with pytest.raises(TypeError, match="q's dtype"):
        mod["gated_attention"](qa, kca.float(), kca, qa, pos, slots, outa, ws, ws, 10, 256, 0.1)
    with pytest.raises(ValueError, match="multiple of 32"):
        mod["gated_attention"](qa, kca, kca, qa, pos, slots, outa, ws, ws, 10, 100, 0.1)
    with pytest.raises(ValueError, match="ws_o must be"):  # 300 keys in splits of 256: two splits
        mod["gated_attention"](qa, kca, kca, qa, pos, slots, outa, ws, ws, 300, 256, 0.1)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        mod["gated_attention"](qa[:, :3], kca, kca, qa[:, :3], pos, slots, outa, ws, ws, 10, 256, 0.1)


def test_gated_attention_needs_a_device_that_holds_its_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """101,376 bytes a block at head_dim 256 (the 99 KiB of sm_86 / sm_89 / sm_120 cards); the executor
    keeps SDPA on a device whose blocks cannot hold it, and for float32 or another head_dim."""
    from types import SimpleNamespace

    from ignis.runtime.kernels.fused_mixers import FusedMixersKernel, _smem_per_block_optin

    assert gated_attention_smem_bytes(256) == 101_376 == 99 * 1024
    assert gated_attention_smem_bytes(64) == 27_648
    mix = FusedMixersKernel({"gdn_conv_silu": None, "qk_norm_rope_kv": None, "gated_attention": None})
    cuda = torch.device("cuda", 0)
    props = SimpleNamespace(shared_memory_per_block_optin=65_536)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    _smem_per_block_optin.cache_clear()  # read once a device: start from this fake one
    assert not mix.gated_attention_takes(torch.bfloat16, 256, cuda)
    assert mix.gated_attention_takes(torch.bfloat16, 64, cuda)
    props.shared_memory_per_block_optin = 101_376
    _smem_per_block_optin.cache_clear()
    assert mix.gated_attention_takes(torch.float16, 256, cuda)
    assert not mix.gated_attention_takes(torch.float32, 64, cuda)
    assert not mix.gated_attention_takes(torch.bfloat16, 96, cuda)
    assert mix.gated_attention_takes(torch.bfloat16, 256)  # CPU stand-ins: not checked
    old = FusedMixersKernel({"gdn_conv_silu": None, "qk_norm_rope_kv": None})  # built before it
    assert not old.has_gated_attention and not old.gated_attention_takes(torch.bfloat16, 256)
    _smem_per_block_optin.cache_clear()  # no fake device left behind


def test_attention_split_keys() -> None:
    """One split up to 256 keys; beyond, at most 32 splits of whole 32-key stages."""
    assert [attention_split_keys(k) for k in (1, 16, 256, 257, 4096, 8192)] == [256] * 6
    assert attention_split_keys(8193) == 288
    assert attention_split_keys(32_768) == 1024
    for max_keys in (1, 255, 256, 257, 1000, 4096, 4097, 10_000, 131_072, 262_145):
        sk = attention_split_keys(max_keys)
        assert sk % 32 == 0 and sk >= 256
        assert -(-max_keys // sk) <= 32
    with pytest.raises(ValueError, match="max_keys"):
        attention_split_keys(0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gated_attention_reference_matches_masked_sdpa(dtype: torch.dtype) -> None:
    """The oracle of ``gated_attention`` against the executor's own formulation (gathered caches, a
    [L, 1, rep * n, T] mask at each row's position, SDPA over the kv heads' grouped rows, the sigmoid
    gate), in float64: each lane reads its own slot, each column only keys up to its position."""
    g = torch.Generator().manual_seed(7)
    lanes, n, heads, kv, hd, cap, num_slots = 3, 4, 6, 2, 16, 24, 5
    rep, rows = heads // kv, lanes * n
    q = torch.randn(rows, heads, hd, generator=g).to(dtype)
    kc = torch.randn(num_slots, cap, kv, hd, generator=g).to(dtype)
    vc = torch.randn(num_slots, cap, kv, hd, generator=g).to(dtype)
    gate = torch.randn(rows, heads, 2 * hd, generator=g).to(dtype)[..., hd:]  # strided, as qg[..., hd:]
    slots = torch.tensor([4, 0, 2])
    past = torch.tensor([3, 11, 0])
    pos = (past[:, None] + torch.arange(n)[None, :]).reshape(-1)
    got = gated_attention_reference(q, kc, vc, gate, pos, slots)
    bucket = int(pos.max()) + 1
    keys = kc[:, :bucket].index_select(0, slots).transpose(1, 2).double()  # [L, kv, T, hd]
    values = vc[:, :bucket].index_select(0, slots).transpose(1, 2).double()
    mask = torch.arange(bucket)[None, None, :] <= pos.view(lanes, n)[:, :, None]
    mask = mask[:, None].expand(lanes, rep, n, bucket).reshape(lanes, 1, rep * n, bucket)
    qq = q.double().view(lanes, n, kv, rep, hd).permute(0, 2, 3, 1, 4).reshape(lanes, kv, rep * n, hd)
    o = torch.nn.functional.scaled_dot_product_attention(qq, keys, values, attn_mask=mask, scale=hd**-0.5)
    o = o.view(lanes, kv, rep, n, hd).permute(0, 3, 1, 2, 4).reshape(rows, heads * hd).to(dtype)
    want = o * torch.sigmoid(gate.reshape(rows, heads * hd))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    # an unknown slot or a row before any key reads nothing: zeros, as the kernel
    bad = gated_attention_reference(
        q, kc, vc, gate, pos - torch.tensor([0] * n + [0] * n + [5] * n), torch.tensor([4, 9, 2])
    )
    assert torch.all(bad[n:] == 0)
    torch.testing.assert_close(bad[:n], got[:n], atol=0, rtol=0)
    # a change to a key past a row's position changes nothing for it
    kc2 = kc.clone()
    kc2[4, 4] = 100.0  # lane 0 (slot 4): position 4 is column 1's and later
    got2 = gated_attention_reference(q, kc2, vc, gate, pos, slots)
    torch.testing.assert_close(got2[:1], got[:1], atol=0, rtol=0)
    assert not torch.equal(got2[1:4], got[1:4])


# --------------------------------------------------------------------------------------------
# The CUDA source itself, run on the host: fused_mixers.cuh compiled with g++ behind a small shim
# (one std::thread per CUDA thread, a std::barrier per warp for __shfl_xor_sync / __syncwarp,
# bf16 / f16 conversions rounding to nearest even, no FMA contraction), called through ctypes with
# the executor's strided layouts, against the CPU models. This checks the kernels' indexing,
# strides, rounding points and reduction order without a GPU.

_HOST_HARNESS = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include <memory>

struct dim3s { unsigned x = 0, y = 0, z = 0; };
thread_local dim3s threadIdx, blockIdx;
struct __nv_bfloat16 { uint16_t b; };
struct __half { _Float16 h; };
inline float __bfloat162float(__nv_bfloat16 v) {
  uint32_t u = uint32_t(v.b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return {uint16_t(0x7fc0)};
  uint32_t r = u + 0x7fff + ((u >> 16) & 1);
  return {uint16_t(r >> 16)};
}
inline float __half2float(__half v) { return float(v.h); }
inline __half __float2half_rn(float f) { return {_Float16(f)}; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// warp emulation
static std::vector<std::unique_ptr<std::barrier<>>> g_bars;
static float g_xchg[64][32];
thread_local int t_warp;
inline void __syncwarp() { g_bars[t_warp]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int w) {
  int lane = threadIdx.x & 31;
  g_xchg[t_warp][lane] = v;
  g_bars[t_warp]->arrive_and_wait();
  float r = g_xchg[t_warp][lane ^ w];
  g_bars[t_warp]->arrive_and_wait();
  return r;
}
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__
#define smem smem_store_alias
#include "fused_mixers.cuh"
#undef smem

namespace ignis_mixers {
float smem_store_alias[kNormWarps * kMaxHeadDim];
}

template <typename F>
void run_grid(unsigned gx, unsigned gy, unsigned threads, F f, unsigned gz = 1) {
  for (unsigned bz = 0; bz < gz; ++bz)
    for (unsigned by = 0; by < gy; ++by)
      for (unsigned bx = 0; bx < gx; ++bx) {
        g_bars.clear();
        for (unsigned w = 0; w < threads / 32; ++w) g_bars.emplace_back(new std::barrier<>(32));
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; ++t)
          ts.emplace_back([=] {
            threadIdx.x = t; blockIdx.x = bx; blockIdx.y = by; blockIdx.z = bz; t_warp = t / 32; f();
          });
        for (auto& th : ts) th.join();
      }
}

using namespace ignis_mixers;
extern "C" {
// dtype: 0 f32, 1 bf16, 2 f16 ; K conv kernel
void conv(int dtype, int K, ConvParams* p) {
  unsigned gx = (p->channels + kConvThreads - 1) / kConvThreads;
  ConvParams q = *p;
// the launch's grid (fused_mixers_ffi.cuh): (channel blocks, columns, lanes)
#define CASE(T) \
  switch (K) { \
    case 2: run_grid(gx, q.n, kConvThreads, [=]{ gdn_conv_silu_kernel<T, 2>(q); }, q.lanes); break; \
    case 4: run_grid(gx, q.n, kConvThreads, [=]{ gdn_conv_silu_kernel<T, 4>(q); }, q.lanes); break; \
    default: run_grid(gx, q.n, kConvThreads, [=]{ gdn_conv_silu_kernel<T, 8>(q); }, q.lanes); }
  if (dtype == 0) { CASE(float) } else if (dtype == 1) { CASE(__nv_bfloat16) } else { CASE(__half) }
}
void qk(int dtype, NormRopeParams* p) {
  NormRopeParams q = *p;
  unsigned blocks = (unsigned)(((int64_t)q.rows * (q.heads + q.kv_heads) + kNormWarps - 1) / kNormWarps);
  if (dtype == 0) run_grid(blocks, 1, kNormWarps * 32, [=]{ qk_norm_rope_kv_kernel<float>(q); });
  else if (dtype == 1) run_grid(blocks, 1, kNormWarps * 32, [=]{ qk_norm_rope_kv_kernel<__nv_bfloat16>(q); });
  else run_grid(blocks, 1, kNormWarps * 32, [=]{ qk_norm_rope_kv_kernel<__half>(q); });
}
}
"""


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory: pytest.TempPathFactory):
    import ctypes
    import subprocess

    tmp = tmp_path_factory.mktemp("mixers_host")
    for name in ("cuda_bf16.h", "cuda_fp16.h"):  # the shim defines what the kernels use
        (tmp / name).write_text("#pragma once\n")
    src = tmp / "harness.cpp"
    src.write_text(_HOST_HARNESS)
    kernels = Path(__file__).resolve().parents[2] / "compiler" / "kernels"
    lib = tmp / "harness.so"
    cmd = ["g++", "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-Wl,--no-undefined"]
    cmd += [f"-I{tmp}", f"-I{kernels}", "-o", str(lib), str(src), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ctypes.CDLL(str(lib))


def _host_structs():
    import ctypes as C

    P, I, i32 = C.c_void_p, C.c_int64, C.c_int

    class Conv(C.Structure):
        _fields_ = [(f, P if f in "qkv state slots weight windows out".split() else I) for f in (
            "qkv qkv_row qkv_el state st_slot st_ch st_el slots weight w_ch w_el windows win_lane win_ch "
            "win_el out"
        ).split()] + [(f, i32) for f in ("lanes", "n", "channels", "num_slots")]  # fmt: skip

    ptrs = set("q k v wq wk cos sin pos slots kc vc q_out".split())

    class NormRope(C.Structure):
        _fields_ = [(f, P if f in ptrs else I) for f in (
            "q q_row q_head q_el k k_row k_head k_el v v_row v_head v_el wq wk cos sin cs_row cs_el "
            "sn_row sn_el pos slots kc vc kc_slot kc_pos kc_head kc_el vc_slot vc_pos vc_head vc_el q_out"
        ).split()] + [(f, i32) for f in ("rows", "n", "heads", "kv_heads", "hd", "rot", "num_slots")] + [
            ("capacity", I), ("eps", C.c_float)
        ]  # fmt: skip

    return Conv, NormRope


_HOST_DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@pytest.mark.skipif(not HAS_GXX, reason="needs g++")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_source_on_the_host_matches_the_models(host_kernels, dtype: torch.dtype) -> None:
    import ctypes

    conv_t, nr_t = _host_structs()

    def conv_kernel(qkv, state, slots, weight, windows, out):
        p = conv_t(
            qkv.data_ptr(), *qkv.stride(), state.data_ptr(), *state.stride(), slots.data_ptr(),
            weight.data_ptr(), *weight.stride(), windows.data_ptr(), *windows.stride(), out.data_ptr(),
            *out.shape, state.shape[0],
        )  # fmt: skip
        host_kernels.conv(_HOST_DTYPE[dtype], weight.shape[1], ctypes.byref(p))

    def qk_kernel(q, k, v, wq, wk, cos, sin, pos, slots, kc, vc, q_out, eps):
        p = nr_t(
            q.data_ptr(), *q.stride(), k.data_ptr(), *k.stride(), v.data_ptr(), *v.stride(),
            wq.data_ptr(), wk.data_ptr(), cos.data_ptr(), sin.data_ptr(), *cos.stride(), *sin.stride(),
            pos.data_ptr(), slots.data_ptr(), kc.data_ptr(), vc.data_ptr(), *kc.stride(), *vc.stride(),
            q_out.data_ptr(), q.shape[0], q.shape[0] // slots.shape[0], q.shape[1], k.shape[1],
            q.shape[2], cos.shape[1], kc.shape[0], kc.shape[1], eps,
        )  # fmt: skip
        host_kernels.qk(_HOST_DTYPE[dtype], ctypes.byref(p))

    for lanes, n, ch, kk, bad in [
        (1, 1, 1, 4, False),
        (1, 8, 300, 4, False),
        (3, 5, 129, 2, True),
        (2, 3, 40, 8, True),
    ]:
        qkv, state, slots, weight = _conv_case(dtype, lanes, n, ch, kk, 7)
        if bad:  # the last lane's slot out of range: a zero state in the model and the kernel
            slots = slots.clone()
            slots[-1] = -1
        got = []
        for fn in (gdn_conv_silu_emulated, conv_kernel):
            windows = torch.full((lanes + 1, ch, kk - 1 + n + 2), 7.0, dtype=dtype)
            out = torch.zeros(lanes, n, ch, dtype=dtype)
            fn(qkv, state, slots, weight, windows, out)
            got.append((out, windows))
        (o_model, w_model), (o_kernel, w_kernel) = got
        assert torch.equal(w_kernel, w_model)
        if bad:
            assert not w_model[lanes - 1, :, : kk - 1].any()
        if dtype == torch.float32:  # expf vs torch.exp: an ulp or so
            torch.testing.assert_close(o_kernel, o_model, atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(o_kernel, o_model)
    for lanes, n, nh, nkv, hd, rot in [(1, 1, 4, 2, 64, 16), (2, 3, 6, 2, 256, 64), (3, 2, 2, 1, 32, 32)]:
        q, k, v, wq_raw, wk_raw, cos, sin, pos, slots, kc, vc = _attn_case(
            dtype, lanes, n, nh, nkv, hd, rot, 3
        )
        pos = pos.clone()
        pos[-1] = kc.shape[1] + 3  # a row past the capacity writes no key / value
        wq, wk = 1.0 + wq_raw.float(), 1.0 + wk_raw.float()
        got = []
        for fn in (qk_norm_rope_kv_emulated, qk_kernel):
            kc2, vc2, q_out = kc.clone(), vc.clone(), torch.zeros(q.shape, dtype=dtype)
            fn(q, k, v, wq, wk, cos, sin, pos, slots, kc2, vc2, q_out, 1e-6)
            got.append((q_out, kc2, vc2))
        for a, b in zip(*got, strict=True):
            assert torch.equal(b, a)
