// Host side of the fused mixer pieces (fused_mixers.cuh): the tvm-ffi exported functions with their
// argument checks. A module built by ignis.compiler.kernels.fused_mixers includes this header and
// IGNIS_FUSED_MIXERS_EXPORT(), which exports the three below:
//
//   gdn_conv_silu(qkv [L * n, C] (any strides), state [S, C, K - 1] (any strides), slots [L] int64,
//                 weight [C, K] (any strides), windows [>= L, C, >= K - 1 + n] (any strides),
//                 out [L, n, C] contiguous)
//       one dtype (f32 | bf16 | f16) for qkv, state, weight, windows and out; 2 <= K <= 8;
//       windows and out must not overlap the inputs (not checked).
//   qk_norm_rope_kv(q [rows, heads, hd], k [rows, kv_heads, hd], v [rows, kv_heads, hd] (any strides),
//                   wq [hd] f32, wk [hd] f32 (contiguous), cos [rows, rot], sin [rows, rot],
//                   pos [rows] int64, slots [L] int64 (rows = L * n), kc [S, cap, kv_heads, hd],
//                   vc [S, cap, kv_heads, hd] (any strides), q_out [rows, heads, hd] contiguous, eps)
//       one dtype for q, k, v, cos, sin, kc, vc and q_out; rot even, rot <= hd <= 1024. A row whose
//       slot or position is out of range writes no key / value (torch's indexing would fault).
//   rope_kv(q, k, v, cos, sin, pos, slots, kc, vc, q_out)
//       qk_norm_rope_kv without the q/k norm (llama / qwen2): the same shapes, checks and writes.
//
// Launch on the stream tvm-ffi reports for the tensors' device (torch's current stream under
// tvm_ffi.use_torch_stream(), so CUDA-graph capture works); no allocation, no attribute change.
// Wrong shapes / devices raise ValueError, wrong dtypes TypeError.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "ffi_checks.cuh"
#include "fused_mixers.cuh"

namespace ignis_mixers {

using tvm::ffi::TensorView;
using namespace ignis_ffi;  // the shared argument checks (ffi_checks.cuh)

inline void check_i64(const char* name, const char* what, const TensorView& t, int64_t size) {
  TVM_FFI_CHECK(t.ndim() == 1 && t.size(0) == size && (size == 1 || t.stride(0) == 1), ValueError)
      << name << ": " << what << " must be contiguous [" << size << "]";
  TVM_FFI_CHECK(dtype_is(t, kDLInt, 64), TypeError) << name << ": " << what << " must be int64";
}

template <typename T>
void conv_launch(const ConvParams& p, int K, dim3 grid, cudaStream_t stream) {
  switch (K) {
    case 2: gdn_conv_silu_kernel<T, 2><<<grid, kConvThreads, 0, stream>>>(p); break;
    case 3: gdn_conv_silu_kernel<T, 3><<<grid, kConvThreads, 0, stream>>>(p); break;
    case 4: gdn_conv_silu_kernel<T, 4><<<grid, kConvThreads, 0, stream>>>(p); break;
    case 5: gdn_conv_silu_kernel<T, 5><<<grid, kConvThreads, 0, stream>>>(p); break;
    case 6: gdn_conv_silu_kernel<T, 6><<<grid, kConvThreads, 0, stream>>>(p); break;
    case 7: gdn_conv_silu_kernel<T, 7><<<grid, kConvThreads, 0, stream>>>(p); break;
    default: gdn_conv_silu_kernel<T, 8><<<grid, kConvThreads, 0, stream>>>(p); break;
  }
}

inline void gdn_conv_silu_launch(const char* name, TensorView qkv, TensorView state, TensorView slots,
                                 TensorView weight, TensorView windows, TensorView out) {
  TVM_FFI_CHECK(qkv.ndim() == 2 && state.ndim() == 3 && weight.ndim() == 2 && windows.ndim() == 3 && out.ndim() == 3,
                ValueError)
      << name << ": qkv must be [L * n, C], state [S, C, K - 1], weight [C, K], windows [L, C, W], out [L, n, C]";
  const int64_t lanes = out.size(0), n = out.size(1), channels = out.size(2), K = weight.size(1);
  TVM_FFI_CHECK(lanes >= 1 && n >= 1 && channels >= 1 && lanes <= 65535 && n <= 65535 && channels <= 2147483647LL,
                ValueError)
      << name << ": empty or oversized out";
  TVM_FFI_CHECK(K >= 2 && K <= kMaxConvKernel, ValueError) << name << ": the conv kernel size must be 2.." << kMaxConvKernel;
  TVM_FFI_CHECK(qkv.size(0) == lanes * n && qkv.size(1) == channels, ValueError)
      << name << ": qkv must be [" << lanes * n << ", " << channels << "]";
  TVM_FFI_CHECK(state.size(1) == channels && state.size(2) == K - 1 && state.size(0) >= 1, ValueError)
      << name << ": state must be [S, " << channels << ", " << K - 1 << "]";
  TVM_FFI_CHECK(weight.size(0) == channels, ValueError) << name << ": weight must be [" << channels << ", K]";
  TVM_FFI_CHECK(windows.size(0) >= lanes && windows.size(1) == channels && windows.size(2) >= K - 1 + n, ValueError)
      << name << ": windows must be [>= " << lanes << ", " << channels << ", >= " << K - 1 + n << "]";
  TVM_FFI_CHECK((channels == 1 || out.stride(2) == 1) && (n == 1 || out.stride(1) == channels) &&
                    (lanes == 1 || out.stride(0) == n * channels),
                ValueError)
      << name << ": out must be contiguous";
  check_i64(name, "slots", slots, lanes);
  for (const TensorView* t : {&state, &weight, &windows, &out}) {
    TVM_FFI_CHECK(same_dtype(*t, qkv), TypeError) << name << ": state, weight, windows and out must have qkv's dtype";
  }
  check_cuda(name, {&qkv, &state, &slots, &weight, &windows, &out});
  ConvParams p;
  p.qkv = ptr(qkv);
  p.qkv_row = qkv.stride(0);
  p.qkv_el = qkv.stride(1);
  p.state = ptr(state);
  p.st_slot = state.stride(0);
  p.st_ch = state.stride(1);
  p.st_el = state.stride(2);
  p.slots = static_cast<const int64_t*>(ptr(slots));
  p.weight = ptr(weight);
  p.w_ch = weight.stride(0);
  p.w_el = weight.stride(1);
  p.windows = ptr(windows);
  p.win_lane = windows.stride(0);
  p.win_ch = windows.stride(1);
  p.win_el = windows.stride(2);
  p.out = ptr(out);
  p.lanes = static_cast<int>(lanes);
  p.n = static_cast<int>(n);
  p.channels = static_cast<int>(channels);
  p.num_slots = static_cast<int>(state.size(0));
  cudaStream_t stream = stream_of(qkv);
  const dim3 grid(static_cast<unsigned>((channels + kConvThreads - 1) / kConvThreads), static_cast<unsigned>(n),
                  static_cast<unsigned>(lanes));  // a thread per (channel, column, lane)
  const int k = static_cast<int>(K);
  dispatch_float(name, "qkv", qkv, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    conv_launch<T>(p, k, grid, stream);
  });
  check_launch(name);
}

// qk_norm_rope_kv (norm true) and rope_kv (norm false: wq and wk are not read; the caller passes q for
// both).
inline void qk_norm_rope_kv_launch(const char* name, TensorView q, TensorView k, TensorView v, TensorView wq,
                                   TensorView wk, TensorView cos, TensorView sin, TensorView pos, TensorView slots,
                                   TensorView kc, TensorView vc, TensorView q_out, double eps, bool norm = true) {
  TVM_FFI_CHECK(q.ndim() == 3 && k.ndim() == 3 && v.ndim() == 3 && q_out.ndim() == 3 && cos.ndim() == 2 &&
                    sin.ndim() == 2 && kc.ndim() == 4 && vc.ndim() == 4 &&
                    (!norm || (wq.ndim() == 1 && wk.ndim() == 1)),
                ValueError)
      << name << ": q, q_out [rows, heads, hd], k, v [rows, kv_heads, hd], cos, sin [rows, rot], kc, vc "
      << "[S, cap, kv_heads, hd], wq, wk [hd]";
  const int64_t rows = q.size(0), heads = q.size(1), hd = q.size(2), kv_heads = k.size(1), rot = cos.size(1);
  const int64_t lanes = slots.ndim() == 1 ? slots.size(0) : 0;
  TVM_FFI_CHECK(rows >= 1 && heads >= 1 && kv_heads >= 1 && hd >= 1 && hd <= kMaxHeadDim && rows <= 2147483647LL &&
                    heads + kv_heads <= 65535,
                ValueError)
      << name << ": empty or oversized q / k (head_dim at most " << kMaxHeadDim << ")";
  TVM_FFI_CHECK(lanes >= 1 && rows % lanes == 0, ValueError) << name << ": rows must be a multiple of slots' length";
  TVM_FFI_CHECK(rot >= 0 && rot % 2 == 0 && rot <= hd, ValueError) << name << ": rot must be even and <= head_dim";
  TVM_FFI_CHECK(k.size(0) == rows && k.size(2) == hd && v.size(0) == rows && v.size(1) == kv_heads && v.size(2) == hd,
                ValueError)
      << name << ": k and v must be [" << rows << ", kv_heads, " << hd << "]";
  TVM_FFI_CHECK(q_out.size(0) == rows && q_out.size(1) == heads && q_out.size(2) == hd && (hd == 1 || q_out.stride(2) == 1) &&
                    (heads == 1 || q_out.stride(1) == hd) && (rows == 1 || q_out.stride(0) == heads * hd),
                ValueError)
      << name << ": q_out must be contiguous [" << rows << ", " << heads << ", " << hd << "]";
  TVM_FFI_CHECK(cos.size(0) == rows && sin.size(0) == rows && sin.size(1) == rot, ValueError)
      << name << ": cos and sin must be [" << rows << ", rot]";
  for (const TensorView* t : {&kc, &vc}) {
    TVM_FFI_CHECK(t->size(0) >= 1 && t->size(2) == kv_heads && t->size(3) == hd && t->size(1) == kc.size(1) &&
                      t->size(0) == kc.size(0),
                  ValueError)
        << name << ": kc and vc must be [S, cap, " << kv_heads << ", " << hd << "]";
  }
  for (const TensorView* t : {&wq, &wk}) {
    if (!norm) break;
    TVM_FFI_CHECK(t->size(0) == hd && (hd == 1 || t->stride(0) == 1), ValueError)
        << name << ": wq and wk must be contiguous [" << hd << "]";
    TVM_FFI_CHECK(dtype_is(*t, kDLFloat, 32), TypeError) << name << ": wq and wk must be float32";
  }
  check_i64(name, "pos", pos, rows);
  check_i64(name, "slots", slots, lanes);
  for (const TensorView* t : {&k, &v, &cos, &sin, &kc, &vc, &q_out}) {
    TVM_FFI_CHECK(same_dtype(*t, q), TypeError) << name << ": k, v, cos, sin, kc, vc and q_out must have q's dtype";
  }
  check_cuda(name, {&q, &k, &v, &wq, &wk, &cos, &sin, &pos, &slots, &kc, &vc, &q_out});
  NormRopeParams p;
  p.q = ptr(q);
  p.q_row = q.stride(0);
  p.q_head = q.stride(1);
  p.q_el = q.stride(2);
  p.k = ptr(k);
  p.k_row = k.stride(0);
  p.k_head = k.stride(1);
  p.k_el = k.stride(2);
  p.v = ptr(v);
  p.v_row = v.stride(0);
  p.v_head = v.stride(1);
  p.v_el = v.stride(2);
  p.wq = norm ? static_cast<const float*>(ptr(wq)) : nullptr;
  p.wk = norm ? static_cast<const float*>(ptr(wk)) : nullptr;
  p.cos = ptr(cos);
  p.sin = ptr(sin);
  p.cs_row = cos.stride(0);
  p.cs_el = cos.stride(1);
  p.sn_row = sin.stride(0);
  p.sn_el = sin.stride(1);
  p.pos = static_cast<const int64_t*>(ptr(pos));
  p.slots = static_cast<const int64_t*>(ptr(slots));
  p.kc = ptr(kc);
  p.vc = ptr(vc);
  p.kc_slot = kc.stride(0);
  p.kc_pos = kc.stride(1);
  p.kc_head = kc.stride(2);
  p.kc_el = kc.stride(3);
  p.vc_slot = vc.stride(0);
  p.vc_pos = vc.stride(1);
  p.vc_head = vc.stride(2);
  p.vc_el = vc.stride(3);
  p.q_out = ptr(q_out);
  p.rows = static_cast<int>(rows);
  p.n = static_cast<int>(rows / lanes);
  p.heads = static_cast<int>(heads);
  p.kv_heads = static_cast<int>(kv_heads);
  p.hd = static_cast<int>(hd);
  p.rot = static_cast<int>(rot);
  p.num_slots = static_cast<int>(kc.size(0));
  p.capacity = kc.size(1);
  p.eps = static_cast<float>(eps);
  cudaStream_t stream = stream_of(q);
  const int64_t blocks = (rows * (heads + kv_heads) + kNormWarps - 1) / kNormWarps;
  TVM_FFI_CHECK(blocks <= 2147483647LL, ValueError) << name << ": too many blocks (" << blocks << ")";
  const dim3 grid(static_cast<unsigned>(blocks)), block(kNormWarps * 32);
  const size_t smem = static_cast<size_t>(kNormWarps) * static_cast<size_t>(hd) * sizeof(float);
  dispatch_float(name, "q", q, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (norm) {
      qk_norm_rope_kv_kernel<T, true><<<grid, block, smem, stream>>>(p);
    } else {
      qk_norm_rope_kv_kernel<T, false><<<grid, block, smem, stream>>>(p);
    }
  });
  check_launch(name);
}

}  // namespace ignis_mixers

// Export gdn_conv_silu(qkv, state, slots, weight, windows, out) and
// qk_norm_rope_kv(q, k, v, wq, wk, cos, sin, pos, slots, kc, vc, q_out, eps) and
// rope_kv(q, k, v, cos, sin, pos, slots, kc, vc, q_out).
#define IGNIS_FUSED_MIXERS_EXPORT()                                                                            \
  static void ignis_gdn_conv_silu(tvm::ffi::TensorView qkv, tvm::ffi::TensorView state, tvm::ffi::TensorView slots, \
                                  tvm::ffi::TensorView weight, tvm::ffi::TensorView windows,                    \
                                  tvm::ffi::TensorView out) {                                                   \
    ::ignis_mixers::gdn_conv_silu_launch("gdn_conv_silu", qkv, state, slots, weight, windows, out);             \
  }                                                                                                            \
  static void ignis_qk_norm_rope_kv(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v,     \
                                    tvm::ffi::TensorView wq, tvm::ffi::TensorView wk, tvm::ffi::TensorView cos, \
                                    tvm::ffi::TensorView sin, tvm::ffi::TensorView pos,                         \
                                    tvm::ffi::TensorView slots, tvm::ffi::TensorView kc,                        \
                                    tvm::ffi::TensorView vc, tvm::ffi::TensorView q_out, double eps) {          \
    ::ignis_mixers::qk_norm_rope_kv_launch("qk_norm_rope_kv", q, k, v, wq, wk, cos, sin, pos, slots, kc, vc,    \
                                           q_out, eps);                                                         \
  }                                                                                                            \
  static void ignis_rope_kv(tvm::ffi::TensorView q, tvm::ffi::TensorView k, tvm::ffi::TensorView v,             \
                            tvm::ffi::TensorView cos, tvm::ffi::TensorView sin, tvm::ffi::TensorView pos,       \
                            tvm::ffi::TensorView slots, tvm::ffi::TensorView kc, tvm::ffi::TensorView vc,       \
                            tvm::ffi::TensorView q_out) {                                                       \
    ::ignis_mixers::qk_norm_rope_kv_launch("rope_kv", q, k, v, q, q, cos, sin, pos, slots, kc, vc, q_out, 0.0,  \
                                           false);                                                              \
  }                                                                                                            \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(gdn_conv_silu, ignis_gdn_conv_silu)                                            \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(qk_norm_rope_kv, ignis_qk_norm_rope_kv)                                        \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(rope_kv, ignis_rope_kv)
