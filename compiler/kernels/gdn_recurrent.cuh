// Fused Gated DeltaNet recurrence for verify rounds: every column of a round in one launch, the
// recurrent state kept in registers across the columns, the state after every column written to the
// round's record buffer.
//
// Algorithm: the gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025,
// arXiv:2412.06464, eq. 10), in the state layout of HF / FLA (S is [k_dim, v_dim], a read is k^T S):
//
//     q_t = l2norm(q_t) * k_dim^-0.5,  k_t = l2norm(k_t)     (float32, eps 1e-6 inside the sqrt)
//     beta_t = sigmoid(b_t)             (float32, rounded to the input dtype as torch does)
//     g_t = -exp(A_log) * softplus(a_t + dt_bias)            (float32; softplus threshold 20)
//     S'  = exp(g_t) S_{t-1};  delta = beta_t (v_t - S'^T k_t);  S_t = S' + k_t delta^T
//     o_t = S_t^T q_t
//
// with value head h reading key head h / (v_heads / k_heads) (GQA repeat, no copy). The same math as
// `ignis.runtime.families.gated_deltanet.gated_delta_rule_recurrent` after the torch preparation in
// `StaticHybridExecutor._static_gdn`; a CPU model of this kernel (same blocking, same reduction
// order) is `ignis.compiler.kernels.gdn_recurrent.gdn_recurrent_emulated`.
//
// Blocking: one block of kWarps warps per (lane, value head, tile of kCols value columns). Lane `l`
// of every warp owns value column tile * kCols + l; warp w owns key rows w*R .. w*R + R - 1, so each
// thread keeps R float32 state elements in registers for the whole round. Per column: S'^T k and
// S_t^T q are per-thread partial sums over the thread's R rows (ascending), then the kWarps partials
// summed in warp order through shared memory (deterministic). The round's q/k/v/b/a are staged in
// shared memory kChunk columns at a time (loads in parallel, l2 norms one warp per column), so the
// sequential part touches only registers and shared memory; every state write is a 128-byte row
// segment per warp.
// Limits: k_dim <= kWarps * 32 = 256 (R = 2, 4, 8, 16 or 32 picked by the host side).
//
// Modes (template MODE):
// * kModeRecord: the state after every column is written to the round's record buffer
//   (record[t, lane], 4 * k_dim * v_dim bytes a head and column: at 8 columns and more the kernel
//   is bound by these writes, which is why kModeStash exists).
// * kModeStash: the round writes no state at all; it writes what the recurrence consumed of each
//   column -- the normalized k of every key head, v, beta and the decay exp(g) of every value head,
//   float32 -- into a stash row (stash layout below, ~33 KB a column for the 27B shape instead of
//   3 MB), and the commit replays the kept columns from it (kModeReplay).
// * kModeReplay: per (layer, lane) the first keep[lane] columns of the stash are run from the
//   lane's state and the state after the last is written back in place; no q, no output. The
//   staging reads the stash's floats instead of preparing them, and the per-column update is the
//   same code as the round's, so the state equals, bit for bit, the state after that column in
//   kModeRecord (and what feeding the kept tokens alone gives).
// Stash row (W = hk * k_dim + hv * v_dim + 2 * hv floats): [0, hk k_dim) k of key head kh at
// kh * k_dim; then v of value head h at hk k_dim + h v_dim; then beta[hv]; then alpha[hv].
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "dtypes.cuh"

namespace ignis_gdn {

constexpr int kWarps = 8;        // warps per block
constexpr int kCols = 32;        // value columns per block (one per lane)
constexpr int kChunk = 16;       // round columns staged in shared memory at a time
constexpr int kMaxKeyDim = 256;  // kWarps * the largest R
constexpr float kL2Eps = 1e-6f;
constexpr int kModeRecord = 0;
constexpr int kModeStash = 1;
constexpr int kModeReplay = 2;

using ignis_dtypes::from_f;
using ignis_dtypes::to_f;

struct Params {
  const void* mixed;  // [lanes, n, conv_dim] (strided): q | k | v channels after conv + SiLU
  int64_t m_lane, m_col, m_ch;
  const void* b;  // [lanes, n, v_heads] (strided), mixed's dtype
  int64_t b_lane, b_col, b_head;
  const void* a;  // [lanes, n, v_heads] (strided), mixed's dtype
  int64_t a_lane, a_col, a_head;
  const float* neg_a;    // [v_heads]: -exp(A_log)
  const float* dt_bias;  // [v_heads]
  const float* state;    // [slots, v_heads, k_dim, v_dim], inner three dims contiguous (kModeReplay
                         // writes it in place, through a const_cast)
  int64_t st_slot;
  int64_t num_slots;
  const int64_t* slots;  // [lanes]
  float* record;         // [>= n, >= lanes, v_heads, k_dim, v_dim], inner three dims contiguous
  int64_t rec_col, rec_lane;
  void* out;  // [lanes, n, v_heads, v_dim] contiguous, float32 or mixed's dtype
  bool out_f32;
  int lanes, n, hk, hv, dk, dv;
  float scale;
  // kModeStash (written) / kModeReplay (read): rows of W floats (layout above) at
  // stash + t * sh_col + lane * sh_lane (+ layer * sh_layer in replay).
  float* stash;
  int64_t sh_col, sh_lane, sh_layer;
  // kModeReplay: columns to replay and the lane's index in the stash, per lane ([lanes] int64,
  // device memory); the state is written in place (layer g's at state + g * st_layer). n is the
  // stash's column count (keep is clamped to 0..n) and stash_lanes its lane count (a pos outside
  // is skipped).
  const int64_t* keep;
  const int64_t* pos;
  int64_t st_layer;
  int stash_lanes;
};

template <typename T, int R, int MODE>
__global__ void __launch_bounds__(kWarps * 32) gdn_recurrent_kernel(const Params p) {
  constexpr bool kReplay = MODE == kModeReplay;
  constexpr int DK = kWarps * R;  // padded key rows
  __shared__ float sq[kChunk][DK];
  __shared__ float sk[kChunk][DK];
  __shared__ float sv[kChunk][kCols];
  __shared__ float sbeta[kChunk];
  __shared__ float salpha[kChunk];
  __shared__ float red[2][kWarps][kCols];

  const int tiles = (p.dv + kCols - 1) / kCols;
  const int tile = blockIdx.x % tiles;
  const int h = (blockIdx.x / tiles) % p.hv;
  const int li = blockIdx.x / (tiles * p.hv);
  const int warp = threadIdx.x / 32, lid = threadIdx.x % 32;
  const int j = tile * kCols + lid;
  const bool jok = j < p.dv;
  const int kh = h / (p.hv / p.hk);
  const int64_t slot = p.slots[li];
  if (slot < 0 || slot >= p.num_slots) return;  // the whole block: no barrier is left waiting
  const int64_t head = static_cast<int64_t>(p.dk) * p.dv;
  int n = p.n;        // columns this lane runs
  int64_t si = li;    // the lane's index in the stash
  const int layer = kReplay ? static_cast<int>(blockIdx.y) : 0;
  if constexpr (kReplay) {
    const int64_t keep = p.keep[li];
    si = p.pos[li];
    if (keep <= 0 || si < 0 || si >= p.stash_lanes) return;
    n = static_cast<int>(keep < p.n ? keep : p.n);
  }
  const int64_t hk_dk = static_cast<int64_t>(p.hk) * p.dk;
  const int64_t w_v = hk_dk, w_beta = hk_dk + static_cast<int64_t>(p.hv) * p.dv, w_alpha = w_beta + p.hv;
  float* stash = p.stash + (MODE == kModeRecord ? 0 : layer * p.sh_layer + si * p.sh_lane);

  float s[R];
  float* s0 = const_cast<float*>(p.state) + layer * p.st_layer + slot * p.st_slot + h * head;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = warp * R + r;
    s[r] = (jok && i < p.dk) ? s0[static_cast<int64_t>(i) * p.dv + j] : 0.f;
  }

  const T* mixed = static_cast<const T*>(p.mixed) + li * p.m_lane;
  const T* bp = static_cast<const T*>(p.b) + li * p.b_lane + h * p.b_head;
  const T* ap = static_cast<const T*>(p.a) + li * p.a_lane + h * p.a_head;
  const int64_t qoff = static_cast<int64_t>(kh) * p.dk;
  const int64_t koff = static_cast<int64_t>(p.hk + kh) * p.dk;
  const int64_t voff = 2 * static_cast<int64_t>(p.hk) * p.dk + static_cast<int64_t>(h) * p.dv + tile * kCols;
  const float neg_a = kReplay ? 0.f : p.neg_a[h], dt_bias = kReplay ? 0.f : p.dt_bias[h];

  const int rep = p.hv / p.hk;
  for (int c0 = 0; c0 < n; c0 += kChunk) {
    const int nc = min(kChunk, n - c0);
    __syncthreads();  // the previous chunk is consumed
    if constexpr (kReplay) {  // the round's floats, as it consumed them
      for (int e = threadIdx.x; e < nc * DK; e += blockDim.x) {
        const int c = e / DK, i = e % DK;
        sk[c][i] = i < p.dk ? stash[(c0 + c) * p.sh_col + static_cast<int64_t>(kh) * p.dk + i] : 0.f;
      }
      for (int e = threadIdx.x; e < nc * kCols; e += blockDim.x) {
        const int c = e / kCols, jj = e % kCols;
        const int64_t at = (c0 + c) * p.sh_col + w_v + static_cast<int64_t>(h) * p.dv + tile * kCols + jj;
        sv[c][jj] = (tile * kCols + jj < p.dv) ? stash[at] : 0.f;
      }
      if (threadIdx.x < nc) {
        const int64_t row = (c0 + threadIdx.x) * p.sh_col;
        sbeta[threadIdx.x] = stash[row + w_beta + h];
        salpha[threadIdx.x] = stash[row + w_alpha + h];
      }
      __syncthreads();
    } else {
      for (int e = threadIdx.x; e < nc * DK; e += blockDim.x) {
        const int c = e / DK, i = e % DK;
        const T* row = mixed + static_cast<int64_t>(c0 + c) * p.m_col;
        const bool ok = i < p.dk;
        sq[c][i] = ok ? to_f(row[(qoff + i) * p.m_ch]) : 0.f;
        sk[c][i] = ok ? to_f(row[(koff + i) * p.m_ch]) : 0.f;
      }
      for (int e = threadIdx.x; e < nc * kCols; e += blockDim.x) {
        const int c = e / kCols, jj = e % kCols;
        const T* row = mixed + static_cast<int64_t>(c0 + c) * p.m_col;
        sv[c][jj] = (tile * kCols + jj < p.dv) ? to_f(row[(voff + jj) * p.m_ch]) : 0.f;
      }
      if (threadIdx.x < nc) {
        const int64_t t = c0 + threadIdx.x;
        const float bx = to_f(bp[t * p.b_col]);
        sbeta[threadIdx.x] = to_f(from_f<T>(1.f / (1.f + expf(-bx))));  // sigmoid in T, as torch
        const float ax = to_f(ap[t * p.a_col]) + dt_bias;
        const float sp = ax > 20.f ? ax : log1pf(expf(ax));  // F.softplus (threshold 20)
        salpha[threadIdx.x] = expf(neg_a * sp);
      }
      __syncthreads();
      for (int c = warp; c < nc; c += kWarps) {  // l2 norms: one warp per column
        float aq = 0.f, ak = 0.f;
        for (int i = lid; i < DK; i += 32) {
          aq = fmaf(sq[c][i], sq[c][i], aq);
          ak = fmaf(sk[c][i], sk[c][i], ak);
        }
  #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          aq += __shfl_xor_sync(0xffffffffu, aq, o);
          ak += __shfl_xor_sync(0xffffffffu, ak, o);
        }
        const float rq = rsqrtf(aq + kL2Eps), rk = rsqrtf(ak + kL2Eps);
        for (int i = lid; i < DK; i += 32) {
          sq[c][i] = (sq[c][i] * rq) * p.scale;
          sk[c][i] = sk[c][i] * rk;
        }
      }
      __syncthreads();
      if constexpr (MODE == kModeStash) {  // what the recurrence consumes of each column
        for (int e = threadIdx.x; e < nc * kCols; e += blockDim.x) {
          const int c = e / kCols, jj = e % kCols;
          if (tile * kCols + jj < p.dv)
            stash[(c0 + c) * p.sh_col + w_v + static_cast<int64_t>(h) * p.dv + tile * kCols + jj] = sv[c][jj];
        }
        if (tile == 0) {
          if (h % rep == 0) {  // one block per key head writes its k
            for (int e = threadIdx.x; e < nc * p.dk; e += blockDim.x) {
              const int c = e / p.dk, i = e % p.dk;
              stash[(c0 + c) * p.sh_col + static_cast<int64_t>(kh) * p.dk + i] = sk[c][i];
            }
          }
          if (threadIdx.x < nc) {
            const int64_t row = (c0 + threadIdx.x) * p.sh_col;
            stash[row + w_beta + h] = sbeta[threadIdx.x];
            stash[row + w_alpha + h] = salpha[threadIdx.x];
          }
        }
      }
    }
    for (int c = 0; c < nc; ++c) {
      const int64_t t = c0 + c;
      const float alpha = salpha[c], beta = sbeta[c];
      float part = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        s[r] *= alpha;
        part = fmaf(s[r], sk[c][warp * R + r], part);
      }
      // replay: one barrier a column, the partials' buffer alternating (a warp still reading
      // column c's buffer is behind column c + 1's barrier before it is written again)
      float(&kv_red)[kWarps][kCols] = red[kReplay ? (c & 1) : 0];
      kv_red[warp][lid] = part;
      __syncthreads();
      float kv = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) kv += kv_red[w][lid];
      const float delta = (sv[c][lid] - kv) * beta;
      if constexpr (kReplay) {
#pragma unroll
        for (int r = 0; r < R; ++r) s[r] = fmaf(sk[c][warp * R + r], delta, s[r]);
        continue;
      }
      float* rec = p.record + t * p.rec_col + li * p.rec_lane + h * head;
      float po = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int i = warp * R + r;
        s[r] = fmaf(sk[c][i], delta, s[r]);
        if (MODE == kModeRecord && jok && i < p.dk) rec[static_cast<int64_t>(i) * p.dv + j] = s[r];
        po = fmaf(s[r], sq[c][i], po);
      }
      red[1][warp][lid] = po;
      __syncthreads();
      if (warp == 0 && jok) {
        float o = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) o += red[1][w][lid];
        const int64_t at = ((static_cast<int64_t>(li) * p.n + t) * p.hv + h) * p.dv + j;
        if (p.out_f32) {
          static_cast<float*>(p.out)[at] = o;
        } else {
          static_cast<T*>(p.out)[at] = from_f<T>(o);
        }
      }
    }
  }
  if constexpr (kReplay) {  // the state after the last kept column, in place
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = warp * R + r;
      if (jok && i < p.dk) s0[static_cast<int64_t>(i) * p.dv + j] = s[r];
    }
  }
}

}  // namespace ignis_gdn
