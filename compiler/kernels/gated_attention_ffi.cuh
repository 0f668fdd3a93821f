// Host side of the gated grouped-query attention (gated_attention.cuh): the tvm-ffi exported
// function with its argument checks, built into the fused mixers' module
// (ignis.compiler.kernels.fused_mixers) by IGNIS_GATED_ATTENTION_EXPORT():
//
//   gated_attention(q [rows, heads, hd] contiguous, kc [S, cap, kv_heads, hd], vc [S, cap, kv_heads, hd]
//                   (hd contiguous), gate [rows, heads, hd] (hd contiguous), pos [rows] int64,
//                   slots [L] int64 (rows = L * n), out [rows, heads * hd] contiguous,
//                   ws_o [L, kv_heads, splits, r_pad, hd] f32, ws_ml [L, kv_heads, splits, r_pad, 2] f32
//                   (contiguous; unused, any shape, when splits = 1), max_keys, split_keys, scale)
//       one dtype, bf16 or f16, for q, kc, vc, gate and out; hd in {32, 64, 128, 256}; heads a
//       multiple of kv_heads; splits = ceil(max_keys / split_keys), split_keys a positive multiple of
//       32, r_pad = (heads / kv_heads) * n rounded up to 64. Keys from max_keys on are never read (a
//       row at pos[r] >= max_keys sees keys 0 .. max_keys - 1 only: the caller's KV bucket). A lane
//       whose slot is out of range reads no keys (its output is 0). Needs sm_80+ (mma.m16n8k16,
//       cp.async).
//
// Launch on the stream tvm-ffi reports for the tensors' device (torch's current stream under
// tvm_ffi.use_torch_stream(), so CUDA-graph capture works); no allocation. The first launch on a
// device raises the kernel's dynamic shared-memory limit there (a function attribute, set per
// device). Wrong shapes / devices raise ValueError, wrong dtypes TypeError.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/function.h>

#include "ffi_checks.cuh"
#include "gated_attention.cuh"

namespace ignis_attn {

using tvm::ffi::TensorView;
using namespace ignis_ffi;

template <typename T, int HD, bool GATE>
void gated_attention_run(const char* name, const Params& p, int lanes, int64_t rows, cudaStream_t stream) {
  const size_t smem = gated_attention_smem_bytes<T, HD>();
  static size_t raised[64] = {};  // this instantiation's shared-memory limit, per device
  int device = 0;
  TVM_FFI_CHECK(cudaGetDevice(&device) == cudaSuccess && device >= 0 && device < 64, RuntimeError)
      << name << ": no current CUDA device (or more than 64)";
  raise_smem_limit(name, gated_attention_kernel<T, HD, GATE>, smem, raised[device]);
  const int m_groups = p.r_pad / kRowsPerBlock;
  const dim3 grid(static_cast<unsigned>(p.splits), static_cast<unsigned>(p.kv_heads * m_groups),
                  static_cast<unsigned>(lanes));
  gated_attention_kernel<T, HD, GATE><<<grid, kWarps * 32, smem, stream>>>(p);
  check_launch(name);
  if (p.splits > 1) {
    const dim3 cgrid(static_cast<unsigned>(rows), static_cast<unsigned>(p.heads));
    gated_attention_combine_kernel<T, HD, GATE><<<cgrid, HD, 0, stream>>>(p);
    check_launch(name);
  }
}

template <typename T, bool GATE>
void gated_attention_dispatch(const char* name, const Params& p, int hd, int lanes, int64_t rows,
                              cudaStream_t stream) {
  switch (hd) {
    case 32: gated_attention_run<T, 32, GATE>(name, p, lanes, rows, stream); break;
    case 64: gated_attention_run<T, 64, GATE>(name, p, lanes, rows, stream); break;
    case 128: gated_attention_run<T, 128, GATE>(name, p, lanes, rows, stream); break;
    default: gated_attention_run<T, 256, GATE>(name, p, lanes, rows, stream); break;
  }
}

// gated_attention (gate given) and grouped_attention (gate null: no gate, out's rows any stride).
inline void gated_attention_launch(const char* name, TensorView q, TensorView kc, TensorView vc, const TensorView* gate_p,
                                   TensorView pos, TensorView slots, TensorView out, TensorView ws_o,
                                   TensorView ws_ml, int64_t max_keys, int64_t split_keys, double scale) {
  const bool gated = gate_p != nullptr;
  TensorView gate = gated ? *gate_p : q;  // q stands in for the absent gate in the checks
  TVM_FFI_CHECK(q.ndim() == 3 && kc.ndim() == 4 && vc.ndim() == 4 && gate.ndim() == 3 && out.ndim() == 2 &&
                    pos.ndim() == 1 && slots.ndim() == 1,
                ValueError)
      << name << ": q, gate [rows, heads, hd], kc, vc [S, cap, kv_heads, hd], out [rows, heads * hd], pos [rows], "
      << "slots [L]";
  const int64_t rows = q.size(0), heads = q.size(1), hd = q.size(2), kv_heads = kc.size(2), lanes = slots.size(0);
  TVM_FFI_CHECK(hd == 32 || hd == 64 || hd == 128 || hd == 256, ValueError)
      << name << ": head_dim must be 32, 64, 128 or 256, got " << hd;
  TVM_FFI_CHECK(rows >= 1 && lanes >= 1 && lanes <= 65535 && rows % lanes == 0 && rows <= 2147483647LL, ValueError)
      << name << ": rows must be a positive multiple of slots' length (at most 65535 lanes)";
  TVM_FFI_CHECK(kv_heads >= 1 && heads % kv_heads == 0 && heads <= 65535, ValueError)
      << name << ": heads must be a multiple of kv_heads";
  const int64_t n = rows / lanes, rep = heads / kv_heads;
  TVM_FFI_CHECK(q.stride(2) == 1 && q.stride(1) == hd && (rows == 1 || q.stride(0) == heads * hd), ValueError)
      << name << ": q must be contiguous [" << rows << ", " << heads << ", " << hd << "]";
  for (const TensorView* t : {&kc, &vc}) {
    TVM_FFI_CHECK(t->size(0) == kc.size(0) && t->size(1) == kc.size(1) && t->size(2) == kv_heads && t->size(3) == hd &&
                      t->stride(3) == 1 && t->size(0) >= 1,
                  ValueError)
        << name << ": kc and vc must be [S, cap, " << kv_heads << ", " << hd << "] with head_dim contiguous";
  }
  TVM_FFI_CHECK(gate.size(0) == rows && gate.size(1) == heads && gate.size(2) == hd && gate.stride(2) == 1, ValueError)
      << name << ": gate must be [" << rows << ", " << heads << ", " << hd << "] with head_dim contiguous";
  if (gated) {
    TVM_FFI_CHECK(out.size(0) == rows && out.size(1) == heads * hd && is_contiguous_2d(out), ValueError)
        << name << ": out must be contiguous [" << rows << ", " << heads * hd << "]";
  } else {
    TVM_FFI_CHECK(out.size(0) == rows && out.size(1) == heads * hd && out.stride(1) == 1 &&
                      (rows == 1 || (out.stride(0) >= heads * hd && out.stride(0) % 2 == 0)),
                  ValueError)
        << name << ": out must be [" << rows << ", " << heads * hd << "] with the last dim contiguous and an even "
        << "row stride of at least " << heads * hd;
  }
  TVM_FFI_CHECK(pos.size(0) == rows && (rows == 1 || pos.stride(0) == 1) && dtype_is(pos, kDLInt, 64), ValueError)
      << name << ": pos must be contiguous int64 [" << rows << "]";
  TVM_FFI_CHECK((lanes == 1 || slots.stride(0) == 1) && dtype_is(slots, kDLInt, 64), ValueError)
      << name << ": slots must be contiguous int64 [L]";
  TVM_FFI_CHECK(max_keys >= 1 && split_keys >= kChunk && split_keys % kChunk == 0 && split_keys <= (1LL << 30),
                ValueError)
      << name << ": max_keys must be >= 1 and split_keys a positive multiple of " << kChunk;
  const int64_t splits = (max_keys + split_keys - 1) / split_keys;
  TVM_FFI_CHECK(splits <= 65535, ValueError) << name << ": more than 65535 key splits";
  const int64_t r_pad = (rep * n + kRowsPerBlock - 1) / kRowsPerBlock * kRowsPerBlock;
  TVM_FFI_CHECK(kv_heads * (r_pad / kRowsPerBlock) <= 65535, ValueError) << name << ": too many query rows a lane";
  if (splits > 1) {
    TVM_FFI_CHECK(ws_o.ndim() == 5 && ws_o.size(0) == lanes && ws_o.size(1) == kv_heads && ws_o.size(2) == splits &&
                      ws_o.size(3) == r_pad && ws_o.size(4) == hd && inner_contiguous(ws_o, 5) &&
                      dtype_is(ws_o, kDLFloat, 32),
                  ValueError)
        << name << ": ws_o must be contiguous float32 [" << lanes << ", " << kv_heads << ", " << splits << ", " << r_pad
        << ", " << hd << "]";
    TVM_FFI_CHECK(ws_ml.ndim() == 5 && ws_ml.size(0) == lanes && ws_ml.size(1) == kv_heads &&
                      ws_ml.size(2) == splits && ws_ml.size(3) == r_pad && ws_ml.size(4) == 2 &&
                      inner_contiguous(ws_ml, 5) && dtype_is(ws_ml, kDLFloat, 32),
                  ValueError)
        << name << ": ws_ml must be contiguous float32 [" << lanes << ", " << kv_heads << ", " << splits << ", "
        << r_pad << ", 2]";
    check_cuda(name, {&q, &ws_o, &ws_ml});
  }
  for (const TensorView* t : {&kc, &vc, &gate, &out}) {
    TVM_FFI_CHECK(same_dtype(*t, q), TypeError) << name << ": kc, vc, gate and out must have q's dtype";
  }
  check_cuda(name, {&q, &kc, &vc, &gate, &pos, &slots, &out});
  Params p;
  p.q = ptr(q);
  p.kc = ptr(kc);
  p.vc = ptr(vc);
  p.gate = ptr(gate);
  p.out = ptr(out);
  p.out_row = rows == 1 ? heads * hd : out.stride(0);
  p.ws_o = splits > 1 ? static_cast<float*>(ptr(ws_o)) : nullptr;
  p.ws_ml = splits > 1 ? static_cast<float2*>(ptr(ws_ml)) : nullptr;
  p.pos = static_cast<const int64_t*>(ptr(pos));
  p.slots = static_cast<const int64_t*>(ptr(slots));
  p.kc_slot = kc.stride(0);
  p.kc_pos = kc.stride(1);
  p.kc_head = kc.stride(2);
  p.vc_slot = vc.stride(0);
  p.vc_pos = vc.stride(1);
  p.vc_head = vc.stride(2);
  p.g_row = gate.stride(0);
  p.g_head = gate.stride(1);
  p.capacity = kc.size(1);
  p.max_keys = max_keys;
  p.num_slots = static_cast<int>(kc.size(0) > 2147483647LL ? 2147483647LL : kc.size(0));
  p.n = static_cast<int>(n);
  p.heads = static_cast<int>(heads);
  p.kv_heads = static_cast<int>(kv_heads);
  p.rep = static_cast<int>(rep);
  p.r_pad = static_cast<int>(r_pad);
  p.split_keys = static_cast<int>(split_keys);
  p.splits = static_cast<int>(splits);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
  // 16-byte alignment of every row the kernel copies (cp.async 16 bytes); out takes pairs of elements
  for (const TensorView* t : {&q, &kc, &vc}) {
    TVM_FFI_CHECK(reinterpret_cast<uintptr_t>(ptr(*t)) % 16 == 0, ValueError)
        << name << ": q, kc and vc must be 16-byte aligned";
  }
  TVM_FFI_CHECK(reinterpret_cast<uintptr_t>(ptr(out)) % 4 == 0, ValueError) << name << ": out must be 4-byte aligned";
  TVM_FFI_CHECK(kc.stride(1) % 8 == 0 && kc.stride(2) % 8 == 0 && kc.stride(0) % 8 == 0 && vc.stride(0) % 8 == 0 &&
                    vc.stride(1) % 8 == 0 && vc.stride(2) % 8 == 0,
                ValueError)
      << name << ": kc and vc strides must be multiples of 8 elements";
  cudaStream_t stream = stream_of(q);
  const int h = static_cast<int>(hd), L = static_cast<int>(lanes);
  if (dtype_is(q, kDLBfloat, 16)) {
    if (gated) {
      gated_attention_dispatch<__nv_bfloat16, true>(name, p, h, L, rows, stream);
    } else {
      gated_attention_dispatch<__nv_bfloat16, false>(name, p, h, L, rows, stream);
    }
  } else if (dtype_is(q, kDLFloat, 16)) {
    if (gated) {
      gated_attention_dispatch<__half, true>(name, p, h, L, rows, stream);
    } else {
      gated_attention_dispatch<__half, false>(name, p, h, L, rows, stream);
    }
  } else {
    TVM_FFI_THROW(TypeError) << name << ": q must be bfloat16 or float16";
  }
}

}  // namespace ignis_attn

// Export gated_attention(q, kc, vc, gate, pos, slots, out, ws_o, ws_ml, max_keys, split_keys, scale) and
// grouped_attention(q, kc, vc, pos, slots, out, ws_o, ws_ml, max_keys, split_keys, scale) (no gate: out =
// round(attention); out's rows any even stride >= heads * hd, e.g. a zero-padded activation buffer).
#define IGNIS_GATED_ATTENTION_EXPORT()                                                                           \
  static void ignis_gated_attention(tvm::ffi::TensorView q, tvm::ffi::TensorView kc, tvm::ffi::TensorView vc,    \
                                    tvm::ffi::TensorView gate, tvm::ffi::TensorView pos,                         \
                                    tvm::ffi::TensorView slots, tvm::ffi::TensorView out,                        \
                                    tvm::ffi::TensorView ws_o, tvm::ffi::TensorView ws_ml, int64_t max_keys,     \
                                    int64_t split_keys, double scale) {                                          \
    ::ignis_attn::gated_attention_launch("gated_attention", q, kc, vc, &gate, pos, slots, out, ws_o, ws_ml,      \
                                         max_keys, split_keys, scale);                                           \
  }                                                                                                              \
  static void ignis_grouped_attention(tvm::ffi::TensorView q, tvm::ffi::TensorView kc, tvm::ffi::TensorView vc,  \
                                      tvm::ffi::TensorView pos, tvm::ffi::TensorView slots,                      \
                                      tvm::ffi::TensorView out, tvm::ffi::TensorView ws_o,                       \
                                      tvm::ffi::TensorView ws_ml, int64_t max_keys, int64_t split_keys,          \
                                      double scale) {                                                            \
    ::ignis_attn::gated_attention_launch("grouped_attention", q, kc, vc, nullptr, pos, slots, out, ws_o, ws_ml,  \
                                         max_keys, split_keys, scale);                                           \
  }                                                                                                              \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(gated_attention, ignis_gated_attention)                                          \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(grouped_attention, ignis_grouped_attention)
