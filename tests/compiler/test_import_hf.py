"""HF folder import: config, safetensors (single and sharded), tokenizer files, typed errors."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ignis.compiler.errors import CheckpointError
from ignis.compiler.importers import load_checkpoint
from ignis.compiler.importers.hf import import_hf
from ignis.runtime.errors import ConfigError, TensorSetError, TensorShapeError, UnknownModelTypeError
from ignis.runtime.families.llama import LlamaConfig, Qwen2Config
from ignis.runtime.tokenizer import Tokenizer

try:
    import hf_tiny
except ImportError:  # tests/ is not on sys.path: load the helper by file path
    _spec = importlib.util.spec_from_file_location(
        "hf_tiny", Path(__file__).resolve().parents[1] / "hf_tiny.py"
    )
    assert _spec is not None and _spec.loader is not None
    hf_tiny = importlib.util.module_from_spec(_spec)
    sys.modules["hf_tiny"] = hf_tiny
    _spec.loader.exec_module(hf_tiny)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = hf_tiny.tiny_model("llama", seed=3)
    folder = hf_tiny.save_tiny(
        model,
        tmp_path_factory.mktemp("llama") / "ckpt",
        tokenizer=hf_tiny.tiny_tokenizer(),
        generation_config={"eos_token_id": [2, 0]},
    )
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_single_file_import(llama_dir):
    folder, state = llama_dir
    ckpt = load_checkpoint(folder)
    assert ckpt.format == "hf" and ckpt.source == folder
    assert isinstance(ckpt.config, LlamaConfig) and ckpt.config.num_hidden_layers == 2
    assert set(ckpt.tensors) == set(state)
    assert ckpt.tensors.shapes["model.layers.0.self_attn.k_proj.weight"] == (32, 64)
    assert set(ckpt.tensors.encodings.values()) == {"F32"}
    for name, t in ckpt.tensors.items():
        assert torch.equal(t, state[name]), name
    tok = ckpt.tokenizer
    assert tok is not None and tok.chat_template == hf_tiny.CHATML_TEMPLATE
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.eos_token_ids == (
        2,
        0,
    )  # generation_config first, then config.json / the eos token, deduplicated
    assert Tokenizer(tok).encode("hello") == Tokenizer(tok).backend.encode("hello").ids


def test_sharded_import_equals_single(tmp_path, llama_dir):
    _, state = llama_dir
    model = hf_tiny.tiny_model("llama", seed=3).to(torch.bfloat16)
    folder = hf_tiny.save_tiny(model, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    ckpt = import_hf(folder)
    assert len(ckpt.metadata["safetensors_files"]) == len(set(index["weight_map"].values()))
    assert set(ckpt.tensors.encodings.values()) == {"BF16"}
    assert ckpt.tokenizer is None  # no tokenizer.json in this folder
    for name, t in ckpt.tensors.load_all().items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, state[name].to(torch.bfloat16)), name


def test_qwen2_tied_checkpoint_with_stored_head(tmp_path):
    model = hf_tiny.tiny_model("qwen2", seed=4)
    folder = hf_tiny.save_tiny(model, tmp_path / "q")
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in tensors
    ckpt = import_hf(folder)
    assert isinstance(ckpt.config, Qwen2Config) and ckpt.config.tie_word_embeddings
    assert "model.layers.0.self_attn.q_proj.bias" in ckpt.tensors
    # Some tools store the tied head anyway (and old checkpoints the rotary inv_freq buffers):
    # HF ignores both, and so does the importer.
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    ckpt = import_hf(folder)
    assert "lm_head.weight" not in ckpt.tensors and not any("inv_freq" in n for n in ckpt.tensors)


def test_list_form_chat_templates(tmp_path, llama_dir):
    folder = _copy(llama_dir[0], tmp_path / "c")
    (folder / "chat_template.jinja").unlink()
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc["chat_template"] = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    tc["bos_token"] = {"content": "<|im_start|>", "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    spec = import_hf(folder).tokenizer
    assert spec.chat_template == "D" and spec.named_chat_templates == {"tool_use": "T"}
    assert spec.special_tokens["bos_token"] == "<|im_start|>"


def test_unknown_model_type(tmp_path, llama_dir):
    folder = _copy(llama_dir[0], tmp_path / "u")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "falcon_h1"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownModelTypeError, match=r"falcon_h1.*supported: \[.*'llama'.*'qwen2'"):
        import_hf(folder)


def test_invalid_config(tmp_path, llama_dir):
    folder = _copy(llama_dir[0], tmp_path / "v")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_key_value_heads"] = 3
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_key_value_heads 3"):
        import_hf(folder)
    (folder / "config.json").write_text("{broken")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        import_hf(folder)


def test_missing_and_unexpected_tensors_listed_at_once(tmp_path, llama_dir):
    folder = _copy(llama_dir[0], tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"], tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TensorSetError) as info:
        import_hf(folder)
    assert info.value.missing == ["model.layers.1.mlp.down_proj.weight", "model.norm.weight"]
    assert info.value.unexpected == ["model.layers.0.self_attn.q_norm.weight"]
    assert str(folder) in str(info.value)


def test_wrong_shape(tmp_path, llama_dir):
    folder = _copy(llama_dir[0], tmp_path / "s")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.v_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TensorShapeError, match=r"v_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        import_hf(folder)


def test_file_level_errors(tmp_path, llama_dir):
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "nothing")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="expected an HF checkpoint folder"):
        load_checkpoint(tmp_path / "x.bin")
    folder = _copy(llama_dir[0], tmp_path / "f")
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        import_hf(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        import_hf(folder)
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        import_hf(folder)


def test_sharded_index_errors(tmp_path):
    model = hf_tiny.tiny_model("qwen2", seed=5)
    folder = hf_tiny.save_tiny(model, tmp_path / "sh", max_shard_size="40KB")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.0.mlp.up_proj.weight"
    shard = next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][name])
    index["weight_map"][name] = shard  # a shard that does not hold it
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"up_proj\.weight.*not in this shard"):
        import_hf(folder)
    (folder / shard).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        import_hf(folder)


def _hybrid_helper():
    if "hf_tiny_hybrid" in sys.modules:
        return sys.modules["hf_tiny_hybrid"]
    spec = importlib.util.spec_from_file_location(
        "hf_tiny_hybrid", Path(__file__).resolve().parents[1] / "hf_tiny_hybrid.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["hf_tiny_hybrid"] = module
    spec.loader.exec_module(module)
    return module


def test_qwen3_5_moe_per_expert_checkpoint_imports_builds_and_matches_hf(tmp_path):
    """HF's save_pretrained writes one tensor per expert; the family's canonical layout is fused: the
    importer canonicalizes (Family.canonicalize_tensors) before checking, and the build serves it."""
    from ignis.compiler.build.pipeline import build_artifact
    from ignis.runtime.artifact import load_artifact
    from ignis.runtime.families import get_family
    from ignis.runtime.families.qwen3_5 import canonicalize_moe_tensors

    tiny = _hybrid_helper().make_tiny_hybrid("qwen3_5_moe", tmp_path / "moe")
    hf_tiny.tiny_tokenizer(vocab_size=320).save_pretrained(tmp_path / "moe")
    stored = load_file(str(tmp_path / "moe" / "model.safetensors"))
    per_expert = [n for n in stored if ".mlp.experts.0." in n]
    assert per_expert and not any(n.endswith("experts.gate_up_proj") for n in stored)  # as HF writes it

    family = get_family("qwen3_5_moe")
    assert family.canonicalize_tensors is not None and get_family("qwen3_5").canonicalize_tensors is None
    ckpt = import_hf(tmp_path / "moe")
    assert set(ckpt.tensors) == set(family.tensor_shapes(ckpt.config))  # fused, the canonical layout
    trunk = {n: t for n, t in tiny.tensors.items() if not n.startswith("mtp.")}
    want = canonicalize_moe_tensors(ckpt.config, trunk)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert ckpt.tensors.shapes[name] == tuple(want[name].shape)
    for n in (name, "model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.gate.weight"):
        assert torch.equal(ckpt.tensors[n], want[n]), n

    (tmp_path / "r.toml").write_text('name = "tiny-moe"\n[modules]\nwidths = [1, 4]\n')
    res = build_artifact(
        card="cpu",
        model=tmp_path / "moe",
        recipe=tmp_path / "r.toml",
        out=tmp_path / "tiny-moe",
        progress=False,
        echo=lambda _line: None,
    )
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, ckpt.config.vocab_size, (9,), generator=g)
    with torch.no_grad():
        hf_logits = tiny.hf_model(input_ids=ids[None]).logits[0].float()
    with load_artifact(res.out) as art:
        assert art.family.model_type == "qwen3_5_moe"
        backend = art.linear_backend()
        for linear in (None, backend):
            ex = art.make_executor(dtype=torch.float32, linear=linear)
            out = ex.forward([ex.new_lane()], [ids], record=False).logits[0]
            rel = float((out.double() - hf_logits.double()).abs().max() / hf_logits.double().abs().max())
            assert rel < 1e-4, (linear, rel)
        ex = art.make_executor(dtype=torch.float32, linear=backend)
        state = ex.new_lane()
        ex.forward([state], [ids[:5]], record=False)
        ex.commit([state], [5])
        out = ex.forward([state], [ids[5:]]).logits[0]  # 4 rows: the width-4 module
        rel = float((out.double() - hf_logits[5:].double()).abs().max() / hf_logits.double().abs().max())
        assert rel < 1e-4, rel
        assert backend.counts["compiled"] > 0 and backend.counts["fallback"] == 0
