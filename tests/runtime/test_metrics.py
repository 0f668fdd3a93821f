"""Speculative counters: unit arithmetic and exact counts on scripted engine rounds."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from ignis.runtime.drafters.testing import ReferenceDrafter
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.sampling import SamplingParams


def _toy():
    if "toy_executor" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "toy_executor", Path(__file__).parents[1] / "toy_executor.py"
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["toy_executor"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["toy_executor"]


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Tiny tensors: intra-op threads only add dispatch overhead (and the CI cores are shared)."""
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)


GREEDY = SamplingParams(temperature=0, max_tokens=40)


def test_record_round_and_ratios():
    m = SpeculativeMetrics()
    assert m.tokens_per_round == 0.0 and m.acceptance_rate(0) == 0.0
    m.record_round(num_drafted=3, num_accepted=3, num_emitted=4)
    m.record_round(num_drafted=3, num_accepted=1, num_emitted=2)
    m.record_round(num_drafted=2, num_accepted=0, num_emitted=1)
    m.record_round(num_drafted=3, num_accepted=2, num_emitted=2)  # a stop on the second accepted draft
    assert (m.rounds_total, m.drafted_tokens_total, m.accepted_tokens_total) == (4, 11, 9)
    assert dict(m.position_drafted_total) == {0: 4, 1: 4, 2: 3}
    assert dict(m.position_accepted_total) == {0: 3, 1: 2, 2: 1}
    assert m.tokens_per_round == 9 / 4 and m.acceptance_rate(1) == 2 / 4
    names = [(n, lab.get("position")) for n, lab, _ in m.samples()]
    assert names[:3] == [
        ("ignis_speculative_rounds_total", None),
        ("ignis_speculative_drafted_tokens_total", None),
        ("ignis_speculative_accepted_tokens_total", None),
    ]
    assert ("ignis_speculative_position_accepted_total", "2") in names


@pytest.mark.parametrize(
    "kw",
    [
        {"num_drafted": 0, "num_accepted": 0, "num_emitted": 1},
        {"num_drafted": 2, "num_accepted": 3, "num_emitted": 4},
        {"num_drafted": 2, "num_accepted": 1, "num_emitted": 3},
        {"num_drafted": 2, "num_accepted": 0, "num_emitted": 0},
    ],
)
def test_inconsistent_rounds_are_refused(kw):
    with pytest.raises(ValueError):
        SpeculativeMetrics().record_round(**kw)


def _reference(ex, prompts, params=GREEDY):
    out = SpeculativeEngine(ex).generate(prompts, params)
    return {r.prompt_token_ids: r.output_token_ids for r in out}


def test_scripted_rounds_one_lane():
    toy = _toy()
    ex = toy.ToyExecutor()
    prompt = (3, 1, 4, 1, 5)
    refs = _reference(ex, [prompt])
    script = [3, 0, 1, 3, 2, 2, 0]
    engine = SpeculativeEngine(ex, ReferenceDrafter(refs, vocab_size=50, num_correct=script), draft_tokens=3)
    (res,) = engine.generate([prompt], GREEDY)
    assert res.output_token_ids == refs[prompt]
    m = engine.metrics
    # 40 tokens: 1 from prefill, then runs of c + 1 tokens; near the end drafts are capped by max_tokens.
    rounds, left, i = [], 39, 0
    while left:
        k = min(3, left - 1)
        c = min(script[i % len(script)], k)
        rounds.append((k, c, c + 1))
        left -= c + 1
        i += 1
    spec = [r for r in rounds if r[0] > 0]
    assert m.rounds_total == len(spec)
    assert m.drafted_tokens_total == sum(k for k, _, _ in spec)
    assert m.accepted_tokens_total == sum(e for _, _, e in spec)
    for pos in range(3):
        assert m.position_drafted_total[pos] == sum(k > pos for k, _, _ in spec)
        assert m.position_accepted_total[pos] == sum(c > pos for _, c, _ in spec)
    assert res.num_rounds == len(rounds)


def test_a_stop_inside_the_run_is_not_counted_past_the_stop():
    toy = _toy()
    ex = toy.ToyExecutor()
    prompt = (7, 7, 2)
    refs = _reference(ex, [prompt])
    ref = refs[prompt]
    # EOS = the first token that appears for the first time at output index >= 3
    j = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    engine = SpeculativeEngine(
        ex, ReferenceDrafter(refs, vocab_size=50), draft_tokens=7, eos_token_ids=[ref[j]]
    )
    (res,) = engine.generate([prompt], GREEDY)
    assert res.output_token_ids == ref[: j + 1] and res.finish_reason == "stop"
    m = engine.metrics
    assert m.accepted_tokens_total == j  # every output token but the prefill one, none past the stop
    # the last round emitted only accepted drafts (the stop fell on a draft): no bonus counted
    assert sum(m.position_accepted_total.values()) == m.accepted_tokens_total - (m.rounds_total - 1)


def test_plain_rows_are_not_speculative_rounds():
    toy = _toy()
    ex = toy.ToyExecutor()
    prompts = [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10)]
    refs = _reference(ex, prompts, SamplingParams(temperature=0, max_tokens=6))
    drafter = ReferenceDrafter(refs, vocab_size=50, is_row_budgeted=True)
    engine = SpeculativeEngine(ex, drafter, draft_tokens=3, draft_rows=8)
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    assert engine.metrics.rounds_total == 0 and engine.metrics.samples()[0][2] == 0  # 5 lanes: no drafts
