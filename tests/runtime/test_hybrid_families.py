"""The hybrid families (qwen3_5, qwen3_5_moe, qwen3_next) against HF transformers, and the verify-round
state protocol (record / commit / rollback) of their executor.

Oracle: tiny random checkpoints written by HF's own classes (`tests/hf_tiny_hybrid.py`); "relative"
errors are max|ours - hf| / max|hf| over the compared logits.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from ignis.runtime.errors import (
    ConfigError,
    StateError,
    TensorSetError,
    TensorShapeError,
    UnknownModelTypeError,
)
from ignis.runtime.families import config_from_hf, get_family
from ignis.runtime.families.base import check_tensor_set
from ignis.runtime.families.gated_deltanet import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    l2_normalize,
)
from ignis.runtime.families.hybrid_executor import HybridExecutor, HybridLaneState, rms_norm_one_plus
from ignis.runtime.families.qwen3_5 import (
    Qwen3_5Config,
    Qwen3_5MoeConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    canonicalize_moe_tensors,
    map_hf_name,
    mtp_tensor_shapes,
    tensor_shapes,
)


def _load_helper():  # tests/hf_tiny_hybrid.py, by path (tests/ is not a package)
    name = "hf_tiny_hybrid"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[1] / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_helper = _load_helper()
FAMILIES, TinyHybrid, make_tiny_hybrid = _helper.FAMILIES, _helper.TinyHybrid, _helper.make_tiny_hybrid

REL_TOL = 1e-4
PROMPT_LEN = 90  # > one 64-token GDN chunk
MIN_GREEDY_MARGIN = 1e-3  # top-1 minus top-2 logit; below this a greedy choice is a near-tie


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def tokens(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyHybrid:
    torch.set_num_threads(1)
    return make_tiny_hybrid(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def ex(tiny: TinyHybrid) -> HybridExecutor:
    family = get_family(tiny.config.model_type)
    executor = family.make_executor(tiny.config, tiny.canonical_tensors(), "cpu", torch.float32)
    assert isinstance(executor, HybridExecutor)
    return executor


def feed(ex: HybridExecutor, ids: torch.Tensor, *, record: bool = False) -> HybridLaneState:
    """A lane that has committed `ids` in one forward (nothing for an empty tensor)."""
    state = ex.new_lane()
    if ids.numel():
        ex.forward([state], [ids], record=record)
        ex.commit([state], [ids.numel()])
    return state


def assert_same_state(
    ex: HybridExecutor, a: HybridLaneState, b: HybridLaneState, *, atol: float = 1e-5, rtol: float = 1e-5
) -> None:
    """Same committed length, KV cache, conv state and float32 recurrent state (to fp32 rounding)."""
    c = ex.config
    assert a.num_tokens == b.num_tokens
    for layer in range(c.num_hidden_layers):
        if c.is_full_attention(layer):
            (ka, va), (kb, vb) = a.kv(layer), b.kv(layer)
            assert ka.shape == kb.shape == (c.num_key_value_heads, a.num_tokens, c.head_dim)
            torch.testing.assert_close(ka, kb, atol=atol, rtol=rtol)
            torch.testing.assert_close(va, vb, atol=atol, rtol=rtol)
        else:
            torch.testing.assert_close(a.conv_state(layer), b.conv_state(layer), atol=atol, rtol=rtol)
            ra, rb = a.recurrent_state(layer), b.recurrent_state(layer)
            assert ra.dtype == rb.dtype == torch.float32
            torch.testing.assert_close(ra, rb, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# configs and tensor tables
# ---------------------------------------------------------------------------------------------


def test_config_from_hf(tiny: TinyHybrid) -> None:
    cfg = config_from_hf(tiny.raw_config)
    assert cfg == tiny.config
    hf_text = tiny.hf_model.config.get_text_config()
    assert (
        list(cfg.layer_types)
        == list(hf_text.layer_types)
        == ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    )
    assert cfg.rotary_dim == int(hf_text.head_dim * hf_text.rope_parameters["partial_rotary_factor"])
    assert cfg.rope_theta == hf_text.rope_parameters["rope_theta"]
    assert cfg.to_dict()["model_type"] == tiny.family
    assert config_from_hf(cfg.to_dict()) == cfg  # artifact metadata round trip
    if tiny.family == "qwen3_next":
        assert isinstance(cfg, Qwen3NextConfig)
        assert [cfg.is_moe_layer(i) for i in range(4)] == [True, True, False, True]
    elif tiny.family == "qwen3_5_moe":
        assert isinstance(cfg, Qwen3_5MoeConfig) and cfg.norm_topk_prob
    else:
        assert isinstance(cfg, Qwen3_5Config) and not cfg.is_moe


def test_config_variants_and_errors() -> None:
    base = dict(
        model_type="qwen3_next",
        vocab_size=10,
        hidden_size=8,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=16,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=4,
        shared_expert_intermediate_size=4,
        linear_key_head_dim=4,
        linear_value_head_dim=4,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
    )
    # legacy top-level rope fields and full_attention_interval (Qwen3-Next's released config.json style)
    cfg = config_from_hf(dict(base, rope_theta=1e6, partial_rotary_factor=0.5, full_attention_interval=4))
    assert isinstance(cfg, Qwen3NextConfig)
    assert cfg.rope_theta == 1e6 and cfg.rotary_dim == 4
    assert [cfg.is_full_attention(i) for i in range(8)] == [False, False, False, True] * 2
    assert config_from_hf(dict(base, num_nextn_predict_layers=2)).mtp_num_hidden_layers == 2
    # text-only checkpoint alias and a nested text_config with mrope (text positions -> plain RoPE)
    text = dict(
        base,
        model_type="qwen3_5_text",
        rope_parameters={"rope_type": "default", "rope_theta": 5.0, "mrope_section": [1, 1, 0]},
    )
    assert isinstance(config_from_hf(text), Qwen3_5TextConfig)
    nested = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": dict(text)}
    cfg5 = config_from_hf(nested)
    assert type(cfg5) is Qwen3_5Config and cfg5.tie_word_embeddings and cfg5.rope_theta == 5.0
    assert "lm_head.weight" not in tensor_shapes(cfg5)
    with pytest.raises(UnknownModelTypeError, match="qwen9"):
        config_from_hf(dict(base, model_type="qwen9"))
    with pytest.raises(ConfigError, match="hidden_size"):
        config_from_hf({k: v for k, v in base.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        config_from_hf(dict(base, rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ConfigError, match="layer_types"):
        config_from_hf(dict(base, layer_types=["linear_attention"] * 7 + ["sliding_attention"]))
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        config_from_hf(dict(base, linear_num_value_heads=3, linear_num_key_heads=2))
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        config_from_hf(dict(base, num_experts_per_tok=3))
    with pytest.raises(ConfigError, match="hidden_act"):
        config_from_hf(dict(base, hidden_act="gelu"))
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        config_from_hf(dict(base, mlp_only_layers=[8]))


def test_tensor_tables_match_hf_checkpoint(tiny: TinyHybrid) -> None:
    cfg = tiny.config
    # the saved checkpoint, mapped (vision tower dropped), canonical expert layout, MTP ignored
    shapes = {k: tuple(v.shape) for k, v in tiny.canonical_tensors().items()}
    check_tensor_set(cfg, shapes, source=str(tiny.folder), ignore_prefixes=("mtp.",))
    assert {k: v for k, v in shapes.items() if k.startswith("mtp.")} == mtp_tensor_shapes(cfg)
    # HF's in-memory parameter names (routed experts fused) map onto the fused table
    hf_shapes = {}
    for name, tensor in tiny.hf_model.state_dict().items():
        mapped = map_hf_name(name)
        if mapped is not None:
            hf_shapes[mapped] = tuple(tensor.shape)
    assert hf_shapes == tensor_shapes(cfg, expert_layout="fused")
    assert map_hf_name("model.visual.blocks.0.attn.qkv.weight") is None
    assert map_hf_name("model.language_model.norm.weight") == "model.norm.weight"
    assert map_hf_name("mtp.fc.weight") == "mtp.fc.weight"


def test_tensor_set_errors(tiny: TinyHybrid) -> None:
    cfg = tiny.config
    weights = tiny.canonical_tensors()
    broken = {
        k: v for k, v in weights.items() if k not in ("model.norm.weight", "model.layers.0.linear_attn.A_log")
    }
    broken["model.layers.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(TensorSetError) as info:
        HybridExecutor(cfg, broken)
    assert info.value.missing == ["model.layers.0.linear_attn.A_log", "model.norm.weight"]
    assert info.value.unexpected == ["model.layers.0.extra.weight"]
    with pytest.raises(TensorSetError):
        check_tensor_set(cfg, {k: v.shape for k, v in broken.items()}, source="x", ignore_prefixes=("mtp.",))
    wrong = dict(weights, **{"model.layers.1.self_attn.q_norm.weight": torch.zeros(3)})
    with pytest.raises(TensorShapeError, match="q_norm"):
        HybridExecutor(cfg, wrong)


def test_expert_layouts_are_interchangeable(tiny: TinyHybrid, ex: HybridExecutor) -> None:
    if not tiny.config.is_moe:
        pytest.skip("dense family")
    ids = tokens(12, 3, tiny.config.vocab_size)
    ref = ex.forward([state := ex.new_lane()], [ids]).logits[0]
    ex.commit([state], [0])
    for layout in ("fused", "per_expert"):
        weights = canonicalize_moe_tensors(tiny.config, tiny.tensors, expert_layout=layout)
        assert any(k.endswith("experts.gate_up_proj") for k in weights) == (layout == "fused")
        other = HybridExecutor(tiny.config, weights)
        out = other.forward([other.new_lane()], [ids]).logits[0]
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# against HF transformers
# ---------------------------------------------------------------------------------------------


def test_prefill_and_decode_match_hf(tiny: TinyHybrid, ex: HybridExecutor) -> None:
    vocab = tiny.config.vocab_size
    prompt = tokens(PROMPT_LEN, 1, vocab)
    with torch.no_grad():
        hf_out = tiny.hf_model(input_ids=prompt[None], use_cache=True)
    state = ex.new_lane()
    out = ex.forward([state], [prompt], record=False)
    ex.commit([state], [PROMPT_LEN])
    assert rel_err(out.logits[0], hf_out.logits[0]) < REL_TOL
    cache = hf_out.cache
    decode = tokens(16, 2, vocab)
    for step in range(16):
        tok = decode[step : step + 1]
        with torch.no_grad():
            hf_step = tiny.hf_model(input_ids=tok[None], cache=cache, use_cache=True)
        cache = hf_step.cache
        ours = ex.forward([state], [tok])
        ex.commit([state], [1])
        assert ours.logits[0].shape == (1, vocab)
        assert rel_err(ours.logits[0], hf_step.logits[0]) < REL_TOL, f"decode step {step}"
    assert state.num_tokens == PROMPT_LEN + 16


def test_greedy_32_tokens_match_hf_generate(tiny: TinyHybrid, ex: HybridExecutor) -> None:
    prompt = tokens(24, 18, tiny.config.vocab_size)  # seed with no near-tie (see margins)
    with torch.no_grad():
        hf_tokens = tiny.hf_model.generate(
            prompt[None], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, prompt.numel() :]
    state = ex.new_lane()
    out = ex.forward([state], [prompt], logits="last", record=False)
    ex.commit([state], [prompt.numel()])
    ours: list[int] = []
    margins: list[float] = []
    for _ in range(32):
        logits = out.logits[0][-1]
        top2 = logits.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        ours.append(int(logits.argmax()))
        out = ex.forward([state], [torch.tensor(ours[-1:])])
        ex.commit([state], [1])
    assert min(margins) > MIN_GREEDY_MARGIN, "near-tie in the greedy path: pick another seed"
    assert ours == hf_tokens.tolist()


def test_hidden_states_and_taps_match_hf(tiny: TinyHybrid, ex: HybridExecutor) -> None:
    ids = tokens(20, 5, tiny.config.vocab_size)
    with torch.no_grad():
        hf_hidden = tiny.hf_model(input_ids=ids[None], output_hidden_states=True).hidden_states
    n_layers, h = tiny.config.num_hidden_layers, tiny.config.hidden_size
    state = ex.new_lane()
    out = ex.forward([state], [ids], logits="last", output_hidden_states=True, tap_layers=[2, 0, 1])
    ex.commit([state], [0])
    taps = out.taps[0]
    assert taps.shape == (20, 3 * h)
    for j, layer in enumerate([2, 0, 1]):  # HF: hidden_states[i + 1] = output of layer i
        torch.testing.assert_close(
            taps[:, j * h : (j + 1) * h], hf_hidden[layer + 1][0], atol=1e-4, rtol=1e-4
        )
    # HF's last entry is after the final norm; ours is the last layer's output before it
    normed = rms_norm_one_plus(out.hidden_states[0], ex._final_norm, tiny.config.rms_norm_eps)
    torch.testing.assert_close(normed, hf_hidden[n_layers][0], atol=1e-4, rtol=1e-4)
    assert out.logits[0].shape == (1, tiny.config.vocab_size)
    assert state.num_tokens == 0


def test_tied_embeddings_match_hf(tmp_path: Path) -> None:
    tiny = make_tiny_hybrid("qwen3_5", tmp_path, seed=3, tie=True)
    assert tiny.config.tie_word_embeddings and "lm_head.weight" not in tiny.tensors
    ex = HybridExecutor(tiny.config, tiny.tensors)
    ids = tokens(70, 6, tiny.config.vocab_size)
    with torch.no_grad():
        ref = tiny.hf_model(input_ids=ids[None]).logits[0]
    assert rel_err(ex.forward([ex.new_lane()], [ids], record=False).logits[0], ref) < REL_TOL


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet algorithms and the verify-round state protocol
# ---------------------------------------------------------------------------------------------


def test_delta_rule_chunked_equals_recurrent() -> None:
    gen = torch.Generator().manual_seed(0)
    n, heads, dk, dv = 150, 3, 16, 8
    q = l2_normalize(torch.randn(n, heads, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(n, heads, dk, generator=gen))
    v = torch.randn(n, heads, dv, generator=gen)
    g = -torch.rand(n, heads, generator=gen)
    beta = torch.rand(n, heads, generator=gen)
    s0 = torch.randn(heads, dk, dv, generator=gen)
    o_rec, states = gated_delta_rule_recurrent(q, k, v, g, beta, s0, record=True)
    o_chunk, final = gated_delta_rule_chunked(q, k, v, g, beta, s0)
    torch.testing.assert_close(o_chunk, o_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, states[-1], atol=1e-5, rtol=1e-5)
    o_last, last = gated_delta_rule_recurrent(q, k, v, g, beta, s0, record=False)
    torch.testing.assert_close(o_last, o_rec, atol=0, rtol=0)
    torch.testing.assert_close(last, states[-1], atol=0, rtol=0)


def test_chunked_prefill_equals_token_by_token(tiny: TinyHybrid, ex: HybridExecutor) -> None:
    prompt = tokens(PROMPT_LEN, 7, tiny.config.vocab_size)
    chunked = ex.new_lane()
    all_logits = ex.forward([chunked], [prompt], record=False).logits[0]
    ex.commit([chunked], [PROMPT_LEN])
    stepped = ex.new_lane()
    for t in range(PROMPT_LEN):
        step = ex.forward([stepped], [prompt[t : t + 1]]).logits[0]
        ex.commit([stepped], [1])
        torch.testing.assert_close(step[0], all_logits[t], atol=1e-4, rtol=1e-4)
    # chunked vs token-by-token: different fp32 summation orders over 90 tokens and 4 layers
    assert_same_state(ex, chunked, stepped, atol=1e-4, rtol=1e-4)
    # two prefill calls across the chunk boundary reach the same state too
    split = feed(ex, prompt[:70])
    ex.forward([split], [prompt[70:]], record=False)
    ex.commit([split], [PROMPT_LEN - 70])
    assert_same_state(ex, chunked, split, atol=1e-4, rtol=1e-4)


def test_lanes_of_different_lengths_batch_like_alone(tiny: TinyHybrid, ex: HybridExecutor) -> None:
    vocab = tiny.config.vocab_size
    prefixes = [tokens(n, 10 + n, vocab) for n in (5, 70, 0)]
    cols = [tokens(n, 20 + n, vocab) for n in (3, 1, 8)]
    keeps = [2, 1, 5]
    for record in (True, False):
        batched = [feed(ex, p) for p in prefixes]
        out = ex.forward(batched, cols, record=record, output_hidden_states=True, tap_layers=[1])
        ex.commit(batched, keeps if record else [c.numel() for c in cols])
        for i, (prefix, col) in enumerate(zip(prefixes, cols, strict=True)):
            alone = feed(ex, prefix)
            ref = ex.forward([alone], [col], record=record, output_hidden_states=True, tap_layers=[1])
            ex.commit([alone], [keeps[i] if record else col.numel()])
            torch.testing.assert_close(out.logits[i], ref.logits[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.hidden_states[i], ref.hidden_states[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.taps[i], ref.taps[0], atol=1e-5, rtol=1e-5)
            assert_same_state(ex, batched[i], alone)


@pytest.mark.parametrize("num_keep", range(6))
def test_commit_keeps_exactly_the_committed_prefix(
    tiny: TinyHybrid, ex: HybridExecutor, num_keep: int
) -> None:
    vocab = tiny.config.vocab_size
    prefix, drafts, nxt = tokens(20, 30, vocab), tokens(5, 31, vocab), tokens(1, 32, vocab)
    verified = feed(ex, prefix)
    ex.forward([verified], [drafts], record=True)
    ex.commit([verified], [num_keep])
    reference = feed(ex, prefix)  # the same prefix, then only the kept drafts
    if num_keep:
        ex.forward([reference], [drafts[:num_keep]], record=True)
        ex.commit([reference], [num_keep])
    assert verified.num_tokens == 20 + num_keep
    assert_same_state(ex, verified, reference)  # to fp32 rounding of the R-row matmuls
    # and the next round sees exactly the same model state
    a = ex.forward([verified], [nxt]).logits[0]
    b = ex.forward([reference], [nxt]).logits[0]
    ex.commit([verified, reference], [1, 1])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_protocol_errors(tiny: TinyHybrid, ex: HybridExecutor) -> None:
    vocab = tiny.config.vocab_size
    lane = ex.new_lane()
    with pytest.raises(StateError, match="without a pending forward"):
        ex.commit([lane], [1])
    ex.forward([lane], [tokens(4, 40, vocab)], record=False)
    with pytest.raises(StateError, match="not committed"):
        ex.forward([lane], [tokens(1, 41, vocab)])
    with pytest.raises(StateError, match="record=False"):
        ex.commit([lane], [2])
    with pytest.raises(StateError, match=r"outside 0\.\.4"):
        ex.commit([lane], [5])
    ex.commit([lane], [0])  # discarding a prefill is allowed and leaves the lane untouched
    assert lane.num_tokens == 0 and not lane.is_pending
    assert float(lane.recurrent_state(0).abs().max()) == 0.0
    with pytest.raises(StateError, match="more than once"):
        ex.forward([lane, lane], [tokens(1, 42, vocab)] * 2)
    with pytest.raises(ValueError, match="token id"):
        ex.forward([lane], [torch.tensor([vocab])])
    with pytest.raises(ValueError, match="1-D integer"):
        ex.forward([lane], [torch.zeros(2)])
    with pytest.raises(ValueError, match="tap_layers"):
        ex.forward([lane], [tokens(1, 43, vocab)], tap_layers=[9])
    with pytest.raises(ValueError, match="not a full-attention layer"):
        lane.kv(0)
    other = HybridExecutor(tiny.config, tiny.canonical_tensors())
    with pytest.raises(StateError, match="this executor"):
        ex.forward([other.new_lane()], [tokens(1, 44, vocab)])
    small = HybridExecutor(
        dataclasses.replace(tiny.config, max_position_embeddings=8), tiny.canonical_tensors()
    )
    with pytest.raises(StateError, match="max_position_embeddings"):
        small.forward([small.new_lane()], [tokens(9, 45, vocab)])
    assert not lane.is_pending


def test_mtp_tensors_are_ignored_by_the_trunk(tiny: TinyHybrid, ex: HybridExecutor) -> None:
    assert any(k.startswith("mtp.") for k in tiny.tensors)
    trunk_only = {k: v for k, v in tiny.canonical_tensors().items() if not k.startswith("mtp.")}
    plain = HybridExecutor(tiny.config, trunk_only)
    ids = tokens(6, 50, tiny.config.vocab_size)
    a = plain.forward([plain.new_lane()], [ids]).logits[0]
    b = ex.forward([lane := ex.new_lane()], [ids]).logits[0]
    ex.commit([lane], [0])
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# bf16 and CUDA
# ---------------------------------------------------------------------------------------------


def test_bf16_smoke(tiny: TinyHybrid) -> None:
    ex16 = HybridExecutor(tiny.config, tiny.canonical_tensors(), dtype=torch.bfloat16)
    hf16 = copy.deepcopy(tiny.hf_model).to(torch.bfloat16)
    prompt = tokens(80, 60, tiny.config.vocab_size)
    with torch.no_grad():
        ref16 = hf16(input_ids=prompt[None]).logits[0].float()
        ref32 = tiny.hf_model(input_ids=prompt[None]).logits[0]
    state = ex16.new_lane()
    out = ex16.forward([state], [prompt], record=False).logits[0]
    ex16.commit([state], [80])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()

    def fro(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    # as accurate as HF's own bf16 run, and row by row close to it (a MoE routing flip may move a row)
    assert fro(out, ref32) < 1.25 * fro(ref16, ref32) + 1e-2
    row_err = (out - ref16).norm(dim=-1) / ref16.norm(dim=-1)
    assert float(row_err.median()) < 2e-2
    assert float((out.argmax(-1) == ref16.argmax(-1)).float().mean()) > 0.9
    layer_gdn, layer_attn = 0, 1
    assert state.recurrent_state(layer_gdn).dtype == torch.float32
    assert state.conv_state(layer_gdn).dtype == torch.bfloat16
    assert state.kv(layer_attn)[0].dtype == torch.bfloat16
    # a bf16 verify round with a partial commit
    ex16.forward([state], [tokens(4, 61, tiny.config.vocab_size)], record=True)
    ex16.commit([state], [2])
    assert state.num_tokens == 82


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu(tiny: TinyHybrid, ex: HybridExecutor) -> None:
    vocab = tiny.config.vocab_size
    prompt, drafts = tokens(PROMPT_LEN, 70, vocab), tokens(5, 71, vocab)
    cpu = ex.new_lane()
    ref_prompt = ex.forward([cpu], [prompt], record=False).logits[0]
    ex.commit([cpu], [PROMPT_LEN])
    ref_drafts = ex.forward([cpu], [drafts]).logits[0]
    ex.commit([cpu], [3])
    for dtype in (torch.float32, torch.bfloat16):
        gpu_ex = HybridExecutor(tiny.config, tiny.canonical_tensors(), device="cuda", dtype=dtype)
        lane = gpu_ex.new_lane()
        out_prompt = gpu_ex.forward([lane], [prompt], record=False).logits[0]
        gpu_ex.commit([lane], [PROMPT_LEN])
        out_drafts = gpu_ex.forward([lane], [drafts]).logits[0]
        gpu_ex.commit([lane], [3])
        assert out_prompt.device.type == "cuda" and out_prompt.dtype == torch.float32
        assert lane.recurrent_state(0).dtype == torch.float32 and lane.num_tokens == cpu.num_tokens
        if dtype == torch.float32:
            assert rel_err(out_prompt.cpu(), ref_prompt) < REL_TOL
            assert rel_err(out_drafts.cpu(), ref_drafts) < REL_TOL
            for layer in range(tiny.config.num_hidden_layers):
                if not tiny.config.is_full_attention(layer):
                    torch.testing.assert_close(
                        lane.recurrent_state(layer).cpu(), cpu.recurrent_state(layer), atol=1e-4, rtol=1e-4
                    )
        else:  # bf16: as close to fp32 as HF's own bf16 run (MoE routing flips make bf16 noisy)
            hf16 = copy.deepcopy(tiny.hf_model).to(torch.bfloat16)
            with torch.no_grad():
                hf_prompt16 = hf16(input_ids=prompt[None]).logits[0].float()

            def fro(a: torch.Tensor, b: torch.Tensor) -> float:
                return float((a - b).norm() / b.norm())

            ours16 = out_prompt.cpu()
            assert fro(ours16, ref_prompt) < 1.25 * fro(hf_prompt16, ref_prompt) + 1e-2
            agree_ours = float((ours16.argmax(-1) == ref_prompt.argmax(-1)).float().mean())
            agree_hf = float((hf_prompt16.argmax(-1) == ref_prompt.argmax(-1)).float().mean())
            assert agree_ours >= agree_hf - 0.05


def test_fusions_follow_what_the_compiled_functions_serve(tiny: TinyHybrid, ex: HybridExecutor) -> None:
    """The executor stacks a layer's q|k|v (and qkv|z, gate|up) when nothing is compiled or a
    compiled function serves the stacked shape, and keeps the members apart when only their own
    shapes are served (an artifact built before the fusion); the logits are the same either way."""
    from ignis.runtime.linear import CompiledLinears, LinearBackend

    c = tiny.config
    tensors = tiny.canonical_tensors()
    i = next(j for j in range(c.num_hidden_layers) if c.is_full_attention(j))
    q, k, v = (tuple(tensors[f"model.layers.{i}.self_attn.{m}_proj.weight"].shape) for m in "qkv")
    stacked = (q[0] + k[0] + v[0], q[1])

    def matmul(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> None:
        y.copy_(x @ w.T)

    def backend(shapes: set[tuple[int, int]]) -> LinearBackend:
        fns = {(64, "dense", n, kk, "float32"): (matmul, True, False) for n, kk in shapes}
        return LinearBackend(CompiledLinears(fns, [64]))

    ids = tokens(9, 3, c.vocab_size)
    want = ex.forward([ex.new_lane()], [ids]).logits[0]
    for linear, fused in ((None, True), (backend({q, k, v}), False), (backend({stacked}), True)):
        e = HybridExecutor(c, tensors, device="cpu", dtype=torch.float32, linear=linear)
        attn = e._layers[i].attn
        assert attn is not None and (attn.qkv_proj is not None) == fused
        assert (attn.q_proj is None) == fused
        gdn = next(layer.gdn for layer in e._layers if layer.gdn is not None)
        assert (gdn.in_proj_qkv_z is not None) == (c.model_type != "qwen3_next")
        got = e.forward([e.new_lane()], [ids]).logits[0]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 129, 200])
def test_delta_rule_chunked_equals_recurrent_at_chunk_edges(n: int) -> None:
    """The chunks-at-once form (padding the last chunk) against the token-by-token recurrence, at
    lengths below, at and past chunk boundaries, with a decay strong enough to matter."""
    gen = torch.Generator().manual_seed(n)
    heads, dk, dv = 4, 16, 24
    q = l2_normalize(torch.randn(n, heads, dk, generator=gen)) * dk**-0.5
    k = l2_normalize(torch.randn(n, heads, dk, generator=gen))
    v = torch.randn(n, heads, dv, generator=gen)
    g = -3 * torch.rand(n, heads, generator=gen)
    beta = torch.rand(n, heads, generator=gen)
    s0 = torch.randn(heads, dk, dv, generator=gen)
    o_rec, last = gated_delta_rule_recurrent(q, k, v, g, beta, s0, record=False)
    o_chunk, final = gated_delta_rule_chunked(q, k, v, g, beta, s0)
    assert o_chunk.shape == (n, heads, dv) and final.shape == (heads, dk, dv)
    torch.testing.assert_close(o_chunk, o_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, last, atol=1e-5, rtol=1e-5)
    o_small, f_small = gated_delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=16)
    torch.testing.assert_close(o_small, o_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f_small, last, atol=1e-5, rtol=1e-5)
