// Host side of the fused Gated DeltaNet recurrence (gdn_recurrent.cuh): the tvm-ffi exported functions
// with their argument checks. A module built by ignis.compiler.kernels.gdn_recurrent includes this
// header and IGNIS_GDN_RECURRENT_EXPORT(name), IGNIS_GDN_STASH_EXPORT(name) (the round with a stash in
// place of the record) and IGNIS_GDN_REPLAY_EXPORT(name) (gdn_replay_launch below).
//
//   name(mixed [L, n, conv_dim] f32|bf16|f16 (any strides),
//        b [L, n, hv], a [L, n, hv] (mixed's dtype, any strides),
//        neg_a [hv] f32, dt_bias [hv] f32,
//        state [S, hv, dk, dv] f32, slots [L] int64,
//        record [>= n, >= L, hv, dk, dv] f32 (written: record[t, l] = state after column t),
//        out [L, n, hv, dv] f32 or mixed's dtype, contiguous (written),
//        num_key_heads: int, scale: float)
//
// conv_dim must be 2 * num_key_heads * dk + hv * dv; hv a multiple of num_key_heads; dk <= 256;
// slots[l] in 0..S-1 (device memory, not checked here: a lane with a slot outside is skipped).
// The rounds read state, never write it (the replay writes it in place). Launches on the stream tvm-ffi reports for mixed's device (torch's
// current stream under tvm_ffi.use_torch_stream(), so CUDA-graph capture works); no allocation, no
// attribute change: capturable from the first call.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "ffi_checks.cuh"
#include "gdn_recurrent.cuh"

namespace ignis_gdn {

using tvm::ffi::TensorView;
using namespace ignis_ffi;  // the shared argument checks (ffi_checks.cuh)

// `layers` > 1: kModeReplay over that many layers (grid.y).
template <typename T, int MODE = kModeRecord>
void launch(const char* name, const Params& p, cudaStream_t stream, int layers = 1) {
  const int tiles = (p.dv + kCols - 1) / kCols;
  const int64_t blocks = static_cast<int64_t>(p.lanes) * p.hv * tiles;
  TVM_FFI_CHECK(blocks <= 2147483647LL, ValueError) << name << ": too many blocks (" << blocks << ")";
  TVM_FFI_CHECK(layers >= 1 && layers <= 65535, ValueError) << name << ": 1..65535 layers, got " << layers;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(layers)), block(kWarps * 32);
  if (p.dk <= kWarps * 2) {
    gdn_recurrent_kernel<T, 2, MODE><<<grid, block, 0, stream>>>(p);
  } else if (p.dk <= kWarps * 4) {
    gdn_recurrent_kernel<T, 4, MODE><<<grid, block, 0, stream>>>(p);
  } else if (p.dk <= kWarps * 8) {
    gdn_recurrent_kernel<T, 8, MODE><<<grid, block, 0, stream>>>(p);
  } else if (p.dk <= kWarps * 16) {
    gdn_recurrent_kernel<T, 16, MODE><<<grid, block, 0, stream>>>(p);
  } else {
    gdn_recurrent_kernel<T, 32, MODE><<<grid, block, 0, stream>>>(p);
  }
  check_launch(name);
}

// The kernel's head limits: v_heads a multiple of num_key_heads, k_dim <= kMaxKeyDim (ValueError).
inline void check_heads(const char* name, int64_t hv, int64_t dk, int64_t num_key_heads) {
  TVM_FFI_CHECK(num_key_heads >= 1 && hv % num_key_heads == 0, ValueError)
      << name << ": v_heads " << hv << " must be a multiple of num_key_heads " << num_key_heads;
  TVM_FFI_CHECK(dk <= kMaxKeyDim, ValueError) << name << ": k_dim must be <= " << kMaxKeyDim << ", got " << dk;
}

// Floats of one stash row: k of every key head, v, beta and alpha of every value head.
inline int64_t stash_width(int64_t hk, int64_t hv, int64_t dk, int64_t dv) { return hk * dk + hv * dv + 2 * hv; }

// STASH false: `record` is the record buffer [>= n, >= L, hv, dk, dv]; true: the stash
// [>= n, >= L, W] (kModeStash).
template <bool STASH = false>
void gdn_recurrent_launch(const char* name, TensorView mixed, TensorView b, TensorView a, TensorView neg_a,
                          TensorView dt_bias, TensorView state, TensorView slots, TensorView record,
                          TensorView out, int64_t num_key_heads, double scale) {
  TVM_FFI_CHECK(mixed.ndim() == 3 && b.ndim() == 3 && a.ndim() == 3, ValueError)
      << name << ": mixed, b and a must be 3-d [lanes, n, *]";
  TVM_FFI_CHECK(state.ndim() == 4 && record.ndim() == (STASH ? 3 : 5) && out.ndim() == 4, ValueError)
      << name << ": state must be [S, hv, dk, dv], " << (STASH ? "stash [cols, lanes, W]" : "record [cols, lanes, hv, dk, dv]")
      << ", out [lanes, n, hv, dv]";
  TVM_FFI_CHECK(slots.ndim() == 1 && neg_a.ndim() == 1 && dt_bias.ndim() == 1, ValueError)
      << name << ": slots, neg_a and dt_bias must be 1-d";
  const int64_t lanes = mixed.size(0), n = mixed.size(1), conv_dim = mixed.size(2);
  const int64_t hv = state.size(1), dk = state.size(2), dv = state.size(3);
  TVM_FFI_CHECK(lanes >= 1 && n >= 1 && hv >= 1 && dk >= 1 && dv >= 1, ValueError)
      << name << ": empty lanes, columns or state";
  check_heads(name, hv, dk, num_key_heads);
  TVM_FFI_CHECK(conv_dim == 2 * num_key_heads * dk + hv * dv, ValueError)
      << name << ": mixed has " << conv_dim << " channels, expected 2 * " << num_key_heads << " * " << dk
      << " + " << hv << " * " << dv;
  for (const TensorView* t : {&b, &a}) {
    TVM_FFI_CHECK(t->size(0) == lanes && t->size(1) == n && t->size(2) == hv, ValueError)
        << name << ": b and a must be [" << lanes << ", " << n << ", " << hv << "]";
    TVM_FFI_CHECK(same_dtype(*t, mixed), TypeError) << name << ": b and a must have mixed's dtype";
  }
  TVM_FFI_CHECK(neg_a.size(0) == hv && dt_bias.size(0) == hv && neg_a.stride(0) == 1 && dt_bias.stride(0) == 1,
                ValueError)
      << name << ": neg_a and dt_bias must be contiguous [" << hv << "]";
  TVM_FFI_CHECK(dtype_is(neg_a, kDLFloat, 32) && dtype_is(dt_bias, kDLFloat, 32) && dtype_is(state, kDLFloat, 32) &&
                    dtype_is(record, kDLFloat, 32),
                TypeError)
      << name << ": neg_a, dt_bias, state and " << (STASH ? "stash" : "record") << " must be float32";
  TVM_FFI_CHECK(dtype_is(slots, kDLInt, 64), TypeError) << name << ": slots must be int64";
  TVM_FFI_CHECK(slots.size(0) == lanes && slots.stride(0) == 1, ValueError)
      << name << ": slots must be contiguous [" << lanes << "]";
  TVM_FFI_CHECK(inner_contiguous(state, 3) && state.size(0) >= 1, ValueError)
      << name << ": state's [hv, dk, dv] must be contiguous";
  if constexpr (STASH) {
    const int64_t w = stash_width(num_key_heads, hv, dk, dv);
    TVM_FFI_CHECK(record.size(0) >= n && record.size(1) >= lanes && record.size(2) == w && record.stride(2) == 1,
                  ValueError)
        << name << ": stash must be [>= " << n << ", >= " << lanes << ", " << w << "] with the last dim contiguous";
  } else {
    TVM_FFI_CHECK(record.size(0) >= n && record.size(1) >= lanes && record.size(2) == hv && record.size(3) == dk &&
                      record.size(4) == dv && inner_contiguous(record, 3),
                  ValueError)
        << name << ": record must be [>= " << n << ", >= " << lanes << ", " << hv << ", " << dk << ", " << dv
        << "] with the last three dims contiguous";
  }
  TVM_FFI_CHECK(out.size(0) == lanes && out.size(1) == n && out.size(2) == hv && out.size(3) == dv &&
                    inner_contiguous(out, 4),
                ValueError)
      << name << ": out must be contiguous [" << lanes << ", " << n << ", " << hv << ", " << dv << "]";
  const bool out_f32 = dtype_is(out, kDLFloat, 32);
  TVM_FFI_CHECK(out_f32 || same_dtype(out, mixed), TypeError) << name << ": out must be float32 or mixed's dtype";
  check_cuda(name, {&mixed, &b, &a, &neg_a, &dt_bias, &state, &slots, &record, &out});
  Params p{};
  p.mixed = ptr(mixed);
  p.m_lane = mixed.stride(0);
  p.m_col = mixed.stride(1);
  p.m_ch = mixed.stride(2);
  p.b = ptr(b);
  p.b_lane = b.stride(0);
  p.b_col = b.stride(1);
  p.b_head = b.stride(2);
  p.a = ptr(a);
  p.a_lane = a.stride(0);
  p.a_col = a.stride(1);
  p.a_head = a.stride(2);
  p.neg_a = static_cast<const float*>(ptr(neg_a));
  p.dt_bias = static_cast<const float*>(ptr(dt_bias));
  p.state = static_cast<const float*>(ptr(state));
  p.st_slot = state.stride(0);
  p.num_slots = state.size(0);
  p.slots = static_cast<const int64_t*>(ptr(slots));
  if constexpr (STASH) {
    p.stash = static_cast<float*>(ptr(record));
    p.sh_col = record.stride(0);
    p.sh_lane = record.stride(1);
  } else {
    p.record = static_cast<float*>(ptr(record));
    p.rec_col = record.stride(0);
    p.rec_lane = record.stride(1);
  }
  p.out = ptr(out);
  p.out_f32 = out_f32;
  p.lanes = static_cast<int>(lanes);
  p.n = static_cast<int>(n);
  p.hk = static_cast<int>(num_key_heads);
  p.hv = static_cast<int>(hv);
  p.dk = static_cast<int>(dk);
  p.dv = static_cast<int>(dv);
  p.scale = static_cast<float>(scale);
  cudaStream_t stream = stream_of(mixed);
  constexpr int kMode = STASH ? kModeStash : kModeRecord;
  dispatch_float(name, "mixed", mixed, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch<T, kMode>(name, p, stream);
  });
}

// kModeReplay: stash [G, C, Ls, W] f32 (last dim contiguous), state [G, S, hv, dk, dv] f32 (inner four
// dims contiguous; written in place), slots / keep / pos [m] int64, num_key_heads. Per layer g and lane
// l < m: the first keep[l] columns (clamped to 0..C) of stash[g, :, pos[l]] run from state[g, slots[l]],
// and the state after the last is written there; keep 0, or a slot or pos outside, leaves the lane.
// The slots must be distinct (two lanes on one slot would update it concurrently).
inline void gdn_replay_launch(const char* name, TensorView stash, TensorView state, TensorView slots,
                              TensorView keep, TensorView pos, int64_t num_key_heads) {
  TVM_FFI_CHECK(stash.ndim() == 4 && state.ndim() == 5, ValueError)
      << name << ": stash must be [layers, cols, lanes, W] and state [layers, S, hv, dk, dv]";
  TVM_FFI_CHECK(slots.ndim() == 1 && keep.ndim() == 1 && pos.ndim() == 1, ValueError)
      << name << ": slots, keep and pos must be 1-d";
  const int64_t layers = state.size(0), hv = state.size(2), dk = state.size(3), dv = state.size(4);
  const int64_t m = slots.size(0);
  TVM_FFI_CHECK(m >= 1 && keep.size(0) == m && pos.size(0) == m && slots.stride(0) == 1 && keep.stride(0) == 1 &&
                    pos.stride(0) == 1,
                ValueError)
      << name << ": slots, keep and pos must be contiguous [m], m >= 1, one length";
  TVM_FFI_CHECK(layers >= 1 && hv >= 1 && dk >= 1 && dv >= 1 && state.size(1) >= 1, ValueError)
      << name << ": empty state";
  check_heads(name, hv, dk, num_key_heads);
  const int64_t w = stash_width(num_key_heads, hv, dk, dv);
  TVM_FFI_CHECK(stash.size(0) == layers && stash.size(1) >= 1 && stash.size(2) >= 1 && stash.size(3) == w &&
                    stash.stride(3) == 1,
                ValueError)
      << name << ": stash must be [" << layers << ", cols, lanes, " << w << "] with the last dim contiguous";
  TVM_FFI_CHECK(inner_contiguous(state, 4), ValueError) << name << ": state's [S, hv, dk, dv] must be contiguous";
  TVM_FFI_CHECK(dtype_is(stash, kDLFloat, 32) && dtype_is(state, kDLFloat, 32), TypeError)
      << name << ": stash and state must be float32";
  TVM_FFI_CHECK(dtype_is(slots, kDLInt, 64) && dtype_is(keep, kDLInt, 64) && dtype_is(pos, kDLInt, 64), TypeError)
      << name << ": slots, keep and pos must be int64";
  TVM_FFI_CHECK(stash.size(1) <= 2147483647LL && stash.size(2) <= 2147483647LL && m <= 2147483647LL, ValueError)
      << name << ": stash too large";
  check_cuda(name, {&stash, &state, &slots, &keep, &pos});
  Params p{};
  p.state = static_cast<const float*>(ptr(state));
  p.st_slot = state.stride(1);
  p.st_layer = state.stride(0);
  p.num_slots = state.size(1);
  p.slots = static_cast<const int64_t*>(ptr(slots));
  p.stash = static_cast<float*>(ptr(stash));
  p.sh_layer = stash.stride(0);
  p.sh_col = stash.stride(1);
  p.sh_lane = stash.stride(2);
  p.keep = static_cast<const int64_t*>(ptr(keep));
  p.pos = static_cast<const int64_t*>(ptr(pos));
  p.stash_lanes = static_cast<int>(stash.size(2));
  p.lanes = static_cast<int>(m);
  p.n = static_cast<int>(stash.size(1));
  p.hk = static_cast<int>(num_key_heads);
  p.hv = static_cast<int>(hv);
  p.dk = static_cast<int>(dk);
  p.dv = static_cast<int>(dv);
  launch<float, kModeReplay>(name, p, stream_of(state), static_cast<int>(layers));
}

}  // namespace ignis_gdn

// A round's export: `NAME(mixed, b, a, neg_a, dt_bias, state, slots, buf, out, num_key_heads, scale)`,
// buf the record (STASH false) or the stash (true: kModeStash).
#define IGNIS_GDN_ROUND_EXPORT_(NAME, STASH)                                                                  \
  static void ignis_gdn_##NAME(tvm::ffi::TensorView mixed, tvm::ffi::TensorView b, tvm::ffi::TensorView a,     \
                               tvm::ffi::TensorView neg_a, tvm::ffi::TensorView dt_bias,                     \
                               tvm::ffi::TensorView state, tvm::ffi::TensorView slots,                       \
                               tvm::ffi::TensorView buf, tvm::ffi::TensorView out, int64_t num_key_heads,    \
                               double scale) {                                                               \
    ::ignis_gdn::gdn_recurrent_launch<STASH>(#NAME, mixed, b, a, neg_a, dt_bias, state, slots, buf, out,      \
                                             num_key_heads, scale);                                          \
  }                                                                                                          \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(NAME, ignis_gdn_##NAME)

// Export `NAME(mixed, b, a, neg_a, dt_bias, state, slots, record, out, num_key_heads, scale)`.
#define IGNIS_GDN_RECURRENT_EXPORT(NAME) IGNIS_GDN_ROUND_EXPORT_(NAME, false)

// Export `NAME(mixed, b, a, neg_a, dt_bias, state, slots, stash, out, num_key_heads, scale)`: a round
// that writes the stash (kModeStash) instead of the record.
#define IGNIS_GDN_STASH_EXPORT(NAME) IGNIS_GDN_ROUND_EXPORT_(NAME, true)

// Export `NAME(stash, state, slots, keep, pos, num_key_heads)` (kModeReplay, gdn_replay_launch).
#define IGNIS_GDN_REPLAY_EXPORT(NAME)                                                                         \
  static void ignis_gdn_##NAME(tvm::ffi::TensorView stash, tvm::ffi::TensorView state,                        \
                               tvm::ffi::TensorView slots, tvm::ffi::TensorView keep,                        \
                               tvm::ffi::TensorView pos, int64_t num_key_heads) {                            \
    ::ignis_gdn::gdn_replay_launch(#NAME, stash, state, slots, keep, pos, num_key_heads);                    \
  }                                                                                                          \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(NAME, ignis_gdn_##NAME)
