// Gated grouped-query attention of a verify round straight from the lanes' KV caches (Qwen3.5 /
// Qwen3-Next full-attention layers): one launch per layer replaces the cache gathers, the mask,
// cuDNN's SDPA, the head permutes, the sigmoid and the gate multiply of the torch path.
//
// For lane l (cache slot slots[l]), its column c (query row r = l * n + c, position pos[r]) and
// query head hq (kv head h = hq / rep, rep = heads / kv_heads: GQA):
//
//     s[t]     = (q[r, hq, :] . K[slots[l], t, h, :]) * hd^-0.5             for t <= pos[r]
//     o[r, hq] = sum_t softmax(s)[t] * V[slots[l], t, h, :]                  (float32)
//     out[r, hq * hd + e] = round(round(o[e]) * round(sigmoid(gate[r, hq, e])))
//
// round = to the model dtype at the points the torch path rounds (SDPA's output, torch.sigmoid, the
// product). Keys past pos[r] are masked (the round's later columns, stale cache rows): a column sees
// the cache as if the round's earlier columns had been committed.
//
// The algorithm is FlashAttention-2's (Dao, "FlashAttention-2", 2023, Algorithm 1: online softmax,
// P in the model dtype into the P.V product) split over the keys as flash-decoding (Dao et al.,
// "Flash-Decoding for long-context inference", 2023). A block is (key split, kv head x group of 64
// query rows, lane); its 4 warps each own 16 query rows -- the lane's rep * n rows (r' = c * rep + e)
// of that kv head -- as the mma.m16n8k16 A operand, fp32 accumulation, so the GQA heads sharing a kv
// head read its keys once. Keys and values go through shared memory 32 keys at a time (cp.async, two
// stages; rows past the split zero-filled so stale bytes never meet P = 0 as NaN * 0). A split holds
// `split_keys` keys (a multiple of 32) and its work depends only on the keys and the row's position:
// a row's result does not depend on the other lanes or columns of the round. With one split the
// block writes `out`; else each split parks its unnormalized o and (running max, sum) in the
// workspace and `gated_attention_combine_kernel` merges the splits in split order (deterministic).
//
// Ungated (GATE false: the `grouped_attention` export, llama / qwen2 attention): out = round(o), written
// with a row stride of the caller's (e.g. the front columns of a zero-padded activation buffer).
//
// Fixed: head_dim HD in {32, 64, 128, 256} (multiple of 16, the register budget of o: HD / 2 floats a
// thread), T = bf16 or f16 (mma operands).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>
#include <stdint.h>

namespace ignis_attn {

constexpr int kWarps = 4;   // warps of a block, 16 query rows each
constexpr int kRowsPerBlock = kWarps * 16;
constexpr int kChunk = 32;  // keys per shared-memory stage
constexpr int kPad = 8;     // elements of padding a shared-memory row (16 bytes): conflict-free ldmatrix

struct Params {
  const void* q;      // [rows, heads, hd] contiguous
  const void* kc;     // [S, cap, kv_heads, hd], hd contiguous
  const void* vc;     // [S, cap, kv_heads, hd], hd contiguous
  const void* gate;   // element (r, hq, e) at r * g_row + hq * g_head + e (GATE only)
  void* out;          // [rows, heads * hd], rows out_row elements apart
  int64_t out_row;
  float* ws_o;        // [L, kv_heads, splits, r_pad, hd] (splits > 1)
  float2* ws_ml;      // [L, kv_heads, splits, r_pad]: (running max in log2 units, sum) (splits > 1)
  const int64_t* pos;    // [rows]
  const int64_t* slots;  // [L]
  int64_t kc_slot, kc_pos, kc_head, vc_slot, vc_pos, vc_head;
  int64_t g_row, g_head;
  int64_t capacity;
  int64_t max_keys;  // keys 0 .. max_keys - 1 are read at most (the caller's KV bucket)
  int num_slots;
  int n, heads, kv_heads, rep;  // rows = L * n; rep * n query rows a (lane, kv head)
  int r_pad;                    // rep * n rounded up to kRowsPerBlock
  int split_keys;               // keys a split (a multiple of kChunk)
  int splits;
  float scale_log2;  // hd^-0.5 * log2(e)
};

template <typename T>
struct AttnTraits;
template <>
struct AttnTraits<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  __device__ __forceinline__ static float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
  __device__ __forceinline__ static uint32_t pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct AttnTraits<__half> {
  using T2 = __half2;
  __device__ __forceinline__ static float to_f(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half from_f(float v) { return __float2half_rn(v); }
  __device__ __forceinline__ static uint32_t pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit_group() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The torch path's gate: round(round(o) * round(sigmoid(g))), all rounds to T.
template <typename T>
__device__ __forceinline__ float gated(float o, float g) {
  using Tr = AttnTraits<T>;
  const float sg = Tr::to_f(Tr::from_f(__frcp_rn(1.f + __expf(-g))));  // == 1.f / (1 + e), rounded
  return Tr::to_f(Tr::from_f(o)) * sg;
}

// Shared memory of gated_attention_kernel<T, HD>: the block's query rows, two stages of keys and
// two of values, rows of HD + kPad elements.
template <typename T, int HD>
__host__ __device__ constexpr size_t gated_attention_smem_bytes() {
  return static_cast<size_t>(kRowsPerBlock + 4 * kChunk) * (HD + kPad) * sizeof(T);
}

// out's element: gated (the gate g) or the attention output rounded once (GATE false).
template <typename T, bool GATE>
__device__ __forceinline__ float attn_out(float o, float g) {
  if constexpr (GATE) {
    return gated<T>(o, g);
  } else {
    return o;  // rounded to T by the store
  }
}

template <typename T, int HD, bool GATE = true>
__global__ void __launch_bounds__(kWarps * 32) gated_attention_kernel(Params p) {
  static_assert(HD % 16 == 0 && HD >= 32 && HD <= 256, "head_dim: 32..256, a multiple of 16");
  using Tr = AttnTraits<T>;
  constexpr int LD = HD + kPad;    // shared row stride, elements
  constexpr int PIECES = HD / 8;   // 16-byte pieces a row
  constexpr int NT = HD / 8;       // n-tiles of o
  extern __shared__ __align__(16) unsigned char attn_smem[];
  T* sq = reinterpret_cast<T*>(attn_smem);
  T* sk = sq + kRowsPerBlock * LD;  // [2][kChunk][LD]
  T* sv = sk + 2 * kChunk * LD;     // [2][kChunk][LD]
  const uint32_t sq_a = static_cast<uint32_t>(__cvta_generic_to_shared(sq));
  const uint32_t sk_a = static_cast<uint32_t>(__cvta_generic_to_shared(sk));
  const uint32_t sv_a = static_cast<uint32_t>(__cvta_generic_to_shared(sv));

  const int split = blockIdx.x;
  const int h = blockIdx.y % p.kv_heads, mg = blockIdx.y / p.kv_heads;
  const int l = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int R = p.n * p.rep;
  const int64_t slot = p.slots[l];
  const bool slot_ok = slot >= 0 && slot < p.num_slots;
  int64_t kend = 0;  // keys the lane's columns read: 0 .. max position
  for (int c = 0; c < p.n; ++c) kend = max(kend, p.pos[static_cast<int64_t>(l) * p.n + c] + 1);
  kend = min(kend, min(p.capacity, p.max_keys));  // keys from max_keys on are never read
  const int64_t k0 = static_cast<int64_t>(split) * p.split_keys;
  const int64_t k1 = slot_ok ? min(k0 + p.split_keys, kend) : k0;  // an unknown slot reads nothing

  // The block's valid query rows into shared memory (padding rows stay unset: their scores are
  // masked to -inf below whatever the bytes hold, and they are never stored).
  const T* q = static_cast<const T*>(p.q);
  const int blk_rows = max(0, min(kRowsPerBlock, R - mg * kRowsPerBlock));
  for (int i = threadIdx.x; i < blk_rows * PIECES; i += kWarps * 32) {
    const int row = i / PIECES, piece = i % PIECES;
    const int rr = mg * kRowsPerBlock + row;
    const T* src = q + ((static_cast<int64_t>(l) * p.n + rr / p.rep) * p.heads + h * p.rep + rr % p.rep) * HD + piece * 8;
    cp_async16_zfill(sq_a + (row * LD + piece * 8) * sizeof(T), src, true);
  }
  const T* kc = static_cast<const T*>(p.kc) + (slot_ok ? slot : 0) * p.kc_slot + h * p.kc_head;
  const T* vc = static_cast<const T*>(p.vc) + (slot_ok ? slot : 0) * p.vc_slot + h * p.vc_head;
  auto stage = [&](int buf, int64_t kb) {  // keys kb .. kb + kChunk - 1 into stage buf
    for (int i = threadIdx.x; i < kChunk * PIECES; i += kWarps * 32) {
      const int key = i / PIECES, piece = i % PIECES;
      const int64_t tk = kb + key;
      const bool ok = tk < k1;
      const uint32_t off = ((buf * kChunk + key) * LD + piece * 8) * sizeof(T);
      cp_async16_zfill(sk_a + off, ok ? kc + tk * p.kc_pos + piece * 8 : kc, ok);
      cp_async16_zfill(sv_a + off, ok ? vc + tk * p.vc_pos + piece * 8 : vc, ok);
    }
  };
  const int n_chunks = k1 > k0 ? static_cast<int>((k1 - k0 + kChunk - 1) / kChunk) : 0;
  if (n_chunks > 0) stage(0, k0);
  cp_async_commit_group();  // the query rows and the first stage

  // This warp's rows: r' = mg * 64 + warp * 16 + (g, g + 8); their positions (-1: a padding row,
  // every key masked).
  const int rbase = mg * kRowsPerBlock + warp * 16;
  int64_t prow[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int rr = rbase + g + 8 * i;
    prow[i] = rr < R ? p.pos[static_cast<int64_t>(l) * p.n + rr / p.rep] : -1;
  }
  const bool warp_active = rbase < R;
  float o[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_run[2] = {0.f, 0.f};

  for (int ch = 0; ch < n_chunks; ++ch) {
    const int buf = ch & 1;
    if (ch + 1 < n_chunks) stage(buf ^ 1, k0 + static_cast<int64_t>(ch + 1) * kChunk);
    cp_async_commit_group();
    cp_async_wait_group<1>();
    __syncthreads();
    if (warp_active) {
      const int64_t kb = k0 + static_cast<int64_t>(ch) * kChunk;
      // S = Q K^T: 16 rows x 32 keys (4 n-tiles of 8 keys)
      float s[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      const uint32_t kbuf = sk_a + buf * kChunk * LD * sizeof(T);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t a[4];
        ldsm_x4(a, sq_a + ((warp * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8) * sizeof(T));
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {  // n-tiles 2 jp, 2 jp + 1
          uint32_t b[4];
          const int key = 16 * jp + (lane & 7) + ((lane >> 4) << 3);
          ldsm_x4(b, kbuf + (key * LD + kk * 16 + ((lane >> 3) & 1) * 8) * sizeof(T));
          Tr::mma(s[2 * jp], a, b[0], b[1]);
          Tr::mma(s[2 * jp + 1], a, b[2], b[3]);
        }
      }
      // mask, scale, online softmax (rows g and g + 8 of this warp: c = 0, 1 and 2, 3)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -CUDART_INF_F;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int cc = 0; cc < 2; ++cc) {
            const int64_t key = kb + 8 * j + 2 * t + cc;
            float& v = s[j][2 * i + cc];
            v = (key <= prow[i] && key < k1) ? v * p.scale_log2 : -CUDART_INF_F;
            mx = fmaxf(mx, v);
          }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run[i], mx);
        const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
        const float alpha = exp2f(m_run[i] - m_use);
        m_run[i] = m_new;
        float rs = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int cc = 0; cc < 2; ++cc) {
            float& v = s[j][2 * i + cc];
            v = exp2f(v - m_use);
            rs += v;
          }
        l_run[i] = l_run[i] * alpha + rs;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          o[j][2 * i] *= alpha;
          o[j][2 * i + 1] *= alpha;
        }
      }
      // O += P V: P (16 x 32 keys, the model dtype) as A, V as B (ldmatrix.trans)
      const uint32_t vbuf = sv_a + buf * kChunk * LD * sizeof(T);
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t a[4];
        a[0] = Tr::pack(s[2 * kk][0], s[2 * kk][1]);
        a[1] = Tr::pack(s[2 * kk][2], s[2 * kk][3]);
        a[2] = Tr::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        a[3] = Tr::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        const int key = 16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
        for (int jp = 0; jp < NT / 2; ++jp) {  // d-tiles 2 jp, 2 jp + 1
          uint32_t b[4];
          ldsm_x4_trans(b, vbuf + (key * LD + 16 * jp + (lane >> 4) * 8) * sizeof(T));
          Tr::mma(o[2 * jp], a, b[0], b[1]);
          Tr::mma(o[2 * jp + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // the stage is read before the next iteration refills it
  }
  cp_async_wait_group<0>();
  if (!warp_active) return;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 1);
    l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], 2);
  }
  const int64_t r_lane = static_cast<int64_t>(l) * p.n;
  if (p.splits == 1) {
    T* out = static_cast<T*>(p.out);
    const T* gate = static_cast<const T*>(p.gate);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int rr = rbase + g + 8 * i;
      if (rr >= R) continue;
      const int64_t r = r_lane + rr / p.rep;
      const int hq = h * p.rep + rr % p.rep;
      const float inv = l_run[i] > 0.f ? __frcp_rn(l_run[i]) : 0.f;  // one reciprocal a row
      const T* __restrict__ gr = GATE ? gate + r * p.g_row + hq * p.g_head : nullptr;
      T* __restrict__ orow = out + r * p.out_row + hq * HD;
      // 8 n-tiles at a time: their gate loads all issued before any store (one memory round trip a
      // group, not one an element)
#pragma unroll
      for (int j0 = 0; j0 < NT; j0 += 8) {
        constexpr int G = NT < 8 ? NT : 8;
        T g0[G], g1[G];
        if constexpr (GATE) {
#pragma unroll
          for (int j = 0; j < G; ++j) {
            g0[j] = __ldg(gr + 8 * (j0 + j) + 2 * t);
            g1[j] = __ldg(gr + 8 * (j0 + j) + 2 * t + 1);
          }
        }
#pragma unroll
        for (int j = 0; j < G; ++j) {
          const int e = 8 * (j0 + j) + 2 * t;
          const float y0 = attn_out<T, GATE>(o[j0 + j][2 * i] * inv, GATE ? Tr::to_f(g0[j]) : 0.f);
          const float y1 = attn_out<T, GATE>(o[j0 + j][2 * i + 1] * inv, GATE ? Tr::to_f(g1[j]) : 0.f);
          *reinterpret_cast<uint32_t*>(orow + e) = Tr::pack(y0, y1);
        }
      }
    }
    return;
  }
  // park this split's o (unnormalized) and (max, sum) for the combine
  const int64_t base = (static_cast<int64_t>(l) * p.kv_heads + h) * p.splits + split;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int rr = rbase + g + 8 * i;
    float* wo = p.ws_o + (base * p.r_pad + rr) * HD;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      *reinterpret_cast<float2*>(wo + 8 * j + 2 * t) = make_float2(o[j][2 * i], o[j][2 * i + 1]);
    }
    if (t == 0) p.ws_ml[base * p.r_pad + rr] = make_float2(m_run[i], l_run[i]);
  }
}

// The splits of (lane, query row, head) merged in split order, normalized, gated and written: one
// block per query row r and head hq, HD threads (one element each).
template <typename T, int HD, bool GATE = true>
__global__ void __launch_bounds__(HD) gated_attention_combine_kernel(Params p) {
  using Tr = AttnTraits<T>;
  const int64_t r = blockIdx.x;  // query row l * n + c
  const int hq = blockIdx.y;
  const int e = threadIdx.x;
  const int l = static_cast<int>(r / p.n), c = static_cast<int>(r % p.n);
  const int h = hq / p.rep, rr = c * p.rep + hq % p.rep;
  const int64_t base = (static_cast<int64_t>(l) * p.kv_heads + h) * p.splits;
  float m = -CUDART_INF_F;
  for (int s = 0; s < p.splits; ++s) m = fmaxf(m, p.ws_ml[(base + s) * p.r_pad + rr].x);
  const float m_use = m == -CUDART_INF_F ? 0.f : m;
  float acc = 0.f, sum = 0.f;
  for (int s = 0; s < p.splits; ++s) {
    const float2 ml = p.ws_ml[(base + s) * p.r_pad + rr];
    if (ml.y == 0.f) continue;  // an empty split (past the lane's keys) parks nothing else
    const float w = exp2f(ml.x - m_use);
    sum += ml.y * w;
    acc += p.ws_o[((base + s) * p.r_pad + rr) * HD + e] * w;
  }
  const float v = sum > 0.f ? acc / sum : 0.f;
  const T* __restrict__ gate = static_cast<const T*>(p.gate);
  T* out = static_cast<T*>(p.out);
  const float g = GATE ? Tr::to_f(gate[r * p.g_row + hq * p.g_head + e]) : 0.f;
  out[r * p.out_row + hq * HD + e] = Tr::from_f(attn_out<T, GATE>(v, g));
}

}  // namespace ignis_attn
