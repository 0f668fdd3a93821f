"""Cross-compiling an artifact's modules for the GPU cards on this host (no GPU, no driver): sm_90 (h200)
and sm_120 (rtx5090 / rtxpro6000 / rtx50-16gb), checked to hold SASS for that arch only, never PTX or
CUDA source, and byte-reproducible; the q4 linears and the kernel libraries the model uses (the
manifest's `kernels`: the drafter's top-k, the hybrid families' fused GDN recurrence, row norms and
mixer pieces).

Each build runs in a fresh interpreter: the build-time libcuda stub must be loaded before `tvm` is
first imported (DESIGN.md, "TVM facts"), and this test session may already have imported tvm.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from ignis.compiler.kernels.q4_linear import cuda_binary_info
from ignis.formats import read_manifest

HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
pytestmark = pytest.mark.skipif(not HAS_NVCC, reason="needs the CUDA toolkit (nvcc)")


def _helper(name: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _build_in_subprocess(
    card: str, model: Path, out: Path, recipe: Path, drafter: Path | None = None, q4_route: str | None = None
) -> None:
    code = textwrap.dedent(
        f"""
        from ignis.compiler.build import build_artifact, modules
        if {q4_route!r} is not None:
            modules.Q4_CUDA_ROUTE = {q4_route!r}  # the build's switch between the tiled and mma routes
        build_artifact(card={card!r}, model={str(model)!r}, recipe={str(recipe)!r}, out={str(out)!r},
                       drafter={None if drafter is None else str(drafter)!r}, progress=False,
                       echo=lambda _line: None)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


#: The kernel libraries' manifest entries, by (the drafter, a hybrid family): (kind, symbol, file name).
_TOPK = [("topk", "topk", "topk.so")]
_HYBRID = [
    ("gdn_recurrent", "gdn_recurrent", "gdn_recurrent.so"),
    ("gdn_recurrent_stash", "gdn_recurrent_stash", "gdn_recurrent.so"),
    ("gdn_replay", "gdn_replay", "gdn_recurrent.so"),
    ("add_rms_norm", "add_rms_norm", "fused_norms.so"),
    ("gated_rms_norm", "gated_rms_norm", "fused_norms.so"),
    ("silu_mul", "silu_mul", "fused_norms.so"),
    ("narrow_linear", "narrow_linear", "fused_norms.so"),
    ("add_rms_norm_llama", "add_rms_norm_llama", "fused_norms.so"),
    ("gdn_conv_silu", "gdn_conv_silu", "fused_mixers.so"),
    ("qk_norm_rope_kv", "qk_norm_rope_kv", "fused_mixers.so"),
    ("gated_attention", "gated_attention", "fused_mixers.so"),
    ("rope_kv", "rope_kv", "fused_mixers.so"),
    ("grouped_attention", "grouped_attention", "fused_mixers.so"),
]
# a llama / qwen2 build on CUDA: the fused norms and mixers (StaticLlamaExecutor takes add_rms_norm_llama,
# silu_mul, rope_kv and grouped_attention); a library is whole, so every export of the two is listed
_LLAMA = [k for k in _HYBRID if k[2] != "gdn_recurrent.so"]


def _check_binaries(
    out: Path, card: str, arch: str, kernels: list[tuple[str, str, str]], dtype: str = "bfloat16"
) -> dict[str, str]:
    m = read_manifest(out)
    assert m.card == card and m.arch == arch and m.linear_dtype == "q4_g32"
    routes = {}
    for entry in m.modules:
        assert entry.target == {"kind": "cuda", "arch": arch}
        # the tiled route's functions take the runtime's tiled layout; the others the stored one
        kind = "q4_g32_tiled" if entry.route == "cuda-tiled" else "q4_g32"
        assert all(f.kind == kind and f.dtype == dtype for f in entry.functions)
        assert entry.dynamic_rows == (entry.route in ("cuda-tiled", "cuda-mma"))
        if entry.route == "cuda-tiled":
            assert entry.file == f"modules/{card}/q4_tiled_nt{(entry.width + 7) // 8}.so"
            assert all(f.name.startswith("q4t_") for f in entry.functions)
            assert all(f.name.encode() in (out / entry.file).read_bytes() for f in entry.functions)
        routes[entry.file] = entry.route
    # the kernel libraries the model uses, each its own file listed as a module, one entry per export
    assert m.version == 2
    assert [(k.kind, k.name, k.file) for k in m.kernels] == [
        (kind, name, f"modules/{card}/{file}") for kind, name, file in kernels
    ]
    for k in m.kernels:
        assert k.abi == 1 and k.target == {"kind": "cuda", "arch": arch}
        # the (gated) attention takes the mma's input types only, the replay float32 stash and state
        mma_only = ("bfloat16", "float16")
        want = {"gated_attention": mma_only, "grouped_attention": mma_only, "gdn_replay": ("float32",)}.get(
            k.kind, ("bfloat16", "float16", "float32")
        )
        assert k.dtypes == want
        assert m.file(k.file).role == "module" and k.file not in routes
        assert k.name.encode() in (out / k.file).read_bytes()
    for rel in [*routes, *sorted({k.file for k in m.kernels})]:
        info = cuda_binary_info(out / rel)
        assert info.sass_archs == (arch,), (rel, info)
        assert not info.has_ptx and not info.has_cuda_source, (rel, info)
    return routes


def test_cross_compiled_q4_modules_hold_sass_for_the_arch(tmp_path: Path) -> None:
    """sm_120 (rtx5090): a llama without a drafter gets both q4 routes and the fused norms and mixers
    libraries (no top-k: it serves only a DFlash2 drafter); built twice, byte-identical."""
    card, arch = "rtx5090", "sm_120"
    hf_tiny = _helper("hf_tiny")
    model = hf_tiny.tiny_model(
        "llama", hidden_size=128, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2
    )
    ckpt = hf_tiny.save_tiny(model, tmp_path / "ckpt", tokenizer=hf_tiny.tiny_tokenizer())
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "tiny-gpu"\n[modules]\nwidths = [8]\n')
    _build_in_subprocess(card, ckpt, tmp_path / "a" / "tiny-gpu", recipe)
    routes = _check_binaries(tmp_path / "a" / "tiny-gpu", card, arch, kernels=_LLAMA)
    # in_features 128 -> the tiled stream-K route (nvcc, the default); down_proj's 160 -> TensorIR +
    # dlight (TVM)
    assert sorted(set(routes.values())) == ["cuda-tiled", "tir-dlight"]
    assert routes[f"modules/{card}/q4_tiled_nt1.so"] == "cuda-tiled"
    m = read_manifest(tmp_path / "a" / "tiny-gpu")
    shapes = {(f.kind, f.out_features, f.in_features) for e in m.modules for f in e.functions}
    assert ("q4_g32", 128, 160) in shapes and ("q4_g32_tiled", 384, 128) in shapes
    # the same input gives the same bytes (nvcc's temporary names are stripped); one arch suffices
    _build_in_subprocess(card, ckpt, tmp_path / "b" / "tiny-gpu", recipe)
    for f in m.files:
        first, second = tmp_path / "a" / "tiny-gpu" / f.path, tmp_path / "b" / "tiny-gpu" / f.path
        assert first.read_bytes() == second.read_bytes(), f.path


def test_the_mma_route_stays_available_behind_the_switch(tmp_path: Path) -> None:
    """`modules.Q4_CUDA_ROUTE = "mma"` builds the K % 128 == 0 shapes on the mma kernel again
    (`q4_mma_nt{T}.so`, kind q4_g32, the stored layout)."""
    card, arch = "h200", "sm_90"
    hf_tiny = _helper("hf_tiny")
    model = hf_tiny.tiny_model(
        "llama", hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
    )
    ckpt = hf_tiny.save_tiny(model, tmp_path / "ckpt", tokenizer=hf_tiny.tiny_tokenizer())
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "tiny-gpu"\n[modules]\nwidths = [8, 16]\n')
    _build_in_subprocess(card, ckpt, tmp_path / "tiny-gpu", recipe, q4_route="mma")
    routes = _check_binaries(tmp_path / "tiny-gpu", card, arch, kernels=_LLAMA)
    assert routes == {f"modules/{card}/q4_mma_nt{t}.so": "cuda-mma" for t in (1, 2)}


def test_cross_compiled_hybrid_kernels_for_h200(tmp_path: Path) -> None:
    """sm_90 (h200): a tiny qwen3_5 with a DFlash2 drafter gets the top-k, the fused GDN recurrence,
    the fused row norms and the fused mixers beside its q4 linears, each library stripped
    (byte-reproducible: the nvcc temporary names are gone) and holding sm_90 SASS only."""
    card, arch = "h200", "sm_90"
    from ignis.tools.make_test_drafter import make_dflash2_drafter

    _helper("hf_tiny_hybrid").make_tiny_hybrid("qwen3_5", tmp_path / "ckpt")
    make_dflash2_drafter(tmp_path / "ckpt", tmp_path / "dflash2", num_layers=1)
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "tiny-gpu"\n[modules]\nwidths = [8]\n')
    out = tmp_path / "a" / "tiny-gpu"
    _build_in_subprocess(card, tmp_path / "ckpt", out, recipe, tmp_path / "dflash2")
    routes = _check_binaries(out, card, arch, kernels=_TOPK + _HYBRID)
    assert routes
    for k in read_manifest(out).kernels:
        assert b"tmpxft_" not in (out / k.file).read_bytes(), k.file


@pytest.mark.slow
@pytest.mark.parametrize(("card", "arch"), [("h200", "sm_90"), ("rtxpro6000", "sm_120")])
@pytest.mark.parametrize("family", ["llama", "qwen3_5", "qwen3_next"])
def test_cross_compile_every_family_at_every_width(tmp_path: Path, card: str, arch: str, family: str) -> None:
    hf_tiny = _helper("hf_tiny")
    hybrid = _helper("hf_tiny_hybrid")
    drafter = None
    if family == "llama":
        model = hf_tiny.save_tiny(
            hf_tiny.tiny_model("llama", hidden_size=128, intermediate_size=256),
            tmp_path / "ckpt",
            tokenizer=hf_tiny.tiny_tokenizer(),
        )
    else:
        from ignis.tools.make_test_drafter import make_dflash2_drafter, make_mtp_drafter

        hybrid.make_tiny_hybrid(family, tmp_path / "base")
        model = tmp_path / "ckpt"
        make_mtp_drafter(tmp_path / "base", model)
        drafter = tmp_path / "dflash2"
        make_dflash2_drafter(model, drafter, num_layers=1)
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "tiny-gpu"\n')
    _build_in_subprocess(card, model, tmp_path / "tiny-gpu", recipe, drafter)
    m = read_manifest(tmp_path / "tiny-gpu")
    # h200 compiles every 8 rows to 64 (one tiled call for 1-8 lanes x 8 columns); the sm_120 cards
    # stop at 32
    wide = [16, 24, 32, 40, 48, 56, 64] if card == "h200" else [16, 32]
    assert list(m.widths) == [1, 2, 3, 4, 5, 6, 7, 8, *wide]
    assert {e.width for e in m.modules} == set(m.widths)
    # llama: the fused norms (add_rms_norm_llama, silu_mul) and mixers (rope_kv) of `StaticLlamaExecutor`
    norms = [k for k in _HYBRID if k[2] in ("fused_norms.so", "fused_mixers.so")]
    _check_binaries(tmp_path / "tiny-gpu", card, arch, kernels=norms if drafter is None else _TOPK + _HYBRID)
    json.dumps(m.to_json())
