"""`StaticHybridExecutor` (pooled static buffers, CUDA-graphed rounds) against `HybridExecutor`.

On the CPU the static path runs without capture: the same code the graphs replay. Oracle: the eager
`HybridExecutor` over the same tiny random checkpoints (`tests/hf_tiny_hybrid.py`), float32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hf_tiny_hybrid import TinyHybrid, make_tiny_hybrid  # tests/ is on pytest's pythonpath
from hybrid_graph_checks import (
    commit_every_k_on_gpu,
    cuda_kw,
    feed_alone,
    gpu_rounds,
    gpu_tolerances,
    module_path,
    prefill_on_gpu,
    recaptured_matches,
    setter_wants_cuda,
    states_agree,
    tokens,
)

from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.errors import ConfigError, StateError
from ignis.runtime.families.hybrid_executor import HybridExecutor
from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
from ignis.runtime.sampling import SamplingParams

FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
ATOL = RTOL = 1e-4  # float32; rows batched differently round differently (MoE index_add_, GEMM paths)


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TinyHybrid:
    torch.set_num_threads(1)
    return make_tiny_hybrid(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def ref(tiny: TinyHybrid) -> HybridExecutor:
    return HybridExecutor(tiny.config, tiny.canonical_tensors())


def static(tiny: TinyHybrid, **kw) -> StaticHybridExecutor:
    kw = {"max_lanes": 4, "max_context": 200, "kv_bucket": 16, **kw}
    return StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), **kw)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def assert_same_state(config, a, b) -> None:
    """Same committed length, KV, conv and float32 recurrent state (a, b from any two executors)."""
    assert a.num_tokens == b.num_tokens
    for layer in range(config.num_hidden_layers):
        if config.is_full_attention(layer):
            (ka, va), (kb, vb) = a.kv(layer), b.kv(layer)
            assert ka.shape == kb.shape == (config.num_key_value_heads, a.num_tokens, config.head_dim)
            close(ka, kb)
            close(va, vb)
        else:
            close(a.conv_state(layer), b.conv_state(layer))
            ra, rb = a.recurrent_state(layer), b.recurrent_state(layer)
            assert ra.dtype == rb.dtype == torch.float32
            close(ra, rb)


def run_both(ref, st, ref_states, st_states, columns, keeps, *, record=True, logits="all", **kw):
    """One forward + commit on both executors; checks logits (and hidden/taps) equal."""
    a = ref.forward(ref_states, columns, record=record, logits=logits, **kw)
    b = st.forward(st_states, columns, record=record, logits=logits, **kw)
    assert len(a.logits) == len(b.logits)
    for la, lb in zip(a.logits, b.logits, strict=True):
        assert la.shape == lb.shape
        close(lb, la)
    for name in ("hidden_states", "taps"):
        xa, xb = getattr(a, name), getattr(b, name)
        assert (xa is None) == (xb is None)
        for ya, yb in zip(xa or [], xb or [], strict=True):
            close(yb, ya)
    ref.commit(ref_states, keeps)
    st.commit(st_states, keeps)
    for ra, sb in zip(ref_states, st_states, strict=True):
        assert_same_state(ref.config, sb, ra)


def test_rounds_match_hybrid_executor(tiny: TinyHybrid, ref: HybridExecutor) -> None:
    """Prefill (long prompts eager and chunked, a short one static), then verify rounds with mixed
    column counts and partial commits; a lane joins mid-way; hidden states and taps too."""
    vocab = tiny.config.vocab_size
    st = static(tiny, max_lanes=5)
    assert not st.cuda_graphs
    prompts = [tokens(70, 1, vocab), tokens(5, 2, vocab), tokens(20, 3, vocab)]
    ra, sa = [ref.new_lane() for _ in prompts], [st.new_lane() for _ in prompts]
    run_both(ref, st, ra, sa, prompts, [p.numel() for p in prompts], record=False, logits="last")
    short = [tokens(3, 4, vocab), tokens(8, 5, vocab)]  # all <= max_columns: a static prefill
    rb, sb = [ref.new_lane() for _ in short], [st.new_lane() for _ in short]
    run_both(ref, st, rb, sb, short, [3, 8], record=False, logits="last", output_hidden_states=True)
    ra, sa = ra + rb[:1], sa + sb[:1]  # lane 4 joins the rounds below; lane 5 waits
    shapes = [[1, 8, 3, 5], [4, 1, 8, 2], [1, 1, 1, 1], [8, 8, 8, 8], [2, 7, 1, 6]]
    keeps = [[1, 5, 0, 5], [4, 1, 2, 1], [1, 1, 1, 0], [8, 3, 1, 7], [2, 7, 1, 6]]
    for r, (shape, keep) in enumerate(zip(shapes, keeps, strict=True)):
        cols = [tokens(n, 100 + 10 * r + i, vocab) for i, n in enumerate(shape)]
        kw = {"output_hidden_states": True, "tap_layers": (0, 2)} if r % 2 else {}
        run_both(ref, st, ra, sa, cols, keep, **kw)
    # the waiting lane joins a round with the others at a different length
    ra, sa = ra + rb[1:], sa + sb[1:]
    cols = [tokens(n, 900 + i, vocab) for i, n in enumerate([3, 1, 6, 2, 4])]
    run_both(ref, st, ra, sa, cols, [c.numel() for c in cols])


@pytest.mark.parametrize("prefix", [0, 9])
def test_commit_every_k_equals_feeding_the_kept_tokens(
    tiny: TinyHybrid, ref: HybridExecutor, prefix: int
) -> None:
    vocab = tiny.config.vocab_size
    st = static(tiny, max_lanes=2)
    head, cols = tokens(prefix, 7, vocab), tokens(8, 8, vocab)
    for keep in range(cols.numel() + 1):
        lane = st.new_lane()
        if prefix:
            st.forward([lane], [head], record=False)
            st.commit([lane], [prefix])
        other = st.new_lane()  # a second lane in the same round, committed differently
        st.forward([lane, other], [cols, cols[:3]])
        st.commit([lane, other], [keep, 3])
        expect = ref.new_lane()
        kept = torch.cat([head, cols[:keep]])
        if kept.numel():  # token by token, as the static round (chunked differs by ~3e-5)
            ref.forward([expect], [kept], record=True)
            ref.commit([expect], [kept.numel()])
        assert_same_state(tiny.config, lane, expect)
        # and the next round from there matches too
        nxt = tokens(4, 50 + keep, vocab)
        a = ref.forward([expect], [nxt])
        b = st.forward([lane], [nxt])
        close(b.logits[0], a.logits[0])
        ref.commit([expect], [0])
        st.commit([lane], [0])
        st.release_lane(lane)
        st.release_lane(other)
        assert st.num_free_lanes == 2


def test_slot_reuse_and_lane_errors(tiny: TinyHybrid, ref: HybridExecutor) -> None:
    vocab = tiny.config.vocab_size
    st = static(tiny, max_lanes=2, max_context=40)
    a, b = st.new_lane(), st.new_lane()
    st.forward([a, b], [tokens(12, 1, vocab), tokens(6, 2, vocab)], record=False)
    st.commit([a, b], [12, 6])
    ra = ref.new_lane()
    ref.forward([ra], [tokens(12, 1, vocab)], record=False)
    ref.commit([ra], [12])
    extra = st.new_lane()  # a third lane: the pools grow to 4 slots, a's state comes along
    assert st.max_lanes == 4 and extra.slot == 2 and st.num_free_lanes == 1
    assert_same_state(tiny.config, a, ra)
    st.release_lane(extra)
    slot = b.slot
    st.release_lane(b)
    st.release_lane(b)  # idempotent
    with pytest.raises(StateError, match="released"):
        st.forward([b], [tokens(1, 3, vocab)])
    c = st.new_lane()  # reuses b's slot with a clean state
    assert c.slot == slot and c.num_tokens == 0
    del a  # dropping a state gives its slot back too
    import gc

    gc.collect()
    assert st.num_free_lanes == 3
    prompt = tokens(5, 4, vocab)
    rc = ref.new_lane()
    run_both(ref, st, [rc], [c], [prompt], [5])
    # protocol errors
    with pytest.raises(StateError, match="outside"):
        st.forward([c], [tokens(3, 5, vocab)])
        st.commit([c], [4])
    st.commit([c], [3])
    st.forward([c], [tokens(4, 6, vocab)], record=False)
    with pytest.raises(StateError, match="record=False"):
        st.commit([c], [2])
    st.commit([c], [4])
    d = st.new_lane()
    st.forward([c], [tokens(2, 7, vocab)])
    with pytest.raises(StateError, match="static round is pending"):
        st.forward([d], [tokens(2, 8, vocab)])
    st.commit([c], [1])
    e = st.new_lane()  # a lane dropped with a pending round does not block the next round
    st.forward([e], [tokens(2, 10, vocab)])
    del e
    gc.collect()
    st.forward([d], [tokens(2, 8, vocab)])
    st.commit([d], [2])
    with pytest.raises(StateError, match="max_context"):
        st.forward([c], [tokens(40 - c.num_tokens + 1, 9, vocab)])
    with pytest.raises(StateError, match="new_lane"):
        st.forward([ref.new_lane()], [tokens(1, 9, vocab)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="CUDA"):
        static(tiny, cuda_graphs=True)


@pytest.mark.parametrize("chunked", [0, 32])
def test_spec_on_equals_spec_off_through_the_engine(tiny: TinyHybrid, chunked: int) -> None:
    """SpeculativeEngine over the static executor: greedy outputs with the test drafters (7 drafts,
    right with p = 0.6, always right, always wrong) equal speculation off and the eager executor's;
    lanes finish and free their slots for the waiting ones (5 requests on 3 slots). chunked: the
    prompts of 9 and 17 tokens prefill as chunks of static rounds (the 70-token one eagerly)."""
    from ignis.runtime.drafters.testing import always_right, always_wrong, right_with_probability

    vocab = tiny.config.vocab_size
    prompts = [tokens(n, 20 + n, vocab).tolist() for n in (3, 17, 9, 70, 1)]
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    eager = HybridExecutor(tiny.config, tiny.canonical_tensors())
    refs = {
        tuple(p): r.output_token_ids
        for p, r in zip(prompts, SpeculativeEngine(eager).generate(prompts, greedy), strict=True)
    }
    st = static(tiny, max_lanes=3, max_context=120, chunked_prefill=chunked)
    eager_prefills = _count_calls(st, "_eager_forward")
    off = SpeculativeEngine(st, max_lanes=3).generate(prompts, greedy)
    # the first prefill (3, 17, 9 tokens) is chunked or eager; the 70-token one is always eager
    assert (eager_prefills[0] == 1) == bool(chunked)
    assert {tuple(p): r.output_token_ids for p, r in zip(prompts, off, strict=True)} == refs
    assert st.num_free_lanes == 3
    drafters = [
        right_with_probability(refs, 0.6, vocab_size=vocab, seed=3),
        always_right(refs, vocab_size=vocab),
        always_wrong(refs, vocab_size=vocab, seed=1),
    ]
    for drafter in drafters:
        eng = SpeculativeEngine(st, drafter, draft_tokens=7, max_lanes=3)
        got = eng.generate(prompts, greedy)
        assert {tuple(p): r.output_token_ids for p, r in zip(prompts, got, strict=True)} == refs
        assert st.num_free_lanes == 3
    assert SpeculativeEngine(st).max_context == 120  # the engine caps its context to the pool
    with pytest.raises(ConfigError, match="max_context"):
        SpeculativeEngine(st, max_context=121)


def _count_calls(ex: StaticHybridExecutor, name: str, fail_at: int | None = None) -> list[int]:
    """Wrap ex.<name> to count its calls (a one-element list); fail_at: the call (1-based) that
    raises RuntimeError instead."""
    count, inner = [0], getattr(ex, name)

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] == fail_at:
            raise RuntimeError("injected failure")
        return inner(*args, **kwargs)

    setattr(ex, name, wrapped)
    return count


def _snapshot(config, lane) -> list[torch.Tensor]:
    """The lane's committed state (KV up to its length, conv, recurrent), cloned."""
    out = []
    for layer in range(config.num_hidden_layers):
        if config.is_full_attention(layer):
            out += [t.clone() for t in lane.kv(layer)]
        else:
            out += [lane.conv_state(layer).clone(), lane.recurrent_state(layer).clone()]
    return out


def _same_exactly(config, lane, snap: list[torch.Tensor], num_tokens: int) -> None:
    assert lane.num_tokens == num_tokens and not lane.is_pending
    now = _snapshot(config, lane)
    assert len(now) == len(snap)
    for a, b in zip(now, snap, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_forward_checks_name_the_lane(tiny: TinyHybrid) -> None:
    """The token-id checks run on one host copy of every lane's columns (one sync per forward) and
    still name the lane, as HybridExecutor's."""
    vocab = tiny.config.vocab_size
    st = static(tiny, max_lanes=3)
    lanes = [st.new_lane() for _ in range(3)]
    good = [tokens(n, 90 + n, vocab) for n in (2, 5, 1)]
    for i, bad in ((2, vocab), (0, -1), (1, vocab + 7)):
        cols = list(good)
        cols[i] = torch.cat([good[i], torch.tensor([bad])])
        with pytest.raises(ValueError, match=f"lane {i}: token id outside"):
            st.forward(lanes, cols)
    with pytest.raises(ValueError, match="lane 1: columns must be a non-empty"):
        st.forward(lanes, [good[0], good[1][:0], good[2]])
    assert not any(s.is_pending for s in lanes)
    st.forward(lanes, good)  # and a good forward goes through
    st.commit(lanes, [2, 5, 1])
    assert [s.num_tokens for s in lanes] == [2, 5, 1]


def test_chunked_prefill_matches_the_eager_paths(tiny: TinyHybrid, ref: HybridExecutor) -> None:
    """record=False forwards of max_columns < n <= chunked_prefill columns run as static chunks:
    logits (all / last), hidden states and taps equal the eager static path and HybridExecutor's;
    commit(whole) leaves the state of feeding the tokens alone; mixed lanes (20 and 5 columns, on a
    prefix); a lane past chunked_prefill sends the whole forward down the eager path."""
    vocab, c = tiny.config.vocab_size, tiny.config
    assert static(tiny).chunked_prefill == 0  # off by default without CUDA graphs
    with pytest.raises(ValueError, match="chunked_prefill"):
        static(tiny, chunked_prefill=-1)
    st = static(tiny, max_lanes=3, chunked_prefill=32)
    plain = static(tiny, max_lanes=3)  # chunked_prefill=0: the eager path
    chunks, eager_calls = _count_calls(st, "_static_forward"), _count_calls(st, "_eager_forward")
    prefix = [tokens(9, 60, vocab), tokens(3, 61, vocab)]
    prompts = [tokens(20, 62, vocab), tokens(5, 63, vocab)]
    lanes = [[ex.new_lane() for _ in prompts] for ex in (ref, st, plain)]
    for ex, ls in zip((ref, st, plain), lanes, strict=True):
        ex.forward(ls, prefix, record=False)
        ex.commit(ls, [p.numel() for p in prefix])
    assert chunks[0] == 2 and eager_calls[0] == 0  # 9 columns: 2 chunks (8 + 1)
    chunks[0] = 0
    for logits, kw in (("all", {"output_hidden_states": True, "tap_layers": (0, 2)}), ("last", {})):
        outs = [
            ex.forward(ls, prompts, record=False, logits=logits, **kw)
            for ex, ls in zip((ref, st, plain), lanes, strict=True)
        ]
        assert chunks[0] == 3 and eager_calls[0] == 0  # 20 columns: 8 + 8 + 4 (the 5 in the first)
        chunks[0] = 0
        for i, p in enumerate(prompts):
            assert outs[1].logits[i].shape == (p.numel() if logits == "all" else 1, vocab)
            close(outs[1].logits[i], outs[0].logits[i])
            close(outs[1].logits[i], outs[2].logits[i])
            for name in ("hidden_states", "taps"):
                xs = [getattr(o, name) for o in outs]
                assert (xs[1] is None) == (xs[0] is None) == (logits == "last")
                if xs[1] is not None:
                    assert xs[1][i].shape == xs[0][i].shape
                    close(xs[1][i], xs[0][i])
                    close(xs[1][i], xs[2][i])
        assert all(s.is_pending and s.num_tokens == p.numel() for s, p in zip(lanes[1], prefix, strict=True))
        if logits == "all":  # discard: the next (last-logits) forward repeats it
            for ex, ls in zip((ref, st, plain), lanes, strict=True):
                ex.commit(ls, [0, 0])
    for ex, ls in zip((ref, st, plain), lanes, strict=True):
        ex.commit(ls, [p.numel() for p in prompts])
    for a, b, e in zip(*lanes, strict=True):
        assert_same_state(c, b, a)
        assert_same_state(c, e, a)
    # the next verify round from there matches too
    cols = [tokens(4, 64, vocab), tokens(8, 65, vocab)]
    run_both(ref, st, lanes[0], lanes[1], cols, [2, 8])
    # a lane past chunked_prefill: the whole forward is eager
    longer = [tokens(33, 66, vocab), tokens(10, 67, vocab)]
    run_both(ref, st, lanes[0], lanes[1], longer, [33, 10], record=False, logits="last")
    assert eager_calls[0] == 1 and chunks[0] == 1  # the verify round above
    # record=True forwards never chunk
    run_both(ref, st, lanes[0], lanes[1], [tokens(12, 68, vocab), tokens(2, 69, vocab)], [5, 2])
    assert eager_calls[0] == 2 and chunks[0] == 1


def test_chunked_prefill_discard_and_errors_restore_exactly(tiny: TinyHybrid, ref: HybridExecutor) -> None:
    """A chunked prefill (committed chunk by chunk inside the forward) discarded with commit(0), or
    failing in its second chunk, leaves every lane bit-exactly as before; only whole or 0 commits;
    no chunked forward while a static round is pending."""
    vocab, c = tiny.config.vocab_size, tiny.config
    st = static(tiny, max_lanes=3, chunked_prefill=24)
    lanes = [st.new_lane() for _ in range(2)]
    st.forward(lanes, [tokens(7, 70, vocab), tokens(2, 71, vocab)], record=False)
    st.commit(lanes, [7, 2])
    snaps = [_snapshot(c, s) for s in lanes]
    prompts = [tokens(19, 72, vocab), tokens(11, 73, vocab)]
    first = st.forward(lanes, prompts, record=False, logits="last").logits
    with pytest.raises(StateError, match="whole"):
        st.commit(lanes, [19, 4])
    st.commit(lanes, [0, 0])
    for s, snap, n in zip(lanes, snaps, (7, 2), strict=True):
        _same_exactly(c, s, snap, n)
    # the same prefill again gives the same logits, and committing it matches the eager executor
    again = st.forward(lanes, prompts, record=False, logits="last").logits
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    st.commit(lanes, [0, 0])
    # an error in the second chunk: the lanes are back as they were, nothing pending
    calls = _count_calls(st, "_static_forward", fail_at=2)
    with pytest.raises(RuntimeError, match="injected"):
        st.forward(lanes, prompts, record=False)
    assert calls[0] == 2
    del st._static_forward  # the class's method again
    for s, snap, n in zip(lanes, snaps, (7, 2), strict=True):
        _same_exactly(c, s, snap, n)
    # the lanes still work: prefill whole, as HybridExecutor fed the same tokens
    refs = [ref.new_lane() for _ in lanes]
    for r, head in zip(refs, (tokens(7, 70, vocab), tokens(2, 71, vocab)), strict=True):
        ref.forward([r], [head], record=False)
        ref.commit([r], [head.numel()])
    run_both(ref, st, refs, lanes, prompts, [19, 11], record=False, logits="last")
    # a pending static round blocks a chunked prefill
    other = st.new_lane()
    st.forward([lanes[0]], [tokens(3, 74, vocab)])
    with pytest.raises(StateError, match="static round is pending"):
        st.forward([other], [tokens(12, 75, vocab)], record=False)
    st.commit([lanes[0]], [0])
    st.release_lane(other)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_chunked_prefill(tiny: TinyHybrid, dtype: torch.dtype) -> None:
    """On CUDA (qwen3_5: graphed): a 16-token prompt on 1 and 3 lanes prefills as 2 replayed chunks,
    with the eager static path's logits and states (float32 tight, bf16 close); commit(0) restores
    the lanes bit-exactly; repeated prefills replay without new captures."""
    if tiny.config.model_type != "qwen3_5":
        pytest.skip("MoE configs run without CUDA graphs (chunked_prefill off by default)")
    vocab, c = tiny.config.vocab_size, tiny.config
    kw = cuda_kw(dtype)
    graphed = StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), **kw)
    assert graphed.cuda_graphs and graphed.chunked_prefill == 4 * graphed.max_columns
    plain = StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), cuda_graphs=False, **kw)
    assert plain.chunked_prefill == 0
    same = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.15, "rtol": 0.05}
    for n_lanes in (1, 3):
        prompts = [tokens(16, 80 + i, vocab).cuda() for i in range(n_lanes)]
        lanes = [[ex.new_lane() for _ in prompts] for ex in (graphed, plain)]
        for rep in range(2):
            r0, c0 = graphed.num_replays, graphed.num_captures
            snaps = [_snapshot(c, s) for s in lanes[0]]
            outs = [
                ex.forward(ls, prompts, record=False, logits="last")
                for ex, ls in zip((graphed, plain), lanes, strict=True)
            ]
            assert graphed.num_replays - r0 == 2
            assert graphed.num_captures - c0 == (1 if rep == 0 else 0)  # [L, 8] at buckets 16, 16
            for a, b in zip(outs[0].logits, outs[1].logits, strict=True):
                torch.testing.assert_close(a, b, **same)
            if rep == 0:
                graphed.commit(lanes[0], [0] * n_lanes)
                plain.commit(lanes[1], [0] * n_lanes)
                for s, snap in zip(lanes[0], snaps, strict=True):
                    _same_exactly(c, s, snap, 0)
        graphed.commit(lanes[0], [16] * n_lanes)
        plain.commit(lanes[1], [16] * n_lanes)
        for a, b in zip(*lanes, strict=True):
            assert a.num_tokens == 16
            states_agree(c, a, b, same=same, attn="kv", conv=True)
        for ex, ls in zip((graphed, plain), lanes, strict=True):
            for s in ls:
                ex.release_lane(s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_replay_like_the_eager_paths(tiny: TinyHybrid, dtype: torch.dtype) -> None:
    """On CUDA: graphed rounds (replayed, several shapes, mixed lane lengths, partial commits) give the
    eager static path's logits and states, and HybridExecutor's (float32: tight; bf16: close)."""
    vocab = tiny.config.vocab_size
    kw = cuda_kw(dtype)
    has_moe = tiny.config.model_type != "qwen3_5"
    graphed = StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), **kw)
    assert graphed.cuda_graphs == (not has_moe)
    plain = StaticHybridExecutor(
        tiny.config,
        tiny.canonical_tensors(),
        cuda_graphs=False,
        chunked_prefill=graphed.chunked_prefill,
        **kw,
    )  # the same (chunked, when graphed) prefill, run eagerly
    eager = HybridExecutor(tiny.config, tiny.canonical_tensors(), device="cuda", dtype=dtype)
    tol = {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else {"atol": 0.15, "rtol": 0.05}
    exs = (graphed, plain, eager)
    lanes = prefill_on_gpu(exs, vocab, 30)
    replays0, captures0 = graphed.num_replays, graphed.num_captures  # the prefill's chunks (graphed)
    shapes = [[1, 1, 1], [8, 3, 1], [8, 3, 1], [2, 8, 5], [1, 1, 1], [8, 3, 1]]
    keeps = [[1, 1, 1], [4, 3, 0], [8, 1, 1], [2, 8, 3], [1, 1, 1], [2, 2, 1]]
    exact = {"atol": 1e-5, "rtol": 1e-5}
    gpu_rounds(exs, lanes, shapes, keeps, 200, vocab, same=exact, tol=tol, hidden=False)
    if not has_moe:  # the prefill (20 columns) ran as 3 chunks; every round replayed a graph
        assert replays0 == 3
        assert graphed.num_replays - replays0 == len(shapes)
        assert 2 <= graphed.num_captures - captures0 < len(shapes)  # repeated shapes: no capture
    else:
        assert graphed.num_captures == graphed.num_replays == 0
    c = tiny.config
    for a, b in zip(lanes[0], lanes[1], strict=True):
        states_agree(c, a, b, same=exact, attn="", conv=False)


def _emulated_gdn_module(calls: list, replay: bool = False):
    """A CPU stand-in for the compiled `gdn_recurrent` function: the kernel's CPU model
    (`gdn_recurrent_emulated`), writing record[:n, :L] and out as the kernel does. replay: a module
    dict that also has `gdn_recurrent_stash` and `gdn_replay` (their CPU models; calls records
    ("stash", L, n) and ("replay", keep list))."""
    from ignis.compiler.kernels.gdn_recurrent import (
        gdn_recurrent_emulated,
        gdn_replay_emulated,
        gdn_stash_emulated,
    )

    def func(mixed, b, a, neg_a, dt_bias, state, slots, record, out, num_key_heads, scale):
        assert scale == state.shape[2] ** -0.5 and state.dtype == record.dtype == torch.float32
        o, rec = gdn_recurrent_emulated(mixed, b, a, neg_a, dt_bias, state, slots, num_key_heads)
        lanes, n = mixed.shape[:2]
        record[:n, :lanes] = rec
        out.copy_(o.to(out.dtype))
        calls.append((lanes, n))

    if not replay:
        return func

    def stash_func(mixed, b, a, neg_a, dt_bias, state, slots, stash, out, num_key_heads, scale):
        assert scale == state.shape[2] ** -0.5 and stash.dtype == torch.float32 and stash.dim() == 3
        o, st = gdn_stash_emulated(mixed, b, a, neg_a, dt_bias, state, slots, num_key_heads)
        lanes, n = mixed.shape[:2]
        stash[:n, :lanes] = st
        out.copy_(o.to(out.dtype))
        calls.append(("stash", lanes, n))

    def replay_func(stash, state, slots, keep, pos, num_key_heads):
        gdn_replay_emulated(stash, state, slots, keep, pos, num_key_heads)
        calls.append(("replay", keep.tolist()))

    return {"gdn_recurrent": func, "gdn_recurrent_stash": stash_func, "gdn_replay": replay_func}


@pytest.mark.parametrize("replay", [False, True])
def test_fused_gdn_module_path_matches_hybrid_executor(
    tiny: TinyHybrid, ref: HybridExecutor, replay: bool
) -> None:
    """The executor's kernel path (arguments, record or stash layout, slots, commit) with the
    kernel's CPU model in place of the module: rounds, every commit k, and the state after commit
    equal to feeding the committed tokens alone. replay: a module with the stash round and the
    commit's replay (no record allocated; one replay call a commit, every layer)."""
    from ignis.runtime.kernels.gdn_recurrent import GdnRecurrentKernel

    vocab = tiny.config.vocab_size
    st = static(tiny, max_lanes=3)
    calls: list = []
    st._gdn_kernel = GdnRecurrentKernel(_emulated_gdn_module(calls, replay))  # the setter wants CUDA
    st._gdn_buffers()
    assert (st._record is None) == replay and (st._stash is None) == (not replay)
    n_gdn = sum(not tiny.config.is_full_attention(i) for i in range(tiny.config.num_hidden_layers))
    head, cols = tokens(9, 17, vocab), tokens(8, 18, vocab)
    for keep in (0, 1, 3, 8):
        lane, other = st.new_lane(), st.new_lane()
        rl, ro = ref.new_lane(), ref.new_lane()
        run_both(ref, st, [rl, ro], [lane, other], [head, head[:4]], [9, 4], record=False)  # eager
        calls.clear()
        run_both(ref, st, [rl, ro], [lane, other], [cols, cols[:3]], [keep, 2])  # static: the kernel
        if replay:  # the lanes with keep 0 are not sent
            assert calls == [("stash", 2, 8)] * n_gdn + [("replay", [keep, 2] if keep else [2])]
        else:
            assert calls == [(2, 8)] * n_gdn
        expect = feed_alone(ref, torch.cat([head, cols[:keep]]))
        assert_same_state(tiny.config, lane, expect)
        nxt = tokens(4, 60 + keep, vocab)
        close(st.forward([lane], [nxt]).logits[0], ref.forward([expect], [nxt]).logits[0])
        st.commit([lane], [0])
        ref.commit([expect], [0])
        for s in (lane, other):
            st.release_lane(s)
    setter_wants_cuda(st, lambda **kw: static(tiny, **kw), "gdn_module", lambda: _emulated_gdn_module([]))


@pytest.mark.parametrize(("first", "second"), [("record", "replay"), (None, "replay"), ("replay", None)])
def test_gdn_round_buffer_swapped_mid_round(
    tiny: TinyHybrid, ref: HybridExecutor, first: str | None, second: str | None
) -> None:
    """A GDN recurrence swapped between a round's forward and its commit: the round commits from the
    buffer it ran with (its state equals feeding the kept tokens alone), and that buffer is freed
    once the round is settled (the record is 9.7 GB for the 27B at 8 x 8)."""
    from ignis.runtime.kernels.gdn_recurrent import GdnRecurrentKernel

    def swap(ex: StaticHybridExecutor, kind: str | None) -> None:  # the setter without its CUDA check
        ex._gdn_kernel = (
            None if kind is None else GdnRecurrentKernel(_emulated_gdn_module([], kind == "replay"))
        )
        ex._gdn_buffers()
        ex._graphs.clear()

    vocab = tiny.config.vocab_size
    st = static(tiny, max_lanes=2)
    swap(st, first)
    lane, rl = st.new_lane(), ref.new_lane()
    head, cols = tokens(6, 41, vocab), tokens(5, 42, vocab)
    run_both(ref, st, [rl], [lane], [head], [6], record=False)
    st.forward([lane], [cols])
    swap(st, second)
    assert st._record is not None or st._stash is not None  # kept for the open round
    st.commit([lane], [3])
    assert (st._record is None) == (second == "replay") and (st._stash is None) == (second != "replay")
    assert_same_state(tiny.config, lane, feed_alone(ref, torch.cat([head, cols[:3]])))
    nxt = tokens(4, 43, vocab)
    close(st.forward([lane], [nxt]).logits[0], ref.forward([rl], [torch.cat([cols[:3], nxt])]).logits[0][3:])


def _gdn_module_path() -> str | None:
    """$IGNIS_GDN_MODULE, else a build for this GPU's arch with nvcc, else None."""
    return module_path("IGNIS_GDN_MODULE", "gdn_recurrent", "build_gdn_recurrent")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_with_the_fused_gdn_kernel(tiny: TinyHybrid, dtype: torch.dtype) -> None:
    """On CUDA: static rounds with the compiled GDN kernel (graphed for qwen3_5; the MoE families run
    the static path eagerly, qwen3_next with strided b/a) give the static rounds without it and
    HybridExecutor's logits; every commit k leaves the state of feeding the kept tokens alone."""
    graphs = tiny.config.model_type == "qwen3_5"
    path = _gdn_module_path()
    if path is None:
        pytest.skip("no compiled GDN module ($IGNIS_GDN_MODULE) and no nvcc")
    vocab, c = tiny.config.vocab_size, tiny.config
    kw = cuda_kw(dtype)
    fused = StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), gdn_module=path, **kw)
    plain = StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), **kw)
    eager = HybridExecutor(tiny.config, tiny.canonical_tensors(), device="cuda", dtype=dtype)
    assert fused.cuda_graphs == plain.cuda_graphs == graphs and fused.gdn_module is not None
    same, tol = gpu_tolerances(dtype)
    exs = (fused, plain, eager)
    lanes = prefill_on_gpu(exs, vocab, 30)
    replays0 = fused.num_replays  # the prefill's chunks (graphed)
    shapes = [[1, 1, 1], [8, 3, 1], [8, 3, 1], [2, 8, 5], [8, 8, 8], [8, 3, 1], [8, 1, 8], [8, 8, 8]]
    keeps = [[1, 1, 1], [4, 3, 0], [8, 1, 1], [2, 8, 3], [0, 5, 6], [7, 2, 1], [3, 1, 8], [6, 4, 2]]
    gpu_rounds(exs, lanes, shapes, keeps, 300, vocab, same=same, tol=tol, hidden=False)
    if graphs:
        assert fused.num_replays - replays0 == len(shapes) and fused.num_captures >= 2
    for a, b, e in zip(*lanes, strict=True):
        states_agree(c, a, b, e, same=same, tol=tol, attn="", conv=False)
    # every commit k: the state equals feeding the committed tokens alone (eager, token by token)
    commit_every_k_on_gpu(fused, eager, c, vocab, range(9), 77, tol=tol, kv=False)
    # the attribute: set after captures, the graphs are recaptured with the kernel (and without)
    for module in (path, None):
        plain.gdn_module = module
        recaptured_matches(exs, lanes, vocab, 500, same)
        for ex, ls in zip(exs, lanes, strict=True):
            ex.commit(ls, [3, 2, 4])
    assert plain.gdn_module is None


def _emulated_norms_module(calls: list[str], *, extras: bool = True) -> dict:
    """A CPU stand-in for the compiled fused norms: the kernels' CPU models, writing the outputs
    the module's functions write (extras: with ``silu_mul`` and ``narrow_linear``, as modules built
    since session 10)."""
    from ignis.compiler.kernels.fused_norms import (
        add_rms_norm_emulated,
        gated_rms_norm_emulated,
        narrow_linear_emulated,
        silu_mul_emulated,
    )

    def add(h, d, w1p, h_out, x_out, eps):
        assert w1p.dtype == torch.float32 and h_out.shape == x_out.shape == h.shape
        a, b = add_rms_norm_emulated(h, d, w1p, eps)
        h_out.copy_(a)
        x_out.copy_(b)
        calls.append("add")

    def gated(x, z, w, out, eps):
        out.copy_(gated_rms_norm_emulated(x, z, w, eps))
        calls.append("gated")

    def silu_mul(gu, out):
        out.copy_(silu_mul_emulated(gu))
        calls.append("silu_mul")

    def narrow(x, w, y):
        y.copy_(narrow_linear_emulated(x, w))
        calls.append("narrow")

    funcs = {"add_rms_norm": add, "gated_rms_norm": gated}
    if extras:
        funcs.update(silu_mul=silu_mul, narrow_linear=narrow)
    return funcs


@pytest.mark.parametrize(("with_gdn", "extras"), [(False, True), (True, True), (True, False)])
def test_fused_norms_path_matches_hybrid_executor(
    tiny: TinyHybrid, ref: HybridExecutor, with_gdn: bool, extras: bool
) -> None:
    """The executor's fused-norms path (the MLP's add deferred to the next norm, taps and hidden
    states, the gated norm on either recurrence's output; with a module that has them, the dense
    MLPs' activation by ``silu_mul`` and the GDN b|a projections by ``narrow_linear``) with the
    kernels' CPU models: rounds, commits and states equal HybridExecutor's; eager forwards do not
    use it; a module without the extras runs the torch activation and projection."""
    from ignis.runtime.kernels.fused_norms import FusedNormsKernel
    from ignis.runtime.kernels.gdn_recurrent import GdnRecurrentKernel

    c = tiny.config
    vocab = c.vocab_size
    # the tensors copied out of the checkpoint's mapping: 16-byte aligned, as device weights are (a
    # view into the mapping may not be, and keeps torch's linear: test_takes_narrow_rules)
    aligned = {k: v.clone() for k, v in tiny.canonical_tensors().items()}
    st = StaticHybridExecutor(c, aligned, max_lanes=3, max_context=200, kv_bucket=16)
    calls: list[str] = []
    st._norms_kernel = FusedNormsKernel(_emulated_norms_module(calls, extras=extras))  # the setter wants CUDA
    assert st._norms_kernel.has_silu_mul == st._norms_kernel.has_narrow_linear == extras
    probe = torch.zeros(1, c.hidden_size, dtype=st.dtype)
    ba = [
        w
        for layer in st._layers
        if layer.gdn is not None
        for w in (layer.gdn.in_proj_b_a, layer.gdn.in_proj_b, layer.gdn.in_proj_a, layer.gdn.in_proj_ba)
        if w is not None
    ]
    narrow = len(ba)  # every family's b|a projections, qwen3_next's grouped in_proj_ba too
    assert all(FusedNormsKernel(_emulated_norms_module([])).takes_narrow(probe, w) for w in ba)
    if with_gdn:
        st._gdn_kernel = GdnRecurrentKernel(_emulated_gdn_module([]))
    n_gdn = sum(not c.is_full_attention(i) for i in range(c.num_hidden_layers))
    from ignis.runtime.families.moe import SparseMoeWeights

    dense = [not isinstance(layer.mlp, SparseMoeWeights) for layer in st._layers]
    layers = c.num_hidden_layers
    head, cols = tokens(9, 17, vocab), tokens(8, 18, vocab)
    for keep in (0, 3, 8):
        lane, other = st.new_lane(), st.new_lane()
        rl, ro = ref.new_lane(), ref.new_lane()
        calls.clear()
        run_both(ref, st, [rl, ro], [lane, other], [head, head[:4]], [9, 4], record=False)  # eager
        assert calls == []
        run_both(ref, st, [rl, ro], [lane, other], [cols, cols[:3]], [keep, 2])  # static: fused
        # per layer the post-mixer add; the MLP's add with the next norm (not after MoE blocks)
        adds = layers + sum(dense)
        assert calls.count("add") == adds and calls.count("gated") == n_gdn
        assert calls.count("silu_mul") == (sum(dense) if extras else 0)  # the dense MLPs' gate|up
        assert calls.count("narrow") == (narrow if extras else 0)  # the GDN b|a projections
        calls.clear()
        run_both(
            ref,
            st,
            [rl, ro],
            [lane, other],
            [cols[:2], cols[:5]],
            [1, 5],
            output_hidden_states=True,
            tap_layers=(0,),
        )
        assert calls.count("add") == layers + sum(dense) - dense[0]  # layer 0's MLP add is tapped
        expect = feed_alone(ref, torch.cat([head, cols[:keep], cols[:1]]))
        assert_same_state(c, lane, expect)
        for s in (lane, other):
            st.release_lane(s)
    setter_wants_cuda(st, lambda **kw: static(tiny, **kw), "norms_module", lambda: _emulated_norms_module([]))


def test_takes_narrow_rules() -> None:
    """`FusedNormsKernel.takes_narrow` sends narrow_linear only calls the kernel takes, where it beats
    cuBLAS: 1-16 rows, float32 / bfloat16 / float16, a dense non-empty weight of x's dtype with at
    most 1,024 rows, K and the row strides multiples of 16 bytes, 16-byte aligned data, a module
    that has the export."""
    from ignis.runtime.kernels.fused_norms import FusedNormsKernel
    from ignis.runtime.linear import Q4Weight

    norms = FusedNormsKernel(_emulated_norms_module([]))
    old = FusedNormsKernel(_emulated_norms_module([], extras=False))
    x, w = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(96, 64, dtype=torch.bfloat16)
    assert norms.takes_narrow(x, w) and not old.takes_narrow(x, w)
    assert norms.takes_narrow(torch.zeros(16, 64, dtype=torch.bfloat16), w)
    assert not norms.takes_narrow(torch.zeros(17, 64, dtype=torch.bfloat16), w)  # cuBLAS is faster
    assert not norms.takes_narrow(torch.zeros(0, 64, dtype=torch.bfloat16), w)
    assert not norms.takes_narrow(x.double(), w.double())
    assert not norms.takes_narrow(x, w.float())  # another dtype
    assert not norms.takes_narrow(x, torch.zeros(1025, 64, dtype=torch.bfloat16))
    assert not norms.takes_narrow(x, torch.zeros(0, 64, dtype=torch.bfloat16))
    assert not norms.takes_narrow(
        torch.zeros(8, 12, dtype=torch.bfloat16), torch.zeros(4, 12, dtype=torch.bfloat16)
    )
    buf = torch.zeros(96 * 64 + 8, dtype=torch.bfloat16)
    assert not norms.takes_narrow(x, buf[1 : 1 + 96 * 64].view(96, 64))  # 2 bytes off alignment
    assert not norms.takes_narrow(x, torch.zeros(96, 68, dtype=torch.bfloat16)[:, :64])  # 136-byte rows
    assert norms.takes_narrow(x, torch.zeros(96, 72, dtype=torch.bfloat16)[:, :64])  # 144-byte rows
    q4 = Q4Weight(torch.zeros(96, 8, dtype=torch.int32), torch.ones(96, 2, dtype=torch.float16))
    assert not norms.takes_narrow(x, q4)


def _norms_module_path() -> str | None:
    """$IGNIS_NORMS_MODULE, else a build for this GPU's arch with nvcc, else None."""
    return module_path("IGNIS_NORMS_MODULE", "fused_norms", "build_fused_norms")


def _norms_kernel_or_skip() -> Any:
    """The compiled norms module (`_norms_module_path`) as a `FusedNormsKernel`, or skip the test."""
    from ignis.runtime.kernels.fused_norms import FusedNormsKernel

    path = _norms_module_path()
    if path is None:
        pytest.skip("no compiled norms module ($IGNIS_NORMS_MODULE) and no nvcc")
    return FusedNormsKernel(path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_with_the_fused_norms(tiny: TinyHybrid, dtype: torch.dtype) -> None:
    """On CUDA: static rounds with the compiled norms (and the GDN kernel when available; graphed for
    qwen3_5) give the static rounds without them and HybridExecutor's logits; every commit k leaves
    the state of feeding the kept tokens alone."""
    graphs = tiny.config.model_type == "qwen3_5"
    path = _norms_module_path()
    if path is None:
        pytest.skip("no compiled norms module ($IGNIS_NORMS_MODULE) and no nvcc")
    gdn = _gdn_module_path()
    vocab, c = tiny.config.vocab_size, tiny.config
    kw = cuda_kw(dtype)
    fused = StaticHybridExecutor(
        tiny.config, tiny.canonical_tensors(), norms_module=path, gdn_module=gdn, **kw
    )
    plain = StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), gdn_module=gdn, **kw)
    eager = HybridExecutor(tiny.config, tiny.canonical_tensors(), device="cuda", dtype=dtype)
    assert fused.cuda_graphs == plain.cuda_graphs == graphs and fused.norms_module is not None
    same, tol = gpu_tolerances(dtype)
    exs = (fused, plain, eager)
    lanes = prefill_on_gpu(exs, vocab, 30)
    replays0 = fused.num_replays  # the prefill's chunks (graphed)
    shapes = [[1, 1, 1], [8, 3, 1], [8, 3, 1], [2, 8, 5], [8, 8, 8], [8, 1, 8]]
    keeps = [[1, 1, 1], [4, 3, 0], [8, 1, 1], [2, 8, 3], [0, 5, 6], [3, 1, 8]]
    gpu_rounds(exs, lanes, shapes, keeps, 300, vocab, same=same, tol=tol, hidden=True)
    if graphs:
        assert fused.num_replays - replays0 == len(shapes) and fused.num_captures >= 2
    for a, b, e in zip(*lanes, strict=True):
        states_agree(c, a, b, e, same=same, tol=tol, attn="k", conv=False)
    commit_every_k_on_gpu(fused, eager, c, vocab, (0, 1, 5, 8), 77, tol=tol, kv=False)
    plain.norms_module = path  # set after captures: recaptured with the norms
    recaptured_matches(exs, lanes, vocab, 500, same)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_add_rms_norm_matches_its_cpu_model(dtype: torch.dtype) -> None:
    """The compiled add_rms_norm against its CPU model (`add_rms_norm_emulated`: the kernel's order
    of operations) on rows kept in registers (hidden <= 8192), rows past that (the reloading loop),
    ragged widths and strided rows: the residual sum bit for bit, the normed row within 4 units in
    the last place of the dtype (CUDA's rsqrtf is not correctly rounded: up to 2.2 measured in float32,
    docs/perf/log run 43; a wrong or missing element would be off by far more)."""
    from ignis.compiler.kernels.fused_norms import add_rms_norm_emulated

    norms = _norms_kernel_or_skip()
    gen = torch.Generator().manual_seed(5)
    ulp = torch.finfo(dtype).eps
    for rows, hidden in [(1, 5120), (3, 100), (8, 8192), (2, 8193), (64, 4133), (5, 12288)]:
        wide = torch.randn(rows, hidden + 24, generator=gen) * 3
        h = wide[:, 7 : 7 + hidden].to(dtype)  # strided rows
        d = torch.randn(rows, hidden, generator=gen).to(dtype)
        w1p = 1 + torch.randn(hidden, generator=gen) * 0.1
        want_h, want_x = add_rms_norm_emulated(h, d, w1p, 1e-6)
        got_h, got_x = norms.add_rms_norm(h.cuda(), d.cuda(), w1p.cuda(), 1e-6)
        assert torch.equal(got_h.cpu(), want_h), (rows, hidden)
        err = (got_x.cpu().double() - want_x.double()).abs()
        assert bool((err <= 4 * ulp * want_x.double().abs() + 1e-30).all()), (rows, hidden, float(err.max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    """The compiled silu_mul equals torch's ``F.silu(gate) * up`` bit for bit: 16-byte rows (the
    vectorized path, the 27B's 17,408-wide MLP at 1-64 rows) and rows that are not (odd widths, a
    misaligned strided view: one element a thread)."""
    from ignis.compiler.kernels.fused_norms import silu_mul_reference

    norms = _norms_kernel_or_skip()
    assert norms.has_silu_mul
    gen = torch.Generator().manual_seed(9)
    for rows, inter, pad in [(1, 17408, 0), (8, 17408, 0), (64, 1024, 0), (3, 37, 0), (5, 96, 3), (2, 1, 1)]:
        wide = (torch.randn(rows, 2 * inter + pad + 5, generator=gen) * 4).to(dtype).cuda()
        gu = wide[:, pad : pad + 2 * inter]
        got = norms.silu_mul(gu)
        assert got.shape == (rows, inter) and got.dtype == dtype
        assert torch.equal(got, silu_mul_reference(gu)), (rows, inter, pad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_narrow_linear_matches_its_cpu_model(dtype: torch.dtype) -> None:
    """The compiled narrow_linear against its CPU model (`narrow_linear_emulated`: the kernel's order
    of float32 sums) within one unit in the last place of the dtype (the model's FMA is emulated in
    float64, one rounding step apart at worst), almost all equal, and against float64: the 27B's
    b|a shape at 1 / 8 / 64 rows, strided rows, one output feature, and a K past the weight chunks a
    thread loads at once (the loop). Misaligned rows are refused."""
    from ignis.compiler.kernels.fused_norms import narrow_linear_emulated

    norms = _norms_kernel_or_skip()
    assert norms.has_narrow_linear
    gen = torch.Generator().manual_seed(10)
    ulp = torch.finfo(dtype).eps
    cases = [(1, 96, 5120, 0), (8, 96, 5120, 8), (64, 96, 5120, 0), (9, 5, 1536, 16), (3, 1, 64, 0)]
    cases.append((2, 7, 16384, 0))
    for rows, n, k, pad in cases:
        x = torch.randn(rows, k + pad, generator=gen).to(dtype)[:, :k]
        w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
        xc = torch.zeros(rows, k + pad, dtype=dtype, device="cuda")
        xc[:, :k] = x.cuda()
        assert norms.takes_narrow(xc[:, :k], w.cuda()) == (rows <= 16)  # faster than cuBLAS there
        got = norms.narrow_linear(xc[:, :k], w.cuda()).cpu()
        want = narrow_linear_emulated(x, w)
        err = (got.double() - want.double()).abs()
        assert bool((err <= ulp * want.double().abs() + 1e-30).all()), (rows, n, k, float(err.max()))
        assert (got == want).float().mean() > 0.98
        exact = x.double() @ w.double().T
        bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + ulp * exact.abs()
        assert bool(((got.double() - exact).abs() <= bound + 1e-30).all())
    odd = torch.zeros(2, 12, dtype=torch.bfloat16, device="cuda")  # 24-byte rows
    assert not norms.takes_narrow(odd, torch.zeros(3, 12, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(ValueError, match="16 bytes"):
        norms.narrow_linear(odd, torch.zeros(3, 12, dtype=torch.bfloat16, device="cuda"))


def _mixers_module_or_skip() -> str:
    path = _mixers_module_path()
    if path is None:
        pytest.skip("no compiled mixers module ($IGNIS_MIXERS_MODULE) and no nvcc")
    return path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_gdn_conv_silu_matches_its_cpu_model(dtype: torch.dtype) -> None:
    """The compiled GDN conv1d + SiLU (a thread per channel, column and lane) against its CPU model at
    1-33 columns, 1-3 lanes in permuted slots and one slot out of range (a zero state), conv sizes 2
    and 4 (K - 1 = 1 or 3 state positions in a column's window), the 27B's 10,240 channels and odd
    counts: the windows bit for bit, the outputs within a unit in the last place in the half types
    (almost all equal) and four in float32 (CUDA's expf against the CPU's exp, then a division)."""
    from ignis.compiler.kernels.fused_mixers import gdn_conv_silu_emulated
    from ignis.runtime.kernels.fused_mixers import FusedMixersKernel

    mixers = FusedMixersKernel(_mixers_module_or_skip())
    gen = torch.Generator().manual_seed(12)
    ulp = torch.finfo(dtype).eps * (4 if dtype == torch.float32 else 1)
    cases = [(1, 1, 10240, 4), (1, 8, 10240, 4), (2, 9, 300, 2), (3, 17, 130, 4), (1, 32, 10240, 4)]
    cases += [(3, 33, 77, 2), (2, 1, 64, 2)]
    for lanes, n, ch, kk in cases:
        slots_n = 5
        qkv = torch.randn(lanes * n, ch, generator=gen).to(dtype)
        state = torch.randn(slots_n, ch, kk - 1, generator=gen).to(dtype)
        weight = (torch.randn(ch, kk, generator=gen) * 0.5).to(dtype)
        slots = torch.tensor([4, 0, 7][:lanes], dtype=torch.int64)  # 7: out of range, a zero state
        win_c = torch.zeros(lanes, ch, kk - 1 + n + 2, dtype=dtype, device="cuda")
        args = (qkv.cuda(), state.cuda(), slots.cuda(), weight.cuda(), win_c, lanes, n)
        got = mixers.gdn_conv_silu(*args).cpu()
        win = torch.zeros(lanes, ch, kk - 1 + n + 2, dtype=dtype)
        want = torch.empty(lanes, n, ch, dtype=dtype)
        gdn_conv_silu_emulated(qkv, state, slots, weight, win, want)
        assert torch.equal(win_c.cpu(), win), (lanes, n, ch, kk)
        if lanes == 3:
            assert not win[2, :, : kk - 1].any()  # the out-of-range slot's state positions are zeros
        err = (got.double() - want.double()).abs()
        assert bool((err <= ulp * want.double().abs() + 1e-30).all()), (lanes, n, ch, kk, float(err.max()))
        assert dtype == torch.float32 or (got == want).float().mean() > 0.99


def _emulated_mixers_module(calls: list[str]) -> dict:
    """A CPU stand-in for the compiled fused mixers: the kernels' CPU models, with the module's
    calling convention (outputs written in place)."""
    from ignis.compiler.kernels.fused_mixers import gdn_conv_silu_emulated, qk_norm_rope_kv_emulated

    def conv(qkv, state, slots, weight, windows, out):
        gdn_conv_silu_emulated(qkv, state, slots, weight, windows, out)
        calls.append("conv")

    def attn(q, k, v, wq, wk, cos, sin, pos, slots, kc, vc, q_out, eps):
        assert wq.dtype == wk.dtype == torch.float32 and q_out.shape == q.shape
        qk_norm_rope_kv_emulated(q, k, v, wq, wk, cos, sin, pos, slots, kc, vc, q_out, eps)
        calls.append("attn")

    return {"gdn_conv_silu": conv, "qk_norm_rope_kv": attn}


@pytest.mark.parametrize("with_others", [False, True])
def test_fused_mixers_path_matches_hybrid_executor(
    tiny: TinyHybrid, ref: HybridExecutor, with_others: bool
) -> None:
    """The executor's fused-mixers path (the GDN conv + window write, the q/k norms + RoPE + KV
    write) with the kernels' CPU models, alone or with the GDN and norms models: rounds, commits for
    every k and states equal HybridExecutor's and the executor's without them; eager forwards do not
    use it."""
    from ignis.runtime.kernels.fused_mixers import FusedMixersKernel
    from ignis.runtime.kernels.fused_norms import FusedNormsKernel
    from ignis.runtime.kernels.gdn_recurrent import GdnRecurrentKernel

    c = tiny.config
    vocab = c.vocab_size
    st, plain = static(tiny, max_lanes=3), static(tiny, max_lanes=3)
    calls: list[str] = []
    st._mixers_kernel = FusedMixersKernel(_emulated_mixers_module(calls))  # the setter wants CUDA
    if with_others:
        for ex in (st, plain):
            ex._gdn_kernel = GdnRecurrentKernel(_emulated_gdn_module([]))
            ex._norms_kernel = FusedNormsKernel(_emulated_norms_module([]))
    n_gdn = sum(not c.is_full_attention(i) for i in range(c.num_hidden_layers))
    n_attn = c.num_hidden_layers - n_gdn
    assert n_gdn and n_attn
    head, cols = tokens(9, 27, vocab), tokens(8, 28, vocab)
    for keep in range(9):
        lane, other = st.new_lane(), st.new_lane()
        pl, po = plain.new_lane(), plain.new_lane()
        rl, ro = ref.new_lane(), ref.new_lane()
        calls.clear()
        run_both(ref, st, [rl, ro], [lane, other], [head, head[:4]], [9, 4], record=False)  # eager
        plain.forward([pl, po], [head, head[:4]], record=False)
        plain.commit([pl, po], [9, 4])
        assert calls == []
        for shape, keeps in (((8, 3), (keep, 2)), ((2, 5), (min(keep, 2), 5)), ((1, 1), (1, 0))):
            columns = [cols[: shape[0]], cols[3 : 3 + shape[1]]]
            calls.clear()
            a = st.forward([lane, other], columns, output_hidden_states=True)
            b = plain.forward([pl, po], columns, output_hidden_states=True)
            assert calls.count("conv") == n_gdn and calls.count("attn") == n_attn
            for la, lb in zip(a.logits, b.logits, strict=True):
                close(la, lb)
            for ha, hb in zip(a.hidden_states, b.hidden_states, strict=True):
                close(ha, hb)
            e = ref.forward([rl, ro], columns)
            for la, le in zip(a.logits, e.logits, strict=True):
                close(la, le)
            for ex, ls in ((st, [lane, other]), (plain, [pl, po]), (ref, [rl, ro])):
                ex.commit(ls, list(keeps))
            for x, y, z in ((lane, pl, rl), (other, po, ro)):
                assert_same_state(c, x, y)
                assert_same_state(c, x, z)
        # the lane's state equals feeding the kept tokens alone
        expect = feed_alone(ref, torch.cat([head, cols[:keep], cols[: min(keep, 2)], cols[:1]]))
        assert_same_state(c, lane, expect)
        for s in (lane, other):
            st.release_lane(s)
        for s in (pl, po):
            plain.release_lane(s)
    setter_wants_cuda(
        st, lambda **kw: static(tiny, **kw), "mixers_module", lambda: _emulated_mixers_module([])
    )


def _emulated_attention_module(calls: list[str]) -> dict:
    """The mixers' CPU models plus ``gated_attention`` served by its oracle, with the module's calling
    convention (out written in place) and its workspace contract checked."""
    from ignis.compiler.kernels.fused_mixers import attention_split_keys, gated_attention_reference

    def attention(q, kc, vc, gate, pos, slots, out, ws_o, ws_ml, max_keys, split_keys, scale):
        rows, heads, hd = q.shape
        assert q.is_contiguous() and gate.stride(-1) == 1 and out.shape == (rows, heads * hd)
        assert int(pos.max()) < max_keys and split_keys == attention_split_keys(max_keys)
        splits = -(-max_keys // split_keys)
        assert ws_o.numel() == 0 if splits == 1 else ws_o.shape[2] == ws_ml.shape[2] == splits
        assert scale == hd**-0.5
        out.copy_(gated_attention_reference(q, kc, vc, gate, pos, slots))
        calls.append("gated_attention")

    return {**_emulated_mixers_module(calls), "gated_attention": attention}


def test_gated_attention_path_matches_the_sdpa_path(tiny: TinyHybrid) -> None:
    """bf16 static rounds whose attention runs through the module's ``gated_attention`` (served by its
    oracle) against the same rounds through SDPA: logits and the KV caches of later layers agree to
    bf16 rounding carried through the layers; a module without the export keeps SDPA."""
    from ignis.runtime.kernels.fused_mixers import FusedMixersKernel

    c = tiny.config
    vocab = c.vocab_size
    n_attn = sum(c.is_full_attention(i) for i in range(c.num_hidden_layers))
    bf = {"dtype": torch.bfloat16, "max_lanes": 3}
    st, plain = static(tiny, **bf), static(tiny, **bf)
    calls: list[str] = []
    st._mixers_kernel = FusedMixersKernel(_emulated_attention_module(calls))  # the setter wants CUDA
    plain._mixers_kernel = FusedMixersKernel(_emulated_mixers_module([]))
    assert st.mixers_module.has_gated_attention and not plain.mixers_module.has_gated_attention
    head, cols = tokens(9, 31, vocab), tokens(8, 32, vocab)
    lanes, pl = [st.new_lane(), st.new_lane()], [plain.new_lane(), plain.new_lane()]
    for ex, ls in ((st, lanes), (plain, pl)):
        ex.forward(ls, [head, head[:4]], record=False)
        ex.commit(ls, [9, 4])
    calls.clear()
    for shape, keeps in (((8, 3), (5, 2)), ((2, 5), (2, 5)), ((1, 1), (1, 0))):
        columns = [cols[: shape[0]], cols[3 : 3 + shape[1]]]
        calls.clear()
        a = st.forward(lanes, columns, output_hidden_states=True)
        b = plain.forward(pl, columns, output_hidden_states=True)
        assert calls.count("gated_attention") == n_attn
        for la, lb in zip(a.logits, b.logits, strict=True):  # bf16 rounding through the layers
            torch.testing.assert_close(la, lb, atol=0.15, rtol=0.05)
        st.commit(lanes, list(keeps))
        plain.commit(pl, list(keeps))
        for x, y in zip(lanes, pl, strict=True):
            assert x.num_tokens == y.num_tokens
            for layer in range(c.num_hidden_layers):
                if c.is_full_attention(layer):
                    for kx, ky in zip(x.kv(layer), y.kv(layer), strict=True):
                        torch.testing.assert_close(kx, ky, atol=0.15, rtol=0.05)


def _mixers_module_path() -> str | None:
    """$IGNIS_MIXERS_MODULE, else a build for this GPU's arch with nvcc, else None."""
    return module_path("IGNIS_MIXERS_MODULE", "fused_mixers", "build_fused_mixers")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("others", [False, True])
def test_cuda_graphs_with_the_fused_mixers(
    tiny: TinyHybrid, dtype: torch.dtype, others: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA: static rounds with the compiled mixers (alone, or with the GDN and norms kernels when
    available; graphed for qwen3_5) give the static rounds without them and HybridExecutor's logits;
    KV, conv and recurrent states agree after every round; every commit k leaves the state of
    feeding the kept tokens alone."""
    # the kernel's conv is plain float32: keep cuDNN's conv1d (the path it is compared with) off TF32
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    graphs = tiny.config.model_type == "qwen3_5"
    path = _mixers_module_path()
    if path is None:
        pytest.skip("no compiled mixers module ($IGNIS_MIXERS_MODULE) and no nvcc")
    mods = {"gdn_module": _gdn_module_path(), "norms_module": _norms_module_path()} if others else {}
    vocab, c = tiny.config.vocab_size, tiny.config
    kw = cuda_kw(dtype)
    fused = StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), mixers_module=path, **mods, **kw)
    plain = StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), **mods, **kw)
    eager = HybridExecutor(tiny.config, tiny.canonical_tensors(), device="cuda", dtype=dtype)
    assert fused.cuda_graphs == plain.cuda_graphs == graphs and fused.mixers_module is not None
    same, tol = gpu_tolerances(dtype)
    if dtype != torch.float32 and fused.mixers_module.has_gated_attention:
        # the fused attention rounds P to bf16 and sums in another order than cuDNN's SDPA: fused and
        # plain rounds agree to the tolerance both keep against the eager executor
        same = tol
    exs = (fused, plain, eager)
    lanes = prefill_on_gpu(exs, vocab, 40)
    replays0 = fused.num_replays  # the prefill's chunks (graphed)
    shapes = [[1, 1, 1], [8, 3, 1], [8, 3, 1], [2, 8, 5], [8, 8, 8], [8, 1, 8]]
    keeps = [[1, 1, 1], [4, 3, 0], [8, 1, 1], [2, 8, 3], [0, 5, 6], [3, 1, 8]]

    def states_after_the_round() -> None:
        for a, b, e in zip(*lanes, strict=True):
            states_agree(c, a, b, e, same=same, tol=tol, attn="kv", conv=True)

    gpu_rounds(
        exs,
        lanes,
        shapes,
        keeps,
        400,
        vocab,
        same=same,
        tol=tol,
        hidden=True,
        after_commit=states_after_the_round,
    )
    if graphs:
        assert fused.num_replays - replays0 == len(shapes) and fused.num_captures >= 2
    commit_every_k_on_gpu(fused, eager, c, vocab, range(9), 87, tol=tol, kv=True)
    plain.mixers_module = path  # set after captures: recaptured with the mixers
    recaptured_matches(exs, lanes, vocab, 600, same)


_ATTN_CASES = [  # (lanes, n, heads, kv_heads, hd, max_keys, pasts): 1 split, several, 16, 27B-shaped
    (3, 1, 4, 2, 32, 40, (0, 17, 39)),
    (2, 8, 4, 4, 64, 700, (5, 690)),
    (3, 5, 8, 2, 128, 300, (250, 3, 290)),
    (1, 32, 24, 4, 256, 96, (60,)),
    (2, 8, 24, 4, 256, 5000, (4990, 1200)),
    (1, 32, 24, 4, 256, 5000, (4900,)),  # 3 row groups x 16 splits
    (2, 4, 4, 2, 32, 700, (650, 300)),  # head_dim 32, 3 splits
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", _ATTN_CASES, ids=lambda c: f"L{c[0]}n{c[1]}h{c[2]}kv{c[3]}d{c[4]}k{c[5]}")
def test_compiled_gated_attention_matches_its_reference(dtype: torch.dtype, case: tuple) -> None:
    """The compiled ``gated_attention`` against its oracle (attention in float32 rounded once, the
    torch path's gate): one split, several and sixteen (the combine kernel), every head_dim, GQA
    groups of 1 to 6, 1 to 32 columns, lanes in permuted slots and one whose slot is out of range
    (zeros); a stale cache row past every position changes nothing; a captured graph replays it."""
    from ignis.runtime.kernels.fused_mixers import FusedMixersKernel

    path = _mixers_module_path()
    if path is None:
        pytest.skip("no compiled mixers module ($IGNIS_MIXERS_MODULE) and no nvcc")
    mixers = FusedMixersKernel(path)
    if not mixers.has_gated_attention:
        pytest.skip("this mixers module predates gated_attention")
    lanes, n, heads, kv, hd, max_keys, pasts = case
    rows, num_slots = lanes * n, lanes + 2
    gen = torch.Generator().manual_seed(hd + lanes * 7 + n)
    q = torch.randn(rows, heads, hd, generator=gen).to(dtype).cuda()
    kc = torch.randn(num_slots, max_keys + 8, kv, hd, generator=gen).to(dtype).cuda()
    vc = torch.randn(num_slots, max_keys + 8, kv, hd, generator=gen).to(dtype).cuda()
    gate = torch.randn(rows, heads, 2 * hd, generator=gen).to(dtype).cuda()[..., hd:]
    slots = torch.tensor([num_slots - 1 - i for i in range(lanes)], device="cuda")
    pos = torch.tensor(
        [min(p + c, max_keys - 1) for p in pasts for c in range(n)], dtype=torch.int64, device="cuda"
    )
    scale = hd**-0.5
    got = mixers.gated_attention(q, kc, vc, gate, pos, slots, max_keys, scale)
    want = gated_attention_reference_cpu(q, kc, vc, gate, pos, slots)
    tol = {"atol": 3e-2, "rtol": 3e-2} if dtype == torch.bfloat16 else {"atol": 4e-3, "rtol": 4e-3}
    torch.testing.assert_close(got.cpu(), want, **tol)
    # relative to the output's own size (long contexts average to small outputs, where an absolute
    # tolerance would let a dropped split pass): bf16 / f16 rounding of o, P and the gate
    rel = float((got.float().cpu() - want.float()).norm() / want.float().norm())
    assert rel < (1e-2 if dtype == torch.bfloat16 else 2e-3), rel
    # rows past every position and the slots no lane holds are never read (NaN there changes nothing)
    for cache in (kc, vc):
        cache[:, max_keys:] = float("nan")
        cache[0] = float("nan")
    again = mixers.gated_attention(q, kc, vc, gate, pos, slots, max_keys, scale)
    assert torch.equal(again, got)
    # an out-of-range slot reads no keys: zeros for its rows, the other lanes unchanged
    bad = slots.clone()
    bad[0] = num_slots + 3
    zero = mixers.gated_attention(q, kc, vc, gate, pos, bad, max_keys, scale)
    assert torch.all(zero[:n] == 0) and torch.equal(zero[n:], got[n:])
    # CUDA graph: captured once, replayed over new queries
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mixers.gated_attention(q, kc, vc, gate, pos, slots, max_keys, scale)  # warm-up outside capture
        with torch.cuda.graph(g):
            captured = mixers.gated_attention(q, kc, vc, gate, pos, slots, max_keys, scale)
    torch.cuda.current_stream().wait_stream(stream)
    q.copy_(torch.randn(rows, heads, hd, generator=gen).to(dtype))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, mixers.gated_attention(q, kc, vc, gate, pos, slots, max_keys, scale))


def gated_attention_reference_cpu(q, kc, vc, gate, pos, slots):
    """`gated_attention_reference` on the CPU copies (only the slots the lanes read)."""
    from ignis.compiler.kernels.fused_mixers import gated_attention_reference

    return gated_attention_reference(q.cpu(), kc.cpu(), vc.cpu(), gate.cpu(), pos.cpu(), slots.cpu())


class _Loaded(Exception):
    """Raised by `_RecordingSource.load` to stop `ignis-run` before it serves."""


class _RecordingSource:
    name = "rec"
    aliases: tuple[str, ...] = ()
    spec_kinds: tuple[str, ...] = ()
    profile = None
    settings: ClassVar[list] = []

    def missing_backend_reason(self, backend: str) -> str:
        return "none here"

    def load(self, settings):  # -> ServedModel; here: record and stop
        _RecordingSource.settings.append(settings)
        raise _Loaded


def recording_source() -> _RecordingSource:
    return _RecordingSource()


@pytest.mark.parametrize(
    ("flag", "expect"), [((), True), (("--no-cuda-graphs",), False), (("--cuda-graphs",), True)]
)
def test_ignis_run_passes_the_cuda_graphs_knob(flag: tuple[str, ...], expect: bool, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ignis.runtime import cli

    _RecordingSource.settings.clear()
    args = ["--model-factory", f"{__name__}:recording_source", "--socket", str(tmp_path / "s"), *flag]
    with pytest.raises(_Loaded):
        CliRunner().invoke(cli.main, args, catch_exceptions=False)
    (settings,) = _RecordingSource.settings
    assert settings.cuda_graphs is expect
