"""The draft-model drafter: exactness, state rollback, cost, tokenizer refusal, sampling distribution.

- Greedy exactness: speculation on equals speculation off, token for token, on tiny llama / qwen2
  targets (tests/hf_tiny.py), for draft tokens {1, 3, 7} x lanes {1, 3}, with three draft models:
  the target's own weights ("self": every draft accepted, so long runs and the kept pending prefix
  are exercised), the same weights in bfloat16 ("bf16": mostly accepted, some rejections) and another
  random model ("other": nearly every draft rejected). A difference is tolerated only where the
  speculation-off run's top-2 logit margin at the first differing token is below NEAR_TIE_MARGIN
  (float32 logits; verify rounds and decode rounds batch columns differently), and reported.
- The drafter's state after every round equals the state of a fresh lane fed the committed tokens
  alone: bit for bit on the toy model (recurrent + attention layers, float64, batching-independent),
  and to float tolerance on llama.
- Cost: k forwards of the draft model per round, none at commit. Kept drafts (an executor that can
  rewind: llama / qwen2, and a rewindable toy model here): one column per step, k or k + 1 columns
  per round; re-run drafts (no rewind): 1 + 1 + 2 + .. + (k - 1) columns plus the catch-up.
- The two schedules propose the same drafts (and q) on the same inputs: bit for bit on the toy model.
- The tokenizer check refuses a mismatch with a typed error naming the first differing id.
- Sampling: chi-square goodness of fit of the first output tokens against the model's exact
  distribution (toy model, enumerated), as tests/runtime/test_engine.py does, at ALPHA = 1e-6.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import warnings
from functools import cache
from pathlib import Path

import pytest
import torch
from sampling_checks import exact_joint, pooled_chi2
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.compiler.importers import load_checkpoint
from ignis.runtime.drafters import DRAFTERS, get_drafter_factory
from ignis.runtime.drafters.common import DrafterFitError
from ignis.runtime.drafters.draft_model import (
    DraftModelDrafter,
    TokenizerMismatchError,
    build_draft_model_drafter,
    check_tokenizers_match,
    rewinder_for,
)
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.errors import ConfigError, StateError
from ignis.runtime.families import get_family
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.tokenizer import TokenizerSpec


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parents[1] / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


hf_tiny = _load("hf_tiny")
toy = _load("toy_executor")

NEAR_TIE_MARGIN = 1e-4  # logits units (module docstring)
MAX_TOKENS = 16
PROMPT_LENGTHS = (5, 40, 12)
VOCAB = 384
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@cache
def _models(family: str):
    """(target, {draft kind: executor}, tokenizer spec) for one tiny family."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"ignis-dm-{family}-"))
    target_ckpt = load_checkpoint(
        hf_tiny.save_tiny(
            hf_tiny.tiny_model(family, seed=0), folder / "target", tokenizer=hf_tiny.tiny_tokenizer()
        )
    )
    other_ckpt = load_checkpoint(hf_tiny.save_tiny(hf_tiny.tiny_model(family, seed=1), folder / "other"))
    fam = get_family(family)
    weights = target_ckpt.tensors.load_all()
    target = fam.make_executor(target_ckpt.config, weights, "cpu", torch.float32)
    drafts = {
        "self": fam.make_executor(target_ckpt.config, weights, "cpu", torch.float32),
        "bf16": fam.make_executor(target_ckpt.config, weights, "cpu", torch.bfloat16),
        "other": fam.make_executor(other_ckpt.config, other_ckpt.tensors.load_all(), "cpu", torch.float32),
    }
    return target, drafts, target_ckpt.tokenizer


def _prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, VOCAB, (PROMPT_LENGTHS[i],), generator=g).tolist()) for i in range(n)]


@cache
def _spec_off(family: str, prompt: tuple[int, ...]) -> tuple[int, ...]:
    target = _models(family)[0]
    return SpeculativeEngine(target).generate([prompt], GREEDY)[0].output_token_ids


def _assert_greedy_equal(family, prompt, got, ref, label):
    if got == ref:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
    assert i < min(len(got), len(ref)), f"{label}: lengths differ with equal prefixes: {got} vs {ref}"
    target = _models(family)[0]
    st = target.new_lane()
    out = target.forward([st], [torch.tensor([*prompt, *ref[:i]])], logits="last", record=False)
    target.commit([st], [0])
    top2 = torch.topk(out.logits[0][-1].double(), 2).values
    margin = float(top2[0] - top2[1])
    assert margin < NEAR_TIE_MARGIN, f"{label}: token {i} differs ({got[i]} vs {ref[i]}), margin {margin:.3g}"
    warnings.warn(f"{label}: near-tie at token {i} (margin {margin:.2g}) tolerated", stacklevel=2)


def _run_with_late_lane(engine, prompts, params):
    """All prompts but the last join at once; the last joins after two steps. Returns results in order."""
    late = prompts[-1] if len(prompts) > 1 else None
    ids = [engine.add_lane(p, params) for p in (prompts[:-1] if late else prompts)]
    steps = 0
    while engine.has_unfinished or late:
        engine.step()
        steps += 1
        if late and steps == 2:
            ids.append(engine.add_lane(late, params))
            late = None
    return [engine.pop_result(i) for i in ids]


# ----------------------------------------------------------------------------- greedy exactness


@pytest.mark.parametrize("num_lanes", [1, 3])
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("draft", ["self", "bf16", "other"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_spec_on_equals_spec_off(family, draft, k, num_lanes):
    target, drafts, _ = _models(family)
    prompts = _prompts(num_lanes)
    drafter = DraftModelDrafter(drafts[draft])
    engine = SpeculativeEngine(target, drafter, draft_tokens=k)
    results = _run_with_late_lane(engine, prompts, GREEDY)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.finish_reason == "length" and len(res.output_token_ids) == MAX_TOKENS
        ref = _spec_off(family, prompt)
        _assert_greedy_equal(
            family, prompt, res.output_token_ids, ref, f"{family} {draft} k={k} lanes={num_lanes}"
        )
    m = engine.metrics
    assert m.rounds_total > 0
    if draft == "self":  # every draft is the target's own argmax: all accepted (up to the length cap)
        assert m.accepted_tokens_total > m.rounds_total * min(k, 2)
    if draft == "other":
        assert m.accepted_tokens_total < 1.5 * m.rounds_total
    assert not drafter._lanes  # every lane ended


# ----------------------------------------------------------------------------- state and cost


class _CountingExecutor:
    """Wraps an executor and counts forward calls and columns."""

    def __init__(self, inner):
        self.inner = inner
        self.config = inner.config
        self.num_forwards = 0
        self.num_columns = 0
        self.num_commits = 0

    def new_lane(self):
        return self.inner.new_lane()

    def forward(self, states, columns, **kw):
        self.num_forwards += 1
        self.num_columns += sum(int(c.numel()) for c in columns)
        return self.inner.forward(states, columns, **kw)

    def commit(self, states, num_keep):
        self.num_commits += 1
        return self.inner.commit(states, num_keep)


@pytest.mark.parametrize("draft_seed", [0, 1], ids=["same-model", "other-model"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_toy_state_after_every_round_equals_feeding_the_committed_tokens(draft_seed, k):
    """Bit-exact on the toy model (a recurrent layer + attention), 3 lanes, greedy and sampled lanes."""
    target = toy.ToyExecutor()
    draft_ex = toy.ToyExecutor(toy.ToyConfig(seed=draft_seed))
    drafter = DraftModelDrafter(draft_ex)
    engine = SpeculativeEngine(target, drafter, draft_tokens=k)
    g = torch.Generator().manual_seed(3)
    prompts = [tuple(torch.randint(0, 50, (n,), generator=g).tolist()) for n in (3, 17, 8)]
    params = [
        SamplingParams(temperature=0, max_tokens=30),
        SamplingParams(temperature=0.9, max_tokens=30, seed=5),
        SamplingParams(temperature=1.2, top_k=5, max_tokens=30, seed=6),
    ]
    tokens = {engine.add_lane(p, sp): list(p) for p, sp in zip(prompts, params, strict=True)}
    checked = 0
    while engine.has_unfinished:
        for u in engine.step():
            tokens[u.lane_id].extend(u.new_token_ids)
            if u.is_finished:
                assert u.lane_id not in drafter._lanes
                continue
            assert drafter.lane_tokens(u.lane_id) == tuple(tokens[u.lane_id])
            n = drafter.num_fed(u.lane_id)
            assert n <= len(tokens[u.lane_id]) - 1  # the anchor is never fed between rounds
            ref = draft_ex.state_after(tokens[u.lane_id][:n])
            assert toy.ToyExecutor.states_equal(drafter.lane_state(u.lane_id), ref)
            checked += 1
    assert checked >= 6


def test_llama_state_after_a_round_equals_feeding_the_committed_tokens():
    """float32 llama: the kept keys/values and the next logits match a fresh lane to float tolerance."""
    target, drafts, _ = _models("llama")
    draft_ex = drafts["bf16"]  # mixed acceptance: rounds keep 0..k-1 pending columns
    drafter = DraftModelDrafter(draft_ex)
    engine = SpeculativeEngine(target, drafter, draft_tokens=5)
    prompt = _prompts(1)[0]
    lane = engine.add_lane(prompt, SamplingParams(temperature=0, max_tokens=40))
    tokens = list(prompt)
    rounds = 0
    while engine.has_unfinished:
        for u in engine.step():
            tokens.extend(u.new_token_ids)
            if u.is_finished:
                continue
            n = drafter.num_fed(lane)
            st = drafter.lane_state(lane)
            ref = draft_ex.new_lane()
            draft_ex.forward([ref], [torch.tensor(tokens[:n])], logits="last", record=False)
            draft_ex.commit([ref], [n])
            torch.testing.assert_close(
                st.kv[..., :n, :].float(), ref.kv[..., :n, :].float(), atol=2e-2, rtol=2e-2
            )
            rounds += 1
    assert rounds > 5


@pytest.mark.parametrize("k", [1, 4, 7])
def test_k_forwards_per_round_and_none_at_commit(k):
    target = toy.ToyExecutor()
    counting = _CountingExecutor(toy.ToyExecutor())
    drafter = DraftModelDrafter(counting)
    engine = SpeculativeEngine(target, drafter, draft_tokens=k)
    engine.add_lane((1, 2, 3, 4), SamplingParams(temperature=0, max_tokens=200))
    engine.step()  # prefill + round 1
    for _ in range(10):
        before = counting.num_forwards
        engine.step()
        assert counting.num_forwards - before == k
    # columns per round: the unfed confirmed tokens (1..k+1) + 1 + 2 + ... + (k - 1)
    assert counting.num_columns <= 11 * ((k + 1) + k * (k - 1) // 2) + 4


class _RewindToy(toy.ToyExecutor):
    """The toy model plus `rewind` (test-only): each lane keeps its conv and recurrent state at every
    committed length it passed through, so rewinding to one of them is exact."""

    def new_lane(self):
        st = super().new_lane()
        st.snaps = {0: (st.h, st.conv)}
        return st

    def commit(self, states, num_keep):
        super().commit(states, num_keep)
        for st in states:
            st.snaps[st.committed] = (st.h, st.conv)

    def rewind(self, states, num_tokens):
        for i, (st, n) in enumerate(zip(states, num_tokens, strict=True)):
            if st.pending is not None or not 0 <= n <= st.committed or n not in st.snaps:
                raise StateError(f"lane {i}: cannot rewind to {n}")
        for st, n in zip(states, num_tokens, strict=True):
            st.keys, st.values = st.keys[:n], st.values[:n]
            st.h, st.conv = st.snaps[n]
            st.committed = n
            st.snaps = {m: v for m, v in st.snaps.items() if m <= n}


class _CountingRewind(_CountingExecutor):
    """`_CountingExecutor` that forwards the inner executor's rewind (`rewinder_for`) and counts it."""

    def __init__(self, inner):
        super().__init__(inner)
        self._inner_rewind = rewinder_for(inner)
        assert self._inner_rewind is not None
        self.num_rewinds = 0

    def rewind(self, states, num_tokens):
        self.num_rewinds += 1
        self._inner_rewind(states, num_tokens)


def test_schedule_choice():
    """Kept drafts wherever the executor rewinds (llama / qwen2, an own `rewind`), else re-run."""
    _, drafts, _ = _models("llama")
    assert DraftModelDrafter(drafts["other"]).keeps_drafts
    assert not DraftModelDrafter(drafts["other"], keep_drafts=False).keeps_drafts
    assert DraftModelDrafter(_RewindToy()).keeps_drafts
    assert not DraftModelDrafter(toy.ToyExecutor()).keeps_drafts
    assert not DraftModelDrafter(_CountingExecutor(drafts["other"])).keeps_drafts  # a wrapper: unknown
    with pytest.raises(ConfigError, match="rewind"):
        DraftModelDrafter(toy.ToyExecutor(), keep_drafts=True)


def test_llama_rewind_checks_its_arguments():
    _, drafts, _ = _models("qwen2")
    ex = drafts["other"]
    rewind = rewinder_for(ex)
    assert rewind is not None and rewinder_for(drafts["bf16"]) is not None
    st = ex.new_lane()
    ex.forward([st], [torch.tensor([5, 6, 7, 8])], logits="last", record=False)
    ex.commit([st], [4])
    with pytest.raises(StateError, match="outside"):
        rewind([st], [5])
    with pytest.raises(StateError, match="not created"):
        rewind([drafts["bf16"].new_lane()], [0])
    ex.forward([st], [torch.tensor([9])], logits="last", record=True)
    with pytest.raises(StateError, match="pending"):
        rewind([st], [2])
    ex.commit([st], [0])
    rewind([st], [2])
    assert st.num_tokens == 2
    # the rewound lane continues exactly like a lane fed the two tokens alone
    out = ex.forward([st], [torch.tensor([11, 12])], logits="all", record=False)
    ex.commit([st], [2])
    ref = ex.new_lane()
    want = ex.forward([ref], [torch.tensor([5, 6, 11, 12])], logits="all", record=False)
    ex.commit([ref], [4])
    torch.testing.assert_close(out.logits[0], want.logits[0][2:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("draft_seed", [0, 1], ids=["same-model", "other-model"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_kept_drafts_state_after_every_round_equals_feeding_the_committed_tokens(draft_seed, k):
    """Kept-drafts schedule, bit-exact on the rewindable toy model, greedy and sampled lanes."""
    target = toy.ToyExecutor()
    draft_ex = _RewindToy(toy.ToyConfig(seed=draft_seed))
    drafter = DraftModelDrafter(draft_ex)
    assert drafter.keeps_drafts
    engine = SpeculativeEngine(target, drafter, draft_tokens=k)
    g = torch.Generator().manual_seed(3)
    prompts = [tuple(torch.randint(0, 50, (n,), generator=g).tolist()) for n in (3, 17, 8)]
    params = [
        SamplingParams(temperature=0, max_tokens=30),
        SamplingParams(temperature=0.9, max_tokens=30, seed=5),
        SamplingParams(temperature=1.2, top_k=5, max_tokens=30, seed=6),
    ]
    tokens = {engine.add_lane(p, sp): list(p) for p, sp in zip(prompts, params, strict=True)}
    checked = 0
    while engine.has_unfinished:
        for u in engine.step():
            tokens[u.lane_id].extend(u.new_token_ids)
            if u.is_finished:
                continue
            assert drafter.lane_tokens(u.lane_id) == tuple(tokens[u.lane_id])
            n = drafter.num_fed(u.lane_id)
            assert n <= len(tokens[u.lane_id]) - 1
            ref = draft_ex.state_after(tokens[u.lane_id][:n])
            assert toy.ToyExecutor.states_equal(drafter.lane_state(u.lane_id), ref)
            checked += 1
    assert checked >= 6


class _Recorder:
    """A drafter wrapper recording every propose (requests with a copy of each lane's random stream
    as it was before the call, and the proposals) and commit, in order."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.is_row_budgeted = inner.is_row_budgeted
        self.needs_hidden_states = inner.needs_hidden_states
        self.tap_layers = inner.tap_layers
        self.log = []

    def start_lane(self, lane_id, prompt):
        self.log.append(("start", lane_id, tuple(prompt)))
        self.inner.start_lane(lane_id, prompt)

    def end_lane(self, lane_id):
        self.log.append(("end", lane_id))
        self.inner.end_lane(lane_id)

    def propose(self, requests):
        copies = []
        for r in requests:
            g = torch.Generator(device=r.generator.device)
            g.set_state(r.generator.get_state())
            copies.append(dataclasses.replace(r, token_ids=tuple(r.token_ids), generator=g))
        out = self.inner.propose(requests)
        self.log.append(("propose", copies, out))
        return out

    def commit(self, spans):
        self.log.append(("commit", list(spans)))
        self.inner.commit(spans)


@pytest.mark.parametrize("draft_seed", [0, 1], ids=["same-model", "other-model"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_kept_and_rerun_schedules_propose_the_same_drafts(draft_seed, k):
    """Replaying a kept-drafts run's calls on a re-run drafter gives identical drafts and q, bit for
    bit (toy model, float64), while the re-run one runs more columns (k >= 3)."""
    kept = _CountingRewind(_RewindToy(toy.ToyConfig(seed=draft_seed)))
    rec = _Recorder(DraftModelDrafter(kept))
    assert rec.inner.keeps_drafts
    engine = SpeculativeEngine(toy.ToyExecutor(), rec, draft_tokens=k)
    g = torch.Generator().manual_seed(4)
    prompts = [tuple(torch.randint(0, 50, (n,), generator=g).tolist()) for n in (6, 11, 3)]
    params = [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=1.0, max_tokens=40, seed=8),
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=40, seed=9),
    ]
    engine.generate(prompts, params)
    rerun_ex = _CountingExecutor(toy.ToyExecutor(toy.ToyConfig(seed=draft_seed)))
    rerun = DraftModelDrafter(rerun_ex)
    assert not rerun.keeps_drafts
    proposals = 0
    for entry in rec.log:
        if entry[0] == "start":
            rerun.start_lane(entry[1], entry[2])
        elif entry[0] == "end":
            rerun.end_lane(entry[1])
        elif entry[0] == "commit":
            rerun.commit(entry[1])
        else:
            _, requests, want = entry
            got = rerun.propose(requests)
            for w, gp in zip(want, got, strict=True):
                assert torch.equal(w.draft_token_ids, gp.draft_token_ids)
                assert (w.draft_probs is None) == (gp.draft_probs is None)
                if w.draft_probs is not None:
                    assert torch.equal(w.draft_probs, gp.draft_probs)
            proposals += 1
    assert proposals >= 5
    assert kept.num_forwards == rerun_ex.num_forwards  # k forwards per proposal either way
    if k >= 3:
        assert kept.num_columns < rerun_ex.num_columns


@pytest.mark.parametrize("draft", ["self", "other"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("kind", ["toy", "qwen2"])
def test_kept_drafts_cost_k_or_k_plus_1_columns_per_round(kind, draft, k):
    """Per round: k forwards of one column each, plus the last draft when all k were accepted (fed
    in step 1 with the new anchor); nothing at commit but one rewind call."""
    if kind == "toy":
        target = toy.ToyExecutor()
        inner = _RewindToy(toy.ToyConfig(seed=0 if draft == "self" else 1))
        prompt = (1, 2, 3, 4)
    else:
        target, drafts, _ = _models("qwen2")
        inner = drafts[draft]
        prompt = _prompts(1)[0]
    counting = _CountingRewind(inner)
    drafter = DraftModelDrafter(counting)
    engine = SpeculativeEngine(target, drafter, draft_tokens=k)
    lane = engine.add_lane(prompt, SamplingParams(temperature=0, max_tokens=60))
    engine.step()  # prefill + round 1 (feeds the prompt)
    rounds, all_accepted = 0, 0
    accepted_before = engine.metrics.accepted_tokens_total
    for _ in range(8):
        fwd, cols, commits = counting.num_forwards, counting.num_columns, counting.num_commits
        fed_before = drafter.num_fed(lane)
        engine.step()
        if not engine.has_unfinished:
            break
        assert counting.num_forwards - fwd == k  # k steps
        assert counting.num_commits - commits == k  # each step committed at once, none at commit
        # the catch-up: one column (the anchor), or two when the previous round accepted all k
        catch_up = counting.num_columns - cols - (k - 1)
        assert catch_up in (1, 2)
        all_accepted += catch_up == 2
        assert drafter.num_fed(lane) >= fed_before
        rounds += 1
    assert rounds >= 3
    accepted = engine.metrics.accepted_tokens_total - accepted_before
    if draft == "self":  # the target's own model drafts: every draft is accepted
        assert all_accepted == rounds and accepted >= rounds * k
    else:
        assert all_accepted < rounds


@pytest.mark.parametrize("draft", ["bf16", "other"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_rerun_schedule_still_exact(family, draft):
    """The re-run schedule (executors without rewind) on llama / qwen2 targets and drafts."""
    target, drafts, _ = _models(family)
    prompts = _prompts(3)
    drafter = DraftModelDrafter(drafts[draft], keep_drafts=False)
    engine = SpeculativeEngine(target, drafter, draft_tokens=3)
    for prompt, res in zip(prompts, _run_with_late_lane(engine, prompts, GREEDY), strict=True):
        _assert_greedy_equal(
            family, prompt, res.output_token_ids, _spec_off(family, prompt), f"{family} {draft} re-run"
        )


def test_ended_lanes_go_back_to_a_pooled_executor():
    """An executor with `release_lane` (pooled lane slots) gets every ended lane's state back."""

    class Pooled(_RewindToy):
        def release_lane(self, state):
            self.released.append(state)

    draft_ex = Pooled()
    draft_ex.released = []
    drafter = DraftModelDrafter(draft_ex)
    engine = SpeculativeEngine(toy.ToyExecutor(), drafter, draft_tokens=3)
    engine.generate([(1, 2, 3), (4, 5)], SamplingParams(temperature=0, max_tokens=8))
    assert len(draft_ex.released) == 2 and not drafter._lanes


def test_draft_context_end_gives_zero_drafts():
    """A draft model with a shorter context stops drafting instead of failing."""
    target = toy.ToyExecutor(toy.ToyConfig(max_position_embeddings=64))
    draft_ex = toy.ToyExecutor(toy.ToyConfig(max_position_embeddings=20))
    engine = SpeculativeEngine(target, DraftModelDrafter(draft_ex), draft_tokens=3)
    prompt = (1, 2, 3, 4, 5)
    res = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    ref = SpeculativeEngine(target).generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    assert res.output_token_ids == ref.output_token_ids


def test_vocab_fitting():
    """Draft logits wider than the target's vocabulary are cut; narrower ones padded with zeros in q."""
    draft_ex = toy.ToyExecutor(toy.ToyConfig(vocab_size=60))
    d = DraftModelDrafter(draft_ex, vocab_size=50)
    assert d._fit(torch.randn(2, 60)).shape == (2, 50)
    d = DraftModelDrafter(toy.ToyExecutor(toy.ToyConfig(vocab_size=40)), vocab_size=50)
    fitted = d._fit(torch.randn(40))
    assert fitted.shape == (50,) and torch.isinf(fitted[40:]).all()
    # a committed id past the draft vocabulary (40..49) stops drafting for that lane, without error
    target = toy.ToyExecutor()
    prompt = (1, 2, 3)
    engine = SpeculativeEngine(target, d, draft_tokens=3)
    res = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30))[0]
    ref = SpeculativeEngine(target).generate([prompt], SamplingParams(temperature=0, max_tokens=30))[0]
    assert res.output_token_ids == ref.output_token_ids
    assert any(t >= 40 for t in ref.output_token_ids)


# ----------------------------------------------------------------------------- tokenizer check


def _spec_with(spec: TokenizerSpec, edit) -> TokenizerSpec:
    data = json.loads(spec.tokenizer_json)
    edit(data)
    return dataclasses.replace(spec, tokenizer_json=json.dumps(data))


def _id_of(spec: TokenizerSpec, token: str) -> int:
    return json.loads(spec.tokenizer_json)["model"]["vocab"][token]


def test_matching_tokenizers_pass_and_the_factory_builds():
    target, drafts, spec = _models("qwen2")
    check_tokenizers_match(spec, spec)
    assert get_drafter_factory("draft-model") is build_draft_model_drafter
    assert DRAFTERS["draft-model"] is build_draft_model_drafter
    d = build_draft_model_drafter(
        target_tokenizer=spec, executor=drafts["other"], tokenizer=spec, target_config=target.config
    )
    assert isinstance(d, DraftModelDrafter) and d.name == "draft-model" and d.vocab_size == VOCAB
    with pytest.raises(ConfigError, match="artifact"):
        build_draft_model_drafter(target_tokenizer=spec)
    with pytest.raises(ConfigError, match="tokenizer"):
        build_draft_model_drafter(target_tokenizer=spec, executor=drafts["other"])


def test_vocabulary_mismatch_names_the_first_differing_id():
    _, drafts, spec = _models("qwen2")
    vocab = json.loads(spec.tokenizer_json)["model"]["vocab"]
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    (tok_a, id_a), (tok_b, id_b) = by_id[200], by_id[250]

    def swap(data):
        data["model"]["vocab"][tok_a], data["model"]["vocab"][tok_b] = id_b, id_a

    other = _spec_with(spec, swap)
    with pytest.raises(TokenizerMismatchError, match=f"at id {id_a}") as info:
        DraftModelDrafter(drafts["other"], tokenizer=other, target_tokenizer=spec)
    err = info.value
    assert isinstance(err, DrafterFitError) and isinstance(err, ConfigError)
    assert (err.token_id, err.what, err.target_token, err.draft_token) == (id_a, "vocabulary", tok_a, tok_b)


def test_smaller_vocabulary_mismatch():
    spec = _models("qwen2")[2]
    vocab = json.loads(spec.tokenizer_json)["model"]["vocab"]
    last = max(vocab.values())
    token = next(t for t, i in vocab.items() if i == last)

    def drop(data):
        del data["model"]["vocab"][token]
        data["model"]["merges"] = [m for m in data["model"]["merges"] if "".join(m) != token and m != token]

    with pytest.raises(TokenizerMismatchError, match=f"at id {last}") as info:
        check_tokenizers_match(spec, _spec_with(spec, drop))
    assert info.value.draft_token is None


def test_special_and_eos_mismatch():
    spec = _models("qwen2")[2]
    eos = spec.eos_token_ids[0]
    with pytest.raises(TokenizerMismatchError, match=f"at id {eos}") as info:
        check_tokenizers_match(spec, dataclasses.replace(spec, eos_token_ids=()))
    assert info.value.what == "eos"

    def unspecial(data):
        for tok in data["added_tokens"]:
            if tok["content"] == "<|im_start|>":
                tok["special"] = False

    with pytest.raises(TokenizerMismatchError, match="special") as info:
        check_tokenizers_match(spec, _spec_with(spec, unspecial))
    assert info.value.token_id == _id_of(spec, "<|im_start|>") or info.value.what == "special"


# ----------------------------------------------------------------------------- sampling distribution

ALPHA = 1e-6
NUM_SAMPLES = 2000
SAMPLING = SamplingParams(temperature=0.8, top_k=3, max_tokens=4)
SAMPLE_PROMPT = (4, 17, 4)


@cache
def _exact_joint():
    """P(t1, t2, t3) and the marginal P(t4) of the toy model under SAMPLING (enumerated)."""
    return exact_joint(toy.ToyExecutor(), SAMPLE_PROMPT, SAMPLING, 50)


DRAFT_CONFIGS = {
    "same-model (q = p)": toy.ToyConfig(seed=0),
    "flatter (same weights, logit scale 2)": toy.ToyConfig(seed=0, logit_scale=2.0),
    "other-model (top-3 sets apart)": toy.ToyConfig(seed=1),
}


@pytest.mark.parametrize("name", list(DRAFT_CONFIGS))
def test_sampled_output_distribution_is_the_models(name):
    drafter = DraftModelDrafter(toy.ToyExecutor(DRAFT_CONFIGS[name]))
    engine = SpeculativeEngine(toy.ToyExecutor(), drafter, draft_tokens=2)
    params = [dataclasses.replace(SAMPLING, seed=20_000 + i) for i in range(NUM_SAMPLES)]
    results = engine.generate([SAMPLE_PROMPT] * NUM_SAMPLES, params)
    joint, t4 = _exact_joint()
    counts = dict.fromkeys(joint, 0)
    fourth = torch.zeros(50)
    for r in results:
        head = tuple(r.output_token_ids[:3])
        assert head in counts, f"{head} has probability 0 under the model"
        counts[head] += 1
        fourth[r.output_token_ids[3]] += 1
    assert torch.all(fourth[t4 == 0] == 0)
    pv = pooled_chi2([counts[c] for c in joint], [joint[c] * NUM_SAMPLES for c in joint])
    assert pv > ALPHA, f"(t1, t2, t3) deviates from the model (p-value {pv:.2e})"
    pv4 = pooled_chi2(fourth[t4 > 0].tolist(), (t4[t4 > 0] * NUM_SAMPLES).tolist())
    assert pv4 > ALPHA, f"t4 deviates from the model (p-value {pv4:.2e})"
    m = engine.metrics
    if name.startswith("same"):  # q = p: every draft accepted
        assert m.tokens_per_round == 3.0
    elif name.startswith("flatter"):
        assert 1.2 < m.tokens_per_round < 2.9


# ----------------------------------------------------------------------------- from an artifact


def test_from_an_artifact_directory(tmp_path):
    """`ignis-build --card cpu` output of a tiny qwen2 as the draft model (the factory's `artifact=`)."""
    build = pytest.importorskip("ignis.compiler.build")
    target, _, spec = _models("qwen2")
    ckpt = hf_tiny.save_tiny(
        hf_tiny.tiny_model("qwen2", seed=0), tmp_path / "ckpt", tokenizer=hf_tiny.tiny_tokenizer()
    )
    (tmp_path / "r.toml").write_text('name = "tiny-draft"\n[modules]\nwidths = [1, 4]\n')
    res = build.build_artifact(
        card="cpu",
        model=ckpt,
        recipe=tmp_path / "r.toml",
        out=tmp_path / "art",
        progress=False,
        echo=lambda _l: None,
    )
    d = build_draft_model_drafter(target_tokenizer=spec, artifact=res.out, target_config=target.config)
    try:
        engine = SpeculativeEngine(target, d, draft_tokens=3)
        prompt = _prompts(1)[0]
        out = engine.generate([prompt], GREEDY)[0].output_token_ids
        _assert_greedy_equal("qwen2", prompt, out, _spec_off("qwen2", prompt), "artifact draft")
        assert engine.metrics.tokens_per_round > 3.0  # the artifact holds the target's own weights
    finally:
        d.close()
    other = dataclasses.replace(spec, eos_token_ids=())
    with pytest.raises(TokenizerMismatchError, match="at id"):
        build_draft_model_drafter(target_tokenizer=other, artifact=res.out)
