"""The one table of compiled non-linear kernel libraries: what each exports, and how the runtime binds it.

A CUDA artifact may carry libraries of hand-written kernels besides its linears (``modules/<card>/``,
one manifest `kernels` entry per export: kind, symbol, file, dtypes). Each row of `LIBRARIES` says,
for one library: its file name, its exports (manifest kind, symbol) in build order, the dtypes each
export takes, which exports must all be listed in one file for the library to be used at all
(`KernelLibrary.required`; the others are taken when listed in the same file and exported), and the
binding the runtime wraps the loaded functions in (`KernelLibrary.bind`).

The compiler's build table (``ignis.compiler.build.modules.KERNELS``) is derived from these rows, so
an export, a file name or a dtype list is written once. A new kind is a row here, its kind in
``ignis.formats.manifest.KERNEL_ABIS``, a builder in ``ignis.compiler.kernels`` and a rule in the
compiler's ``select_kernels``.

`load_library` opens one library of an artifact with the lean TVM runtime (no ``ignis.compiler``, no
``import tvm``); `ignis.runtime.artifact.Artifact.kernel_library` calls it once per library and
falls back to torch (logged) when it cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignis.formats.manifest import KernelEntry, Manifest
from ignis.runtime.kernels import fused_mixers, fused_norms, gdn_recurrent, moe_experts, topk

__all__ = ["ALL_DTYPES", "LIBRARIES", "KernelLibrary", "load_library"]

#: Every input dtype the non-linear kernels' exports dispatch on (their *_ffi.cuh), ascending.
ALL_DTYPES = ("bfloat16", "float16", "float32")

#: `KernelLibrary.bind`: (loaded functions by manifest kind, the manifest entries by kind) -> binding.
Binder = Callable[[Mapping[str, Any], Mapping[str, KernelEntry]], Any]


@dataclass(frozen=True)
class KernelLibrary:
    """One compiled library of non-linear kernels (a row of `LIBRARIES`).

    Attributes:
        name: the library's name (the key in `LIBRARIES`; the compiler's builder is
            ``ignis.compiler.kernels.<name>.build_<name>``).
        file: its file name under ``modules/<card>/``.
        exports: (manifest kernel kind, exported symbol) per function, in build order.
        required: the kinds that must all be listed, in one file, for the runtime to use the library;
            the other exports are optional (taken when listed in that file and exported).
        what: what the library is, in log messages ("row norms").
        fallback: what runs instead when it is not used, in log messages.
        bind: wraps the loaded functions (by kind) in the runtime's binding.
        dtypes: the input dtypes every export takes (ascending), unless `export_dtypes` names them.
        export_dtypes: (manifest kernel kind, its dtypes) for exports that take fewer.
    """

    name: str
    file: str
    exports: tuple[tuple[str, str], ...]
    required: tuple[str, ...]
    what: str
    fallback: str
    bind: Binder
    dtypes: tuple[str, ...] = ALL_DTYPES
    export_dtypes: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def optional(self) -> tuple[str, ...]:
        """The exports' kinds that are not `required`, in build order."""
        return tuple(kind for kind, _symbol in self.exports if kind not in self.required)

    def kind_dtypes(self, kind: str) -> tuple[str, ...]:
        """The input dtypes the export of `kind` takes."""
        return dict(self.export_dtypes).get(kind, self.dtypes)


def _same_names(names: Sequence[str]) -> tuple[tuple[str, str], ...]:
    return tuple((name, name) for name in names)


def _bind_topk(funcs: Mapping[str, Any], entries: Mapping[str, KernelEntry]) -> topk.TopKModule:
    return topk.TopKModule(funcs[topk.FUNCTION_NAME], dtypes=entries[topk.FUNCTION_NAME].dtypes)


#: Every non-linear kernel library, by name, in the order a build compiles them.
LIBRARIES: dict[str, KernelLibrary] = {
    "topk": KernelLibrary(
        name="topk",
        file="topk.so",
        exports=_same_names((topk.FUNCTION_NAME,)),
        required=(topk.FUNCTION_NAME,),
        what="top-k",
        fallback="the drafter selects in torch",
        bind=_bind_topk,
    ),
    "gdn_recurrent": KernelLibrary(
        name="gdn_recurrent",
        file="gdn_recurrent.so",
        exports=_same_names(gdn_recurrent.FUNCTION_NAMES),
        required=(gdn_recurrent.FUNCTION_NAME,),
        what="GDN recurrence",
        fallback="rounds run the torch recurrence",
        # one of the stash round and the replay without the other: the record path
        # (GdnRecurrentKernel takes the pair only when both are there), not the torch recurrence
        bind=lambda funcs, _entries: gdn_recurrent.GdnRecurrentKernel(dict(funcs)),
        export_dtypes=((gdn_recurrent.REPLAY_FUNCTION_NAME, ("float32",)),),
    ),
    "fused_norms": KernelLibrary(
        name="fused_norms",
        file="fused_norms.so",
        exports=_same_names(fused_norms.FUNCTION_NAMES),
        required=fused_norms.REQUIRED_FUNCTION_NAMES,
        what="row norms",
        fallback="rounds run the torch norms",
        bind=lambda funcs, _entries: fused_norms.FusedNormsKernel(dict(funcs)),
    ),
    "fused_mixers": KernelLibrary(
        name="fused_mixers",
        file="fused_mixers.so",
        exports=_same_names(fused_mixers.FUNCTION_NAMES),
        required=fused_mixers.REQUIRED_FUNCTION_NAMES,
        what="mixer pieces",
        fallback="rounds run the torch mixer ops",
        bind=lambda funcs, _entries: fused_mixers.FusedMixersKernel(dict(funcs)),
        export_dtypes=(
            ("gated_attention", ("bfloat16", "float16")),
            ("grouped_attention", ("bfloat16", "float16")),
        ),
    ),
    "moe_experts": KernelLibrary(
        name="moe_experts",
        file="moe_experts.so",
        exports=_same_names(moe_experts.FUNCTION_NAMES),
        required=moe_experts.REQUIRED_FUNCTION_NAMES,
        what="grouped MoE experts",
        fallback="MoE layers run one linear per routed expert",
        bind=lambda funcs, _entries: moe_experts.MoeExpertsKernel(dict(funcs)),
    ),
}


def load_library(lib: KernelLibrary, root: Path, manifest: Manifest) -> Any:
    """Load `lib` from the artifact at `root` and bind it: every `required` kind's function, and each
    optional kind that the manifest lists in the same file and the library exports.

    The caller has checked that the manifest lists every required kind, all in one file.

    Raises:
        TvmRuntimeError: the library cannot be loaded (no TVM runtime libraries, a bad file), or it
            lacks a required function.
    """
    from ignis.runtime.kernels.module import optional_export
    from ignis.runtime.kernels.tvm_runtime import TvmRuntimeError, load_module

    entries = {kind: manifest.kernel(kind) for kind, _symbol in lib.exports}
    file = entries[lib.required[0]].file  # type: ignore[union-attr]
    path = root / file
    module = load_module(path, cuda=True)
    funcs: dict[str, Any] = {}
    for kind in lib.required:
        name = entries[kind].name  # type: ignore[union-attr]
        try:
            funcs[kind] = module[name]
        except Exception as exc:  # tvm_ffi raises AttributeError or its own errors
            raise TvmRuntimeError(f"compiled module {path} has no function {name!r}: {exc}") from exc
    for kind in lib.optional:
        entry = entries[kind]
        if entry is not None and entry.file == file:
            func = optional_export(module, entry.name)
            if func is not None:
                funcs[kind] = func
    listed = {kind: e for kind, e in entries.items() if e is not None}
    return lib.bind(funcs, listed)
