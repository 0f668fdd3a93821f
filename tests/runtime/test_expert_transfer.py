"""Batched expert misses (`ignis.runtime.expert_transfer`): the address plan, its merging, the batched
copy path of `ExpertSlots` (run by ``memmove`` on the CPU: the same plan the CUDA driver gets), the
preallocated routing buffers, and the executors' output through that path equal to resident.

CUDA (marked gpu): `test_cuda_driver_batch_fills_reused_slots` (cuMemcpyBatchAsync into slots
reused over several batches: bytes equal the host bytes), `test_cuda_cached_block_batched_equals_resident`.
"""

from __future__ import annotations

import ctypes
import dataclasses

import numpy as np
import pytest
import torch
from hf_tiny_hybrid import make_tiny_hybrid
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.formats import quantize_q4_g32
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.expert_cache import ExpertCache, ExpertSlots, host_experts
from ignis.runtime.expert_transfer import HostMemmove, PartTable, RoutingBuffers
from ignis.runtime.families.hybrid_executor import HybridExecutor
from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
from ignis.runtime.families.moe import SparseMoeWeights, SwiGLUWeights, sparse_moe_block
from ignis.runtime.families.moe_grouped import GroupedExperts, stack_experts
from ignis.runtime.linear import Q4Weight, torch_linear
from ignis.runtime.sampling import SamplingParams

HIDDEN, INTER, EXPERTS = 64, 32, 8


def _q4(rows: int, cols: int, g: torch.Generator, lead: int = 0) -> Q4Weight:
    t = torch.randn(max(lead, 1) * rows, cols, generator=g) * 0.2
    packed, scales = quantize_q4_g32(t.numpy())
    p, s = torch.from_numpy(packed), torch.from_numpy(scales)
    if lead:
        p, s = p.reshape(lead, rows, -1), s.reshape(lead, rows, -1)
    return Q4Weight(p, s)


def _fused_host(g: torch.Generator) -> list[SwiGLUWeights]:
    """Experts as an artifact hands them over: views of fused stacks ([E, 2 I, H] gate|up, [E, H, I])."""
    gate_up, down = _q4(2 * INTER, HIDDEN, g, EXPERTS), _q4(HIDDEN, INTER, g, EXPERTS)
    weights = {"p.experts.gate_up_proj": gate_up, "p.experts.down_proj": down}
    config = type("C", (), {"moe_intermediate_size": INTER, "num_experts": EXPERTS})()
    return host_experts(config, weights, "p", dtype=torch.float32)


def _slot_bytes(slots: ExpertSlots, slot: int) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for t in _slot_parts(slots, slot)]


def _slot_parts(slots: ExpertSlots, slot: int) -> list[torch.Tensor]:
    return [d(slot) for d in slots._dst]


def _host_bytes(w: SwiGLUWeights) -> list[bytes]:
    out = []
    for f in ("gate", "up", "down"):
        v = getattr(w, f)
        out += [v.packed.contiguous().view(torch.uint8).numpy().tobytes(),
                v.scales.contiguous().view(torch.uint8).numpy().tobytes()]  # fmt: skip
    return out


def test_part_table_merges_adjacent_parts_and_gathers_addresses() -> None:
    """Fused stacks into stacked slots: gate's and up's codes (and scales) lie back to back on both
    sides, so a miss is 4 copies (gate|up codes, gate|up scales, down codes, down scales), not 6."""
    g = torch.Generator().manual_seed(1)
    host = _fused_host(g)
    cache = ExpertCache(3, device="cpu", copies="memmove")
    slots = cache.make_layer(host, linear=torch_linear, stacked=True)
    table = slots._table
    assert isinstance(table, PartTable) and table.num_parts == 4
    assert table.expert_bytes == slots.expert_bytes == int(table.sizes.sum())
    dst, src, sizes = table.gather([5, 2], [0, 2])
    assert dst.dtype == src.dtype == sizes.dtype == np.uint64 and dst.shape == (8,)
    gate_up, down = slots.stacks()
    copies = set(zip(dst.tolist(), src.tolist(), sizes.tolist(), strict=True))

    def nb(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    for e, s in ((5, 0), (2, 2)):  # gate's and up's rows in one copy; down's codes and scales
        assert (gate_up.packed[s].data_ptr(), host[e].gate.packed.data_ptr(), nb(gate_up.packed[s])) in copies
        assert (gate_up.scales[s].data_ptr(), host[e].gate.scales.data_ptr(), nb(gate_up.scales[s])) in copies
        assert (down.packed[s].data_ptr(), host[e].down.packed.data_ptr(), nb(down.packed[s])) in copies
        assert (down.scales[s].data_ptr(), host[e].down.scales.data_ptr(), nb(down.scales[s])) in copies
    # separate tensors per expert: nothing adjacent, one copy per part
    parts = [[torch.zeros(4), torch.zeros(8)] for _ in range(4)]
    apart = PartTable(parts[:3], parts[3:])
    assert apart.num_parts == 2
    with pytest.raises(ValueError, match="sizes differ"):
        PartTable([[torch.zeros(4)], [torch.zeros(5)]], [[torch.zeros(4)]])
    with pytest.raises(ValueError, match="not contiguous"):
        PartTable([[torch.zeros(4, 4).t()]], [[torch.zeros(16)]])


def test_batched_misses_fill_reused_slots_with_the_host_bytes() -> None:
    """Lookups that evict and refill (2 slots, 8 experts, groups): after every lookup each resident
    expert's slot holds exactly its host bytes; one batch a group (counted as direct copies)."""
    g = torch.Generator().manual_seed(2)
    host = _fused_host(g)
    cache = ExpertCache(2, device="cpu", copies="memmove")
    slots = cache.make_layer(host, linear=torch_linear, stacked=True)
    assert slots.batched
    calls: list[int] = []
    dma = slots._copier.dma
    real = dma.copy
    dma.copy = lambda d, s, n, st: (calls.append(len(n)), real(d, s, n, st))[1]  # type: ignore[method-assign]
    for experts in ([0, 1], [1, 2], [3, 4, 5], [5], [0, 7], [2, 6, 7, 0]):
        for group in slots.slot_groups(experts, rows=1):
            for e, s in group:
                assert b"".join(_slot_bytes(slots, s)) == b"".join(_host_bytes(host[e])), (experts, e, s)
    st = cache.stats
    assert st.misses == st.direct_copies == sum(calls) // 4 and st.staged_copies == 0
    assert st.hits == 2 and st.misses == 12  # [1], [5] hit; the rest miss (LRU over 2 slots)
    assert all(n % 4 == 0 for n in calls) and len(calls) == 7  # one batch per group with misses


def test_torch_and_layout_paths_keep_per_miss_copies() -> None:
    """copies="torch", and slots converting a layout (dequantized for a dense hook), build no table."""
    g = torch.Generator().manual_seed(3)
    host = _fused_host(g)
    torch_cache = ExpertCache(2, device="cpu", copies="torch")
    torch_path = torch_cache.make_layer(host, linear=torch_linear, stacked=True)
    assert torch_path._table is not None and not torch_path.batched  # plan built, copier not batched
    dense = ExpertCache(2, device="cpu", copies="memmove").make_layer(host, linear=None, stacked=True)
    assert dense._table is None and not dense.batched
    with pytest.raises(ValueError, match="copies"):
        ExpertCache(2, device="cpu", copies="fast")


def test_routing_buffers_on_the_cpu() -> None:
    r = RoutingBuffers(torch.device("cpu"))
    ids = torch.tensor([[3, 1], [1, 4]])
    host = r.to_host(ids)
    assert host.dtype == np.int64 and host.tolist() == [[3, 1], [1, 4]]
    dev, hst = r.slot_ids(0, 6, [(1, 0), (4, 1)], host)
    assert dev.dtype == torch.int32 and dev.tolist() == [[-1, 0], [0, 1]] and hst.tolist() == dev.tolist()


def _block(seed: int) -> SparseMoeWeights:
    g = torch.Generator().manual_seed(seed)
    host = _fused_host(g)
    shared = SwiGLUWeights(_q4(64, HIDDEN, g), _q4(64, HIDDEN, g), _q4(HIDDEN, 64, g))
    return SparseMoeWeights(torch.randn(EXPERTS, HIDDEN, generator=g), host, shared, torch.randn(1, HIDDEN))


@pytest.mark.parametrize("num_slots", [1, 2])
def test_grouped_block_batched_equals_resident_bit_for_bit(num_slots: int) -> None:
    w = _block(4)
    gate_up, down = stack_experts([e.gate for e in w.experts], [e.up for e in w.experts],
                                  [e.down for e in w.experts])  # fmt: skip
    resident = dataclasses.replace(w, grouped=GroupedExperts(gate_up, down))
    cache = ExpertCache(num_slots, device="cpu", copies="memmove")
    slots = cache.make_layer(w.experts, linear=torch_linear, stacked=True)
    assert slots.batched
    cached = dataclasses.replace(w, experts=slots, grouped=GroupedExperts(*slots.stacks(), slots=slots))
    g = torch.Generator().manual_seed(5)
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, HIDDEN, generator=g)
        want = sparse_moe_block(x, resident, top_k=3, norm_topk_prob=True, linear=torch_linear)
        got = sparse_moe_block(x, cached, top_k=3, norm_topk_prob=True, linear=torch_linear)
        assert torch.equal(got, want)
    assert cache.stats.misses > EXPERTS and cache.stats.direct_copies == cache.stats.misses


PROMPTS = ([5, 17, 3, 99, 250, 7, 8, 41], list(range(30, 100)), [1, 2, 3], [300, 12, 64, 64, 9])


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("static", [False, True])
def test_executors_with_batched_misses_equal_resident(family: str, static: bool, tmp_path) -> None:
    """Tiny hybrids, 1 slot a layer, misses batched (memmove): greedy output equals resident."""
    tiny = make_tiny_hybrid(family, tmp_path / family)
    tensors = tiny.canonical_tensors()
    greedy = SamplingParams(temperature=0, max_tokens=10)
    want = [o.output_token_ids for o in SpeculativeEngine(HybridExecutor(tiny.config, tensors))
            .generate(list(PROMPTS), greedy)]  # fmt: skip
    cache = ExpertCache(1, device="cpu", copies="memmove")
    if static:
        ex = StaticHybridExecutor(tiny.config, tensors, max_lanes=4, max_context=256, expert_cache=cache)
    else:
        ex = HybridExecutor(tiny.config, tensors, expert_cache=cache)
    assert cache.layers and all(layer.batched for layer in cache.layers)
    got = [o.output_token_ids for o in SpeculativeEngine(ex).generate(list(PROMPTS), greedy)]
    assert got == want
    st = cache.stats
    assert st.misses > len(cache.layers) * tiny.config.num_experts and st.direct_copies == st.misses


def test_memmove_runs_the_plan() -> None:
    a, b = torch.arange(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    HostMemmove().copy(
        np.array([b.data_ptr() + 8, b.data_ptr()], dtype=np.uint64),
        np.array([a.data_ptr(), a.data_ptr() + 4], dtype=np.uint64),
        np.array([4, 2], dtype=np.uint64),
        None,
    )
    assert b.tolist() == [4, 5, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0]


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_cuda_driver_batch_fills_reused_slots() -> None:
    """Page-locked fused q4 stacks into 2 stacked slots on the GPU: every lookup's misses go as one
    driver batch (cuMemcpyBatchAsync, or the per-copy loop where the driver lacks it); after each
    group the slots hold exactly the host bytes, through evictions and refills."""
    from ignis.runtime.expert_transfer import DriverBatchCopy

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(6)
    host = _fused_host(g)
    cache = ExpertCache(2, device=dev, pin="on")
    slots = cache.make_layer(host, linear=torch_linear, stacked=True)
    assert isinstance(slots._copier.dma, DriverBatchCopy) and slots.batched, cache.describe_host()
    host = [slots[e] for e in range(EXPERTS)]  # the page-locked views
    for experts in ([0, 1], [1, 2], [3, 4, 5], [5], [0, 7], [2, 6, 7, 0], [1, 3]):
        for group in slots.slot_groups(experts, rows=1):
            torch.cuda.current_stream().synchronize()
            for e, s in group:
                got = b"".join(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()
                               for t in _slot_parts(slots, s))  # fmt: skip
                assert got == b"".join(_host_bytes(host[e])), (experts, e, s)
    assert cache.stats.direct_copies == cache.stats.misses > EXPERTS
    cache.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_slots", [1, 2])
def test_cuda_cached_block_batched_equals_resident(num_slots: int) -> None:
    """The grouped block on the GPU (torch path over stacked q4 slots) with batched misses and the
    pinned routing buffers equals the resident stacks bit for bit, over many lookups."""
    dev = torch.device("cuda")
    w = _block(7)
    gate_up, down = stack_experts([e.gate for e in w.experts], [e.up for e in w.experts],
                                  [e.down for e in w.experts])  # fmt: skip
    mv = dataclasses.replace
    sh = w.shared_expert
    res = mv(w, router=w.router.to(dev), shared_expert=SwiGLUWeights(sh.gate.to(dev), sh.up.to(dev),
             sh.down.to(dev)), shared_expert_gate=w.shared_expert_gate.to(dev),
             grouped=GroupedExperts(gate_up.to(dev), down.to(dev)))  # fmt: skip
    cache = ExpertCache(num_slots, device=dev, pin="on")
    slots = cache.make_layer(w.experts, linear=torch_linear, stacked=True)
    assert slots.batched
    cached = mv(res, experts=slots, grouped=GroupedExperts(*slots.stacks(), slots=slots))
    g = torch.Generator().manual_seed(8)
    for rows in (1, 3, 8, 17, 2, 5):
        x = torch.randn(rows, HIDDEN, generator=g).to(dev)
        want = sparse_moe_block(x, res, top_k=3, norm_topk_prob=True, linear=torch_linear)
        got = sparse_moe_block(x, cached, top_k=3, norm_topk_prob=True, linear=torch_linear)
        assert torch.equal(got, want)
    assert cache.stats.direct_copies == cache.stats.misses > EXPERTS
    cache.close()


def test_driver_batch_falls_back_to_single_copies_when_the_batch_is_refused(caplog) -> None:
    """A driver that refuses cuMemcpyBatchAsync as invalid: the batch is re-issued one copy each and
    every later batch goes that way (logged once); another error is raised with its name."""
    from ignis.runtime.expert_transfer import DriverBatchCopy

    dma = DriverBatchCopy.__new__(DriverBatchCopy)  # no libcuda here: the driver calls are stand-ins
    batches: list[int] = []
    singles: list[tuple[int, int, int]] = []
    dma._batch = lambda d, s, n, count, *rest: batches.append(count) or 1  # CUDA_ERROR_INVALID_VALUE
    dma._one = lambda d, s, n, stream: singles.append((d, s, n)) or 0
    dma.error_name = lambda code: f"E{code}"  # type: ignore[method-assign]
    dma._attrs, dma._attr_idx, dma._fail_idx = ctypes.c_int(0), ctypes.c_size_t(0), ctypes.c_size_t(0)
    dma._marshal()
    dma.name = "cuMemcpyBatchAsync"
    arr = [np.array(v, dtype=np.uint64) for v in ([10, 20], [1, 2], [4, 8])]
    with caplog.at_level("WARNING"):
        dma.copy(*arr, 7)
        dma.copy(*arr, 7)
    assert batches == [2] and singles == [(10, 1, 4), (20, 2, 8)] * 2
    assert dma.name == "cuMemcpyHtoDAsync" and "refused a batch" in caplog.text
    dma._one = lambda d, s, n, stream: 700
    with pytest.raises(RuntimeError, match="E700"):
        dma.copy(*arr, 7)
