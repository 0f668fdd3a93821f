// Host side of the fused row norms (fused_norms.cuh): the tvm-ffi exported functions with their
// argument checks. A module built by ignis.compiler.kernels.fused_norms includes this header and
// IGNIS_FUSED_NORMS_EXPORT(), which exports all five:
//
//   add_rms_norm(h [rows, hidden], d [rows, hidden], w1p [hidden] f32, h_out [rows, hidden],
//                x_out [rows, hidden], eps: float)
//       h, d, h_out, x_out: one dtype (f32 | bf16 | f16), any row stride, the hidden dim contiguous;
//       h_out and x_out must not overlap each other, h or d (not checked).
//   add_rms_norm_llama(h, d, w [hidden] h's dtype, h_out, x_out, eps)
//       as add_rms_norm with HF LlamaRMSNorm's roundings: x_out = round(w * round(normed h_out)).
//   gated_rms_norm(x [rows, heads, dim] f32 or z's dtype (any strides), z [rows, heads, dim] (any
//                  strides), w [dim] z's dtype, out [rows, heads * dim] z's dtype contiguous, eps)
//       out must not overlap x, z or w (not checked).
//   silu_mul(gu [rows, 2 inter], out [rows, inter])
//       one dtype (f32 | bf16 | f16), any row strides, inner dims contiguous; out must not overlap gu.
//   narrow_linear(x [rows, k], w [n, k], y [rows, n])
//       one dtype (f32 | bf16 | f16), any row strides (x and w rows 16-byte aligned: k and the row
//       strides multiples of 16 bytes), inner dims contiguous; y must not overlap x or w.
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
#include "fused_norms.cuh"

namespace ignis_norms {

using tvm::ffi::TensorView;
using namespace ignis_ffi;  // the shared argument checks (ffi_checks.cuh)

// add_rms_norm (llama false: w1p float32, 1 + weight) and add_rms_norm_llama (llama true: w the weight
// in h's dtype, applied after the normed value is rounded).
inline void add_rms_norm_launch(const char* name, TensorView h, TensorView d, TensorView w1p, TensorView h_out,
                                TensorView x_out, double eps, bool llama = false) {
  TVM_FFI_CHECK(h.ndim() == 2 && d.ndim() == 2 && h_out.ndim() == 2 && x_out.ndim() == 2 && w1p.ndim() == 1,
                ValueError)
      << name << ": h, d, h_out, x_out must be [rows, hidden] and w1p [hidden]";
  const int64_t rows = h.size(0), hidden = h.size(1);
  TVM_FFI_CHECK(rows >= 1 && hidden >= 1 && rows <= 2147483647LL && hidden <= 2147483647LL, ValueError)
      << name << ": empty or oversized rows / hidden";
  for (const TensorView* t : {&d, &h_out, &x_out}) {
    TVM_FFI_CHECK(t->size(0) == rows && t->size(1) == hidden, ValueError)
        << name << ": d, h_out and x_out must be [" << rows << ", " << hidden << "]";
    TVM_FFI_CHECK(same_dtype(*t, h), TypeError) << name << ": d, h_out and x_out must have h's dtype";
  }
  for (const TensorView* t : {&h, &d, &h_out, &x_out}) {
    TVM_FFI_CHECK(t->size(1) == 1 || t->stride(1) == 1, ValueError) << name << ": the hidden dim must be contiguous";
  }
  const char* wname = llama ? "w" : "w1p";
  TVM_FFI_CHECK(w1p.size(0) == hidden && w1p.stride(0) == 1, ValueError)
      << name << ": " << wname << " must be contiguous [" << hidden << "]";
  if (llama) {
    TVM_FFI_CHECK(same_dtype(w1p, h), TypeError) << name << ": w must have h's dtype";
  } else {
    TVM_FFI_CHECK(dtype_is(w1p, kDLFloat, 32), TypeError) << name << ": w1p must be float32";
  }
  check_cuda(name, {&h, &d, &w1p, &h_out, &x_out});
  AddParams p;
  p.h = ptr(h);
  p.h_row = h.stride(0);
  p.d = ptr(d);
  p.d_row = d.stride(0);
  p.w1p = llama ? nullptr : static_cast<const float*>(ptr(w1p));
  p.w = llama ? ptr(w1p) : nullptr;
  p.h_out = ptr(h_out);
  p.ho_row = h_out.stride(0);
  p.x_out = ptr(x_out);
  p.xo_row = x_out.stride(0);
  p.rows = static_cast<int>(rows);
  p.hidden = static_cast<int>(hidden);
  p.eps = static_cast<float>(eps);
  cudaStream_t stream = stream_of(h);
  const dim3 grid(static_cast<unsigned>(rows)), block(kAddThreads);
  dispatch_float(name, "h", h, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (llama) {
      launch_maybe_pdl(add_rms_norm_kernel<T, true>, grid, block, 0, stream, p);
    } else {
      launch_maybe_pdl(add_rms_norm_kernel<T, false>, grid, block, 0, stream, p);
    }
  });
  check_launch(name);
}

template <typename T>
void gated_launch(const GatedParams& p, bool x_f32, dim3 grid, dim3 block, cudaStream_t stream) {
  if (x_f32) {
    launch_maybe_pdl(gated_rms_norm_kernel<float, T>, grid, block, 0, stream, p);
  } else {
    launch_maybe_pdl(gated_rms_norm_kernel<T, T>, grid, block, 0, stream, p);
  }
}

inline void gated_rms_norm_launch(const char* name, TensorView x, TensorView z, TensorView w, TensorView out,
                                  double eps) {
  TVM_FFI_CHECK(x.ndim() == 3 && z.ndim() == 3 && w.ndim() == 1 && out.ndim() == 2, ValueError)
      << name << ": x and z must be [rows, heads, dim], w [dim], out [rows, heads * dim]";
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  TVM_FFI_CHECK(rows >= 1 && heads >= 1 && dim >= 1 && rows <= 2147483647LL && heads <= 2147483647LL && dim <= 2147483647LL,
                ValueError)
      << name << ": empty or oversized x";
  TVM_FFI_CHECK(z.size(0) == rows && z.size(1) == heads && z.size(2) == dim, ValueError)
      << name << ": z must be [" << rows << ", " << heads << ", " << dim << "]";
  TVM_FFI_CHECK(w.size(0) == dim && w.stride(0) == 1, ValueError) << name << ": w must be contiguous [" << dim << "]";
  TVM_FFI_CHECK(out.size(0) == rows && out.size(1) == heads * dim && (out.size(1) == 1 || out.stride(1) == 1) &&
                    (rows == 1 || out.stride(0) == heads * dim),
                ValueError)
      << name << ": out must be contiguous [" << rows << ", " << heads * dim << "]";
  TVM_FFI_CHECK(same_dtype(w, z) && same_dtype(out, z), TypeError) << name << ": w and out must have z's dtype";
  const bool x_f32 = dtype_is(x, kDLFloat, 32);
  TVM_FFI_CHECK(x_f32 || same_dtype(x, z), TypeError) << name << ": x must be float32 or z's dtype";
  check_cuda(name, {&x, &z, &w, &out});
  GatedParams p;
  p.x = ptr(x);
  p.x_row = x.stride(0);
  p.x_head = x.stride(1);
  p.x_el = x.stride(2);
  p.z = ptr(z);
  p.z_row = z.stride(0);
  p.z_head = z.stride(1);
  p.z_el = z.stride(2);
  p.w = ptr(w);
  p.out = ptr(out);
  p.rows = static_cast<int>(rows);
  p.heads = static_cast<int>(heads);
  p.dim = static_cast<int>(dim);
  p.eps = static_cast<float>(eps);
  cudaStream_t stream = stream_of(x);
  const int64_t blocks = (rows * heads + kGatedWarps - 1) / kGatedWarps;
  TVM_FFI_CHECK(blocks <= 2147483647LL, ValueError) << name << ": too many blocks (" << blocks << ")";
  const dim3 grid(static_cast<unsigned>(blocks)), block(kGatedWarps * 32);
  dispatch_float(name, "z", z, [&](auto tag) {  // (float32 z: x is float32 too, checked above)
    using T = std::remove_pointer_t<decltype(tag)>;
    gated_launch<T>(p, x_f32, grid, block, stream);
  });
  check_launch(name);
}

template <typename T>
bool aligned16(const TensorView& t, int64_t row_stride) {
  return reinterpret_cast<uintptr_t>(ptr(t)) % 16 == 0 && (row_stride * static_cast<int64_t>(sizeof(T))) % 16 == 0;
}

template <typename T>
void silu_mul_typed(ActParams p, TensorView gu, TensorView out, cudaStream_t stream) {
  const bool vec =
      p.inter % (16 / static_cast<int>(sizeof(T))) == 0 && aligned16<T>(gu, p.gu_row) && aligned16<T>(out, p.out_row);
  const int per = vec ? 16 / static_cast<int>(sizeof(T)) : 1;
  const int64_t chunks = (p.inter + per - 1) / per;
  const dim3 grid(static_cast<unsigned>((chunks + kActThreads - 1) / kActThreads), static_cast<unsigned>(p.rows));
  if (vec) {
    launch_maybe_pdl(silu_mul_kernel<T, true>, grid, dim3(kActThreads), 0, stream, p);
  } else {
    launch_maybe_pdl(silu_mul_kernel<T, false>, grid, dim3(kActThreads), 0, stream, p);
  }
}

inline void silu_mul_launch(const char* name, TensorView gu, TensorView out) {
  TVM_FFI_CHECK(gu.ndim() == 2 && out.ndim() == 2, ValueError) << name << ": gu must be [rows, 2 inter], out [rows, inter]";
  const int64_t rows = gu.size(0), inter = out.size(1);
  TVM_FFI_CHECK(rows >= 1 && inter >= 1 && rows <= 65535 && inter <= 1073741823LL, ValueError)
      << name << ": rows must be 1..65535 and inter >= 1, got [" << rows << ", " << inter << "]";
  TVM_FFI_CHECK(gu.size(1) == 2 * inter && out.size(0) == rows, ValueError)
      << name << ": gu must be [" << rows << ", " << 2 * inter << "] for out [" << out.size(0) << ", " << inter << "]";
  TVM_FFI_CHECK(gu.stride(1) == 1 && (inter == 1 || out.stride(1) == 1), ValueError)
      << name << ": the inner dims must be contiguous";
  TVM_FFI_CHECK(same_dtype(gu, out), TypeError) << name << ": out must have gu's dtype";
  check_cuda(name, {&gu, &out});
  ActParams p;
  p.gu = ptr(gu);
  p.gu_row = gu.stride(0);
  p.out = ptr(out);
  p.out_row = out.stride(0);
  p.rows = static_cast<int>(rows);
  p.inter = static_cast<int>(inter);
  cudaStream_t stream = stream_of(gu);
  dispatch_float(name, "gu", gu, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_typed<T>(p, gu, out, stream);
  });
  check_launch(name);
}

template <typename T>
void narrow_linear_typed(const char* name, LinParams p, TensorView x, TensorView w, cudaStream_t stream) {
  constexpr int E = 16 / static_cast<int>(sizeof(T));
  TVM_FFI_CHECK(p.k % E == 0 && aligned16<T>(x, p.x_row) && aligned16<T>(w, p.w_row), ValueError)
      << name << ": k and the row strides of x and w must be multiples of 16 bytes, with 16-byte aligned data";
  const dim3 grid(static_cast<unsigned>(p.n), static_cast<unsigned>((p.rows + kLinRows - 1) / kLinRows));
  launch_maybe_pdl(narrow_linear_kernel<T>, grid, dim3(kLinThreads), 0, stream, p);
}

inline void narrow_linear_launch(const char* name, TensorView x, TensorView w, TensorView y) {
  TVM_FFI_CHECK(x.ndim() == 2 && w.ndim() == 2 && y.ndim() == 2, ValueError)
      << name << ": x must be [rows, k], w [n, k], y [rows, n]";
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  TVM_FFI_CHECK(rows >= 1 && k >= 1 && n >= 1 && rows <= 65535 * 8LL && n <= 2147483647LL && k <= 2147483647LL,
                ValueError)
      << name << ": empty or oversized x / w";
  TVM_FFI_CHECK(w.size(1) == k && y.size(0) == rows && y.size(1) == n, ValueError)
      << name << ": w must be [n, " << k << "] and y [" << rows << ", " << n << "]";
  TVM_FFI_CHECK(x.stride(1) == 1 && w.stride(1) == 1 && (n == 1 || y.stride(1) == 1), ValueError)
      << name << ": the inner dims must be contiguous";
  TVM_FFI_CHECK(same_dtype(w, x) && same_dtype(y, x), TypeError) << name << ": w and y must have x's dtype";
  check_cuda(name, {&x, &w, &y});
  LinParams p;
  p.x = ptr(x);
  p.x_row = x.stride(0);
  p.w = ptr(w);
  p.w_row = w.stride(0);
  p.y = ptr(y);
  p.y_row = y.stride(0);
  p.rows = static_cast<int>(rows);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  cudaStream_t stream = stream_of(x);
  dispatch_float(name, "x", x, [&](auto tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    narrow_linear_typed<T>(name, p, x, w, stream);
  });
  check_launch(name);
}

}  // namespace ignis_norms

// Export add_rms_norm(h, d, w1p, h_out, x_out, eps), add_rms_norm_llama(h, d, w, h_out, x_out, eps), gated_rms_norm(x, z, w, out, eps), silu_mul(gu, out)
// and narrow_linear(x, w, y).
#define IGNIS_FUSED_NORMS_EXPORT()                                                                           \
  static void ignis_add_rms_norm(tvm::ffi::TensorView h, tvm::ffi::TensorView d, tvm::ffi::TensorView w1p,  \
                                 tvm::ffi::TensorView h_out, tvm::ffi::TensorView x_out, double eps) {      \
    ::ignis_norms::add_rms_norm_launch("add_rms_norm", h, d, w1p, h_out, x_out, eps);                        \
  }                                                                                                          \
  static void ignis_add_rms_norm_llama(tvm::ffi::TensorView h, tvm::ffi::TensorView d, tvm::ffi::TensorView w, \
                                       tvm::ffi::TensorView h_out, tvm::ffi::TensorView x_out, double eps) {  \
    ::ignis_norms::add_rms_norm_launch("add_rms_norm_llama", h, d, w, h_out, x_out, eps, true);             \
  }                                                                                                          \
  static void ignis_gated_rms_norm(tvm::ffi::TensorView x, tvm::ffi::TensorView z, tvm::ffi::TensorView w,  \
                                   tvm::ffi::TensorView out, double eps) {                                  \
    ::ignis_norms::gated_rms_norm_launch("gated_rms_norm", x, z, w, out, eps);                               \
  }                                                                                                          \
  static void ignis_silu_mul(tvm::ffi::TensorView gu, tvm::ffi::TensorView out) {                           \
    ::ignis_norms::silu_mul_launch("silu_mul", gu, out);                                                     \
  }                                                                                                          \
  static void ignis_narrow_linear(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView y) {  \
    ::ignis_norms::narrow_linear_launch("narrow_linear", x, w, y);                                           \
  }                                                                                                          \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_rms_norm, ignis_add_rms_norm)                                            \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(gated_rms_norm, ignis_gated_rms_norm)                                        \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(silu_mul, ignis_silu_mul)                                                    \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(narrow_linear, ignis_narrow_linear)                                          \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_rms_norm_llama, ignis_add_rms_norm_llama)
