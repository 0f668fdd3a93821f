// Fused row norms of the hybrid (Qwen3.5 / Qwen3-Next) decoder layers, the dense MLP's SwiGLU
// activation and a narrow dense linear (the GDN b|a projection), for graphed verify rounds: each
// replaces a chain of small torch kernels or cuBLAS's split-K pair (graph nodes) by one launch.
// silu_mul and narrow_linear are described above their kernels below.
//
// add_rms_norm (the residual add + the (1 + w) RMSNorm, twice per layer):
//
//     h_out = round(h + d)                                   (torch's add in the model dtype)
//     x_out = round((float(h_out) * rsqrt(mean(float(h_out)^2) + eps)) * w1p)
//
// w1p = 1 + weight in float32 (precomputed); round = to the model dtype (round to nearest even),
// the identity for float32. One block of kAddThreads threads per row: thread t handles elements
// t, t + kAddThreads, ... (a strided FMA sum of squares in float32), the warp sums by an xor-shuffle
// tree, the kAddThreads / 32 warp sums added in warp order by every thread (deterministic). The
// first pass only reads (h + d, rounded, squared and summed), keeping its values and w1p in
// registers (up to kAddKeep a thread: one round trip of loads a row), the second writes h_out and
// x_out (rows wider than kAddThreads * kAddKeep recompute the sum from reloaded inputs); the
// outputs must not overlap the inputs (restrict pointers).
//
// add_rms_norm_llama (the residual add + HF LlamaRMSNorm, twice per llama / qwen2 decoder layer):
//
//     h_out = round(h + d)
//     x_out = round(float(w) * float(round(float(h_out) * rsqrt(mean(float(h_out)^2) + eps))))
//
// w [hidden] in the model dtype (HF multiplies the weight after casting the normed row back: two
// roundings, as `weight * norm(x.float()).to(dtype)`); the same kernel as add_rms_norm otherwise
// (template flag kWeightAfterRound: w is read as T, the normed value rounded before the product).
//
// gated_rms_norm (the GDN output norm, HF Qwen3_5RMSNormGated):
//
//     y   = round(float(x) * rsqrt(mean(float(x)^2) + eps))     over the last dim (head_dim)
//     out = round(float(round(float(w) * y)) * silu(float(z)))  silu(v) = v / (1 + exp(-v))
//
// One warp per (row, head): lane l handles elements l, l + 32, ...; the sum of squares is a strided
// FMA chain and an xor-shuffle tree. CPU models of all four (same order of operations):
// ignis.compiler.kernels.fused_norms.add_rms_norm_emulated / gated_rms_norm_emulated /
// silu_mul_emulated / narrow_linear_emulated.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "dtypes.cuh"
#include "pdl.cuh"

namespace ignis_norms {

constexpr int kAddThreads = 512;  // threads per row of add_rms_norm
constexpr int kGatedWarps = 8;    // (row, head) groups per block of gated_rms_norm

using ignis_dtypes::from_f;
using ignis_dtypes::round_to;
using ignis_dtypes::to_f;

using ignis_pdl::pdl_grid_trigger;
using ignis_pdl::pdl_grid_wait;


__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct AddParams {
  const void* h;  // [rows, hidden], inner dim contiguous
  int64_t h_row;
  const void* d;
  int64_t d_row;
  const float* w1p;  // [hidden] float32, 1 + weight (add_rms_norm)
  const void* w;     // [hidden] in T, the weight itself (add_rms_norm_llama)
  void* h_out;
  int64_t ho_row;
  void* x_out;
  int64_t xo_row;
  int rows;
  int hidden;
  float eps;
};

// Elements a thread keeps in registers between the two passes of add_rms_norm (hidden <= kAddThreads *
// kAddKeep, 8192): the first pass then issues all its loads (h, d and w1p) at once -- one memory
// round trip a row instead of one per few elements and a second read -- and the second pass only
// stores. Wider rows take the reloading loop. The order of the arithmetic is the same either way.
constexpr int kAddKeep = 16;

// The weight of element i as a float: w1p[i] (add_rms_norm) or the T weight w[i] (llama).
template <typename T, bool kWeightAfterRound>
__device__ __forceinline__ float add_weight(const AddParams& p, int i) {
  if constexpr (kWeightAfterRound) {
    return to_f(static_cast<const T*>(p.w)[i]);
  } else {
    return p.w1p[i];
  }
}

// x_out's element from the added value v (already rounded to T), the row's r and the weight wt.
template <typename T, bool kWeightAfterRound>
__device__ __forceinline__ T add_norm_out(float v, float r, float wt) {
  if constexpr (kWeightAfterRound) {
    return from_f<T>(wt * round_to<T>(v * r));
  } else {
    return from_f<T>((v * r) * wt);
  }
}

template <typename T, bool kWeightAfterRound = false>
__global__ void __launch_bounds__(kAddThreads) add_rms_norm_kernel(AddParams p) {
  pdl_grid_wait();
  const int row = blockIdx.x;
  const T* __restrict__ h = static_cast<const T*>(p.h) + row * p.h_row;
  const T* __restrict__ d = static_cast<const T*>(p.d) + row * p.d_row;
  T* __restrict__ ho = static_cast<T*>(p.h_out) + row * p.ho_row;
  T* __restrict__ xo = static_cast<T*>(p.x_out) + row * p.xo_row;
  const bool keep = p.hidden <= kAddThreads * kAddKeep;
  float v[kAddKeep], w[kAddKeep];
  float ss = 0.f;
  if (keep) {
    // Every load issued before any is used: indices past the row read its last element (in cache,
    // never used), so no load waits behind a predicate.
    T hv[kAddKeep], dv[kAddKeep];
#pragma unroll
    for (int j = 0; j < kAddKeep; ++j) {
      const int i = min(static_cast<int>(threadIdx.x) + j * kAddThreads, p.hidden - 1);
      hv[j] = h[i];
      dv[j] = d[i];
      w[j] = add_weight<T, kWeightAfterRound>(p, i);
    }
    pdl_grid_trigger();
#pragma unroll
    for (int j = 0; j < kAddKeep; ++j) v[j] = round_to<T>(to_f(hv[j]) + to_f(dv[j]));
#pragma unroll
    for (int j = 0; j < kAddKeep; ++j) {
      if (static_cast<int>(threadIdx.x) + j * kAddThreads < p.hidden) ss = fmaf(v[j], v[j], ss);
    }
  } else {
#pragma unroll 4
    for (int i = threadIdx.x; i < p.hidden; i += kAddThreads) {
      const float u = round_to<T>(to_f(h[i]) + to_f(d[i]));
      ss = fmaf(u, u, ss);
    }
  }
  __shared__ float part[kAddThreads / 32];
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int k = 0; k < kAddThreads / 32; ++k) total += part[k];
  const float r = rsqrtf(total / static_cast<float>(p.hidden) + p.eps);
  if (keep) {
#pragma unroll
    for (int j = 0; j < kAddKeep; ++j) {
      const int i = threadIdx.x + j * kAddThreads;
      if (i < p.hidden) {
        const T s = from_f<T>(v[j]);  // v[j] is already rounded to T: exact
        ho[i] = s;
        xo[i] = add_norm_out<T, kWeightAfterRound>(v[j], r, w[j]);
      }
    }
  } else {
#pragma unroll 4
    for (int i = threadIdx.x; i < p.hidden; i += kAddThreads) {
      const T s = from_f<T>(to_f(h[i]) + to_f(d[i]));
      ho[i] = s;
      xo[i] = add_norm_out<T, kWeightAfterRound>(to_f(s), r, add_weight<T, kWeightAfterRound>(p, i));
    }
  }
}

struct GatedParams {
  const void* x;  // [rows, heads, dim], any strides
  int64_t x_row, x_head, x_el;
  const void* z;  // [rows, heads, dim], any strides, the model dtype
  int64_t z_row, z_head, z_el;
  const void* w;  // [dim] the model dtype, contiguous
  void* out;      // [rows, heads * dim] contiguous, the model dtype
  int rows;
  int heads;
  int dim;
  float eps;
};

template <typename X, typename T>
__global__ void __launch_bounds__(kGatedWarps * 32) gated_rms_norm_kernel(GatedParams p) {
  pdl_grid_wait();
  pdl_grid_trigger();
  const int lane = threadIdx.x & 31;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kGatedWarps + (threadIdx.x >> 5);
  if (g >= static_cast<int64_t>(p.rows) * p.heads) return;
  const int64_t row = g / p.heads, head = g % p.heads;
  const X* __restrict__ x = static_cast<const X*>(p.x) + row * p.x_row + head * p.x_head;
  const T* __restrict__ z = static_cast<const T*>(p.z) + row * p.z_row + head * p.z_head;
  const T* __restrict__ w = static_cast<const T*>(p.w);
  T* __restrict__ out = static_cast<T*>(p.out) + g * p.dim;
  float ss = 0.f;
  for (int i = lane; i < p.dim; i += 32) {
    const float v = to_f(x[i * p.x_el]);
    ss = fmaf(v, v, ss);
  }
  ss = warp_sum(ss);
  const float r = rsqrtf(ss / static_cast<float>(p.dim) + p.eps);
  for (int i = lane; i < p.dim; i += 32) {
    const float y = round_to<T>(to_f(x[i * p.x_el]) * r);
    const float wy = round_to<T>(to_f(w[i]) * y);
    const float zv = to_f(z[i * p.z_el]);
    out[i] = from_f<T>(wy * (zv / (1.f + expf(-zv))));
  }
}

// silu_mul (the SwiGLU MLP's activation, HF ``act_fn(gate_proj(x)) * up_proj(x)`` on the stacked
// gate|up GEMM's output):
//
//     out[r, i] = round(float(round(silu(float(gu[r, i])))) * float(gu[r, I + i]))
//     silu(v) = v / (1 + exp(-v))                                   (ATen's silu_kernel, float32)
//
// torch's ``F.silu(gate) * up``: two elementwise kernels (graph nodes) and an intermediate tensor.
// A thread per 16 bytes of a row's elements (16-byte loads and stores when the host found the rows
// aligned, VEC; else a thread per element), grid (ceil(threads / kActThreads), rows).
constexpr int kActThreads = 256;

struct ActParams {
  const void* gu;  // [rows, 2 inter]: gate = [:, :inter], up = [:, inter:]; inner dim contiguous
  int64_t gu_row;
  void* out;  // [rows, inter], inner dim contiguous
  int64_t out_row;
  int rows;
  int inter;
};

template <typename T>
__device__ __forceinline__ float silu_mul_one(T g, T u) {
  const float gf = to_f(g);
  return round_to<T>(gf / (1.f + expf(-gf))) * to_f(u);
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(kActThreads) silu_mul_kernel(ActParams p) {
  pdl_grid_wait();
  pdl_grid_trigger();
  constexpr int E = VEC ? 16 / static_cast<int>(sizeof(T)) : 1;  // elements a thread
  const int row = blockIdx.y;
  const int i0 = (blockIdx.x * kActThreads + threadIdx.x) * E;
  if (i0 >= p.inter) return;
  const T* __restrict__ gate = static_cast<const T*>(p.gu) + row * p.gu_row;
  T* __restrict__ out = static_cast<T*>(p.out) + row * p.out_row;
  if constexpr (VEC) {  // the host checked: inter % E == 0, rows and bases 16-byte aligned
    const uint4 gv = *reinterpret_cast<const uint4*>(gate + i0);
    const uint4 uv = *reinterpret_cast<const uint4*>(gate + p.inter + i0);
    const T* g = reinterpret_cast<const T*>(&gv);
    const T* u = reinterpret_cast<const T*>(&uv);
    uint4 ov;
    T* o = reinterpret_cast<T*>(&ov);
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] = from_f<T>(silu_mul_one(g[e], u[e]));
    *reinterpret_cast<uint4*>(out + i0) = ov;
  } else {
    out[i0] = from_f<T>(silu_mul_one(gate[i0], gate[p.inter + i0]));
  }
}

// narrow_linear (a dense linear with few output features: the GDN's b|a projection, [2 v_heads,
// hidden], which cuBLAS runs as a split-K GEMM plus a reduction kernel, two graph nodes a layer):
//
//     y[r, n] = round(sum_k float(x[r, k]) * float(w[n, k]))          fp32 accumulation
//
// Block (output feature n, kLinRows rows of x): kLinThreads threads over the K dim in 16-byte
// chunks (thread t: chunks t, t + kLinThreads, ..; per row an FMA chain over the chunk's elements, k
// ascending). A thread's first kLinKeep chunks are loaded all at once -- the weight's before the
// grid wait (constant), x's after it (the previous kernel writes it) -- so a row tile costs about one
// memory round trip (a loop of dependent chunk loads was latency-bound: the perf log,
// docs/perf/log/, run 84); K past kLinThreads x kLinKeep chunks is looped. The
// per-thread sums of a row meet in an xor-shuffle tree per warp and the warp sums are added in warp
// order (deterministic).
constexpr int kLinThreads = 512;
constexpr int kLinRows = 8;  // rows of x a block
constexpr int kLinKeep = 2;  // chunks a thread loaded at once (K <= 512 x 2 x 16 bytes; more looped)

struct LinParams {
  const void* x;  // [rows, k], rows 16-byte aligned, inner dim contiguous
  int64_t x_row;
  const void* w;  // [n, k], the same
  int64_t w_row;
  void* y;  // [rows, n], inner dim contiguous
  int64_t y_row;
  int rows;
  int n;
  int k;
};

template <typename T>
__device__ __forceinline__ float dot_chunk(const uint4& a, const uint4& b, float acc) {
  constexpr int E = 16 / static_cast<int>(sizeof(T));
  const T* av = reinterpret_cast<const T*>(&a);
  const T* bv = reinterpret_cast<const T*>(&b);
#pragma unroll
  for (int e = 0; e < E; ++e) acc = fmaf(to_f(av[e]), to_f(bv[e]), acc);
  return acc;
}

template <typename T>
__global__ void __launch_bounds__(kLinThreads) narrow_linear_kernel(LinParams p) {
  constexpr int E = 16 / static_cast<int>(sizeof(T));
  const int n = blockIdx.x, r0 = blockIdx.y * kLinRows;
  const int chunks = p.k / E, tid = threadIdx.x;
  const uint4* __restrict__ w = reinterpret_cast<const uint4*>(static_cast<const T*>(p.w) + n * p.w_row);
  uint4 wk[kLinKeep];
#pragma unroll
  for (int j = 0; j < kLinKeep; ++j) {
    const int c = tid + j * kLinThreads;
    if (c < chunks) wk[j] = __ldg(w + c);
  }
  pdl_grid_wait();
  pdl_grid_trigger();
  const int nr = min(kLinRows, p.rows - r0);
  const T* __restrict__ x = static_cast<const T*>(p.x) + r0 * p.x_row;
  uint4 xk[kLinKeep][kLinRows];
#pragma unroll
  for (int j = 0; j < kLinKeep; ++j)
#pragma unroll
    for (int r = 0; r < kLinRows; ++r) {
      const int c = tid + j * kLinThreads;
      if (c < chunks && r < nr) xk[j][r] = *reinterpret_cast<const uint4*>(x + r * p.x_row + c * E);
    }
  float acc[kLinRows];
#pragma unroll
  for (int r = 0; r < kLinRows; ++r) acc[r] = 0.f;
#pragma unroll
  for (int j = 0; j < kLinKeep; ++j)
#pragma unroll
    for (int r = 0; r < kLinRows; ++r)
      if (tid + j * kLinThreads < chunks && r < nr) acc[r] = dot_chunk<T>(wk[j], xk[j][r], acc[r]);
  for (int c = tid + kLinKeep * kLinThreads; c < chunks; c += kLinThreads) {
    const uint4 wv = __ldg(w + c);
    uint4 xv[kLinRows];
#pragma unroll
    for (int r = 0; r < kLinRows; ++r)
      if (r < nr) xv[r] = *reinterpret_cast<const uint4*>(x + r * p.x_row + c * E);
#pragma unroll
    for (int r = 0; r < kLinRows; ++r)
      if (r < nr) acc[r] = dot_chunk<T>(wv, xv[r], acc[r]);
  }
  __shared__ float part[kLinThreads / 32][kLinRows];
#pragma unroll
  for (int r = 0; r < kLinRows; ++r) {
    const float v = warp_sum(acc[r]);
    if ((tid & 31) == 0) part[tid >> 5][r] = v;
  }
  __syncthreads();
  if (tid < nr) {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < kLinThreads / 32; ++q) s += part[q][tid];
    static_cast<T*>(p.y)[(r0 + tid) * p.y_row + n] = from_f<T>(s);
  }
}

}  // namespace ignis_norms
