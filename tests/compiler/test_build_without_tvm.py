"""`ignis-build` for a CUDA card on a host without the TVM compiler (issue 25), and the build's
threads.

- A CUDA build whose every q4 linear has in_features % 128 == 0 takes only nvcc-built routes (the
  tiled q4 kernels and the kernel libraries): it runs in a fresh interpreter where every `import tvm`
  fails (a meta-path finder, as tests/runtime/test_no_compiler.py hides the compiler), and never
  imports `tvm`.
- A plan with a shape on the TensorIR route is refused there before anything is written, with a
  ModuleBuildError naming the shapes.
- The q4 quantization on worker threads writes the bytes of the one-thread run; the input checksums
  hashed on threads keep the inputs' order.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from ignis.compiler.build import convert
from ignis.compiler.build.manifest import input_checksums
from ignis.compiler.errors import CheckpointError
from ignis.formats import NinferWriter

TESTS = Path(__file__).resolve().parents[1]
HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()

_BLOCKED_BUILD = r"""
import importlib.abc, json, sys

class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "tvm" or name.startswith("tvm."):
            raise ImportError(f"{name} is not installed on this host")
        return None

sys.meta_path.insert(0, NotInstalled())
from ignis.compiler.build import build_artifact
from ignis.compiler.build.errors import ModuleBuildError

model, drafter, recipe, out = sys.argv[1:5]
try:
    build_artifact(card="h200", model=model, drafter=drafter or None, recipe=recipe, out=out,
                   progress=False, echo=lambda _l: None)
    error = None
except ModuleBuildError as exc:
    error = str(exc)
tvm = sorted(m for m in sys.modules if m == "tvm" or m.startswith("tvm."))
print(json.dumps({"error": error, "tvm": tvm}))
"""


def _blocked_build(model: Path, drafter: Path | None, recipe: Path, out: Path) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_BUILD, str(model), str(drafter or ""), str(recipe), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tiny_llama_k160(tmp_path: Path, *, q4_pad_k: bool) -> tuple[Path, Path]:
    """A tiny llama checkpoint (hidden 128, intermediate 160: down_proj's K is not a multiple of 128)
    and a recipe of width 8, with or without q4_pad_k, in `tmp_path`. Returns (checkpoint, recipe)."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(TESTS))
    import hf_tiny

    model = hf_tiny.tiny_model(
        "llama", hidden_size=128, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2
    )
    ckpt = hf_tiny.save_tiny(model, tmp_path / "ckpt", tokenizer=hf_tiny.tiny_tokenizer())
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "tiny"\n[modules]\nwidths = [8]\n' + ("q4_pad_k = true\n" if q4_pad_k else ""))
    return ckpt, recipe


def test_a_plan_on_the_tensorir_route_is_refused_without_tvm(tmp_path: Path) -> None:
    """down_proj's in_features 160 is not a multiple of 128: the TensorIR route, which needs tvm."""
    ckpt, recipe = _tiny_llama_k160(tmp_path, q4_pad_k=False)
    seen = _blocked_build(ckpt, None, recipe, tmp_path / "out" / "tiny")
    error = str(seen["error"])
    assert "need the TVM compiler" in error and "[128, 160] (tir-dlight)" in error, error
    assert "[384, 128]" not in error  # the K % 128 == 0 shapes build with nvcc alone
    assert seen["tvm"] == []
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.skipif(not HAS_NVCC, reason="needs the CUDA toolkit (nvcc)")
def test_with_q4_pad_k_the_same_plan_builds_without_tvm(tmp_path: Path) -> None:
    """The model above with the recipe's q4_pad_k: its K = 160 linears take the tiled route over K
    padded to 256 (functions q4t_n{N}_k160_pad256, padded_in_features 256), so the h200 build needs
    no TVM; the fused norms and RoPE + KV write of the llama rounds are built beside them."""
    from ignis.formats import read_manifest

    ckpt, recipe = _tiny_llama_k160(tmp_path, q4_pad_k=True)
    out = tmp_path / "out" / "tiny"
    seen = _blocked_build(ckpt, None, recipe, out)
    assert seen["error"] is None and seen["tvm"] == []
    m = read_manifest(out)
    assert {e.route for e in m.modules} == {"cuda-tiled"}
    fns = {f.name: f for e in m.modules for f in e.functions}
    down = fns["q4t_n128_k160_pad256"]
    assert (down.kind, down.in_features, down.padded_in_features) == ("q4_g32_tiled", 160, 256)
    assert all(f.padded_in_features is None for f in fns.values() if f.in_features % 128 == 0)
    assert {k.kind for k in m.kernels} >= {"add_rms_norm_llama", "silu_mul", "rope_kv", "grouped_attention"}


@pytest.mark.skipif(not HAS_NVCC, reason="needs the CUDA toolkit (nvcc)")
def test_an_all_nvcc_qwen3_5_builds_for_h200_without_tvm(tmp_path: Path) -> None:
    """The tiny qwen3_5 of tools/random_checkpoint.py (every linear's K a multiple of 128) with its
    DFlash2 drafter, built for h200 where tvm cannot be imported: tiled q4 libraries and the kernel
    libraries, no TensorIR module, and tvm never imported."""
    from ignis.formats import read_manifest
    from ignis.tools.random_checkpoint import write_random_checkpoint, write_random_dflash2

    ckpt, drafter = tmp_path / "ckpt", tmp_path / "dflash2"
    write_random_checkpoint(ckpt, model="tiny")
    write_random_dflash2(ckpt, drafter, model="tiny")
    (tmp_path / "r.toml").write_text('name = "tiny"\n[modules]\nwidths = [1, 8]\n')
    out = tmp_path / "art"
    seen = _blocked_build(ckpt, drafter, tmp_path / "r.toml", out)
    assert seen["error"] is None and seen["tvm"] == []
    m = read_manifest(out)
    assert {e.route for e in m.modules} == {"cuda-tiled"} and [e.width for e in m.modules] == [1, 8]
    assert {k.kind for k in m.kernels} >= {"topk", "gdn_recurrent", "add_rms_norm", "gated_attention"}


def _q4_bytes(t: torch.Tensor, path: Path) -> bytes:
    with NinferWriter(path, metadata={}) as w:
        convert.write_tensor(w, "m.layers.0.mlp.down_proj.weight", t, "q4_g32")
    return path.read_bytes()


def test_q4_on_threads_writes_the_bytes_of_one_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = (torch.randn(203, 96, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    t[7, :32] = 0  # a zero group: scale 0
    monkeypatch.setenv(convert.BUILD_THREADS_ENV, "1")
    one = _q4_bytes(t, tmp_path / "one.ninfer")
    names: set[str] = set()
    quantize = convert._quantize_rows

    def spy(rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        names.add(threading.current_thread().name)
        return quantize(rows)

    monkeypatch.setattr(convert, "_quantize_rows", spy)
    monkeypatch.setattr(convert, "PARALLEL_CHUNK_ELEMENTS", 96 * 10)  # 21 blocks, more than the window
    monkeypatch.setenv(convert.BUILD_THREADS_ENV, "4")
    many = _q4_bytes(t, tmp_path / "many.ninfer")
    assert many == one
    assert len(names) > 1 and all(n.startswith("ignis-q4") for n in names)


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_build_threads_refuses_a_bad_setting(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(convert.BUILD_THREADS_ENV, value)
    with pytest.raises(CheckpointError, match="IGNIS_BUILD_THREADS"):
        convert.build_threads()


def test_input_checksums_on_threads_keep_the_order(tmp_path: Path) -> None:
    files = []
    for i in range(7):
        f = tmp_path / f"shard-{i}.bin"
        f.write_bytes(bytes([i]) * (1000 + 97 * i))
        files.append(f)
    seen: list[int] = []
    got = input_checksums(
        [("model", tmp_path, files[:5]), ("drafter", tmp_path, files[5:])], progress=seen.append
    )
    assert [g["path"] for g in got] == [f.name for f in files]
    assert [g["role"] for g in got] == ["model"] * 5 + ["drafter"] * 2
    assert all(
        g["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest() for g, f in zip(got, files, strict=True)
    )
    assert sum(seen) == sum(f.stat().st_size for f in files)


def test_the_build_module_imports_no_tvm() -> None:
    code = textwrap.dedent(
        """
        import sys
        import ignis.compiler.build, ignis.compiler.build.modules, ignis.compiler.cli
        print(sorted(m for m in sys.modules if m == "tvm" or m.startswith("tvm.")))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("ids", [list(range(40)), [39, 3, 17, 3, 0]])
def test_the_shortlist_head_on_threads_is_the_reference_quantization(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ids: list[int]
) -> None:
    from ignis.compiler.build.shortlist import write_shortlist
    from ignis.formats import NinferReader, quantize_q4_g32

    head = (torch.randn(40, 64, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    monkeypatch.setattr(convert, "PARALLEL_CHUNK_ELEMENTS", 64 * 3)
    monkeypatch.setenv(convert.BUILD_THREADS_ENV, "3")
    with NinferWriter(tmp_path / "s.ninfer") as w:
        write_shortlist(w, head, np.array(ids, dtype=np.int32))
    packed, scales = quantize_q4_g32(head.float()[ids].numpy())
    with NinferReader(tmp_path / "s.ninfer") as r:
        q = r.q4_g32("shortlist.head.weight")
        np.testing.assert_array_equal(q.packed, packed)
        np.testing.assert_array_equal(q.scales, scales)


def test_convert_rate_measures_every_thread_count_on_the_same_bytes(tmp_path: Path) -> None:
    from ignis.tools.bench.convert_rate import measure
    from ignis.tools.random_checkpoint import write_random_checkpoint

    write_random_checkpoint(tmp_path / "ckpt", model="tiny")
    res = measure(
        tmp_path / "ckpt", drafter=None, card="h200", threads=[1, 3], max_params=5e5, out_dir=tmp_path
    )
    assert res["same_bytes"] and [r["threads"] for r in res["runs"]] == [1, 3]
    assert (
        5e5
        <= res["measured_params"]["q4"] + res["measured_params"]["plain"]
        < res["plan_params"]["q4"] + (res["plan_params"]["plain"])
    )
    assert all(r["estimated_plan_weights_s"] > 0 for r in res["runs"])
    assert not list(tmp_path.glob("convert-rate-*"))  # the scratch files are gone


def _sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A bf16 safetensors file with these tensors' header and no data written (a sparse file)."""
    import math
    import struct

    header: dict[str, object] = {}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)


def test_the_full_27b_plan_for_h200_needs_no_tvm(tmp_path: Path) -> None:
    """The public Qwen3.5-27B text config with the public 27B DFlash2 drafter (headers only, no
    weights): every linear, the drafter's and the whole-vocabulary shortlist head's included, takes
    the nvcc-built tiled route at every h200 width (8 tile libraries), nothing needs TVM, and the
    artifact is ~17.8 GiB."""
    from ignis.compiler.build import build_artifact
    from ignis.runtime.drafters.dflash2 import DFlash2Config, dflash2_tensor_shapes
    from ignis.runtime.families.base import config_from_hf
    from ignis.runtime.families.qwen3_5 import tensor_shapes
    from ignis.tools import random_checkpoint as rc

    ckpt, drafter = tmp_path / "ckpt", tmp_path / "dflash2"
    ckpt.mkdir()
    drafter.mkdir()
    raw = rc.MODELS["qwen3_5-27b"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    rc._write_tokenizer(ckpt, raw["vocab_size"])
    shapes = tensor_shapes(config_from_hf(raw))
    groups = rc._shards(shapes, 2, 4 << 30)  # 4 GiB shards: each mapped on its own
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        _sparse_safetensors(ckpt / file, {n: shapes[n] for n in names})
        weight_map |= dict.fromkeys(names, file)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    d = DFlash2Config.from_hf(rc.PUBLIC_27B_DFLASH2)
    (drafter / "config.json").write_text(json.dumps(d.to_hf()))
    _sparse_safetensors(drafter / "model.safetensors", dflash2_tensor_shapes(d))
    (tmp_path / "r.toml").write_text('name = "q27"\n[shortlist]\nsize = 248320\n')
    res = build_artifact(
        card="h200", model=ckpt, drafter=drafter, recipe=tmp_path / "r.toml", out=tmp_path / "art",
        dry_run=True, echo=lambda _l: None,
    )  # fmt: skip
    m = res.plan.modules
    assert m.tvm_shapes() == () and {m.route(s) for s in m.shapes} == {"cuda-tiled"}
    assert len(m.shapes) == 11 and sorted({(w + 7) // 8 for w in m.widths}) == list(range(1, 9))
    assert set(m.kernels) == {"topk", "gdn_recurrent", "fused_norms", "fused_mixers"}
    assert 17.5 * 2**30 < res.plan.weights_bytes < 18.1 * 2**30


def test_tile_libraries_build_in_parallel_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`_build_nt_libraries` runs one build per tile count on `build_workers` threads at once; the
    entries and the files come back in tile order whatever finishes first, and a failure names its
    library."""
    import time as _time

    from ignis.compiler.build import modules
    from ignis.compiler.build.errors import ModuleBuildError

    plan = modules.ModulePlan(
        card="h200", arch="sm_90", widths=(1, 8, 16, 24, 64), shapes=(), dtype="bfloat16",
        target={"kind": "cuda", "arch": "sm_90"},
    )  # fmt: skip
    monkeypatch.setattr(modules, "build_workers", lambda jobs: 4)
    monkeypatch.setattr(modules, "strip_local_symbols", lambda path: True)
    monkeypatch.setattr(modules, "check_cuda_binary", lambda path, arch: None)
    running, peak, lock = [0], [0], threading.Lock()

    def build(nt: int, path: Path) -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        _time.sleep(0.05 * (9 - nt))  # the small tile counts finish last
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"lib")
        with lock:
            running[0] -= 1

    done: list[str] = []
    by_width: dict[int, list[object]] = {w: [] for w in plan.widths}
    modules._build_nt_libraries(
        plan, tmp_path, by_width, done.append, rel_of=lambda nt: f"m/nt{nt}.so", build=build,
        route="cuda-tiled", functions=(),
    )  # fmt: skip
    assert peak[0] > 1  # ran together
    assert done == ["m/nt1.so", "m/nt2.so", "m/nt3.so", "m/nt8.so"]
    assert [(w, [e.file for e in by_width[w]]) for w in plan.widths] == [
        (1, ["m/nt1.so"]), (8, ["m/nt1.so"]), (16, ["m/nt2.so"]), (24, ["m/nt3.so"]), (64, ["m/nt8.so"])
    ]  # fmt: skip

    def failing(nt: int, path: Path) -> None:
        if nt == 3:
            raise RuntimeError("nvcc exploded")

    with pytest.raises(ModuleBuildError, match=r"m/nt3\.so for sm_90 failed: nvcc exploded"):
        modules._build_nt_libraries(
            plan, tmp_path, {w: [] for w in plan.widths}, lambda _r: None, rel_of=lambda nt: f"m/nt{nt}.so",
            build=failing, route="cuda-tiled", functions=(),
        )  # fmt: skip
