// Host side of the grouped routed-expert linears (moe_experts.cuh): the tvm-ffi exported functions
// with their argument checks. A module built by ignis.compiler.kernels.moe_experts includes this
// header and IGNIS_MOE_EXPERTS_EXPORT(), which exports both:
//
//   moe_q4_gate_up(x [rows, K], ids [rows, top_k] i32, packed [slots, N, K/8] u32|i32,
//                  scales [slots, N, K/32] f16, y [rows, top_k, N])
//       x and y one dtype (f32 | bf16 | f16); x any row stride with its inner dim contiguous; ids,
//       packed, scales, y contiguous; packed 16-byte aligned; K a multiple of 32.
//   moe_q4_down(x [rows, top_k, W], ids [rows, top_k] i32, packed [slots, N, K/8], scales [slots, N, K/32],
//               route_w [rows, top_k] f32, y [rows, top_k, N] f32)
//       W = K (x is the input) or 2K (x = [gate | up], the input is round(round(silu(gate)) * up));
//       x contiguous, model dtype; route_w and y contiguous float32.
//
// rows * top_k <= kMaxPairs. Pairs whose slot id is outside [0, slots) are skipped (their outputs are
// not written). Launch on the stream tvm-ffi reports for the tensors' device (torch's current
// stream under tvm_ffi.use_torch_stream(), so CUDA-graph capture works); no allocation. Wrong shapes
// / devices raise ValueError, wrong dtypes TypeError.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "ffi_checks.cuh"
#include "moe_experts.cuh"

namespace ignis_moe {

using tvm::ffi::TensorView;
using namespace ignis_ffi;  // the shared argument checks (ffi_checks.cuh)

inline bool fully_contiguous(const TensorView& t) { return inner_contiguous(t, t.ndim()); }

// Most activation rows staged at once for `rows` rows of a K-input weight: the power of two >=
// min(rows, kMaxStageRows) whose stage fits kMaxStageBytes (at least 1). A slot's members are at most
// `rows` (a row routes to distinct experts) and at decode sizes mostly 1-2: more rows a chunk would
// cost registers (occupancy) for the rare slot with more members, which runs as several chunks.
inline int stage_rows(int64_t rows, int64_t k) {
  int m = 1;
  while (m < kMaxStageRows && m < rows) m *= 2;
  const int64_t per_row = (k / 32) * kGroupStride * static_cast<int64_t>(sizeof(float));
  while (m > 1 && m * per_row > kMaxStageBytes) m /= 2;
  return m;
}

template <typename T, int MAXM, bool DOWN>
void launch_typed(const char* name, const Params& p, dim3 grid, size_t smem, cudaStream_t stream) {
  static size_t raised[64] = {};  // per device: the dynamic shared-memory limit set for this kernel
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64) device = 0;
  raise_smem_limit(name, moe_q4_kernel<T, MAXM, DOWN>, smem, raised[device]);
  moe_q4_kernel<T, MAXM, DOWN><<<grid, dim3(kThreads), smem, stream>>>(p);
}

template <typename T, bool DOWN>
void launch_rows(const char* name, const Params& p, int m, dim3 grid, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(m) * (p.k / 32) * kGroupStride * sizeof(float);
  switch (m) {
    case 1:
      launch_typed<T, 1, DOWN>(name, p, grid, smem, stream);
      break;
    case 2:
      launch_typed<T, 2, DOWN>(name, p, grid, smem, stream);
      break;
    default:
      launch_typed<T, kMaxStageRows, DOWN>(name, p, grid, smem, stream);
      break;
  }
}

// The checks both exports share: ids [rows, top_k] i32 contiguous, the q4 stack [slots, N, K/8] +
// [slots, N, K/32], y [rows, top_k, N]; fills the weight fields of p.
inline void check_stack(const char* name, const TensorView& ids, const TensorView& packed, const TensorView& scales,
                        const TensorView& y, int64_t k, Params& p) {
  TVM_FFI_CHECK(ids.ndim() == 2 && packed.ndim() == 3 && scales.ndim() == 3 && y.ndim() == 3, ValueError)
      << name << ": ids must be [rows, top_k], packed [slots, N, K/8], scales [slots, N, K/32], y [rows, top_k, N]";
  const int64_t rows = ids.size(0), top_k = ids.size(1);
  const int64_t slots = packed.size(0), n = packed.size(1);
  TVM_FFI_CHECK(rows >= 1 && top_k >= 1 && rows * top_k <= kMaxPairs, ValueError)
      << name << ": rows * top_k must be 1.." << kMaxPairs << ", got " << rows << " x " << top_k;
  TVM_FFI_CHECK(k >= 32 && k % 32 == 0 && k <= 1073741823LL, ValueError)
      << name << ": K must be a positive multiple of 32, got " << k;
  TVM_FFI_CHECK(slots >= 1 && n >= 1 && slots <= 2147483647LL && n <= 65535LL * kTileRows, ValueError)
      << name << ": empty or oversized weight stack";
  TVM_FFI_CHECK(packed.size(2) == k / 8 && scales.size(0) == slots && scales.size(1) == n && scales.size(2) == k / 32,
                ValueError)
      << name << ": packed must be [" << slots << ", " << n << ", " << k / 8 << "] and scales [" << slots << ", " << n
      << ", " << k / 32 << "]";
  TVM_FFI_CHECK(y.size(0) == rows && y.size(1) == top_k && y.size(2) == n, ValueError)
      << name << ": y must be [" << rows << ", " << top_k << ", " << n << "]";
  TVM_FFI_CHECK(dtype_is(ids, kDLInt, 32), TypeError) << name << ": ids must be int32";
  TVM_FFI_CHECK(dtype_is(packed, kDLUInt, 32) || dtype_is(packed, kDLInt, 32), TypeError)
      << name << ": packed must be uint32 or int32";
  TVM_FFI_CHECK(dtype_is(scales, kDLFloat, 16), TypeError) << name << ": scales must be float16";
  TVM_FFI_CHECK(fully_contiguous(ids) && fully_contiguous(packed) && fully_contiguous(scales) && fully_contiguous(y),
                ValueError)
      << name << ": ids, packed, scales and y must be contiguous";
  TVM_FFI_CHECK(reinterpret_cast<uintptr_t>(ptr(packed)) % 16 == 0, ValueError)
      << name << ": packed must be 16-byte aligned";
  p.ids = static_cast<const int32_t*>(ptr(ids));
  p.pairs = static_cast<int>(rows * top_k);
  p.packed = static_cast<const uint32_t*>(ptr(packed));
  p.scales = static_cast<const __half*>(ptr(scales));
  p.slots = static_cast<int>(slots);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
}

inline dim3 grid_of(const Params& p) {
  return dim3(static_cast<unsigned>(p.pairs), static_cast<unsigned>((p.n + kTileRows - 1) / kTileRows));
}

inline void gate_up_launch(const char* name, TensorView x, TensorView ids, TensorView packed, TensorView scales,
                           TensorView y) {
  TVM_FFI_CHECK(x.ndim() == 2, ValueError) << name << ": x must be [rows, K]";
  Params p{};
  check_stack(name, ids, packed, scales, y, x.size(1), p);
  TVM_FFI_CHECK(x.size(0) == ids.size(0), ValueError) << name << ": x and ids must have the same rows";
  TVM_FFI_CHECK(x.stride(1) == 1, ValueError) << name << ": x's inner dim must be contiguous";
  TVM_FFI_CHECK(same_dtype(y, x), TypeError) << name << ": y must have x's dtype";
  check_cuda(name, {&x, &ids, &packed, &scales, &y});
  p.x = ptr(x);
  p.x_row = x.stride(0);
  p.x_div = static_cast<int>(ids.size(1));
  p.swiglu = 0;
  p.route_w = nullptr;
  p.y = ptr(y);
  const int m = stage_rows(x.size(0), p.k);
  cudaStream_t stream = stream_of(x);
  dispatch_float(name, "x", x, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_rows<T, false>(name, p, m, grid_of(p), stream);
  });
  check_launch(name);
}

inline void down_launch(const char* name, TensorView x, TensorView ids, TensorView packed, TensorView scales,
                        TensorView route_w, TensorView y) {
  TVM_FFI_CHECK(x.ndim() == 3 && route_w.ndim() == 2, ValueError)
      << name << ": x must be [rows, top_k, W] and route_w [rows, top_k]";
  TVM_FFI_CHECK(packed.ndim() == 3, ValueError) << name << ": packed must be [slots, N, K/8]";
  const int64_t k = packed.size(2) * 8;
  Params p{};
  check_stack(name, ids, packed, scales, y, k, p);
  TVM_FFI_CHECK(x.size(0) == ids.size(0) && x.size(1) == ids.size(1) && (x.size(2) == k || x.size(2) == 2 * k),
                ValueError)
      << name << ": x must be [" << ids.size(0) << ", " << ids.size(1) << ", " << k << " or " << 2 * k << "]";
  TVM_FFI_CHECK(route_w.size(0) == ids.size(0) && route_w.size(1) == ids.size(1), ValueError)
      << name << ": route_w must be [" << ids.size(0) << ", " << ids.size(1) << "]";
  TVM_FFI_CHECK(fully_contiguous(x) && fully_contiguous(route_w), ValueError)
      << name << ": x and route_w must be contiguous";
  TVM_FFI_CHECK(dtype_is(route_w, kDLFloat, 32) && dtype_is(y, kDLFloat, 32), TypeError)
      << name << ": route_w and y must be float32";
  check_cuda(name, {&x, &ids, &packed, &scales, &route_w, &y});
  p.x = ptr(x);
  p.x_row = x.size(2);
  p.x_div = 1;
  p.swiglu = x.size(2) == 2 * k ? 1 : 0;
  p.route_w = static_cast<const float*>(ptr(route_w));
  p.y = ptr(y);
  const int m = stage_rows(x.size(0), k);
  cudaStream_t stream = stream_of(x);
  dispatch_float(name, "x", x, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    launch_rows<T, true>(name, p, m, grid_of(p), stream);
  });
  check_launch(name);
}

}  // namespace ignis_moe

// Export moe_q4_gate_up(x, ids, packed, scales, y) and moe_q4_down(x, ids, packed, scales, route_w, y).
#define IGNIS_MOE_EXPERTS_EXPORT()                                                                             \
  static void ignis_moe_q4_gate_up(tvm::ffi::TensorView x, tvm::ffi::TensorView ids, tvm::ffi::TensorView packed, \
                                   tvm::ffi::TensorView scales, tvm::ffi::TensorView y) {                      \
    ::ignis_moe::gate_up_launch("moe_q4_gate_up", x, ids, packed, scales, y);                                  \
  }                                                                                                            \
  static void ignis_moe_q4_down(tvm::ffi::TensorView x, tvm::ffi::TensorView ids, tvm::ffi::TensorView packed,    \
                                tvm::ffi::TensorView scales, tvm::ffi::TensorView route_w,                     \
                                tvm::ffi::TensorView y) {                                                      \
    ::ignis_moe::down_launch("moe_q4_down", x, ids, packed, scales, route_w, y);                               \
  }                                                                                                            \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_q4_gate_up, ignis_moe_q4_gate_up)                                          \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(moe_q4_down, ignis_moe_q4_down)
