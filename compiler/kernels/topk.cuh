// Exact, deterministic top-k over the last dimension of a [rows, V] tensor (float32, bf16, f16).
//
// Order: values descending, equal values by ascending index; NaN ranks above +inf (all NaNs equal,
// so by index), -0.0 equals +0.0. This is `torch.sort(x, dim=-1, descending=True, stable=True)`
// cut to k columns. Every element gets a unique 64-bit key
//     key = ord(value) << 32 | (0xFFFFFFFF - index)
// where ord() maps the float32 value (bf16 / f16 widened exactly) to an unsigned integer with the
// same order (NaN -> 0xFFFFFFFF, +-0 -> 0x80000000); key 0 is below every element (padding).
// The top k keys, descending, are the answer. A CPU model of both kernels, index arithmetic and
// sorting network included, is `ignis.compiler.kernels.topk.topk_emulated`.
//
// Two kernels (host side and argument checks: topk_ffi.cuh):
//  1. topk_group_max_kernel: the row is cut into groups of kGroup = 128 elements (lane `l` of the
//     warp that owns tile `t` of 32 * kGroup elements takes the 16-byte vectors l, l + 32, ... of
//     that tile); each lane writes its group's largest key to the workspace [rows, M], M = 32 *
//     tiles. Memory bound: every element is read once, with 16-byte loads.
//  2. topk_select_kernel (one block per row): sorts the M group maxima (bitonic, shared memory);
//     T = the k-th largest. Every element of the top k lies in one of the k groups whose maxima
//     rank first (an element whose group maximum ranks below k has k larger elements), and is >= T
//     (the k largest maxima are k elements >= T). So the block scans those k groups only (k * 128
//     elements at most), keeps the keys >= T (at most k * 128 of them), sorts them and writes the
//     first k. Keys are unique, so the result does not depend on the order in which candidates
//     are appended: it is deterministic.
// Limits: 1 <= k <= kMaxK = 64 (k * kGroup candidates fit the 64 KiB buffer), k <= V,
// M <= kCap = 8192 (V <= 1,048,576).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "dtypes.cuh"

namespace ignis_topk {

constexpr int kGroup = 128;           // elements per group (per lane of kernel 1)
constexpr int kTile = 32 * kGroup;    // elements per warp tile
constexpr int kMaxK = 64;
constexpr int kCap = 8192;            // keys in kernel 2's shared buffer (64 KiB)
constexpr int kWarps1 = 4;            // warps per block of kernel 1
constexpr int kThreads2 = 1024;       // threads of kernel 2

using ignis_dtypes::to_f;

// Order-preserving map float -> u32: NaN above +inf, -0 == +0, 0 never returned.
__device__ __forceinline__ uint32_t ord_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t mag = u & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0xffffffffu;  // any NaN
  if (mag == 0u) return 0x80000000u;          // +0 and -0
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t make_key(uint32_t ord, uint32_t index) {
  return (static_cast<uint64_t>(ord) << 32) | static_cast<uint64_t>(~index);
}

__device__ __forceinline__ uint32_t key_index(uint64_t key) {
  return ~static_cast<uint32_t>(key & 0xffffffffull);
}

// Group of element `i` and the e-th element of group g (e in 0..kGroup-1); EV elements per vector.
template <int EV>
__device__ __forceinline__ int64_t group_of(int64_t i) {
  const int64_t tile = i / kTile, r = i % kTile;
  return tile * 32 + (r % (32 * EV)) / EV;
}
template <int EV>
__device__ __forceinline__ int64_t element_of(int64_t g, int e) {
  const int64_t tile = g / 32;
  const int lane = static_cast<int>(g % 32);
  return tile * kTile + static_cast<int64_t>(e / EV) * (32 * EV) + lane * EV + (e % EV);
}

template <typename T>
struct VecOf {
  static constexpr int EV = 16 / sizeof(T);
};

template <typename T>
__global__ void __launch_bounds__(kWarps1 * 32)
    topk_group_max_kernel(const T* __restrict__ x, int64_t vocab, int tiles, uint64_t* __restrict__ gm,
                          bool vec_ok) {
  constexpr int EV = VecOf<T>::EV;
  constexpr int Q = kGroup / EV;  // 16-byte vectors per lane
  const int64_t row = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int tile = blockIdx.x * kWarps1 + warp;
  if (tile >= tiles) return;
  const T* xr = x + row * vocab;
  const int64_t base = static_cast<int64_t>(tile) * kTile + lane * EV;
  uint32_t best = 0u, best_idx = 0u;  // strict '>' in ascending index order: ties keep the first
  constexpr int B = Q;                // vectors in flight per lane: the whole group, one round trip
#pragma unroll 1
  for (int j0 = 0; j0 < Q; j0 += B) {
    uint4 buf[B];
    bool full[B];
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int64_t i0 = base + static_cast<int64_t>(j0 + b) * (32 * EV);
      full[b] = vec_ok && i0 + EV <= vocab;
      if (full[b]) buf[b] = __ldg(reinterpret_cast<const uint4*>(xr + i0));
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int64_t i0 = base + static_cast<int64_t>(j0 + b) * (32 * EV);
      if (full[b]) {
        const T* v = reinterpret_cast<const T*>(&buf[b]);
#pragma unroll
        for (int c = 0; c < EV; ++c) {
          const uint32_t o = ord_bits(to_f(v[c]));
          if (o > best) {
            best = o;
            best_idx = static_cast<uint32_t>(i0 + c);
          }
        }
      } else {
        for (int c = 0; c < EV; ++c) {
          const int64_t i = i0 + c;
          if (i < vocab) {
            const uint32_t o = ord_bits(to_f(xr[i]));
            if (o > best) {
              best = o;
              best_idx = static_cast<uint32_t>(i);
            }
          }
        }
      }
    }
  }
  gm[row * (static_cast<int64_t>(tiles) * 32) + static_cast<int64_t>(tile) * 32 + lane] =
      best ? make_key(best, best_idx) : 0ull;
}

__device__ __forceinline__ int next_pow2(int n) {
  int p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Sort s[0..n) descending (n a power of two), all threads of the block taking part.
__device__ __forceinline__ void bitonic_sort_desc(uint64_t* s, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < (n >> 1); t += blockDim.x) {
        const int i = 2 * t - (t & (stride - 1));
        const int j = i + stride;
        const bool desc = (i & size) == 0;
        const uint64_t a = s[i], b = s[j];
        if ((a < b) == desc) {
          s[i] = b;
          s[j] = a;
        }
      }
      __syncthreads();
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads2)
    topk_select_kernel(const T* __restrict__ x, int64_t vocab, int tiles, const uint64_t* __restrict__ gm,
                       int k, T* __restrict__ values, int64_t* __restrict__ indices) {
  constexpr int EV = VecOf<T>::EV;
  extern __shared__ uint64_t s_keys[];  // kCap keys
  __shared__ int64_t s_sel[kMaxK];
  __shared__ int s_count;
  const int64_t row = blockIdx.x;
  const T* xr = x + row * vocab;
  const int m = tiles * 32;
  const int p1 = next_pow2(m < 2 ? 2 : m);
  for (int i = threadIdx.x; i < p1; i += blockDim.x) s_keys[i] = i < m ? gm[row * m + i] : 0ull;
  __syncthreads();
  bitonic_sort_desc(s_keys, p1);
  const uint64_t thresh = m >= k ? s_keys[k - 1] : 0ull;
  const int nsel = m < k ? m : k;
  if (threadIdx.x < nsel) {
    const uint64_t key = s_keys[threadIdx.x];
    s_sel[threadIdx.x] = key ? group_of<EV>(key_index(key)) : -1;
  }
  if (threadIdx.x == 0) s_count = 0;
  __syncthreads();  // everyone has read thresh: s_keys may now take candidates
  for (int p = threadIdx.x; p < nsel * kGroup; p += blockDim.x) {
    const int64_t g = s_sel[p / kGroup];
    if (g < 0) continue;
    const int64_t i = element_of<EV>(g, p % kGroup);
    if (i >= vocab) continue;
    const uint64_t key = make_key(ord_bits(to_f(xr[i])), static_cast<uint32_t>(i));
    if (key >= thresh) s_keys[atomicAdd(&s_count, 1)] = key;
  }
  __syncthreads();
  const int n = s_count;
  const int p2 = next_pow2(n < 2 ? 2 : n);
  for (int i = n + threadIdx.x; i < p2; i += blockDim.x) s_keys[i] = 0ull;
  __syncthreads();
  bitonic_sort_desc(s_keys, p2);
  for (int t = threadIdx.x; t < k; t += blockDim.x) {
    const uint32_t idx = key_index(s_keys[t]);
    indices[row * k + t] = static_cast<int64_t>(idx);
    values[row * k + t] = xr[idx];
  }
}

}  // namespace ignis_topk
