"""Static rounds of a MoE hybrid with an expert cache split at the MoE syncs
(`ignis.runtime.families.moe_piecewise`): on the CPU the split runs eagerly (the same pieces the CUDA
graphs capture), and its rounds equal the resident static executor's bit for bit.

CUDA (marked gpu, in tests/runtime/test_moe_grouped.py):
`test_cuda_piecewise_cached_rounds_equal_eager_and_resident`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import ClassVar

import pytest
import torch
from hf_tiny_hybrid import make_tiny_hybrid
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.expert_cache import ExpertCache, ExpertCacheStats, ExpertSlots
from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
from ignis.runtime.families.moe import SparseMoeWeights, SwiGLUWeights
from ignis.runtime.families.moe_grouped import GroupedExperts
from ignis.runtime.families.moe_piecewise import MoeRoundBuffers, PiecewiseMoe, piecewise_layers


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("num_slots", [1, 2])
def test_split_static_rounds_equal_resident(family: str, num_slots: int, tmp_path) -> None:
    """A prompt (chunked static rounds) then verify rounds of 3 lanes: every logit equal to the
    resident static executor's, lane states equal after commit; each MoE layer of each static round
    went through the split's host part."""
    tiny = make_tiny_hybrid(family, tmp_path / family)
    tensors = tiny.canonical_tensors()
    kw = dict(max_lanes=4, max_context=256, chunked_prefill=32)
    ref = StaticHybridExecutor(tiny.config, tensors, **kw)
    cache = ExpertCache(num_slots, device="cpu")
    ex = StaticHybridExecutor(tiny.config, tensors, expert_cache=cache, **kw)
    assert ref._moe_pieces is None and ex._moe_pieces is not None and not ex.piecewise_graphs
    calls = []
    real = ex._moe_pieces.experts
    ex._moe_pieces.experts = lambda w, rows: (calls.append(rows), real(w, rows))[1]  # type: ignore[method-assign]
    moe_layers = sum(isinstance(layer.mlp, SparseMoeWeights) for layer in ex._layers)
    g = torch.Generator().manual_seed(3)
    lanes_ref = [ref.new_lane() for _ in range(3)]
    lanes = [ex.new_lane() for _ in range(3)]
    prompts = [torch.tensor([5, 17, 3, 99, 250, 7, 8, 41]), torch.arange(30, 50), torch.tensor([1, 2, 3])]
    for record, cols in ((False, prompts), (True, None), (True, None), (True, None)):
        if cols is None:
            cols = [torch.randint(0, tiny.config.vocab_size, (4,), generator=g) for _ in lanes]
        want = ref.forward(lanes_ref, cols, record=record)
        got = ex.forward(lanes, cols, record=record)
        for a, b in zip(got.logits, want.logits, strict=True):
            assert torch.equal(a, b)
        keep = [c.numel() for c in cols] if not record else [1, 4, 2]
        ref.commit(lanes_ref, keep)
        ex.commit(lanes, keep)
    for a, b in zip(lanes, lanes_ref, strict=True):
        assert a.num_tokens == b.num_tokens
        for layer in range(tiny.config.num_hidden_layers):
            if tiny.config.is_full_attention(layer):
                assert all(torch.equal(x, y) for x, y in zip(a.kv(layer), b.kv(layer), strict=True))
            else:
                assert torch.equal(a.recurrent_state(layer), b.recurrent_state(layer))
    # the prompts (8, 20 and 3 columns) in chunks of 8: 3 lanes x 8, then 1 x 8, then 1 x 4 (the
    # width holding the last 4); then 3 verify rounds of 3 lanes x 4
    assert calls == [24] * moe_layers + [8] * moe_layers + [4] * moe_layers + [12] * 3 * moe_layers
    assert cache.stats.misses > len(cache.layers) * tiny.config.num_experts


def test_piecewise_layers_needs_a_cache_on_every_moe_layer() -> None:
    w = torch.zeros(2, 2)
    dense = SwiGLUWeights(w, w, w)
    moe = SparseMoeWeights(w, [dense, dense], dense, w)
    cached = dataclasses.replace(moe, grouped=GroupedExperts(w, w, slots=object()))
    resident = dataclasses.replace(moe, grouped=GroupedExperts(w, w))
    assert piecewise_layers([dense, cached]) and piecewise_layers([cached, cached])
    assert not piecewise_layers([dense, dense]) and not piecewise_layers([cached, resident])
    assert not piecewise_layers([cached, moe])


def test_quiet_puts_the_counters_back() -> None:
    stats = ExpertCacheStats()
    stats.trace = [(0, (1,))]
    stats.hits, stats.misses = 3, 4
    buffers = MoeRoundBuffers(2, 4, 1, device=torch.device("cpu"), dtype=torch.float32)
    pieces = PiecewiseMoe(top_k=1, norm_topk_prob=True, linear=None, buffers=buffers, stats=stats)
    with pieces.quiet():
        stats.hits += 10
        stats.misses += 10
        stats.forwards += 1
        stats.trace.append((1, (2,)))
        stats.prefetch_trace.append((2, 1, (3,)))
    assert (stats.hits, stats.misses, stats.forwards, stats.trace) == (3, 4, 0, [(0, (1,))])
    assert stats.prefetch_trace == []


# ---------------------------------------------------------------------------------------------
# router lookahead
# ---------------------------------------------------------------------------------------------


def test_prefetch_fills_slots_ahead_and_a_lookup_waits_for_it() -> None:
    """`ExpertSlots.prefetch`: predicted experts copied into LRU slots (after the slots' last use);
    the next lookup finds them (hits) and waits for the prefetch's copy; recall is scored."""
    from test_expert_cache import _experts, _RecordingCopier

    host = _experts(6, 32, 16, seed=21)
    copier = _RecordingCopier()
    stats = ExpertCacheStats()
    slots = ExpertSlots(host, 2, device=torch.device("cpu"), copier=copier, stats=stats, first=True)
    list(slots.slot_groups([0, 1], rows=1))  # copies 1, 2; used 3
    copier.log.clear()
    assert slots.prefetch([1, 4]) == 1  # 1 is resident already; 4 evicts 0 (LRU)
    assert copier.log == [("copy", 4, ("used", 3))]
    assert slots.resident == {1: 1, 4: 0}
    copier.log.clear()
    for group in slots.slot_groups([4, 5], rows=1):
        assert sorted(e for e, _ in group) == [4, 5]
    # 5 misses (evicts 1); 4 is a hit that waits for the prefetch copy
    assert ("wait", ("copy", 4)) in copier.log and copier.log[0] == ("copy", 5, ("used", 3))
    assert (stats.hits, stats.misses, stats.prefetches) == (1, 3, 1)
    assert stats.bytes_copied == 4 * slots.expert_bytes
    assert stats.lookahead_recall == 0.5  # predicted {1, 4}, needed {4, 5}
    copier.log.clear()
    list(slots.slot_groups([4], rows=1))  # the prefetch was waited for: no second wait on it
    assert ("wait", ("copy", 4)) not in copier.log


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("copies", ["memmove", "torch"])
def test_lookahead_rounds_equal_resident(family: str, copies: str, tmp_path) -> None:
    """Router lookahead on (2 slots a layer): greedy output equals the resident static executor's;
    experts were prefetched and lookups found some of them."""
    from ignis.runtime.engine import SpeculativeEngine
    from ignis.runtime.sampling import SamplingParams

    tiny = make_tiny_hybrid(family, tmp_path / family)
    tensors = tiny.canonical_tensors()
    kw = dict(max_lanes=4, max_context=256, chunked_prefill=32)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    prompts = [[5, 17, 3, 99, 250, 7, 8, 41], list(range(30, 60)), [1, 2, 3]]
    ref = StaticHybridExecutor(tiny.config, tensors, **kw)
    want = [o.output_token_ids for o in SpeculativeEngine(ref).generate(prompts, greedy)]
    cache = ExpertCache(2, device="cpu", copies=copies, lookahead=True)
    ex = StaticHybridExecutor(tiny.config, tensors, expert_cache=cache, **kw)
    assert ex._moe_pieces is not None and ex._moe_pieces.next_layer
    got = [o.output_token_ids for o in SpeculativeEngine(ex).generate(prompts, greedy)]
    assert got == want
    st = cache.stats
    assert st.prefetches > 0 and st.lookahead_needed > 0 and 0 < st.lookahead_recall <= 1
    assert st.bytes_copied == (st.misses + st.prefetches) * cache.layers[0].expert_bytes


def test_lookahead_replays_to_the_measured_hits(tmp_path) -> None:
    """A run with lookahead records its prefetches beside the routing trace; `simulate_policy` with
    them replays to the run's own hits and misses (so the same trace without them is what LRU alone
    would have got: the A/B the benchmark reports)."""
    from ignis.runtime.engine import SpeculativeEngine
    from ignis.runtime.expert_cache import simulate_policy
    from ignis.runtime.sampling import SamplingParams

    tiny = make_tiny_hybrid("qwen3_5_moe", tmp_path / "t")
    cache = ExpertCache(3, device="cpu", copies="memmove", lookahead=True)
    cache.stats.trace = []
    ex = StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), max_lanes=4, max_context=256,
                              expert_cache=cache)  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=8)
    SpeculativeEngine(ex).generate([[5, 17, 3, 99], list(range(30, 45)), [1, 2, 3]], greedy)
    st = cache.stats
    assert st.prefetch_trace and st.prefetches > 0
    sim = simulate_policy(st.trace, 3, "lru", prefetch=st.prefetch_trace)
    assert (sim["hits"], sim["misses"], sim["prefetches"]) == (st.hits, st.misses, st.prefetches)
    plain = simulate_policy(st.trace, 3, "lru")
    assert plain["hits"] + plain["misses"] == st.hits + st.misses and "prefetches" not in plain


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: logs capture_begin / capture_end / replay."""

    log: ClassVar[list[tuple[str, int]]] = []
    count = 0

    def __init__(self) -> None:
        _FakeGraph.count += 1
        self.n = _FakeGraph.count

    def capture_begin(self, pool=None) -> None:
        _FakeGraph.log.append(("begin", self.n))

    def capture_end(self) -> None:
        _FakeGraph.log.append(("end", self.n))

    def replay(self) -> None:
        _FakeGraph.log.append(("replay", self.n))


def test_capture_cuts_at_every_moe_layer_and_replay_interleaves_the_host_parts(monkeypatch) -> None:
    """The capture's control flow without a GPU (graphs and streams stood in): one warm-up pass of
    the pieces without host parts, then one graph per piece (cut where the body reaches a MoE
    layer), captures properly nested; replay runs piece, host part, ..., last piece, in order; a
    failing body ends the open capture and raises."""
    import ignis.runtime.families.moe_piecewise as mp

    class _Stream:
        def wait_stream(self, other) -> None:
            pass

    monkeypatch.setattr(mp.torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(mp.torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(mp, "_on_stream", lambda stream: contextlib.nullcontext())
    _FakeGraph.log, _FakeGraph.count = [], 0
    buffers = MoeRoundBuffers(4, 8, 2, device=torch.device("cpu"), dtype=torch.float32)
    pieces = PiecewiseMoe(top_k=2, norm_topk_prob=True, linear=None, buffers=buffers)
    layers = [object(), object(), object()]
    calls: list[tuple[str, object]] = []
    pieces.route = lambda x, w: calls.append(("route", w)) or x  # type: ignore[method-assign]
    pieces.combine = lambda shared: calls.append(("combine", None)) or shared  # type: ignore[method-assign]
    pieces.experts = lambda w, rows: _FakeGraph.log.append(("host", layers.index(w)))  # type: ignore[method-assign]

    def body(moe):
        x = torch.zeros(4, 8)
        for w in layers:
            x = x + moe(x, w)
        return {"logits": x}

    entry = pieces.capture(body, rows=4, device=torch.device("cpu"), pool=None, stream=_Stream())
    assert calls == [("route", w) if i % 2 == 0 else ("combine", None)
                     for w in layers for i in range(2)] * 2  # fmt: skip (warm-up, then the capture)
    assert [g.n for g in entry.graphs] == [1, 2, 3, 4] and entry.layers == layers
    assert _FakeGraph.log == [(op, n) for n in (1, 2, 3, 4) for op in ("begin", "end")]
    _FakeGraph.log.clear()
    assert pieces.replay(entry) is entry.outputs
    assert _FakeGraph.log == [("replay", 1), ("host", 0), ("replay", 2), ("host", 1), ("replay", 3),
                              ("host", 2), ("replay", 4)]  # fmt: skip
    _FakeGraph.log.clear()

    passes: list[int] = []

    def broken(moe):  # the warm-up pass runs; the capture pass fails after its first cut
        passes.append(1)
        moe(torch.zeros(4, 8), layers[0])
        if len(passes) == 2:
            raise RuntimeError("capture refused")
        return {}

    with pytest.raises(RuntimeError, match="capture refused"):
        pieces.capture(broken, rows=4, device=torch.device("cpu"), pool=None, stream=_Stream())
    assert _FakeGraph.log == [("begin", 5), ("end", 5), ("begin", 6), ("end", 6)]  # the open one ended
    with pytest.raises(ValueError, match="MoE buffers hold 4"):
        pieces.capture(body, rows=5, device=torch.device("cpu"), pool=None, stream=_Stream())
