"""`ignis.tools.random_checkpoint` (issue 25): random checkpoints of the public Qwen3.5-27B shape.

Checked on the `tiny` preset (the 27B's structure at toy sizes): the folder parses as the family's
config with every tensor of its table, in the asked dtype, sharded with an index; values follow the
init rules (std 0.02 matrices, identity norms, HF's A_log / dt_bias); the bytes do not depend on the
thread count; the tokenizer has exactly the model's vocabulary with the ChatML specials; `ignis-build`
accepts the checkpoint and its DFlash2 drafter, and the artifact generates. The 27B preset's config
and the public drafter's are checked without writing them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ignis.runtime.drafters.dflash2 import DFlash2Config, dflash2_tensor_shapes
from ignis.runtime.families.base import config_from_hf
from ignis.runtime.families.qwen3_5 import tensor_shapes
from ignis.tools import random_checkpoint as rc


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


def test_the_27b_preset_is_the_public_config() -> None:
    cfg = config_from_hf(rc.MODELS["qwen3_5-27b"])
    assert cfg.model_type == "qwen3_5_text"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size) == (
        5120,
        64,
        17408,
        248320,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 4, 256)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 48, 128)
    assert cfg.layer_types.count("full_attention") == 16 and cfg.layer_types[3] == "full_attention"
    assert cfg.rope_theta == 1e7 and cfg.partial_rotary_factor == 0.25 and not cfg.tie_word_embeddings
    params = sum(math.prod(s) for s in tensor_shapes(cfg).values())
    assert 26.5e9 < params < 27.5e9  # the published ~27B text trunk (the vision tower is not here)
    d = DFlash2Config.from_hf(rc.PUBLIC_27B_DFLASH2)
    assert d.target_layer_ids == (5, 19, 33, 47, 61) and d.num_target_layers == 64
    assert d.mask_token_id == 248070 and d.hidden_size == 5120 and d.vocab_size == 248320
    assert dflash2_tensor_shapes(d)["fc.weight"] == (5120, 5 * 5120)


def test_tiny_checkpoint_tensors_values_and_determinism(tmp_path: Path) -> None:
    cfg = rc.write_random_checkpoint(tmp_path / "a", model="tiny", seed=3, shard_gib=0.002, threads=1)
    raw = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config_from_hf(raw) == cfg
    # every linear's input width is a multiple of 128 (the CUDA cards' nvcc-built route)
    shapes = tensor_shapes(cfg)
    assert all(s[-1] % 128 == 0 for n, s in shapes.items() if n.endswith("proj.weight"))
    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    tensors = _tensors(tmp_path / "a")
    assert set(tensors) == set(shapes) == set(index["weight_map"])
    assert all(tuple(tensors[n].shape) == s and tensors[n].dtype == torch.bfloat16 for n, s in shapes.items())
    emb = tensors["model.embed_tokens.weight"].float()
    assert abs(emb.std().item() - rc.INIT_STD) < 0.002 and abs(emb.mean().item()) < 0.002
    assert torch.count_nonzero(tensors["model.layers.0.input_layernorm.weight"]) == 0  # (1 + w): identity
    assert torch.all(tensors["model.layers.0.linear_attn.norm.weight"] == 1)
    a = tensors["model.layers.0.linear_attn.A_log"].float().exp()
    assert a.min() >= 1 - 1e-2 and a.max() <= 16 + 0.1
    # the same seed with more threads and another shard size: the same values
    rc.write_random_checkpoint(tmp_path / "b", model="tiny", seed=3, shard_gib=1.0, threads=3)
    again = _tensors(tmp_path / "b")
    assert all(torch.equal(again[n], tensors[n]) for n in shapes)
    rc.write_random_checkpoint(tmp_path / "c", model="tiny", seed=3, shard_gib=1.0, threads=1)
    assert _digest(tmp_path / "b") == _digest(tmp_path / "c")
    rc.write_random_checkpoint(tmp_path / "d", model="tiny", seed=4, shard_gib=1.0, threads=1)
    assert not torch.equal(
        _tensors(tmp_path / "d")["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"]
    )


def test_blocks_of_a_large_tensor_are_drawn_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(rc, "BLOCK_ELEMENTS", 1000)
    alone = rc.init_tensor("x.weight", (64, 100), torch.bfloat16, seed=1)
    with ThreadPoolExecutor(4) as pool:
        pooled = rc.init_tensor("x.weight", (64, 100), torch.bfloat16, seed=1, pool=pool)
    assert torch.equal(alone, pooled)
    assert len(rc._blocks((64, 100))) == 7
    assert not torch.equal(alone[:10], alone[10:20])  # each block its own stream


def test_the_tokenizer_has_the_vocabulary_and_the_chat_specials(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    text, specials = rc.random_tokenizer_json(248320)
    tok = Tokenizer.from_str(text)
    assert tok.get_vocab_size() == 248320
    assert specials == {248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>"}
    assert tok.decode([300, 301], skip_special_tokens=False) == " t300 t301"
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 248045 and ids[-1] == 248046
    assert tok.decode(tok.encode("héllo wörld").ids) == "héllo wörld"  # byte-level: any text round-trips
    with pytest.raises(Exception, match="too small"):
        rc.random_tokenizer_json(100)


def test_ignis_build_takes_the_checkpoint_and_drafter_and_it_generates(tmp_path: Path) -> None:
    build = pytest.importorskip("ignis.compiler.build")
    from ignis.runtime.metrics import SpeculativeMetrics
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.sampling import SamplingParams
    from ignis.runtime.server.artifact_source import ArtifactSource
    from ignis.runtime.server.model import ModelSettings

    ckpt, drafter = tmp_path / "ckpt", tmp_path / "dflash2"
    rc.write_random_checkpoint(ckpt, model="tiny")
    d = rc.write_random_dflash2(ckpt, drafter, model="tiny")
    assert d.hidden_size == 256 and max(d.target_layer_ids) < 4
    (tmp_path / "r.toml").write_text('name = "tiny"\n[modules]\nwidths = []\n')
    res = build.build_artifact(
        card="cpu",
        model=ckpt,
        drafter=drafter,
        recipe=tmp_path / "r.toml",
        out=tmp_path / "art",
        progress=False,
        echo=lambda _l: None,
    )
    assert res.manifest is not None and res.manifest.family == "qwen3_5_text"
    src = ArtifactSource(res.out)
    assert src.spec_kinds[0] == "dflash2"
    model = src.load(ModelSettings(SpecDefaults("dflash2", 7), device="cpu"))
    try:
        engine = model.make_engine(2, SpeculativeMetrics())
        (out,) = engine.generate([[5, 17, 33, 2, 90]], SamplingParams(temperature=0, max_tokens=6))
        assert len(out.output_token_ids) == 6 and all(0 <= t < 1024 for t in out.output_token_ids)
    finally:
        if model.close is not None:
            model.close()


def test_the_27b_drafter_fits_a_shallower_smoke_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = dict(rc.MODELS["qwen3_5-27b"], num_hidden_layers=4)
    raw["layer_types"] = raw["layer_types"][:4]
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(raw))
    shapes: dict[str, tuple[int, ...]] = {}

    def fake_write(folder: Path, s: dict[str, tuple[int, ...]], **_kw: object) -> int:
        shapes.update(s)
        return 0

    monkeypatch.setattr(rc, "_write_tensors", fake_write)
    d = rc.write_random_dflash2(tmp_path / "t", tmp_path / "d", model="qwen3_5-27b")
    assert d.target_layer_ids == (0, 1, 2, 3) and d.num_target_layers == 4
    assert shapes["fc.weight"] == (5120, 4 * 5120) and d.intermediate_size == 17408


def test_confident_head_is_the_permuted_embedding_in_every_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # small blocks: several full ones permuted among themselves and a partial last one (1024 = 7 * 136 + 72)
    monkeypatch.setattr(rc, "BLOCK_ELEMENTS", 136 * 256)
    cfg = rc.write_random_checkpoint(tmp_path / "a", model="tiny", seed=5, confident=True, threads=2)
    raw = json.loads((tmp_path / "a" / "config.json").read_text())
    conf = rc.Confident.for_config(cfg)
    assert raw["ignis_random"] == {"confident": True, "rho": 1.0, "embed_std": conf.embed_std, "seed": 5}
    t = _tensors(tmp_path / "a")
    emb, head = t[rc.EMBED].float(), t[rc.HEAD].float()
    assert abs(emb.std().item() / conf.embed_std - 1) < 0.02
    assert abs(head.std().item() / rc.INIT_STD - 1) < 0.02
    pi = rc.confident_permutation(cfg.vocab_size, cfg.hidden_size, seed=5)
    assert sorted(pi.tolist()) == list(range(cfg.vocab_size))
    assert len(rc._blocks(tuple(head.shape))) == 8
    moved = pi // 136 != torch.arange(cfg.vocab_size) // 136
    assert moved[:952].float().mean() > 0.5  # the full blocks trade places
    assert torch.all(pi[952:] >= 952)  # the partial one keeps its place
    torch.testing.assert_close(head[pi], emb * (rc.INIT_STD / conf.embed_std), rtol=1e-2, atol=1e-5)
    # the rest is the default init, drawn from the same streams
    plain = rc.write_random_checkpoint(tmp_path / "b", model="tiny", seed=5, threads=1)
    assert plain == cfg
    other = _tensors(tmp_path / "b")
    assert all(torch.equal(other[n], t[n]) for n in t if n not in (rc.EMBED, rc.HEAD))
    assert torch.allclose(other[rc.EMBED].float() * (conf.embed_std / rc.INIT_STD), emb, rtol=1e-2)
    with pytest.raises(Exception, match="rho must be > 0"):
        rc.Confident.for_config(cfg, 0.0)


def test_confident_greedy_is_wide_margined_and_the_same_at_any_row_count(tmp_path: Path) -> None:
    """The tiny confident checkpoint (with its DFlash2 drafter grafted): greedy outputs at one row a
    round (one lane), at six lanes, and with the drafter's 8-column rounds are the same; the top-2
    logprob gap is >= 2 nats at every token (`Confident`'s margin estimate at tiny: ~2.4; the default
    init's median gap is ~0.05) and each token is pi of the one before."""
    build = pytest.importorskip("ignis.compiler.build")
    from ignis.runtime.metrics import SpeculativeMetrics
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.sampling import SamplingParams
    from ignis.runtime.server.artifact_source import ArtifactSource
    from ignis.runtime.server.model import ModelSettings

    ckpt = tmp_path / "ckpt"
    cfg = rc.write_random_checkpoint(ckpt, model="tiny", confident=True)
    rc.write_random_dflash2(ckpt, tmp_path / "d", model="tiny")
    (tmp_path / "r.toml").write_text('name = "tiny"\n[modules]\nwidths = []\n')
    res = build.build_artifact(
        card="cpu",
        model=ckpt,
        drafter=tmp_path / "d",
        recipe=tmp_path / "r.toml",
        out=tmp_path / "art",
        progress=False,
        echo=lambda _l: None,
    )
    prompts = [[(7 * i + 3 * j) % 1000 + 5 for j in range(6 + i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)

    def generate(spec: SpecDefaults, batch: list[list[int]]) -> tuple[list[list[int]], list[float]]:
        model = ArtifactSource(res.out).load(ModelSettings(spec, device="cpu"))
        try:
            out = model.make_engine(len(batch), SpeculativeMetrics()).generate(batch, params)
        finally:
            if model.close is not None:
                model.close()
        gaps = [lp.top[0][1] - lp.top[1][1] for r in out for lp in r.logprobs]
        return [list(r.output_token_ids) for r in out], gaps

    many, gaps = generate(SpecDefaults("off"), prompts)
    one = [generate(SpecDefaults("off"), [p])[0][0] for p in prompts[:3]]
    drafted, _ = generate(SpecDefaults("dflash2", 7), prompts)
    assert one == many[:3] and drafted == many
    assert min(gaps) > 2.0, min(gaps)
    pi = rc.confident_permutation(cfg.vocab_size, cfg.hidden_size)
    for p, o in zip(prompts, many, strict=True):
        walk = [p[-1], *o]
        assert all(int(pi[a]) == b for a, b in itertools.pairwise(walk))
