"""llama / qwen2 families: configs, and the torch executor held to HF transformers (the oracle).

Tiny random checkpoints are written by transformers' own classes (tests/hf_tiny.py), saved with
`save_pretrained`, imported through ignis' HF importer, and run side by side with the HF model.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from ignis.compiler.importers import load_checkpoint
from ignis.runtime.errors import ConfigError, StateError, TensorSetError, UnknownModelTypeError
from ignis.runtime.families import config_from_hf, get_family
from ignis.runtime.families.llama import LlamaConfig, LlamaExecutor, Qwen2Config, rope_inv_freq

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

FAMILIES = ["llama", "qwen2"]
PREFILL = 80  # > 64 tokens
DECODE_STEPS = 16
REL_TOL = 1e-4


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref| (the relative error the issue bounds by 1e-4)."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, HF model, ignis executor) from one tiny checkpoint written by HF and imported by ignis."""
    family = request.param
    model = hf_tiny.tiny_model(family, seed=0)
    folder = hf_tiny.save_tiny(model, tmp_path_factory.mktemp(family) / "ckpt")
    ckpt = load_checkpoint(folder)
    assert ckpt.config.model_type == family
    ex = get_family(family).make_executor(ckpt.config, ckpt.tensors.load_all(), "cpu", torch.float32)
    return family, model, ex


def _prompt(n: int, seed: int = 1, vocab: int = 384) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g)


def _run(ex, lane, ids: torch.Tensor, **kw) -> torch.Tensor:
    out = ex.forward([lane], [ids], **kw)
    ex.commit([lane], [ids.numel()])
    return out.logits[0]


# ---- configs -------------------------------------------------------------------------------------


def test_config_fields_and_defaults():
    raw = hf_tiny.llama_config().to_dict()
    cfg = config_from_hf(raw)
    assert isinstance(cfg, LlamaConfig)
    assert (cfg.head_dim, cfg.num_key_value_heads) == (16, 2)
    assert cfg.rope_parameters["rope_type"] == "llama3"
    # v4-style config.json: rope_theta + rope_scaling with the old "type" key; no num_key_value_heads.
    v4 = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    cfg = config_from_hf(v4)
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 4
    assert cfg.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    q = config_from_hf(hf_tiny.qwen2_config().to_dict())
    assert isinstance(q, Qwen2Config) and q.has_qkv_bias and not q.has_o_bias
    assert q.to_dict()["model_type"] == "qwen2"


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "llama3"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_config_validation(change, match):
    raw = {**hf_tiny.llama_config().to_dict(), **change}
    with pytest.raises(ConfigError, match=match):
        config_from_hf(raw)


def test_config_errors_are_typed():
    with pytest.raises(UnknownModelTypeError, match="mamba"):
        config_from_hf({"model_type": "mamba"})
    with pytest.raises(ConfigError, match="vocab_size"):
        config_from_hf({"model_type": "llama", "hidden_size": 8})
    with pytest.raises(ConfigError, match="sliding"):
        config_from_hf({**hf_tiny.qwen2_config().to_dict(), "use_sliding_window": True})


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 1e6},
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 5e5,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_inv_freq_matches_hf(rope):
    import transformers

    hf_cfg = hf_tiny.llama_config(rope_parameters=rope)
    hf_rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_cfg)
    ours = rope_inv_freq(config_from_hf(hf_cfg.to_dict()))
    assert torch.equal(ours, hf_rot.inv_freq)
    assert hf_rot.attention_scaling == 1.0


# ---- numerics against HF -----------------------------------------------------------------------------


def test_prefill_and_decode_match_hf(pair):
    family, model, ex = pair
    ids = _prompt(PREFILL)
    with torch.no_grad():
        out = model(ids[None], use_cache=True)
    lane = ex.new_lane()
    ours = _run(ex, lane, ids)
    assert ours.shape == (PREFILL, model.config.vocab_size) and ours.dtype == torch.float32
    assert rel_err(ours, out.logits[0]) < REL_TOL, family
    cache, nxt = out.cache, int(out.logits[0, -1].argmax())
    for step in range(DECODE_STEPS):
        with torch.no_grad():
            out = model(torch.tensor([[nxt]]), cache=cache, use_cache=True)
        cache = out.cache
        ours = _run(ex, lane, torch.tensor([nxt]))
        assert rel_err(ours, out.logits[0]) < REL_TOL, (family, step)
        nxt = int(out.logits[0, -1].argmax())
    assert lane.num_tokens == PREFILL + DECODE_STEPS


def test_greedy_32_tokens_match_hf(pair):
    family, model, ex = pair
    prompt = _prompt(12, seed=7)
    with torch.no_grad():
        ref = model.generate(
            prompt[None],
            max_new_tokens=32,
            do_sample=False,
            min_new_tokens=32,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref_tokens = ref.sequences[0, prompt.numel() :].tolist()
    lane = ex.new_lane()
    logits = _run(ex, lane, prompt, logits="last")[-1]
    ours, margins, errs = [], [], []
    for step in range(32):
        top2 = logits.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        errs.append(float((logits - ref.logits[step][0]).abs().max()))
        ours.append(int(logits.argmax()))
        logits = _run(ex, lane, torch.tensor([ours[-1]]))[-1]
    assert ours == ref_tokens, family
    # Exactness is only meaningful away from near-ties: every greedy choice wins by far more than
    # the numerical difference between the two implementations.
    assert min(margins) > 100 * max(errs), (min(margins), max(errs))


def test_hidden_states_and_taps_match_hf(pair):
    _family, model, ex = pair
    ids = _prompt(20, seed=3)
    with torch.no_grad():
        ref = model(ids[None], output_hidden_states=True)
    lane = ex.new_lane()
    out = ex.forward([lane], [ids], output_hidden_states=True, tap_layers=[0, 0])
    ex.commit([lane], [20])
    h = model.config.hidden_size
    # HF: hidden_states = (embeddings, layer 0 output, ..., final norm(last layer output)).
    assert rel_err(out.taps[0][:, :h], ref.hidden_states[1][0]) < REL_TOL
    assert torch.equal(out.taps[0][:, :h], out.taps[0][:, h:])
    with torch.no_grad():
        normed = model.model.norm(out.hidden_states[0])
    assert rel_err(normed, ref.hidden_states[-1][0]) < REL_TOL


def test_bf16_close_to_hf_bf16(pair):
    family, model, _ = pair
    state = {
        k: v
        for k, v in model.state_dict().items()
        if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
    }
    cfg = config_from_hf(model.config.to_dict())
    ex = LlamaExecutor(cfg, state, device="cpu", dtype=torch.bfloat16)
    ref_model = hf_tiny.tiny_model(family, seed=0).to(torch.bfloat16)
    ids = _prompt(PREFILL)
    with torch.no_grad():
        ref = ref_model(ids[None]).logits[0].float()
        fp32 = model(ids[None]).logits[0]
    ours = _run(ex, ex.new_lane(), ids)
    # bf16 has 8 mantissa bits: both implementations sit about equally far from float32.
    assert rel_err(ours, ref) < 3e-2
    assert rel_err(ours, fp32) < 3e-2


# ---- the verify-round protocol -------------------------------------------------------------------------


def test_lanes_of_different_lengths_in_one_forward_equal_alone(pair):
    _family, _model, ex = pair
    prompts = [_prompt(70, seed=11), _prompt(9, seed=12), _prompt(1, seed=13)]
    rounds = [
        [_prompt(1, seed=21), _prompt(4, seed=22), _prompt(3, seed=23)],
        [_prompt(5, seed=31), _prompt(1, seed=32), _prompt(2, seed=33)],
    ]
    keeps = [[1, 2, 3], [5, 1, 1]]
    lanes = [ex.new_lane() for _ in prompts]
    together = [ex.forward(lanes, prompts).logits]
    ex.commit(lanes, [p.numel() for p in prompts])
    for cols, keep in zip(rounds, keeps, strict=True):
        together.append(ex.forward(lanes, cols).logits)
        ex.commit(lanes, keep)
    for i in range(len(prompts)):
        lane = ex.new_lane()
        alone = [ex.forward([lane], [prompts[i]]).logits[0]]
        ex.commit([lane], [prompts[i].numel()])
        for cols, keep in zip(rounds, keeps, strict=True):
            alone.append(ex.forward([lane], [cols[i]]).logits[0])
            ex.commit([lane], [keep[i]])
        for a, t in zip(alone, together, strict=True):
            torch.testing.assert_close(t[i], a, rtol=1e-5, atol=1e-5)
        assert lane.num_tokens == lanes[i].num_tokens


def test_partial_commit_equals_feeding_only_kept_tokens(pair):
    _family, _model, ex = pair
    prefix, drafts, follow = _prompt(30, seed=41), _prompt(5, seed=42), _prompt(3, seed=43)
    spec, plain = ex.new_lane(), ex.new_lane()
    _run(ex, spec, prefix)
    _run(ex, plain, prefix)
    verify = ex.forward([spec], [drafts]).logits[0]
    ex.commit([spec], [2])
    fed = ex.forward([plain], [drafts[:2]]).logits[0]
    ex.commit([plain], [2])
    torch.testing.assert_close(verify[:2], fed, rtol=1e-5, atol=1e-5)
    assert spec.num_tokens == plain.num_tokens == 32
    torch.testing.assert_close(_run(ex, spec, follow), _run(ex, plain, follow), rtol=1e-5, atol=1e-5)
    # num_keep = 0 (a cancelled lane) leaves no trace either.
    ex.forward([spec], [drafts])
    ex.commit([spec], [0])
    torch.testing.assert_close(_run(ex, spec, follow[:1]), _run(ex, plain, follow[:1]), rtol=1e-5, atol=1e-5)


def test_protocol_errors(pair):
    _family, model, ex = pair
    lane = ex.new_lane()
    with pytest.raises(StateError, match="no pending"):
        ex.commit([lane], [1])
    ex.forward([lane], [_prompt(3)])
    with pytest.raises(StateError, match="uncommitted"):
        ex.forward([lane], [_prompt(1)])
    with pytest.raises(StateError, match="num_keep"):
        ex.commit([lane], [4])
    ex.commit([lane], [3])
    ex.forward([lane], [_prompt(3)], record=False)
    with pytest.raises(StateError, match="record=False"):
        ex.commit([lane], [2])
    ex.commit([lane], [3])
    with pytest.raises(StateError, match="twice"):
        ex.forward([lane, lane], [_prompt(1), _prompt(1)])
    with pytest.raises(StateError, match="outside"):
        ex.forward([lane], [torch.tensor([model.config.vocab_size])])
    with pytest.raises(StateError, match="max_position_embeddings"):
        ex.forward([lane], [torch.zeros(model.config.max_position_embeddings, dtype=torch.long)])
    with pytest.raises(StateError, match="non-empty"):
        ex.forward([lane], [torch.tensor([], dtype=torch.long)])
    other = get_family(_family).make_executor(
        ex.config,
        {
            k: v
            for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
        },
        "cpu",
        torch.float32,
    )
    with pytest.raises(StateError, match="not created by this executor"):
        other.forward([lane], [_prompt(1)])
    assert lane.num_tokens == 6


def test_executor_refuses_wrong_tensor_set(pair):
    _family, model, ex = pair
    state = {k: v for k, v in model.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    with pytest.raises(TensorSetError, match=r"model\.layers\.1\.mlp\.up_proj\.weight") as info:
        LlamaExecutor(ex.config, state)
    assert info.value.missing == ["model.layers.1.mlp.up_proj.weight"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_hf(pair, dtype):
    family, model, _ = pair
    cfg = config_from_hf(model.config.to_dict())
    state = {
        k: v
        for k, v in model.state_dict().items()
        if not (k == "lm_head.weight" and model.config.tie_word_embeddings)
    }
    ex = LlamaExecutor(cfg, state, device="cuda", dtype=dtype)
    ref_model = hf_tiny.tiny_model(family, seed=0).to("cuda", dtype)
    ids = _prompt(PREFILL)
    with torch.no_grad():
        out = ref_model(ids[None].cuda(), use_cache=True)
    lane = ex.new_lane()
    tol = REL_TOL if dtype == torch.float32 else 3e-2
    assert rel_err(_run(ex, lane, ids), out.logits[0]) < tol
    # the cache's name: `cache` in the pinned transformers, `past_key_values` in earlier 5.x (GPU hosts)
    key = "cache" if hasattr(out, "cache") else "past_key_values"
    cache, nxt = getattr(out, key), int(out.logits[0, -1].argmax())
    for _ in range(DECODE_STEPS):
        with torch.no_grad():
            out = ref_model(torch.tensor([[nxt]], device="cuda"), **{key: cache}, use_cache=True)
        cache = getattr(out, key)
        assert rel_err(_run(ex, lane, torch.tensor([nxt])), out.logits[0]) < tol
        nxt = int(out.logits[0, -1].argmax())
