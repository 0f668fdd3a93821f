// Programmatic dependent launch, device side (CUDA programming guide, "Programmatic Dependent
// Launch"; PTX ISA griddepcontrol). The fused norms' host launches them with the attribute on
// sm_90+ (`ignis_ffi::launch_maybe_pdl`), so such a kernel may start while the previous kernel on the
// stream is finishing: it calls `pdl_grid_wait` before it touches memory an earlier kernel may write
// (constant weights may be read before it: `narrow_linear`), and `pdl_grid_trigger` to
// let the next kernel launch early (that kernel waits in turn). Both are no-ops before sm_90. (The
// same for the GDN recurrence and the fused mixers was not faster: the perf log, docs/perf/log/,
// run 46.)
#pragma once

namespace ignis_pdl {

__device__ __forceinline__ void pdl_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_grid_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

}  // namespace ignis_pdl
