// Dequantization of tiled q4_g32 weights (runtime/q4_tiled.py's layout) into row-major bf16 / f16,
// for the prefill route of LinearBackend: a chunk of hundreds of rows runs one GEMM on the
// dequantized weight instead of streaming the codes once per 64-row verify-round width.
//
//   q4_g32_tiled_dequant(codes [B, T, S, 256] u32|i32, scales [B, T, S, 64] f16, out [B, N, K] bf16|f16)
//
// B >= 1 stacked weights (an MoE layer's experts; lead dims flattened by the caller), T = ceil(N / 16)
// tiles, S = K / 128 k-steps. Within one (tile, k-step) word (h * 32 + lane) * 4 + w, lane = 4 g + t,
// holds the 8 codes of row 16 tile + g + 8 h at features 128 s + 32 w + 8 t + f, feature f in nibble
// kNibbleOfFeature[f]; scale (g * 2 + h) * 4 + w is that row's scale for features 128 s + 32 w ..
// + 31. Value = (code - 8) * scale computed in float32 (exact: a 4-bit integer times an f16 is
// exact in float32) and rounded once to the output type (round to nearest even), the same numbers
// as runtime/linear.py's dequantize_q4. Rows past N (the last tile's padding) are not written.
//
// One block per (tile, k-step, weight), 256 threads, one code word each: 8 outputs as one 16-byte
// store; a warp writes two rows of 128 contiguous features. Runs on the stream tvm-ffi reports
// (torch's current stream under tvm_ffi.use_torch_stream()).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include <cstdint>

#include "ffi_checks.cuh"

namespace ignis_q4_dequant {

using tvm::ffi::TensorView;
using namespace ignis_ffi;

// nibble position of feature f within a tiled word (runtime/q4_tiled.py NIBBLE_OF_FEATURE)
__constant__ int kNibbleOfFeature[8] = {0, 4, 1, 5, 2, 6, 3, 7};

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

template <typename T>
__global__ void __launch_bounds__(256) q4_dequant_tiled_kernel(const uint32_t* __restrict__ codes,
                                                               const __half* __restrict__ scales,
                                                               T* __restrict__ out, int64_t tiles,
                                                               int64_t steps, int64_t n, int64_t k) {
  const int64_t tile = blockIdx.x / steps, s = blockIdx.x % steps, b = blockIdx.y;
  const int word = threadIdx.x;  // (h * 32 + lane) * 4 + w
  const int w = word & 3, lane = (word >> 2) & 31, h = word >> 7;
  const int g = lane >> 2, t = lane & 3;
  const int64_t row = tile * 16 + g + 8 * h;
  if (row >= n) return;
  const int64_t pair = (b * tiles + tile) * steps + s;
  const uint32_t bits = codes[pair * 256 + word];
  const float scale = __half2float(scales[pair * 64 + (g * 2 + h) * 4 + w]);
  alignas(16) T vals[8];
#pragma unroll
  for (int f = 0; f < 8; ++f) {
    const int code = static_cast<int>((bits >> (4 * kNibbleOfFeature[f])) & 15u);
    vals[f] = from_float<T>(static_cast<float>(code - 8) * scale);
  }
  T* dst = out + (b * n + row) * k + s * 128 + w * 32 + t * 8;
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(vals);
}

inline void q4_dequant_tiled_launch(const char* name, TensorView codes, TensorView scales, TensorView out) {
  check_cuda(name, {&codes, &scales, &out});
  TVM_FFI_CHECK(codes.ndim() == 4 && scales.ndim() == 4 && out.ndim() == 3, ValueError)
      << name << ": codes [B, T, S, 256], scales [B, T, S, 64] and out [B, N, K] expected";
  TVM_FFI_CHECK(dtype_is(codes, kDLUInt, 32) || dtype_is(codes, kDLInt, 32), TypeError)
      << name << ": codes must be uint32 or int32";
  TVM_FFI_CHECK(dtype_is(scales, kDLFloat, 16), TypeError) << name << ": scales must be float16";
  TVM_FFI_CHECK(inner_contiguous(codes, 4) && inner_contiguous(scales, 4) && inner_contiguous(out, 3), ValueError)
      << name << ": codes, scales and out must be contiguous";
  const int64_t batch = codes.size(0), tiles = codes.size(1), steps = codes.size(2);
  const int64_t n = out.size(1), k = out.size(2);
  TVM_FFI_CHECK(codes.size(3) == 256 && scales.size(0) == batch && scales.size(1) == tiles &&
                    scales.size(2) == steps && scales.size(3) == 64,
                ValueError)
      << name << ": scales [" << scales.size(0) << ", " << scales.size(1) << ", " << scales.size(2) << ", "
      << scales.size(3) << "] do not match codes [" << batch << ", " << tiles << ", " << steps << ", "
      << codes.size(3) << "]";
  TVM_FFI_CHECK(out.size(0) == batch && k == steps * 128 && n > (tiles - 1) * 16 && n <= tiles * 16, ValueError)
      << name << ": out [" << out.size(0) << ", " << n << ", " << k << "] cannot hold " << batch << " x "
      << tiles << " tiles x " << steps << " k-steps";
  TVM_FFI_CHECK(batch >= 1 && batch <= 65535 && tiles * steps <= 2147483647LL, ValueError)
      << name << ": " << batch << " weights of " << tiles << " x " << steps << " tiles are out of range";
  TVM_FFI_CHECK(reinterpret_cast<uintptr_t>(ptr(out)) % 16 == 0, ValueError)
      << name << ": out must be 16-byte aligned";
  const dim3 grid(static_cast<unsigned>(tiles * steps), static_cast<unsigned>(batch));
  const cudaStream_t stream = stream_of(out);
  const uint32_t* cp = static_cast<const uint32_t*>(ptr(codes));
  const __half* sp = static_cast<const __half*>(ptr(scales));
  if (dtype_is(out, kDLBfloat, 16)) {
    q4_dequant_tiled_kernel<__nv_bfloat16>
        <<<grid, 256, 0, stream>>>(cp, sp, static_cast<__nv_bfloat16*>(ptr(out)), tiles, steps, n, k);
  } else if (dtype_is(out, kDLFloat, 16)) {
    q4_dequant_tiled_kernel<__half><<<grid, 256, 0, stream>>>(cp, sp, static_cast<__half*>(ptr(out)), tiles, steps, n, k);
  } else {
    TVM_FFI_THROW(TypeError) << name << ": out must be bfloat16 or float16";
  }
  check_launch(name);
}

}  // namespace ignis_q4_dequant

// Exports q4_g32_tiled_dequant (the name runtime/linear.py looks up in a tiled q4 module).
#define IGNIS_Q4_DEQUANT_EXPORT()                                                                            \
  static void ignis_q4_g32_tiled_dequant(tvm::ffi::TensorView codes, tvm::ffi::TensorView scales,         \
                                         tvm::ffi::TensorView out) {                                      \
    ::ignis_q4_dequant::q4_dequant_tiled_launch("q4_g32_tiled_dequant", codes, scales, out);              \
  }                                                                                                        \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(q4_g32_tiled_dequant, ignis_q4_g32_tiled_dequant)
