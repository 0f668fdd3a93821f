// Host side of the q4_g32 CUDA kernels: tvm-ffi exported functions with argument checks.
// A module built by ignis.compiler.kernels.q4_linear includes this header and instantiates
// IGNIS_Q4_EXPORT once per exported function.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "ffi_checks.cuh"
#include "q4_linear.cuh"

namespace ignis_q4 {

using tvm::ffi::TensorView;

inline bool is_contiguous_2d(const TensorView& t) {
  return t.ndim() == 2 && t.stride(1) == 1 && t.stride(0) == t.size(1);
}

inline bool dtype_is(const TensorView& t, uint8_t code, uint8_t bits) {
  return t.dtype().code == code && t.dtype().bits == bits && t.dtype().lanes == 1;
}

// Launch with programmatic stream serialization: the kernel may start while the previous kernel
// in the stream finishes; it waits (griddepcontrol.wait) before touching activations or outputs.
// cluster_x > 1: thread-block clusters of cluster_x blocks along x (the N layout's split K).
template <typename... KArgs, typename... Args>
void launch_pdl(void (*kernel)(KArgs...), bool pdl, size_t& raised, dim3 grid, dim3 block,
                size_t smem, cudaStream_t stream, unsigned cluster_x, Args... args) {
  // the kernel's dynamic shared-memory limit on this launch's device (`raised`: the caller's per
  // device and kernel)
  ignis_ffi::raise_smem_limit("q4_linear", kernel, smem, raised);
  cudaError_t e = ignis_ffi::launch_ex(kernel, grid, block, smem, stream, pdl, cluster_x, args...);
  TVM_FFI_CHECK(e == cudaSuccess, RuntimeError) << "q4_linear: launch failed: " << cudaGetErrorString(e);
}

// x: [R, K] f16|bf16; qweight: [N, K/8] u32|i32; scales: [N, K/32] f16; y: [R, N] like x
inline void q4_check_args(const char* name, int max_rows, int step_k, const TensorView& x,
                          const TensorView& qweight, const TensorView& scales, const TensorView& y) {
  TVM_FFI_CHECK(is_contiguous_2d(x) && is_contiguous_2d(qweight) && is_contiguous_2d(scales) &&
                    is_contiguous_2d(y),
                ValueError)
      << name << ": x, qweight, scales and y must be contiguous 2-d tensors";
  const int64_t rows = x.size(0), k_in = x.size(1), n_out = qweight.size(0);
  TVM_FFI_CHECK(rows >= 1 && rows <= max_rows, ValueError)
      << name << ": compiled for 1.." << max_rows << " rows, got " << rows;
  TVM_FFI_CHECK(k_in % step_k == 0, ValueError)
      << name << ": in_features must be a multiple of " << step_k << ", got " << k_in;
  TVM_FFI_CHECK(qweight.size(1) * 8 == k_in && scales.size(0) == n_out && scales.size(1) * 32 == k_in,
                ValueError)
      << name << ": qweight must be [N, K/8] and scales [N, K/32] for K = " << k_in << ", got ["
      << qweight.size(0) << ", " << qweight.size(1) << "] and [" << scales.size(0) << ", "
      << scales.size(1) << "]";
  TVM_FFI_CHECK(y.size(0) == rows && y.size(1) == n_out, ValueError)
      << name << ": y must be [" << rows << ", " << n_out << "]";
  TVM_FFI_CHECK((dtype_is(qweight, kDLUInt, 32) || dtype_is(qweight, kDLInt, 32)) &&
                    dtype_is(scales, kDLFloat, 16),
                TypeError)
      << name << ": qweight must be uint32 (or int32 bits) and scales float16";
  TVM_FFI_CHECK(x.dtype().code == y.dtype().code && x.dtype().bits == y.dtype().bits, TypeError)
      << name << ": y must have x's dtype";
  for (const TensorView* t : {&x, &qweight, &scales, &y}) {
    TVM_FFI_CHECK(t->device().device_type == kDLCUDA && t->device().device_id == x.device().device_id,
                  ValueError)
        << name << ": every tensor must be on the same CUDA device";
  }
  TVM_FFI_CHECK(k_in <= INT32_MAX && n_out <= INT32_MAX, ValueError) << name << ": shape too large";
}

// The N layout (q4_linear_n_kernel): WN warps split the block's outputs, clusters of KC split K.
template <int NT, int MT, int WN, int KC, int STAGES, bool PDL, int MINB, bool EARLY_W = true,
          int MODE = kModeCompute, bool KSPAN = false, bool X_CA = false, int KS = 1>
void q4_linear_n_launch(const char* name, TensorView x, TensorView qweight, TensorView scales,
                        TensorView y) {
  q4_check_args(name, 8 * NT, kStepK * KS, x, qweight, scales, y);
  const int64_t rows = x.size(0), k_in = x.size(1), n_out = qweight.size(0);
  cudaStream_t stream =
      static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, x.device().device_id));
  const int64_t rows_per_block = 16 * MT * WN;
  const dim3 grid(static_cast<unsigned>((n_out + rows_per_block - 1) / rows_per_block * KC));
  const dim3 block(WN * 32);
  const size_t smem = q4n_smem_bytes<NT, MT, WN, STAGES, KS>();
  const uint32_t* qw = static_cast<const uint32_t*>(qweight.data_ptr());
  const uint16_t* sc = static_cast<const uint16_t*>(scales.data_ptr());
  static size_t raised_f16[64], raised_bf16[64];  // per device
  const int dev = x.device().device_id;
  TVM_FFI_CHECK(dev >= 0 && dev < 64, ValueError) << name << ": CUDA device id " << dev << " out of range";
  if (dtype_is(x, kDLFloat, 16)) {
    launch_pdl(q4_linear_n_kernel<half, NT, MT, WN, KC, STAGES, MINB, EARLY_W, MODE, KSPAN, X_CA, KS>, PDL, raised_f16[dev], grid,
               block, smem, stream, static_cast<unsigned>(KC), static_cast<const half*>(x.data_ptr()),
               qw, sc, static_cast<half*>(y.data_ptr()), static_cast<int>(rows),
               static_cast<int>(n_out), static_cast<int>(k_in));
  } else if (dtype_is(x, kDLBfloat, 16)) {
    launch_pdl(q4_linear_n_kernel<__nv_bfloat16, NT, MT, WN, KC, STAGES, MINB, EARLY_W, MODE, KSPAN, X_CA, KS>, PDL, raised_bf16[dev],
               grid, block, smem, stream, static_cast<unsigned>(KC),
               static_cast<const __nv_bfloat16*>(x.data_ptr()), qw, sc,
               static_cast<__nv_bfloat16*>(y.data_ptr()), static_cast<int>(rows),
               static_cast<int>(n_out), static_cast<int>(k_in));
  } else {
    TVM_FFI_THROW(TypeError) << name << ": x must be float16 or bfloat16";
  }
  cudaError_t err = cudaGetLastError();
  TVM_FFI_CHECK(err == cudaSuccess, RuntimeError)
      << name << ": kernel launch failed: " << cudaGetErrorString(err);
}

template <int NT, int MT, int WARPS, int STAGES, int V, bool PX, bool XR, int MODE, bool PDL, int MINB,
          int FP = 0>
void q4_linear_launch(const char* name, TensorView x, TensorView qweight, TensorView scales,
                      TensorView y) {
  q4_check_args(name, 8 * NT, kStepK * V, x, qweight, scales, y);
  const int64_t rows = x.size(0), k_in = x.size(1), n_out = qweight.size(0);
  cudaStream_t stream =
      static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, x.device().device_id));
  const dim3 grid(static_cast<unsigned>((n_out + 16 * MT - 1) / (16 * MT)));
  const dim3 block(WARPS * 32);
  const size_t smem = size_t(WARPS) * q4_smem_bytes_per_warp<NT, MT, STAGES, V, XR>();
  const uint32_t* qw = static_cast<const uint32_t*>(qweight.data_ptr());
  const uint16_t* sc = static_cast<const uint16_t*>(scales.data_ptr());
  static size_t raised_f16[64], raised_bf16[64];  // per device
  const int dev = x.device().device_id;
  TVM_FFI_CHECK(dev >= 0 && dev < 64, ValueError) << name << ": CUDA device id " << dev << " out of range";
  if (dtype_is(x, kDLFloat, 16)) {
    launch_pdl(q4_linear_mma_kernel<half, NT, MT, WARPS, STAGES, V, PX, XR, MODE, MINB, FP>, PDL, raised_f16[dev], grid, block,
               smem, stream, 1u,
               static_cast<const half*>(x.data_ptr()), qw, sc, static_cast<half*>(y.data_ptr()),
               static_cast<int>(rows), static_cast<int>(n_out), static_cast<int>(k_in));
  } else if (dtype_is(x, kDLBfloat, 16)) {
    launch_pdl(q4_linear_mma_kernel<__nv_bfloat16, NT, MT, WARPS, STAGES, V, PX, XR, MODE, MINB, FP>, PDL,
               raised_bf16[dev],
               grid, block, smem, stream, 1u, static_cast<const __nv_bfloat16*>(x.data_ptr()), qw, sc,
               static_cast<__nv_bfloat16*>(y.data_ptr()), static_cast<int>(rows),
               static_cast<int>(n_out), static_cast<int>(k_in));
  } else {
    TVM_FFI_THROW(TypeError) << name << ": x must be float16 or bfloat16";
  }
  cudaError_t err = cudaGetLastError();
  TVM_FFI_CHECK(err == cudaSuccess, RuntimeError)
      << name << ": kernel launch failed: " << cudaGetErrorString(err);
}

}  // namespace ignis_q4

// Export `NAME(x, qweight, scales, y)` for up to 8*NT rows with the given tile configuration.
#define IGNIS_Q4_EXPORT(NAME, NT, MT, WARPS, STAGES, V, PX, XR, MODE, PDL, MINB)             \
  IGNIS_Q4_EXPORT_FP(NAME, NT, MT, WARPS, STAGES, V, PX, XR, MODE, PDL, MINB, 0)
// The same with fragment prefetch FP (0, 1, 2: see q4_linear_mma_kernel).
#define IGNIS_Q4_EXPORT_FP(NAME, NT, MT, WARPS, STAGES, V, PX, XR, MODE, PDL, MINB, FP)      \
  static void ignis_q4_##NAME(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight,           \
                              tvm::ffi::TensorView scales, tvm::ffi::TensorView y) {          \
    ::ignis_q4::q4_linear_launch<NT, MT, WARPS, STAGES, V, PX, XR, MODE, PDL, MINB, FP>(      \
        #NAME, x, qweight, scales, y);                                                        \
  }                                                                                           \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(NAME, ignis_q4_##NAME)
// Export `NAME(x, qweight, scales, y)` on the N layout (q4_linear_n_kernel).
// EARLY_W, MODE, KSPAN, X_CA, KS: see q4_linear_n_kernel.
#define IGNIS_Q4_EXPORT_N(NAME, NT, MT, WN, KC, STAGES, PDL, MINB, EARLY_W, MODE, KSPAN, X_CA, \
                          KS)                                                                 \
  static void ignis_q4_##NAME(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight,           \
                              tvm::ffi::TensorView scales, tvm::ffi::TensorView y) {          \
    ::ignis_q4::q4_linear_n_launch<NT, MT, WN, KC, STAGES, PDL, MINB, EARLY_W, MODE, KSPAN,   \
                                   X_CA, KS>(#NAME, x, qweight, scales, y);                   \
  }                                                                                           \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(NAME, ignis_q4_##NAME)
