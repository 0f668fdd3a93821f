"""The shared nvcc build (compiler/kernels/cuda_build.py): the exact command line and source text each
kernel builder hands to nvcc (recorded with subprocess.run patched out, so no toolkit is needed),
the atomic move into place, the error path and the source-keyed cache."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from ignis.compiler.kernels import cuda_build
from ignis.compiler.kernels.fused_mixers import FusedMixersError, build_fused_mixers
from ignis.compiler.kernels.fused_norms import FusedNormsError, build_fused_norms
from ignis.compiler.kernels.gdn_recurrent import GdnKernelError, build_gdn_recurrent
from ignis.compiler.kernels.q4_linear import (
    Q4KernelError,
    build_q4_cuda_bundle,
    build_q4_linear,
    default_tile_config,
)
from ignis.compiler.kernels.topk import TopKKernelError, build_topk

KERNEL_DIR = Path(cuda_build.__file__).resolve().parent


def _tvm_ffi_dirs() -> tuple[str, str]:
    import tvm_ffi.libinfo as libinfo

    return str(Path(libinfo.find_include_path())), str(Path(libinfo.find_libtvm_ffi()).parent)


def _expected(
    nvcc: str, arch: str, out: str, src: str, *, extra: Sequence[str] = (), verbose: bool = False
) -> list[str]:
    """The command line every module was built with before the shared builder, spelled out."""
    include, lib = _tvm_ffi_dirs()
    num = arch[3:]
    return [
        nvcc,
        *(["-Xptxas=-v"] if verbose else []),
        "-std=c++17",
        "-O3",
        "-shared",
        "-Xcompiler",
        "-fPIC,-fvisibility=hidden",
        "-gencode",
        f"arch=compute_{num},code=sm_{num}",
        f"-I{KERNEL_DIR}",
        f"-I{include}",
        f"-L{lib}",
        "-ltvm_ffi",
        *extra,
        "-o",
        out,
        src,
    ]


class FakeNvcc:
    """Stands in for subprocess.run: records each command and the source it compiles, writes the
    output file (or fails with ``stderr``)."""

    def __init__(self, returncode: int = 0, stderr: str = "") -> None:
        self.calls: list[tuple[list[str], str]] = []
        self.returncode, self.stderr = returncode, stderr

    def __call__(self, cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        assert kwargs == {"capture_output": True, "text": True}
        self.calls.append((list(cmd), Path(cmd[-1]).read_text()))
        if self.returncode == 0:
            Path(cmd[cmd.index("-o") + 1]).write_bytes(b"fake module")
        return subprocess.CompletedProcess(cmd, self.returncode, "", self.stderr)


@pytest.fixture
def nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, FakeNvcc]:
    path = tmp_path / "bin" / "nvcc"
    path.parent.mkdir()
    path.write_text("")
    monkeypatch.setenv("NVCC", str(path))
    monkeypatch.setenv("IGNIS_CACHE_DIR", str(tmp_path / "cache"))
    fake = FakeNvcc()
    monkeypatch.setattr(cuda_build.subprocess, "run", fake)
    return str(path), fake


BUILDERS = [
    (build_topk, "topk", '#include "topk_ffi.cuh"\n\nIGNIS_TOPK_EXPORT(topk)\n'),
    (
        build_gdn_recurrent,
        "gdn_recurrent",
        '#include "gdn_recurrent_ffi.cuh"\n\nIGNIS_GDN_RECURRENT_EXPORT(gdn_recurrent)\n'
        "IGNIS_GDN_STASH_EXPORT(gdn_recurrent_stash)\nIGNIS_GDN_REPLAY_EXPORT(gdn_replay)\n",
    ),
    (build_fused_norms, "fused_norms", '#include "fused_norms_ffi.cuh"\n\nIGNIS_FUSED_NORMS_EXPORT()\n'),
    (
        build_fused_mixers,
        "fused_mixers",
        '#include "fused_mixers_ffi.cuh"\n#include "gated_attention_ffi.cuh"\n\n'
        "IGNIS_FUSED_MIXERS_EXPORT()\nIGNIS_GATED_ATTENTION_EXPORT()\n",
    ),
]


@pytest.mark.parametrize("verbose", [False, True])
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
@pytest.mark.parametrize(("build", "name", "source"), BUILDERS, ids=[b[1] for b in BUILDERS])
def test_each_builder_passes_the_same_command_line(
    nvcc: tuple[str, FakeNvcc], tmp_path: Path, build: Any, name: str, source: str, arch: str, verbose: bool
) -> None:
    path, fake = nvcc
    dest = tmp_path / "out" / f"{name}.so"
    assert build(arch, out_path=dest, verbose=verbose) == dest
    assert dest.read_bytes() == b"fake module"
    [(cmd, text)] = fake.calls
    tmp = Path(cmd[-1]).parent
    assert tmp.parent == dest.parent and not tmp.exists()  # built next to dest, then moved in
    assert cmd == _expected(path, arch, str(tmp / dest.name), str(tmp / f"{name}_module.cu"), verbose=verbose)
    assert text == source


@pytest.mark.parametrize("verbose", [False, True])
def test_q4_bundle_passes_the_same_command_line(
    nvcc: tuple[str, FakeNvcc], tmp_path: Path, verbose: bool
) -> None:
    path, fake = nvcc
    dest = tmp_path / "q4.so"
    cfg = default_tile_config(8, 17408, 5120, arch="sm_90")
    extra = ["-lineinfo", "-DIGNIS_X=1"]
    assert build_q4_cuda_bundle("sm_90", {"q4_a": cfg}, dest, extra_flags=extra, verbose=verbose) == dest
    [(cmd, text)] = fake.calls
    tmp = Path(cmd[-1]).parent
    assert cmd == _expected(
        path, "sm_90", str(tmp / "q4.so"), str(tmp / "q4_linear_module.cu"), extra=extra, verbose=verbose
    )
    assert text == f'#include "q4_linear_ffi.cuh"\n\n{cfg.export_line("q4_a")}\n'
    fake.calls.clear()
    build_q4_linear({"kind": "cuda", "arch": "sm_90"}, 17408, 5120, 8, out_path=tmp_path / "q4b.so")
    [(cmd, _)] = fake.calls
    tmp = Path(cmd[-1]).parent
    assert cmd == _expected(path, "sm_90", str(tmp / "q4b.so"), str(tmp / "q4_linear_module.cu"))


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (build_topk, TopKKernelError),
        (build_gdn_recurrent, GdnKernelError),
        (build_fused_norms, FusedNormsError),
        (build_fused_mixers, FusedMixersError),
        (
            lambda arch, out_path: build_q4_cuda_bundle(
                arch, {"f": default_tile_config(1, 64, 128)}, out_path
            ),
            Q4KernelError,
        ),
    ],
)
def test_nvcc_failure_raises_the_module_error_and_leaves_nothing(
    nvcc: tuple[str, FakeNvcc], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, build: Any, error: type
) -> None:
    monkeypatch.setattr(cuda_build.subprocess, "run", FakeNvcc(returncode=1, stderr="error: boom"))
    out = tmp_path / "out"
    with pytest.raises(
        error, match=r"(?s)nvcc failed \(.*-gencode arch=compute_90,code=sm_90.*\):\nerror: boom"
    ):
        build("sm_90", out_path=out / "m.so")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(("build", "name", "source"), BUILDERS, ids=[b[1] for b in BUILDERS])
def test_default_path_is_a_cache_reused_when_present(
    nvcc: tuple[str, FakeNvcc], tmp_path: Path, build: Any, name: str, source: str
) -> None:
    _, fake = nvcc
    first = build("sm_90")
    assert first.parent == tmp_path / "cache" / name and first.name.startswith(f"{name}_sm_90_")
    assert build("sm_90") == first and len(fake.calls) == 1  # reused, not rebuilt
    assert build("sm_120") != first and len(fake.calls) == 2


@pytest.mark.parametrize(
    ("build", "error"),
    [
        (build_topk, TopKKernelError),
        (build_gdn_recurrent, GdnKernelError),
        (build_fused_norms, FusedNormsError),
        (build_fused_mixers, FusedMixersError),
    ],
)
def test_missing_nvcc_raises_the_module_error(
    monkeypatch: pytest.MonkeyPatch, build: Any, error: type
) -> None:
    def no_nvcc(*, error: type[Exception] = ValueError) -> str:
        raise error("nvcc not found: install the CUDA toolkit or set NVCC")

    monkeypatch.setattr(cuda_build, "find_nvcc", no_nvcc)
    with pytest.raises(error, match="nvcc not found"):
        build("sm_90")
    with pytest.raises(error, match="CUDA only"):
        build({"kind": "llvm"})
