"""The one nvcc build the hand-written CUDA kernel modules share (q4_linear, q4_tiled, topk,
gdn_recurrent, fused_norms, fused_mixers, moe_experts): a tvm-ffi shared library with SASS for one
arch only (no PTX).

:func:`build_cuda_module` writes the module's source into a temporary directory next to the
destination, runs nvcc there and moves the library into place atomically, so a reader never sees a
half-written file. :func:`target_dict`, :func:`cuda_arch` and :func:`find_nvcc` read a build target
and find the toolkit for every builder (each raises the builder's own error type).

The fixed-export libraries (topk, gdn_recurrent, fused_norms, fused_mixers, moe_experts) are rows
of one table, :data:`KERNEL_BUILDS`: the headers the translation unit includes, its export lines
(names from the runtime's ABI, ``ignis.runtime.kernels``), the files whose bytes key the build cache, and the
oldest arch it compiles for; :func:`build_kernel_library` builds any row. Their
``build_<name>`` functions only name the row and their error type.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ignis.runtime.kernels import fused_mixers, fused_norms, gdn_recurrent, moe_experts, topk

KERNEL_DIR = Path(__file__).resolve().parent


class CudaBuildError(ValueError):
    """A CUDA kernel library cannot be built: not a CUDA target, a bad arch, or nvcc missing (the
    default error type of the helpers below; each builder passes its own)."""


def target_dict(target: Any, *, error: type[Exception] = CudaBuildError) -> dict[str, Any]:
    """A build target as a dict: ``"sm_90"`` -> ``{"kind": "cuda", "arch": "sm_90"}``, ``"llvm"`` /
    ``"cpu"`` -> ``{"kind": "llvm"}``, a mapping as is, a ``tvm.target.Target`` exported.

    Raises:
        error: any other value.
    """
    if isinstance(target, str):
        if target in ("llvm", "cpu"):
            return {"kind": "llvm"}
        if target.startswith("sm_"):
            return {"kind": "cuda", "arch": target}
        raise error(
            f"unknown target {target!r}: use a dict such as {{'kind': 'cuda', 'arch': 'sm_90'}} or 'llvm'"
        )
    if isinstance(target, Mapping):
        return dict(target)
    export = getattr(target, "export", None)
    if callable(export):  # a tvm.target.Target
        return dict(export())
    raise error(f"unknown target {target!r}")


def cuda_arch(target: Mapping[str, Any], *, error: type[Exception] = CudaBuildError) -> str:
    """The ``sm_NN`` arch of a CUDA target dict (an ``a`` suffix allowed).

    Raises:
        error: no such arch.
    """
    arch = str(target.get("arch", ""))
    if not arch.startswith("sm_") or not arch[3:].rstrip("a").isdigit():
        raise error(f"a CUDA target needs an arch such as 'sm_90', got {arch!r}")
    return arch


def find_nvcc(*, error: type[Exception] = CudaBuildError) -> str:
    """nvcc: ``$NVCC``, else the one on ``PATH``, else ``/usr/local/cuda/bin/nvcc``.

    Raises:
        error: none of them exists.
    """
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    raise error("nvcc not found: install the CUDA toolkit or set NVCC")


def tvm_ffi_paths() -> tuple[Path, Path]:
    """tvm-ffi's include directory and the directory holding libtvm_ffi."""
    import tvm_ffi.libinfo as libinfo

    include = Path(libinfo.find_include_path())
    lib = Path(libinfo.find_libtvm_ffi()).parent
    return include, lib


def sm_number(arch: str) -> int | None:
    """The number of an ``sm_NN`` arch, its ``a`` / ``f`` suffixes aside (``sm_90a`` -> 90), or None for
    anything else."""
    digits = arch[3:].rstrip("af") if arch.startswith("sm_") else ""
    return int(digits) if digits.isdigit() else None


def gencode(arch: str) -> str:
    """nvcc's ``-gencode`` value for SASS of ``arch`` only: ``sm_90`` -> ``arch=compute_90,code=sm_90``."""
    num = arch[3:]
    return f"arch=compute_{num},code=sm_{num}"


def nvcc_command(
    nvcc: str,
    arch: str,
    src: Path,
    out: Path,
    *,
    extra_flags: Sequence[str] = (),
    verbose: bool = False,
) -> list[str]:
    """The nvcc command line every kernel module is built with (``-Xptxas=-v`` second when verbose)."""
    include, lib = tvm_ffi_paths()
    cmd = [
        nvcc,
        "-std=c++17",
        "-O3",
        "-shared",
        "-Xcompiler",
        "-fPIC,-fvisibility=hidden",
        "-gencode",
        gencode(arch),
        f"-I{KERNEL_DIR}",
        f"-I{include}",
        f"-L{lib}",
        "-ltvm_ffi",
        *extra_flags,
        "-o",
        str(out),
        str(src),
    ]
    if verbose:
        cmd.insert(1, "-Xptxas=-v")
    return cmd


def exports_source(header: str, exports: Mapping[str, Any]) -> str:
    """The ``.cu`` translation unit that includes ``header`` and instantiates each (name, config)
    export (``config.export_line(name)``: the export macros of the q4 kernels' host headers)."""
    lines = [f'#include "{header}"', ""]
    lines += [cfg.export_line(name) for name, cfg in exports.items()]
    return "\n".join(lines) + "\n"


def build_cuda_module(
    source: str,
    arch: str,
    out_path: str | os.PathLike[str],
    *,
    nvcc: str,
    src_name: str,
    error: type[Exception],
    extra_flags: Sequence[str] = (),
    verbose: bool = False,
) -> Path:
    """Compile ``source`` (a ``.cu`` translation unit, written as ``src_name`` in a temporary
    directory; it includes headers from this directory) into the shared library ``out_path``.

    Raises ``error`` with the command and the tail of nvcc's stderr when nvcc fails; prints nvcc's
    stderr (ptxas' register and shared-memory report) when ``verbose``.
    """
    dest = Path(out_path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        src = Path(tmp) / src_name
        src.write_text(source)
        tmp_out = Path(tmp) / dest.name
        cmd = nvcc_command(nvcc, arch, src, tmp_out, extra_flags=extra_flags, verbose=verbose)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise error(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        if verbose:
            print(proc.stderr)
        os.replace(tmp_out, dest)
    return dest


# --------------------------------------------------------------------------------------------
# The fixed-export libraries: one table, one builder.


def resolve_cuda_target(target: Any, *, not_cuda: str, error: type[Exception]) -> tuple[str, str]:
    """``(arch, nvcc)`` for a CUDA target; ``error`` when the target is not CUDA (``not_cuda``, then
    the target), has no valid arch, or nvcc is missing."""
    tdict = target_dict(target, error=error)
    if tdict.get("kind") != "cuda":
        raise error(f"{not_cuda}, got target {tdict}")
    return cuda_arch(tdict, error=error), find_nvcc(error=error)


@dataclass(frozen=True)
class KernelBuild:
    """How one fixed-export kernel library is built (a row of :data:`KERNEL_BUILDS`).

    Attributes:
        not_cuda: the error message for a target that is not CUDA.
        headers: the ``*_ffi.cuh`` headers the translation unit includes, in order.
        exports: its export lines (the headers' export macros).
        sources: the files whose bytes key the cache (names in this directory, or absolute paths:
            the runtime ABI module the export names and limits come from).
        min_sm: the oldest arch it compiles for (None: any) and the error message for an older one.
    """

    not_cuda: str
    headers: tuple[str, ...]
    exports: tuple[str, ...]
    sources: tuple[str, ...]
    min_sm: tuple[int, str] | None = None

    def source(self) -> str:
        """The ``.cu`` translation unit."""
        includes = "".join(f'#include "{h}"\n' for h in self.headers)
        return includes + "\n" + "".join(f"{line}\n" for line in self.exports)


#: The fixed-export kernel libraries by name (the runtime registry's names,
#: ``ignis.runtime.kernels.registry.LIBRARIES``; the cache folder and the ``<name>_module.cu`` file).
KERNEL_BUILDS: dict[str, KernelBuild] = {
    "topk": KernelBuild(
        not_cuda="the top-k kernel is CUDA only",
        headers=("topk_ffi.cuh",),
        exports=(f"IGNIS_TOPK_EXPORT({topk.FUNCTION_NAME})",),
        sources=(
            "topk.cuh",
            "topk_ffi.cuh",
            "ffi_checks.cuh",
            "dtypes.cuh",
            "topk.py",
            "cuda_build.py",
            topk.__file__,
        ),
    ),
    "gdn_recurrent": KernelBuild(
        not_cuda="the GDN recurrence kernel is CUDA only",
        headers=("gdn_recurrent_ffi.cuh",),
        exports=(
            f"IGNIS_GDN_RECURRENT_EXPORT({gdn_recurrent.FUNCTION_NAME})",
            f"IGNIS_GDN_STASH_EXPORT({gdn_recurrent.STASH_FUNCTION_NAME})",
            f"IGNIS_GDN_REPLAY_EXPORT({gdn_recurrent.REPLAY_FUNCTION_NAME})",
        ),
        sources=(
            "gdn_recurrent.cuh",
            "gdn_recurrent_ffi.cuh",
            "ffi_checks.cuh",
            "dtypes.cuh",
            "gdn_recurrent.py",
            "cuda_build.py",
            gdn_recurrent.__file__,
        ),
    ),
    "fused_norms": KernelBuild(
        not_cuda="the fused norms are CUDA only",
        headers=("fused_norms_ffi.cuh",),
        exports=("IGNIS_FUSED_NORMS_EXPORT()",),
        sources=(
            "fused_norms.cuh",
            "fused_norms_ffi.cuh",
            "ffi_checks.cuh",
            "pdl.cuh",
            "dtypes.cuh",
            "fused_norms.py",
            "cuda_build.py",
            fused_norms.__file__,
        ),
    ),
    "fused_mixers": KernelBuild(
        not_cuda="the fused mixers are CUDA only",
        headers=("fused_mixers_ffi.cuh", "gated_attention_ffi.cuh"),
        exports=("IGNIS_FUSED_MIXERS_EXPORT()", "IGNIS_GATED_ATTENTION_EXPORT()"),
        sources=(
            "fused_mixers.cuh",
            "fused_mixers_ffi.cuh",
            "gated_attention.cuh",
            "gated_attention_ffi.cuh",
            "ffi_checks.cuh",
            "dtypes.cuh",
            "fused_mixers.py",
            "cuda_build.py",
            fused_mixers.__file__,
        ),
        min_sm=(80, "the fused mixers need sm_80 or newer"),  # gated_attention: mma.m16n8k16, cp.async
    ),
    "moe_experts": KernelBuild(
        not_cuda="the grouped MoE expert kernels are CUDA only",
        headers=("moe_experts_ffi.cuh",),
        exports=("IGNIS_MOE_EXPERTS_EXPORT()",),
        sources=(
            "moe_experts.cuh",
            "moe_experts_ffi.cuh",
            "ffi_checks.cuh",
            "dtypes.cuh",
            "moe_experts.py",
            "cuda_build.py",
            moe_experts.__file__,
        ),
    ),
}


def build_kernel_library(
    name: str,
    target: Any,
    *,
    error: type[Exception],
    out_path: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> Path:
    """Compile the :data:`KERNEL_BUILDS` library ``name`` for a CUDA arch; return the ``.so`` path.

    Args:
        name: a key of :data:`KERNEL_BUILDS`.
        target: ``"sm_90"``, ``"sm_120"``... or ``{"kind": "cuda", "arch": "sm_90"}``.
        error: the exception type raised (the kernel module's own).
        out_path: where to write it; default a cache file keyed by arch and sources
            (``$IGNIS_CACHE_DIR/<name>/``), reused when present.
        verbose: print ptxas' register and shared-memory report.

    Raises:
        error: not a CUDA target, an arch older than the row's ``min_sm``, nvcc missing, or nvcc
            failed (its stderr included).
        KeyError: no such library.
    """
    build = KERNEL_BUILDS[name]
    arch, nvcc = resolve_cuda_target(target, not_cuda=build.not_cuda, error=error)
    if build.min_sm is not None:
        number, too_old = sm_number(arch), build.min_sm
        if number is None or number < too_old[0]:
            raise error(f"{too_old[1]}, got {arch!r}")
    dest, reuse = cached_module_path(name, arch, build.sources, out_path)
    if reuse:
        return dest
    return build_cuda_module(
        build.source(), arch, dest, nvcc=nvcc, src_name=f"{name}_module.cu", error=error, verbose=verbose
    )


def cache_dir(name: str) -> Path:
    """``$IGNIS_CACHE_DIR/<name>`` (default ``$XDG_CACHE_HOME/ignis/<name>``, ``~/.cache/ignis/<name>``)."""
    root = os.environ.get("IGNIS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ignis"
    )
    return Path(root) / name


def sources_hash(names: Sequence[str]) -> str:
    """A short hash of the named files (names in this directory, or absolute paths)."""
    h = hashlib.sha256()
    for name in names:
        h.update((KERNEL_DIR / name).read_bytes())
    return h.hexdigest()[:16]


def cached_module_path(
    name: str, arch: str, sources: Sequence[str], out_path: str | os.PathLike[str] | None
) -> tuple[Path, bool]:
    """``(destination, reuse)``: ``out_path`` when given (always rebuilt), else the cache file
    ``<name>_<arch>_<hash of arch and sources>.so``, reused when it exists."""
    if out_path is not None:
        return Path(out_path), False
    digest = hashlib.sha256(f"{arch}|{sources_hash(sources)}".encode()).hexdigest()[:16]
    dest = cache_dir(name) / f"{name}_{arch}_{digest}.so"
    return dest, dest.exists()
