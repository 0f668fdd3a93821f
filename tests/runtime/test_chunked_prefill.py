"""Chunked prefill (`max_prefill_tokens`): a prompt longer than the per-step prefill budget is prefilled
over several steps while the active lanes keep getting one verify round per step.

Exactness: greedy outputs with chunk budgets 1, 3, 7 and one larger than every prompt equal the
unchunked run (`max_prefill_tokens=0`), without a drafter and with the test drafters, on the toy
executor (float64, column by column: bit-exact, and the drafter's own proposals and committed spans
are compared too), on the llama family and on the hybrid Gated DeltaNet family (qwen3_5, with its real
MTP drafter, whose proposals after a chunked prefill must be the unchunked run's). The families' float32
math over a different split of the same columns may differ by ~1e-6: a differing greedy token is
tolerated only at a near-tie of the unchunked run (top-2 margin < NEAR_TIE_MARGIN), as in
test_spec_exactness_families.py; none is expected.

Scheduling: the active lane emits every step while a long prompt is prefilled; prefill order is arrival
order, the lane cut last step continues first, `max_lanes` counts a lane being prefilled; abort between
chunks frees the lane's state and the drafter's lane; the knob is validated with typed errors.
"""

from __future__ import annotations

import asyncio
import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import toy_executor as toy
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.drafters.base import BaseDrafter, CommittedSpan, DraftRequest
from ignis.runtime.drafters.testing import ModelDrafter, always_right, always_wrong
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.errors import ConfigError
from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.scheduler import DEFAULT_MAX_PREFILL_TOKENS, LaneScheduler, check_max_prefill_tokens
from ignis.runtime.server.lanes import LaneLoop, RequestHandle, TokenEvent
from ignis.runtime.server.model import ModelSettings

VOCAB = 50
NEAR_TIE_MARGIN = 1e-4
BUDGETS = (1, 3, 7, 1000)  # 1000: larger than every prompt (one chunk each, still a budget)
TOY_PROMPT_LENGTHS = (9, 40, 3)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _toy_prompts(lengths=TOY_PROMPT_LENGTHS, seed=3, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab, (n,), generator=g).tolist()) for n in lengths]


class Tracing(toy.ToyExecutor):
    """The toy executor, listing the column counts of every prefill forward (logits="last"; verify
    rounds ask for all rows) and taking pooled-slot releases (`release_lane`)."""

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.prefills: list[list[int]] = []
        self.released: list[object] = []

    def forward(self, states, columns, *, logits="all", **kw):
        if logits == "last":
            self.prefills.append([int(c.numel()) for c in columns])
        return super().forward(states, columns, logits=logits, **kw)

    def release_lane(self, state) -> None:
        self.released.append(state)


class Recording(BaseDrafter):
    """Wraps a drafter: records every proposal (lane's prompt -> drafts per round) and every committed
    span (prompt -> spans in order), forwards everything to the inner drafter."""

    def __init__(self, inner, *, needs_hidden_states=False, tap_layers=()) -> None:
        self.inner = inner
        self.name = f"recording-{inner.name}"
        self.is_row_budgeted = inner.is_row_budgeted
        self.needs_hidden_states = needs_hidden_states or inner.needs_hidden_states
        self.tap_layers = tuple(tap_layers) or tuple(inner.tap_layers)
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.proposals: dict[tuple[int, ...], list[list[int]]] = {}
        self.spans: dict[tuple[int, ...], list[CommittedSpan]] = {}
        self.started: list[int] = []
        self.ended: list[int] = []

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        prompt = tuple(prompt_token_ids)
        self.prompts[lane_id] = prompt
        self.proposals[prompt], self.spans[prompt] = [], []
        self.started.append(lane_id)
        self.inner.start_lane(lane_id, prompt_token_ids)

    def end_lane(self, lane_id: int) -> None:
        self.ended.append(lane_id)
        self.inner.end_lane(lane_id)

    def commit(self, spans: Sequence[CommittedSpan]) -> None:
        assert len({s.lane_id for s in spans}) == len(spans), "one span per lane per commit"
        for s in spans:
            self.spans[self.prompts[s.lane_id]].append(s)
        self.inner.commit(spans)

    def propose(self, requests: Sequence[DraftRequest]):
        out = self.inner.propose(requests)
        for req, prop in zip(requests, out, strict=True):
            self.proposals[self.prompts[req.lane_id]].append(prop.draft_token_ids.tolist())
        return out


def _run(ex, prompts, *, budget, max_tokens, drafter=None, k=3, max_lanes=None):
    """All prompts added at once; returns (prompt -> output, engine, per-step updates)."""
    engine = SpeculativeEngine(
        ex, drafter, draft_tokens=k if drafter is not None else None, max_prefill_tokens=budget,
        max_lanes=max_lanes,
    )  # fmt: skip
    ids = {engine.add_lane(p, _greedy(max_tokens)): p for p in prompts}
    steps = []
    while engine.has_unfinished:
        steps.append(engine.step())
        assert len(steps) < 10_000
    return {p: engine.pop_result(i).output_token_ids for i, p in ids.items()}, engine, steps


def _toy_refs(prompts, max_tokens):
    ex = toy.ToyExecutor()
    engine = SpeculativeEngine(ex, max_prefill_tokens=0)
    return {p: engine.generate([p], _greedy(max_tokens))[0].output_token_ids for p in prompts}


# ----------------------------------------------------------------------------- the scheduler's plan


def test_plan_prefill_spends_the_budget_in_queue_order():
    plan = LaneScheduler(draft_tokens=0, max_prefill_tokens=10).plan_prefill
    assert plan([4, 3, 5, 2]) == [4, 3, 3]  # the third lane is cut, the fourth not reached
    assert plan([25, 1]) == [10]
    assert plan([10, 1]) == [10]
    assert plan([]) == []
    assert LaneScheduler(draft_tokens=0, max_prefill_tokens=0).plan_prefill([4000, 3, 9]) == [4000, 3, 9]
    assert LaneScheduler(draft_tokens=0).max_prefill_tokens == DEFAULT_MAX_PREFILL_TOKENS == 2048


@pytest.mark.parametrize("bad", [-1, True, 1.5, "8", None])
def test_the_knob_is_validated_with_typed_errors(bad):
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        check_max_prefill_tokens(bad)
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        LaneScheduler(draft_tokens=0, max_prefill_tokens=bad)
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        SpeculativeEngine(toy.ToyExecutor(), max_prefill_tokens=bad)
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        ModelSettings(spec=SpecDefaults("off"), max_prefill_tokens=bad)
    assert SpeculativeEngine(toy.ToyExecutor(), max_prefill_tokens=0).max_prefill_tokens == 0
    assert SpeculativeEngine(toy.ToyExecutor()).max_prefill_tokens == DEFAULT_MAX_PREFILL_TOKENS


# ----------------------------------------------------------------------------- toy executor: bit-exact


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("kind", ["off", "right", "wrong", "model"])
def test_toy_chunked_equals_unchunked(kind, budget):
    """Outputs, the drafter's proposals and the committed spans (tokens, hidden states, taps) are those
    of the unchunked run; the spans tile positions 0.. in order, chunk by chunk."""
    prompts = _toy_prompts()
    max_tokens = 12
    refs = _toy_refs(prompts, max_tokens)

    def drafter():
        if kind == "off":
            return None
        inner = {
            "right": lambda: always_right(refs, vocab_size=VOCAB),
            "wrong": lambda: always_wrong(refs, vocab_size=VOCAB, seed=1),
            # its own toy model, advanced by the committed spans only: checks every span's start
            "model": lambda: ModelDrafter(toy.ToyExecutor(toy.ToyConfig(seed=5)), mode="greedy"),
        }[kind]()
        return Recording(inner, needs_hidden_states=True, tap_layers=(1, 0))

    d0, d1 = drafter(), drafter()
    base, _, _ = _run(toy.ToyExecutor(), prompts, budget=0, max_tokens=max_tokens, drafter=d0)
    ex = Tracing()
    got, _, _ = _run(ex, prompts, budget=budget, max_tokens=max_tokens, drafter=d1)
    assert base == refs and got == refs
    total = sum(map(len, prompts))
    assert all(sum(cols) <= budget for cols in ex.prefills)
    assert sum(map(sum, ex.prefills)) == total  # every prompt token fed once
    assert len(ex.prefills) == (1 if budget >= total else math.ceil(total / budget))  # budget used up
    if d1 is None:
        return
    if kind != "wrong":  # its wrong tokens come from one random stream shared by the lanes
        assert d1.proposals == d0.proposals
    for p in prompts:
        chunked, whole = d1.spans[p], d0.spans[p]
        assert whole[0].start == 0 and len(whole[0].input_token_ids) == len(p)
        prompt_spans = [s for s in chunked if s.start < len(p)]
        assert len(prompt_spans) >= math.ceil(len(p) / budget)  # one span per chunk
        cat = lambda spans, f: [t for s in spans for t in getattr(s, f)]  # noqa: E731
        assert cat(prompt_spans, "input_token_ids") == list(p)
        assert cat(prompt_spans, "next_token_ids") == [*p[1:], refs[p][0]]
        assert cat(chunked, "input_token_ids") == cat(whole, "input_token_ids")
        assert cat(chunked, "next_token_ids") == cat(whole, "next_token_ids")
        assert torch.equal(
            torch.cat([s.hidden_states for s in chunked]), torch.cat([s.hidden_states for s in whole])
        )
        assert torch.equal(torch.cat([s.taps for s in chunked]), torch.cat([s.taps for s in whole]))
        assert [s.start for s in chunked] == [
            sum(len(x.input_token_ids) for x in chunked[:i]) for i in range(len(chunked))
        ]
    assert sorted(d1.ended) == sorted(d1.started)  # every lane's drafter context was dropped


def test_toy_prefill_budget_per_step_and_state_after_chunks():
    """Each prefill forward carries at most the budget, in arrival order, the cut lane first next step;
    after its last chunk a lane's state equals feeding its prompt at once."""
    prompts = _toy_prompts((10, 4, 6))
    ex = Tracing()
    engine = SpeculativeEngine(ex, max_prefill_tokens=7)
    a, b, c = (engine.add_lane(p, _greedy(3)) for p in prompts)
    assert engine.step() == []  # a: 7 of 10
    assert (engine.num_prefilling, engine.num_waiting, engine.num_active) == (1, 2, 0)
    lane_a = engine._prefilling[0]
    assert toy.ToyExecutor.states_equal(lane_a.state, ex.state_after(prompts[0][:7]))
    engine.step()  # a: last 3 -> active; b: 4 -> active; c: waits (budget spent)
    assert (engine.num_prefilling, engine.num_waiting, engine.num_active) == (0, 1, 2)
    assert toy.ToyExecutor.states_equal(lane_a.state, ex.state_after([*prompts[0], *lane_a.output[:-1]]))
    n = len(ex.calls)
    engine.step()  # c: 6 -> active, then the verify round of a, b, c
    assert ex.prefills == [[7], [3, 4], [6]]
    assert [cols for cols, _ in ex.calls[n:]] == [[6], [1, 1, 1]]
    refs = _toy_refs(prompts, 3)
    while engine.has_unfinished:
        engine.step()
    assert [engine.pop_result(i).output_token_ids for i in (a, b, c)] == [refs[p] for p in prompts]


def test_active_lane_decodes_every_step_while_a_long_prompt_is_prefilled():
    short, long_ = _toy_prompts((2, 100))
    refs = _toy_refs([short, long_], 60)
    ex = Tracing()
    drafter = Recording(always_wrong(refs, vocab_size=VOCAB, seed=2))
    engine = SpeculativeEngine(ex, drafter, draft_tokens=2, max_prefill_tokens=8)
    a = engine.add_lane(short, _greedy(60))
    engine.step()  # a prefilled and decoding
    b = engine.add_lane(long_, _greedy(5))
    steps_b = 0
    while True:
        updates = {u.lane_id: u for u in engine.step()}
        steps_b += 1
        assert a in updates and len(updates[a].new_token_ids) >= 1, "the active lane must emit every step"
        assert engine.num_active + engine.num_prefilling == 2
        if b in updates:
            # its first token, then (as after an unchunked prefill) its first verify round's token
            assert updates[b].new_token_ids == refs[long_][:2]
            break
        assert engine.num_prefilling == 1 and not drafter.proposals[long_]
        assert ex.prefills[-1] == [8]
    assert steps_b == math.ceil(100 / 8) and ex.prefills[-1] == [100 % 8]
    while engine.has_unfinished:
        engine.step()
    assert engine.pop_result(a).output_token_ids == refs[short]
    assert engine.pop_result(b).output_token_ids == refs[long_][:5]


def test_max_lanes_counts_a_lane_being_prefilled():
    """max_lanes=1: while the first lane is prefilled (budget left over at its last chunk) and while it
    decodes, no other lane starts."""
    prompts = _toy_prompts((20, 3, 3))
    ex = Tracing()
    engine = SpeculativeEngine(ex, max_lanes=1, max_prefill_tokens=8)
    ids = [engine.add_lane(p, _greedy(6)) for p in prompts]
    engine.step()
    engine.step()
    assert (engine.num_prefilling, engine.num_waiting) == (1, 2)
    while engine.has_unfinished:
        engine.step()
        assert engine.num_active + engine.num_prefilling <= 1
    assert ex.prefills == [[8], [8], [4], [3], [3]]
    refs = _toy_refs(prompts, 6)
    assert [engine.pop_result(i).output_token_ids for i in ids] == [refs[p] for p in prompts]


def test_abort_mid_prefill_frees_the_lane():
    short, long_ = _toy_prompts((3, 30))
    refs = _toy_refs([short, long_], 10)
    ex = Tracing()
    drafter = Recording(ModelDrafter(toy.ToyExecutor(toy.ToyConfig(seed=5)), mode="greedy"))
    engine = SpeculativeEngine(ex, drafter, draft_tokens=2, max_prefill_tokens=10)
    a = engine.add_lane(short, _greedy(10))
    engine.step()
    b = engine.add_lane(long_, _greedy(10))
    engine.step()
    engine.step()
    assert engine.num_prefilling == 1
    state = engine._prefilling[0].state
    assert state.num_tokens == 20
    engine.abort(b)
    assert engine.num_prefilling == 0 and ex.released == [state]
    assert b in drafter.ended and b not in drafter.inner._states
    res = engine.pop_result(b)
    assert (res.finish_reason, res.output_token_ids, res.num_rounds) == ("abort", (), 0)
    n = len(ex.prefills)
    c = engine.add_lane(long_, _greedy(10))  # the same prompt again, from scratch
    while engine.has_unfinished:
        engine.step()
    assert ex.prefills[n:] == [[10], [10], [10]]
    assert engine.pop_result(a).output_token_ids == refs[short]
    assert engine.pop_result(c).output_token_ids == refs[long_]


def test_stop_on_the_first_token_after_a_chunked_prefill():
    """The first token is an eos: the lane finishes at its last chunk; the drafter, started at the
    first chunk, gets end_lane; max_tokens=1 likewise."""
    (prompt,) = _toy_prompts((17,))
    refs = _toy_refs([prompt], 4)
    for params in (
        SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[refs[prompt][0]]),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
    ):
        drafter = Recording(always_right(refs, vocab_size=VOCAB))
        engine = SpeculativeEngine(toy.ToyExecutor(), drafter, draft_tokens=2, max_prefill_tokens=5)
        lane = engine.add_lane(prompt, params)
        updates = [engine.step() for _ in range(4)]
        assert [u for u in updates[:3]] == [[], [], []]
        assert updates[3][0].new_token_ids == refs[prompt][:1] and updates[3][0].is_finished
        assert not engine.has_unfinished and drafter.ended == drafter.started == [lane]
        assert engine.pop_result(lane).output_token_ids == refs[prompt][:1]


def test_lane_loop_counts_a_lane_being_prefilled_as_active_on_every_step():
    """/health and the gauges (`LaneLoop.snapshot`): a request whose prompt is prefilled over several
    steps is active from its first chunk on, the one behind it waiting (one lane)."""
    (prompt,) = _toy_prompts((20,))
    lanes = LaneLoop(
        lambda n, m: SpeculativeEngine(toy.ToyExecutor(), max_lanes=n, max_prefill_tokens=6, metrics=m),
        max_lanes=1,
        queue_size=4,
    )
    loop = asyncio.new_event_loop()
    try:
        handles = [RequestHandle(prompt, _greedy(2), loop) for _ in range(2)]
        for h in handles:  # what `submit` queues (it needs the lane thread running)
            lanes._num_inflight += 1
            lanes._ops.append(("add", h))
        snapshots = []
        while lanes._engine.has_unfinished or lanes._ops:
            lanes._run_once()  # the lane thread's loop body: queued operations, one step, publish
            snapshots.append((lanes.snapshot.num_active, lanes.snapshot.num_waiting))
        # 20 prompt tokens in chunks of 6, 6, 6, 2 (the last with the first token and a verify round:
        # max_tokens reached), then the second request likewise
        assert snapshots == [(1, 1)] * 3 + [(1, 0)] * 4 + [(0, 0)]
        assert handles[0].num_emitted == handles[1].num_emitted == 2
        loop.run_until_complete(asyncio.sleep(0))
        events = [handles[0]._queue.get_nowait() for _ in range(handles[0]._queue.qsize())]
        assert all(isinstance(e, TokenEvent) for e in events) and events[-1].finish_reason == "length"
    finally:
        loop.close()


def test_sampled_lanes_are_reproducible_whatever_the_chunking():
    """A seeded sampled lane draws its first token once, after its last chunk: same outputs."""
    prompts = _toy_prompts((23, 5))
    params = [SamplingParams(temperature=0.8, max_tokens=8, seed=s, ignore_eos=True) for s in (7, 8)]
    outs = []
    for budget in (0, 4):
        engine = SpeculativeEngine(toy.ToyExecutor(), max_prefill_tokens=budget)
        outs.append([r.output_token_ids for r in engine.generate(prompts, params)])
    assert outs[0] == outs[1]


# ----------------------------------------------------------------------------- the families


def _check_equal(ex, got: dict, ref: dict, label: str) -> None:
    """got == ref per prompt, up to a near-tie of the unchunked run (module docstring)."""
    for prompt, out in got.items():
        want = ref[prompt]
        if out == want:
            continue
        i = next((j for j, (x, y) in enumerate(zip(out, want, strict=False)) if x != y), len(want))
        assert i < min(len(out), len(want)), f"{label}: lengths differ: {out} vs {want}"
        st = ex.new_lane()
        logits = ex.forward([st], [torch.tensor([*prompt, *want[:i]])], logits="last", record=False).logits
        ex.commit([st], [0])
        top2 = torch.topk(logits[0][-1].double(), 2).values
        margin = float(top2[0] - top2[1])
        assert margin < NEAR_TIE_MARGIN, (
            f"{label}: token {i} differs ({out[i]} vs {want[i]}), margin {margin:.3g}"
        )
        warnings.warn(f"{label}: near-tie at token {i} (margin {margin:.2g}) tolerated", stacklevel=2)


FAMILY_PROMPT_LENGTHS = (5, 70, 12)  # one past the 64-column Gated DeltaNet chunk
FAMILY_MAX_TOKENS = 8


class _Family:
    def __init__(self, name: str, base: Path) -> None:
        from ignis.runtime.families import get_family

        self.name = name
        self.drafters = {}
        if name == "llama":
            import hf_tiny

            from ignis.compiler.importers import load_checkpoint

            folder = hf_tiny.save_tiny(hf_tiny.tiny_model("llama", seed=0), base / "ckpt")
            ckpt = load_checkpoint(folder)
            config, weights = ckpt.config, ckpt.tensors.load_all()
        else:
            import hf_tiny_hybrid

            from ignis.runtime.drafters.dflash2 import build_dflash2_drafter
            from ignis.runtime.drafters.mtp import build_mtp_drafter, load_mtp_checkpoint
            from ignis.runtime.families.qwen3_5 import canonicalize_moe_tensors
            from ignis.tools.make_test_drafter import make_dflash2_drafter, make_mtp_drafter

            tiny = hf_tiny_hybrid.make_tiny_hybrid(name, base / "target")
            make_mtp_drafter(tiny.folder, base / "with_mtp", seed=11)
            # a sliding window of 8: the drafter's context is trimmed across the chunks of a prompt
            make_dflash2_drafter(tiny.folder, base / "dflash2", seed=12, sliding_window=8)
            config, tensors = load_mtp_checkpoint(base / "with_mtp")
            weights = canonicalize_moe_tensors(config, tensors)
            self.drafters = {
                "mtp": lambda: build_mtp_drafter(target_config=config, target_weights=tensors),
                "dflash2": lambda: build_dflash2_drafter(
                    target_config=config, target_weights=tensors, checkpoint=base / "dflash2"
                ),
            }
        self.weights = weights
        self.ex = get_family(config.model_type).make_executor(config, weights, "cpu", torch.float32)
        g = torch.Generator().manual_seed(1)
        self.prompts = [
            tuple(torch.randint(3, config.vocab_size, (n,), generator=g).tolist())
            for n in FAMILY_PROMPT_LENGTHS
        ]
        self.refs, _, _ = _run(self.ex, self.prompts, budget=0, max_tokens=FAMILY_MAX_TOKENS)
        self.vocab = config.vocab_size


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    made: dict[str, _Family] = {}

    def get(name: str) -> _Family:
        if name not in made:
            made[name] = _Family(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("kind", ["off", "right", "wrong"])
@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_family_chunked_equals_unchunked(family, name, kind, budget):
    fam = family(name)
    drafter = {
        "off": lambda: None,
        "right": lambda: always_right(fam.refs, vocab_size=fam.vocab),
        "wrong": lambda: always_wrong(fam.refs, vocab_size=fam.vocab, seed=1),
    }[kind]()
    got, engine, _ = _run(fam.ex, fam.prompts, budget=budget, max_tokens=FAMILY_MAX_TOKENS, drafter=drafter)
    _check_equal(fam.ex, got, fam.refs, f"{name} {kind} budget={budget}")
    assert all(len(o) == FAMILY_MAX_TOKENS for o in got.values())
    if kind == "wrong":
        assert engine.metrics.accepted_tokens_total == engine.metrics.rounds_total > 0
    if kind == "right":
        assert engine.metrics.accepted_tokens_total > engine.metrics.rounds_total


@pytest.mark.parametrize("budget", [3, 64, 1000])
@pytest.mark.parametrize("backend", ["mtp", "dflash2"])
def test_hybrid_real_drafters_draft_after_a_chunked_prefill_as_after_an_unchunked_one(
    family, backend, budget
):
    """The real drafters (MTP reads each span's hidden states, DFlash2 its taps; both check each span's
    start): every round's proposals equal those after an unchunked prefill. One lane at a time, so that
    MTP's row budget (drafts per lane by the number of lanes decoding) is the same in both runs."""
    fam = family("qwen3_5")
    for prompt in fam.prompts:
        whole, chunked = Recording(fam.drafters[backend]()), Recording(fam.drafters[backend]())
        base, e0, _ = _run(fam.ex, [prompt], budget=0, max_tokens=FAMILY_MAX_TOKENS, drafter=whole)
        got, e1, _ = _run(fam.ex, [prompt], budget=budget, max_tokens=FAMILY_MAX_TOKENS, drafter=chunked)
        _check_equal(fam.ex, base, fam.refs, f"qwen3_5 {backend} unchunked")
        _check_equal(fam.ex, got, fam.refs, f"qwen3_5 {backend} budget={budget}")
        assert chunked.proposals == whole.proposals
        assert e1.metrics.rounds_total == e0.metrics.rounds_total > 0
        assert len(chunked.spans[prompt]) - len(whole.spans[prompt]) == math.ceil(len(prompt) / budget) - 1


@pytest.mark.parametrize("budget", [3, 20, 1000])
def test_pooled_static_hybrid_executor_chunked_equals_unchunked_and_abort_frees_the_slot(family, budget):
    """The fixed-capacity hybrid executor (CPU: eager static rounds, no graphs): chunks of at most
    max_columns run as static rounds, longer ones as its internal chunked prefill (chunked_prefill=32)
    or eagerly; outputs equal the unchunked run's, and a lane aborted between chunks gives its pool
    slot back."""
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor

    fam = family("qwen3_5")
    ex = StaticHybridExecutor(
        fam.ex.config, fam.weights, max_lanes=3, max_context=120, kv_bucket=16, chunked_prefill=32
    )
    got, _, _ = _run(ex, fam.prompts, budget=budget, max_tokens=FAMILY_MAX_TOKENS)
    _check_equal(fam.ex, got, fam.refs, f"static qwen3_5 budget={budget}")
    assert ex.num_free_lanes == 3
    drafter = always_wrong(fam.refs, vocab_size=fam.vocab, seed=1)
    engine = SpeculativeEngine(ex, drafter, draft_tokens=3, max_prefill_tokens=budget)
    a = engine.add_lane(fam.prompts[0], _greedy(FAMILY_MAX_TOKENS))
    while engine.num_active == 0:
        engine.step()
    b = engine.add_lane(fam.prompts[1], _greedy(FAMILY_MAX_TOKENS))  # 70 tokens
    engine.step()
    if budget < len(fam.prompts[1]):
        assert engine.num_prefilling == 1 and ex.num_free_lanes == 1
        engine.abort(b)
        assert ex.num_free_lanes == 2 and engine.pop_result(b).finish_reason == "abort"
    while engine.has_unfinished:
        engine.step()
    _check_equal(fam.ex, {fam.prompts[0]: engine.pop_result(a).output_token_ids}, fam.refs, "static a")
    assert ex.num_free_lanes == 3


@pytest.mark.parametrize("chunked_prefill", [32, 0])
def test_pooled_executor_near_its_capacity_with_a_short_last_chunk_beside_a_long_one(family, chunked_prefill):
    """One forward of the fixed-capacity executor can hold a lane far into its prompt (a short last
    chunk) beside a fresh lane with a long chunk: max_context 100, budget 64, prompts of 70 and 60 --
    step 2 prefills the first's last 6 tokens (from 64) and the second's first 58 together. The keys
    read are each lane's own (at most the capacity), and the outputs equal the unchunked run's."""
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor

    fam = family("qwen3_5")
    g = torch.Generator().manual_seed(5)
    prompts = [tuple(torch.randint(3, fam.vocab, (n,), generator=g).tolist()) for n in (70, 60)]
    outs = {}
    for budget in (0, 64):
        ex = StaticHybridExecutor(
            fam.ex.config,
            fam.weights,
            max_lanes=2,
            max_context=100,
            kv_bucket=16,
            chunked_prefill=chunked_prefill,
        )
        outs[budget], _, _ = _run(ex, prompts, budget=budget, max_tokens=4)
    ref, _, _ = _run(fam.ex, prompts, budget=0, max_tokens=4)
    _check_equal(fam.ex, outs[64], ref, "chunked near the capacity")
    _check_equal(fam.ex, outs[0], ref, "unchunked near the capacity")
