"""MTP drafter: forward against an independent float64 reference (full recomputation of the chain),
shapes and determinism, state after rejected / partial / full rounds, fit checks, expert layouts,
sampling, bf16, make_test_drafter (`--kind mtp`) on every hybrid family.

Targets: tiny checkpoints of qwen3_5 (dense MLP head), qwen3_5_moe and qwen3_next (MoE heads) written
by HF's own classes (`tests/hf_tiny_hybrid.py`); the head's weights come from make_test_drafter.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from hf_tiny_hybrid import FAMILIES, make_tiny_hybrid
from safetensors.torch import load_file, save_file
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.drafters import DRAFTERS
from ignis.runtime.drafters.base import CommittedSpan, DrafterError
from ignis.runtime.drafters.common import HiddenSizeMismatchError, MissingDrafterWeightsError
from ignis.runtime.drafters.mtp import MTPDrafter, build_mtp_drafter, check_mtp_fits, load_mtp_checkpoint
from ignis.runtime.drafters.testing import chi2_pvalue, draft_request, greedy_then_wrong, random_tokens
from ignis.runtime.errors import ConfigError, StateError, TensorSetError
from ignis.runtime.families import get_family
from ignis.runtime.families.qwen3_5 import canonicalize_moe_tensors, mtp_tensor_shapes
from ignis.runtime.sampling import SamplingParams
from ignis.tools.make_test_drafter import main as make_test_drafter_cli
from ignis.tools.make_test_drafter import make_mtp_drafter

VOCAB = 320
GREEDY = SamplingParams(temperature=0)


@dataclasses.dataclass
class Target:
    family: str
    folder: Path  # the target with a random MTP head (make_test_drafter --kind mtp)
    config: object
    tensors: dict  # canonical names, mtp.* included
    ex: object


@pytest.fixture(scope="module", params=FAMILIES)
def target(request, tmp_path_factory: pytest.TempPathFactory) -> Target:
    base = tmp_path_factory.mktemp(request.param)
    tiny = make_tiny_hybrid(request.param, base / "target")
    make_mtp_drafter(tiny.folder, base / "with_mtp", seed=5)
    config, tensors = load_mtp_checkpoint(base / "with_mtp")
    fam = get_family(config.model_type)
    ex = fam.make_executor(config, canonicalize_moe_tensors(config, tensors), "cpu", torch.float32)
    return Target(request.param, base / "with_mtp", config, tensors, ex)


def _drafter(t: Target, **kw) -> MTPDrafter:
    return build_mtp_drafter(target_config=t.config, target_weights=t.tensors, **kw)


def _tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, VOCAB)


def _hidden(ex, tokens: list[int]) -> torch.Tensor:
    """The trunk's pre-norm hidden states of `tokens` from one prefill forward (discarded)."""
    st = ex.new_lane()
    out = ex.forward([st], [torch.tensor(tokens)], logits="last", record=False, output_hidden_states=True)
    ex.commit([st], [0])
    return out.hidden_states[0]


def _commit_all(d: MTPDrafter, lane: int, seq: list[int], hidden: torch.Tensor) -> None:
    """Start `lane` and commit seq[:-1] in one span; seq[-1] is the anchor."""
    d.start_lane(lane, seq[:1])
    d.commit([CommittedSpan(lane, 0, tuple(seq[:-1]), tuple(seq[1:]), hidden_states=hidden[: len(seq) - 1])])


# ------------------------------------------------------------------------------------------ reference


def _rms1p(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _swiglu(x, g, u, d):
    return (F.silu(x @ g.T) * (x @ u.T)) @ d.T


def _reference_layer(c, w, x):
    """The head's decoder layer + mtp.norm over rows x [n, H] at positions 0..n-1 (causal), float64."""
    n, hd, nh, nkv, eps = x.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps
    p = "mtp.layers.0"
    h = _rms1p(x, w[f"{p}.input_layernorm.weight"], eps)
    qg = (h @ w[f"{p}.self_attn.q_proj.weight"].T).view(n, nh, 2 * hd)
    q, gate = _rms1p(qg[..., :hd], w[f"{p}.self_attn.q_norm.weight"], eps), qg[..., hd:].reshape(n, nh * hd)
    k = _rms1p(
        (h @ w[f"{p}.self_attn.k_proj.weight"].T).view(n, nkv, hd), w[f"{p}.self_attn.k_norm.weight"], eps
    )
    v = (h @ w[f"{p}.self_attn.v_proj.weight"].T).view(n, nkv, hd)
    rot = c.rotary_dim
    inv = 1.0 / c.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]

    def rope(t):
        r = t[..., :rot]
        return torch.cat(
            [r * cos + torch.cat([-r[..., rot // 2 :], r[..., : rot // 2]], -1) * sin, t[..., rot:]], -1
        )

    q, k = rope(q), rope(k).repeat_interleave(nh // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1)[None], float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v.repeat_interleave(nh // nkv, 1)).reshape(n, nh * hd)
    x = x + (o * torch.sigmoid(gate)) @ w[f"{p}.self_attn.o_proj.weight"].T
    m = _rms1p(x, w[f"{p}.post_attention_layernorm.weight"], eps)
    if f"{p}.mlp.gate.weight" in w:  # sparse MoE with a gated shared expert
        probs = torch.softmax(m @ w[f"{p}.mlp.gate.weight"].T, -1)
        top_w, top_i = torch.topk(probs, c.num_experts_per_tok, -1)
        if c.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        y = torch.zeros_like(m)
        for r in range(n):
            for j in range(top_i.shape[1]):
                e = f"{p}.mlp.experts.{int(top_i[r, j])}"
                y[r] += (
                    top_w[r, j]
                    * _swiglu(
                        m[r : r + 1],
                        w[f"{e}.gate_proj.weight"],
                        w[f"{e}.up_proj.weight"],
                        w[f"{e}.down_proj.weight"],
                    )[0]
                )
        se = f"{p}.mlp.shared_expert"
        shared = _swiglu(
            m, w[f"{se}.gate_proj.weight"], w[f"{se}.up_proj.weight"], w[f"{se}.down_proj.weight"]
        )
        y = y + shared * torch.sigmoid(m @ w[f"{p}.mlp.shared_expert_gate.weight"].T)
    else:
        y = _swiglu(
            m, w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"], w[f"{p}.mlp.down_proj.weight"]
        )
    return _rms1p(x + y, w["mtp.norm.weight"], eps)


def _reference_drafts(t: Target, seq: list[int], hidden: torch.Tensor, k: int) -> tuple[list[int], float]:
    """Greedy chain from scratch: rows (final_norm(h_t), token_{t+1}) for t < P, then the chain rows."""
    c = t.config
    w = {n: v.double() for n, v in canonicalize_moe_tensors(c, t.tensors, expert_layout="per_expert").items()}
    embed = w["model.embed_tokens.weight"]
    head = w.get("lm_head.weight", embed)
    eps = c.rms_norm_eps

    def row(token, g):
        e = _rms1p(embed[token], w["mtp.pre_fc_norm_embedding.weight"], eps)
        return torch.cat([e, _rms1p(g, w["mtp.pre_fc_norm_hidden.weight"], eps)]) @ w["mtp.fc.weight"].T

    g = _rms1p(hidden.double(), w["model.norm.weight"], eps)
    rows = [row(seq[i + 1], g[i]) for i in range(len(seq) - 1)]
    drafts, margin = [], float("inf")
    for _ in range(k):
        out = _reference_layer(c, w, torch.stack(rows))[-1]
        logits = head @ out
        top2 = torch.topk(logits, 2).values
        margin = min(margin, float(top2[0] - top2[1]))
        drafts.append(int(logits.argmax()))
        rows.append(row(drafts[-1], out))
    return drafts, margin


# ------------------------------------------------------------------------------------------ forward


def test_forward_matches_float64_reference(target: Target) -> None:
    d = _drafter(target)
    seq = _tokens(16, seed=1)
    hidden = _hidden(target.ex, seq)
    d.start_lane(0, seq[:10])
    d.commit([CommittedSpan(0, 0, tuple(seq[:9]), tuple(seq[1:10]), hidden_states=hidden[:9])])
    for start, end in ((9, 10), (10, 13), (13, 15)):
        d.commit(
            [
                CommittedSpan(
                    0,
                    start,
                    tuple(seq[start:end]),
                    tuple(seq[start + 1 : end + 1]),
                    hidden_states=hidden[start:end],
                )
            ]
        )
        got = d.propose([draft_request(0, seq[: end + 1], 7)])[0]
        want, margin = _reference_drafts(target, seq[: end + 1], hidden[:end], 7)
        assert margin > 1e-4
        assert got.draft_token_ids.tolist() == want and got.draft_probs is None


def test_shapes_determinism_and_batching(target: Target) -> None:
    d = _drafter(target)
    assert d.name == "mtp" and d.is_row_budgeted and d.needs_hidden_states and d.tap_layers == ()
    seqs = [_tokens(n, seed=n) for n in (2, 7, 12)]
    for lane, seq in enumerate(seqs):
        _commit_all(d, lane, seq, _hidden(target.ex, seq))
    reqs = [draft_request(i, s, k) for i, (s, k) in enumerate(zip(seqs, (1, 3, 7), strict=True))]
    a, b = d.propose(reqs), d.propose(reqs)
    assert [p.draft_token_ids.shape for p in a] == [(1,), (3,), (7,)]
    assert [p.draft_token_ids.tolist() for p in a] == [p.draft_token_ids.tolist() for p in b]
    alone = [d.propose([draft_request(i, s, 7)])[0].draft_token_ids.tolist() for i, s in enumerate(seqs)]
    assert [x[:k] for x, k in zip(alone, (1, 3, 7), strict=True)] == [p.draft_token_ids.tolist() for p in a]
    assert [d.state(i).num_tokens for i in range(3)] == [1, 6, 11]  # proposing left no rows behind


def test_fused_and_per_expert_heads_agree(target: Target) -> None:
    if not target.config.is_moe:
        pytest.skip("dense head")
    fused = canonicalize_moe_tensors(target.config, target.tensors, expert_layout="fused")
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in fused or target.family == "qwen3_next"
    a, b = _drafter(target), build_mtp_drafter(target_config=target.config, target_weights=fused)
    seq = _tokens(9, seed=4)
    h = _hidden(target.ex, seq)
    for d in (a, b):
        _commit_all(d, 0, seq, h)
    assert (
        a.propose([draft_request(0, seq, 5)])[0].draft_token_ids.tolist()
        == b.propose([draft_request(0, seq, 5)])[0].draft_token_ids.tolist()
    )


def test_bf16_forward(target: Target) -> None:
    d = _drafter(target, dtype=torch.bfloat16)
    seq = _tokens(10, seed=6)
    _commit_all(d, 0, seq, _hidden(target.ex, seq))
    p = d.propose([draft_request(0, seq, 4)])[0]
    assert p.draft_token_ids.shape == (4,) and d.state(0).last_hidden.dtype == torch.bfloat16
    assert torch.isfinite(d.state(0).last_hidden.float()).all()


def test_sampled_proposals_record_q(target: Target) -> None:
    d = _drafter(target)
    seq = _tokens(8, seed=9)
    _commit_all(d, 0, seq, _hidden(target.ex, seq))
    hot = SamplingParams(temperature=1.3, top_p=0.9)
    p1, p2 = (d.propose([draft_request(0, seq, 4, hot, seed=3)])[0] for _ in range(2))
    assert torch.equal(p1.draft_token_ids, p2.draft_token_ids) and torch.equal(p1.draft_probs, p2.draft_probs)
    assert p1.draft_probs.shape == (4, VOCAB)
    torch.testing.assert_close(p1.draft_probs.sum(-1), torch.ones(4))
    assert (p1.draft_probs.gather(1, p1.draft_token_ids[:, None]) > 0).all()


# ------------------------------------------------------------------------------------------ state


@pytest.mark.parametrize("accepts", [[0, 0, 0], [1, 0, 2, 0], [3, 3, 3]], ids=["rejected", "partial", "full"])
def test_state_after_rounds_equals_direct_commit(target: Target, accepts) -> None:
    """Rounds with n of k drafts right leave the head's KV and last hidden equal to committing the same
    tokens directly: exactly (drafter fed the same spans without proposing) and to fp32 rounding
    (the whole sequence from one prefill)."""
    k, ex = 3, target.ex
    d, quiet, direct = (_drafter(target) for _ in range(3))
    prompt = _tokens(7, seed=13)
    st = ex.new_lane()
    out = ex.forward([st], [torch.tensor(prompt)], logits="last", record=False, output_hidden_states=True)
    ex.commit([st], [len(prompt)])
    seq = [*prompt, int(out.logits[0][-1].argmax())]
    first = CommittedSpan(0, 0, tuple(prompt), tuple(seq[1:]), hidden_states=out.hidden_states[0])
    for x in (d, quiet):
        x.start_lane(0, prompt)
        x.commit([first])
    for n in accepts:
        pos = len(seq) - 1
        d.propose([draft_request(0, seq, k)])
        drafts = greedy_then_wrong(ex, seq, n, k, VOCAB)
        cols = torch.tensor([seq[-1], *drafts])
        o = ex.forward([st], [cols], logits="all", output_hidden_states=True)
        arg = o.logits[0].argmax(-1).tolist()
        keep = next((i for i in range(k) if drafts[i] != arg[i]), k) + 1
        assert keep == n + 1
        ex.commit([st], [keep])
        span = CommittedSpan(
            0, pos, tuple(cols[:keep].tolist()), tuple(arg[:keep]), hidden_states=o.hidden_states[0][:keep]
        )
        d.commit([span])
        quiet.commit([span])
        seq += arg[:keep]
    _commit_all(direct, 0, seq, _hidden(ex, seq))
    (ka, va), (kq, vq), (kd, vd) = (x.state(0).keys_values() for x in (d, quiet, direct))
    assert torch.equal(ka, kq) and torch.equal(va, vq)
    assert torch.equal(d.state(0).last_hidden, quiet.state(0).last_hidden)
    assert ka.shape[0] == len(seq) - 1 == d.state(0).num_tokens
    torch.testing.assert_close(ka, kd, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(va, vd, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(d.state(0).last_hidden, direct.state(0).last_hidden, atol=1e-4, rtol=1e-4)
    assert d.state(0).last_token == direct.state(0).last_token == seq[-1]


def test_protocol_errors(target: Target) -> None:
    d = _drafter(target)
    seq = _tokens(5, seed=2)
    h = _hidden(target.ex, seq)
    with pytest.raises(StateError, match="not started"):
        d.propose([draft_request(3, seq, 2)])
    _commit_all(d, 0, seq, h)
    with pytest.raises(StateError, match="commit was missed"):
        d.propose([draft_request(0, [*seq, 1], 2)])
    with pytest.raises(StateError, match="commit was missed"):  # right position, wrong anchor
        d.propose([draft_request(0, [*seq[:-1], (seq[-1] + 1) % VOCAB], 2)])
    with pytest.raises(StateError, match="starts at position 2"):
        d.commit([CommittedSpan(0, 2, (1,), (2,), hidden_states=h[:1])])
    with pytest.raises(DrafterError, match="without hidden states"):
        d.commit([CommittedSpan(0, 4, (1,), (2,))])
    with pytest.raises(DrafterError, match="shape"):
        d.commit([CommittedSpan(0, 4, (1, 2), (2, 3), hidden_states=h[:1])])


# ------------------------------------------------------------------------------------------ fit checks


def test_fit_checks(target: Target) -> None:
    c, w = target.config, target.tensors
    check_mtp_fits(c, w)
    trunk = {k: v for k, v in w.items() if not k.startswith("mtp.")}
    with pytest.raises(MissingDrafterWeightsError, match="no MTP head") as info:
        build_mtp_drafter(target_config=c, target_weights=trunk)
    assert "mtp.fc.weight" in info.value.missing and isinstance(info.value, ConfigError)
    with pytest.raises(MissingDrafterWeightsError):
        check_mtp_fits(dataclasses.replace(c, mtp_num_hidden_layers=0), w)
    with pytest.raises(ConfigError, match="only 1"):
        check_mtp_fits(dataclasses.replace(c, mtp_num_hidden_layers=2), w)
    partial = {k: v for k, v in w.items() if k != "mtp.norm.weight"} | {
        "mtp.embed_tokens.weight": w["model.embed_tokens.weight"]
    }
    with pytest.raises(TensorSetError) as info2:
        check_mtp_fits(c, partial)
    assert info2.value.missing == ["mtp.norm.weight"] and info2.value.unexpected == [
        "mtp.embed_tokens.weight"
    ]
    with pytest.raises(HiddenSizeMismatchError):
        MTPDrafter(
            c,
            w,
            embed_tokens=torch.zeros(VOCAB, 8),
            lm_head=w["lm_head.weight"],
            final_norm=w["model.norm.weight"],
        )
    assert DRAFTERS["mtp"] is build_mtp_drafter


# ------------------------------------------------------------------------------------------ make_test_drafter


def test_make_test_drafter_mtp_folder(target: Target, tmp_path: Path) -> None:
    raw = json.loads((target.folder / "config.json").read_text())
    text = raw.get("text_config", raw)
    assert text["mtp_num_hidden_layers"] == 1 and text["mtp_use_dedicated_embeddings"] is False
    original = load_file(str(target.folder.parent / "target" / "model.safetensors"))
    written = load_file(str(target.folder / "model.safetensors"))
    mtp = {k for k in written if k.startswith("mtp.")}
    assert mtp == set(mtp_tensor_shapes(target.config, expert_layout="per_expert"))
    assert all(torch.equal(written[k], v) for k, v in original.items())  # the trunk is untouched
    assert set(written) - mtp == set(original)
    # CLI: a sharded target gets one more shard in its index
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "generation_config.json"):
        (sharded / name).write_bytes((target.folder.parent / "target" / name).read_bytes())
    names = sorted(original)
    half = len(names) // 2
    save_file({k: original[k] for k in names[:half]}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({k: original[k] for k in names[half:]}, str(sharded / "model-00002-of-00002.safetensors"))
    wmap = {k: f"model-0000{1 + (i >= half)}-of-00002.safetensors" for i, k in enumerate(names)}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    out = tmp_path / "out"
    res = CliRunner().invoke(
        make_test_drafter_cli, ["--target", str(sharded), "--kind", "mtp", "--out", str(out), "--seed", "5"]
    )
    assert res.exit_code == 0, res.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {index["weight_map"][k] for k in mtp} == {"model-mtp.safetensors"}
    config, tensors = load_mtp_checkpoint(out)
    assert config.mtp_num_hidden_layers == 1
    assert all(torch.equal(tensors[k], target.tensors[k]) for k in target.tensors)  # same seed, same head


def test_make_test_drafter_mtp_refuses_non_hybrid(tmp_path: Path) -> None:
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 16,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    save_file({"x": torch.zeros(1)}, str(folder / "model.safetensors"))
    res = CliRunner().invoke(
        make_test_drafter_cli, ["--target", str(folder), "--kind", "mtp", "--out", str(tmp_path / "o")]
    )
    assert res.exit_code != 0 and "no MTP head" in res.output


def test_sampled_drafts_follow_q(target: Target) -> None:
    """The first draft of 1,200 seeded proposals is distributed as its recorded q (the lane's own
    distribution of the head's logits; chi-square p > 1e-4 with fixed seeds), and a later draft's q is
    a function of the path so far."""
    d = _drafter(target)
    seq = _tokens(6, seed=21)
    h = _hidden(target.ex, seq)
    lanes = 300
    for lane in range(lanes):
        _commit_all(d, lane, seq, h)
    hot = SamplingParams(temperature=3.0, top_k=40)
    first, q0, by_prefix = [], None, {}
    for rep in range(4):
        for p in d.propose(
            [draft_request(lane, seq, 2, hot, seed=rep * lanes + lane) for lane in range(lanes)]
        ):
            first.append(int(p.draft_token_ids[0]))
            q0 = p.draft_probs[0] if q0 is None else q0
            torch.testing.assert_close(p.draft_probs[0], q0)
            torch.testing.assert_close(p.draft_probs[1], by_prefix.setdefault(first[-1], p.draft_probs[1]))
    assert int((q0 > 0).sum()) == 40  # top-k applied to q
    counts = torch.bincount(torch.tensor(first), minlength=VOCAB).double()
    assert chi2_pvalue(counts, q0.double()) > 1e-4
    assert len(by_prefix) > 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu(target: Target) -> None:
    seq = _tokens(12, seed=4)
    h = _hidden(target.ex, seq)
    outs = []
    for dev in ("cpu", "cuda"):
        d = _drafter(target, device=dev)
        _commit_all(d, 0, seq, h)
        outs.append(d.propose([draft_request(0, seq, 5)])[0].draft_token_ids.cpu().tolist())
    assert outs[0] == outs[1]
