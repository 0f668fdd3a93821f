"""Step 5: TVM modules for every verify row width of the card, covering every linear shape.

Which linears (`linear_shapes`): every tensor the executors hand to a linear layer as its weight
(`convert.is_linear_weight`) in the target, the grafted drafter, the MTP head and the shortlist head,
as [N, K] = (out_features, in_features); fused expert stacks [E, N, K] count per expert (the
executor slices them: gate_up[e, :I], gate_up[e, I:], down[e]); a tied output head is the embedding;
and the executors' own fusions (`FUSED_LINEARS`: llama/qwen2 concatenate the trunk's q/k/v and
gate/up rows into one weight, the hybrid families q/k/v, the GDN's qkv/z and the dense MLP's
gate/up) replace their members.

Which functions, per card:

* `cpu` (arch `llvm`): every linear, `dense` for float weights and `q4_g32` for q4 ones, built by
  `llvm_linear` (TensorIR scheduled for the CPU), one library per width: `modules/cpu/linear_w{W}.so`.
* CUDA cards: the q4_g32 linears (float weights run on cuBLAS through torch). Shapes with
  K % 128 == 0 take the CUDA route `Q4_CUDA_ROUTE` picks (a build option: `plan_modules`'
  `q4_cuda_route`), one library per 8-row tile count, serving every width up to its rows (dynamic
  rows):

  - "tiled" (the default): the stream-K kernel over the tiled weight layout
    (`ignis.compiler.kernels.q4_tiled`, configurations from `tiled_config_for(8 T, N, K, arch)`),
    `modules/<card>/q4_tiled_nt{T}.so`, route "cuda-tiled", functions `q4t_n{N}_k{K}` of kind
    "q4_g32_tiled" (the runtime re-lays those weights when it places them on the GPU);
  - "mma": the tensor-core mma kernel over the stored layout (`ignis.compiler.kernels.q4_linear`),
    `modules/<card>/q4_mma_nt{T}.so`, route "cuda-mma", functions `q4_n{N}_k{K}` of kind "q4_g32".

  With the build option `q4_pad_k` (a recipe's ``[modules] q4_pad_k = true``; off by default) the
  q4 shapes whose K is a multiple of 32 but not of 128 take the tiled route too: their functions
  (`q4t_n{N}_k{K}_pad{K'}`, the manifest's ``padded_in_features`` = K') compute over K padded with
  zero columns to K' = the next multiple of 128; the runtime pads the tiled weight (code 8, scale 0:
  exact zeros) when it places it and the activations (zeros), so the product equals the unpadded
  one. The rest go on the TensorIR route with dlight's schedules (`modules/<card>/q4_tir_w{W}.so`, fixed
  rows, kind "q4_g32", builder `ignis.compiler.kernels.q4_linear`). Only that route (and the `cpu`
  card's) needs the TVM compiler package `tvm`; the nvcc-built libraries need tvm-ffi and nvcc alone,
  so a CUDA build whose every q4 linear has K % 128 == 0 runs where `tvm` is not installed
  (`tvm_shapes` lists what needs it, `require_tvm` refuses a plan that needs it there). The tiled / mma
  libraries of the tile counts compile in parallel (one nvcc each, `build_workers()` at a time).
  Cross-compiled with nvcc on a host without a GPU (the libcuda stub of
  `compiler/kernels/cuda_stub.py` keeps TVM from embedding CUDA source); every exported library is
  checked to hold SASS for the card's arch and neither PTX nor CUDA source.
  The nvcc-built libraries are stripped of their static symbol table (`strip_local_symbols`), which
  would otherwise carry nvcc's per-process temporary file names: builds are byte-reproducible.
  Besides the linears, a CUDA card gets the non-linear kernel libraries (`KERNELS`) the model uses
  (`select_kernels`), each built with nvcc by its `ignis.compiler.kernels` builder in worker threads
  beside the q4 builds, then stripped and checked like them, listed as files of role "module" and
  recorded in the manifest's `kernels` (formats/manifest.py), one entry per exported function:

  - `modules/<card>/topk.so` (`topk.build_topk`, kind `topk`): the drafter's exact top-k, only
    when a DFlash2 drafter is grafted (its selector walk is the only caller);
  - `modules/<card>/gdn_recurrent.so` (`gdn_recurrent.build_gdn_recurrent`, kind `gdn_recurrent`):
    the fused Gated DeltaNet verify-round recurrence, for the hybrid families (qwen3_5,
    qwen3_5_moe, qwen3_next) when the kernel takes the config's shapes (`gdn_kernel_fits`:
    linear_key_head_dim <= 256, value heads a multiple of key heads);
  - `modules/<card>/fused_norms.so` (`fused_norms.build_fused_norms`, kinds `add_rms_norm`,
    `gated_rms_norm`, `silu_mul`, `narrow_linear` and `add_rms_norm_llama`): the hybrid families'
    fused residual-add + RMSNorm and gated RMSNorm, the dense MLP's SwiGLU activation and the GDN's
    b|a projection; for llama and qwen2, the residual add + HF LlamaRMSNorm and the SwiGLU
    activation of `StaticLlamaExecutor`, whose RoPE + KV write is `fused_mixers.so`'s `rope_kv`;
  - `modules/<card>/fused_mixers.so` (`fused_mixers.build_fused_mixers`, kinds `gdn_conv_silu`,
    `qk_norm_rope_kv` and `gated_attention`): the hybrid families' GDN conv1d + SiLU, attention
    q/k norm + RoPE + KV write and the gated attention itself (bf16 / f16 only; head_dims it does not
    take keep SDPA at run time), when the kernels take the config's shapes (`mixers_kernel_fits`:
    conv taps 2..8, head_dim <= 1024, an even rotary dim).

  Each exports its functions for float32, bfloat16 and float16 inputs, whatever the card's dtypes:
  one artifact serves any activation dtype, and compiling fewer dtypes would save little build time
  (the host code, not the per-dtype kernels, dominates nvcc's time).

Function names: `dense_n{N}_k{K}`, `q4_n{N}_k{K}` and (tiled) `q4t_n{N}_k{K}`; the kernels' as their
`KERNELS` exports.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignis.compiler.build.convert import is_linear_weight
from ignis.compiler.build.errors import ModuleBuildError
from ignis.compiler.build.llvm_linear import LinearSpec, build_llvm_module, llvm_target
from ignis.compiler.kernels.q4_linear import MAX_ROWS as _MMA_MAX_ROWS
from ignis.formats.manifest import KERNEL_ABIS, KernelEntry, ModuleEntry, ModuleFunction, padded_k
from ignis.runtime.families import FAMILIES
from ignis.runtime.kernels.fused_mixers import MAX_CONV_KERNEL as _MIXERS_MAX_CONV_KERNEL
from ignis.runtime.kernels.fused_mixers import MAX_HEAD_DIM as _MIXERS_MAX_HEAD_DIM
from ignis.runtime.kernels.gdn_recurrent import MAX_KEY_DIM as _GDN_MAX_KEY_DIM
from ignis.runtime.kernels.registry import LIBRARIES

#: Executor fusions per family: (module path under each layer, member projections concatenated in
#: this order along the output rows). The executor runs one linear over the fused weight. The same
#: table the runtime's families declare (`Family.fused_linears`: the loader leaves the members in the
#: stored layout, the executor fuses and then places them).
FUSED_LINEARS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    model_type: family.fused_linears for model_type, family in FAMILIES.items() if family.fused_linears
}

#: Activation dtype of the compiled functions, by the profile's other_dtype.
ACTIVATION_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}

#: The CUDA routes' k-step (mma and tiled): in_features must be a multiple of it.
MMA_STEP_K = 128

#: The CUDA route of the q4 shapes with K % 128 == 0 when a build does not choose: "tiled" (the
#: stream-K kernel over the tiled layout, `q4_tiled_nt{T}.so`) or "mma" (`q4_mma_nt{T}.so`).
Q4_CUDA_ROUTE = "tiled"

#: `plan_modules`' q4_cuda_route -> the ModuleEntry route name.
Q4_CUDA_ROUTES = {"tiled": "cuda-tiled", "mma": "cuda-mma"}

@dataclass(frozen=True)
class KernelLibrary:
    """One compiled library of non-linear kernels (a row of `KERNELS`): the runtime registry's row
    (`ignis.runtime.kernels.registry.LIBRARIES`: file, exports, dtypes) plus the builder.

    Attributes:
        file: its file name under modules/<card>/.
        builder: "module:function" under `ignis.compiler.kernels`, called as
            `function({"kind": "cuda", "arch": arch}, out_path=dest)` (nvcc, SASS for that arch).
        exports: (manifest kernel kind, exported symbol) per function the library exports; one
            manifest `kernels` entry each.
        dtypes: the input dtypes every export takes (ascending), unless `export_dtypes` names them.
        export_dtypes: (manifest kernel kind, its dtypes) for exports that take fewer.
    """

    file: str
    builder: str
    exports: tuple[tuple[str, str], ...]
    dtypes: tuple[str, ...]
    export_dtypes: tuple[tuple[str, tuple[str, ...]], ...] = ()


#: Non-linear kernel libraries a CUDA card may get (`select_kernels` picks them per model):
#: library name -> `KernelLibrary`, one row per row of the runtime's registry, built by
#: ``ignis.compiler.kernels.<name>.build_<name>``. A new kind is a row in the registry, its kind in
#: `formats.manifest` (`KERNEL_ABIS`), its builder, and a rule in `select_kernels`.
KERNELS: dict[str, KernelLibrary] = {
    name: KernelLibrary(lib.file, f"{name}:build_{name}", lib.exports, lib.dtypes, lib.export_dtypes)
    for name, lib in LIBRARIES.items()
}

#: The fused GDN kernel's limit on the key head dim (`ignis.runtime.kernels.gdn_recurrent.MAX_KEY_DIM`).
GDN_MAX_KEY_DIM: int = _GDN_MAX_KEY_DIM


def gdn_kernel_fits(config: Any) -> bool:
    """Whether the fused GDN kernel takes a hybrid config's Gated DeltaNet shapes: it has GDN layers
    (`layer_types` holds "linear_attention"), linear_key_head_dim <= `GDN_MAX_KEY_DIM` and
    linear_num_value_heads a multiple of linear_num_key_heads (the limits `StaticHybridExecutor`'s
    `gdn_module` checks). False for a config without those fields."""
    try:
        layers = tuple(config.layer_types)
        dk, hv, hk = (
            int(config.linear_key_head_dim),
            int(config.linear_num_value_heads),
            int(config.linear_num_key_heads),
        )
    except (AttributeError, TypeError, ValueError):
        return False
    return "linear_attention" in layers and 1 <= dk <= GDN_MAX_KEY_DIM and hk >= 1 and hv % hk == 0


#: The fused mixers' limits (`ignis.runtime.kernels.fused_mixers`): GDN conv taps (2..MAX_CONV_KERNEL)
#: and attention head dim (<= MAX_HEAD_DIM).
MIXERS_MAX_CONV_KERNEL: int = _MIXERS_MAX_CONV_KERNEL
MIXERS_MAX_HEAD_DIM: int = _MIXERS_MAX_HEAD_DIM


def mixers_kernel_fits(config: Any) -> bool:
    """Whether the fused mixers (`gdn_conv_silu`, `qk_norm_rope_kv`) take a hybrid config's shapes,
    the limits their exports check (fused_mixers_ffi.cuh): with GDN layers ("linear_attention" in
    `layer_types`) 2 <= linear_conv_kernel_dim <= `MIXERS_MAX_CONV_KERNEL`; with attention layers
    ("full_attention") 1 <= head_dim <= `MIXERS_MAX_HEAD_DIM`, the rotary dim even and <= head_dim,
    num_attention_heads + num_key_value_heads <= 65535; at least one of the two kinds. False for a
    config without those fields."""
    try:
        layers = tuple(config.layer_types)
        taps, hd, rot = int(config.linear_conv_kernel_dim), int(config.head_dim), int(config.rotary_dim)
        heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    except (AttributeError, TypeError, ValueError):
        return False
    gdn, attention = "linear_attention" in layers, "full_attention" in layers
    gdn_fits = 2 <= taps <= MIXERS_MAX_CONV_KERNEL
    attention_fits = (
        1 <= hd <= MIXERS_MAX_HEAD_DIM
        and 0 <= rot <= hd
        and rot % 2 == 0
        and heads >= 1
        and kv_heads >= 1
        and heads + kv_heads <= 65535
    )
    return (gdn or attention) and (gdn_fits or not gdn) and (attention_fits or not attention)


def select_kernels(*, config: Any = None, dflash2: bool = False) -> tuple[str, ...]:
    """The `KERNELS` libraries a CUDA card's artifact gets, in build order.

    Args:
        config: the target's family config (None: no model-dependent kernel).
        dflash2: a DFlash2 drafter is grafted (its selector walk is the top-k's only caller).

    Returns:
        "topk" with a DFlash2 drafter; "fused_norms" for llama and qwen2 configs (the
        `StaticLlamaExecutor`'s ``add_rms_norm_llama`` and ``silu_mul``) and "fused_mixers" when
        their head_dim is even and at most `MIXERS_MAX_HEAD_DIM` (its ``rope_kv``); for hybrid configs
        (qwen3_5, qwen3_5_moe, qwen3_next: the `StaticHybridExecutor` families) "gdn_recurrent" when
        `gdn_kernel_fits`, "fused_norms", "fused_mixers" when `mixers_kernel_fits`, and
        "moe_experts" when `moe_kernel_fits` (MoE configs: the grouped routed-expert linears).
    """
    from ignis.runtime.families.llama import LlamaConfig, Qwen2Config
    from ignis.runtime.families.qwen3_5 import HybridConfig

    out: list[str] = []
    if dflash2:
        out.append("topk")
    if isinstance(config, LlamaConfig | Qwen2Config):
        out.append("fused_norms")  # add_rms_norm_llama and silu_mul (`StaticLlamaExecutor`)
        hd = config.head_dim or config.hidden_size // config.num_attention_heads
        if 1 <= hd <= MIXERS_MAX_HEAD_DIM and hd % 2 == 0:
            out.append("fused_mixers")  # rope_kv
    if isinstance(config, HybridConfig):
        if gdn_kernel_fits(config):
            out.append("gdn_recurrent")
        out.append("fused_norms")
        if mixers_kernel_fits(config):
            out.append("fused_mixers")
        if moe_kernel_fits(config):
            out.append("moe_experts")
    return tuple(out)


def moe_kernel_fits(config: Any) -> bool:
    """Whether the grouped expert kernels (`ignis.runtime.kernels.moe_experts`) take a config's routed
    experts: a MoE config (`is_moe`) with experts, hidden_size and moe_intermediate_size multiples
    of 32 (the q4_g32 groups the kernels stream) and num_experts_per_tok <= `MAX_PAIRS`. False for a
    config without those fields."""
    from ignis.runtime.kernels.moe_experts import MAX_PAIRS

    try:
        moe = bool(config.is_moe)
        experts, top_k = int(config.num_experts), int(config.num_experts_per_tok)
        hidden, inter = int(config.hidden_size), int(config.moe_intermediate_size)
    except (AttributeError, TypeError, ValueError):
        return False
    return moe and experts >= 1 and 1 <= top_k <= MAX_PAIRS and hidden % 32 == 0 and inter % 32 == 0


@dataclass(frozen=True, order=True)
class LinearShape:
    """One linear to compile: weight [out_features, in_features] of `kind` ("dense" or "q4_g32")."""

    kind: str
    out_features: int
    in_features: int

    @property
    def function_name(self) -> str:
        """The exported symbol: dense_n{N}_k{K} or q4_n{N}_k{K}."""
        short = "q4" if self.kind == "q4_g32" else "dense"
        return f"{short}_n{self.out_features}_k{self.in_features}"


# The target trunk's layers only: a grafted drafter's and the MTP head's layers run unfused.
_LAYER = re.compile(r"^(?P<p>model\.layers\.\d+)\.(?P<m>[a-z_]+)\.(?P<w>[a-z_]+)\.weight$")


def linear_shapes(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    *,
    family: str,
    tie_word_embeddings: bool = False,
) -> list[LinearShape]:
    """Every linear shape the executors run over the artifact's tensors (module docstring).

    Args:
        tensors: stored name -> (stored dtype, logical shape), all parts of the artifact.
        family: the target's model_type (selects `FUSED_LINEARS`).
        tie_word_embeddings: the output head is `model.embed_tokens.weight`.

    Returns:
        Sorted unique shapes.
    """
    out: set[LinearShape] = set()
    fused_members: set[str] = set()
    for path, members in FUSED_LINEARS.get(family, ()):
        groups: dict[str, list[str]] = {}
        for name in tensors:
            m = _LAYER.match(name)
            if m and m.group("m") == path and m.group("w") in members:
                groups.setdefault(m.group("p"), []).append(name)
        for prefix, names in groups.items():
            full = [f"{prefix}.{path}.{w}.weight" for w in members]
            if sorted(names) != sorted(full):
                continue
            dtypes = {tensors[n][0] for n in full}
            ks = {tensors[n][1][-1] for n in full}
            if len(dtypes) != 1 or len(ks) != 1:
                continue  # mixed: the executor cannot fuse them into one weight of one dtype
            fused_members.update(full)
            rows = sum(tensors[n][1][0] for n in full)
            out.add(_shape(dtypes.pop(), rows, ks.pop()))
    for name, (dtype, shape) in tensors.items():
        if name in fused_members or not is_linear_weight(name, shape):
            continue
        if len(shape) == 2:
            out.add(_shape(dtype, shape[0], shape[1]))
        elif name.endswith("gate_up_proj"):
            out.add(_shape(dtype, shape[1] // 2, shape[2]))
        else:
            out.add(_shape(dtype, shape[1], shape[2]))
    if tie_word_embeddings and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        dtype, shape = tensors["model.embed_tokens.weight"]
        out.add(_shape(dtype, shape[0], shape[1]))
    return sorted(out)


def _shape(dtype: str, n: int, k: int) -> LinearShape:
    return LinearShape("q4_g32" if dtype == "q4_g32" else "dense", int(n), int(k))


@dataclass(frozen=True)
class ModulePlan:
    """What step 5 compiles.

    Attributes:
        card: card profile name (the folder under modules/).
        arch: "llvm" or a CUDA arch ("sm_90", "sm_120").
        widths: verify row widths to compile (ascending).
        shapes: the linears to compile at every width.
        dtype: activation dtype ("float32", "bfloat16", "float16").
        target: the TVM target dict.
        kernels: the non-linear kernel libraries to build (keys of `KERNELS`; CUDA cards only).
        q4_cuda_route: the CUDA route of the K % 128 == 0 q4 shapes, a key of `Q4_CUDA_ROUTES`
            ("tiled" or "mma"; `Q4_CUDA_ROUTE` when not given).
        q4_pad_k: with the "tiled" route, the q4 shapes with K % 128 != 0 (K % 32 == 0) take it too:
            their functions compute over K padded with zero columns to the next multiple of 128
            (`padded_k`; the manifest's ``padded_in_features``, the runtime pads the weight when it
            tiles it and the activations), instead of the TensorIR route. Off by default.
    """

    card: str
    arch: str
    widths: tuple[int, ...]
    shapes: tuple[LinearShape, ...]
    dtype: str
    target: dict[str, Any]
    kernels: tuple[str, ...] = ()
    q4_cuda_route: str = ""
    q4_pad_k: bool = False

    def __post_init__(self) -> None:
        if not self.q4_cuda_route:
            object.__setattr__(self, "q4_cuda_route", Q4_CUDA_ROUTE)
        if self.q4_cuda_route not in Q4_CUDA_ROUTES:
            raise ModuleBuildError(
                f"q4_cuda_route must be one of {sorted(Q4_CUDA_ROUTES)}, got {self.q4_cuda_route!r}"
            )
        mma = self.is_cuda and any(self.route(s) == "cuda-mma" for s in self.shapes)
        if mma and self.widths and max(self.widths) > _MMA_MAX_ROWS:
            raise ModuleBuildError(
                f"the mma q4 route compiles at most {_MMA_MAX_ROWS} rows, the plan asks for width "
                f"{max(self.widths)}: use the tiled route (up to 64 rows) or narrower widths"
            )

    @property
    def is_cuda(self) -> bool:
        """CUDA card (else the host CPU)."""
        return self.arch != "llvm"

    def route(self, shape: LinearShape) -> str:
        """ "llvm-te", "cuda-tiled" / "cuda-mma" (per `q4_cuda_route`) or "tir-dlight"."""
        if not self.is_cuda:
            return "llvm-te"
        if shape.in_features % MMA_STEP_K == 0:
            return Q4_CUDA_ROUTES[self.q4_cuda_route]
        if self.pads(shape):
            return "cuda-tiled"
        return "tir-dlight"

    def pads(self, shape: LinearShape) -> bool:
        """Whether the shape takes the tiled route over K padded to a multiple of 128 (`q4_pad_k`)."""
        return (
            self.is_cuda
            and self.q4_pad_k
            and self.q4_cuda_route == "tiled"
            and shape.kind == "q4_g32"
            and shape.in_features % MMA_STEP_K != 0
            and shape.in_features % 32 == 0
        )

    def tvm_shapes(self) -> tuple[LinearShape, ...]:
        """The linears whose route needs the TVM compiler (`llvm-te`, `tir-dlight`)."""
        return tuple(s for s in self.shapes if self.route(s) in ("llvm-te", "tir-dlight"))

    def num_functions(self) -> int:
        """Functions compiled in all (one per shape and width, tiled / mma libraries shared across
        widths, plus each kernel library's exports)."""
        if not self.is_cuda:
            return len(self.shapes) * len(self.widths) + self._kernel_functions()
        mma = [s for s in self.shapes if self.route(s) in ("cuda-mma", "cuda-tiled")]
        tir = len(self.shapes) - len(mma)
        tiles = {(w + 7) // 8 for w in self.widths}
        return len(mma) * len(tiles) + tir * len(self.widths) + self._kernel_functions()

    def _kernel_functions(self) -> int:
        return sum(len(KERNELS[k].exports) for k in self.kernels)


def plan_modules(
    *,
    card: str,
    arch: str,
    widths: Sequence[int],
    shapes: Sequence[LinearShape],
    other_dtype: str,
    llvm_mcpu: str | None = None,
    config: Any = None,
    dflash2: bool = False,
    q4_cuda_route: str | None = None,
    q4_pad_k: bool = False,
) -> ModulePlan:
    """Choose what to compile: on CUDA cards only the q4_g32 linears, and the `KERNELS` libraries
    `select_kernels(config=config, dflash2=dflash2)` picks (module docstring); CPU cards get no
    kernel library. `q4_cuda_route` ("tiled" or "mma"; None: `Q4_CUDA_ROUTE`) picks the CUDA route
    of the K % 128 == 0 q4 shapes; `q4_pad_k` puts the other q4 shapes (K % 32 == 0) on the tiled
    route too, over K padded to a multiple of 128 (`ModulePlan.q4_pad_k`).

    Raises:
        ModuleBuildError: an unknown q4_cuda_route.
    """
    dtype = ACTIVATION_DTYPES.get(other_dtype, "bfloat16")
    kernels: tuple[str, ...] = ()
    if arch == "llvm":
        target = llvm_target(llvm_mcpu)
        chosen = tuple(shapes)
    else:
        target = {"kind": "cuda", "arch": arch}
        chosen = tuple(s for s in shapes if s.kind == "q4_g32")
        kernels = select_kernels(config=config, dflash2=dflash2)
    return ModulePlan(
        card=card,
        arch=arch,
        widths=tuple(sorted(set(widths))),
        shapes=chosen,
        dtype=dtype,
        target=target,
        kernels=kernels,
        q4_cuda_route=q4_cuda_route or Q4_CUDA_ROUTE,
        q4_pad_k=q4_pad_k,
    )


#: The tiled route's function kind (`formats.manifest.FUNCTION_KINDS`).
TILED_KIND = "q4_g32_tiled"


def tiled_function_name(shape: LinearShape) -> str:
    """The tiled route's exported symbol: q4t_n{N}_k{K}, or q4t_n{N}_k{K}_pad{K'} for a K padded to
    K' = `padded_k(K)` (K % 128 != 0)."""
    base = f"q4t_n{shape.out_features}_k{shape.in_features}"
    if shape.in_features % MMA_STEP_K:
        return f"{base}_pad{padded_k(shape.in_features)}"
    return base


def _functions(
    shapes: Sequence[LinearShape], dtype: str, *, tiled: bool = False
) -> tuple[ModuleFunction, ...]:
    return tuple(
        ModuleFunction(
            name=tiled_function_name(s) if tiled else s.function_name,
            kind=TILED_KIND if tiled else s.kind,
            out_features=s.out_features,
            in_features=s.in_features,
            dtype=dtype,
            padded_in_features=padded_k(s.in_features) if tiled and s.in_features % MMA_STEP_K else None,
        )
        for s in shapes
    )


def check_cuda_binary(path: Path, arch: str) -> None:
    """Require SASS for `arch` only, with neither PTX nor embedded CUDA source.

    Raises:
        ModuleBuildError: naming what the library holds instead.
    """
    from ignis.compiler.kernels.q4_linear import cuda_binary_info

    info = cuda_binary_info(path)
    if info.sass_archs != (arch.rstrip("a"),) or info.has_ptx or info.has_cuda_source:
        raise ModuleBuildError(
            f"{path}: expected a {arch} binary (SASS) only, found SASS for {list(info.sass_archs)}, "
            f"PTX {info.has_ptx}, CUDA source {info.has_cuda_source}; a host without a GPU driver "
            f"needs the libcuda stub loaded before tvm is imported (compiler/kernels/cuda_stub.py) "
            f"and nvcc on PATH"
        )


def _tile_config(kernels: Any, rows: int, shape: LinearShape, arch: str) -> Any:
    """The kernel builder's tile choice for this shape, sized for the arch when it takes one."""
    import inspect

    fn = kernels.default_tile_config
    if "arch" in inspect.signature(fn).parameters:
        return fn(rows, shape.out_features, shape.in_features, arch=arch)
    return fn(rows, shape.out_features, shape.in_features)


def strip_local_symbols(path: Path) -> bool:
    """Drop the static symbol table of an nvcc-built library (`strip --strip-unneeded`).

    nvcc names its intermediate files after the compiler's process id (`tmpxft_<pid>_...`) and those
    names land in local symbols, so two builds of the same source differ by a few bytes. The exported
    functions (`.dynsym`), the code and the embedded cubin are untouched. Returns False when no
    `strip` is installed (the library then stays as built, and the artifact is not byte-reproducible).

    Raises:
        ModuleBuildError: strip ran and failed.
    """
    tool = shutil.which("strip")
    if tool is None:
        return False
    proc = subprocess.run([tool, "--strip-unneeded", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModuleBuildError(f"strip --strip-unneeded {path} failed: {proc.stderr.strip()}")
    return True


def _build_kernel(kind: str, arch: str, dest: Path) -> None:
    """Compile the `KERNELS` library `kind` for a CUDA arch into `dest` (nvcc, in a worker thread).

    Raises:
        ModuleBuildError: no such library, or its builder cannot be imported. The builder's own
            errors (nvcc failures) propagate.
    """
    import importlib

    lib = KERNELS.get(kind)
    if lib is None:
        raise ModuleBuildError(f"no builder for the {kind!r} kernel")
    module_name, func_name = lib.builder.split(":")
    try:
        builder = getattr(importlib.import_module(f"ignis.compiler.kernels.{module_name}"), func_name)
    except (ImportError, AttributeError) as exc:
        raise ModuleBuildError(
            f"the {kind} kernel builder ({lib.builder}) cannot be imported: {exc}"
        ) from exc
    builder({"kind": "cuda", "arch": arch}, out_path=dest)


def _kernel_entries(kind: str, rel: str, plan: ModulePlan) -> list[KernelEntry]:
    lib = KERNELS[kind]
    return [
        KernelEntry(
            name=symbol,
            kind=entry_kind,
            abi=KERNEL_ABIS[entry_kind],
            file=rel,
            target=dict(plan.target),
            dtypes=dict(lib.export_dtypes).get(entry_kind, lib.dtypes),
        )
        for entry_kind, symbol in lib.exports
    ]


def build_modules(
    plan: ModulePlan,
    artifact_dir: Path,
    *,
    on_file: Callable[[str], None] | None = None,
) -> tuple[list[ModuleEntry], list[KernelEntry], list[str]]:
    """Compile the plan into `artifact_dir/modules/<card>/`.

    Args:
        plan: from `plan_modules`.
        artifact_dir: the (temporary) artifact directory.
        on_file: called with each library's relative path once it is written.

    Returns:
        (manifest module entries in width order, manifest kernel entries in `plan.kernels` order,
        relative paths of the libraries written).

    Raises:
        ModuleBuildError: compilation failed, a kernel builder is missing, or a CUDA library does
            not hold a binary for the arch (only). A failure waits for a kernel build in flight.
    """
    rel_dir = f"modules/{plan.card}"
    builds_linears = bool(plan.shapes and plan.widths)
    if not builds_linears and not (plan.is_cuda and plan.kernels):
        return [], [], []
    (artifact_dir / rel_dir).mkdir(parents=True, exist_ok=True)
    entries: list[ModuleEntry] = []
    files: list[str] = []

    def done(rel: str) -> None:
        files.append(rel)
        if on_file is not None:
            on_file(rel)

    if not plan.is_cuda:
        for w in plan.widths:
            rel = f"{rel_dir}/linear_w{w}.so"
            specs = [
                LinearSpec(s.function_name, s.kind, w, s.out_features, s.in_features, plan.dtype)
                for s in plan.shapes
            ]
            build_llvm_module(specs, artifact_dir / rel, target=plan.target)
            done(rel)
            entries.append(
                ModuleEntry(
                    width=w,
                    file=rel,
                    target=dict(plan.target),
                    route="llvm-te",
                    dynamic_rows=False,
                    functions=_functions(plan.shapes, plan.dtype),
                )
            )
        return entries, [], files

    kernels: list[KernelEntry] = []
    # the kernels compile in a worker thread (nvcc subprocesses) while the linears build here
    # (one worker on a 2-core host: the linears' nvcc runs take the other core)
    workers = max(1, min(len(plan.kernels), (os.cpu_count() or 2) - 1))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ignis-kernels") as pool:
        pending: list[tuple[str, str, Future[None]]] = []
        for kind in plan.kernels:
            rel = f"{rel_dir}/{KERNELS[kind].file}"
            pending.append((kind, rel, pool.submit(_build_kernel, kind, plan.arch, artifact_dir / rel)))
        if builds_linears:
            entries = _build_cuda_linears(plan, artifact_dir, rel_dir, done)
        for kind, rel, fut in pending:
            try:
                fut.result()
            except ModuleBuildError:
                raise
            except Exception as exc:  # the kernels' *Error (ValueError), nvcc failures
                raise ModuleBuildError(f"building {rel} ({kind}) for {plan.arch} failed: {exc}") from exc
            strip_local_symbols(artifact_dir / rel)
            check_cuda_binary(artifact_dir / rel, plan.arch)
            done(rel)
            kernels += _kernel_entries(kind, rel, plan)
    return entries, kernels, files


def _build_cuda_linears(
    plan: ModulePlan, artifact_dir: Path, rel_dir: str, done: Callable[[str], None]
) -> list[ModuleEntry]:
    """The q4 linears of a CUDA card (tiled or mma, and TensorIR routes), as `build_modules` describes."""
    entries: list[ModuleEntry] = []
    try:
        from ignis.compiler.kernels import q4_linear as kernels
    except ImportError as exc:
        raise ModuleBuildError(
            f"the q4 kernel builder (ignis.compiler.kernels.q4_linear) cannot be imported: {exc}"
        ) from exc
    tiled = [s for s in plan.shapes if plan.route(s) == "cuda-tiled"]
    mma = [s for s in plan.shapes if plan.route(s) == "cuda-mma"]
    tir = [s for s in plan.shapes if plan.route(s) == "tir-dlight"]
    by_width: dict[int, list[ModuleEntry]] = {w: [] for w in plan.widths}
    if tiled:
        _build_tiled_linears(plan, tiled, artifact_dir, rel_dir, done, by_width)
    if mma:
        _build_nt_libraries(
            plan,
            artifact_dir,
            by_width,
            done,
            rel_of=lambda nt: f"{rel_dir}/q4_mma_nt{nt}.so",
            build=lambda nt, path: kernels.build_q4_cuda_bundle(
                plan.arch, {s.function_name: _tile_config(kernels, 8 * nt, s, plan.arch) for s in mma}, path
            ),
            route="cuda-mma",
            functions=_functions(mma, plan.dtype),
        )
    if tir:
        for w in plan.widths:
            rel = f"{rel_dir}/q4_tir_w{w}.so"
            funcs = {s.function_name: (w, s.out_features, s.in_features, plan.dtype) for s in tir}
            try:
                kernels.build_q4_tir_bundle(plan.target, funcs, artifact_dir / rel, schedule="dlight")
            except Exception as exc:  # TVM errors
                raise ModuleBuildError(f"building {rel} for {plan.arch} failed: {exc}") from exc
            check_cuda_binary(artifact_dir / rel, plan.arch)
            done(rel)
            by_width[w].append(
                ModuleEntry(
                    width=w,
                    file=rel,
                    target=dict(plan.target),
                    route="tir-dlight",
                    dynamic_rows=False,
                    functions=_functions(tir, plan.dtype),
                )
            )
    for w in plan.widths:
        entries += by_width[w]
    return entries


def _build_tiled_linears(
    plan: ModulePlan,
    shapes: Sequence[LinearShape],
    artifact_dir: Path,
    rel_dir: str,
    done: Callable[[str], None],
    by_width: dict[int, list[ModuleEntry]],
) -> None:
    """The "cuda-tiled" libraries: one per 8-row tile count T of the widths, `q4_tiled_nt{T}.so`,
    exporting `q4t_n{N}_k{K}` for every shape (`tiled_config_for(8 T, N, K, arch)`), each stripped
    and checked to hold SASS for the arch only; their entries are appended to `by_width`.

    Raises:
        ModuleBuildError: the builder cannot be imported, nvcc failed, or the library is not a binary
            for the arch only.
    """
    try:
        from ignis.compiler.kernels import q4_tiled
    except ImportError as exc:
        raise ModuleBuildError(
            f"the tiled q4 kernel builder (ignis.compiler.kernels.q4_tiled) cannot be imported: {exc}"
        ) from exc
    _build_nt_libraries(
        plan,
        artifact_dir,
        by_width,
        done,
        rel_of=lambda nt: f"{rel_dir}/q4_tiled_nt{nt}.so",
        build=lambda nt, path: q4_tiled.build_q4_tiled_module(
            plan.arch,
            {
                tiled_function_name(s): q4_tiled.tiled_config_for(
                    8 * nt, s.out_features, padded_k(s.in_features), plan.arch
                )
                for s in shapes
            },
            path,
        ),
        route="cuda-tiled",
        functions=_functions(shapes, plan.dtype, tiled=True),
    )


def _build_nt_libraries(
    plan: ModulePlan,
    artifact_dir: Path,
    by_width: dict[int, list[ModuleEntry]],
    done: Callable[[str], None],
    *,
    rel_of: Callable[[int], str],
    build: Callable[[int, Path], object],
    route: str,
    functions: tuple[ModuleFunction, ...],
) -> None:
    """One dynamic-rows library per 8-row tile count T of the plan's widths (`rel_of(T)`, made by
    `build(T, path)` on `build_workers` threads, one nvcc each), stripped and checked to hold SASS for
    the arch only; an entry of `route` for every width with that T is appended to `by_width`.

    Raises:
        ModuleBuildError: the build failed (nvcc, the kernel builder) or the library is not a binary
            for the arch only.
    """
    tiles = sorted({(w + 7) // 8 for w in plan.widths})
    with ThreadPoolExecutor(max_workers=build_workers(len(tiles)), thread_name_prefix="ignis-nvcc") as pool:
        futures = [pool.submit(build, nt, artifact_dir / rel_of(nt)) for nt in tiles]
        try:
            for nt, fut in zip(tiles, futures, strict=True):
                try:
                    fut.result()
                except Exception as exc:  # Q4KernelError, nvcc failures
                    raise ModuleBuildError(f"building {rel_of(nt)} for {plan.arch} failed: {exc}") from exc
        finally:
            for fut in futures:
                fut.cancel()
    for nt in tiles:
        rel = rel_of(nt)
        strip_local_symbols(artifact_dir / rel)
        check_cuda_binary(artifact_dir / rel, plan.arch)
        done(rel)
        for w in plan.widths:
            if (w + 7) // 8 == nt:
                by_width[w].append(
                    ModuleEntry(
                        width=w,
                        file=rel,
                        target=dict(plan.target),
                        route=route,
                        dynamic_rows=True,
                        functions=functions,
                    )
                )


def tvm_available() -> bool:
    """Whether the TVM compiler package `tvm` can be found (not imported: a CUDA build must load the
    libcuda stub before the first `import tvm`, `prepare_cuda_build`)."""
    import importlib.util

    if "tvm" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("tvm") is not None
    except (ImportError, ValueError):  # an import hook that refuses it, a broken package
        return False


def require_tvm(plan: ModulePlan) -> None:
    """Refuse, before any work, a plan with linears on a TVM route where `tvm` is not installed.

    Raises:
        ModuleBuildError: naming the shapes ([N, K], route) that need TVM and what avoids them.
    """
    need = plan.tvm_shapes()
    if not need or not plan.widths or tvm_available():
        return
    shown = ", ".join(f"[{s.out_features}, {s.in_features}] ({plan.route(s)})" for s in need[:12])
    more = f" and {len(need) - 12} more" if len(need) > 12 else ""
    hint = (
        f"on card {plan.card} only the q4 linears with in_features % {MMA_STEP_K} == 0 build without it"
        if plan.is_cuda
        else "the cpu card compiles every linear with TVM's LLVM backend"
    )
    raise ModuleBuildError(
        f"{len(need)} linear shape(s) need the TVM compiler (pip install 'ignis[compiler]'), which is not "
        f"installed here: {shown}{more}; {hint}"
    )


def build_workers(jobs: int) -> int:
    """nvcc processes run at once for `jobs` libraries: one per core but one, at least 1."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 2
    return max(1, min(jobs, cores - 1))


def prepare_cuda_build() -> str:
    """Before the first `import tvm` of a CUDA build: load the GPU driver, or the build-only stub.

    Returns "driver" or "stub". Raises ModuleBuildError when neither can be loaded.
    """
    try:
        from ignis.compiler.kernels.cuda_stub import ensure_cuda_driver_or_stub
    except ImportError as exc:
        raise ModuleBuildError(f"compiler/kernels/cuda_stub.py cannot be imported: {exc}") from exc
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    already = "tvm" in sys.modules
    try:
        source = ensure_cuda_driver_or_stub()
    except Exception as exc:  # building the stub needs a C compiler
        raise ModuleBuildError(f"cannot load libcuda.so.1 or build its stub: {exc}") from exc
    if already and source == "stub":
        logging.getLogger("ignis.compiler.build").warning(
            "tvm was imported before the libcuda stub was loaded; if TVM embeds CUDA source instead of "
            "a binary the build stops with ModuleBuildError: run CUDA builds in a fresh process"
        )
    return str(source)


__all__ = [
    "ACTIVATION_DTYPES",
    "FUSED_LINEARS",
    "GDN_MAX_KEY_DIM",
    "KERNELS",
    "Q4_CUDA_ROUTE",
    "Q4_CUDA_ROUTES",
    "TILED_KIND",
    "KernelLibrary",
    "LinearShape",
    "ModulePlan",
    "build_modules",
    "build_workers",
    "check_cuda_binary",
    "gdn_kernel_fits",
    "linear_shapes",
    "moe_kernel_fits",
    "plan_modules",
    "prepare_cuda_build",
    "require_tvm",
    "select_kernels",
    "strip_local_symbols",
    "tiled_function_name",
    "tvm_available",
]
