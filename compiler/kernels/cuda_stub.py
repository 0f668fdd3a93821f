"""A build-time stand-in for the CUDA driver (``libcuda.so.1``), for hosts with no GPU driver.

TVM's CUDA runtime library links against ``libcuda.so.1``. When that cannot be loaded, TVM quietly
falls back to embedding CUDA *source* in exported modules instead of a binary. Loading this stub
(every entry point returns ``CUDA_ERROR_NO_DEVICE``) before ``import tvm`` lets codegen emit a cubin
with nvcc. It is used only while building and is never shipped or loaded by the runtime.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import tempfile
from pathlib import Path

__all__ = ["ensure_cuda_driver_or_stub", "import_tvm_for_build"]

# The driver entry points that libtvm_runtime_cuda.so (apache-tvm 0.27) takes from libcuda.so.1.
_DRIVER_SYMBOLS = (
    "cuDeviceGetName",
    "cuFuncSetAttribute",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuLaunchKernelEx",
    "cuModuleGetFunction",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuTensorMapEncodeTiled",
)
_CUDA_ERROR_NO_DEVICE = 100

_loaded: ctypes.CDLL | None = None


def _stub_source() -> str:
    lines = ["/* ignis build-time libcuda.so.1 stub: no device, every call fails. */"]
    lines += [f"int {name}(void) {{ return {_CUDA_ERROR_NO_DEVICE}; }}" for name in _DRIVER_SYMBOLS]
    return "\n".join(lines) + "\n"


def _stub_dir() -> Path:
    root = os.environ.get("IGNIS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ignis"
    )
    return Path(root) / "cuda_stub"


def build_stub(out_dir: Path | None = None) -> Path:
    """Compile the stub (once) and return the path of the shared library."""
    out_dir = out_dir or _stub_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libcuda.so.1"
    src_text = _stub_source()
    stamp = out_dir / "libcuda_stub.c"
    if lib.exists() and stamp.exists() and stamp.read_text() == src_text:
        return lib
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / "stub.c"
        src.write_text(src_text)
        tmp_lib = Path(tmp) / "libcuda.so.1"
        cc = os.environ.get("CC", "cc")
        subprocess.run(
            [cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(tmp_lib), str(src)],
            check=True,
        )
        os.replace(tmp_lib, lib)
        stamp.write_text(src_text)
    return lib


def ensure_cuda_driver_or_stub() -> str:
    """Make ``libcuda.so.1`` loadable: the real driver if there is one, else the stub.

    Returns ``"driver"`` or ``"stub"``. Must run before the first ``import tvm`` in the process.
    """
    global _loaded
    if _loaded is not None:
        return "stub"
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
        return "driver"
    except OSError:
        pass
    _loaded = ctypes.CDLL(str(build_stub()), mode=ctypes.RTLD_GLOBAL)
    return "stub"


def import_tvm_for_build():  # type: ignore[no-untyped-def]
    """Import tvm for cross-compiling CUDA modules: driver or stub first, nvcc as the compiler."""
    import sys

    if "tvm" not in sys.modules:
        ensure_cuda_driver_or_stub()
    os.environ.setdefault("TVM_CUDA_COMPILE_MODE", "nvcc")
    import tvm

    return tvm
