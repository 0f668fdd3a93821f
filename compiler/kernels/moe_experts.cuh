// Grouped q4_g32 routed-expert linears of the sparse MoE block, for decode-sized rounds: one launch
// runs every (row, choice) pair of a round against the expert slot it was routed to (what llama.cpp's
// mul_mat_id / MMVQ and vLLM's fused_moe do for few rows), instead of one launch per expert and a
// host sync to find which rows chose it.
//
//   pair p = r * top_k + j, slot s = ids[p] (int32; s < 0 or s >= slots: the pair is skipped and its
//   output left untouched -- an expert cache runs the pairs of the experts resident now and masks the
//   others)
//   gate_up:  y[p, n] = round_T( sum_i x[r, i] * W_s[n, i] )                       y: T   [pairs, N]
//   down:     y[p, n] = route_w[p] * sum_i a[p, i] * W_s[n, i]                     y: f32 [pairs, N]
//             a[p, i] = x[p, i]                                 (x [pairs, K]), or with swiglu
//             a[p, i] = round_T(round_T(silu(x[p, i])) * x[p, K + i])  (x [pairs, 2K] = [gate | up],
//             torch's F.silu(gate) * up in the model dtype: silu(v) = v / (1 + exp(-v)) in float32)
//
// W_s is slot s of a row-major q4_g32 stack: packed [slots, N, K/8] u32 (nibble j of word c = code of
// input 8c + j, low nibble first) and scales [slots, N, K/32] f16; W[n, i] = (code - 8) * scale[n,
// i / 32] (ignis.runtime.linear.dequantize_q4), exact in float32. Sums are float32: per 32-input
// group a lane's FMA chain over the group's inputs in order, times the group's scale, added into the
// lane's accumulator; lanes hold groups lane, lane + 32, ...; the 32 lane sums are added by an
// xor-shuffle tree. The order depends only on K: a pair's result does not depend on the other pairs
// of the launch (bit for bit the same when the pairs are run in several masked launches).
//
// Grid: x = pairs, y = N / kTileRows tiles; block kThreads. The block of pair p first checks whether
// an earlier pair has the same slot (then it exits: that block does the work), else it gathers every
// later pair of its slot (ascending) -- so each slot's weights are streamed once per launch however
// many rows chose it (a slot with more members than MAXM runs as several chunks over the weights).
// Its members' activation rows are staged in shared memory as float32, MAXM <= kMaxStageRows rows at
// a time, groups of 32 padded to kGroupStride floats so the lanes' float4 reads are free of bank
// conflicts; each warp streams kRowsPerWarp weight rows of the tile, one 16-byte load (one group)
// per row per lane per step.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "dtypes.cuh"

namespace ignis_moe {

using ignis_dtypes::from_f;
using ignis_dtypes::round_to;
using ignis_dtypes::to_f;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = 4;                     // weight rows a warp streams at once
constexpr int kTileRows = kWarps * kRowsPerWarp;    // weight rows (outputs) per block: 32
constexpr int kMaxPairs = 1024;                     // most pairs (rows x top_k) one launch takes
constexpr int kGroupStride = 36;                    // floats per staged group of 32 inputs (+4 padding)
constexpr int kMaxStageBytes = 64 * 1024;           // most shared memory for the staged activations
constexpr int kMaxStageRows = 4;                    // most activation rows staged (and summed) at once

struct Params {
  const void* x;          // activations, model dtype T
  int64_t x_row;          // elements between consecutive activation rows
  int x_div;              // pairs per activation row: top_k (gate_up, x [rows, K]); 1 (down)
  int swiglu;             // down: activation row = [gate (K) | up (K)]
  const int32_t* ids;     // [pairs]
  int pairs;
  const uint32_t* packed; // [slots, n, k / 8]
  const __half* scales;   // [slots, n, k / 32]
  int slots;
  int n;
  int k;
  const float* route_w;   // down: [pairs] float32; gate_up: unused
  void* y;                // gate_up: T [pairs, n]; down: float [pairs, n]
};

// (code - 8) of nibble j of w as float32, exactly: the code is put in the mantissa of 2^23 (a float
// whose last 4 mantissa bits are the code) and 2^23 + 8 is subtracted (both exact).
__device__ __forceinline__ float q4_minus8(uint32_t w, int j) {
  return __uint_as_float(((w >> (4 * j)) & 0xFu) | 0x4B000000u) - 8388616.0f;
}

__device__ __forceinline__ float silu_f(float v) { return v / (1.0f + expf(-v)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T, int MAXM, bool DOWN>
__global__ void __launch_bounds__(kThreads) moe_q4_kernel(Params p) {
  extern __shared__ float4 stage4[];  // [MAXM][k / 32][kGroupStride] float32
  float* stage = reinterpret_cast<float*>(stage4);
  __shared__ int members[kMaxPairs];
  __shared__ int warp_counts[kWarps];

  const int pair = blockIdx.x;
  const int slot = p.ids[pair];
  if (slot < 0 || slot >= p.slots) return;  // (block-uniform)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // an earlier pair with this slot does the work
  int earlier = 0;
  for (int q = tid; q < pair; q += kThreads) earlier |= (p.ids[q] == slot) ? 1 : 0;
  if (__syncthreads_or(earlier)) return;

  // members: this pair and every later one with the same slot, ascending
  int count = 0;
  for (int base = pair; base < p.pairs; base += kThreads) {
    const int q = base + tid;
    const bool hit = q < p.pairs && p.ids[q] == slot;
    const unsigned ballot = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int offset = count, total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int c = warp_counts[w];
      offset += w < warp ? c : 0;
      total += c;
    }
    offset += __popc(ballot & ((1u << lane) - 1u));
    if (hit) members[offset] = q;
    __syncthreads();  // warp_counts is rewritten by the next step
    count += total;
  }

  const int groups = p.k >> 5;
  const int words = p.k >> 3;
  const int n0 = blockIdx.y * kTileRows + warp * kRowsPerWarp;
  const size_t slot_row = static_cast<size_t>(slot) * static_cast<size_t>(p.n);
  const T* x = static_cast<const T*>(p.x);

  for (int c0 = 0; c0 < count; c0 += MAXM) {
    const int mc = min(MAXM, count - c0);
    __syncthreads();  // the previous chunk's reads of the stage are done
    for (int idx = tid; idx < mc * p.k; idx += kThreads) {
      const int m = idx / p.k;
      const int i = idx - m * p.k;
      const int q = members[c0 + m];
      float v;
      if (DOWN && p.swiglu) {
        const T* row = x + static_cast<int64_t>(q) * p.x_row;
        const float g = round_to<T>(silu_f(to_f(row[i])));
        v = round_to<T>(g * to_f(row[p.k + i]));
      } else {
        v = to_f(x[static_cast<int64_t>(q / p.x_div) * p.x_row + i]);
      }
      stage[(m * groups + (i >> 5)) * kGroupStride + (i & 31)] = v;
    }
    __syncthreads();

    float acc[MAXM][kRowsPerWarp];
#pragma unroll
    for (int m = 0; m < MAXM; ++m) {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) acc[m][r] = 0.0f;
    }
    for (int g = lane; g < groups; g += 32) {
      uint4 wv[kRowsPerWarp];
      float sc[kRowsPerWarp];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int n = n0 + r;
        if (n < p.n) {
          const size_t row = slot_row + static_cast<size_t>(n);
          wv[r] = __ldg(reinterpret_cast<const uint4*>(p.packed + row * static_cast<size_t>(words)) + g);
          sc[r] = __half2float(p.scales[row * static_cast<size_t>(groups) + g]);
        } else {
          wv[r] = make_uint4(0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u);  // codes 8: zeros
          sc[r] = 0.0f;
        }
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        float part[MAXM];
#pragma unroll
        for (int m = 0; m < MAXM; ++m) part[m] = 0.0f;
        const uint32_t wr[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float wf[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) wf[j] = q4_minus8(wr[c], j);
#pragma unroll
          for (int m = 0; m < MAXM; ++m) {
            if (m < mc) {
              const float4* xg = reinterpret_cast<const float4*>(stage + (m * groups + g) * kGroupStride) + 2 * c;
              const float4 a = xg[0], b = xg[1];
              float s = part[m];
              s = fmaf(wf[0], a.x, s);
              s = fmaf(wf[1], a.y, s);
              s = fmaf(wf[2], a.z, s);
              s = fmaf(wf[3], a.w, s);
              s = fmaf(wf[4], b.x, s);
              s = fmaf(wf[5], b.y, s);
              s = fmaf(wf[6], b.z, s);
              s = fmaf(wf[7], b.w, s);
              part[m] = s;
            }
          }
        }
#pragma unroll
        for (int m = 0; m < MAXM; ++m) acc[m][r] = fmaf(part[m], sc[r], acc[m][r]);
      }
    }
#pragma unroll
    for (int m = 0; m < MAXM; ++m) {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float v = warp_sum(acc[m][r]);
        const int n = n0 + r;
        if (lane == m * kRowsPerWarp + r && m < mc && n < p.n) {
          const int q = members[c0 + m];
          const size_t at = static_cast<size_t>(q) * static_cast<size_t>(p.n) + static_cast<size_t>(n);
          if (DOWN) {
            static_cast<float*>(p.y)[at] = p.route_w[q] * v;
          } else {
            static_cast<T*>(p.y)[at] = from_f<T>(v);
          }
        }
      }
    }
  }
}

}  // namespace ignis_moe
