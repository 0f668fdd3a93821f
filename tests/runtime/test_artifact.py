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
    assert backend.counts == {"compiled": 3, "torch": 0, "fallback": 0}
    x9 = torch.randn(9, 64, generator=g)  # dense above every width: torch's GEMM, silently
    torch.testing.assert_close(backend(x9, w), F.linear(x9, w))
    assert backend.counts == {"compiled": 3, "torch": 1, "fallback": 0}
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
    assert backend.counts == {"compiled": 0, "torch": 1, "fallback": 0}
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

    compiled = CompiledLinears({(w, "q4_g32", 8, 64, "float32"): (q4, False, False) for w in (8, 32)},
                               [8, 32])
    backend = LinearBackend(compiled)
    x, b = torch.randn(2, 35, 64), torch.randn(8)
    torch.testing.assert_close(backend(x, qw, b), torch_linear(x, qw, b))
    assert calls == [32, 32, 8]  # 70 rows: 32 + 32 + 6 (padded to width 8)
    assert backend.counts == {"compiled": 3, "torch": 0, "fallback": 0}


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
    import ignis.runtime.artifact as artifact_mod
    from ignis.runtime.topk import TopKModule
    from ignis.runtime.tvm_runtime import TvmRuntimeError

    a = _with_topk_entry(artifact, tmp_path / "a")
    calls: list[tuple[Path, str, tuple[str, ...] | None]] = []

    def fake_load(path: Path, *, name: str, dtypes: tuple[str, ...] | None) -> TopKModule:
        calls.append((path, name, dtypes))
        return TopKModule(lambda *args: None, dtypes=dtypes)

    monkeypatch.setattr(artifact_mod, "load_topk_module", fake_load)
    # no CUDA device: a CUDA kernel is not even loaded
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with load_artifact(a) as art:
        assert art.manifest.kernel("topk") is not None and art.manifest.kernel("topk", "float16") is None
        assert art.topk_module() is None and calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with load_artifact(a) as art:
        mod = art.topk_module()
        assert isinstance(mod, TopKModule) and art.topk_module() is mod  # loaded once
        assert calls == [(a / "modules/h200/topk.so", "topk", ("bfloat16", "float32"))]
        assert mod.dtypes == (torch.bfloat16, torch.float32)

    def failing_load(path: Path, **_kw: Any) -> TopKModule:
        raise TvmRuntimeError(f"cannot load module {path}")

    monkeypatch.setattr(artifact_mod, "load_topk_module", failing_load)
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
