// The activation dtypes every non-linear kernel takes (float32, float16, bfloat16) as float32 and
// back: `to_f` widens exactly, `from_f<T>` rounds to nearest even (the identity for float32), and
// `round_to<T>` is the round trip, the model dtype's rounding point (what a torch op computing in
// float32 and storing in T does). Shared by the GDN recurrence, the fused norms and mixers, and the
// top-k kernel; each brings them into its namespace with using-declarations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace ignis_dtypes {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Rounded to T and back (the model dtype's rounding point).
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_f(from_f<T>(v));
}

}  // namespace ignis_dtypes
