// Argument checks shared by the host sides of the tvm-ffi kernel modules (topk_ffi.cuh,
// gdn_recurrent_ffi.cuh, fused_norms_ffi.cuh, fused_mixers_ffi.cuh): dtype / device / shape /
// contiguity predicates and checks, the launch-error check and the stream lookup. Host code only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <initializer_list>
#include <type_traits>

namespace ignis_ffi {

using tvm::ffi::TensorView;

// t's dtype is exactly (code, bits) with one lane.
inline bool dtype_is(const TensorView& t, uint8_t code, uint8_t bits) {
  return t.dtype().code == code && t.dtype().bits == bits && t.dtype().lanes == 1;
}

inline bool same_dtype(const TensorView& x, const TensorView& y) {
  return x.dtype().code == y.dtype().code && x.dtype().bits == y.dtype().bits && x.dtype().lanes == y.dtype().lanes;
}

// fn(tag) for t's element type T -- float, __nv_bfloat16 or __half -- with tag a null T* (the caller
// reads T as std::remove_pointer_t<decltype(tag)>); TypeError "<name>: <what> must be float32,
// bfloat16 or float16" for any other dtype.
template <typename F>
void dispatch_float(const char* name, const char* what, const TensorView& t, F&& fn) {
  if (dtype_is(t, kDLFloat, 32)) {
    fn(static_cast<float*>(nullptr));
  } else if (dtype_is(t, kDLBfloat, 16)) {
    fn(static_cast<__nv_bfloat16*>(nullptr));
  } else if (dtype_is(t, kDLFloat, 16)) {
    fn(static_cast<__half*>(nullptr));
  } else {
    TVM_FFI_THROW(TypeError) << name << ": " << what << " must be float32, bfloat16 or float16";
  }
}

// The first element's address (DLPack: data + byte_offset).
inline void* ptr(const TensorView& t) { return static_cast<char*>(t.data_ptr()) + t.byte_offset(); }

// A row-major contiguous 2-d tensor.
inline bool is_contiguous_2d(const TensorView& t) {
  return t.ndim() == 2 && t.stride(1) == 1 && (t.size(0) <= 1 || t.stride(0) == t.size(1));
}

// The last `inner` dims of t are contiguous (row-major).
inline bool inner_contiguous(const TensorView& t, int inner) {
  int64_t expect = 1;
  for (int d = t.ndim() - 1; d >= t.ndim() - inner; --d) {
    if (t.size(d) > 1 && t.stride(d) != expect) return false;
    expect *= t.size(d);
  }
  return true;
}

// Whether `device` supports programmatic dependent launch (compute capability 9.0+), cached per device.
inline bool device_has_pdl(int device) {
  static int cached[64] = {};  // 0 unknown, 1 no, 2 yes
  if (device < 0 || device >= 64) return false;
  if (cached[device] == 0) {
    int major = 0;
    cached[device] = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
                             major >= 9
                         ? 2
                         : 1;
  }
  return cached[device] == 2;
}

// cudaLaunchKernelEx with the attributes the kernels use: `pdl`, programmatic stream serialization
// (CUDA programming guide, "Programmatic Dependent Launch": the kernel may start while the previous
// kernel on the stream is finishing, so it must execute griddepcontrol.wait before it reads that
// kernel's outputs or writes anything), and `cluster_x` > 1, thread-block clusters of that many
// blocks along x. Returns the launch's error.
template <typename... KArgs, typename... Args>
cudaError_t launch_ex(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                      unsigned cluster_x, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n_attr = 0;
  if (pdl) {
    attr[n_attr].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n_attr].val.programmaticStreamSerializationAllowed = 1;
    ++n_attr;
  }
  if (cluster_x > 1) {
    attr[n_attr].id = cudaLaunchAttributeClusterDimension;
    attr[n_attr].val.clusterDim.x = cluster_x;
    attr[n_attr].val.clusterDim.y = 1;
    attr[n_attr].val.clusterDim.z = 1;
    ++n_attr;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n_attr;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

// Launch `kernel` on `stream`, as a programmatic dependent launch where the current device has it
// (`launch_ex`; the device code calls `pdl_grid_wait` first). The caller checks the launch
// (`check_launch`).
template <typename... KArgs, typename... Args>
void launch_maybe_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args... args) {
  int device = -1;  // the launch's device: the current one
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  (void)launch_ex(kernel, grid, block, smem, stream, device_has_pdl(device), 1u, args...);
}

// Raise `kernel`'s dynamic shared-memory limit to `smem` bytes when `raised` (the limit already set for
// it on the device this call launches on; 0 = the default 48 KiB) is lower. A function attribute is
// set per device: the caller keeps one `raised` per device and kernel. RuntimeError on failure.
template <typename Kernel>
void raise_smem_limit(const char* name, Kernel kernel, size_t smem, size_t& raised) {
  if (smem <= (raised ? raised : size_t{48} * 1024)) return;
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  TVM_FFI_CHECK(e == cudaSuccess, RuntimeError)
      << name << ": cannot reserve " << smem << " bytes of shared memory: " << cudaGetErrorString(e);
  raised = smem;
}

// Every tensor is on the first one's CUDA device (ValueError otherwise).
inline void check_cuda(const char* name, std::initializer_list<const TensorView*> ts) {
  const TensorView* first = *ts.begin();
  for (const TensorView* t : ts) {
    TVM_FFI_CHECK(t->device().device_type == kDLCUDA && t->device().device_id == first->device().device_id,
                  ValueError)
        << name << ": every tensor must be on the same CUDA device";
  }
}

// The last launch succeeded (RuntimeError otherwise).
inline void check_launch(const char* name) {
  cudaError_t err = cudaGetLastError();
  TVM_FFI_CHECK(err == cudaSuccess, RuntimeError) << name << ": kernel launch failed: " << cudaGetErrorString(err);
}

// The stream tvm-ffi reports for t's CUDA device (torch's current stream under
// tvm_ffi.use_torch_stream()).
inline cudaStream_t stream_of(const TensorView& t) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, t.device().device_id));
}

}  // namespace ignis_ffi
