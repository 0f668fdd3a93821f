"""The pooled, static MTP head (`ignis.runtime.drafters.mtp_static.StaticMTPDrafter`) against the eager
`MTPDrafter` it replaces on CUDA.

CPU (the static shapes run eagerly, so CI covers the layout and the bookkeeping):
* greedy proposals equal the eager head's for several lanes of different lengths and draft counts;
  sampled proposals draw the same tokens from the same q (to float rounding);
* rounds with rejections, partial and full acceptance (static commits of 1..k+1 columns, padded)
  leave the pooled KV and chained hidden equal to the eager head's, and to committing the tokens
  alone (the same spans without proposing);
* through `SpeculativeEngine`: lanes joining mid-run and leaving at different lengths, more lanes than
  slots (the pools grow), the same drafts and outputs as the eager head;
* prompt checkpoints: snapshot / restore give the eager head's state and proposals;
* the factory's choice, capacity errors, `warm_up` off CUDA.

GPU (marked gpu): the graphed head proposes exactly what the static head run eagerly proposes (same
kernels: greedy drafts equal, sampled q equal bit for bit) and what the eager `MTPDrafter` proposes
(float32: equal drafts), every shape captured at load (`warm_up`: no capture while serving), on
qwen3_5 (dense MLP head) and, with the compiled grouped expert kernels and q4 experts, qwen3_5_moe
and qwen3_next (MoE heads).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hf_tiny_hybrid import FAMILIES, make_tiny_hybrid
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.drafters.base import CommittedSpan
from ignis.runtime.drafters.mtp import MTPDrafter, build_mtp_drafter, load_mtp_checkpoint
from ignis.runtime.drafters.mtp_static import StaticMTPDrafter
from ignis.runtime.drafters.testing import draft_request, greedy_then_wrong, random_tokens
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.errors import StateError
from ignis.runtime.families import get_family
from ignis.runtime.families.qwen3_5 import canonicalize_moe_tensors
from ignis.runtime.sampling import SamplingParams
from ignis.tools.make_test_drafter import make_mtp_drafter

VOCAB = 320
GREEDY = SamplingParams(temperature=0)


@dataclasses.dataclass
class Target:
    family: str
    config: object
    tensors: dict
    ex: object


@pytest.fixture(scope="module", params=FAMILIES)
def target(request, tmp_path_factory: pytest.TempPathFactory) -> Target:
    base = tmp_path_factory.mktemp(request.param)
    tiny = make_tiny_hybrid(request.param, base / "target")
    make_mtp_drafter(tiny.folder, base / "with_mtp", seed=5)
    config, tensors = load_mtp_checkpoint(base / "with_mtp")
    fam = get_family(config.model_type)
    ex = fam.make_executor(config, canonicalize_moe_tensors(config, tensors), "cpu", torch.float32)
    return Target(request.param, config, tensors, ex)


def _eager(t: Target) -> MTPDrafter:
    d = build_mtp_drafter(target_config=t.config, target_weights=t.tensors)
    assert type(d) is MTPDrafter
    return d


def _static(t: Target, **kw) -> StaticMTPDrafter:
    kw.setdefault("max_context", 128)
    d = build_mtp_drafter(target_config=t.config, target_weights=t.tensors, static=True, **kw)
    assert isinstance(d, StaticMTPDrafter) and not d.cuda_graphs
    return d


def _hidden(ex, tokens: list[int]) -> torch.Tensor:
    st = ex.new_lane()
    out = ex.forward([st], [torch.tensor(tokens)], logits="last", record=False, output_hidden_states=True)
    ex.commit([st], [0])
    return out.hidden_states[0]


def _commit_all(d, lane: int, seq: list[int], hidden: torch.Tensor) -> None:
    d.start_lane(lane, seq[:1])
    d.commit([CommittedSpan(lane, 0, tuple(seq[:-1]), tuple(seq[1:]), hidden_states=hidden[: len(seq) - 1])])


def _assert_same_state(a, b, lane: int, exact: bool = False) -> None:
    (ka, va), (kb, vb) = a.state(lane).keys_values(), b.state(lane).keys_values()
    assert ka.shape == kb.shape and a.state(lane).num_tokens == b.state(lane).num_tokens
    assert a.state(lane).last_token == b.state(lane).last_token
    tol: dict = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-5)
    if not exact and ka.dtype != torch.float32:
        tol = {}  # the dtype's rounding (torch.testing's defaults)
    torch.testing.assert_close(ka, kb, **tol)
    torch.testing.assert_close(va, vb, **tol)
    torch.testing.assert_close(a.state(lane).last_hidden, b.state(lane).last_hidden, **tol)


def test_greedy_proposals_equal_the_eager_head(target: Target) -> None:
    eager, static = _eager(target), _static(target, max_lanes=4)
    seqs = [random_tokens(n, seed=n, vocab=VOCAB) for n in (5, 11, 23)]
    for lane, seq in enumerate(seqs):
        h = _hidden(target.ex, seq)
        for d in (eager, static):
            _commit_all(d, lane, seq, h)
        _assert_same_state(static, eager, lane)
    for ks in ([1, 1, 1], [3, 3, 3], [5, 2, 7], [7]):
        reqs = [draft_request(i, seqs[i], k) for i, k in enumerate(ks)]
        a, b = eager.propose(reqs), static.propose(reqs)
        for pa, pb, k in zip(a, b, ks, strict=True):
            assert pb.draft_token_ids.dtype == torch.int64 and pb.draft_probs is None
            assert pb.draft_token_ids.tolist() == pa.draft_token_ids.tolist() and len(pb.draft_token_ids) == k
    for lane in range(3):  # proposing leaves no trace
        _assert_same_state(static, eager, lane)


def test_sampled_proposals_draw_from_the_same_q(target: Target) -> None:
    """Two sampled lanes (one q computation for both: equal params) beside a greedy one: each lane's
    draws and q equal the eager head's (its own generator, seeded alike)."""
    eager, static = _eager(target), _static(target)
    seqs = [random_tokens(n, seed=40 + n, vocab=VOCAB) for n in (6, 9, 4)]
    for lane, seq in enumerate(seqs):
        h = _hidden(target.ex, seq)
        for d in (eager, static):
            _commit_all(d, lane, seq, h)
    hot = SamplingParams(temperature=1.3, top_p=0.9)
    for seed in range(3):

        def reqs(seed: int = seed) -> list:  # each drafter its own generators, seeded alike
            return [
                draft_request(0, seqs[0], 4, hot, seed=seed),
                draft_request(1, seqs[1], 3),
                draft_request(2, seqs[2], 2, SamplingParams(temperature=1.3, top_p=0.9), seed=seed + 10),
            ]

        a, b = eager.propose(reqs()), static.propose(reqs())
        for i in (0, 2):
            assert b[i].draft_token_ids.tolist() == a[i].draft_token_ids.tolist()
            torch.testing.assert_close(b[i].draft_probs, a[i].draft_probs, rtol=1e-5, atol=1e-6)
            assert b[i].draft_probs.shape == (len(b[i].draft_token_ids), VOCAB)
        assert b[1].draft_probs is None and b[1].draft_token_ids.tolist() == a[1].draft_token_ids.tolist()


@pytest.mark.parametrize("accepts", [[0, 0, 0], [1, 0, 2, 0], [3, 3, 3]], ids=["rejected", "partial", "full"])
def test_rounds_leave_the_committed_state(target: Target, accepts) -> None:
    """Rounds with n of k drafts right: the static head's pooled state equals the eager head's and
    equals the static head fed the same spans without proposing (bit for bit)."""
    k, ex = 3, target.ex
    eager, static, quiet = _eager(target), _static(target), _static(target)
    prompt = random_tokens(7, seed=13, vocab=VOCAB)
    st = ex.new_lane()
    out = ex.forward([st], [torch.tensor(prompt)], logits="last", record=False, output_hidden_states=True)
    ex.commit([st], [len(prompt)])
    seq = [*prompt, int(out.logits[0][-1].argmax())]
    first = CommittedSpan(0, 0, tuple(prompt), tuple(seq[1:]), hidden_states=out.hidden_states[0])
    for d in (eager, static, quiet):
        d.start_lane(0, prompt)
        d.commit([first])
    for n in accepts:
        pos = len(seq) - 1
        a, b = eager.propose([draft_request(0, seq, k)]), static.propose([draft_request(0, seq, k)])
        assert a[0].draft_token_ids.tolist() == b[0].draft_token_ids.tolist()
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
        for d in (eager, static, quiet):
            d.commit([span])
        seq += arg[:keep]
        _assert_same_state(static, eager, 0)
        _assert_same_state(static, quiet, 0, exact=True)
    assert static.state(0).num_tokens == len(seq) - 1


def _recording(d):
    seen: list[list[list[int]]] = []
    propose = d.propose

    def record(reqs):
        got = propose(reqs)
        seen.append([p.draft_token_ids.tolist() for p in got])
        return got

    d.propose = record
    return seen


def test_engine_lanes_join_and_leave(target: Target) -> None:
    """Three lanes (two slots: the pools grow), one joining after two steps, lengths differing: the
    static head gets the eager head's requests and proposes its drafts; outputs equal spec-off."""
    prompts = [random_tokens(n, seed=70 + n, vocab=VOCAB) for n in (9, 14, 5)]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (9, 4, 7)]
    outs, drafts = [], []
    for drafter in (None, _eager(target), _static(target, max_lanes=2)):
        seen = _recording(drafter) if drafter is not None else []
        engine = SpeculativeEngine(target.ex, drafter, draft_tokens=3 if drafter else None, draft_rows=16)
        ids = [engine.add_lane(prompts[0], params[0]), engine.add_lane(prompts[1], params[1])]
        for _ in range(2):
            engine.step()
        ids.append(engine.add_lane(prompts[2], params[2]))
        got: dict[int, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished:
            for u in engine.step():
                got[u.lane_id] += list(u.new_token_ids)
        outs.append([got[i] for i in ids])
        drafts.append(seen)
        if isinstance(drafter, StaticMTPDrafter):
            assert drafter.max_lanes == 4 and drafter.num_free_lanes() == 4  # grew; every slot back
    assert outs[0] == outs[1] == outs[2]
    assert drafts[1] == drafts[2] and len(drafts[2]) > 3


def test_checkpoint_snapshot_and_restore(target: Target) -> None:
    """Snapshots after a prompt (the eager span path) and after a static commit of two columns equal
    the eager head's; a restored lane proposes as the eager head's."""
    eager, static = _eager(target), _static(target)
    seq = random_tokens(12, seed=3, vocab=VOCAB)
    h = _hidden(target.ex, seq)
    for d in (eager, static):
        _commit_all(d, 0, seq, h)
    snap_e, snap_s = eager.snapshot_lane(0, len(seq) - 1), static.snapshot_lane(0, len(seq) - 1)
    for name in ("keys", "values", "hidden"):
        torch.testing.assert_close(snap_s.tensors[name], snap_e.tensors[name], rtol=1e-5, atol=1e-5)
    ext = seq + random_tokens(2, seed=4, vocab=VOCAB)
    h = _hidden(target.ex, ext)
    span = CommittedSpan(0, len(seq) - 1, tuple(ext[-3:-1]), tuple(ext[-2:]), hidden_states=h[-3:-1])
    for d in (eager, static):
        d.commit([span])
    seq = ext
    snap_e, snap_s = eager.snapshot_lane(0, len(seq) - 1), static.snapshot_lane(0, len(seq) - 1)
    for name in ("keys", "values", "hidden"):
        torch.testing.assert_close(snap_s.tensors[name], snap_e.tensors[name], rtol=1e-5, atol=1e-5)
    for d in (eager, static):
        d.end_lane(0)
        d.restore_lane(5, seq, snap_e)
    a, b = eager.propose([draft_request(5, seq, 4)]), static.propose([draft_request(5, seq, 4)])
    assert a[0].draft_token_ids.tolist() == b[0].draft_token_ids.tolist()
    _assert_same_state(static, eager, 5)
    static.end_lane(5)
    assert static.num_free_lanes() == static.max_lanes


def test_factory_capacity_and_warm_up(target: Target) -> None:
    d = _static(target, max_lanes=1, max_context=16)
    assert d.capacity == 16 + 16
    seq = random_tokens(40, seed=1, vocab=VOCAB)
    with pytest.raises(StateError, match="capacity"):
        _commit_all(d, 0, seq, _hidden(target.ex, seq))
    assert d.warm_up(columns=(4,), context=64) == 0 and 4 in d.column_widths
    with pytest.raises(ValueError, match="column count"):
        d.warm_up(columns=(9,))
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        _static(target, cuda_graphs=True)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


def _gpu_target(family: str, tmp_path: Path, dtype: torch.dtype, kernel=None) -> tuple:
    from ignis.runtime.linear import torch_linear

    tiny = make_tiny_hybrid(family, tmp_path / "target")
    make_mtp_drafter(tiny.folder, tmp_path / "with_mtp", seed=5)
    config, tensors = load_mtp_checkpoint(tmp_path / "with_mtp")
    dev = torch.device("cuda")
    # the target (dense experts) only feeds the heads its hidden states
    ex = get_family(config.model_type).make_executor(
        config, canonicalize_moe_tensors(config, tensors), dev, dtype
    )
    if kernel is not None:
        tensors = _q4_experts(tensors)
    kw = dict(target_config=config, target_weights=tensors, device=dev, dtype=dtype)
    if kernel is not None:
        kw |= dict(linear=torch_linear, moe_module=kernel)
    return config, ex, kw


def _graphed_equals_eager(config, ex, kw: dict, *, against_mtp: bool) -> None:
    graphed = build_mtp_drafter(**kw, max_lanes=4, max_context=256)
    plain = build_mtp_drafter(**kw, max_lanes=4, max_context=256, cuda_graphs=False)
    eager = build_mtp_drafter(**kw, static=False)
    assert isinstance(graphed, StaticMTPDrafter) and graphed.cuda_graphs and not plain.cuda_graphs
    assert graphed.warm_up(columns=(4,), context=256) > 0
    captured = graphed.num_captures
    drafters = (graphed, plain, eager)
    seqs = [random_tokens(n, seed=n, vocab=VOCAB) for n in (6, 17, 30)]
    hot = SamplingParams(temperature=0.9, top_k=50)
    for lane, seq in enumerate(seqs):
        h = _hidden(ex, seq)
        for d in drafters:
            _commit_all(d, lane, seq, h)
    for rnd in range(4):
        for lanes in (1, 3):
            reqs = [draft_request(i, seqs[i], 3) for i in range(lanes)]
            got = [d.propose(reqs) for d in drafters]
            for i in range(lanes):
                assert got[0][i].draft_token_ids.tolist() == got[1][i].draft_token_ids.tolist()
                if against_mtp:
                    assert got[0][i].draft_token_ids.tolist() == got[2][i].draft_token_ids.cpu().tolist()
            a, b = (
                d.propose([draft_request(i, seqs[i], 3, hot, seed=rnd) for i in range(lanes)])
                for d in drafters[:2]
            )
            for pa, pb in zip(a, b, strict=True):
                torch.testing.assert_close(pa.draft_probs, pb.draft_probs)  # the dtype's rounding
                assert pa.draft_token_ids.tolist() == pb.draft_token_ids.tolist()
        # a round: lane 0 keeps 1 column, lane 1 two, lane 2 three (the drafts' tokens as inputs)
        spans = []
        for i, seq in enumerate(seqs):
            m = i + 1
            ext = seq + random_tokens(m, seed=100 * rnd + i, vocab=VOCAB)
            h = _hidden(ex, ext)
            pos = len(seq) - 1
            spans.append(
                CommittedSpan(
                    i, pos, tuple(ext[pos : pos + m]), tuple(ext[pos + 1 : pos + m + 1]), h[pos : pos + m]
                )
            )
            seqs[i] = ext
        for d in drafters:
            d.commit(spans)
        for i in range(3):
            _assert_same_state(graphed, plain, i)
            if against_mtp:
                _assert_same_state(graphed, eager, i)
    assert graphed.num_captures == captured and graphed.num_replays > 0  # every shape from warm_up


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphed_dense_head(tmp_path: Path, dtype: torch.dtype) -> None:
    config, ex, kw = _gpu_target("qwen3_5", tmp_path, dtype)
    _graphed_equals_eager(config, ex, kw, against_mtp=dtype == torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_cuda_graphed_moe_head(cuda_kernel, family: str, tmp_path: Path) -> None:
    config, ex, kw = _gpu_target(family, tmp_path, torch.float32, kernel=cuda_kernel)
    _graphed_equals_eager(config, ex, kw, against_mtp=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_with_graphed_head(tmp_path: Path) -> None:
    """Through the engine (lanes joining and leaving): spec-on with the graphed head equals spec-off,
    and the graphed head's drafts equal the eager static head's."""
    _, ex, kw = _gpu_target("qwen3_5", tmp_path, torch.float32)
    prompts = [random_tokens(n, seed=n, vocab=VOCAB) for n in (9, 14, 5)]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (12, 5, 9)]
    outs, drafts = [], []
    for drafter in (
        None,
        build_mtp_drafter(**kw, max_lanes=3, max_context=128, cuda_graphs=False),
        build_mtp_drafter(**kw, max_lanes=3, max_context=128),
    ):
        if drafter is not None:
            drafter.warm_up(columns=(4,), context=128)
        seen = _recording(drafter) if drafter is not None else []
        engine = SpeculativeEngine(ex, drafter, draft_tokens=3 if drafter else None, draft_rows=16)
        ids = [engine.add_lane(prompts[0], params[0]), engine.add_lane(prompts[1], params[1])]
        engine.step()
        ids.append(engine.add_lane(prompts[2], params[2]))
        got: dict[int, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished:
            for u in engine.step():
                got[u.lane_id] += list(u.new_token_ids)
        outs.append([got[i] for i in ids])
        drafts.append(seen)
    assert outs[0] == outs[1] == outs[2]
    assert drafts[1] == drafts[2]


@pytest.fixture(scope="module")
def cuda_kernel(tmp_path_factory: pytest.TempPathFactory):
    """The compiled grouped expert kernels (as test_moe_grouped's: ``$IGNIS_MOE_MODULE`` or nvcc)."""
    import os

    from kernel_module_checks import HAS_NVCC

    from ignis.runtime.kernels.moe_experts import MoeExpertsKernel

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    env = os.environ.get("IGNIS_MOE_MODULE")
    if env:
        path = Path(env)
        if path.is_dir():
            path = path / f"moe_experts_sm{major}{minor}.so"
        if not path.exists():
            pytest.skip(f"IGNIS_MOE_MODULE={env} holds no module for sm_{major}{minor}")
    elif HAS_NVCC:
        from ignis.compiler.kernels.moe_experts import build_moe_experts

        path = build_moe_experts(f"sm_{major}{minor}", out_path=tmp_path_factory.mktemp("moe") / "moe.so")
    else:
        pytest.skip("no compiled grouped MoE kernels: set IGNIS_MOE_MODULE or install nvcc")
    return MoeExpertsKernel(path)


def _q4_experts(tensors: dict) -> dict:
    """The routed experts (trunk and MTP head) quantized to q4_g32; the rest as is."""
    from ignis.formats import quantize_q4_g32
    from ignis.runtime.linear import Q4Weight

    out = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name and t.shape[-1] % 32 == 0:
            packed, scales = quantize_q4_g32(t.reshape(-1, t.shape[-1]).float().numpy())
            t = Q4Weight(
                torch.from_numpy(packed).reshape(*t.shape[:-1], -1),
                torch.from_numpy(scales).reshape(*t.shape[:-1], -1),
            )
        out[name] = t
    return out


# ---------------------------------------------------------------------------------------------
# the server's load (ArtifactSource): a tiny qwen3_5 artifact with its MTP companion
# ---------------------------------------------------------------------------------------------


def _mtp_artifact(root: Path) -> Path:
    """A tiny `qwen3_5` artifact for the `cpu` card (torch linears) with its MTP companion."""
    import hf_tiny

    from ignis.compiler import build

    make_tiny_hybrid("qwen3_5", root / "target")
    hf_tiny.tiny_tokenizer(vocab_size=VOCAB).save_pretrained(root / "target")
    make_mtp_drafter(root / "target", root / "with_mtp", seed=5)
    recipe = root / "r.toml"
    recipe.write_text('name = "tiny-mtp"\n[modules]\nwidths = []\n')
    res = build.build_artifact(
        card="cpu", model=root / "with_mtp", recipe=recipe, out=root / "art", progress=False,
        echo=lambda _line: None,
    )  # fmt: skip
    assert res.out is not None
    return Path(res.out)


def _served_outputs(art: Path, device: str, backend: str) -> tuple[list[list[int]], object]:
    from ignis.runtime.metrics import SpeculativeMetrics
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.server.artifact_source import ArtifactSource
    from ignis.runtime.server.model import ModelSettings

    spec = SpecDefaults("off") if backend == "off" else SpecDefaults("mtp", 3)
    model = ArtifactSource(art).load(ModelSettings(spec, device=device, max_context=256))
    try:
        engine = model.make_engine(3, SpeculativeMetrics())
        drafter = engine.drafter
        captured = getattr(drafter, "num_captures", 0)
        prompts = [random_tokens(n, seed=n, vocab=VOCAB) for n in (5, 19, 33)]
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outs = [r.output_token_ids for r in engine.generate(prompts, params)]
        if drafter is not None:
            assert getattr(drafter, "num_captures", 0) == captured, "a request captured a head graph"
        return outs, drafter
    finally:
        model.close()


def test_server_serves_mtp_on_the_cpu(tmp_path: Path) -> None:
    """The server's MTP route on the CPU (the eager head): spec-on equals spec-off."""
    art = _mtp_artifact(tmp_path)
    off, _ = _served_outputs(art, "cpu", "off")
    on, drafter = _served_outputs(art, "cpu", "mtp")
    assert type(drafter) is MTPDrafter and on == off


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_server_builds_the_graphed_head_and_captures_it_at_load(tmp_path: Path) -> None:
    """On CUDA the server builds the static head for the engine's lanes and context, captures its
    shapes at load (no request captures one) and serves spec-on equal to spec-off."""
    art = _mtp_artifact(tmp_path)
    off, _ = _served_outputs(art, "cuda", "off")
    on, drafter = _served_outputs(art, "cuda", "mtp")
    assert isinstance(drafter, StaticMTPDrafter) and drafter.cuda_graphs
    assert drafter.max_lanes == 3 and drafter.max_context == 256 and drafter.num_captures > 0
    assert on == off


def test_static_commit_refuses_bad_spans_like_the_eager_head(target: Target) -> None:
    """A round-sized span (the static commit shape) that starts at the wrong position, lacks hidden
    states or has them in the wrong shape gets the eager head's error, and the lane's state is kept:
    the next good commit leaves the same state as the eager head's."""
    from ignis.runtime.drafters.base import DrafterError

    seq = random_tokens(7, seed=11, vocab=VOCAB)
    h = _hidden(target.ex, seq)
    eager, static = _eager(target), _static(target)
    for d in (eager, static):
        _commit_all(d, 0, seq[:5], h)
    bad = [
        (StateError, "starts at position 2", CommittedSpan(0, 2, (1,), (2,), hidden_states=h[:1])),
        (DrafterError, "without hidden states", CommittedSpan(0, 4, (seq[4],), (seq[5],))),
        (
            DrafterError,
            r"shape \(1, \d+\), expected \[2,",
            CommittedSpan(0, 4, (1, 2), (2, 3), hidden_states=h[:1]),
        ),
    ]
    for d in (eager, static):
        for err, match, span in bad:
            with pytest.raises(err, match=match):
                d.commit([span])
        d.commit([CommittedSpan(0, 4, tuple(seq[4:6]), tuple(seq[5:7]), hidden_states=h[4:6])])
    _assert_same_state(eager, static, 0)
