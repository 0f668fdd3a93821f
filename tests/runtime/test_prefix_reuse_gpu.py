"""Prompt checkpoints on CUDA: the static (pooled, CUDA-graphed) hybrid executor and the DFlash2
drafter on the device, the card tier on the device and the host tier in pinned memory.

The drafter runs its static route (pooled rings, graphed proposals), as the server runs it on CUDA.

1. A lane's state captured on the card, restored into another lane's pooled slot (directly, and via
   a pinned host copy), is bit for bit the original, and a verify round from it gives bit-identical
   logits (float32 and bf16).
2. An agent session (the CPU test's turns) on a warm engine equals the cold engine: float32 token
   for token (near-ties by the cold run's margin), bf16 to bf16 near-ties; every turn after the first
   reuses what it should; with a card tier of one checkpoint, evicted checkpoints come back from the
   host tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ignis.runtime.checkpoints import capture_model_state, restore_model_state
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.prefix_cache import PrefixCache
from ignis.runtime.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

OPENER, USER, TOOL, MAX_TOKENS = 40, 12, 30, 10
BIG = 1 << 32


class Target:
    def __init__(self, base: Path, dtype: torch.dtype) -> None:
        import hf_tiny_hybrid

        from ignis.runtime.drafters.dflash2 import build_dflash2_drafter
        from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
        from ignis.tools.make_test_drafter import make_dflash2_drafter

        tiny = hf_tiny_hybrid.make_tiny_hybrid("qwen3_5", base / "target")
        make_dflash2_drafter(tiny.folder, base / "dflash2", seed=12, sliding_window=8)
        self.config, self.tensors = tiny.config, tiny.canonical_tensors()
        self.dtype = dtype
        self.ex = StaticHybridExecutor(
            self.config, self.tensors, device="cuda", dtype=dtype, max_lanes=4, max_context=512
        )
        assert self.ex.cuda_graphs

        def drafter():  # type: ignore[no-untyped-def]
            d = build_dflash2_drafter(
                target_config=self.config,
                target_weights=self.tensors,
                checkpoint=base / "dflash2",
                device="cuda",
                dtype=dtype,
                static=True,  # what the server does beside a static target on CUDA (graphed)
                max_lanes=4,
                max_context=512,
            )
            assert d.warm_up() > 0
            return d

        self.drafter = drafter
        g = torch.Generator().manual_seed(5)
        self.parts = {
            k: tuple(torch.randint(3, self.config.vocab_size, (n,), generator=g).tolist())
            for k, n in (
                ("opener", OPENER),
                ("user", USER),
                ("user2", USER),
                ("tool1", TOOL),
                ("tool2", TOOL),
            )
        }

    def margin(self, tokens) -> float:  # type: ignore[no-untyped-def]
        st = self.ex.new_lane()
        out = self.ex.forward([st], [torch.tensor(list(tokens), device="cuda")], logits="last", record=False)
        self.ex.commit([st], [0])
        self.ex.release_lane(st)
        top2 = torch.topk(out.logits[0][-1].double(), 2).values
        return float(top2[0] - top2[1])


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Target:
    return Target(tmp_path_factory.mktemp("gpu"), request.param)


def _state(ex, st) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {k: v.clone() for k, v in capture_model_state(ex, st).items()}


def test_restore_into_a_pooled_slot_is_exact(target: Target) -> None:
    ex = target.ex
    prompt = torch.tensor(target.parts["opener"] + target.parts["user"], device="cuda")
    a = ex.new_lane()
    ex.forward([a], [prompt], logits="last", record=False)
    ex.commit([a], [prompt.numel()])
    ckpt = capture_model_state(ex, a)
    assert all(t.is_cuda for t in ckpt.values())
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v) for k, v in ckpt.items()}
    for source in (ckpt, host):
        b = ex.new_lane()
        assert b.slot != a.slot
        restore_model_state(ex, b, source, prompt.numel())
        sa, sb = _state(ex, a), _state(ex, b)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        cols = torch.tensor(target.parts["tool1"][:4], device="cuda")
        la = ex.forward([a], [cols], logits="all", record=True).logits[0].clone()
        ex.commit([a], [0])
        lb = ex.forward([b], [cols], logits="all", record=True).logits[0].clone()
        ex.commit([b], [0])
        assert torch.equal(la, lb)  # same state, same slot-independent graph: bit-identical
        ex.release_lane(b)
    ex.release_lane(a)


def _session(target: Target, cache: PrefixCache | None) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    engine = SpeculativeEngine(target.ex, target.drafter(), draft_tokens=3, prefix_cache=cache, device="cuda")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    p = target.parts
    turns = []

    def run(prompt, boundary=()):  # type: ignore[no-untyped-def]
        lane = engine.add_lane(prompt, params, checkpoint_at=boundary)
        while engine.result(lane) is None:
            engine.step()
        r = engine.pop_result(lane)
        turns.append((prompt, r.output_token_ids, r.num_cached_tokens))
        return r.output_token_ids

    p1 = p["opener"] + p["user"]
    o1 = run(p1, (OPENER,))
    p2 = p1 + o1 + p["tool1"]
    o2 = run(p2)
    run(p2 + o2 + p["tool2"])
    run(p["opener"] + p["user2"], (OPENER,))
    run(p1)
    return turns


def _check(target: Target, warm, cold, *, retry_whole: bool = True) -> None:  # type: ignore[no-untyped-def]
    limit = 1e-3 if target.dtype == torch.float32 else 0.25
    for (prompt, got, _), (_, want, _) in zip(warm, cold, strict=True):
        if got != want:
            i = next(j for j, (x, y) in enumerate(zip(got, want, strict=False)) if x != y)
            assert target.margin(prompt + want[:i]) < limit, (prompt[:4], got, want)
    (p1, o1, _), (p2, o2, _), _, _, (p5, _, _) = warm
    got = [c for _, _, c in warm]
    assert got[:4] == [0, len(p1) + len(o1) - 1, len(p2) + len(o2) - 1, OPENER]
    # the retry of turn 1's prompt: whole from its checkpoint, unless the card was too small to keep
    # it (superseded by turn 1's reply, it is dropped rather than moved to the host): the opener
    assert got[4] == len(p5) if retry_whole else OPENER <= got[4] < len(p5)


def test_session_reuse_equals_cold_on_the_card(target: Target) -> None:
    cold = _session(target, None)
    cache = PrefixCache(card_bytes=BIG, host_bytes=0, card_device="cuda")
    warm = _session(target, cache)
    _check(target, warm, cold)
    assert all(c.device.type == "cuda" for c in cache.entries("card"))
    assert cache.metrics.hits_total["card"] == 4


def test_session_reuse_through_the_host_tier(target: Target) -> None:
    cold = _session(target, None)
    probe = PrefixCache(card_bytes=BIG, host_bytes=0, card_device="cuda")
    _session(target, probe)
    one = max(c.nbytes for c in probe.entries("card"))
    cache = PrefixCache(card_bytes=one + 1, host_bytes=BIG, card_device="cuda")
    warm = _session(target, cache)
    _check(target, warm, cold, retry_whole=False)
    assert cache.metrics.evictions_total["card"] > 0 and cache.metrics.hits_total["host"] >= 1
    host = cache.entries("host")
    assert host and all(t.device.type == "cpu" and t.is_pinned() for c in host for t in c.model.values())
    assert cache.bytes_used("card") <= cache.budget["card"]
    m = cache.metrics
    assert m.copied_bytes_total["to_host"] > 0 and m.copy_seconds_total["to_host"] > 0
    print(  # a figure for PERF notes (pytest -s): the synchronous tier copies' cost
        f"to_host {m.copied_bytes_total['to_host']} B in {m.copy_seconds_total['to_host']:.4f} s, "
        f"to_card {m.copied_bytes_total['to_card']} B in {m.copy_seconds_total['to_card']:.4f} s"
    )
