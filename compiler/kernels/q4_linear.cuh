// ignis q4_g32 linear on tensor cores (mma.sync m16n8k16), for 1..32 activation rows.
//
//   y[R, N] = x[R, K] @ dequant(W)[N, K]^T      (fp32 accumulation, y in x's dtype)
//   W: u32 [N, K/8], nibble j of word c = input feature 8c+j; value = (q - 8) * scale
//   scales: f16 [N, K/32] (one per 32 input features)
//
// Decode-route design (see docs/adr/0001-q4-kernel-route.md):
// * The weights are the mma's A operand (16 output features per m-tile), the activation rows are
//   B (8 rows per n-tile), so R = 1..8 costs one n-tile and 9..32 rows two to four.
// * A k-step is 128 V input features (V = 1, 2, 4). Lane (g = lane/4, t = lane%4) streams 16 V
//   contiguous bytes (V whole scale groups) of output rows g and g+8 per step.
// * The mma's k order is permuted so that the A fragment is built from those 16 bytes without
//   any shuffles: a sum over k does not care about the order, only that A and B use the same one.
//   Lane t's mma slots {2t, 2t+1, 2t+8, 2t+9} of mma (2w + h) hold nibbles {h*2, h*2+4, h*2+1,
//   h*2+5} of its word w; its B fragment is the same eight features of x, one 16-byte load per
//   word, paired with two byte-permutes.
// * Dequantization in registers with the 0x6400 (f16) / 0x4300 (bf16) exponent trick: one LOP3
//   per two weights, then an exact subtraction and one packed multiply by the group's scale.
// * Split-K over the block's warps (interleaved k-steps). Each lane streams its own weight and
//   scale bytes through a private STAGES-deep cp.async ring in shared memory (no barriers for
//   them: a lane only reads what it copied), so every warp keeps STAGES - 1 k-steps of weights in
//   flight without spending registers on them. Activations come either through L1, one sub-step
//   ahead (PREFETCH_X), or through the same ring as coalesced 16-byte chunks (XR, one __syncwarp
//   per step). Two accumulator sets halve the chains of dependent mmas.
// * Programmatic dependent launch: the kernel fills its weight pipeline before
//   griddepcontrol.wait, so in a chain of layers the next layer's weight stream starts while the
//   previous layer drains. Activations are read and outputs written only after the wait.
// * The warps' partial sums are reduced through shared memory in a fixed order (deterministic).
//
// Wide route (9..32 rows): q4_linear_n_kernel at the end of this file (block-shared activations,
// warps splitting the outputs, thread-block clusters splitting K).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace ignis_q4 {

constexpr int kStepK = 128;  // input features per warp k-step

__device__ __forceinline__ uint4 ld_cached_v4(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ uint32_t as_u32(half2 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ uint32_t as_u32(__nv_bfloat162 v) {
  return *reinterpret_cast<uint32_t*>(&v);
}

// (a & MASK) | EX in one LOP3 (the compiler splits the C++ expression into two).
template <uint32_t MASK, uint32_t EX>
__device__ __forceinline__ uint32_t and_or(uint32_t a) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(MASK), "n"(EX));
  return r;
}

template <typename T>
struct Q4Traits;

template <>
struct Q4Traits<half> {
  using T2 = half2;
  // Scale pair (s, s) from the stored f16 scale.
  __device__ __forceinline__ static uint32_t scale2(uint16_t s_bits) {
    return (uint32_t(s_bits) << 16) | uint32_t(s_bits);
  }
  // out[i] = half2((n_i - 8) * s, (n_{i+4} - 8) * s) for the word's nibbles n_0..n_7.
  __device__ __forceinline__ static void dequant(uint32_t q, uint32_t s2, uint32_t out[4]) {
    uint32_t lo0 = and_or<0x000f000fu, 0x64006400u>(q);  // 1024 + n0, 1024 + n4
    uint32_t hi0 = and_or<0x00f000f0u, 0x64006400u>(q);  // 1024 + 16 n1, 1024 + 16 n5
    uint32_t q8 = q >> 8;
    uint32_t lo1 = and_or<0x000f000fu, 0x64006400u>(q8);  // n2, n6
    uint32_t hi1 = and_or<0x00f000f0u, 0x64006400u>(q8);  // n3, n7
    const half2 sub = __halves2half2(__ushort_as_half(0x6408), __ushort_as_half(0x6408));  // 1032
    const half2 mul = __halves2half2(__ushort_as_half(0x2c00), __ushort_as_half(0x2c00));  // 1/16
    const half2 add = __halves2half2(__ushort_as_half(0xd480), __ushort_as_half(0xd480));  // -72
    const half2 s = *reinterpret_cast<const half2*>(&s2);
    half2 v0 = __hmul2(__hsub2(*reinterpret_cast<half2*>(&lo0), sub), s);
    half2 v1 = __hmul2(__hfma2(*reinterpret_cast<half2*>(&hi0), mul, add), s);
    half2 v2 = __hmul2(__hsub2(*reinterpret_cast<half2*>(&lo1), sub), s);
    half2 v3 = __hmul2(__hfma2(*reinterpret_cast<half2*>(&hi1), mul, add), s);
    out[0] = as_u32(v0);
    out[1] = as_u32(v1);
    out[2] = as_u32(v2);
    out[3] = as_u32(v3);
  }
  __device__ __forceinline__ static void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                             uint32_t b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct Q4Traits<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  __device__ __forceinline__ static uint32_t scale2(uint16_t s_bits) {
    __nv_bfloat16 b = __float2bfloat16_rn(__half2float(__ushort_as_half(s_bits)));
    uint32_t u = uint32_t(__bfloat16_as_ushort(b));
    return (u << 16) | u;
  }
  __device__ __forceinline__ static void dequant(uint32_t q, uint32_t s2, uint32_t out[4]) {
    // 128 + n, exact in bf16
    const __nv_bfloat162 sub =
        __halves2bfloat162(__ushort_as_bfloat16(0x4308), __ushort_as_bfloat16(0x4308));  // 136
    const __nv_bfloat162 s = *reinterpret_cast<const __nv_bfloat162*>(&s2);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t v = and_or<0x000f000fu, 0x43004300u>(q >> (4 * i));
      __nv_bfloat162 d = __hmul2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&v), sub), s);
      out[i] = as_u32(d);
    }
  }
  __device__ __forceinline__ static void mma(float c[4], const uint32_t a[4], uint32_t b0,
                                             uint32_t b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float v) {
    return __float2bfloat16_rn(v);
  }
};

__device__ __forceinline__ void cp_async16(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(uint32_t smem_addr, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

// One warp's ring, per stage: per m-tile the weights (2 rows x 32 lanes x 16 V bytes) then the
// scales (2 rows x 32 lanes x max(4, 2 V) bytes: the lane's V scales, or for V = 1 the aligned
// pair holding its one scale); with XR, then the step's activations (8 NT rows x 256 V bytes, rows
// padded by 16 bytes against bank conflicts).
template <int V>
__host__ __device__ constexpr int q4_scale_bytes() {
  return 2 * V > 4 ? 2 * V : 4;
}
template <int V>
__host__ __device__ constexpr int q4_stage_tile_bytes() {
  return 2 * 32 * 16 * V + 2 * 32 * q4_scale_bytes<V>();
}
template <int V>
__host__ __device__ constexpr int q4_x_row_bytes() {
  return 256 * V + 16;
}
template <int NT, int MT, int V, bool XR>
__host__ __device__ constexpr int q4_stage_bytes() {
  return MT * q4_stage_tile_bytes<V>() + (XR ? 8 * NT * q4_x_row_bytes<V>() : 0);
}
template <int NT, int MT, int STAGES, int V, bool XR>
__host__ __device__ constexpr int q4_smem_bytes_per_warp() {
  return STAGES * q4_stage_bytes<NT, MT, V, XR>();
}

template <typename T, int NT, int MT>
__device__ __forceinline__ void compute_step(const uint4 (&xr)[NT][4], const uint4 (&wq)[MT][2],
                                             const uint16_t (&sc)[MT][2],
                                             float (&acc)[2][MT][NT][4]) {
  using Tr = Q4Traits<T>;
  // B fragments: per n-tile, per word, two mmas (h = 0, 1) x two registers.
  uint32_t b[NT][4][2][2];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint4 v = xr[j][w];  // features 8w + 0..7 as (e0,e1) (e2,e3) (e4,e5) (e6,e7)
      b[j][w][0][0] = __byte_perm(v.x, v.z, 0x5410);  // e0, e4
      b[j][w][0][1] = __byte_perm(v.x, v.z, 0x7632);  // e1, e5
      b[j][w][1][0] = __byte_perm(v.y, v.w, 0x5410);  // e2, e6
      b[j][w][1][1] = __byte_perm(v.y, v.w, 0x7632);  // e3, e7
    }
  }
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
    const uint32_t s0 = Tr::scale2(sc[mi][0]);
    const uint32_t s1 = Tr::scale2(sc[mi][1]);
    const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&wq[mi][0]);
    const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&wq[mi][1]);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t p0[4], p1[4];
      Tr::dequant(w0[w], s0, p0);
      Tr::dequant(w1[w], s1, p1);
      const uint32_t a0[4] = {p0[0], p1[0], p0[1], p1[1]};  // nibbles (0,4) / (1,5)
      const uint32_t a1[4] = {p0[2], p1[2], p0[3], p1[3]};  // nibbles (2,6) / (3,7)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        // Two accumulator sets (by word parity) halve the chain of dependent mmas.
        Tr::mma(acc[w & 1][mi][j], a0, b[j][w][0][0], b[j][w][0][1]);
        Tr::mma(acc[w & 1][mi][j], a1, b[j][w][1][0], b[j][w][1][1]);
      }
    }
  }
}

// Kernel modes: the real kernel, and a diagnostic that only streams the weights (no math; the
// output is garbage) to measure what the memory pattern alone can reach.
enum : int { kModeCompute = 0, kModeStreamOnly = 1 };

// Grid: ceil(N / (16 MT)) blocks of WARPS warps, dynamic shared memory
// WARPS * q4_smem_bytes_per_warp<NT, MT, STAGES, V, XR>(). A warp k-step is 128 V input features:
// lane t streams 16 V contiguous bytes of each of its rows per step. Requires K % (128 V) == 0
// and R <= 8 NT.
// PREFETCH_X: (without XR) the next sub-step's activations are loaded before this one's math.
// XR: the activations travel through the warp's cp.async ring too (coalesced, STAGES deep).
// MIN_BLOCKS: blocks per SM the register allocation must allow (1: no constraint).
// FP: fragment prefetch (register double buffering, V == 1, STAGES >= 3). 0: off; 1: the next
//   k-step's weights and scales are read from shared memory before this step's math, so their
//   latency hides behind it (each warp waits for one stage less of its ring); 2: the activations
//   too (XR). The loop is unrolled by two with ping-pong fragment buffers (no register moves).
template <typename T, int NT, int MT, int WARPS, int STAGES, int V, bool PREFETCH_X, bool XR, int MODE,
          int MIN_BLOCKS, int FP = 0>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS > 1 ? MIN_BLOCKS : 0)
    q4_linear_mma_kernel(const T* __restrict__ x, const uint32_t* __restrict__ qw,
                         const uint16_t* __restrict__ sc, T* __restrict__ y, int n_rows, int n_out,
                         int k_in) {
  static_assert(STAGES >= 2, "at least two pipeline stages");
  static_assert(V == 1 || V == 2 || V == 4, "V is 1, 2 or 4");
  constexpr int kWarpBytes = q4_smem_bytes_per_warp<NT, MT, STAGES, V, XR>();
  static_assert(kWarpBytes >= MT * NT * 4 * 32 * 4,
                "the ring must hold the warp's partial sums for the reduction");
  constexpr int kTile = q4_stage_tile_bytes<V>();
  constexpr int kStage = q4_stage_bytes<NT, MT, V, XR>();
  constexpr int kScaleBytes = q4_scale_bytes<V>();
  constexpr int kXRow = q4_x_row_bytes<V>();
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16 * MT;
  const int n_steps = k_in / (kStepK * V);
  const int kw = k_in / 8, kg = k_in / 32;
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
  // This warp's k-steps: warp, warp + WARPS, ...
  const int my_steps = n_steps > warp ? (n_steps - warp + WARPS - 1) / WARPS : 0;

  unsigned char* ring = smem + warp * kWarpBytes;
  const uint32_t ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(ring));

  // Per lane, for the next k-step to be issued: its two weight rows per m-tile and their scales
  // (rows past n_out clamped), advanced by WARPS steps per issue. Shared-memory offsets are lane
  // constants plus the stage base.
  const uint32_t* wp[MT][2];
  const uint16_t* sp[MT][2];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int o = row0 + 16 * mi + g + 8 * h;
      o = o < n_out ? o : n_out - 1;
      wp[mi][h] = qw + size_t(o) * kw + 4 * V * t + warp * 16 * V;
      sp[mi][h] = sc + size_t(o) * kg + (V == 1 ? (t & ~1) : V * t) + warp * 4 * V;
    }
  }
  const uint32_t w_off = lane * 16 * V;                       // + h * 32 * 16 V + mi * kTile
  const uint32_t s_off = 2 * 32 * 16 * V + lane * kScaleBytes;  // + h * 32 * kScaleBytes
  // XR copies: chunk c = lane + 32 k of the 8 NT x 16 V chunks of the step's activation rows.
  const uint16_t* xcp = xs + warp * kStepK * V;
  uint32_t issue_stage = ring_addr;
  const uint32_t ring_end = ring_addr + STAGES * kStage;
  auto issue_weights = [&]() {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int v = 0; v < V; ++v)
          cp_async16(issue_stage + mi * kTile + h * 32 * 16 * V + w_off + 16 * v, wp[mi][h] + 4 * v);
        const uint32_t sdst = issue_stage + mi * kTile + h * 32 * kScaleBytes + s_off;
        if (kScaleBytes == 4) cp_async4(sdst, sp[mi][h]);
        else asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(sdst), "l"(sp[mi][h]));
        wp[mi][h] += WARPS * 16 * V;
        sp[mi][h] += WARPS * 4 * V;
      }
    }
  };
  auto issue_acts = [&]() {
    constexpr int kChunksPerRow = 16 * V;
#pragma unroll
    for (int c0 = 0; c0 < 8 * NT * kChunksPerRow; c0 += 32) {
      const int c = c0 + lane;
      const int r = c / kChunksPerRow, col = c % kChunksPerRow;
      if (r < n_rows) cp_async16(issue_stage + MT * kTile + r * kXRow + 16 * col, xcp + size_t(r) * k_in + 8 * col);
    }
    xcp += WARPS * kStepK * V;
  };
  auto next_issue_stage = [&]() {
    issue_stage += kStage;
    if (issue_stage == ring_end) issue_stage = ring_addr;
  };

  // Weights do not depend on the previous kernel: fill the pipeline before waiting for it.
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < my_steps) issue_weights();
    cp_async_commit();
    next_issue_stage();
  }
  pdl_launch_dependents();
  pdl_wait();
  // Activations only after the wait: with XR, one more group per prologue stage, so that the
  // group of stage i's activations still has exactly STAGES - 1 groups after it at step i.
  if (XR && MODE == kModeCompute) {
    issue_stage = ring_addr;
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
      if (i < my_steps) issue_acts();
      cp_async_commit();
      next_issue_stage();
    }
  }

  float acc[2][MT][NT][4];
#pragma unroll
  for (int p = 0; p < 2; ++p)
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[p][mi][j][c] = 0.f;

  // Without XR: the lane's activation rows (clamped), at its features of the current sub-step.
  const uint16_t* xp[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j)
    xp[j] = xs + size_t(min(8 * j + g, n_rows - 1)) * k_in + warp * kStepK * V + 32 * V * t;
  auto load_x = [&](uint4 (&dst)[NT][4], int off) {
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int w = 0; w < 4; ++w) dst[j][w] = ld_cached_v4(xp[j] + off + 8 * w);
  };
  constexpr int kXStride = WARPS * kStepK * V;  // halves between a warp's consecutive steps
  const uint32_t xr_off = MT * kTile + g * kXRow + 64 * V * t;

  uint4 xr[NT][4];
  uint32_t read_stage = ring_addr;
  if constexpr (FP > 0 && MODE == kModeCompute) {
    static_assert(V == 1 && STAGES >= 3, "fragment prefetch needs V == 1 and at least 3 stages");
    static_assert(FP == 1 || XR, "FP == 2 prefetches the activations from the ring (XR)");
    // Stage i + 1's fragments are read while stage i is computed: at step i the warp waits for
    // stage i + 1 (STAGES - 2 groups may stay pending). Slot reuse: step i refills the slot of
    // step i - 1, whose fragments were consumed by step i - 1's math (and, with XR, every lane
    // is past it: the __syncwarp at the top of the step).
    auto load_w = [&](uint32_t base, uint4 (&wq)[MT][2], uint16_t (&scl)[MT][2]) {
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wq[mi][h] = lds128(base + mi * kTile + h * 32 * 16 + w_off);
          const uint32_t pair = lds32(base + mi * kTile + h * 32 * kScaleBytes + s_off);
          scl[mi][h] = static_cast<uint16_t>((t & 1) ? (pair >> 16) : (pair & 0xffffu));
        }
      }
    };
    auto load_xs = [&](uint32_t base, uint4 (&dst)[NT][4]) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int w = 0; w < 4; ++w) dst[j][w] = lds128(base + xr_off + 8 * j * kXRow + 16 * w);
    };
    auto fp_step = [&](int i, const uint4 (&cw)[MT][2], const uint16_t (&cs)[MT][2], uint4 (&cx)[NT][4],
                       uint4 (&nw)[MT][2], uint16_t (&ns)[MT][2], uint4 (&nx)[NT][4]) {
      if (XR) __syncwarp();  // every lane is done with the slot about to be refilled
      if (i + STAGES - 1 < my_steps) {
        issue_weights();
        if (XR) issue_acts();
      }
      cp_async_commit();
      next_issue_stage();
      cp_async_wait<STAGES - 2>();  // stage i + 1 has landed (this lane's copies)
      if (XR) __syncwarp();         // ... and every lane's
      const uint32_t base = read_stage;
      read_stage += kStage;
      if (read_stage == ring_end) read_stage = ring_addr;
      const bool has_next = i + 1 < my_steps;
      if (XR && FP == 1) load_xs(base, cx);
      if (has_next) {
        load_w(read_stage, nw, ns);
        if (XR && FP == 2) load_xs(read_stage, nx);
        if (!XR && PREFETCH_X) load_x(nx, kXStride);
      }
      compute_step<T, NT, MT>(cx, cw, cs, acc);
      if (!XR && has_next) {
        if (!PREFETCH_X) load_x(nx, kXStride);
#pragma unroll
        for (int j = 0; j < NT; ++j) xp[j] += kXStride;
      }
    };
    uint4 wa[MT][2], wb[MT][2], xb[NT][4];
    uint16_t sa[MT][2], sb[MT][2];
    if (my_steps > 0) {
      cp_async_wait<STAGES - 2>();  // stage 0
      if (XR) __syncwarp();
      load_w(ring_addr, wa, sa);
      if (XR && FP == 2) load_xs(ring_addr, xr);
      if (!XR) load_x(xr, 0);
    }
    for (int i = 0; i < my_steps; i += 2) {
      fp_step(i, wa, sa, xr, wb, sb, xb);
      if (i + 1 < my_steps) fp_step(i + 1, wb, sb, xb, wa, sa, xr);
    }
  } else {
  if (!XR && MODE == kModeCompute && my_steps > 0) load_x(xr, 0);
  for (int i = 0; i < my_steps; ++i) {
    if (XR) __syncwarp();  // every lane is done reading the stage about to be refilled
    if (i + STAGES - 1 < my_steps) {
      issue_weights();
      if (XR && MODE == kModeCompute) issue_acts();
    }
    cp_async_commit();
    next_issue_stage();
    cp_async_wait<STAGES - 1>();
    if (MODE == kModeStreamOnly) continue;
    if (XR) __syncwarp();  // other lanes' activation copies are visible
    const uint32_t base = read_stage;
    read_stage += kStage;
    if (read_stage == ring_end) read_stage = ring_addr;
#pragma unroll
    for (int u = 0; u < V; ++u) {
      // Sub-step u: the lane's features step*128V + 32Vt + 32u + (0..31).
      const bool has_next = u + 1 < V || i + 1 < my_steps;
      const int x_next = u + 1 < V ? 32 * (u + 1) : kXStride;
      uint4 xn[NT][4];
      if (XR) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int w = 0; w < 4; ++w) xr[j][w] = lds128(base + xr_off + 8 * j * kXRow + 64 * u + 16 * w);
      } else if (PREFETCH_X && has_next) {
        load_x(xn, x_next);
      }
      uint4 wq[MT][2];
      uint16_t scl[MT][2];
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          wq[mi][h] = lds128(base + mi * kTile + h * 32 * 16 * V + w_off + 16 * u);
          const uint32_t sa = base + mi * kTile + h * 32 * kScaleBytes + s_off;
          if (V == 1) {
            const uint32_t pair = lds32(sa);
            scl[mi][h] = static_cast<uint16_t>((t & 1) ? (pair >> 16) : (pair & 0xffffu));
          } else {
            const uint32_t pair = lds32(sa + 4 * (u >> 1));
            scl[mi][h] = static_cast<uint16_t>((u & 1) ? (pair >> 16) : (pair & 0xffffu));
          }
        }
      }
      compute_step<T, NT, MT>(xr, wq, scl, acc);
      if (!XR && has_next) {
        if (PREFETCH_X) {
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int w = 0; w < 4; ++w) xr[j][w] = xn[j][w];
        } else {
          load_x(xr, x_next);
        }
        if (u + 1 == V) {
#pragma unroll
          for (int j = 0; j < NT; ++j) xp[j] += kXStride;
        }
      }
    }
  }
  }  // FP == 0
  cp_async_wait<0>();
  __syncwarp();

  // Deterministic split-K reduction: each warp parks its partial sums in its own (drained) ring,
  // then the block sums the warps in order.
  float* part = reinterpret_cast<float*>(ring);
#pragma unroll
  for (int mi = 0; mi < MT; ++mi)
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        part[((mi * NT + j) * 4 + c) * 32 + lane] = acc[0][mi][j][c] + acc[1][mi][j][c];
  __syncthreads();
  // part[((mi NT + j) 4 + c) 32 + lane] holds y[row 8j + 2t + (c & 1)][out row0 + 16 mi + g + 8 (c >> 1)].
  for (int e = threadIdx.x; e < MT * NT * 128; e += WARPS * 32) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) v += reinterpret_cast<const float*>(smem + w * kWarpBytes)[e];
    const int l = e & 31, c = (e >> 5) & 3, tile = e >> 7;
    const int j = tile % NT, mi = tile / NT;
    const int r = 8 * j + 2 * (l & 3) + (c & 1);
    const int o = row0 + 16 * mi + (l >> 2) + 8 * (c >> 1);
    if (r < n_rows && o < n_out) y[size_t(r) * n_out + o] = Q4Traits<T>::from_float(v);
  }
}

// ---------------------------------------------------------------------------------------------
// The "N" layout (the wide route, 9..32 rows; also a decode candidate).
//
// The split-K kernel above gives every warp its own k-steps, so each warp copies its own
// activations: per weight byte it reads R / (4 MT) bytes of activations (4x at 32 rows with two
// m-tiles), which is what bounded it at 16-32 rows (L2 -> SM traffic and the rings' shared memory,
// i.e. occupancy). Here a block's WN warps share every k-step and split the output rows instead:
// warp n owns m-tiles n MT .. n MT + MT - 1 of the block's WN MT. The step's activations are copied
// once per block into a shared cp.async ring (chunks XOR-swizzled so that the 8 lanes of a 16-byte
// load phase hit 8 distinct bank groups) and feed all WN MT m-tiles: R / (4 MT WN) activation bytes
// per weight byte. One __syncthreads per k-step. A cluster of KC blocks splits K (cluster rank r
// takes k-steps r, r + KC, ...); the blocks' partial sums are reduced through distributed shared
// memory in a fixed order (deterministic) and each rank writes a slice of the outputs. Weights and
// scales still travel through each lane's private ring (no barrier for them). Per word, the
// dequantized A fragment feeds every n-tile and each B fragment every m-tile of the warp. k-step
// 128 features (V = 1). One accumulator set once MT NT >= 4 (enough independent mma chains).
template <int NT>
__host__ __device__ constexpr int q4n_x_stage_bytes() {
  return 8 * NT * q4_x_row_bytes<1>();
}
template <int NT, int MT, int WN, int STAGES, int KS = 1>
__host__ __device__ constexpr int q4n_smem_bytes() {
  return KS * (WN * STAGES * MT * q4_stage_tile_bytes<1>() + STAGES * q4n_x_stage_bytes<NT>());
}

__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
#else
  __trap();
#endif
}
// A float from the shared memory of cluster rank `rank`, at this block's shared address `local`.
__device__ __forceinline__ float ld_cluster_f32(uint32_t local, uint32_t rank) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#else
  __trap();
#endif
  return v;
}

// Grid: ceil(N / (16 MT WN)) * KC blocks of WN warps (clusters of KC along x when KC > 1), dynamic
// shared memory q4n_smem_bytes<NT, MT, WN, STAGES>(). Requires K % 128 == 0 and R <= 8 NT.
// MODE: kModeCompute, or kModeStreamOnly (the same copies and barriers, no math: wrong output).
// KSPAN: each cluster rank takes a contiguous span of k-steps (rank r: [r S, r S + S), S = ceil(steps
// / KC)) instead of every KC-th step, so consecutive steps of one block read adjacent bytes.
// X_CA: the activations are copied with cp.async.ca (allocated in L1: blocks of one SM that work on
// the same k-steps -- the same cluster rank -- share them) instead of .cg.
// KS: k-steps per pipeline stage (one barrier and one copy group per KS k-steps; with KS = 2 a lane
// streams the two adjacent 64-byte pieces -- a whole 128-byte line -- of each weight row per stage).
template <typename T, int NT, int MT, int WN, int KC, int STAGES, int MIN_BLOCKS, bool EARLY_W = true,
          int MODE = kModeCompute, bool KSPAN = false, bool X_CA = false, int KS = 1>
__global__ void __launch_bounds__(WN * 32, MIN_BLOCKS > 1 ? MIN_BLOCKS : 0)
    q4_linear_n_kernel(const T* __restrict__ x, const uint32_t* __restrict__ qw,
                       const uint16_t* __restrict__ sc, T* __restrict__ y, int n_rows, int n_out,
                       int k_in) {
  using Tr = Q4Traits<T>;
  static_assert(STAGES >= 2, "at least two pipeline stages");
  static_assert(KC == 1 || KC == 2 || KC == 4 || KC == 8, "KC is 1, 2, 4 or 8");
  constexpr int kTile = q4_stage_tile_bytes<1>();  // per m-tile: weights 2 x 512, scales 2 x 128
  static_assert(KS == 1 || KS == 2, "KS is 1 or 2");
  constexpr int kWarpStage = KS * MT * kTile;  // one stage of a warp's weights and scales
  constexpr int kWarpRing = STAGES * kWarpStage;
  constexpr int kXRow = q4_x_row_bytes<1>();
  constexpr int kXSub = q4n_x_stage_bytes<NT>();  // one k-step of activations
  constexpr int kXStage = KS * kXSub;
  constexpr int NACC = MT * NT >= 4 ? 1 : 2;
  static_assert(kWarpRing >= MT * NT * 128 * 4, "a warp's ring must hold its partial sums");
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int kc = KC > 1 ? static_cast<int>(blockIdx.x) % KC : 0;
  const int block_row0 = (static_cast<int>(blockIdx.x) / KC) * 16 * MT * WN;
  const int row0 = block_row0 + 16 * MT * warp;
  const int n_steps = k_in / (kStepK * KS);  // pipeline stages' worth of k-steps
  const int kw = k_in / 8, kg = k_in / 32;
  const int span = (n_steps + KC - 1) / KC;
  const int first_step = KSPAN ? kc * span : kc;
  constexpr int kStride = KSPAN ? 1 : KC;  // k-steps between a block's consecutive steps
  const int my_steps = KSPAN ? max(0, min(span, n_steps - kc * span))
                             : (n_steps > kc ? (n_steps - kc + KC - 1) / KC : 0);
  unsigned char* wring = smem + warp * kWarpRing;
  const unsigned char* xring = smem + WN * kWarpRing;
  const uint32_t wring_a = static_cast<uint32_t>(__cvta_generic_to_shared(wring));
  const uint32_t xring_a = static_cast<uint32_t>(__cvta_generic_to_shared(xring));

  const uint32_t* wp[MT][2];
  const uint16_t* sp[MT][2];
#pragma unroll
  for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int o = row0 + 16 * mi + g + 8 * h;
      o = o < n_out ? o : n_out - 1;
      wp[mi][h] = qw + size_t(o) * kw + 4 * t + first_step * 16 * KS;
      sp[mi][h] = sc + size_t(o) * kg + (t & ~1) + first_step * 4 * KS;
    }
  }
  const uint16_t* xcp = reinterpret_cast<const uint16_t*>(x) + size_t(first_step) * kStepK * KS;
  auto issue_weights = [&](int slot) {
    const uint32_t base = wring_a + slot * kWarpStage;
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          cp_async16(base + (ks * MT + mi) * kTile + h * 512 + lane * 16, wp[mi][h] + ks * 16);
          cp_async4(base + (ks * MT + mi) * kTile + 1024 + h * 128 + lane * 4, sp[mi][h] + ks * 4);
        }
        wp[mi][h] += kStride * 16 * KS;
        sp[mi][h] += kStride * 4 * KS;
      }
    }
  };
  // This thread's activation chunks (16 bytes of one row) per step, fixed for the whole loop:
  // chunk c = u WN 32 + tid, row c / 16, column c % 16 (stored XOR-swizzled); offsets precomputed.
  constexpr int kChunks = 8 * NT * 16;  // 16-byte chunks of the step's 8 NT activation rows
  constexpr int kXIter = (kChunks + WN * 32 - 1) / (WN * 32);
  uint32_t x_dst[kXIter], x_src[kXIter], x_live = 0;
#pragma unroll
  for (int u = 0; u < kXIter; ++u) {
    const int c = u * WN * 32 + tid;
    const int r = c >> 4, col = c & 15;
    x_dst[u] = r * kXRow + 16 * (col ^ ((col >> 3) << 1));
    x_src[u] = r * k_in + 8 * col;  // < 32 rows x K halves
    if (c < kChunks && r < n_rows) x_live |= 1u << u;
  }
  auto issue_acts = [&](int slot) {
    const uint32_t base = xring_a + slot * kXStage;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int u = 0; u < kXIter; ++u) {
        if (x_live & (1u << u)) {
          const uint32_t dst = base + ks * kXSub + x_dst[u];
          const uint16_t* src = xcp + ks * kStepK + x_src[u];
          if (X_CA) asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
          else cp_async16(dst, src);
        }
      }
    }
    xcp += kStride * kStepK * KS;
  };

  // Weights do not depend on the previous kernel: fill the pipeline before waiting for it.
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < my_steps) issue_weights(i);
    cp_async_commit();
  }
  pdl_launch_dependents();
  pdl_wait();
  // Then the activations, one group per prologue stage: at step i, the groups of stage i are
  // followed by exactly STAGES - 2 others (weights' groups first, then these, then one per step).
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < my_steps) issue_acts(i);
    cp_async_commit();
  }

  float acc[NACC][MT][NT][4];
#pragma unroll
  for (int p = 0; p < NACC; ++p)
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[p][mi][j][c] = 0.f;

  // Lane (g, t) reads activation row 8 j + g, features 32 t + 8 w .. + 7 (chunk 4 t + w, stored
  // at chunk position 4 t + (w ^ (t & 2))).
  const int x_lane = g * kXRow + 64 * t;
  const int x_swz = (t & 2) ? 32 : 0;
  int read_slot = 0, issue_slot = STAGES - 1;
  for (int i = 0; i < my_steps; ++i) {
    const bool refill = i + STAGES - 1 < my_steps;
    // EARLY_W: this lane's weights of step i + STAGES - 1 go into its private slot (the one step
    // i - 1 used, which this lane has finished reading) before the wait: STAGES steps of weights
    // in flight while the block waits, not STAGES - 1. Uncommitted, they join this step's group.
    if (EARLY_W && refill) issue_weights(issue_slot);
    cp_async_wait<STAGES - 2>();  // this thread's copies of step i have landed
    __syncthreads();              // everyone's; and every warp is done with step i - 1's slot
    if (refill) {
      if (!EARLY_W) issue_weights(issue_slot);
      issue_acts(issue_slot);
    }
    cp_async_commit();
    issue_slot = issue_slot + 1 == STAGES ? 0 : issue_slot + 1;
    if (MODE == kModeStreamOnly) continue;

    const unsigned char* ws_stage = wring + read_slot * kWarpStage;
    const unsigned char* xs_stage = xring + read_slot * kXStage + x_lane;
    read_slot = read_slot + 1 == STAGES ? 0 : read_slot + 1;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
    const unsigned char* ws = ws_stage + ks * MT * kTile;
    const unsigned char* xs = xs_stage + ks * kXSub;
    uint4 wq[MT][2];
    uint32_t s2[MT][2];
#pragma unroll
    for (int mi = 0; mi < MT; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        wq[mi][h] = *reinterpret_cast<const uint4*>(ws + mi * kTile + h * 512 + lane * 16);
        const uint32_t pair = *reinterpret_cast<const uint32_t*>(ws + mi * kTile + 1024 + h * 128 + lane * 4);
        s2[mi][h] = Tr::scale2(static_cast<uint16_t>((t & 1) ? (pair >> 16) : (pair & 0xffffu)));
      }
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint32_t b[NT][2][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4 v = *reinterpret_cast<const uint4*>(xs + j * 8 * kXRow + ((16 * w) ^ x_swz));
        b[j][0][0] = __byte_perm(v.x, v.z, 0x5410);  // e0, e4
        b[j][0][1] = __byte_perm(v.x, v.z, 0x7632);  // e1, e5
        b[j][1][0] = __byte_perm(v.y, v.w, 0x5410);  // e2, e6
        b[j][1][1] = __byte_perm(v.y, v.w, 0x7632);  // e3, e7
      }
#pragma unroll
      for (int mi = 0; mi < MT; ++mi) {
        uint32_t p0[4], p1[4];
        Tr::dequant(reinterpret_cast<const uint32_t*>(&wq[mi][0])[w], s2[mi][0], p0);
        Tr::dequant(reinterpret_cast<const uint32_t*>(&wq[mi][1])[w], s2[mi][1], p1);
        const uint32_t a0[4] = {p0[0], p1[0], p0[1], p1[1]};
        const uint32_t a1[4] = {p0[2], p1[2], p0[3], p1[3]};
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          Tr::mma(acc[w & (NACC - 1)][mi][j], a0, b[j][0][0], b[j][0][1]);
          Tr::mma(acc[w & (NACC - 1)][mi][j], a1, b[j][1][0], b[j][1][1]);
        }
      }
    }
    }  // ks
  }
  cp_async_wait<0>();

  // acc[.][mi][j][c] of lane (g, t): y[row 8 j + 2 t + (c & 1)][out row0 + 16 mi + g + 8 (c >> 1)].
  if constexpr (KC == 1) {
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float v = acc[0][mi][j][c];
          if (NACC == 2) v += acc[NACC - 1][mi][j][c];
          const int r = 8 * j + 2 * t + (c & 1);
          const int o = row0 + 16 * mi + g + 8 * (c >> 1);
          if (r < n_rows && o < n_out) y[size_t(r) * n_out + o] = Tr::from_float(v);
        }
  } else {
    __syncthreads();  // every warp is past its last read of the rings
    float* part = reinterpret_cast<float*>(wring);
#pragma unroll
    for (int mi = 0; mi < MT; ++mi)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float v = acc[0][mi][j][c];
          if (NACC == 2) v += acc[NACC - 1][mi][j][c];
          part[((mi * NT + j) * 4 + c) * 32 + lane] = v;
        }
    cluster_sync_all();  // every block's partial sums are visible to the cluster
    // Rank kc sums (in rank order) and writes the slice [kc E / KC, (kc + 1) E / KC) of the
    // block's E = WN MT NT 128 outputs.
    constexpr int kPerWarp = MT * NT * 128;
    constexpr int kSlice = WN * kPerWarp / KC;
    const uint32_t smem_a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    for (int e = kc * kSlice + tid; e < (kc + 1) * kSlice; e += WN * 32) {
      const int wv = e / kPerWarp, el = e % kPerWarp;
      const int l = el & 31, c = (el >> 5) & 3, tile = el >> 7;
      const int j = tile % NT, mi = tile / NT;
      const int r = 8 * j + 2 * (l & 3) + (c & 1);
      const int o = block_row0 + 16 * (wv * MT + mi) + (l >> 2) + 8 * (c >> 1);
      if (r < n_rows && o < n_out) {
        const uint32_t a = smem_a + wv * kWarpRing + 4 * el;
        float v = 0.f;
#pragma unroll
        for (int q = 0; q < KC; ++q) v += ld_cluster_f32(a, q);
        y[size_t(r) * n_out + o] = Tr::from_float(v);
      }
    }
    cluster_sync_all();  // no block exits while the others read its shared memory
  }
}

}  // namespace ignis_q4
