"""DFlash2 drafter: config and tensor table (public layout), forward against an independent float64
reference, context window, state after rejected / partial / full rounds, fit checks, proposal heads,
sampling, make_test_drafter.

Target: a tiny `qwen3_5` checkpoint written by HF's own classes (`tests/hf_tiny_hybrid.py`); drafter:
`ignis.tools.make_test_drafter` (random weights, tiny sliding window so trimming happens early).
The reference (`_reference_drafts`) recomputes everything from the full committed history in
float64, masking with |q - k| < W, following the published DFlash2 fixture generator's math; the
drafter keeps only the last W - 1 context rows and advances them incrementally, so agreement checks
the windowing and the incremental commit too.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.drafters import DRAFTERS, get_drafter_factory
from ignis.runtime.drafters.base import CommittedSpan, DrafterError, DraftRequest
from ignis.runtime.drafters.common import (
    DrafterFitError,
    HiddenSizeMismatchError,
    MaskTokenOutOfRangeError,
    TapLayerOutOfRangeError,
    TargetDepthMismatchError,
    VocabSizeMismatchError,
)
from ignis.runtime.drafters.dflash2 import (
    DFlash2Config,
    DFlash2Drafter,
    build_dflash2_drafter,
    check_dflash2_fits,
    dflash2_tensor_shapes,
    load_dflash2_checkpoint,
    transform_head_logits,
)
from ignis.runtime.drafters.testing import chi2_pvalue
from ignis.runtime.errors import ConfigError, StateError, TensorSetError, TensorShapeError
from ignis.runtime.families import get_family
from ignis.runtime.sampling import SamplingParams
from ignis.tools.make_test_drafter import main as make_test_drafter_cli
from ignis.tools.make_test_drafter import make_dflash2_drafter, random_dflash2_weights, small_dflash2_config
from ignis.tools.random_checkpoint import PUBLIC_27B_DFLASH2


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


make_tiny_hybrid = _load_helper().make_tiny_hybrid

WINDOW = 6  # tiny sliding window: 5 context rows kept per layer
VOCAB_SIZE = 320  # the tiny targets' vocabulary
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_hybrid("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))


@pytest.fixture(scope="module")
def ex(tiny):
    return get_family(tiny.config.model_type).make_executor(
        tiny.config, tiny.canonical_tensors(), "cpu", torch.float32
    )


@pytest.fixture(scope="module")
def drafter_dir(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dflash2")
    make_dflash2_drafter(tiny.folder, out, seed=7, dtype="float32", sliding_window=WINDOW)
    return out


def _drafter(tiny, drafter_dir: Path, **kw) -> DFlash2Drafter:
    return build_dflash2_drafter(
        target_config=tiny.config, target_weights=tiny.tensors, checkpoint=drafter_dir, **kw
    )


def _tokens(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _taps(ex, tokens: list[int], layers) -> torch.Tensor:
    """Taps of the committed sequence `tokens`, from one prefill forward (discarded)."""
    st = ex.new_lane()
    out = ex.forward([st], [torch.tensor(tokens)], logits="last", record=False, tap_layers=tuple(layers))
    ex.commit([st], [0])
    return out.taps[0]


def _request(lane: int, tokens: list[int], k: int, params=GREEDY, seed: int = 0) -> DraftRequest:
    return DraftRequest(
        lane_id=lane,
        num_drafts=k,
        token_ids=tuple(tokens),
        num_prompt_tokens=len(tokens) - 1,
        params=params,
        generator=torch.Generator().manual_seed(seed),
    )


def _greedy_then_wrong(ex, seq: list[int], n: int, k: int) -> list[int]:
    """k drafts after seq (whose last token is the anchor): the model's own next n tokens, then a
    wrong one (so exactly n are accepted), then arbitrary ones."""
    probe = ex.new_lane()
    o = ex.forward([probe], [torch.tensor(seq)], logits="last", record=False)
    ex.commit([probe], [len(seq)])
    nxt, truth = int(o.logits[0][-1].argmax()), []
    for _ in range(n):
        truth.append(nxt)
        o = ex.forward([probe], [torch.tensor([nxt])], logits="last")
        ex.commit([probe], [1])
        nxt = int(o.logits[0][-1].argmax())
    return [*truth, (nxt + 1) % 320, *_tokens(k, seed=n)][:k]


def _commit_all(d: DFlash2Drafter, lane: int, seq: list[int], taps: torch.Tensor) -> None:
    """Start `lane` and commit seq[:-1] (positions 0..n-2) in one span; seq[-1] is the anchor."""
    d.start_lane(lane, seq[:1])
    d.commit([CommittedSpan(lane, 0, tuple(seq[:-1]), tuple(seq[1:]), taps=taps[: len(seq) - 1])])


# ------------------------------------------------------------------------------------------ reference


def _rms(x, w, eps):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [n, heads, hd] float64, rotate-half over all dims
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


def _conv(x, coeff, base, group):  # x [L, H], coeff [L, taps, groups], base [taps, H]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(base.shape[0]):
            if t - j >= 0:
                out[t] += (base[j] + coeff[t, j].repeat_interleave(group)) * x[t - j]
    return out


def _reference_drafts(cfg: DFlash2Config, w, embed, head, taps, anchor: int, k: int):
    """(drafts, final hidden of the mask slots) from the full history taps [P, T*H], float64."""
    w = {n: t.double() for n, t in w.items()}
    embed, head, taps = embed.double(), head.double(), taps.double()
    eps, b, hd = cfg.rms_norm_eps, cfg.block_size, cfg.head_dim
    nh, nkv, g = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.conv_group_size
    p = taps.shape[0]
    ctx = _rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed[torch.tensor([anchor] + [cfg.mask_token_id] * (b - 1))]
    pos_c, pos_b = torch.arange(p), torch.arange(p, p + b)
    qpos, kpos = pos_b[:, None], torch.cat([pos_c, pos_b])[None, :]
    visible = (qpos - kpos).abs() < cfg.sliding_window
    for i in range(cfg.num_hidden_layers):
        L = lambda n, i=i: w[f"layers.{i}.{n}"]  # noqa: E731
        a = _rms(x, L("input_layernorm.weight"), eps)
        dyn = (a @ L("attention_conv.kernel_projection.weight").T).view(b, 2, cfg.conv_kernel_size, -1)
        a = _conv(a, dyn[:, 0], L("attention_conv.base_kernel")[0], g)
        q = _rope(
            _rms((a @ L("self_attn.q_proj.weight").T).view(b, nh, hd), L("self_attn.q_norm.weight"), eps),
            pos_b,
            cfg.rope_theta,
        )
        keys = torch.cat([ctx, a]) @ L("self_attn.k_proj.weight").T
        keys = _rope(_rms(keys.view(-1, nkv, hd), L("self_attn.k_norm.weight"), eps), kpos[0], cfg.rope_theta)
        vals = (torch.cat([ctx, a]) @ L("self_attn.v_proj.weight").T).view(-1, nkv, hd)
        keys, vals = keys.repeat_interleave(nh // nkv, 1), vals.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, keys) * hd**-0.5
        s = s.masked_fill(~visible[None], float("-inf"))
        o = (
            torch.einsum("hqk,khd->qhd", s.softmax(-1), vals).reshape(b, nh * hd)
            @ L("self_attn.o_proj.weight").T
        )
        x = x + _conv(o, dyn[:, 1], L("attention_conv.base_kernel")[1], g)
        m = _rms(x, L("post_attention_layernorm.weight"), eps)
        dyn = (m @ L("mlp_conv.kernel_projection.weight").T).view(b, 2, cfg.conv_kernel_size, -1)
        m = _conv(m, dyn[:, 0], L("mlp_conv.base_kernel")[0], g)
        y = (F.silu(m @ L("mlp.gate_proj.weight").T) * (m @ L("mlp.up_proj.weight").T)) @ L(
            "mlp.down_proj.weight"
        ).T
        x = x + _conv(y, dyn[:, 1], L("mlp_conv.base_kernel")[1], g)
    hid = _rms(x, w["norm.weight"], eps)[1 : 1 + k]
    unary, cand = torch.topk(hid @ head.T, cfg.selector_top_k, dim=-1)
    prev, out, margins = anchor, [], []
    for s_ in range(k):
        gate = hid[s_] @ w["candidate_selector.hidden_projection.weight"].T
        scores = (
            unary[s_]
            + (w["candidate_selector.predecessor_codebook"][prev] * gate)
            @ w["candidate_selector.successor_codebook"][cand[s_]].T
        )
        top2 = torch.topk(scores, 2).values
        margins.append(float(top2[0] - top2[1]))
        prev = int(cand[s_][scores.argmax()])
        out.append(prev)
    return out, hid, min(margins)


# ------------------------------------------------------------------------------------------ config


# the public Qwen3.5-27B DFlash2 config.json schema and values (one copy: the random-checkpoint tool's)
PUBLIC_27B_CONFIG = PUBLIC_27B_DFLASH2


def test_public_config_and_tensor_table() -> None:
    cfg = DFlash2Config.from_hf(PUBLIC_27B_CONFIG)
    assert cfg.block_size == 8 and cfg.max_drafts == 7 and cfg.target_layer_ids == (5, 19, 33, 47, 61)
    assert cfg.mask_token_id == 248070 and cfg.sliding_window == 2048 and not cfg.is_causal
    assert cfg.rope_theta == 1e7 and cfg.has_conv and cfg.has_selector and cfg.num_conv_groups == 320
    assert cfg.context_retention(0) == 2047
    shapes = dflash2_tensor_shapes(cfg)
    assert len(shapes) == 3 + 5 * 15 + 3  # fc, hidden_norm, norm; 15 per layer; the selector's 3
    assert shapes["fc.weight"] == (5120, 5 * 5120)
    assert shapes["layers.4.attention_conv.base_kernel"] == (2, 2, 5120)
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (2 * 2 * 320, 5120)
    assert shapes["layers.2.self_attn.q_proj.weight"] == (4096, 5120)
    assert shapes["layers.2.self_attn.k_proj.weight"] == (1024, 5120)
    assert shapes["layers.2.self_attn.o_proj.weight"] == (5120, 4096)
    assert shapes["candidate_selector.predecessor_codebook"] == (248320, 256)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 5120)
    # round trip through the public layout
    assert DFlash2Config.from_hf(cfg.to_hf()) == cfg
    # the flat (DFlash 1) spelling and a full-attention DFlash v1 config parse too
    flat = {k: v for k, v in PUBLIC_27B_CONFIG.items() if k != "dflash_config"} | {
        "block_size": 16,
        "target_layer_ids": [1, 2],
        "mask_token_id": 3,
        "layer_types": None,
        "use_sliding_window": False,
    }
    v1 = DFlash2Config.from_hf(flat)
    assert not v1.has_conv and not v1.has_selector and v1.layer_types == ("full_attention",) * 5
    assert v1.context_retention(0) is None


def test_softcapped_config_matches_published_header() -> None:
    """A published DFlash2 config with output_multiplier and final_logit_softcapping (z-lab's test
    fixture `dflash2-config.json`): its tensor table equals the published safetensors header's."""
    raw = json.loads(json.dumps(PUBLIC_27B_CONFIG))
    raw |= {
        "hidden_size": 6656,
        "intermediate_size": 19968,
        "vocab_size": 202048,
        "num_target_layers": 52,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    }
    raw["dflash_config"] |= {
        "block_size": 16,
        "mask_token_id": 201818,
        "target_layer_ids": [1, 13, 25, 37, 49],
        "final_logit_softcapping": 20.0,
        "output_multiplier": 0.19611613513818404,
    }
    cfg = DFlash2Config.from_hf(raw)
    assert cfg.final_logit_softcapping == 20.0 and cfg.output_multiplier == pytest.approx(0.196116135)
    shapes = dflash2_tensor_shapes(cfg)
    assert len(shapes) == 81
    assert shapes["fc.weight"] == (6656, 33280)
    assert shapes["layers.3.attention_conv.kernel_projection.weight"] == (1664, 6656)
    assert shapes["layers.3.mlp.down_proj.weight"] == (6656, 19968)
    assert shapes["candidate_selector.successor_codebook"] == (202048, 256)
    logits = torch.tensor([[-100.0, 0.0, 100.0]])
    capped = transform_head_logits(logits, cfg)
    torch.testing.assert_close(capped, torch.tanh(logits * cfg.output_multiplier / 20.0) * 20.0)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"dflash_config": {"block_size": 1}}, "block_size"),
        ({"dflash_config": {"mask_token_id": 248320}}, "mask_token_id"),
        ({"dflash_config": {"target_layer_ids": [-1, 4]}}, "target_layer_ids"),
        ({"dflash_config": {"target_layer_ids": [5, 64]}}, "num_target_layers"),
        ({"dflash_config": {"selector_top_k": 0}}, "selector"),
        ({"dflash_config": {"conv_group_size": 7}}, "conv_group_size"),
        ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 5}, "unknown type"),
        ({"num_key_value_heads": 7}, "multiple"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_config_errors(change, match) -> None:
    raw = json.loads(json.dumps(PUBLIC_27B_CONFIG))
    for key, value in change.items():
        if key == "dflash_config":
            raw["dflash_config"].update(value)
        elif value is None:
            del raw[key]
        else:
            raw[key] = value
    with pytest.raises(ConfigError, match=match):
        DFlash2Config.from_hf(raw)


# ------------------------------------------------------------------------------------------ fit checks


def test_fit_checks(tiny, drafter_dir) -> None:
    cfg, weights = load_dflash2_checkpoint(drafter_dir)
    check_dflash2_fits(cfg, tiny.config)  # fits
    t = tiny.config
    with pytest.raises(HiddenSizeMismatchError, match="hidden_size"):
        check_dflash2_fits(dataclasses.replace(cfg, hidden_size=128, conv_group_size=16), t)
    with pytest.raises(TapLayerOutOfRangeError, match=r"past the target's last decoder layer 3"):
        check_dflash2_fits(dataclasses.replace(cfg, target_layer_ids=(0, 4), num_target_layers=0), t)
    with pytest.raises(TargetDepthMismatchError):
        check_dflash2_fits(dataclasses.replace(cfg, num_target_layers=5), t)
    with pytest.raises(MaskTokenOutOfRangeError, match="mask_token_id 400"):
        check_dflash2_fits(dataclasses.replace(cfg, vocab_size=500, mask_token_id=400), t)
    with pytest.raises(VocabSizeMismatchError):
        check_dflash2_fits(dataclasses.replace(cfg, vocab_size=321), t)
    with pytest.raises(MaskTokenOutOfRangeError):
        check_dflash2_fits(cfg, t, embed_rows=300)
    assert issubclass(TapLayerOutOfRangeError, DrafterFitError) and issubclass(DrafterFitError, ConfigError)
    # the same checks run when the drafter is built against a target
    deep = dataclasses.replace(cfg, target_layer_ids=(1, 7), num_target_layers=0)
    with pytest.raises(TapLayerOutOfRangeError):
        DFlash2Drafter(
            deep,
            weights | {"fc.weight": torch.zeros(64, 128)},
            embed_tokens=tiny.tensors["model.embed_tokens.weight"],
            lm_head=tiny.tensors["lm_head.weight"],
            target_config=t,
        )
    with pytest.raises(HiddenSizeMismatchError):
        DFlash2Drafter(
            cfg, weights, embed_tokens=torch.zeros(320, 32), lm_head=tiny.tensors["lm_head.weight"]
        )


def test_checkpoint_tensor_errors(drafter_dir, tmp_path) -> None:
    cfg, weights = load_dflash2_checkpoint(drafter_dir)
    from safetensors.torch import save_file

    bad = {k: v for k, v in weights.items() if k not in ("norm.weight", "layers.1.mlp_conv.base_kernel")}
    bad["extra.weight"] = torch.zeros(2)
    (tmp_path / "config.json").write_text((drafter_dir / "config.json").read_text())
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(TensorSetError) as info:
        load_dflash2_checkpoint(tmp_path)
    assert info.value.missing == ["layers.1.mlp_conv.base_kernel", "norm.weight"]
    assert info.value.unexpected == ["extra.weight"]
    wrong = dict(weights)
    wrong["fc.weight"] = wrong["fc.weight"].T.contiguous()
    save_file(wrong, str(tmp_path / "model.safetensors"))
    with pytest.raises(TensorShapeError, match=r"fc\.weight"):
        load_dflash2_checkpoint(tmp_path)
    # the nn.Embedding spelling of the codebooks is accepted
    alias = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in weights.items()}
    save_file(alias, str(tmp_path / "model.safetensors"))
    assert load_dflash2_checkpoint(tmp_path)[0] == cfg


# ------------------------------------------------------------------------------------------ forward


def test_forward_matches_float64_reference(tiny, ex, drafter_dir) -> None:
    """Drafts and hidden states equal a from-scratch float64 recomputation over the full history,
    after a long prompt (trimmed to the window) and after incremental commits."""
    d = _drafter(tiny, drafter_dir)
    cfg, w = load_dflash2_checkpoint(drafter_dir)
    embed, head = tiny.tensors["model.embed_tokens.weight"], tiny.tensors["lm_head.weight"]
    seq = _tokens(23, seed=1)
    taps = _taps(ex, seq, cfg.target_layer_ids)
    d.start_lane(0, seq[:15])
    d.commit([CommittedSpan(0, 0, tuple(seq[:14]), tuple(seq[1:15]), taps=taps[:14])])
    for start, end in ((14, 15), (15, 18), (18, 22)):  # 1, 3 and 4 more committed positions
        d.commit(
            [
                CommittedSpan(
                    0, start, tuple(seq[start:end]), tuple(seq[start + 1 : end + 1]), taps=taps[start:end]
                )
            ]
        )
        anchor = seq[end]
        got = d.propose([_request(0, seq[: end + 1], 7)])[0]
        want, hid, margin = _reference_drafts(cfg, w, embed, head, taps[:end], anchor, 7)
        assert margin > 1e-4
        assert got.draft_token_ids.tolist() == want and got.draft_probs is None
        ctx = [[d.context(0).keys_values(i) for i in range(cfg.num_hidden_layers)]]
        x = d.network.embed_block(torch.tensor([anchor]), d.embed_tokens)
        ours = d.network.block_hidden(x, torch.tensor([end]), ctx)[0, 1:]
        torch.testing.assert_close(ours.double(), hid, atol=2e-5, rtol=2e-5)
    assert all(d.context(0).num_kept(i) == WINDOW - 1 for i in range(cfg.num_hidden_layers))


def test_shapes_determinism_and_fewer_drafts(tiny, ex, drafter_dir) -> None:
    d = _drafter(tiny, drafter_dir)
    seqs = [_tokens(n, seed=n) for n in (3, 9, 17)]
    for lane, seq in enumerate(seqs):
        _commit_all(d, lane, seq, _taps(ex, seq, d.tap_layers))
    reqs = [_request(i, s, k) for i, (s, k) in enumerate(zip(seqs, (1, 7, 12), strict=True))]
    a, b = d.propose(reqs), d.propose(reqs)
    assert [p.draft_token_ids.shape for p in a] == [(1,), (7,), (7,)]  # at most block_size - 1
    assert all(p.draft_token_ids.dtype == torch.int64 for p in a)
    assert [p.draft_token_ids.tolist() for p in a] == [p.draft_token_ids.tolist() for p in b]
    # the drafts of slots 1..k do not depend on k; batching lanes does not change them
    alone = [d.propose([_request(i, s, 7)])[0].draft_token_ids.tolist() for i, s in enumerate(seqs)]
    assert alone[0][:1] == a[0].draft_token_ids.tolist() and alone[1] == a[1].draft_token_ids.tolist()
    assert alone[2] == a[2].draft_token_ids.tolist()


def test_bf16_forward(tiny, ex, drafter_dir) -> None:
    d32 = _drafter(tiny, drafter_dir)
    d16 = _drafter(tiny, drafter_dir, dtype=torch.bfloat16)
    seq = _tokens(12, seed=3)
    taps = _taps(ex, seq, d32.tap_layers)
    for d in (d32, d16):
        _commit_all(d, 0, seq, taps)
    hid = []
    for d in (d32, d16):
        ctx = [[d.context(0).keys_values(i) for i in range(d.config.num_hidden_layers)]]
        x = d.network.embed_block(torch.tensor([seq[-1]]), d.embed_tokens)
        hid.append(d.network.block_hidden(x, torch.tensor([11]), ctx).float())
    assert hid[1].dtype == torch.float32 and torch.isfinite(hid[1]).all()
    assert float((hid[0] - hid[1]).abs().max()) < 0.15 * float(hid[0].abs().max())
    assert d16.propose([_request(0, seq, 7)])[0].draft_token_ids.shape == (7,)


# ------------------------------------------------------------------------------------------ state


@pytest.mark.parametrize("accepts", [[0, 0, 0], [2, 0, 5, 1], [7, 7, 3]], ids=["rejected", "partial", "full"])
def test_state_after_rounds_equals_direct_commit(tiny, ex, drafter_dir, accepts) -> None:
    """Verify rounds where the first `n` drafts are right (the rest wrong) leave the drafter's context
    equal to committing the same tokens directly: exactly equal to a drafter fed the same spans
    without proposing, and close to one fed the whole sequence from a single prefill."""
    k = 7
    d, quiet, direct = (_drafter(tiny, drafter_dir) for _ in range(3))
    prompt = _tokens(8, seed=11)
    # the model's greedy continuation (its argmax is what a round commits)
    st = ex.new_lane()
    out = ex.forward([st], [torch.tensor(prompt)], logits="last", record=False, tap_layers=d.tap_layers)
    ex.commit([st], [len(prompt)])
    seq = [*prompt, int(out.logits[0][-1].argmax())]
    first = CommittedSpan(0, 0, tuple(prompt), tuple(seq[1:]), taps=out.taps[0])
    for x in (d, quiet):
        x.start_lane(0, prompt)
        x.commit([first])
    for n in accepts:
        anchor_pos = len(seq) - 1
        d.propose([_request(0, seq, k)])  # whatever it drafts is discarded below
        # drafts: the model's own next n tokens, then wrong ones
        drafts = _greedy_then_wrong(ex, seq, n, k)
        cols = torch.tensor([seq[-1], *drafts])
        o = ex.forward([st], [cols], logits="all", tap_layers=d.tap_layers)
        arg = o.logits[0].argmax(-1).tolist()
        keep = next((i for i in range(k) if drafts[i] != arg[i]), k) + 1
        assert keep == n + 1
        ex.commit([st], [keep])
        span = CommittedSpan(
            0, anchor_pos, tuple(cols[:keep].tolist()), tuple(arg[:keep]), taps=o.taps[0][:keep]
        )
        d.commit([span])
        quiet.commit([span])
        seq += arg[:keep]
    _commit_all(direct, 0, seq, _taps(ex, seq, d.tap_layers))
    for i in range(d.config.num_hidden_layers):
        (ka, va), (kq, vq), (kd, vd) = (x.context(0).keys_values(i) for x in (d, quiet, direct))
        assert torch.equal(ka, kq) and torch.equal(va, vq)
        torch.testing.assert_close(ka, kd, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(va, vd, atol=1e-4, rtol=1e-4)
    assert d.context(0).num_positions == direct.context(0).num_positions == len(seq) - 1
    assert (
        d.propose([_request(0, seq, k)])[0].draft_token_ids.tolist()
        == direct.propose([_request(0, seq, k)])[0].draft_token_ids.tolist()
    )


def test_window_keeps_last_positions(tiny, ex, drafter_dir) -> None:
    d = _drafter(tiny, drafter_dir)
    seq = _tokens(30, seed=5)
    taps = _taps(ex, seq, d.tap_layers)
    d.start_lane(0, seq[:2])
    d.commit([CommittedSpan(0, 0, (seq[0],), (seq[1],), taps=taps[:1])])
    assert d.context(0).num_kept(0) == 1
    pos = 1
    for m in (2, 1, 3, 1, 9, 1, 4, 1, 2, 3):  # spans shorter and longer than the window
        d.commit(
            [
                CommittedSpan(
                    0,
                    pos,
                    tuple(seq[pos : pos + m]),
                    tuple(seq[pos + 1 : pos + m + 1]),
                    taps=taps[pos : pos + m],
                )
            ]
        )
        pos += m
        kept = min(pos, WINDOW - 1)
        ctx = d.context(0)
        assert ctx.num_positions == pos
        for layer in range(d.config.num_hidden_layers):
            k, v = ctx.keys_values(layer)
            assert k.shape == (kept, d.config.num_key_value_heads, d.config.head_dim) and v.shape == k.shape
            feats = d.network.context_features(taps[pos - kept : pos])
            ref_k, ref_v = d.network.context_keys_values(feats, torch.arange(pos - kept, pos), layer)
            torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, ref_v, atol=1e-5, rtol=1e-5)


def test_protocol_errors(tiny, ex, drafter_dir) -> None:
    d = _drafter(tiny, drafter_dir)
    seq = _tokens(6, seed=2)
    taps = _taps(ex, seq, d.tap_layers)
    with pytest.raises(StateError, match="not started"):
        d.propose([_request(9, seq, 3)])
    _commit_all(d, 0, seq, taps)
    with pytest.raises(StateError, match="commit was missed"):
        d.propose([_request(0, [*seq, 1], 3)])
    with pytest.raises(StateError, match="starts at position 3"):
        d.commit([CommittedSpan(0, 3, (1,), (2,), taps=taps[:1])])
    with pytest.raises(DrafterError, match="without taps"):
        d.commit([CommittedSpan(0, 5, (1,), (2,))])
    with pytest.raises(DrafterError, match="taps have shape"):
        d.commit([CommittedSpan(0, 5, (1, 2), (2, 3), taps=taps[:1])])
    d.end_lane(0)
    with pytest.raises(StateError):
        d.context(0)


# ------------------------------------------------------------------------------------------ heads, sampling


def test_shortlist_head(tiny, ex, drafter_dir) -> None:
    from ignis.formats.q4 import Q4G32Tensor

    full = _drafter(tiny, drafter_dir)
    head = tiny.tensors["lm_head.weight"]
    perm = torch.randperm(320, generator=torch.Generator().manual_seed(0))
    same = _drafter(
        tiny, drafter_dir, draft_head="shortlist", shortlist_weight=head[perm], shortlist_token_ids=perm
    )
    ids = perm[:100].sort().values
    q4 = Q4G32Tensor.quantize(head[ids].numpy())
    small = _drafter(tiny, drafter_dir, draft_head="shortlist", shortlist_weight=q4, shortlist_token_ids=ids)
    deq = _drafter(
        tiny,
        drafter_dir,
        draft_head="shortlist",
        shortlist_weight=torch.from_numpy(q4.dequantize()),
        shortlist_token_ids=ids,
    )
    seqs = [_tokens(n, seed=20 + n) for n in (4, 13)]
    for d in (full, same, small, deq):
        for lane, seq in enumerate(seqs):
            _commit_all(d, lane, seq, _taps(ex, seq, d.tap_layers))
    reqs = [_request(i, s, 7) for i, s in enumerate(seqs)]
    a, b, c, e = (x.propose(reqs) for x in (full, same, small, deq))
    assert [p.draft_token_ids.tolist() for p in a] == [p.draft_token_ids.tolist() for p in b]
    assert [p.draft_token_ids.tolist() for p in c] == [p.draft_token_ids.tolist() for p in e]
    assert all(set(p.draft_token_ids.tolist()) <= set(ids.tolist()) for p in c)
    with pytest.raises(ConfigError, match="unique"):
        _drafter(
            tiny, drafter_dir, draft_head="shortlist", shortlist_weight=head[:2], shortlist_token_ids=[3, 3]
        )
    with pytest.raises(TensorShapeError):
        _drafter(
            tiny, drafter_dir, draft_head="shortlist", shortlist_weight=head[:3], shortlist_token_ids=[1, 2]
        )
    with pytest.raises(ConfigError, match="draft_head"):
        _drafter(tiny, drafter_dir, draft_head="tiny")


def test_sampled_proposals_record_q(tiny, ex, drafter_dir) -> None:
    d = _drafter(tiny, drafter_dir)
    seq = _tokens(10, seed=8)
    _commit_all(d, 0, seq, _taps(ex, seq, d.tap_layers))
    hot = SamplingParams(temperature=1.5, top_k=5)
    p1 = d.propose([_request(0, seq, 5, hot, seed=42)])[0]
    p2 = d.propose([_request(0, seq, 5, hot, seed=42)])[0]
    assert torch.equal(p1.draft_token_ids, p2.draft_token_ids) and torch.equal(p1.draft_probs, p2.draft_probs)
    q = p1.draft_probs
    assert q.shape == (5, 320) and q.dtype == torch.float32
    torch.testing.assert_close(q.sum(-1), torch.ones(5))
    assert ((q > 0).sum(-1) <= d.config.selector_top_k).all()  # q lives on the K candidates
    assert (q.gather(1, p1.draft_token_ids[:, None]) > 0).all()
    # different seeds walk different paths somewhere
    paths = {
        tuple(d.propose([_request(0, seq, 5, hot, seed=s)])[0].draft_token_ids.tolist()) for s in range(8)
    }
    assert len(paths) > 1
    # a greedy and a sampled lane in one call
    d.start_lane(1, seq)
    _commit_all(d, 1, seq, _taps(ex, seq, d.tap_layers))
    mixed = d.propose([_request(0, seq, 3), _request(1, seq, 3, hot, seed=1)])
    assert mixed[0].draft_probs is None and mixed[1].draft_probs.shape == (3, 320)


def test_registry_and_factory(tiny, drafter_dir) -> None:
    assert DRAFTERS["dflash2"] is build_dflash2_drafter
    d = get_drafter_factory("dflash2")(
        target_config=tiny.config, target_weights=tiny.tensors, checkpoint=drafter_dir
    )
    assert isinstance(d, DFlash2Drafter)
    assert d.name == "dflash2" and not d.is_row_budgeted and not d.needs_hidden_states
    assert d.tap_layers == d.config.target_layer_ids
    with pytest.raises(ConfigError, match="checkpoint"):
        build_dflash2_drafter(target_config=tiny.config, target_weights=tiny.tensors)


# ------------------------------------------------------------------------------------------ make_test_drafter


def test_make_test_drafter_cli(tiny, tmp_path) -> None:
    out = tmp_path / "drafter"
    runner = CliRunner()
    res = runner.invoke(
        make_test_drafter_cli,
        [
            "--target",
            str(tiny.folder),
            "--kind",
            "dflash2",
            "--out",
            str(out),
            "--seed",
            "3",
            "--sliding-window",
            "16",
        ],
    )
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["dtype"] == "bfloat16"
    assert set(raw["dflash_config"]) >= {
        "block_size",
        "target_layer_ids",
        "mask_token_id",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
    }
    cfg, weights = load_dflash2_checkpoint(out)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    check_dflash2_fits(cfg, tiny.config)
    assert cfg == small_dflash2_config(tiny.config, sliding_window=16)
    # same seed, same weights; a non-empty folder is refused without --force
    res2 = runner.invoke(
        make_test_drafter_cli, ["--target", str(tiny.folder), "--kind", "dflash2", "--out", str(out)]
    )
    assert res2.exit_code != 0 and "not empty" in res2.output
    ref = random_dflash2_weights(cfg, seed=3)
    assert all(torch.equal(weights[k], ref[k].bfloat16()) for k in ref)
    res3 = runner.invoke(
        make_test_drafter_cli,
        ["--target", str(tmp_path / "nowhere"), "--kind", "dflash2", "--out", str(tmp_path / "x")],
    )
    assert res3.exit_code != 0


def test_sampled_drafts_follow_q(tiny, ex, drafter_dir) -> None:
    """The first draft of 1,200 seeded proposals (lanes with one shared context) is distributed as
    the q recorded for it (chi-square goodness of fit, p > 1e-4 with fixed seeds), and
    a later slot's q is a function of the path so far (same prefix, same q)."""
    d = _drafter(tiny, drafter_dir)
    seq = _tokens(9, seed=17)
    taps = _taps(ex, seq, d.tap_layers)
    lanes = 300
    for lane in range(lanes):
        _commit_all(d, lane, seq, taps)
    hot = SamplingParams(temperature=2.0)
    first, q0, by_prefix = [], None, {}
    for rep in range(4):
        props = d.propose([_request(lane, seq, 2, hot, seed=rep * lanes + lane) for lane in range(lanes)])
        for p in props:
            first.append(int(p.draft_token_ids[0]))
            q0 = p.draft_probs[0] if q0 is None else q0
            torch.testing.assert_close(p.draft_probs[0], q0)  # slot 1's q does not depend on the path
            prev = by_prefix.setdefault(first[-1], p.draft_probs[1])
            torch.testing.assert_close(p.draft_probs[1], prev)
    counts = torch.bincount(torch.tensor(first), minlength=VOCAB_SIZE).double()
    assert chi2_pvalue(counts, q0.double()) > 1e-4
    assert len(by_prefix) > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu(tiny, ex, drafter_dir) -> None:
    seq = _tokens(12, seed=4)
    taps = _taps(ex, seq, (0, 1, 2, 3))
    outs = []
    for dev in ("cpu", "cuda"):
        d = _drafter(tiny, drafter_dir, device=dev)
        _commit_all(d, 0, seq, taps)
        outs.append(d.propose([_request(0, seq, 7)])[0].draft_token_ids.cpu().tolist())
    assert outs[0] == outs[1]
