"""The one nvcc build the hand-written CUDA kernel modules share (q4_linear, topk, gdn_recurrent,
fused_norms, fused_mixers): a tvm-ffi shared library with SASS for one arch only (no PTX).

:func:`build_cuda_module` writes the module's source into a temporary directory next to the
destination, runs nvcc there and moves the library into place atomically, so a reader never sees a
half-written file. :func:`resolve_cuda_target` and :func:`cached_module_path` are the target check
and the source-keyed cache that the single-export builders (topk, gdn_recurrent, fused_*) share.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).resolve().parent


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
# What the single-export builders (topk, gdn_recurrent, fused_norms, fused_mixers) share.


def resolve_cuda_target(target: Any, *, not_cuda: str, error: type[Exception]) -> tuple[str, str]:
    """``(arch, nvcc)`` for a CUDA target; ``error`` when the target is not CUDA (``not_cuda``, then
    the target), has no valid arch, or nvcc is missing."""
    from .q4_linear import Q4KernelError, _cuda_arch, _nvcc, _target_dict

    try:
        tdict = _target_dict(target)
        if tdict.get("kind") != "cuda":
            raise error(f"{not_cuda}, got target {tdict}")
        return _cuda_arch(tdict), _nvcc()
    except Q4KernelError as exc:
        raise error(str(exc)) from exc


def cache_dir(name: str) -> Path:
    """``$IGNIS_CACHE_DIR/<name>`` (default ``$XDG_CACHE_HOME/ignis/<name>``, ``~/.cache/ignis/<name>``)."""
    root = os.environ.get("IGNIS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ignis"
    )
    return Path(root) / name


def sources_hash(names: Sequence[str]) -> str:
    """A short hash of the named files in this directory."""
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
