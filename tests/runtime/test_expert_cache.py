"""Expert cache (`ignis.runtime.expert_cache`): routed experts in host memory behind a few device slots
per layer give the fully resident model's output bit for bit.

* `ExpertSlots` alone: slot mapping, LRU eviction, refill after eviction, groups when a forward needs
  more experts than slots, hit / miss / byte counters.
* `sparse_moe_block` with a cache of 1, 2 and all slots equals the resident block exactly, dense and
  q4_g32 experts.
* The engine on tiny qwen3_5_moe and qwen3_next targets (HF-written checkpoints,
  `tests/hf_tiny_hybrid.py`), with 1 and 2 slots a layer (misses forced and counted): greedy output
  token for token and seeded sampled output token for token (every verify round's logits are equal,
  so the sampled distribution is the same), speculation off and with the MTP head, several lanes; the
  static executor's (CPU, eager) path too.
* The budget plan: the split, the MTP reserve taken from the cache's share, refusals; byte parsing;
  the metric samples.

CUDA: `test_cuda_cache_matches_resident` (marked gpu) runs the side-stream copy path.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hf_tiny_hybrid import make_tiny_hybrid
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.formats import quantize_q4_g32
from ignis.runtime.drafters.mtp import build_mtp_drafter, load_mtp_checkpoint
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.errors import ConfigError
from ignis.runtime.expert_cache import (
    ExpertCache,
    ExpertCacheStats,
    ExpertSlots,
    _Copier,
    expert_nbytes,
    parse_bytes,
    plan_expert_cache,
)
from ignis.runtime.families.hybrid_executor import HybridExecutor
from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
from ignis.runtime.families.moe import SparseMoeWeights, SwiGLUWeights, sparse_moe_block
from ignis.runtime.families.qwen3_5 import canonicalize_moe_tensors
from ignis.runtime.linear import Q4Weight, torch_linear
from ignis.runtime.sampling import SamplingParams
from ignis.tools.make_test_drafter import make_mtp_drafter

MOE_FAMILIES = ("qwen3_5_moe", "qwen3_next")
PROMPTS = ([5, 17, 3, 99, 250, 7, 8, 41], list(range(30, 100)), [1, 2, 3], [300, 12, 64, 64, 9])


def _experts(n: int, hidden: int, inter: int, seed: int, *, q4: bool = False) -> list[SwiGLUWeights]:
    g = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int) -> torch.Tensor | Q4Weight:
        t = torch.randn(rows, cols, generator=g) * 0.2
        if not q4:
            return t
        packed, scales = quantize_q4_g32(t.numpy())
        return Q4Weight(torch.from_numpy(packed), torch.from_numpy(scales))

    return [SwiGLUWeights(w(inter, hidden), w(inter, hidden), w(hidden, inter)) for _ in range(n)]


def _slots(host: list[SwiGLUWeights], num_slots: int, stats: ExpertCacheStats | None = None) -> ExpertSlots:
    stats = stats if stats is not None else ExpertCacheStats()
    return ExpertSlots(
        host,
        num_slots,
        device=torch.device("cpu"),
        copier=_Copier(torch.device("cpu"), expert_nbytes(host[0])),
        stats=stats,
        first=True,
    )


def _visit(slots: ExpertSlots, experts: list[int]) -> list[list[int]]:
    """Run `resident_groups` to the end; the groups' experts, and check each yielded slot holds the
    expert's host weights at that moment."""
    groups = []
    for group in slots.resident_groups(experts, rows=1):
        groups.append([])
        for e, w in group:
            assert torch.equal(w.gate, slots[e].gate) and torch.equal(w.down, slots[e].down)
            groups[-1].append(e)
    return groups


# ---------------------------------------------------------------------------------------------
# ExpertSlots
# ---------------------------------------------------------------------------------------------


def test_slots_lru_eviction_and_refill() -> None:
    host = _experts(6, 32, 16, seed=0)
    stats = ExpertCacheStats()
    slots = _slots(host, 3, stats)
    per = expert_nbytes(host[0])
    assert per == 3 * 16 * 32 * 4 and slots.slots_in_use == 0

    assert _visit(slots, [0, 2, 4]) == [[0, 2, 4]]
    assert (stats.hits, stats.misses, stats.bytes_copied) == (0, 3, 3 * per)
    assert list(slots.resident) == [0, 2, 4]

    assert _visit(slots, [2]) == [[2]]  # hit: 2 becomes most recently used
    assert (stats.hits, stats.misses) == (1, 3)
    assert list(slots.resident) == [0, 4, 2]

    assert _visit(slots, [1, 2]) == [[1, 2]]  # 1 evicts 0 (the LRU), 2 is a hit
    assert (stats.hits, stats.misses) == (2, 4)
    assert set(slots.resident) == {1, 2, 4} and 0 not in slots.resident
    slot_of_1 = slots.resident[1]

    assert _visit(slots, [0]) == [[0]]  # refill of an evicted expert: evicts 4 (LRU now)
    assert (stats.hits, stats.misses, stats.bytes_copied) == (2, 5, 5 * per)
    assert set(slots.resident) == {0, 1, 2}
    assert slots.resident[1] == slot_of_1  # untouched
    assert stats.forwards == 4 and stats.rows == 4

    slots.flush()  # the no-cache baseline: nothing resident, every expert copied again
    assert slots.resident == {} and slots.slots_in_use == 0
    assert _visit(slots, [0, 1, 2, 3]) == [[0, 1, 2], [3]]
    assert (stats.hits, stats.misses) == (2, 9)


def test_slots_groups_when_a_forward_needs_more_experts_than_slots() -> None:
    host = _experts(5, 32, 16, seed=1)
    stats = ExpertCacheStats()
    slots = _slots(host, 2, stats)
    assert _visit(slots, [0, 1, 3, 4]) == [[0, 1], [3, 4]]
    assert stats.misses == 4 and stats.hits == 0
    # the group in use is never evicted by its own members: 3 and 4 are resident now
    assert set(slots.resident) == {3, 4}
    assert _visit(slots, [1, 3, 4]) == [[1, 3], [4]]
    # group [1, 3]: 3 hit, 1 evicts 4 (LRU, not in the group); group [4]: 4 refilled, evicts 1
    assert (stats.hits, stats.misses) == (1, 6)
    one = _slots(host, 1)
    assert _visit(one, [0, 2, 4]) == [[0], [2], [4]]


def test_slots_refuse_bad_sizes_and_mixed_experts() -> None:
    host = _experts(3, 32, 16, seed=2)
    with pytest.raises(ValueError, match="num_slots"):
        _slots(host, 0)
    with pytest.raises(ValueError, match="num_slots"):
        _slots(host, 4)
    odd = [*host[:2], _experts(1, 32, 8, seed=3)[0]]
    with pytest.raises(ValueError, match="parts differ"):
        _slots(odd, 2)


# ---------------------------------------------------------------------------------------------
# the MoE block
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q4", [False, True], ids=["dense", "q4_g32"])
@pytest.mark.parametrize("num_slots", [1, 2, 8])
def test_moe_block_with_cache_equals_resident(q4: bool, num_slots: int) -> None:
    hidden, inter, n = 64, 32, 8
    experts = _experts(n, hidden, inter, seed=4, q4=q4)
    g = torch.Generator().manual_seed(5)
    shared = _experts(1, hidden, 64, seed=6, q4=q4)[0]
    router = torch.randn(n, hidden, generator=g)
    gate = torch.randn(1, hidden, generator=g)
    resident = SparseMoeWeights(router, experts, shared, gate)
    cache = ExpertCache(num_slots, device="cpu")
    cached = dataclasses.replace(resident, experts=cache.make_layer(experts, linear=torch_linear))
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, hidden, generator=g)
        want = sparse_moe_block(x, resident, top_k=2, norm_topk_prob=True, linear=torch_linear)
        got = sparse_moe_block(x, cached, top_k=2, norm_topk_prob=True, linear=torch_linear)
        assert torch.equal(got, want)
    assert cache.stats.misses > 0 and cache.stats.forwards == 4 and cache.stats.rows == 29
    if num_slots < n:
        assert cache.stats.misses > n  # evicted experts were copied in again
    assert cache.slots_in_use <= num_slots and cache.device_bytes == num_slots * expert_nbytes(experts[0])


# ---------------------------------------------------------------------------------------------
# tiny hybrid MoE targets through the engine
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    family: str
    config: object
    tensors: dict  # canonical names, mtp.* included
    ex: HybridExecutor  # every expert resident


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def target(request, tmp_path_factory: pytest.TempPathFactory) -> Target:
    base = tmp_path_factory.mktemp(request.param)
    tiny = make_tiny_hybrid(request.param, base / "target")
    make_mtp_drafter(tiny.folder, base / "with_mtp", seed=7)
    config, tensors = load_mtp_checkpoint(base / "with_mtp")
    tensors = canonicalize_moe_tensors(config, tensors)
    return Target(request.param, config, tensors, HybridExecutor(config, tensors))


def _cached(t: Target, slots: int, *, static: bool = False) -> tuple[HybridExecutor, ExpertCache]:
    cache = ExpertCache(slots, device="cpu")
    if static:
        return StaticHybridExecutor(
            t.config, t.tensors, max_lanes=4, max_context=256, expert_cache=cache
        ), cache
    return HybridExecutor(t.config, t.tensors, expert_cache=cache), cache


def _generate(ex, params: SamplingParams, *, mtp: Target | None = None, k: int = 3) -> list[list[int]]:
    drafter = None
    if mtp is not None:
        drafter = build_mtp_drafter(target_config=mtp.config, target_weights=mtp.tensors)
    engine = SpeculativeEngine(ex, drafter, draft_tokens=k if drafter is not None else None)
    outs = engine.generate(list(PROMPTS), params)
    return [o.output_token_ids for o in outs]


def _assert_forced_misses(t: Target, cache: ExpertCache, slots: int) -> None:
    stats = cache.stats
    n = t.config.num_experts
    assert stats.misses > len(cache.layers) * n  # more copies than experts: evictions and refills
    assert stats.bytes_copied == stats.misses * cache.layers[0].expert_bytes
    assert stats.forwards > 0 and stats.rows >= stats.forwards
    assert cache.slots_in_use == cache.slots_total == slots * len(cache.layers)


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("spec", ["off", "mtp"])
def test_greedy_equals_resident(target: Target, slots: int, spec: str) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=14)
    mtp = target if spec == "mtp" else None
    want = _generate(target.ex, greedy, mtp=mtp)
    ex, cache = _cached(target, slots)
    assert _generate(ex, greedy, mtp=mtp) == want
    _assert_forced_misses(target, cache, slots)


@pytest.mark.parametrize("spec", ["off", "mtp"])
def test_sampled_equals_resident(target: Target, spec: str) -> None:
    mtp = target if spec == "mtp" else None
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=14, seed=1234)
    want = _generate(target.ex, params, mtp=mtp)
    ex, cache = _cached(target, 1)
    assert _generate(ex, params, mtp=mtp) == want
    _assert_forced_misses(target, cache, 1)


def test_verify_round_logits_equal_resident(target: Target) -> None:
    """A prefill then verify rounds of several lanes: every logit equal, states equal after commit."""
    ex, cache = _cached(target, 2)
    g = torch.Generator().manual_seed(9)
    lanes_ref = [target.ex.new_lane() for _ in range(3)]
    lanes = [ex.new_lane() for _ in range(3)]
    prompts = [torch.tensor(p) for p in PROMPTS[:3]]
    for record, cols in ((False, prompts), (True, None), (True, None)):
        if cols is None:
            cols = [torch.randint(0, target.config.vocab_size, (4,), generator=g) for _ in lanes]
        want = target.ex.forward(lanes_ref, cols, record=record)
        got = ex.forward(lanes, cols, record=record)
        for a, b in zip(got.logits, want.logits, strict=True):
            assert torch.equal(a, b)
        keep = [c.numel() for c in cols] if not record else [1, 4, 2]
        target.ex.commit(lanes_ref, keep)
        ex.commit(lanes, keep)
    for a, b in zip(lanes, lanes_ref, strict=True):
        assert a.num_tokens == b.num_tokens
        for layer in range(target.config.num_hidden_layers):
            if target.config.is_full_attention(layer):
                assert all(torch.equal(x, y) for x, y in zip(a.kv(layer), b.kv(layer), strict=True))
            else:
                assert torch.equal(a.recurrent_state(layer), b.recurrent_state(layer))
    assert cache.stats.misses > 0


def test_static_executor_with_cache_equals_resident(target: Target) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=10)
    ref = StaticHybridExecutor(target.config, target.tensors, max_lanes=4, max_context=256)
    want = _generate(ref, greedy, mtp=target)
    ex, cache = _cached(target, 1, static=True)
    assert _generate(ex, greedy, mtp=target) == want
    _assert_forced_misses(target, cache, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_matches_resident(target: Target) -> None:
    """On CUDA (page-locked experts, batched side-stream copies ordered by events): greedy output with
    1 and 2 slots a layer equals the resident executor's, in bf16 and with MTP."""
    dev = torch.device("cuda")
    greedy = SamplingParams(temperature=0, max_tokens=14)
    ref = HybridExecutor(target.config, target.tensors, device=dev, dtype=torch.bfloat16)
    for slots in (1, 2):
        cache = ExpertCache(slots, device=dev)
        # experts stay CPU tensors (the host side); everything else goes to the device
        ex = HybridExecutor(
            target.config, target.tensors, device=dev, dtype=torch.bfloat16, expert_cache=cache
        )
        assert all(
            b.device.type == "cuda"
            for lay in cache.layers
            for bufs in lay._slot_bufs.values()
            for b in bufs.values()
        )
        drafter = build_mtp_drafter(
            target_config=target.config, target_weights=target.tensors, device=dev, dtype=torch.bfloat16
        )
        want = SpeculativeEngine(ref).generate(list(PROMPTS), greedy)
        got = SpeculativeEngine(ex).generate(list(PROMPTS), greedy)
        assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
        got_mtp = SpeculativeEngine(ex, drafter, draft_tokens=3).generate(list(PROMPTS), greedy)
        assert [o.output_token_ids for o in got_mtp] == [o.output_token_ids for o in want]
        assert cache.stats.misses > len(cache.layers) * target.config.num_experts
        # page-locked experts: every miss went in a batched driver copy (ADR 0013)
        assert all(layer.batched for layer in cache.layers), cache.describe_host()
        assert cache.stats.direct_copies == cache.stats.misses and cache.stats.staged_copies == 0


# ---------------------------------------------------------------------------------------------
# budget, sizes, metrics
# ---------------------------------------------------------------------------------------------

GIB = 1024**3


def test_plan_from_card_and_mtp_reserve() -> None:
    kw = dict(
        expert_bytes=5 * 2**20,
        moe_layers=48,
        num_experts=256,
        resident_bytes=8 * GIB,
        lane_bytes=3 * GIB,
        workspace_bytes=1 * GIB,
        card_bytes=32 * GIB,
        card_name="rtx5090",
        headroom_bytes=2 * GIB,
    )
    off = plan_expert_cache(**kw)
    assert off.source == "profile:rtx5090"
    assert off.cache_bytes == 18 * GIB
    assert off.slots_per_layer == 18 * GIB // (48 * 5 * 2**20) == 76
    on = plan_expert_cache(**kw, mtp_reserve_bytes=int(1.1 * GIB))
    assert on.cache_bytes == 18 * GIB - int(1.1 * GIB)
    assert on.slots_per_layer == on.cache_bytes // (48 * 5 * 2**20) < off.slots_per_layer
    assert "MTP reserve 1.10 GiB" in on.describe() and "rtx5090" in on.describe()
    big = plan_expert_cache(**{**kw, "card_bytes": 400 * GIB})
    assert big.slots_per_layer == 256 and big.fraction_cached == 1.0


def test_plan_from_flag_and_refusals() -> None:
    kw = dict(
        expert_bytes=2**20, moe_layers=4, num_experts=16, resident_bytes=0, lane_bytes=0, workspace_bytes=0
    )
    plan = plan_expert_cache(**kw, budget_bytes=10 * 2**20, mtp_reserve_bytes=2 * 2**20)
    assert (plan.source, plan.cache_bytes, plan.slots_per_layer) == ("flag", 8 * 2**20, 2)
    with pytest.raises(ConfigError, match="expert-cache-bytes >= "):
        plan_expert_cache(**kw, budget_bytes=5 * 2**20, mtp_reserve_bytes=2 * 2**20)
    # a row budget past 8: the wider round's extra workspace comes out of the cache too
    wide = plan_expert_cache(
        **kw, budget_bytes=10 * 2**20, mtp_reserve_bytes=2 * 2**20, wide_round_bytes=4 * 2**20
    )
    assert (wide.cache_bytes, wide.slots_per_layer) == (4 * 2**20, 1)
    assert "wide-round reserve 4.00 MiB" in wide.describe() and "MTP reserve 2.00 MiB" in wide.describe()
    with pytest.raises(ConfigError, match="lower --lanes"):
        plan_expert_cache(**{**kw, "resident_bytes": 30 * GIB}, card_bytes=32 * GIB)
    with pytest.raises(ConfigError, match="budget"):
        plan_expert_cache(**kw)


def test_parse_bytes() -> None:
    assert parse_bytes("24GiB") == 24 * GIB
    assert parse_bytes("24G") == 24 * GIB
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512mib") == 512 * 2**20
    assert parse_bytes("4096") == 4096 and parse_bytes(7) == 7
    for bad in ("lots", "-1G", "nan", -3, True):
        with pytest.raises(ConfigError):
            parse_bytes(bad)


def test_stats_samples() -> None:
    host = _experts(4, 32, 16, seed=8)
    cache = ExpertCache(2, device="cpu")
    slots = cache.make_layer(host, linear=None)
    _visit(slots, [0, 1, 2])
    values = {name: (kind, value) for name, kind, _, value in cache.stats.samples()}
    per = expert_nbytes(host[0])
    assert values["ignis_expert_cache_misses_total"] == ("counter", 3)
    assert values["ignis_expert_cache_hits_total"] == ("counter", 0)
    assert values["ignis_expert_cache_copied_bytes_total"] == ("counter", 3 * per)
    assert values["ignis_expert_cache_copied_bytes_per_token"] == ("gauge", 3 * per)
    assert values["ignis_expert_cache_copied_bytes_per_round"] == ("gauge", 3 * per)
    assert values["ignis_expert_cache_slots_in_use"] == ("gauge", 2)
    assert values["ignis_expert_cache_slots"] == ("gauge", 2)


# ---------------------------------------------------------------------------------------------
# an artifact: experts as host views of the memory map, the served budget, /metrics
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3_next artifact with its MTP companion, no compiled modules (torch linears)."""
    import hf_tiny

    from ignis.compiler.build import build_artifact

    root = tmp_path_factory.mktemp("moe_art")
    make_tiny_hybrid("qwen3_next", root / "base")
    hf_tiny.tiny_tokenizer(vocab_size=320).save_pretrained(root / "base")
    make_mtp_drafter(root / "base", root / "ckpt", seed=3)
    (root / "r.toml").write_text('name = "tiny-next"\n[modules]\nwidths = []\n')
    res = build_artifact(
        card="cpu",
        model=root / "ckpt",
        recipe=root / "r.toml",
        out=root / "art",
        progress=False,
        echo=lambda _l: None,
    )
    assert res.out is not None
    return res.out


def test_artifact_experts_stay_host_views(moe_artifact: Path) -> None:
    from ignis.runtime.artifact import load_artifact

    with load_artifact(moe_artifact) as art:
        host = art.target_weights(dtype=torch.float32, experts_on_host=True)
        expert = next(n for n in host if n.startswith("model.layers.") and ".mlp.experts." in n)
        # a zero-copy view of the memory map (float32 stored, float32 asked): same bytes, not a copy
        assert host[expert].data_ptr() == art.weights.torch(expert).data_ptr()
        greedy = SamplingParams(temperature=0, max_tokens=12)
        want = [
            o.output_token_ids for o in SpeculativeEngine(art.make_executor()).generate(list(PROMPTS), greedy)
        ]
        cache = ExpertCache(1, device="cpu")
        ex = art.make_executor(expert_cache=cache)
        assert ex.expert_cache is cache and len(cache.layers) == sum(
            art.config.is_moe_layer(i) for i in range(art.config.num_hidden_layers)
        )
        got = [o.output_token_ids for o in SpeculativeEngine(ex).generate(list(PROMPTS), greedy)]
        assert got == want
        assert cache.stats.misses > len(cache.layers) * art.config.num_experts


def test_served_budget_mtp_reserve_and_metrics(moe_artifact: Path, caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from ignis.runtime.expert_cache import plan_for_artifact
    from ignis.runtime.metrics import SpeculativeMetrics
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.server.artifact_source import ArtifactSource
    from ignis.runtime.server.model import ModelSettings

    source = ArtifactSource(moe_artifact)
    art = source.artifact
    mtp = SpecDefaults(backend="mtp", draft_tokens=3, draft_rows=8)
    sizes = dict(dtype=torch.float32, keep_q4=False, lanes=2, context=64, rows=8, mtp=True)
    probe = plan_for_artifact(art, budget_bytes=10**9, **sizes)
    per_slot = probe.expert_bytes * probe.moe_layers
    assert probe.mtp_reserve_bytes > sum(art.mtp.info(n).length for n in art.mtp) > 0
    without = plan_for_artifact(art, budget_bytes=10**9, **{**sizes, "mtp": False})
    wide = plan_for_artifact(art, budget_bytes=10**9, **{**sizes, "rows": 16})
    assert probe.wide_round_bytes == 0 < wide.wide_round_bytes == probe.cache_bytes - wide.cache_bytes
    assert (
        without.mtp_reserve_bytes == 0 and without.cache_bytes - probe.cache_bytes == probe.mtp_reserve_bytes
    )
    budget = probe.mtp_reserve_bytes + 2 * per_slot + per_slot // 2  # two slots a layer after the reserve
    with caplog.at_level("INFO", logger="ignis.runtime.expert_cache"):
        model = source.load(ModelSettings(spec=mtp, max_context=64, device="cpu", expert_cache=str(budget)))
        engine = model.make_engine(2, SpeculativeMetrics())
    cache = engine.executor.expert_cache
    assert cache is not None and cache.slots_per_layer == 2 and cache.budget.source == "flag"
    assert not cache.lookahead  # off unless asked (--expert-cache-lookahead)
    on = ModelSettings(
        spec=mtp, max_context=64, device="cpu", expert_cache=str(budget), expert_cache_lookahead=True
    )
    ahead = source.load(on).make_engine(2, SpeculativeMetrics())
    assert ahead.executor.expert_cache.lookahead
    assert "expert cache (flag)" in caplog.text and "MTP reserve" in caplog.text
    assert "reserved from the expert cache for the MTP head" in caplog.text
    outs = engine.generate([PROMPTS[0], PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8))
    assert all(len(o.output_token_ids) == 8 for o in outs)
    registry = CollectorRegistry()
    for collector in model.collectors:
        registry.register(collector)
    text = generate_latest(registry).decode()
    stats = cache.stats
    assert stats.misses > 0
    assert f"ignis_expert_cache_misses_total {float(stats.misses)}" in text
    assert f"ignis_expert_cache_slots {float(cache.slots_total)}" in text
    assert (
        "ignis_expert_cache_copied_bytes_per_token" in text
        and "ignis_expert_cache_copied_bytes_per_round" in text
    )
    # a budget below one slot a layer after the MTP reserve is refused with the size that works
    with pytest.raises(ConfigError, match="expert-cache-bytes >= "):
        source.load(
            ModelSettings(spec=mtp, max_context=64, device="cpu", expert_cache=str(budget - 2 * per_slot))
        ).make_engine(2, SpeculativeMetrics())
    # off, and auto on a CPU device: every expert resident, no collector
    for setting in ("off", None):
        model = source.load(ModelSettings(spec=mtp, max_context=64, device="cpu", expert_cache=setting))
        assert (
            model.make_engine(2, SpeculativeMetrics()).executor.expert_cache is None and not model.collectors
        )


class _RecordingCopier(_Copier):
    """The CPU copier that also logs the CUDA path's ordering calls (events are ("copy", n) / ("used",
    n) tokens) so the protocol is checked without a GPU."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), 0)
        self.log: list[tuple] = []
        self.n = 0

    def copy(self, dst, src, after=None, then=None):
        super().copy(dst, src, then=then)
        self.n += 1
        self.log.append(("copy", self.n, after))
        return ("copy", self.n)

    def wait(self, event):
        self.log.append(("wait", event))

    def used(self):
        self.n += 1
        self.log.append(("used", self.n))
        return ("used", self.n)


def test_copy_ordering_protocol() -> None:
    """Each copy into a slot waits for the last use of the slot's previous occupant; every copy of a
    group is issued before its first expert is handed out; an expert is handed out only after a wait
    on its own copy; the group's use is recorded after its experts were handed out."""
    host = _experts(4, 32, 16, seed=10)
    copier = _RecordingCopier()
    slots = ExpertSlots(host, 2, device=torch.device("cpu"), copier=copier, stats=ExpertCacheStats())
    handed: list[tuple] = []
    for group in slots.resident_groups([0, 1, 2], rows=1):
        for e, _ in group:
            copier.log.append(("run", e))
            handed.append(e)
    log = copier.log
    assert handed == [0, 1, 2]
    # group [0, 1]: two copies into free slots (no previous use), then wait+run per expert, then used
    assert log[0] == ("copy", 1, None) and log[1] == ("copy", 2, None)
    assert log[2:6] == [("wait", ("copy", 1)), ("run", 0), ("wait", ("copy", 2)), ("run", 1)]
    assert log[6] == ("used", 3)
    # group [2]: evicts expert 0 (LRU); its copy waits for group 1's use of that slot
    assert log[7] == ("copy", 4, ("used", 3))
    assert log[8:11] == [("wait", ("copy", 4)), ("run", 2), ("used", 5)]
    # a hit needs no copy: its wait is on None
    copier.log.clear()
    for group in slots.resident_groups([2], rows=1):
        for e, _ in group:
            copier.log.append(("run", e))
    assert copier.log == [("wait", None), ("run", 2), ("used", 6)]


class _TilingHook:
    """A linear hook that places every q4 weight it can in the tiled layout (as a `LinearBackend` does
    for the shapes its CUDA tiled functions serve) and runs torch linears (exact on either layout)."""

    def place(self, w, *, row_splits: int = 1):
        n, k = w.out_features, w.in_features
        return w.to_tiled() if k % 128 == 0 and (n // row_splits) % 16 == 0 else w

    def __call__(self, x, w, b=None):
        return torch_linear(x, w, b)


def test_q4_experts_dequantized_into_slots_for_a_dense_hook() -> None:
    """With F.linear (no q4 weights) the slots hold the experts dequantized to the executor's dtype,
    copied as q4 bytes: the block equals the resident block over the dequantized experts."""
    hidden, inter, n = 64, 32, 5
    host = _experts(n, hidden, inter, seed=17, q4=True)
    dense = [SwiGLUWeights(e.gate.dequantize(), e.up.dequantize(), e.down.dequantize()) for e in host]
    g = torch.Generator().manual_seed(18)
    shared = _experts(1, hidden, 64, seed=19)[0]
    resident = SparseMoeWeights(
        torch.randn(n, hidden, generator=g), dense, shared, torch.randn(1, hidden, generator=g)
    )
    cache = ExpertCache(2, device="cpu")
    slots = cache.make_layer(host, linear=torch.nn.functional.linear, dtype=torch.float32)
    assert all(isinstance(w.gate, torch.Tensor) for w in slots._slot_weights)
    assert cache.device_bytes == 2 * 3 * inter * hidden * 4  # float32 slots, not the q4 bytes
    cached = dataclasses.replace(resident, experts=slots)
    for rows in (1, 4, 7):
        x = torch.randn(rows, hidden, generator=g)
        want = sparse_moe_block(x, resident, top_k=2, norm_topk_prob=True)
        assert torch.equal(sparse_moe_block(x, cached, top_k=2, norm_topk_prob=True), want)
    assert cache.stats.bytes_copied == cache.stats.misses * expert_nbytes(host[0])  # q4 bytes moved


@pytest.mark.parametrize("num_slots", [1, 3])
def test_tiled_slots_equal_resident_tiled(num_slots: int) -> None:
    """Slots of q4 experts the hook tiles hold the tiled layout (tiled on the copy path from the
    row-major host bytes): the block equals the resident block over the placed (tiled) experts."""
    hidden, inter, n = 128, 128, 6
    hook = _TilingHook()
    host = _experts(n, hidden, inter, seed=11, q4=True)
    placed = [SwiGLUWeights(hook.place(e.gate), hook.place(e.up), hook.place(e.down)) for e in host]
    assert all(p.gate.is_tiled and p.down.is_tiled for p in placed)
    g = torch.Generator().manual_seed(12)
    shared = _experts(1, hidden, 128, seed=13, q4=True)[0]
    router, gate = torch.randn(n, hidden, generator=g), torch.randn(1, hidden, generator=g)
    resident = SparseMoeWeights(router, placed, shared, gate)
    cache = ExpertCache(num_slots, device="cpu")
    slots = cache.make_layer(host, linear=hook)
    assert all(w.gate.is_tiled and w.up.is_tiled and w.down.is_tiled for w in slots._slot_weights)
    cached = dataclasses.replace(resident, experts=slots)
    for rows in (1, 5, 9):
        x = torch.randn(rows, hidden, generator=g)
        want = sparse_moe_block(x, resident, top_k=2, norm_topk_prob=True, linear=hook)
        assert torch.equal(sparse_moe_block(x, cached, top_k=2, norm_topk_prob=True, linear=hook), want)
    assert cache.stats.misses > 0
    for e, slot in slots.resident.items():  # the slot's bytes are the resident tiled weight's
        assert torch.equal(slots._slot_weights[slot].down.packed, placed[e].down.packed)
        assert torch.equal(slots._slot_weights[slot].gate.scales, placed[e].gate.scales)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_slots", [1, 3])
def test_cuda_tiled_slots_equal_resident_tiled(num_slots: int) -> None:
    """The CUDA copy path with tiling on the copy stream (pinned staging, scratch, events): the block
    with host q4 experts equals the block over the device-resident tiled experts, bit for bit."""
    dev = torch.device("cuda")
    hidden, inter, n = 128, 128, 6
    hook = _TilingHook()
    host = _experts(n, hidden, inter, seed=14, q4=True)
    placed = [
        SwiGLUWeights(*(hook.place(getattr(e, f).to(dev)) for f in ("gate", "up", "down"))) for e in host
    ]
    g = torch.Generator().manual_seed(15)
    shared = _experts(1, hidden, 128, seed=16, q4=True)[0]
    shared = SwiGLUWeights(shared.gate.to(dev), shared.up.to(dev), shared.down.to(dev))
    router, gate = torch.randn(n, hidden, generator=g).to(dev), torch.randn(1, hidden, generator=g).to(dev)
    resident = SparseMoeWeights(router, placed, shared, gate)
    cache = ExpertCache(num_slots, device=dev)
    cached = dataclasses.replace(resident, experts=cache.make_layer(host, linear=hook))
    for rows in (1, 5, 9, 9, 1):
        x = torch.randn(rows, hidden, generator=g).to(dev)
        want = sparse_moe_block(x, resident, top_k=2, norm_topk_prob=True, linear=hook)
        assert torch.equal(sparse_moe_block(x, cached, top_k=2, norm_topk_prob=True, linear=hook), want)
    assert cache.stats.misses > n


def test_policy_replay_matches_the_cache_and_belady_bounds_it(target: Target) -> None:
    """The LRU replay of a recorded routing trace gives the cache's own hits and misses; Belady's
    offline optimum never misses more; LFU replays too."""
    from ignis.runtime.expert_cache import simulate_policy

    ex, cache = _cached(target, 2)
    cache.stats.trace = []
    _generate(ex, SamplingParams(temperature=0, max_tokens=10))
    trace = cache.stats.trace
    assert len(trace) == cache.stats.forwards * len(cache.layers)
    lru = simulate_policy(trace, 2, "lru")
    assert (lru["hits"], lru["misses"]) == (cache.stats.hits, cache.stats.misses)
    best = simulate_policy(trace, 2, "belady")
    assert best["misses"] <= lru["misses"] and best["hits"] + best["misses"] == lru["hits"] + lru["misses"]
    lfu = simulate_policy(trace, 2, "lfu")
    assert lfu["hits"] + lfu["misses"] == lru["hits"] + lru["misses"]
    everything = simulate_policy(trace, target.config.num_experts, "lru")
    # with every expert a slot only the first use of each misses
    assert everything["misses"] == len({(layer, e) for layer, es in trace for e in es}) < lru["misses"]
    with pytest.raises(ValueError, match="policy"):
        simulate_policy(trace, 2, "fifo")


def test_belady_on_a_known_trace() -> None:
    from ignis.runtime.expert_cache import simulate_policy

    # one layer, 2 slots: 0 1 2 0 1 ... LRU always misses; Belady keeps 0 and misses less
    trace = [(0, (e,)) for e in (0, 1, 2, 0, 1, 2, 0, 1, 2)]
    assert simulate_policy(trace, 2, "lru") == {"hits": 0, "misses": 9}
    assert simulate_policy(trace, 2, "belady") == {"hits": 3, "misses": 6}


def test_simulate_policy_warmup_counts_only_after_it() -> None:
    """Entries before `warmup` fill the cache but are not counted: the same decode trace scores its
    hits from the state a prefill left, as the real cache does."""
    from ignis.runtime.expert_cache import simulate_policy

    prefill = [(0, (1, 2))]
    decode = [(0, (1,)), (0, (2,)), (0, (3,))]
    cold = simulate_policy(decode, 2, "lru")
    warm = simulate_policy(prefill + decode, 2, "lru", warmup=1)
    assert cold == {"hits": 0, "misses": 3}
    assert warm == {"hits": 2, "misses": 1}
    assert simulate_policy(prefill + decode, 2, "lru") == {"hits": 2, "misses": 3}
