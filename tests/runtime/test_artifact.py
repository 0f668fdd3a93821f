"""Loading artifacts (runtime/artifact.py) and the linear-backend dispatch (runtime/linear.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ignis.compiler.build import build_artifact
from ignis.formats import (
    MANIFEST_NAME,
    ArtifactChecksumError,
    ArtifactFileError,
    ArtifactMismatchError,
    ChecksumMismatchError,
    ManifestError,
    ManifestVersionError,
    NinferReader,
    NinferWriter,
    dequantize_q4_g32,
    quantize_q4_g32,
    read_manifest,
)
from ignis.formats.manifest import file_entry
from ignis.runtime.artifact import load_artifact
from ignis.runtime.linear import (
    CompiledLinears,
    LinearBackend,
    Q4Weight,
    cat_rows,
    dequantize_q4,
    to_device,
    torch_linear,
)


def _helper(name: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf_tiny = _helper("hf_tiny")
    root = tmp_path_factory.mktemp("art")
    ckpt = hf_tiny.save_tiny(hf_tiny.tiny_model("qwen2"), root / "ckpt", tokenizer=hf_tiny.tiny_tokenizer())
    (root / "r.toml").write_text('name = "tiny"\n[modules]\nwidths = [1, 4]\n')
    res = build_artifact(
        card="cpu",
        model=ckpt,
        recipe=root / "r.toml",
        out=root / "tiny",
        progress=False,
        echo=lambda _l: None,
    )
    assert res.out is not None
    return res.out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_manifest(root: Path, **changes: Any) -> None:
    m = read_manifest(root)
    (root / MANIFEST_NAME).write_bytes(dataclasses.replace(m, **changes).to_bytes())


# ---------------------------------------------------------------------------------------------
# loading


def test_load_parts(artifact: Path) -> None:
    hf_tiny = _helper("hf_tiny")
    with load_artifact(artifact) as art:
        assert art.config.model_type == "qwen2" and art.profile.name == "cpu" and art.profile.widths[-1] == 32
        assert art.spec_defaults("mtp") is not None and art.spec_defaults("mtp").draft_tokens == 3
        assert art.default_dtype() == torch.float32 and not art.has_drafter and not art.has_mtp
        tok = art.tokenizer()
        ref = hf_tiny.tiny_tokenizer()
        text = "Speculative decoding drafts tokens"
        assert tok.encode(text) == ref.encode(text)
        messages = [{"role": "user", "content": "hi"}]
        assert tok.apply_chat_template(messages, add_generation_prompt=True) == ref.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        w = art.target_weights()
        assert w["model.norm.weight"].dtype == torch.float32
        head, ids = art.shortlist()
        assert isinstance(head, Q4Weight) and ids.dtype == torch.int32
        embed = w["model.embed_tokens.weight"]  # qwen2 tiny: tied head
        packed, scales = quantize_q4_g32(embed[ids.long()].numpy())
        assert torch.equal(head.dequantize(), torch.from_numpy(dequantize_q4_g32(packed, scales)))


def test_load_errors_name_the_file(artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="manifest"):
        load_artifact(tmp_path)
    a = _copy(artifact, tmp_path / "a")
    raw = json.loads((a / MANIFEST_NAME).read_text())
    raw["version"] = 7
    (a / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(ManifestVersionError):
        load_artifact(a)
    b = _copy(artifact, tmp_path / "b")
    weights = b / "tiny.ninfer"
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(ArtifactFileError) as err:
        load_artifact(b, verify="none")
    assert "tiny.ninfer" in str(err.value)


def test_verify_levels(artifact: Path, tmp_path: Path) -> None:
    a = _copy(artifact, tmp_path / "a")
    with NinferReader(a / "tiny.ninfer") as r:
        offset = r.info("model.norm.weight").offset
    data = bytearray((a / "tiny.ninfer").read_bytes())
    data[offset] ^= 0x40
    (a / "tiny.ninfer").write_bytes(bytes(data))
    load_artifact(a, verify="none").close()  # data bytes are not read without verification
    with pytest.raises(ChecksumMismatchError) as err:
        load_artifact(a)
    assert err.value.tensor == "model.norm.weight" and err.value.offset == offset
    with pytest.raises(ValueError):
        load_artifact(a, verify="sometimes")  # type: ignore[arg-type]


def _rewrite_container(root: Path, **meta: Any) -> None:
    """Re-write tiny.ninfer with changed metadata (tensors copied) and re-hash it in the manifest."""
    src = root / "tiny.ninfer"
    tmp = root / "new.ninfer"
    with NinferReader(src) as r, NinferWriter(tmp, metadata={**r.metadata, **meta}) as w:
        for name in r:
            info = r.info(name)
            if info.dtype == "q4_g32":
                q = r.q4_g32(name)
                w.add_q4_g32(name, q.packed, q.scales)
            else:
                w.add_tensor(name, r.numpy(name), dtype=info.dtype)
    tmp.replace(src)
    m = read_manifest(root)
    files = tuple(file_entry(root, f.path, f.role) if f.path == "tiny.ninfer" else f for f in m.files)
    _rewrite_manifest(root, files=files)


def test_an_intact_file_that_disagrees_with_the_manifest(artifact: Path, tmp_path: Path) -> None:
    a = _copy(artifact, tmp_path / "a")
    _rewrite_container(a, **{"ignis.artifact": {"name": "tiny", "part": "target", "card": "h200"}})
    with pytest.raises(ArtifactMismatchError, match="card 'h200'") as err:
        load_artifact(a)
    assert "tiny.ninfer" in str(err.value)
    b = _copy(artifact, tmp_path / "b")
    m = read_manifest(b)
    assert m.tokenizer is not None
    _rewrite_manifest(b, tokenizer={**m.tokenizer, "sha256": "0" * 64})
    with pytest.raises(ArtifactMismatchError) as terr:
        load_artifact(b)
    assert terr.value.tensor == "ignis.tokenizer.json" and terr.value.offset is not None


def test_make_executor_without_a_linear_hook_warns(artifact: Path, caplog: pytest.LogCaptureFixture) -> None:
    from ignis.runtime.families.llama import LlamaExecutor

    def legacy(config: Any, weights: Any, device: Any = "cpu", dtype: Any = torch.float32) -> Any:
        return LlamaExecutor(config, weights, device=device, dtype=dtype)  # a family without the hook

    with load_artifact(artifact) as art, caplog.at_level(logging.WARNING, logger="ignis.runtime.artifact"):
        art.family = dataclasses.replace(art.family, make_executor=legacy)
        ex = art.make_executor(linear=art.linear_backend())
        state = ex.new_lane()
        out = ex.forward([state], [torch.tensor([1, 2, 3])])
        assert out.logits[0].shape == (3, art.config.vocab_size)
    assert "linear hook" in caplog.text


def test_make_executor_passes_the_linear_hook(artifact: Path, caplog: pytest.LogCaptureFixture) -> None:
    with load_artifact(artifact) as art, caplog.at_level(logging.WARNING, logger="ignis.runtime.artifact"):
        backend = art.linear_backend()
        ex = art.make_executor(dtype=torch.float32, linear=backend)
        ref = art.make_executor(dtype=torch.float32)
        assert ex.linear is backend and ref.linear is F.linear
        cols = torch.tensor([1, 2, 3, 4])
        out = ex.forward([ex.new_lane()], [cols]).logits[0]
        want = ref.forward([ref.new_lane()], [cols]).logits[0]
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        assert backend.counts["compiled"] > 0 and backend.counts["fallback"] == 0
    assert "linear hook" not in caplog.text


def test_executors_take_q4_weights_through_the_hook() -> None:
    """q4_g32 weights stay `Q4Weight`s (fused with cat_rows) and give the dequantized model's logits."""
    hf_tiny = _helper("hf_tiny")
    from ignis.runtime.families import get_family

    model = hf_tiny.tiny_model("qwen2")
    family = get_family("qwen2")
    config = family.config_cls.from_hf(model.config.to_dict())
    names = family.tensor_shapes(config)
    tensors = {k: v.detach().float() for k, v in model.state_dict().items() if k in names}
    q4: dict[str, Any] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            packed, scales = quantize_q4_g32(t.numpy())
            w = Q4Weight(torch.from_numpy(packed.view(np.int32)), torch.from_numpy(scales))
            q4[name], dense[name] = w, w.dequantize()
        else:
            q4[name] = dense[name] = t
    backend = LinearBackend()
    ex = family.make_executor(config, q4, "cpu", torch.float32, linear=backend)
    assert isinstance(ex.layers[0].w_qkv, Q4Weight) and isinstance(ex.layers[0].w_gate_up, Q4Weight)
    ref = family.make_executor(config, dense, "cpu", torch.float32)
    cols = torch.tensor([3, 1, 4, 1, 5])
    out = ex.forward([ex.new_lane()], [cols]).logits[0]
    want = ref.forward([ref.new_lane()], [cols]).logits[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert backend.counts["torch"] > 0


# ---------------------------------------------------------------------------------------------
# the linear backend


def test_q4_weight_reference() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 6, 64, generator=g)
    packed, scales = quantize_q4_g32(w.numpy())
    q = Q4Weight(torch.from_numpy(packed), torch.from_numpy(scales))
    exact = torch.from_numpy(dequantize_q4_g32(packed, scales))
    assert q.shape == (2, 6, 64) and q.out_features == 6 and q.in_features == 64
    assert torch.equal(q.dequantize(), exact)
    assert torch.equal(dequantize_q4(q.packed.view(torch.int32), q.scales), exact)
    assert torch.equal(q[1, 2:4].dequantize(), exact[1, 2:4])
    assert torch.equal(Q4Weight.cat_rows([q[0], q[1]]).dequantize(), exact.reshape(12, 64))
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(torch_linear(x, q[0]), F.linear(x, exact[0]))
    with pytest.raises(ValueError):
        Q4Weight(q.packed[..., :4], q.scales)
    assert torch.equal(cat_rows([q[0], q[1]]).dequantize(), exact.reshape(12, 64))  # type: ignore[union-attr]
    assert torch.equal(cat_rows([exact[0], exact[1]]), exact.reshape(12, 64))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cat_rows([q[0], exact[1]])
    assert isinstance(to_device(q, "cpu", torch.bfloat16), Q4Weight)
    assert to_device(exact, "cpu", torch.bfloat16).dtype == torch.bfloat16  # type: ignore[union-attr]


class _Fake:
    """A module function: records its inputs, computes y = x @ w^T (dense) into the destination."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, x: torch.Tensor, *args: torch.Tensor) -> None:
        y = args[-1]
        w = args[0] if len(args) == 2 else Q4Weight(args[0], args[1]).dequantize()
        self.calls.append(tuple(x.shape))
        y.copy_(x @ w.T)


def test_dispatch_pads_falls_back_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    g = torch.Generator().manual_seed(1)
    dense, q4, dyn = _Fake(), _Fake(), _Fake()
    fns = {
        (4, "dense", 5, 64, "float32"): (dense, False, False),
        (4, "q4_g32", 6, 64, "float32"): (q4, False, False),
        (8, "dense", 5, 64, "float32"): (dyn, True, False),
    }
    backend = LinearBackend(CompiledLinears(fns, widths=[4, 8]))
    w = torch.randn(5, 64, generator=g)
    b = torch.randn(5, generator=g)
    x = torch.randn(3, 64, generator=g)
    torch.testing.assert_close(backend(x, w, b), F.linear(x, w, b))
    assert dense.calls == [(4, 64)]  # 3 rows padded to width 4
    x3 = torch.randn(2, 3, 64, generator=g)  # leading dims kept; 6 rows -> width 8, dynamic rows
    torch.testing.assert_close(backend(x3, w), F.linear(x3, w))
    assert dyn.calls == [(6, 64)]
    packed, scales = quantize_q4_g32(torch.randn(6, 64, generator=g).numpy())
    qw = Q4Weight(torch.from_numpy(packed), torch.from_numpy(scales))
    torch.testing.assert_close(backend(x, qw), torch_linear(x, qw))
    assert q4.calls == [(4, 64)]
    assert backend.counts == {"compiled": 3, "torch": 0, "fallback": 0, "dequant": 0}
    x9 = torch.randn(9, 64, generator=g)  # dense above every width: torch's GEMM, silently
    torch.testing.assert_close(backend(x9, w), F.linear(x9, w))
    assert backend.counts == {"compiled": 3, "torch": 1, "fallback": 0, "dequant": 0}
    with caplog.at_level(logging.WARNING, logger="ignis.runtime.linear"):
        backend(torch.randn(2, 64), torch.randn(7, 64))  # no [7, 64] function: fallback, one warning
        backend(torch.randn(2, 64), torch.randn(7, 64))
        backend(x.double(), w.double())  # no float64 function
    assert backend.counts["fallback"] == 3
    assert caplog.text.count("no compiled dense linear [7, 64] float32 for width 4") == 1
    assert LinearBackend()(x, w).shape == (3, 5)


def test_compiled_modules_of_an_artifact(
    artifact: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with load_artifact(artifact) as art:
        backend = art.linear_backend()
        w = art.target_weights()["model.layers.0.mlp.down_proj.weight"]
        g = torch.Generator().manual_seed(2)
        for rows in (1, 2, 4):
            x = torch.randn(rows, w.shape[1], generator=g)
            torch.testing.assert_close(backend(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert backend.counts["compiled"] == 3
        assert len(art.compiled_linears()) == 2 * len(art.manifest.modules[0].functions)
    # a module that cannot be loaded: skipped with a warning, its width runs on torch
    a = _copy(artifact, tmp_path / "a")
    m = read_manifest(a)
    (a / m.modules_for(4)[0].file).unlink()
    with caplog.at_level(logging.WARNING, logger="ignis.runtime.linear"):
        compiled = CompiledLinears.load(a, m)
    assert "not loaded" in caplog.text
    assert compiled.get(4, "dense", *np.asarray(w.shape).tolist(), "float32") is None
    assert compiled.get(1, "dense", *np.asarray(w.shape).tolist(), "float32") is not None


def test_dense_linears_beside_q4_only_modules_run_on_torch_by_design(caplog):
    """A CUDA build compiles q4_g32 functions only; its dense (precise) linears are not 'missing'."""
    import logging

    import torch

    from ignis.runtime.linear import CompiledLinears, LinearBackend

    def never_called(*_args):
        raise AssertionError("a q4 function was called for a dense weight")

    compiled = CompiledLinears({(4, "q4_g32", 8, 32, "float32"): (never_called, False, False)}, [4])
    backend = LinearBackend(compiled)
    x, w = torch.randn(3, 32), torch.randn(8, 32)
    with caplog.at_level(logging.WARNING):
        y = backend(x, w)
    torch.testing.assert_close(y, x @ w.T)
    assert backend.counts == {"compiled": 0, "torch": 1, "fallback": 0, "dequant": 0}
    assert not caplog.records


def test_q4_rows_past_the_widest_width_run_compiled_in_chunks():
    """A q4 weight at 70 rows over widths up to 32: compiled calls of 32 + 32 + 8, no dequantizing
    torch fallback (8 lanes x 8 columns = 64 rows hit this on the H200)."""
    import torch

    from ignis.formats import quantize_q4_g32
    from ignis.runtime.linear import CompiledLinears, LinearBackend, Q4Weight, torch_linear

    calls = []
    packed, scales = quantize_q4_g32(torch.randn(8, 64).numpy())
    qw = Q4Weight(torch.from_numpy(packed), torch.from_numpy(scales))

    def q4(xp, _packed, _scales, y):  # the module's contract: y[width, N] = xp @ dequant(W)^T
        calls.append(xp.shape[0])
        y.copy_(torch_linear(xp, qw))

    compiled = CompiledLinears(
        {(w, "q4_g32", 8, 64, "float32"): (q4, False, False) for w in (8, 32)}, [8, 32]
    )
    backend = LinearBackend(compiled)
    x, b = torch.randn(2, 35, 64), torch.randn(8)
    torch.testing.assert_close(backend(x, qw, b), torch_linear(x, qw, b))
    assert calls == [32, 32, 8]  # 70 rows: 32 + 32 + 6 (padded to width 8)
    assert backend.counts == {"compiled": 3, "torch": 0, "fallback": 0, "dequant": 0}


# ---------------------------------------------------------------------------------------------
# the compiled top-k (manifest `kernels`)


def _with_topk_entry(artifact: Path, dst: Path) -> Path:
    """A copy of the CPU artifact whose manifest lists a (dummy) CUDA top-k library."""
    from ignis.formats.manifest import KernelEntry

    a = _copy(artifact, dst)
    rel = "modules/h200/topk.so"
    (a / rel).parent.mkdir(parents=True)
    (a / rel).write_bytes(b"\x7fELF not really")
    m = read_manifest(a)
    files = tuple(sorted((*m.files, file_entry(a, rel, "module")), key=lambda f: f.path))
    entry = KernelEntry("topk", "topk", 1, rel, {"kind": "cuda", "arch": "sm_90"}, ("bfloat16", "float32"))
    _rewrite_manifest(a, files=files, kernels=(entry,))
    return a


def test_topk_module_is_none_without_a_kernel_entry(artifact: Path, tmp_path: Path) -> None:
    with load_artifact(artifact) as art:
        assert art.manifest.version == 2 and art.manifest.kernels == ()
        assert art.topk_module() is None
    # an artifact built before the kernels (manifest version 1) still loads, with no kernel
    old = _copy(artifact, tmp_path / "v1")
    _rewrite_manifest(old, version=1)
    raw = json.loads((old / MANIFEST_NAME).read_text())
    assert raw["version"] == 1 and "kernels" not in raw
    with load_artifact(old) as art:
        assert art.manifest.version == 1 and art.topk_module() is None


def test_topk_module_loads_the_listed_kernel_once(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import ignis.runtime.kernels.tvm_runtime as tvm_runtime
    from ignis.runtime.kernels.topk import TopKModule
    from ignis.runtime.kernels.tvm_runtime import TvmRuntimeError

    a = _with_topk_entry(artifact, tmp_path / "a")
    calls: list[tuple[Path, str]] = []

    def func(*args: Any) -> None:
        return None

    def fake_load(path: Path, *, cuda: bool | None = None) -> Any:
        assert cuda is True

        class Module(dict):  # records which export the loader asks for
            def __getitem__(self, name: str) -> Any:
                calls.append((Path(path), name))
                return super().__getitem__(name)

        return Module(topk=func)

    monkeypatch.setattr(tvm_runtime, "load_module", fake_load)
    # no CUDA device: a CUDA kernel is not even loaded
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with load_artifact(a) as art:
        assert art.manifest.kernel("topk") is not None and art.manifest.kernel("topk", "float16") is None
        assert art.topk_module() is None and calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with load_artifact(a) as art:
        mod = art.topk_module()
        assert isinstance(mod, TopKModule) and art.topk_module() is mod  # loaded once
        assert calls == [(a / "modules/h200/topk.so", "topk")] and mod.func is func
        assert mod.dtypes == (torch.bfloat16, torch.float32)

    def failing_load(path: Path, **_kw: Any) -> Any:
        raise TvmRuntimeError(f"cannot load module {path}")

    monkeypatch.setattr(tvm_runtime, "load_module", failing_load)
    with load_artifact(a) as art, caplog.at_level(logging.WARNING, logger="ignis.runtime.artifact"):
        assert art.topk_module() is None
    assert "compiled top-k modules/h200/topk.so not loaded" in caplog.text
    # the kernel's library is a module file: its sha256 is checked at load like the others
    (a / "modules/h200/topk.so").write_bytes(b"\x7fELF not reallx")
    with pytest.raises(ArtifactChecksumError, match=r"modules/h200/topk\.so"):
        load_artifact(a)


def test_the_dflash2_drafter_gets_the_kernel_on_cuda_only() -> None:
    from types import SimpleNamespace

    from ignis.runtime.server.artifact_source import attach_topk

    asked: list[int] = []
    module = object()

    def topk_module() -> object:
        asked.append(1)
        return module

    art = SimpleNamespace(topk_module=topk_module)
    drafter = SimpleNamespace(topk_module=None)
    assert attach_topk(drafter, art, torch.device("cpu")) is drafter
    assert drafter.topk_module is None and asked == []
    attach_topk(drafter, art, torch.device("cuda", 0))
    assert drafter.topk_module is module and asked == [1]


# ---------------------------------------------------------------------------------------------
# the hybrid rounds' fused kernels (manifest `kernels`: gdn_recurrent, add_rms_norm + gated_rms_norm,
# gdn_conv_silu + qk_norm_rope_kv)

_ALL = ("bfloat16", "float16", "float32")


def _with_hybrid_entries(
    artifact: Path,
    dst: Path,
    *,
    norms: tuple[str, ...] = ("add_rms_norm", "gated_rms_norm"),
    mixers: tuple[tuple[str, str, tuple[str, ...]], ...] = (),
    gdn_extra: tuple[tuple[str, str], ...] = (),
) -> Path:
    """A copy of the CPU artifact whose manifest lists (dummy) CUDA GDN and norm libraries, the
    `mixers` entries (kind, file under modules/h200/, dtypes) and `gdn_extra` ones (kind, file)."""
    from ignis.formats.manifest import KernelEntry

    a = _copy(artifact, dst)
    cuda = {"kind": "cuda", "arch": "sm_90"}
    entries = [
        KernelEntry("gdn_recurrent", "gdn_recurrent", 1, "modules/h200/gdn_recurrent.so", cuda, ("bfloat16",))
    ]
    entries += [KernelEntry(k, k, 1, f"modules/h200/{f}", cuda, ("float32",)) for k, f in gdn_extra]
    entries += [KernelEntry(k, k, 1, "modules/h200/fused_norms.so", cuda, _ALL) for k in norms]
    entries += [KernelEntry(k, k, 1, f"modules/h200/{f}", cuda, d) for k, f, d in mixers]
    (a / "modules/h200").mkdir(parents=True)
    rels = sorted({e.file for e in entries})
    for rel in rels:
        (a / rel).write_bytes(b"\x7fELF " + rel.encode())
    m = read_manifest(a)
    files = tuple(sorted((*m.files, *(file_entry(a, rel, "module") for rel in rels)), key=lambda f: f.path))
    _rewrite_manifest(a, files=files, kernels=tuple(entries))
    return a


def _fake_tvm(monkeypatch: pytest.MonkeyPatch, loaded: list[Path], *, fail: bool = False) -> dict[str, Any]:
    import ignis.runtime.kernels.tvm_runtime as tvm_runtime

    funcs: dict[str, Any] = {
        n: (lambda *args, n=n: None)
        for n in (
            "gdn_recurrent",
            "gdn_recurrent_stash",
            "gdn_replay",
            "add_rms_norm",
            "gated_rms_norm",
            "silu_mul",
            "narrow_linear",
            "gdn_conv_silu",
            "qk_norm_rope_kv",
            "gated_attention",
            "add_rms_norm_llama",
            "rope_kv",
            "grouped_attention",
        )
    }

    def load_module(path: Any, *, cuda: bool | None = None) -> dict[str, Any]:
        assert cuda is True
        loaded.append(Path(path))
        if fail:
            raise tvm_runtime.TvmRuntimeError(f"cannot load module {path}: no libcuda")
        return funcs

    monkeypatch.setattr(tvm_runtime, "load_module", load_module)
    return funcs


def test_hybrid_kernels_are_none_on_a_cpu_artifact(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[Path] = []
    _fake_tvm(monkeypatch, loaded)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # even with a GPU: nothing listed
    with load_artifact(artifact) as art:
        assert art.manifest.kernels == ()
        assert art.gdn_module() is None and art.norms_module() is None and art.topk_module() is None
        assert art.mixers_module() is None
        assert art._hybrid_kernels(torch.bfloat16) == {}
    assert loaded == []


def test_gdn_and_norms_modules_load_the_listed_kernels_once(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ignis.runtime.kernels.fused_norms import FusedNormsKernel
    from ignis.runtime.kernels.gdn_recurrent import GdnRecurrentKernel

    a = _with_hybrid_entries(artifact, tmp_path / "a")
    loaded: list[Path] = []
    funcs = _fake_tvm(monkeypatch, loaded)
    # no CUDA device: listed CUDA kernels are not loaded
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with load_artifact(a) as art:
        assert art.gdn_module() is None and art.norms_module() is None and loaded == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with load_artifact(a) as art:
        gdn, norms = art.gdn_module(), art.norms_module()
        assert isinstance(gdn, GdnRecurrentKernel) and gdn.func is funcs["gdn_recurrent"]
        assert not gdn.has_replay  # the manifest lists no stash round and replay
        assert isinstance(norms, FusedNormsKernel)
        assert norms.funcs == {k: funcs[k] for k in ("add_rms_norm", "gated_rms_norm")}
        assert art.gdn_module() is gdn and art.norms_module() is norms  # loaded once each
        assert loaded == [a / "modules/h200/gdn_recurrent.so", a / "modules/h200/fused_norms.so"]
        assert art.topk_module() is None  # no top-k listed
    # a load failure is logged and means the torch path
    _fake_tvm(monkeypatch, loaded, fail=True)
    with load_artifact(a) as art, caplog.at_level(logging.WARNING, logger="ignis.runtime.artifact"):
        assert art.gdn_module() is None and art.norms_module() is None
    assert "compiled GDN recurrence modules/h200/gdn_recurrent.so not loaded" in caplog.text
    assert "compiled row norms modules/h200/fused_norms.so not loaded" in caplog.text


def test_norms_module_takes_silu_mul_and_narrow_linear_when_listed(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An artifact built since session 10 lists ``silu_mul`` and ``narrow_linear`` in the norms'
    library: the runtime's norms take them (one load); an older one does not list them and its
    norms run without (the torch activation and b|a projection)."""
    from ignis.runtime.kernels.fused_norms import FusedNormsKernel

    kinds = ("add_rms_norm", "gated_rms_norm", "silu_mul", "narrow_linear")
    a = _with_hybrid_entries(artifact, tmp_path / "a", norms=kinds)
    loaded: list[Path] = []
    funcs = _fake_tvm(monkeypatch, loaded)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with load_artifact(a) as art:
        norms = art.norms_module()
        assert isinstance(norms, FusedNormsKernel) and norms.has_silu_mul and norms.has_narrow_linear
        assert norms.funcs == {k: funcs[k] for k in kinds}
        assert loaded == [a / "modules/h200/fused_norms.so"]
    old = _with_hybrid_entries(artifact, tmp_path / "old")
    with load_artifact(old) as art:
        norms = art.norms_module()
        assert isinstance(norms, FusedNormsKernel)
        assert not norms.has_silu_mul and not norms.has_narrow_linear


def test_llama_kernels_are_passed_when_the_llama_exports_are_listed(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`StaticLlamaExecutor` gets the fused norms when the manifest lists ``add_rms_norm_llama`` and
    the fused mixers when it lists ``rope_kv`` (with grouped_attention for bf16 / f16); an artifact
    built before them (the hybrid exports only) gets neither: the torch ops."""
    norms = ("add_rms_norm", "gated_rms_norm", "silu_mul", "narrow_linear", "add_rms_norm_llama")
    hybrid_mixers = (("gdn_conv_silu", "fused_mixers.so", _ALL), ("qk_norm_rope_kv", "fused_mixers.so", _ALL))
    mixers = (
        *hybrid_mixers,
        ("rope_kv", "fused_mixers.so", _ALL),
        ("grouped_attention", "fused_mixers.so", ("bfloat16", "float16")),
    )
    a = _with_hybrid_entries(artifact, tmp_path / "a", norms=norms, mixers=mixers)
    loaded: list[Path] = []
    _fake_tvm(monkeypatch, loaded)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with load_artifact(a) as art:
        kw = art._llama_kernels(torch.bfloat16)
        assert set(kw) == {"norms_module", "mixers_module"}
        assert kw["norms_module"].has_add_rms_norm_llama and kw["norms_module"].has_silu_mul
        assert kw["mixers_module"].has_rope_kv and kw["mixers_module"].has_grouped_attention
        assert set(art._llama_kernels(torch.float32)) == {"norms_module", "mixers_module"}
    old = _with_hybrid_entries(artifact, tmp_path / "old", norms=norms[:4], mixers=hybrid_mixers)
    with load_artifact(old) as art:
        assert art._llama_kernels(torch.bfloat16) == {}


@pytest.mark.parametrize(
    ("extra", "replay"),
    [
        ((("gdn_recurrent_stash", "gdn_recurrent.so"), ("gdn_replay", "gdn_recurrent.so")), True),
        ((("gdn_replay", "gdn_recurrent.so"),), False),  # half of the pair
        ((("gdn_recurrent_stash", "gdn_recurrent.so"), ("gdn_replay", "other.so")), False),  # two files
    ],
)
def test_gdn_module_takes_the_stash_round_and_replay_when_listed(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: tuple, replay: bool
) -> None:
    """An artifact listing `gdn_recurrent_stash` and `gdn_replay` in the GDN library gives rounds
    that keep no per-column states (the executor's replay path); anything less, the record path."""
    a = _with_hybrid_entries(artifact, tmp_path / "a", gdn_extra=extra)
    loaded: list[Path] = []
    funcs = _fake_tvm(monkeypatch, loaded)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with load_artifact(a) as art:
        gdn = art.gdn_module()
        assert gdn is not None and gdn.has_replay == replay and gdn.func is funcs["gdn_recurrent"]
        if replay:
            assert gdn.stash_func is funcs["gdn_recurrent_stash"] and gdn.replay_func is funcs["gdn_replay"]


def test_half_listed_norms_are_not_used(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    a = _with_hybrid_entries(artifact, tmp_path / "a", norms=("add_rms_norm",))
    loaded: list[Path] = []
    _fake_tvm(monkeypatch, loaded)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with load_artifact(a) as art, caplog.at_level(logging.WARNING, logger="ignis.runtime.artifact"):
        assert art.norms_module() is None and art.gdn_module() is not None
    assert loaded == [a / "modules/h200/gdn_recurrent.so"]
    assert "not all of ['add_rms_norm', 'gated_rms_norm'] in one library" in caplog.text


def _tiny_hybrid_config() -> Any:
    from ignis.runtime.families.qwen3_5 import Qwen3_5Config

    return Qwen3_5Config.from_hf(
        dict(
            vocab_size=320,
            hidden_size=64,
            num_hidden_layers=2,
            full_attention_interval=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            intermediate_size=96,
            max_position_embeddings=512,
        )
    )


_MIXERS = (
    ("gdn_conv_silu", "fused_mixers.so", _ALL),
    ("qk_norm_rope_kv", "fused_mixers.so", _ALL),
)


def test_mixers_module_loads_the_listed_kernels_once(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ignis.runtime.kernels.fused_mixers import FusedMixersKernel

    a = _with_hybrid_entries(artifact, tmp_path / "a", mixers=_MIXERS)
    loaded: list[Path] = []
    funcs = _fake_tvm(monkeypatch, loaded)
    # no CUDA device: listed CUDA kernels are not loaded
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with load_artifact(a) as art:
        art.config = _tiny_hybrid_config()
        assert art.mixers_module() is None and art._hybrid_kernels(torch.bfloat16) == {} and loaded == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with load_artifact(a) as art:
        mixers = art.mixers_module()
        assert isinstance(mixers, FusedMixersKernel)
        assert mixers.funcs == {k: funcs[k] for k in ("gdn_conv_silu", "qk_norm_rope_kv")}
        assert art.mixers_module() is mixers  # loaded once
        assert loaded == [a / "modules/h200/fused_mixers.so"]
    # a load failure is logged and means the torch path
    _fake_tvm(monkeypatch, loaded, fail=True)
    with load_artifact(a) as art, caplog.at_level(logging.WARNING, logger="ignis.runtime.artifact"):
        art.config = _tiny_hybrid_config()
        assert art.mixers_module() is None
        assert "mixers_module" not in art._hybrid_kernels(torch.bfloat16)
    assert "compiled mixer pieces modules/h200/fused_mixers.so not loaded" in caplog.text


def test_inspect_lists_the_kernel_libraries(artifact: Path, tmp_path: Path) -> None:
    """`ignis-inspect` lists the manifest's compiled kernels (kind, abi, file, symbol, dtypes)."""
    from click.testing import CliRunner

    from ignis.tools.inspect_artifact import main as inspect_cli

    a = _with_hybrid_entries(
        artifact,
        tmp_path / "a",
        mixers=(*_MIXERS, ("gated_attention", "fused_mixers.so", ("bfloat16", "float16"))),
    )
    result = CliRunner().invoke(inspect_cli, [str(a)])
    assert result.exit_code == 0, result.output
    assert "kernels: 6" in result.output
    assert (
        "  gdn_recurrent (abi 1): modules/h200/gdn_recurrent.so :: gdn_recurrent [bfloat16]" in result.output
    )
    assert (
        "  gated_attention (abi 1): modules/h200/fused_mixers.so :: gated_attention [bfloat16, float16]"
        in (result.output)
    )
    plain = CliRunner().invoke(inspect_cli, [str(artifact)])  # a CPU artifact lists none
    assert plain.exit_code == 0 and "kernels:" not in plain.output


def test_mixers_module_takes_the_gated_attention_of_its_library(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An artifact built since the gated attention lists it in the mixers' library: the executor's
    mixers get it (`has_gated_attention`); listed in another file, or not listed (an artifact built
    before it), they do not."""
    bf = ("bfloat16", "float16")
    loaded: list[Path] = []
    funcs = _fake_tvm(monkeypatch, loaded)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cases = (
        ((*_MIXERS, ("gated_attention", "fused_mixers.so", bf)), True),
        ((*_MIXERS, ("gated_attention", "other.so", bf)), False),
        (_MIXERS, False),
    )
    for i, (mixers, expect) in enumerate(cases):
        a = _with_hybrid_entries(artifact, tmp_path / f"a{i}", mixers=mixers)
        with load_artifact(a) as art:
            mod = art.mixers_module()
            assert mod is not None and mod.has_gated_attention is expect
            if expect:
                assert mod.funcs["gated_attention"] is funcs["gated_attention"]


@pytest.mark.parametrize(
    "mixers",
    [
        (("gdn_conv_silu", "fused_mixers.so", _ALL),),  # one of the pair
        (("gdn_conv_silu", "fused_mixers.so", _ALL), ("qk_norm_rope_kv", "other.so", _ALL)),  # two files
    ],
)
def test_half_listed_mixers_are_not_used(
    artifact: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    mixers: tuple[tuple[str, str, tuple[str, ...]], ...],
) -> None:
    a = _with_hybrid_entries(artifact, tmp_path / "a", mixers=mixers)
    loaded: list[Path] = []
    _fake_tvm(monkeypatch, loaded)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with load_artifact(a) as art, caplog.at_level(logging.WARNING, logger="ignis.runtime.artifact"):
        art.config = _tiny_hybrid_config()
        assert art.mixers_module() is None and art.norms_module() is not None
        assert "mixers_module" not in art._hybrid_kernels(torch.bfloat16)
    assert a / "modules/h200/fused_mixers.so" not in loaded
    assert "not all of ['gdn_conv_silu', 'qk_norm_rope_kv'] in one library" in caplog.text


def test_the_static_executor_gets_the_kernels_for_its_dtype(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make_executor`'s keyword arguments for StaticHybridExecutor: each fused kernel only when the
    manifest lists it for the executor's dtype, the config fits it and it loads."""
    import dataclasses as dc

    from ignis.runtime.kernels.fused_mixers import FusedMixersKernel
    from ignis.runtime.kernels.fused_norms import FusedNormsKernel
    from ignis.runtime.kernels.gdn_recurrent import GdnRecurrentKernel

    hybrid = _tiny_hybrid_config()
    # the mixers listed for bfloat16 and float32 only (the pair must cover the dtype)
    mixers = (
        ("gdn_conv_silu", "fused_mixers.so", ("bfloat16", "float32")),
        ("qk_norm_rope_kv", "fused_mixers.so", ("bfloat16", "float16", "float32")),
    )
    a = _with_hybrid_entries(artifact, tmp_path / "a", mixers=mixers)
    _fake_tvm(monkeypatch, [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with load_artifact(a) as art:
        art.config = hybrid
        got = art._hybrid_kernels(torch.bfloat16)
        assert sorted(got) == ["gdn_module", "mixers_module", "norms_module"]
        assert isinstance(got["gdn_module"], GdnRecurrentKernel)
        assert isinstance(got["norms_module"], FusedNormsKernel)
        assert isinstance(got["mixers_module"], FusedMixersKernel)
        assert got["mixers_module"] is art.mixers_module()
        # the GDN entry lists bfloat16 only, gdn_conv_silu not float16
        assert sorted(art._hybrid_kernels(torch.float16)) == ["norms_module"]
        assert sorted(art._hybrid_kernels(torch.float32)) == ["mixers_module", "norms_module"]
        # shapes the kernel does not take: not passed (the executor would refuse it)
        art.config = dc.replace(hybrid, linear_key_head_dim=512)
        assert sorted(art._hybrid_kernels(torch.bfloat16)) == ["mixers_module", "norms_module"]


# ---------------------------------------------------------------------------------------------
# On a GPU host, from a hybrid artifact built for its card ($IGNIS_GDN_ARTIFACT: the artifact
# directory, e.g. a tiny qwen3_5 (+ DFlash2 drafter) built for h200 on the build host)


def _gdn_gpu_artifact() -> Path:
    import os

    from ignis.formats import read_manifest

    env = os.environ.get("IGNIS_GDN_ARTIFACT")
    if not env:
        pytest.skip("set IGNIS_GDN_ARTIFACT to a hybrid artifact built for this GPU's card")
    path = Path(env)
    entry = read_manifest(path).kernel("gdn_recurrent")
    major, minor = torch.cuda.get_device_capability()
    if entry is None or entry.target.get("arch") != f"sm_{major}{minor}":
        pytest.skip(f"{path} lists no gdn_recurrent kernel for sm_{major}{minor}")
    return path


def _greedy_eager(ex: Any, prompt: torch.Tensor, n_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Token-by-token greedy decoding: (the tokens, the logits row each was taken from)."""
    lane = ex.new_lane()
    out = ex.forward([lane], [prompt], record=False)
    ex.commit([lane], [prompt.numel()])
    rows = [out.logits[0][-1].float()]
    produced = [int(rows[-1].argmax())]
    while len(produced) < n_new:
        out = ex.forward([lane], [torch.tensor([produced[-1]], device=prompt.device)])
        ex.commit([lane], [1])
        rows.append(out.logits[0][-1].float())
        produced.append(int(rows[-1].argmax()))
    return produced, rows


def _greedy_verify_rounds(ex: Any, prompt: torch.Tensor, drafts: list[int], n_new: int) -> list[int]:
    """Greedy decoding in verify rounds of 1 + 3 columns: the drafts come from `drafts` (every
    third round one is corrupted), the kept prefix is what the round's argmax confirms."""
    lane = ex.new_lane()
    out = ex.forward([lane], [prompt], record=False)
    ex.commit([lane], [prompt.numel()])
    produced = [int(out.logits[0][-1].argmax())]
    r = 0
    while len(produced) < n_new:
        guess = list(drafts[len(produced) : len(produced) + 3]) or [0]
        if r % 3 == 2:
            guess[-1] = (guess[-1] + 1) % ex.config.vocab_size
        cols = torch.tensor([produced[-1], *guess], device=prompt.device)
        pred = ex.forward([lane], [cols]).logits[0].argmax(-1).tolist()
        keep = 1
        while keep <= len(guess) and pred[keep - 1] == guess[keep - 1]:
            keep += 1
        ex.commit([lane], [keep])
        produced += pred[:keep]
        r += 1
    ex.release_lane(lane)
    return produced[:n_new]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_artifact_static_hybrid_executor_runs_the_fused_kernels() -> None:
    """make_executor on CUDA: a StaticHybridExecutor with the artifact's GDN recurrence and fused
    mixers (and row norms, when listed) attached and called; greedy decoding in verify rounds gives the eager
    executor's tokens (float32), and its logits to bf16 rounding with the card's dtype and the
    compiled q4 linears."""
    from ignis.runtime.families.hybrid_executor import HybridExecutor
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
    from ignis.runtime.kernels.fused_mixers import FusedMixersKernel
    from ignis.runtime.kernels.fused_norms import FusedNormsKernel
    from ignis.runtime.kernels.gdn_recurrent import GdnRecurrentKernel

    with load_artifact(_gdn_gpu_artifact()) as art:
        gdn = art.gdn_module()
        assert isinstance(gdn, GdnRecurrentKernel) and art.gdn_module() is gdn
        norms = art.norms_module()
        listed_norms = art.manifest.kernel("add_rms_norm") is not None
        assert isinstance(norms, FusedNormsKernel) == listed_norms
        mixers = art.mixers_module()
        assert isinstance(mixers, FusedMixersKernel), "the artifact lists no fused mixers (rebuild it)"
        assert art.mixers_module() is mixers
        # an artifact built since session 8 lists the stash round and the commit's replay
        assert gdn.has_replay == (art.manifest.kernel("gdn_replay") is not None)
        calls: list[str] = []
        for attr in ("func", "stash_func", "replay_func"):
            real = getattr(gdn, attr)
            if real is not None:
                setattr(gdn, attr, lambda *a, _f=real, _n=attr: (calls.append(_n), _f(*a))[1])
        mixer_calls: dict[str, int] = {}
        for name, func in list(mixers.funcs.items()):
            mixers.funcs[name] = lambda *a, _f=func, _n=name: (
                mixer_calls.__setitem__(_n, mixer_calls.get(_n, 0) + 1),
                _f(*a),
            )[1]
        norm_calls: dict[str, int] = {}
        for name, func in list(norms.funcs.items()) if norms is not None else []:
            norms.funcs[name] = lambda *a, _f=func, _n=name: (
                norm_calls.__setitem__(_n, norm_calls.get(_n, 0) + 1),
                _f(*a),
            )[1]
        vocab = art.config.vocab_size
        prompt = torch.tensor([5, 17, 33, 2, 90, 41, 7], device="cuda") % vocab
        n_new = 24
        for dtype, linear in ((torch.float32, None), (art.default_dtype(), art.linear_backend())):
            kw = {"device": "cuda", "dtype": dtype, "linear": linear}
            static = art.make_executor(**kw, max_lanes=2, max_context=256)
            eager = art.make_executor(**kw, cuda_graphs=False)
            assert isinstance(static, StaticHybridExecutor) and isinstance(eager, HybridExecutor)
            assert not isinstance(eager, StaticHybridExecutor)
            # the executor wraps what it is given: the same compiled functions
            assert static.gdn_module is not None and static.gdn_module.func is gdn.func
            if norms is None:
                assert static.norms_module is None
            else:
                assert static.norms_module is not None and static.norms_module.funcs == norms.funcs
            assert static.mixers_module is not None and static.mixers_module.funcs == mixers.funcs
            calls.clear()
            mixer_calls.clear()
            norm_calls.clear()
            want, rows = _greedy_eager(eager, prompt, n_new)
            if dtype == torch.float32:
                assert _greedy_verify_rounds(static, prompt, want, n_new) == want
            else:  # bf16: the logits of the eager tokens agree to bf16 rounding
                lane = static.new_lane()
                static.forward([lane], [prompt], record=False)
                static.commit([lane], [prompt.numel()])
                out = static.forward([lane], [torch.tensor(want[:8], device="cuda")])
                got = out.logits[0].float()
                torch.testing.assert_close(got, torch.stack(rows[1:9]), atol=0.15, rtol=0.05)
            assert calls, "the static rounds did not call the artifact's GDN kernel"
            if gdn.has_replay:  # rounds write the stash, commits replay; no record round
                assert {"stash_func", "replay_func"} <= set(calls) and "func" not in calls, calls
            # the gated attention (an artifact built since session 7) serves bf16 / f16 rounds only
            expect = ["gdn_conv_silu", "qk_norm_rope_kv"]
            if mixers.has_gated_attention and dtype != torch.float32:
                expect = ["gated_attention", *expect]
            assert sorted(mixer_calls) == expect, (
                f"the static rounds did not call the fused mixers: {mixer_calls}"
            )
            if norms is not None:  # an artifact built since session 10: the MLP activation, the b|a
                expect = ["add_rms_norm", "gated_rms_norm"]
                expect += ["narrow_linear"] if norms.has_narrow_linear else []
                expect += ["silu_mul"] if norms.has_silu_mul else []
                assert sorted(norm_calls) == sorted(expect), f"the norms module's calls: {norm_calls}"
