// Host side of the tiled q4_g32 kernel (q4_tiled.cuh): argument checks, the stream-K workspace and
// the launch. A module built by ignis.compiler.kernels.q4_tiled includes this header and
// instantiates IGNIS_Q4T_EXPORT once per exported function.
//
// Workspace: one fp32 buffer per CUDA device, shared by every function of the module (launches on
// one stream run one after another; programmatic dependent launch lets the next kernel start
// early, but it touches the workspace only after griddepcontrol.wait). Its floats hold kSlotEmpty
// between launches (every launch restores the slots it used). It grows on a call that needs more
// (cudaMalloc on the tensors' device, filled with kSlotEmpty in stream order; the old buffers are
// kept, never freed, so graphs captured with them stay valid); growing is refused while the stream
// is being captured into a CUDA graph, so a function must run before capture at the fewest and the
// most rows it will be called with (the need peaks at one end of the range; `LinearBackend.place`
// does it). Concurrent launches of these functions on two streams of one device are not supported.
#pragma once

#include <mutex>

#include "ffi_checks.cuh"
#include "q4_linear_ffi.cuh"
#include "q4_tiled.cuh"

namespace ignis_q4 {

struct TiledWorkspace {
  float* ws = nullptr;
  size_t ws_bytes = 0;
};

inline std::mutex& tiled_mutex() {
  static std::mutex m;
  return m;
}

inline TiledWorkspace& tiled_workspace(int device) {
  static TiledWorkspace per_device[64];
  TVM_FFI_CHECK(device >= 0 && device < 64, ValueError) << "q4_tiled: CUDA device id " << device << " out of range";
  return per_device[device];
}

// Make the device's workspace at least ws_bytes; returns it, every float kSlotEmpty. Superseded
// buffers are kept, never freed: a CUDA graph captured with them keeps replaying into valid memory
// (they grow a few times per process at most: a few MB).
inline TiledWorkspace& tiled_reserve(const char* name, int device, cudaStream_t stream, size_t ws_bytes) {
  TiledWorkspace& w = tiled_workspace(device);
  if (w.ws_bytes >= ws_bytes) return w;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(stream, &status);
  TVM_FFI_CHECK(e == cudaSuccess, RuntimeError) << name << ": " << cudaGetErrorString(e);
  TVM_FFI_CHECK(status == cudaStreamCaptureStatusNone, RuntimeError)
      << name << ": the stream-K workspace must grow to " << ws_bytes << " bytes, which cannot happen "
      << "during CUDA-graph capture: call the function once at its fewest and most rows before capturing";
  int prev_device = 0;
  e = cudaGetDevice(&prev_device);
  TVM_FFI_CHECK(e == cudaSuccess, RuntimeError) << name << ": " << cudaGetErrorString(e);
  e = cudaSetDevice(device);  // allocate on the tensors' device
  TVM_FFI_CHECK(e == cudaSuccess, RuntimeError) << name << ": " << cudaGetErrorString(e);
  float* ws = nullptr;
  e = cudaMalloc(&ws, ws_bytes);
  if (e == cudaSuccess) {  // every float kSlotEmpty (0xff bytes), in stream order and complete
                           // before any other stream uses it
    e = cudaMemsetAsync(ws, 0xff, ws_bytes, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  }
  cudaSetDevice(prev_device);
  TVM_FFI_CHECK(e == cudaSuccess, RuntimeError)
      << name << ": cannot allocate " << ws_bytes << " bytes of workspace: " << cudaGetErrorString(e);
  w.ws = ws;
  w.ws_bytes = ws_bytes;
  return w;
}

// x: [R, K] f16|bf16; qweight: [T, K/128, 256] u32|i32; scales: [T, K/128, 64] f16; y: [R, N] like x,
// T = ceil(N / 16).
inline void q4_tiled_check_args(const char* name, int max_rows, const TensorView& x, const TensorView& qweight,
                                const TensorView& scales, const TensorView& y) {
  using ignis_ffi::inner_contiguous;
  TVM_FFI_CHECK(is_contiguous_2d(x) && is_contiguous_2d(y), ValueError)
      << name << ": x and y must be contiguous 2-d tensors";
  TVM_FFI_CHECK(qweight.ndim() == 3 && scales.ndim() == 3 && inner_contiguous(qweight, 3) &&
                    inner_contiguous(scales, 3),
                ValueError)
      << name << ": qweight and scales must be contiguous tiled tensors [T, K/128, 256] and [T, K/128, 64]";
  const int64_t rows = x.size(0), k_in = x.size(1), n_out = y.size(1);
  TVM_FFI_CHECK(rows >= 1 && rows <= max_rows, ValueError)
      << name << ": compiled for 1.." << max_rows << " rows, got " << rows;
  TVM_FFI_CHECK(k_in % kStepK == 0 && k_in > 0, ValueError)
      << name << ": in_features must be a positive multiple of " << kStepK << ", got " << k_in;
  const int64_t tiles = (n_out + 15) / 16;
  TVM_FFI_CHECK(qweight.size(0) == tiles && qweight.size(1) * kStepK == k_in && qweight.size(2) == 256 &&
                    scales.size(0) == tiles && scales.size(1) * kStepK == k_in && scales.size(2) == 64,
                ValueError)
      << name << ": for y [" << rows << ", " << n_out << "] and K = " << k_in << " the tiled qweight must be ["
      << tiles << ", " << k_in / kStepK << ", 256] and scales [" << tiles << ", " << k_in / kStepK
      << ", 64], got [" << qweight.size(0) << ", " << qweight.size(1) << ", " << qweight.size(2) << "] and ["
      << scales.size(0) << ", " << scales.size(1) << ", " << scales.size(2) << "]";
  TVM_FFI_CHECK(y.size(0) == rows, ValueError) << name << ": y must have x's " << rows << " rows";
  TVM_FFI_CHECK(n_out >= 1, ValueError) << name << ": y must have at least one output feature";
  for (const TensorView* t : {&x, &qweight, &scales}) {  // the kernel's 16-byte loads
    TVM_FFI_CHECK(reinterpret_cast<uintptr_t>(ignis_ffi::ptr(*t)) % 16 == 0, ValueError)
        << name << ": x, qweight and scales must start on 16-byte boundaries";
  }
  TVM_FFI_CHECK((dtype_is(qweight, kDLUInt, 32) || dtype_is(qweight, kDLInt, 32)) && dtype_is(scales, kDLFloat, 16),
                TypeError)
      << name << ": qweight must be uint32 (or int32 bits) and scales float16";
  TVM_FFI_CHECK(x.dtype().code == y.dtype().code && x.dtype().bits == y.dtype().bits, TypeError)
      << name << ": y must have x's dtype";
  ignis_ffi::check_cuda(name, {&x, &qweight, &scales, &y});
  TVM_FFI_CHECK(k_in <= INT32_MAX && n_out <= INT32_MAX && tiles * (k_in / kStepK) <= INT32_MAX, ValueError)
      << name << ": shape too large";
}

// Resident blocks per SM of `kernel` (cached per instantiation by the caller), at most `cap`.
template <typename K>
int tiled_blocks_per_sm(K kernel, int threads, size_t smem, int cap) {
  int n = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem);
  TVM_FFI_CHECK(e == cudaSuccess, RuntimeError) << "q4_tiled: occupancy query failed: " << cudaGetErrorString(e);
  TVM_FFI_CHECK(n > 0, RuntimeError) << "q4_tiled: not one block of " << threads << " threads with " << smem
                                     << " bytes of shared memory fits on an SM";
  return cap > 0 && n > cap ? cap : n;
}

// Most launches one call is split into (tile ranges of whole groups, one after another) when the
// block's activations for the whole weight do not fit in shared memory but those of a slice do (a
// wide stacked weight at many rows): each launch streams fewer units a block, so fewer k-steps.
constexpr int kMaxTileChunks = 4;

// One call's operands once checked (q4_tiled_check_args): x [rows, k_in] and y [rows, n_out] contiguous.
struct TiledArgs {
  const void* x;
  void* y;
  const uint4* qw;
  const uint4* sc;
  int64_t rows, k_in, n_out;
  int device;
  cudaStream_t stream;
};

// Rows a call is split into when its block activations do not fit in shared memory at its row count
// but do at this many (the 2-n-tile kernel, a launch per such row slice): a wide weight at 17-32 rows
// (the 248,320 x 5,120 lm head) streams its weights twice through the block kernel rather than once
// through the warp kernel, which reads every unit's activations from L1 (docs/perf/log/ run 61).
constexpr int kRowSlice = 16;

template <typename T, int NT, int MT, int WARPS, int D, bool POST, int MINB, int BPS, int RING, bool XDB, int MODE,
          int XS, int XR, int XK>
void q4_tiled_launch_t(const char* name, const TiledArgs& args, bool pdl) {
  auto kernel = q4_tiled_kernel<T, NT, MT, WARPS, D, POST, MINB, RING, XDB, MODE, XS, XR, XK>;
  const int64_t rows = args.rows, k_in = args.k_in, n_out = args.n_out;
  const int device = args.device;
  // Per instantiation: SMs, and resident blocks per SM for the last shared-memory size asked.
  static int cached_device = -1, sms = 0, bps = 0, smem_cap = 0;
  static size_t cached_smem = 0;
  // The dynamic shared-memory limit raised for this kernel, per device (a function attribute is
  // set per device): 0 = the default 48 KiB until `raise_smem_limit` raises it.
  static size_t raised_per_device[64];
  TVM_FFI_CHECK(device >= 0 && device < 64, ValueError) << name << ": CUDA device id " << device << " out of range";
  size_t& raised_smem = raised_per_device[device];
  const int n_tiles = static_cast<int>((n_out + 15) / 16);
  const int tiles_per_group = XS ? WARPS * MT : MT;
  const int n_groups = (n_tiles + tiles_per_group - 1) / tiles_per_group;
  const int64_t steps = k_in / kStepK;
  // The plan of one launch over `groups` groups: shared memory, workers, whether XS fits.
  struct Plan {
    size_t smem = 0;
    int n_workers = 0;
    bool fits = true;
  };
  auto raise_limit = [&](size_t smem) {  // the kernel's dynamic shared-memory limit, under tiled_mutex
    ignis_ffi::raise_smem_limit(name, kernel, smem, raised_smem);
  };
  auto plan_for = [&](int groups, int64_t plan_rows) {
    Plan pl;
    const int64_t units = groups * steps;
    pl.smem = RING == 2 ? static_cast<size_t>(WARPS) * tiled_lane_ring_bytes<MT, D>() : 0;
    bool uncapped = false;  // XS: only without the workers-a-group cap
    std::lock_guard<std::mutex> lock(tiled_mutex());
    if (cached_device != device) {
      cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
      TVM_FFI_CHECK(e == cudaSuccess, RuntimeError) << name << ": " << cudaGetErrorString(e);
      e = cudaDeviceGetAttribute(&smem_cap, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
      TVM_FFI_CHECK(e == cudaSuccess, RuntimeError) << name << ": " << cudaGetErrorString(e);
      cached_device = device;
      cached_smem = SIZE_MAX;
    }
    // At most kMaxParts workers a group: the group's first worker gathers the others' partials, a
    // round trip a slot (tiled_add_slots); a narrow weight (few groups) then runs on fewer SMs
    // rather than split its groups 30 ways and pay ~30 round trips in every tail.
    const int64_t g_parts = kMaxParts * static_cast<int64_t>(groups);
    const int64_t cap = units < g_parts ? units : g_parts;
    if (XS) {
      // The activations of at most min(S, ceil(U / P)) k-steps, P = min(SMs x blocks per SM, cap):
      // start from BPS blocks a SM and step down while that much shared memory does not fit them.
      // A narrow but deep weight whose capped workers' activations do not fit takes the uncapped
      // count (more partials a group, gathered in more passes) before the caller splits the launch
      // or falls back to the warp kernel.
      int target = BPS > 0 ? BPS : 1;
      for (;;) {
        const int64_t p_all = static_cast<int64_t>(sms) * target;
        const int64_t p_capped = p_all < cap ? p_all : cap;
        auto smem_for = [&](int64_t p_workers) {  // the kernel's XS layouts (q4_tiled.cuh)
          const int64_t span = (units + p_workers - 1) / p_workers;
          const size_t n_xs = static_cast<size_t>(span < steps ? span : steps);
          const size_t xs = XS == 3   ? static_cast<size_t>(XR) * plan_rows * (256 * XK + 64)  // any span
                            : XS == 2 ? plan_rows * (256 * n_xs + 64)
                                      : n_xs * plan_rows * 320;
          return xs + 128 + (RING == 2 ? static_cast<size_t>(WARPS) * tiled_lane_ring_bytes<MT, D>() : 0);
        };
        pl.smem = smem_for(p_capped);
        uncapped = false;
        if (pl.smem > static_cast<size_t>(smem_cap) && p_capped < p_all) {
          pl.smem = smem_for(p_all < units ? p_all : units);
          uncapped = true;
        }
        if (pl.smem > static_cast<size_t>(smem_cap)) {
          pl.fits = false;
          return pl;
        }
        raise_limit(pl.smem);
        bps = tiled_blocks_per_sm(kernel, WARPS * 32, pl.smem, target);
        if (bps >= target || target == 1) break;
        target = bps;
      }
      cached_smem = SIZE_MAX;  // recomputed per call (depends on the rows)
    } else if (pl.smem != cached_smem) {
      raise_limit(pl.smem);
      bps = tiled_blocks_per_sm(kernel, WARPS * 32, pl.smem, BPS);
      cached_smem = pl.smem;
    }
    const int64_t want = static_cast<int64_t>(sms) * bps * (XS ? 1 : WARPS);
    const int64_t limit = uncapped ? units : cap;
    pl.n_workers = static_cast<int>(want < limit ? want : limit);
    return pl;
  };
  // XS: the fewest tile ranges (of whole groups) whose launches fit in shared memory.
  int chunks = 1;
  Plan pl = plan_for(n_groups, rows);
  if constexpr (XS != 0) {
    while (!pl.fits && chunks < kMaxTileChunks && chunks < n_groups) {
      ++chunks;
      pl = plan_for((n_groups + chunks - 1) / chunks, rows);
    }
    if (!pl.fits) {
      if constexpr (NT * 8 > kRowSlice) {
        // Slices of kRowSlice rows through the 2-n-tile block kernel (scales after the mma, as the
        // rules at those rows), when that many rows fit with tile-range splits -- always above 4
        // n-tiles, whose activations a warp kernel could not hold in registers (the slices fall
        // back to the 2-n-tile warp kernel themselves).
        const int most = n_groups < kMaxTileChunks ? n_groups : kMaxTileChunks;
        if (NT > 4 || plan_for((n_groups + most - 1) / most, kRowSlice).fits) {
          for (int64_t r0 = 0; r0 < rows; r0 += kRowSlice) {
            TiledArgs sub = args;
            sub.rows = rows - r0 < kRowSlice ? rows - r0 : kRowSlice;
            sub.x = static_cast<const T*>(args.x) + r0 * k_in;
            sub.y = static_cast<T*>(args.y) + r0 * n_out;
            // (a ring's slices take whole-span staging: the slices' spans are what fits)
            q4_tiled_launch_t<T, kRowSlice / 8, MT, WARPS, D, true, MINB, BPS, RING, XDB, MODE, (XS == 3 ? 2 : XS),
                              0, 1>(name, sub, pdl);
          }
          return;
        }
      }
      if constexpr (NT <= 4) {
        // Too many activation bytes for shared memory even in kMaxTileChunks launches (a wide call
        // on a very wide weight): the warp kernel, activations through L1, same layout and numerics.
        q4_tiled_launch_t<T, NT, MT, 4, D, POST, (NT <= 2 ? 4 : 2), 0, 0, XDB, MODE, 0, 0, 1>(name, args, pdl);
        return;
      }
    }
  }
  cudaStream_t stream = args.stream;
  const int groups_per_chunk = (n_groups + chunks - 1) / chunks;
  const uint4* qw = args.qw;
  const uint4* sc = args.sc;
  T* yp = static_cast<T*>(args.y);
  for (int c = 0; c < chunks; ++c) {
    const int g0 = c * groups_per_chunk;
    const int groups = (g0 + groups_per_chunk < n_groups ? groups_per_chunk : n_groups - g0);
    if (groups <= 0) break;
    const int t0 = g0 * tiles_per_group;
    const int tiles = (t0 + groups * tiles_per_group < n_tiles ? groups * tiles_per_group : n_tiles - t0);
    const int64_t out_c = (static_cast<int64_t>(t0 + tiles) * 16 < n_out ? static_cast<int64_t>(tiles) * 16
                                                                        : n_out - static_cast<int64_t>(t0) * 16);
    if (groups != groups_per_chunk) pl = plan_for(groups, rows);  // a shorter last range
    const int n_outs = XS ? groups * WARPS : groups;  // output groups: workspace slots
    const int64_t units = groups * steps;
    const int blocks = XS ? pl.n_workers : (pl.n_workers + WARPS - 1) / WARPS;
    // Workers covering one group: at most ceil((S - 2) / floor(U / P)) + 2.
    const int64_t per = units / pl.n_workers;
    const int slots = steps >= 2 ? static_cast<int>((steps - 2 + per - 1) / per + 2) : 1;
    TiledWorkspace* w;
    {
      std::lock_guard<std::mutex> lock(tiled_mutex());
      w = &tiled_reserve(name, device, stream, static_cast<size_t>(n_outs) * slots * MT * NT * 128 * sizeof(float));
    }
    const size_t unit0 = static_cast<size_t>(t0) * steps;  // the range's first (tile, k-step) unit
    // the shared-memory limit was raised by plan_for: launch_pdl finds it raised (no attribute call)
    launch_pdl(kernel, pdl, raised_smem, dim3(static_cast<unsigned>(blocks)), dim3(WARPS * 32), pl.smem, stream, 1u,
               static_cast<const T*>(args.x), qw + unit0 * kUnitWords4, sc + unit0 * kUnitScales4,
               yp + static_cast<size_t>(t0) * 16, w->ws, static_cast<int>(rows), static_cast<int>(out_c),
               static_cast<int>(n_out), static_cast<int>(k_in), tiles, groups, slots, pl.n_workers);
    ignis_ffi::check_launch(name);
  }
}

template <int NT, int MT, int WARPS, int D, bool POST, int MINB, int BPS, bool PDL, int RING, bool XDB, int MODE,
          int XS, int XR, int XK>
void q4_tiled_launch(const char* name, TensorView x, TensorView qweight, TensorView scales, TensorView y) {
  q4_tiled_check_args(name, 8 * NT, x, qweight, scales, y);
  const TiledArgs args{ignis_ffi::ptr(x),
                       ignis_ffi::ptr(y),
                       static_cast<const uint4*>(ignis_ffi::ptr(qweight)),
                       static_cast<const uint4*>(ignis_ffi::ptr(scales)),
                       x.size(0),
                       x.size(1),
                       y.size(1),
                       x.device().device_id,
                       ignis_ffi::stream_of(x)};
  if (dtype_is(x, kDLFloat, 16)) {
    q4_tiled_launch_t<half, NT, MT, WARPS, D, POST, MINB, BPS, RING, XDB, MODE, XS, XR, XK>(name, args, PDL);
  } else if (dtype_is(x, kDLBfloat, 16)) {
    q4_tiled_launch_t<__nv_bfloat16, NT, MT, WARPS, D, POST, MINB, BPS, RING, XDB, MODE, XS, XR, XK>(name, args,
                                                                                                  PDL);
  } else {
    TVM_FFI_THROW(TypeError) << name << ": x must be float16 or bfloat16";
  }
}

}  // namespace ignis_q4

// Export `NAME(x, qweight, scales, y)` (tiled layout) for up to 8*NT rows.
// MT tiles a warp unit, WARPS warps a block, D units in the ring, POST: scales applied after the
// mma, MINB: __launch_bounds__ min blocks, BPS: resident blocks per SM launched (0: as many as
// fit), PDL: programmatic dependent launch, RING: 0 registers, 2 per-lane cp.async,
// XDB: next unit's activations in registers, MODE: 0 compute, 1 stream only, 2 no fixups, 3 no
// wait, 4 math only (the diagnostics: wrong output), XS: 0 warp workers, 1 block workers whose
// activations are staged in shared memory once by cp.async, 2 the same staged by bulk copies, 3
// block workers reading a ring of XR slots of XK k-steps of activations refilled by bulk copies
// (XR: 0 unless XS 3).
#define IGNIS_Q4T_EXPORT(NAME, NT, MT, WARPS, D, POST, MINB, BPS, PDL, RING, XDB, MODE, XS, XR, XK)  \
  static void ignis_q4t_##NAME(tvm::ffi::TensorView x, tvm::ffi::TensorView qweight,                 \
                               tvm::ffi::TensorView scales, tvm::ffi::TensorView y) {                \
    ::ignis_q4::q4_tiled_launch<NT, MT, WARPS, D, POST, MINB, BPS, PDL, RING, XDB, MODE, XS, XR, XK>( \
        #NAME, x, qweight, scales, y);                                                               \
  }                                                                                                 \
  TVM_FFI_DLL_EXPORT_TYPED_FUNC(NAME, ignis_q4t_##NAME)
