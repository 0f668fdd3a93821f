"""Shared checks of the fused kernels' compiled modules (tests/compiler/test_fused_norms.py,
tests/compiler/test_fused_mixers.py): what a cross-compiled binary holds, and loading one here."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()


def check_sass_and_exports(
    path: Path, arch: str, function_names: Iterable[str], kernels: tuple[str, str]
) -> None:
    """The binary exists, exports every `__tvm_ffi_<name>`, holds both kernels, and (with cuobjdump)
    SASS for `arch` and no PTX."""
    assert path.exists() and path.stat().st_size > 0
    data = path.read_bytes()
    for name in function_names:
        assert f"__tvm_ffi_{name}".encode() in data
    assert re.search(kernels[0].encode(), data) and re.search(kernels[1].encode(), data)
    cuobjdump = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    if Path(cuobjdump).exists():
        out = subprocess.run([cuobjdump, "--list-elf", str(path)], capture_output=True, text=True).stdout
        assert arch in out
        ptx = subprocess.run([cuobjdump, "--list-ptx", str(path)], capture_output=True, text=True).stdout
        assert ".ptx" not in ptx  # SASS only


def load_on_host_or_skip(path: Path):
    """The module loaded with cuda=False, or the test skipped when it cannot load here."""
    from ignis.runtime.kernels.tvm_runtime import load_module

    try:
        return load_module(path, cuda=False)
    except Exception as exc:
        pytest.skip(f"cannot load a CUDA module here: {exc}")
