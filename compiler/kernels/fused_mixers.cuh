// Fused pieces of the hybrid (Qwen3.5 / Qwen3-Next) token mixers, for graphed verify rounds: each
// replaces a chain of small torch kernels (graph nodes) by one launch per layer.
//
// gdn_conv_silu (the GDN causal depthwise conv1d + SiLU over the round's columns):
//
//     window[l, c, :] = [state[slots[l], c, 0:kd] | qkv[l * n + t, c] for t < n]   (model dtype)
//     y[l, t, c]      = round(sum_k float(w[c, k]) * float(window[l, c, t + k]))     k = 0..K-1
//     out[l, t, c]    = round(y / (1 + exp(-y)))                                     (SiLU)
//
// kd = K - 1; the window (kd + n values per channel) is also written to windows[l, c, 0:kd+n], the
// layout StaticHybridExecutor.commit reads. round = to the model dtype (round to nearest even), the
// identity for float32. One thread per (channel, column, lane); the sum is a float32 FMA chain in k
// order.
//
// qk_norm_rope_kv (full attention: q/k RMSNorm(1 + w), partial rotate-half RoPE, the KV write):
//
//     y[e]   = round((float(x[e]) * rsqrt(sum(float(x)^2) / hd + eps)) * w1p[e])      per head
//     rot'd  = e < half ? -y[e + half] : y[e - half]                                  for e < rot
//     o[e]   = round(round(y[e] * cos[e]) + round(rot'd * sin[e]))  (e < rot),  y[e] otherwise
//
// (HF Qwen3_5RMSNorm then apply_rotary_pos_emb with cos/sin in the model dtype, as
// StaticHybridExecutor's _norm and _apply_rope.) Query heads go to q_out [rows, heads, hd]; key heads
// to kc[slots[row / n], pos[row], head, :] and the value heads, unchanged, to vc at the same place.
// One warp per (row, head): lane j handles e = j, j + 32, ...; the sum of squares is a strided FMA
// chain and an xor-shuffle tree; the normed head goes through shared memory for the rotation.
// Products and sums are separately rounded (__fmul_rn / __fadd_rn: no contraction, as torch's).
//
// rope_kv (llama / qwen2 attention: no q/k norm) is the same kernel with NORM false: y[e] = x[e]
// (already in the model dtype), then the same RoPE and KV write -- HF's apply_rotary_pos_emb with its
// three roundings, bit for bit what torch's `x * cos + rotate_half(x) * sin` computes.
//
// CPU models (same order of operations): ignis.compiler.kernels.fused_mixers.gdn_conv_silu_emulated,
// qk_norm_rope_kv_emulated and rope_kv_emulated.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "dtypes.cuh"

namespace ignis_mixers {

constexpr int kConvThreads = 128;  // channels per block of gdn_conv_silu
constexpr int kMaxConvKernel = 8;  // largest conv kernel size K
constexpr int kNormWarps = 8;      // (row, head) groups per block of qk_norm_rope_kv
constexpr int kMaxHeadDim = 1024;  // largest head_dim (shared memory kNormWarps * hd floats)

using ignis_dtypes::from_f;
using ignis_dtypes::round_to;
using ignis_dtypes::to_f;


struct ConvParams {
  const void* qkv;  // [L * n, C]
  int64_t qkv_row, qkv_el;
  const void* state;  // [S, C, kd]
  int64_t st_slot, st_ch, st_el;
  const int64_t* slots;  // [L]
  const void* weight;    // [C, K]
  int64_t w_ch, w_el;
  void* windows;  // [>= L, C, >= kd + n]
  int64_t win_lane, win_ch, win_el;
  void* out;  // [L, n, C] contiguous
  int lanes, n, channels, num_slots;
};

// A thread per (channel, column, lane): out[l, t, c] needs only window positions t .. t + K - 1
// ([state | the round's columns]), so the columns run in parallel rather than one after another in
// a thread (a thread walking its channel's columns grew with the column count, and neither loading 8
// columns at once nor coalescing its window writes helped: the perf log, docs/perf/log/, runs 88-89). Grid (channel blocks, n, L); each thread also writes its window position
// K - 1 + t, the column-0 threads the state's K - 1. The same FMA order as the torch conv's model.
template <typename T, int K>
__global__ void __launch_bounds__(kConvThreads) gdn_conv_silu_kernel(ConvParams p) {
  const int c = blockIdx.x * kConvThreads + threadIdx.x;
  const int t = blockIdx.y;
  const int l = blockIdx.z;
  if (c >= p.channels) return;
  const T* qkv = static_cast<const T*>(p.qkv) + c * p.qkv_el;
  const T* weight = static_cast<const T*>(p.weight);
  T* windows = static_cast<T*>(p.windows) + l * p.win_lane + c * p.win_ch;
  const int64_t slot = p.slots[l];
  const bool ok = slot >= 0 && slot < p.num_slots;  // out of range: a zero state (torch would fault)
  const T* st = static_cast<const T*>(p.state) + (ok ? slot : 0) * p.st_slot + c * p.st_ch;
  T v[K];  // window positions t .. t + K - 1
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int pos = t + k;
    if (pos < K - 1) {
      v[k] = ok ? st[pos * p.st_el] : from_f<T>(0.f);
    } else {
      v[k] = qkv[(static_cast<int64_t>(l) * p.n + pos - (K - 1)) * p.qkv_row];
    }
  }
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) acc = fmaf(to_f(weight[c * p.w_ch + k * p.w_el]), to_f(v[k]), acc);
  const float y = round_to<T>(acc);
  static_cast<T*>(p.out)[(static_cast<int64_t>(l) * p.n + t) * p.channels + c] = from_f<T>(y / (1.f + expf(-y)));
  windows[(K - 1 + t) * p.win_el] = v[K - 1];
  if (t == 0) {
#pragma unroll
    for (int k = 0; k < K - 1; ++k) windows[k * p.win_el] = v[k];
  }
}

struct NormRopeParams {
  const void* q;  // [rows, heads, hd]
  int64_t q_row, q_head, q_el;
  const void* k;  // [rows, kv_heads, hd]
  int64_t k_row, k_head, k_el;
  const void* v;  // [rows, kv_heads, hd]
  int64_t v_row, v_head, v_el;
  const float* wq;  // [hd] 1 + q_norm weight
  const float* wk;  // [hd] 1 + k_norm weight
  const void* cos;  // [rows, rot]
  const void* sin;
  int64_t cs_row, cs_el, sn_row, sn_el;
  const int64_t* pos;    // [rows]
  const int64_t* slots;  // [lanes]
  void* kc;              // [S, cap, kv_heads, hd]
  void* vc;
  int64_t kc_slot, kc_pos, kc_head, kc_el, vc_slot, vc_pos, vc_head, vc_el;
  void* q_out;  // [rows, heads, hd] contiguous
  int rows, n, heads, kv_heads, hd, rot, num_slots;
  int64_t capacity;
  float eps;
};

template <typename T, bool NORM = true>
__global__ void __launch_bounds__(kNormWarps * 32) qk_norm_rope_kv_kernel(NormRopeParams p) {
  extern __shared__ float smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t group = static_cast<int64_t>(blockIdx.x) * kNormWarps + warp;
  const int groups_per_row = p.heads + p.kv_heads;
  if (group >= static_cast<int64_t>(p.rows) * groups_per_row) return;
  const int row = static_cast<int>(group / groups_per_row);
  const int head = static_cast<int>(group % groups_per_row);
  const bool is_q = head < p.heads;
  const int kh = head - p.heads;
  const T* src;
  int64_t el;
  const float* w1p;
  if (is_q) {
    src = static_cast<const T*>(p.q) + row * p.q_row + head * p.q_head;
    el = p.q_el;
    w1p = p.wq;
  } else {
    src = static_cast<const T*>(p.k) + row * p.k_row + kh * p.k_head;
    el = p.k_el;
    w1p = p.wk;
  }
  float* y = smem + warp * p.hd;
  if constexpr (NORM) {
    float acc = 0.f;
    for (int e = lane; e < p.hd; e += 32) {
      const float x = to_f(src[e * el]);
      acc = fmaf(x, x, acc);
    }
#pragma unroll
    for (int width = 16; width; width >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, width);
    const float r = rsqrtf(acc / static_cast<float>(p.hd) + p.eps);
    for (int e = lane; e < p.hd; e += 32) {
      y[e] = round_to<T>(__fmul_rn(__fmul_rn(to_f(src[e * el]), r), w1p[e]));
    }
  } else {
    for (int e = lane; e < p.hd; e += 32) y[e] = to_f(src[e * el]);
  }
  __syncwarp();
  const T* cs = static_cast<const T*>(p.cos) + row * p.cs_row;
  const T* sn = static_cast<const T*>(p.sin) + row * p.sn_row;
  const int half = p.rot / 2;
  T* dst;
  int64_t dst_el;
  bool write = true;
  if (is_q) {
    dst = static_cast<T*>(p.q_out) + (static_cast<int64_t>(row) * p.heads + head) * p.hd;
    dst_el = 1;
  } else {
    const int64_t slot = p.slots[row / p.n], at = p.pos[row];
    write = slot >= 0 && slot < p.num_slots && at >= 0 && at < p.capacity;  // out of range: dropped
    dst = static_cast<T*>(p.kc) + (write ? slot * p.kc_slot + at * p.kc_pos + kh * p.kc_head : 0);
    dst_el = p.kc_el;
    if (write) {
      const T* vs = static_cast<const T*>(p.v) + row * p.v_row + kh * p.v_head;
      T* vd = static_cast<T*>(p.vc) + slot * p.vc_slot + at * p.vc_pos + kh * p.vc_head;
      for (int e = lane; e < p.hd; e += 32) vd[e * p.vc_el] = vs[e * p.v_el];
    }
  }
  if (!write) return;
  for (int e = lane; e < p.hd; e += 32) {
    float o = y[e];
    if (e < p.rot) {
      const float rotated = e < half ? -y[e + half] : y[e - half];
      const float a = round_to<T>(__fmul_rn(o, to_f(cs[e * p.cs_el])));
      const float b = round_to<T>(__fmul_rn(rotated, to_f(sn[e * p.sn_el])));
      o = __fadd_rn(a, b);
    }
    dst[e * dst_el] = from_f<T>(o);
  }
}

}  // namespace ignis_mixers
