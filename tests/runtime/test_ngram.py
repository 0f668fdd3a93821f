"""The ngram (prompt lookup) drafter: the lookup rule, its incremental index, exactness, sampling.

- The rule (longest n first, most recent occurrence, periodic continuation, zero drafts without a
  match) on hand-made contexts, and the incremental index against the plain reference scan
  (`propose_ngram`) on random growing contexts (hypothesis).
- Greedy exactness: speculation on equals speculation off token for token on tiny llama / qwen2
  targets for draft tokens {1, 3, 7} x lanes {1, 3} (near-ties by the logit margin, as in
  tests/runtime/test_draft_model.py).
- Sampling keeps the model's distribution (chi-square on the toy model, drafts a point mass).
- The index is incremental: proposals over a context grown to 20,000 tokens stay cheap.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
import warnings
from functools import cache
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sampling_checks import exact_joint, pooled_chi2
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.compiler.importers import load_checkpoint
from ignis.runtime.drafters import DRAFTERS, DraftRequest, get_drafter_factory
from ignis.runtime.drafters.ngram import NgramDrafter, build_ngram_drafter, propose_ngram
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.errors import ConfigError
from ignis.runtime.families import get_family
from ignis.runtime.sampling import SamplingParams


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

NEAR_TIE_MARGIN = 1e-4
MAX_TOKENS = 24
VOCAB = 384
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def _request(tokens, k, lane_id=0):
    return DraftRequest(
        lane_id=lane_id,
        num_drafts=k,
        token_ids=tuple(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(temperature=0),
        generator=torch.Generator(),
    )


def _propose(drafter, tokens, k, lane_id=0):
    return drafter.propose([_request(tokens, k, lane_id)])[0].draft_token_ids.tolist()


# ----------------------------------------------------------------------------- the rule

CASES = [
    # (context, k, min, max, periodic, expected drafts)
    ((1, 2, 3, 4), 3, 1, 3, True, []),  # no earlier occurrence of any suffix
    ((1, 2, 3, 9, 1, 2, 3), 3, 1, 3, True, [9, 1, 2]),
    ((1, 2, 3, 4, 9, 2, 3, 5, 9, 1, 2, 3), 3, 1, 3, True, [4, 9, 2]),  # longest n beats a more recent 2-gram
    ((1, 2, 7, 1, 2, 8, 1, 2), 3, 2, 2, True, [8, 1, 2]),  # most recent occurrence of the n-gram
    ((3, 4, 3, 4, 3, 4), 5, 2, 2, True, [3, 4, 3, 4, 3]),  # periodic continuation past the end
    ((3, 4, 3, 4, 3, 4), 5, 2, 2, False, [3, 4]),  # ... or stop at the end
    ((5, 5, 5), 4, 1, 4, True, [5, 5, 5, 5]),
    ((1, 2, 3, 1), 3, 2, 4, True, []),  # only a 1-gram matches, below prompt_lookup_min
    ((1, 2, 3, 1), 3, 1, 4, True, [2, 3, 1]),
    ((7,), 3, 1, 4, True, []),  # a one-token context has nothing earlier
]


@pytest.mark.parametrize(("context", "k", "lo", "hi", "periodic", "expected"), CASES)
def test_lookup_rule(context, k, lo, hi, periodic, expected):
    assert (
        propose_ngram(context, k, prompt_lookup_min=lo, prompt_lookup_max=hi, is_periodic=periodic)
        == expected
    )
    d = NgramDrafter(prompt_lookup_min=lo, prompt_lookup_max=hi, is_periodic=periodic)
    d.start_lane(0, context[:1])
    assert _propose(d, context, k) == expected


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=80),
    cuts=st.lists(st.integers(1, 80), max_size=6),
    lo=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 7),
    periodic=st.booleans(),
)
def test_incremental_index_equals_the_reference_scan(tokens, cuts, lo, extra, k, periodic):
    hi = lo + extra
    d = NgramDrafter(prompt_lookup_min=lo, prompt_lookup_max=hi, is_periodic=periodic)
    stops = sorted({c for c in cuts if c < len(tokens)} | {len(tokens)})
    d.start_lane(0, tokens[: stops[0]])
    for stop in stops:
        got = _propose(d, tokens[:stop], k)
        ref = propose_ngram(
            tokens[:stop], k, prompt_lookup_min=lo, prompt_lookup_max=hi, is_periodic=periodic
        )
        assert got == ref
        assert len(got) <= k


def test_lanes_are_independent_and_end_lane_drops_the_index():
    d = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=2)
    d.start_lane(0, [1, 2, 1])
    d.start_lane(1, [3, 4, 3])
    assert _propose(d, [1, 2, 1], 2, lane_id=0) == [2, 1]
    assert _propose(d, [3, 4, 3], 2, lane_id=1) == [4, 3]
    d.end_lane(0)
    assert 0 not in d._lanes and 1 in d._lanes


def test_knobs_and_registry():
    assert get_drafter_factory("ngram") is build_ngram_drafter and DRAFTERS["ngram"] is build_ngram_drafter
    d = build_ngram_drafter(prompt_lookup_min=1, prompt_lookup_max=5, is_row_budgeted=True)
    assert (d.name, d.prompt_lookup_min, d.prompt_lookup_max, d.is_row_budgeted) == ("ngram", 1, 5, True)
    assert not d.needs_hidden_states and d.tap_layers == ()
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        build_ngram_drafter(prompt_lookup_min=0)
    with pytest.raises(ConfigError, match="prompt_lookup_max"):
        build_ngram_drafter(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ConfigError, match="prompt_lookup_max"):
        build_ngram_drafter(prompt_lookup_max=65)


def test_proposals_stay_cheap_on_a_long_context():
    """20,000 proposals, the context growing by one token each: incremental, not a rescan."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (20_000,), generator=g).tolist()
    d = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=4)
    d.start_lane(0, tokens[:1])
    t0 = time.perf_counter()
    for n in range(2, len(tokens), 1):
        d.propose([_request(tokens[:n], 7)]) if n % 1000 == 0 else d._extend(d._lanes[0], tokens[:n])
    elapsed = time.perf_counter() - t0
    # slicing tokens[:n] is itself O(n); the index work is O(1) per new token. A rescan per proposal
    # would take minutes here.
    assert elapsed < 20, elapsed


# ----------------------------------------------------------------------------- greedy exactness


@cache
def _target(family: str):
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"ignis-ngram-{family}-"))
    ckpt = load_checkpoint(hf_tiny.save_tiny(hf_tiny.tiny_model(family, seed=0), folder / "target"))
    return get_family(family).make_executor(ckpt.config, ckpt.tensors.load_all(), "cpu", torch.float32)


def _prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Prompts that repeat a segment (so lookups hit in the prompt) of mixed lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length in (4, 9, 6)[:n]:
        seg = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        out.append(tuple(seg + seg + seg[: length // 2]))
    return out


@cache
def _spec_off(family: str, prompt: tuple[int, ...]) -> tuple[int, ...]:
    return SpeculativeEngine(_target(family)).generate([prompt], GREEDY)[0].output_token_ids


def _assert_greedy_equal(family, prompt, got, ref, label):
    if got == ref:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
    assert i < min(len(got), len(ref)), f"{label}: lengths differ with equal prefixes: {got} vs {ref}"
    ex = _target(family)
    s = ex.new_lane()
    out = ex.forward([s], [torch.tensor([*prompt, *ref[:i]])], logits="last", record=False)
    ex.commit([s], [0])
    top2 = torch.topk(out.logits[0][-1].double(), 2).values
    margin = float(top2[0] - top2[1])
    assert margin < NEAR_TIE_MARGIN, f"{label}: token {i} differs ({got[i]} vs {ref[i]}), margin {margin:.3g}"
    warnings.warn(f"{label}: near-tie at token {i} (margin {margin:.2g}) tolerated", stacklevel=2)


@pytest.mark.parametrize("num_lanes", [1, 3])
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_spec_on_equals_spec_off(family, k, num_lanes):
    target = _target(family)
    prompts = _prompts(num_lanes)
    drafter = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=3)
    engine = SpeculativeEngine(target, drafter, draft_tokens=k)
    late = prompts[-1] if num_lanes > 1 else None
    ids = [engine.add_lane(p, GREEDY) for p in (prompts[:-1] if late else prompts)]
    steps = 0
    while engine.has_unfinished or late:
        engine.step()
        steps += 1
        if late and steps == 2:
            ids.append(engine.add_lane(late, GREEDY))
            late = None
    for prompt, lane_id in zip(prompts, ids, strict=True):
        res = engine.pop_result(lane_id)
        assert len(res.output_token_ids) == MAX_TOKENS
        _assert_greedy_equal(
            family, prompt, res.output_token_ids, _spec_off(family, prompt), f"{family} k={k}"
        )
    assert engine.metrics.drafted_tokens_total > 0
    assert not drafter._lanes


# ----------------------------------------------------------------------------- sampling distribution

ALPHA = 1e-6
NUM_SAMPLES = 2000
SAMPLING = SamplingParams(temperature=0.8, top_k=3, max_tokens=4)
SAMPLE_PROMPT = (*range(0, 50, 2), *range(1, 50, 2))  # every id once: a 1-gram lookup always hits


@cache
def _exact_joint():
    """P(t1, t2, t3) and the marginal P(t4) of the toy model under SAMPLING (enumerated)."""
    return exact_joint(toy.ToyExecutor(), SAMPLE_PROMPT, SAMPLING, 50)


def test_sampled_output_distribution_is_the_models():
    engine = SpeculativeEngine(toy.ToyExecutor(), NgramDrafter(prompt_lookup_min=1), draft_tokens=3)
    params = [dataclasses.replace(SAMPLING, seed=30_000 + i) for i in range(NUM_SAMPLES)]
    results = engine.generate([SAMPLE_PROMPT] * NUM_SAMPLES, params)
    joint, t4 = _exact_joint()
    counts = dict.fromkeys(joint, 0)
    fourth = torch.zeros(50)
    for r in results:
        head = tuple(r.output_token_ids[:3])
        assert head in counts
        counts[head] += 1
        fourth[r.output_token_ids[3]] += 1
    pv = pooled_chi2([counts[c] for c in joint], [joint[c] * NUM_SAMPLES for c in joint])
    assert pv > ALPHA, f"(t1, t2, t3) deviates from the model (p-value {pv:.2e})"
    pv4 = pooled_chi2(fourth[t4 > 0].tolist(), (t4[t4 > 0] * NUM_SAMPLES).tolist())
    assert pv4 > ALPHA, f"t4 deviates from the model (p-value {pv4:.2e})"
    m = engine.metrics
    assert m.drafted_tokens_total > NUM_SAMPLES and sum(m.position_accepted_total.values()) > 0
