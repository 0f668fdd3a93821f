"""The cached round's host-time breakdown (`ignis.runtime.host_breakdown`) and the host-path cuts of
issue 22: sections that add up to the round, every MoE layer's host part marked, outputs unchanged
with the timer on, the reused address and table buffers, the lookahead prefetch queued before the
layer's launches, and one stream switch for the two grouped launches.

CUDA (marked gpu): `test_cuda_ids_wait_modes_return_the_ids` (the ids' spin / blocking / hybrid
waits), `test_cuda_graphed_pieces_timed_equal_untimed` (graphed pieces with the timer, each ids wait
and source order of the batched driver copy: tokens equal resident; needs the compiled grouped
kernels as `test_moe_grouped`'s GPU tests do: IGNIS_MOE_MODULE or nvcc)."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import torch
from hf_tiny_hybrid import make_tiny_hybrid
from test_moe_grouped import cuda_kernel  # noqa: F401 (the compiled grouped kernels' fixture, GPU tests)
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.expert_cache import ExpertCache
from ignis.runtime.expert_transfer import AddressBuffers, PartTable, RoutingBuffers
from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
from ignis.runtime.host_breakdown import SECTIONS, HostBreakdown
from ignis.runtime.linear import torch_linear
from ignis.runtime.sampling import SamplingParams


def test_laps_add_up_to_the_round_and_dropped_rounds_do_not_count() -> None:
    t = HostBreakdown()
    t.lap("piece")  # outside a round: ignored
    t.begin_round()
    t.layer()
    time.sleep(0.002)
    t.lap("piece")
    t.lap("lookup")
    t.end_round()
    rep = t.report()
    assert rep["rounds"] == 1 and rep["moe_layers_per_round"] == 1
    assert rep["ms_per_round"]["piece"] >= 2.0
    assert abs(sum(rep["ms_per_round"].values()) - rep["round_ms"]) < 0.01  # no gap between marks
    assert set(rep["calls_per_round"]) == {"piece", "lookup", "engine"}
    t.begin_round()
    t.layer()
    time.sleep(0.001)
    t.lap("launch")
    t.drop_round()  # e.g. a round that captured graphs
    t.lap("launch")
    assert t.report() == rep and "launch" not in t.report()["ms_per_round"]
    assert "section" in HostBreakdown.format(rep) and HostBreakdown.format({}) == "(no rounds counted)"
    t.reset()
    assert t.report() == {}


def test_cached_static_rounds_mark_every_layer_and_keep_their_outputs(tmp_path) -> None:
    """Split static rounds (1 slot a layer, misses by memmove) with the breakdown attached: greedy
    output equals the same cache without it; every MoE layer's host part is counted once a round and
    the host sections each layer meets are marked."""
    tiny = make_tiny_hybrid("qwen3_5_moe", tmp_path / "t")
    tensors = tiny.canonical_tensors()
    kw = dict(max_lanes=4, max_context=256)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    prompts = [[5, 17, 3, 99, 250, 7], list(range(30, 50))]
    outs = []
    for timed in (False, True):
        cache = ExpertCache(1, device="cpu", copies="memmove")
        timer = HostBreakdown()
        if timed:
            cache.set_breakdown(timer)  # before the layers exist: handed to the copier when made
        ex = StaticHybridExecutor(tiny.config, tensors, expert_cache=cache, **kw)
        assert ex._moe_pieces is not None and cache.layers
        engine = SpeculativeEngine(ex)
        tokens: dict[int, list[int]] = {engine.add_lane(p, greedy): [] for p in prompts}
        rounds = 0
        while engine.has_unfinished:
            timer.begin_round()
            for u in engine.step():
                tokens[u.lane_id] += u.new_token_ids
            timer.end_round()
            rounds += 1
        outs.append(list(tokens.values()))
        if timed:
            rep = timer.report()
            # every forward (prefill chunks, verify rounds) marks each MoE layer's host part once
            marked = round(rep["moe_layers_per_round"] * rounds)
            assert rep["rounds"] == rounds and marked == cache.stats.forwards * len(cache.layers)
            seen = set(rep["ms_per_round"])
            assert {"piece", "ids_copy", "lookup", "miss_gather", "miss_issue", "copy_wait", "table",
                    "launch", "last_use", "engine"} <= seen <= set(SECTIONS)  # fmt: skip
            # one ids copy per layer; one table and one launch mark per group, at least one a layer
            layers = rep["moe_layers_per_round"]
            assert rep["calls_per_round"]["ids_copy"] == layers
            assert rep["calls_per_round"]["launch"] == rep["calls_per_round"]["table"] >= layers
            assert abs(sum(rep["ms_per_round"].values()) - rep["round_ms"]) < 0.05
        else:
            rep = timer.report()  # not attached: no layer marked it, the round is all "engine"
            assert set(rep["ms_per_round"]) == {"engine"} and rep["moe_layers_per_round"] == 0
    assert outs[0] == outs[1]


def test_breakdown_does_not_change_tokens(tmp_path) -> None:
    """Greedy tokens through the split static rounds with the timer on equal those with it off."""
    tiny = make_tiny_hybrid("qwen3_next", tmp_path / "n")
    tensors = tiny.canonical_tensors()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    prompts = [[5, 17, 3, 99, 250, 7, 8, 41], [1, 2, 3]]
    got = []
    for timed in (False, True):
        cache = ExpertCache(2, device="cpu", copies="memmove", lookahead=True)
        if timed:
            cache.set_breakdown(HostBreakdown())
        ex = StaticHybridExecutor(tiny.config, tensors, max_lanes=4, max_context=256, expert_cache=cache)
        got.append([o.output_token_ids for o in SpeculativeEngine(ex).generate(prompts, greedy)])
    assert got[0] == got[1]


def test_gather_into_equals_gather_and_grows() -> None:
    host = [[torch.zeros(16, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)] for _ in range(6)]
    slots = [[torch.zeros(16, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)] for _ in range(3)]
    table = PartTable(host, slots)
    buf = AddressBuffers(capacity=2)
    for experts, where in (([4, 1], [0, 2]), ([0, 1, 2, 5, 3], [2, 1, 0, 0, 1]), ([3], [1])):
        n = table.gather_into(experts, where, buf)
        dst, src, sizes = table.gather(experts, where)
        assert n == len(dst)
        assert np.array_equal(buf.dst[:n], dst) and np.array_equal(buf.src[:n], src)
        assert np.array_equal(buf.sizes[:n], sizes)
        assert buf.dst_ptr == buf.dst.ctypes.data and buf.sizes_ptr == buf.sizes.ctypes.data


def test_slot_tables_of_successive_groups_do_not_leak() -> None:
    """The expert -> slot table is reused from group to group: a group's table names only its own
    experts (the previous group's entries are cleared)."""
    r = RoutingBuffers(torch.device("cpu"))
    host = r.to_host(torch.tensor([[3, 1], [1, 4], [5, 0]]))
    _, first = r.slot_ids(0, 6, [(0, 1), (1, 0), (3, 2)], host)
    assert first.tolist() == [[2, 0], [0, -1], [-1, 1]]
    _, second = r.slot_ids(1, 6, [(4, 0), (5, 1)], host)
    assert second.tolist() == [[-1, -1], [-1, 0], [1, -1]]
    _, empty = r.slot_ids(2, 6, [], host)
    assert empty.tolist() == [[-1, -1]] * 3


def test_bad_ids_wait_is_refused() -> None:
    with pytest.raises(ValueError, match="ids_wait"):
        ExpertCache(2, device="cpu", ids_wait="nap")
    with pytest.raises(ValueError, match="ids_wait"):
        RoutingBuffers(torch.device("cpu"), ids_wait="nap")


def test_lookahead_prefetch_is_queued_before_the_layers_launches(tmp_path, monkeypatch) -> None:
    """With router lookahead the next layer's prefetch is issued after this layer's misses and before
    its expert launches (so the copy stream gets it as early as the host can give it)."""
    import ignis.runtime.expert_cache as ec
    import ignis.runtime.families.moe_grouped as mg

    log: list[str] = []
    real_prefetch, real_run, real_batch = ec.ExpertSlots.prefetch, mg._run_pairs, ec._Copier.copy_batch

    def prefetch(self, experts):
        log.append(f"prefetch{self.index}")
        return real_prefetch(self, experts)

    def run_pairs(x, ids, ids_host, route_w, g, y, linear):
        log.append(f"launch{g.slots.index}")
        return real_run(x, ids, ids_host, route_w, g, y, linear)

    def copy_batch(self, table, misses, after):
        log.append("copy")
        return real_batch(self, table, misses, after)

    monkeypatch.setattr(ec.ExpertSlots, "prefetch", prefetch)
    monkeypatch.setattr(mg, "_run_pairs", run_pairs)
    monkeypatch.setattr(ec._Copier, "copy_batch", copy_batch)
    tiny = make_tiny_hybrid("qwen3_5_moe", tmp_path / "t")
    cache = ExpertCache(tiny.config.num_experts, device="cpu", copies="memmove", lookahead=True)
    ex = StaticHybridExecutor(tiny.config, tiny.canonical_tensors(), max_lanes=2, max_context=128,
                              expert_cache=cache)  # fmt: skip
    SpeculativeEngine(ex).generate([[5, 17, 3]], SamplingParams(temperature=0, max_tokens=2))
    moe = len(cache.layers)
    assert moe >= 2
    for i in range(moe - 1):  # layer i: its launches come after the prefetch into layer i + 1
        assert f"prefetch{i + 1}" in log
        first_prefetch = log.index(f"prefetch{i + 1}")
        assert log.index(f"launch{i}") > first_prefetch


def test_grouped_launches_share_one_stream_switch(monkeypatch) -> None:
    """`MoeExpertsKernel.swiglu_experts` on CUDA tensors enters tvm-ffi's stream context once for its
    two launches (each `_call` alone enters its own)."""
    import ignis.runtime.kernels.tvm_runtime as tr
    from ignis.runtime.kernels.moe_experts import MoeExpertsKernel

    entered: list[int] = []

    @contextlib.contextmanager
    def torch_stream(context=None):
        entered.append(1)
        yield

    monkeypatch.setattr(tr, "torch_stream", torch_stream)
    calls: list[str] = []
    kernel = MoeExpertsKernel({
        "moe_q4_gate_up": lambda *a: calls.append("gate_up"),
        "moe_q4_down": lambda *a: calls.append("down"),
    })  # fmt: skip

    class _Cuda:  # a tensor stand-in that says it is on CUDA
        is_cuda = True
        shape = (1, 2)

        def new_empty(self, shape):
            return self

    class _Stack:
        out_features, packed, scales = 4, None, None

    x = _Cuda()
    kernel.swiglu_experts(x, x, _Stack(), _Stack(), x, x)
    assert calls == ["gate_up", "down"] and entered == [1]
    kernel._call("moe_q4_down", (), True)
    assert entered == [1, 1] and not kernel._on_stream


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["spin", "block", "hybrid"])
def test_cuda_ids_wait_modes_return_the_ids(mode: str) -> None:
    r = RoutingBuffers(torch.device("cuda"), ids_wait=mode, spin_us=5)
    for n in (1, 8, 64):
        ids = torch.randint(0, 256, (n, 8), device="cuda")
        torch.cuda._sleep(1_000_000)  # the copy queued behind ~1 ms of work: the wait really waits
        assert r.to_host(ids).tolist() == ids.cpu().tolist()
    assert r.wait_seconds > 0


def test_driver_batch_source_order() -> None:
    """The batched copy's source access order is one attribute the driver call reads: "stream" by
    default, "any" on request (the bench's --source-order); others are refused."""
    from ignis.runtime.expert_transfer import DriverBatchCopy, _MemcpyAttributes

    dma = DriverBatchCopy.__new__(DriverBatchCopy)  # no libcuda here: only the attribute block
    dma._attrs = _MemcpyAttributes(srcAccessOrder=1)
    dma.set_source_order("any")
    assert dma._attrs.srcAccessOrder == 3 and dma.source_order == "any"
    dma.set_source_order("stream")
    assert dma._attrs.srcAccessOrder == 1
    with pytest.raises(ValueError, match="source order"):
        dma.set_source_order("never")


def test_piece_runs_the_shared_expert_before_the_routing(monkeypatch) -> None:
    """A piece's device part ends with the routing (the ids written last), so the ids' copy to the
    host queued after it does not wait for the shared expert; the values are the same."""
    import ignis.runtime.families.moe_piecewise as mp
    from ignis.runtime.families.moe_piecewise import MoeRoundBuffers, PiecewiseMoe

    order: list[str] = []
    real_route, real_shared = mp.route_top_k, mp.shared_expert_output
    monkeypatch.setattr(mp, "route_top_k", lambda *a, **k: order.append("route") or real_route(*a, **k))
    monkeypatch.setattr(
        mp, "shared_expert_output", lambda *a, **k: order.append("shared") or real_shared(*a, **k)
    )
    from test_expert_transfer import _block

    w = _block(3)
    buffers = MoeRoundBuffers(4, w.router.shape[1], 3, device=torch.device("cpu"), dtype=torch.float32)
    pieces = PiecewiseMoe(top_k=3, norm_topk_prob=True, linear=torch_linear, buffers=buffers)
    x = torch.randn(2, w.router.shape[1])
    shared = pieces.route(x, w)
    assert order == ["shared", "route"]
    assert torch.equal(shared, real_shared(x, w, linear=torch_linear))
    want_w, want_i = real_route(x, w.router, top_k=3, norm_topk_prob=True, linear=torch_linear)
    assert torch.equal(buffers.ids[:2], want_i) and torch.equal(buffers.weights[:2], want_w.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("ids_wait", "order"), [("spin", "stream"), ("hybrid", "any"), ("block", "stream")])
def test_cuda_graphed_pieces_timed_equal_untimed(ids_wait: str, order: str, cuda_kernel, tmp_path) -> None:  # noqa: F811
    """The graphed piecewise rounds on CUDA (1 slot a layer, batched driver copies, the compiled
    grouped kernels) with the breakdown attached, under each ids wait and source order: greedy tokens
    equal the resident executor's, and the driver path's sections (deps, issue, event) are marked."""
    import test_moe_grouped as tmg

    from ignis.runtime.expert_transfer import driver_batch_copy

    kernel = cuda_kernel
    tiny = make_tiny_hybrid("qwen3_5_moe", tmp_path / "t")
    tensors = tmg._q4_experts(tiny.canonical_tensors())
    dev = torch.device("cuda")
    kw = dict(device=dev, dtype=torch.bfloat16, linear=torch_linear, max_lanes=4, max_context=256)
    greedy = SamplingParams(temperature=0, max_tokens=10)
    text = [[5, 17, 3, 99, 250, 7, 8, 41], list(range(30, 60))]
    resident = StaticHybridExecutor(tiny.config, tensors, moe_module=kernel, **kw)
    want = [list(o.output_token_ids) for o in SpeculativeEngine(resident).generate(text, greedy)]
    dma = driver_batch_copy()
    assert dma is not None
    try:
        dma.set_source_order(order)
        cache = ExpertCache(1, device=dev, ids_wait=ids_wait)
        timer = HostBreakdown()
        cache.set_breakdown(timer)
        ex = StaticHybridExecutor(tiny.config, tensors, moe_module=kernel, expert_cache=cache, **kw)
        assert ex.piecewise_graphs and all(layer.batched for layer in cache.layers)
        engine = SpeculativeEngine(ex)
        tokens: dict[int, list[int]] = {engine.add_lane(p, greedy): [] for p in text}
        while engine.has_unfinished:
            timer.begin_round()
            for u in engine.step():
                tokens[u.lane_id] += u.new_token_ids
            timer.end_round()
        assert list(tokens.values()) == want
        rep = timer.report()
        assert {"piece", "ids_copy", "ids_wait", "miss_issue", "miss_event", "launch"} <= set(
            rep["ms_per_round"]
        )
        cache.close()
    finally:
        dma.set_source_order("stream")
