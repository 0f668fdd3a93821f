// Host side of the exact top-k (topk.cuh): the tvm-ffi exported function with argument checks.
// A module built by ignis.compiler.kernels.topk includes this header and IGNIS_TOPK_EXPORT(name).
//
//   name(x [rows, V] f32|bf16|f16, values [rows, k] (x's dtype), indices [rows, k] int64,
//        workspace [>= rows * 32 * ceil(V / 4096)] int64|uint64)
//
// k is values.shape[1]. Both kernels run on the stream tvm-ffi reports for x's device (torch's
// current stream under tvm_ffi.use_torch_stream(), so CUDA-graph capture works). The select
// kernel's 64 KiB of dynamic shared memory is reserved on the first call on each device: call once
// before capturing a graph.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>

#include "ffi_checks.cuh"
#include "topk.cuh"

namespace ignis_topk {

using tvm::ffi::TensorView;
using namespace ignis_ffi;  // the shared argument checks (ffi_checks.cuh)

template <typename T>
void launch(const char* name, const TensorView& x, const TensorView& values, const TensorView& indices,
            const TensorView& workspace, int64_t rows, int64_t vocab, int k, int tiles,
            cudaStream_t stream) {
  // the select kernel's dynamic shared-memory limit, raised once per device (a function attribute
  // is per device)
  static size_t raised_per_device[64];
  const int device = x.device().device_id;
  TVM_FFI_CHECK(device >= 0 && device < 64, ValueError) << name << ": CUDA device id " << device << " out of range";
  const size_t smem = size_t(kCap) * sizeof(uint64_t);
  raise_smem_limit(name, topk_select_kernel<T>, smem, raised_per_device[device]);
  const T* xp = static_cast<const T*>(x.data_ptr());
  uint64_t* gm = static_cast<uint64_t*>(workspace.data_ptr());
  const bool vec_ok = (reinterpret_cast<uintptr_t>(xp) % 16 == 0) && ((vocab * sizeof(T)) % 16 == 0);
  const dim3 grid1(static_cast<unsigned>((tiles + kWarps1 - 1) / kWarps1), static_cast<unsigned>(rows));
  topk_group_max_kernel<T><<<grid1, kWarps1 * 32, 0, stream>>>(xp, vocab, tiles, gm, vec_ok);
  topk_select_kernel<T><<<static_cast<unsigned>(rows), kThreads2, smem, stream>>>(
      xp, vocab, tiles, gm, k, static_cast<T*>(values.data_ptr()),
      static_cast<int64_t*>(indices.data_ptr()));
  check_launch(name);
}

inline void topk_launch(const char* name, TensorView x, TensorView values, TensorView indices,
                        TensorView workspace) {
  TVM_FFI_CHECK(is_contiguous_2d(x) && is_contiguous_2d(values) && is_contiguous_2d(indices), ValueError)
      << name << ": x, values and indices must be contiguous 2-d tensors";
  const int64_t rows = x.size(0), vocab = x.size(1), k = values.size(1);
  TVM_FFI_CHECK(values.size(0) == rows && indices.size(0) == rows && indices.size(1) == k, ValueError)
      << name << ": values and indices must both be [" << rows << ", k], got [" << values.size(0) << ", "
      << values.size(1) << "] and [" << indices.size(0) << ", " << indices.size(1) << "]";
  TVM_FFI_CHECK(k >= 1 && k <= kMaxK && k <= vocab, ValueError)
      << name << ": k must be 1.." << kMaxK << " and at most V = " << vocab << ", got " << k;
  TVM_FFI_CHECK(rows >= 1 && rows <= 65535, ValueError) << name << ": rows must be 1..65535, got " << rows;
  const int64_t tiles = (vocab + kTile - 1) / kTile;
  TVM_FFI_CHECK(vocab >= 1 && tiles * 32 <= kCap, ValueError)
      << name << ": V must be 1.." << int64_t(kCap / 32) * kTile << ", got " << vocab;
  TVM_FFI_CHECK(x.dtype().code == values.dtype().code && x.dtype().bits == values.dtype().bits, TypeError)
      << name << ": values must have x's dtype";
  TVM_FFI_CHECK(dtype_is(indices, kDLInt, 64), TypeError) << name << ": indices must be int64";
  TVM_FFI_CHECK(dtype_is(workspace, kDLInt, 64) || dtype_is(workspace, kDLUInt, 64), TypeError)
      << name << ": workspace must be int64 or uint64";
  int64_t ws = 1;
  for (int d = 0; d < workspace.ndim(); ++d) ws *= workspace.size(d);
  TVM_FFI_CHECK(workspace.ndim() == 1 && workspace.stride(0) == 1 && ws >= rows * tiles * 32, ValueError)
      << name << ": workspace must be a contiguous 1-d tensor of at least " << rows * tiles * 32
      << " elements, got " << ws;
  check_cuda(name, {&x, &values, &indices, &workspace});
  cudaStream_t stream = stream_of(x);
  const int kk = static_cast<int>(k), nt = static_cast<int>(tiles);
  if (dtype_is(x, kDLFloat, 32)) {
    launch<float>(name, x, values, indices, workspace, rows, vocab, kk, nt, stream);
  } else if (dtype_is(x, kDLBfloat, 16)) {
    launch<__nv_bfloat16>(name, x, values, indices, workspace, rows, vocab, kk, nt, stream);
  } else if (dtype_is(x, kDLFloat, 16)) {
    launch<__half>(name, x, values, indices, workspace, rows, vocab, kk, nt, stream);
  } else {
    TVM_FFI_THROW(TypeError) << name << ": x must be float32, bfloat16 or float16";
  }
}

}  // namespace ignis_topk

// Export `NAME(x, values, indices, workspace)` (see the top of this file).
#define IGNIS_TOPK_EXPORT(NAME)                                                                    \
  static void ignis_topk_##NAME(tvm::ffi::TensorView x, tvm::ffi::TensorView values,               \
                                tvm::ffi::TensorView indices, tvm::ffi::TensorView workspace) {    \
    ::ignis_topk::topk_launch(#NAME, x, values, indices, workspace);                               \
  }                                                                                                \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(NAME, ignis_topk_##NAME)
