"""ignis.runtime.kernels: the runtime side of every compiled kernel.

The compiler (``ignis.compiler.kernels``) owns the kernel sources (``*.cuh``), their nvcc builds and
their CPU models; this package owns what a deployment host needs to run what it built, without
``ignis.compiler`` or the TVM compiler installed:

* the ABI of each library: export names, limits, and the size and shared-memory formulas the
  host side must agree on (the compiler's builders import them from here, the direction ADR 0000
  allows);
* the bindings the executors call: `gdn_recurrent.GdnRecurrentKernel`,
  `fused_norms.FusedNormsKernel`, `fused_mixers.FusedMixersKernel`, `topk.TopKModule` (with the
  exact torch top-k beside it);
* `registry.LIBRARIES`: one row per compiled non-linear library (file, exports, dtypes, binding),
  from which `ignis.runtime.artifact.Artifact.kernel_library` loads an artifact's libraries and the
  compiler derives its build table;
* `tvm_runtime`: the lean TVM runtime (tvm-ffi and TVM's runtime libraries, no ``import tvm``);
* `q4_tiled`: the tiled q4_g32 weight layout the CUDA "tiled" linear kernel streams.
"""
