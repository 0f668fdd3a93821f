"""DFlash2's static route (`ignis.runtime.drafters.dflash2_graphs`): pooled lane windows and one
fixed-shape proposal forward, held to the eager drafter over multi-round runs (lanes joining and
leaving, partial acceptance, wrapped windows, sampled lanes, prompt checkpoints), on the CPU without
graphs; the CUDA graphs against the eager path on a GPU (`gpu` tests)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.drafters.base import CommittedSpan, DrafterError, DraftRequest
from ignis.runtime.drafters.dflash2 import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DFlash2Config,
    DFlash2Drafter,
)
from ignis.runtime.drafters.dflash2_graphs import context_buckets, default_widths, draw_race_noise
from ignis.runtime.errors import ConfigError, StateError
from ignis.runtime.sampling import SamplingParams
from ignis.tools.make_test_drafter import random_dflash2_weights

VOCAB = 320
HIDDEN = 64
TAPS = 2
GREEDY = SamplingParams(temperature=0)
HOT = SamplingParams(temperature=1.3)


def _config(**kw) -> DFlash2Config:
    base = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=VOCAB,
        block_size=8,
        target_layer_ids=(0, 1),
        mask_token_id=VOCAB - 1,
        layer_types=(SLIDING_ATTENTION, SLIDING_ATTENTION),
        sliding_window=6,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=16,
        rope_theta=10000.0,
    )
    base.update(kw)
    return DFlash2Config(**base)


def _drafter(config: DFlash2Config, device: str = "cpu", **kw) -> DFlash2Drafter:
    gen = torch.Generator().manual_seed(5)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5
    return DFlash2Drafter(
        config,
        random_dflash2_weights(config, seed=3),
        embed_tokens=embed,
        lm_head=head,
        device=device,
        **kw,
    )


class _Lane:
    def __init__(self, lane_id: int, rng: random.Random, params: SamplingParams) -> None:
        self.lane_id, self.params = lane_id, params
        self.tokens = [rng.randrange(VOCAB - 1) for _ in range(rng.randrange(1, 12))]
        self.committed = 0  # positions committed to the drafters
        self.rounds = 0


def _taps(lane_id: int, start: int, n: int) -> torch.Tensor:
    """Deterministic taps of positions start .. start + n - 1 of a lane (the same for every drafter)."""
    rows = [
        torch.randn(TAPS * HIDDEN, generator=torch.Generator().manual_seed(1000 * lane_id + p))
        for p in range(start, start + n)
    ]
    return torch.stack(rows)


def _span(lane: _Lane, n: int) -> CommittedSpan:
    """The next n columns of the lane (its tokens are extended by random ones first when needed)."""
    a = lane.committed
    return CommittedSpan(
        lane.lane_id,
        a,
        tuple(lane.tokens[a : a + n]),
        tuple(lane.tokens[a + 1 : a + n + 1]),
        taps=_taps(lane.lane_id, a, n),
    )


def _request(lane: _Lane, k: int, device: str) -> DraftRequest:
    seed = 7919 * lane.lane_id + lane.rounds
    return DraftRequest(
        lane_id=lane.lane_id,
        num_drafts=k,
        token_ids=tuple(lane.tokens[: lane.committed + 1]),
        num_prompt_tokens=1,
        params=lane.params,
        generator=torch.Generator(device=device).manual_seed(seed),
    )


def _same_proposals(a, b, *, atol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for pa, pb in zip(a, b, strict=True):
        assert pa.draft_token_ids.cpu().tolist() == pb.draft_token_ids.cpu().tolist()
        assert (pa.draft_probs is None) == (pb.draft_probs is None)
        if pa.draft_probs is not None:
            assert pa.draft_probs.shape == pb.draft_probs.shape
            torch.testing.assert_close(pa.draft_probs.cpu(), pb.draft_probs.cpu(), atol=atol, rtol=1e-4)


def _same_context(a: DFlash2Drafter, b: DFlash2Drafter, lane_id: int, atol: float = 1e-5) -> None:
    ca, cb = a.context(lane_id), b.context(lane_id)
    assert ca.num_positions == cb.num_positions
    for layer in range(a.config.num_hidden_layers):
        (ka, va), (kb, vb) = ca.keys_values(layer), cb.keys_values(layer)
        assert ka.shape == kb.shape
        torch.testing.assert_close(ka.cpu(), kb.cpu(), atol=atol, rtol=1e-4)
        torch.testing.assert_close(va.cpu(), vb.cpu(), atol=atol, rtol=1e-4)


def _drive(drafters, *, rounds: int, seed: int, max_lanes: int, device: str = "cpu", sampled: bool = True):
    """Multi-round run over every drafter in lockstep: lanes join (prompt spans, some in two chunks)
    and leave, every round each lane drafts 7 (some fewer), a random number of its drafts is
    accepted (the committed tokens are random), one lane is checkpointed and restored as a new lane.
    Every drafter's proposals and contexts are compared with the first's."""
    rng = random.Random(seed)
    lanes: list[_Lane] = []
    next_id = 0
    checkpoint = None
    for rnd in range(rounds):
        # join: up to max_lanes lanes; prompts committed in one span or two chunks
        while len(lanes) < max_lanes and (not lanes or rng.random() < 0.4):
            params = HOT if sampled and rng.random() < 0.4 else GREEDY
            lane = _Lane(next_id, rng, params)
            next_id += 1
            lanes.append(lane)
            n = len(lane.tokens) - 1
            cut = rng.randrange(1, n) if n > 1 and rng.random() < 0.5 else n
            for d in drafters:
                d.start_lane(lane.lane_id, lane.tokens)
            for piece in (cut, n - cut):
                if piece:
                    span = _span(lane, piece)
                    for d in drafters:
                        d.commit([span])
                    lane.committed += piece
        asking = [lane for lane in lanes if rng.random() < 0.9]
        if asking:
            ks = [7 if rng.random() < 0.8 else rng.randrange(1, 7) for _ in asking]
            props = [
                d.propose([_request(lane, k, device) for lane, k in zip(asking, ks, strict=True)])
                for d in drafters
            ]
            for other in props[1:]:
                _same_proposals(props[0], other)
        spans = []
        for lane in lanes:
            lane.rounds += 1
            keep = 1 + min(rng.randrange(0, 9), 7)  # anchor + accepted drafts
            lane.tokens += [rng.randrange(VOCAB - 1) for _ in range(keep)]
            spans.append(_span(lane, keep))
            lane.committed += keep
        for d in drafters:
            d.commit(spans)
        for lane in lanes:
            for d in drafters[1:]:
                _same_context(drafters[0], d, lane.lane_id)
        # prompt checkpoint: take one lane's state, restore it as a new lane later
        if rnd == rounds // 3 and lanes:
            src = lanes[0]
            checkpoint = (src, [d.snapshot_lane(src.lane_id, src.committed) for d in drafters])
        if rnd == rounds // 2 and checkpoint is not None and len(lanes) < max_lanes:
            src, snaps = checkpoint
            lane = _Lane(next_id, rng, src.params)
            next_id += 1
            lane.tokens = list(src.tokens[: snaps[0].num_tokens + 1])
            lane.committed = snaps[0].num_tokens
            for d, snap in zip(drafters, snaps, strict=True):
                d.restore_lane(lane.lane_id, lane.tokens, snap)
            for d in drafters[1:]:
                _same_context(drafters[0], d, lane.lane_id)
            lanes.append(lane)
        # leave
        for lane in list(lanes):
            if rng.random() < 0.15:
                lanes.remove(lane)
                for d in drafters:
                    d.end_lane(lane.lane_id)
    return lanes


CONFIGS = {
    "sliding": _config(),
    "long-window": _config(sliding_window=40),
    "mixed-full": _config(layer_types=(FULL_ATTENTION, SLIDING_ATTENTION)),
    "causal-gqa4": _config(is_causal=True, num_attention_heads=8, num_key_value_heads=2, sliding_window=20),
    "no-selector": _config(conv_kernel_size=0, selector_rank=0, selector_top_k=0, sliding_window=20),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_static_route_matches_eager(name: str) -> None:
    """The pooled layout (no graphs, CPU) proposes what the eager drafter proposes, round after round,
    and keeps the same context; several buckets and widths are met."""
    config = CONFIGS[name]
    eager = _drafter(config)
    static = _drafter(config)
    static.use_static(max_lanes=4, max_context=512, buckets=(2, 4, 16, 64), widths=(1, 2, 4))
    st = static.static
    assert st is not None and not st.cuda_graphs
    shapes: set[tuple[int, int]] = set()
    run = st.run
    st.run = lambda w, b: (shapes.add((w, b)), run(w, b))[1]  # type: ignore[method-assign]
    _drive([eager, static], rounds=24, seed=sum(map(ord, name)), max_lanes=4, sampled=name != "no-selector")
    assert len({w for w, _ in shapes}) > 1 and len({b for _, b in shapes}) > 1  # several widths, buckets


def test_static_route_snapshots_cross_paths() -> None:
    """A checkpoint taken on one path restores on the other (same tensor names, shapes, order)."""
    config = _config(sliding_window=10)
    eager, static = _drafter(config), _drafter(config)
    static.use_static(max_lanes=2)
    lane = _Lane(0, random.Random(1), GREEDY)
    lane.tokens = list(range(30))
    for d in (eager, static):
        d.start_lane(0, lane.tokens)
        d.commit([_span(lane, 25)])
    lane.committed = 25
    snaps = [d.snapshot_lane(0, 25) for d in (eager, static)]
    assert set(snaps[0].tensors) == set(snaps[1].tensors)
    for name, t in snaps[0].tensors.items():
        torch.testing.assert_close(t, snaps[1].tensors[name], atol=1e-5, rtol=1e-4)
    e2, s2 = _drafter(config), _drafter(config)
    s2.use_static(max_lanes=2)
    e2.restore_lane(5, lane.tokens, snaps[1])
    s2.restore_lane(5, lane.tokens, snaps[0])
    _same_context(e2, s2, 5)
    lane.lane_id = 5
    _same_proposals(e2.propose([_request(lane, 7, "cpu")]), s2.propose([_request(lane, 7, "cpu")]))
    with pytest.raises(StateError, match="context ends at 25"):
        static.snapshot_lane(0, 24)
    # a snapshot whose windows do not hold what this drafter keeps is refused (the engine prefills)
    from ignis.runtime.checkpoints import CheckpointError, DrafterSnapshot

    short = dict(snaps[0].tensors)
    short["layer.1.keys"], short["layer.1.values"] = short["layer.1.keys"][2:], short["layer.1.values"][2:]
    with pytest.raises(CheckpointError, match="holds 7 rows for 25 positions"):
        s2.restore_lane(6, lane.tokens, DrafterSnapshot(num_tokens=25, tensors=short))
    assert not s2.static.has_lane(6)
    with pytest.raises(CheckpointError, match="lacks tensor"):
        s2.restore_lane(6, lane.tokens, DrafterSnapshot(num_tokens=25, tensors={}))


def test_both_routes_refuse_a_snapshot_layer_of_the_wrong_shape() -> None:
    """Keys and values that differ in shape, or are not [n, nkv, head_dim], are a CheckpointError with
    the same message on the eager and the static restore, and no lane is left behind."""
    from ignis.runtime.checkpoints import CheckpointError, DrafterSnapshot

    config = _config(sliding_window=10)
    source = _drafter(config)
    lane = _Lane(0, random.Random(3), GREEDY)
    lane.tokens = list(range(12))
    source.start_lane(0, lane.tokens)
    source.commit([_span(lane, 8)])
    snap = source.snapshot_lane(0, 8)
    eager, static = _drafter(config), _drafter(config)
    static.use_static(max_lanes=2)
    k, v = snap.tensors["layer.1.keys"], snap.tensors["layer.1.values"]
    for bad, match in (
        ({"layer.1.values": v[:-1]}, r"layer 1 keys \(\d+, \d+, \d+\) / values .* do not fit"),
        ({"layer.1.keys": k[..., :-1], "layer.1.values": v[..., :-1]}, r"layer 1 keys .* do not fit \[n, "),
    ):
        broken = DrafterSnapshot(num_tokens=8, tensors={**snap.tensors, **bad})
        messages = []
        for d in (eager, static):
            with pytest.raises(CheckpointError, match=match) as err:
                d.restore_lane(4, lane.tokens, broken)
            messages.append(str(err.value))
        assert messages[0] == messages[1]
        assert 4 not in eager._lanes and static.static is not None and not static.static.has_lane(4)


def test_static_route_errors() -> None:
    config = _config()
    d = _drafter(config)
    d.use_static(max_lanes=2)
    lane = _Lane(0, random.Random(2), GREEDY)
    d.start_lane(0, lane.tokens)
    d.start_lane(1, lane.tokens)
    with pytest.raises(StateError, match="use_static"):
        d.use_static(max_lanes=4)
    with pytest.raises(StateError, match="a commit was missed"):
        d.propose([DraftRequest(0, 7, (1, 2, 3), 3, GREEDY, torch.Generator())])
    with pytest.raises(StateError, match="not started"):
        d.propose([DraftRequest(9, 7, (1,), 1, GREEDY, torch.Generator())])
    with pytest.raises(DrafterError, match="without taps"):
        d.commit([CommittedSpan(0, 0, (1,), (2,))])
    with pytest.raises(DrafterError, match="taps have shape"):
        d.commit([CommittedSpan(0, 0, (1,), (2,), taps=torch.zeros(1, 3))])
    d.end_lane(1)
    d.start_lane(2, lane.tokens)  # the freed slot is taken again
    assert d.static is not None and d.static._slot[2] == 1
    full = _config(layer_types=(FULL_ATTENTION, SLIDING_ATTENTION))
    with pytest.raises(ConfigError, match="needs max_context"):
        _drafter(full).use_static(max_lanes=2)
    with pytest.raises(ConfigError, match="max_lanes"):
        _drafter(config).use_static(max_lanes=0)


def test_slots_grow_past_max_lanes(caplog) -> None:
    """An engine running more lanes than the route was sized for (no max_lanes) gets twice the slots
    each time, every lane's context kept: proposals still equal the eager path's."""
    config = _config(sliding_window=20)
    eager, static = _drafter(config), _drafter(config)
    static.use_static(max_lanes=1)
    with caplog.at_level("WARNING"):
        _drive([eager, static], rounds=16, seed=21, max_lanes=4)
    assert static.static is not None and static.static.max_lanes == 4
    assert static.static.widths == (1, 2, 3, 4) and static.static.commit_rows == (8, 16, 32)
    assert "growing to 2" in caplog.text and "growing to 4" in caplog.text


def test_full_attention_ring_refuses_past_max_context() -> None:
    """A full-attention layer's ring holds max_context positions: a span past it is refused, not
    wrapped into the kept context."""
    d = _drafter(_config(layer_types=(FULL_ATTENTION, SLIDING_ATTENTION)))
    d.use_static(max_lanes=1, max_context=16)
    assert d.static is not None and d.static.full_cap == 16 and d.static.commit_rows == (8,)
    lane = _Lane(0, random.Random(4), GREEDY)
    lane.tokens = list(range(40))
    d.start_lane(0, lane.tokens)
    d.commit([_span(lane, 16)])
    lane.committed = 16
    with pytest.raises(DrafterError, match="past the 16 positions"):
        d.commit([_span(lane, 1)])


def test_default_widths() -> None:
    assert default_widths(1) == (1,)
    assert default_widths(8) == (1, 2, 3, 4, 5, 6, 7, 8)
    assert default_widths(40) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 40)
    assert default_widths(32) == (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)


def test_context_buckets() -> None:
    assert context_buckets(2047) == (128, 256, 512, 1024, 2047)
    assert context_buckets(5) == (5,)
    assert context_buckets(256) == (128, 256)


def test_race_noise_is_the_generator_stream() -> None:
    """The noise is a function of the lane's seed (both paths draw it the same way) and Exp(1)."""
    a = draw_race_noise(torch.Generator().manual_seed(3), 7, 16)
    b = draw_race_noise(torch.Generator().manual_seed(3), 7, 16)
    assert torch.equal(a, b) and a.shape == (7, 16) and a.dtype == torch.float32
    big = draw_race_noise(torch.Generator().manual_seed(4), 4000, 16)
    assert (big > 0).all() and abs(float(big.mean()) - 1.0) < 0.02


def test_race_noise_never_zero(monkeypatch) -> None:
    """A zero draw (possible from exponential_) would make a q = 0 candidate win (0 / 0 = NaN is
    argmax's pick); it is raised to the smallest normal float."""
    monkeypatch.setattr(torch.Tensor, "exponential_", lambda self, generator=None: self.zero_())
    noise = draw_race_noise(torch.Generator().manual_seed(0), 2, 4)
    assert (noise > 0).all()
    q = torch.tensor([0.0, 0.7, 0.3, 0.0])
    assert int((q / noise[0]).argmax()) == 1


def test_static_sampled_drafts_follow_q() -> None:
    """The static route's first sampled draft is distributed as its q (chi-square, fixed seeds)."""
    from ignis.runtime.drafters.testing import chi2_pvalue

    config = _config()
    d = _drafter(config)
    d.use_static(max_lanes=1)
    lane = _Lane(0, random.Random(3), SamplingParams(temperature=2.0))
    lane.tokens = list(range(1, 9))
    d.start_lane(0, lane.tokens)
    d.commit([_span(lane, 7)])
    lane.committed = 7
    first, q0 = [], None
    for seed in range(1500):
        req = dataclasses.replace(_request(lane, 1, "cpu"), generator=torch.Generator().manual_seed(seed))
        p = d.propose([req])[0]
        first.append(int(p.draft_token_ids[0]))
        q0 = p.draft_probs[0] if q0 is None else q0
    counts = torch.bincount(torch.tensor(first), minlength=VOCAB).double()
    assert chi2_pvalue(counts, q0.double()) > 1e-4


# ------------------------------------------------------------------------------------------ GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["sliding", "long-window", "mixed-full", "no-selector"])
def test_graphed_matches_eager_cuda(name: str) -> None:
    """CUDA graphs (captured at load, none on the request path) propose what the eager drafter
    proposes on the same card, over a multi-round run with lanes joining and leaving."""
    config = CONFIGS[name]
    eager = _drafter(config, "cuda")
    graphed = _drafter(config, "cuda")
    graphed.use_static(max_lanes=4, max_context=512)
    captured = graphed.warm_up(columns=(8,), context=512)
    st = graphed.static
    assert st is not None and st.cuda_graphs
    assert captured == len(st.widths) * len(st.buckets) + len(st.commit_rows)
    _drive([eager, graphed], rounds=24, seed=11, max_lanes=4, device="cuda", sampled=name != "no-selector")
    assert st.num_captures == captured  # nothing captured on the request path


@pytest.mark.gpu
@needs_cuda
def test_graphed_equals_ungraphed_bf16_cuda() -> None:
    """In bf16 the graphs replay exactly the fixed-shape forward they captured: bit-equal drafts and q
    with and without graphs."""
    config = _config(sliding_window=40)
    graphed = _drafter(config, "cuda", dtype=torch.bfloat16)
    plain = _drafter(config, "cuda", dtype=torch.bfloat16)
    graphed.use_static(max_lanes=4)
    assert graphed.warm_up() > 0
    plain.use_static(max_lanes=4, cuda_graphs=False)
    assert plain.warm_up() == 0
    _drive([plain, graphed], rounds=16, seed=5, max_lanes=4, device="cuda")


# ------------------------------------------------------------------------------------------ engine


def test_engine_static_route_equals_eager(tmp_path) -> None:
    """A tiny qwen3_5 target served with the static route gives what the eager drafter gives: the same
    outputs (greedy and seeded sampled lanes, one joining late, chunked prefill) and the same
    acceptance per position; greedy outputs equal speculation off's."""
    import importlib.util
    import sys
    from pathlib import Path

    from ignis.runtime.drafters.dflash2 import build_dflash2_drafter
    from ignis.runtime.engine import SpeculativeEngine
    from ignis.runtime.families import get_family
    from ignis.tools.make_test_drafter import make_dflash2_drafter

    name = "hf_tiny_hybrid"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[1] / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    tiny = sys.modules[name].make_tiny_hybrid("qwen3_5", tmp_path / "target")
    make_dflash2_drafter(tiny.folder, tmp_path / "dflash2", seed=7, dtype="float32", sliding_window=12)
    ex = get_family(tiny.config.model_type).make_executor(
        tiny.config, tiny.canonical_tensors(), "cpu", torch.float32
    )
    gen = torch.Generator().manual_seed(3)
    prompts = [tuple(torch.randint(3, 300, (n,), generator=gen).tolist()) for n in (9, 23, 5)]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=24, seed=11, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    ]

    def run(static: bool | None):
        drafter = None
        if static is not None:
            drafter = build_dflash2_drafter(
                target_config=tiny.config, target_weights=tiny.tensors, checkpoint=tmp_path / "dflash2"
            )
            if static:
                drafter.use_static(max_lanes=3, buckets=(4,))
        engine = SpeculativeEngine(
            ex, drafter, draft_tokens=7 if drafter else None, max_lanes=3, max_prefill_tokens=8
        )
        ids = [engine.add_lane(prompts[0], params[0]), engine.add_lane(prompts[1], params[1])]
        steps = 0
        while engine.has_unfinished or len(ids) < 3:
            engine.step()
            steps += 1
            if steps == 3:
                ids.append(engine.add_lane(prompts[2], params[2]))
        outs = [engine.pop_result(i).output_token_ids for i in ids]
        return outs, engine.metrics

    (eager, me), (static, ms), (off, _) = run(False), run(True), run(None)
    assert static == eager
    assert dict(ms.position_drafted_total) == dict(me.position_drafted_total)
    assert dict(ms.position_accepted_total) == dict(me.position_accepted_total)
    assert ms.rounds_total > 0
    assert static[0] == off[0] and static[2] == off[2]  # greedy lanes: speculation off's output


def test_factory_builds_the_route(tmp_path) -> None:
    """`build_dflash2_drafter`'s static options (what the server passes beside a static target):
    slots = max_lanes, full-attention rings of max_context; None means on CUDA (eager on the CPU);
    `warm_up` (called by the server's `warm_up_static`) captures nothing without CUDA graphs."""
    from ignis.runtime.drafters.dflash2 import build_dflash2_drafter

    config = _config(layer_types=(FULL_ATTENTION, SLIDING_ATTENTION))
    target = SimpleNamespace(
        hidden_size=HIDDEN, num_hidden_layers=2, vocab_size=VOCAB, tie_word_embeddings=False
    )
    gen = torch.Generator().manual_seed(5)
    tw = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen)}
    tw["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen)
    kw = dict(target_config=target, target_weights=tw, config=config, weights=random_dflash2_weights(config))
    d = build_dflash2_drafter(**kw, static=True, max_lanes=3, max_context=96)
    assert d.static is not None and d.static.max_lanes == 3 and d.static.full_cap == 96
    assert not d.static.cuda_graphs and d.warm_up(columns=(8,), context=64) == 0
    with pytest.raises(ValueError, match="context"):
        d.warm_up(context=0)
    assert build_dflash2_drafter(**kw).static is None  # None: on CUDA only
    assert build_dflash2_drafter(**kw, static=False).warm_up() == 0
    with pytest.raises(ConfigError, match="needs max_context"):
        build_dflash2_drafter(**kw, static=True)


def test_warm_up_covers_every_shape_a_run_meets(monkeypatch) -> None:
    """With graphs (stood in for on the CPU by replaying the captured body), `warm_up` at load
    captures every (width, bucket) proposal and every commit row bucket a multi-lane run then
    meets: nothing is captured on the request path, and the replayed route equals the eager one."""
    from ignis.runtime.drafters.dflash2_graphs import StaticDFlash2

    class Replayed:
        def __init__(self, body) -> None:  # type: ignore[no-untyped-def]
            self.body = body

        def replay(self) -> None:
            self.body()

    def capture(self, run):  # type: ignore[no-untyped-def]
        self.num_captures += 1
        return Replayed(run)

    monkeypatch.setattr(StaticDFlash2, "_capture_body", capture)
    config = _config(sliding_window=40)
    eager, graphed = _drafter(config), _drafter(config)
    graphed.use_static(max_lanes=4, buckets=(8, 16))
    st = graphed.static
    assert st is not None
    st.cuda_graphs = True  # the CPU stand-in above replays what would be captured
    captured = graphed.warm_up(columns=(8,))
    assert captured == len(st.widths) * len(st.buckets) + len(st.commit_rows) == 4 * 3 + 3
    live = _drive([eager, graphed], rounds=20, seed=9, max_lanes=4)
    assert st.num_captures == captured
    assert live
    with pytest.raises(StateError, match="before any lane"):
        graphed.warm_up()


def test_a_failed_capture_turns_graphs_off_and_runs_the_static_route(monkeypatch, caplog) -> None:
    """A capture that raises (an op the CUDA graph cannot hold) at load turns the drafter's graphs
    off (logged) instead of failing the server's load; every shape then runs the same static code
    directly, and the proposals still equal the eager drafter's."""
    from ignis.runtime.drafters.dflash2_graphs import StaticDFlash2

    calls = []

    def capture(self, run):  # type: ignore[no-untyped-def]
        calls.append(run)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(StaticDFlash2, "_capture_body", capture)
    config = _config(sliding_window=40)
    eager, graphed = _drafter(config), _drafter(config)
    graphed.use_static(max_lanes=4, buckets=(8, 16))
    st = graphed.static
    assert st is not None
    st.cuda_graphs = True
    with caplog.at_level("WARNING"):
        assert graphed.warm_up(columns=(8,)) == 0
    assert len(calls) == 1 and not st.cuda_graphs
    assert "graphs off" in caplog.text
    assert _drive([eager, graphed], rounds=12, seed=3, max_lanes=4)
    assert len(calls) == 1  # nothing tried again on the request path
