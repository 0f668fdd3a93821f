"""The round loop on the toy executor: exactness, no leakage, sampling distribution, stops, budget, state.

Greedy exactness: speculation on must equal speculation off token for token. A mismatch is tolerated
only where the speculation-off run's top-2 logit margin at the first differing token is below
NEAR_TIE_MARGIN, and it is reported (warning). The toy model computes every position column by column
in float64, so its logits do not depend on batching and no mismatch is expected at all; the margin
rule is the one the real families' tests will use (their wide routes sum in a different order).

Sampling: chi-square goodness of fit of the first output tokens against the model's exact
distribution (enumerated with the toy model): the joint law of (t1, t2, t3) and the marginal of t4,
for 6 drafters (12 tests) at ALPHA = 1e-6 each, so a false failure has probability < 1.2e-5 over the
seed choice (the seeds are fixed, so runs are repeatable). 2,000 samples per drafter; the tests'
power was checked by mutation: resampling from p instead of the residual, or drawing the bonus token
from the wrong row, fails 3 and 4 of the 6 drafters respectively.
"""

import importlib.util
import sys
import warnings
from functools import cache
from pathlib import Path

import pytest
import torch
from sampling_checks import exact_joint, pooled_chi2

from ignis.runtime.drafters.base import BaseDrafter, DrafterError, DraftProposal
from ignis.runtime.drafters.testing import (
    BigramDrafter,
    ModelDrafter,
    always_right,
    always_wrong,
    right_with_probability,
)
from ignis.runtime.engine import LaneRequestError, SpeculativeEngine
from ignis.runtime.errors import ConfigError, StateError
from ignis.runtime.sampling import SamplingParams, SamplingParamsError


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


toy = _toy()
VOCAB = 50
NEAR_TIE_MARGIN = 1e-4  # logits units; float32 logits of magnitude ~10 carry ~1e-6 rounding
ALPHA = 1e-6
MAX_TOKENS = 24
PROMPT_LENGTHS = [1, 5, 12, 3, 9, 2, 14, 7]  # mixed prompt lengths, one per lane
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def _prompts(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, VOCAB, (PROMPT_LENGTHS[i],), generator=g).tolist()) for i in range(n)]


@cache
def _spec_off(prompts, max_tokens=MAX_TOKENS):
    """Speculation-off greedy outputs, each prompt run alone."""
    return {
        p: SpeculativeEngine(toy.ToyExecutor())
        .generate([p], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
        .output_token_ids
        for p in prompts
    }


def _assert_greedy_equal(prompt, got, ref, label=""):
    if got == ref:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
    assert i < min(len(got), len(ref)), f"{label}: lengths differ with equal prefixes: {got} vs {ref}"
    top2 = torch.topk(toy.ToyExecutor().next_logits([*prompt, *ref[:i]]).double(), 2).values
    margin = float(top2[0] - top2[1])
    assert margin < NEAR_TIE_MARGIN, (
        f"{label}: token {i} differs ({got[i]} vs {ref[i]}), top-2 margin {margin:.3g}"
    )
    warnings.warn(f"{label}: near-tie at token {i} (margin {margin:.2g}) tolerated", stacklevel=2)


def _make_drafter(kind, refs, budgeted):
    if kind == "right":
        return always_right(refs, vocab_size=VOCAB, is_row_budgeted=budgeted)
    if kind == "wrong":
        return always_wrong(refs, vocab_size=VOCAB, seed=1, is_row_budgeted=budgeted)
    return right_with_probability(refs, 0.5, vocab_size=VOCAB, seed=2, is_row_budgeted=budgeted)


# ----------------------------------------------------------------------------- greedy exactness


@pytest.mark.parametrize("budgeted", [False, True], ids=["fixed", "row-budgeted"])
@pytest.mark.parametrize("num_lanes", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("kind", ["right", "wrong", "p0.5"])
def test_greedy_spec_on_equals_spec_off(kind, k, num_lanes, budgeted):
    """Mixed prompt lengths; with 3 and 8 lanes the last lane joins after two rounds."""
    prompts = _prompts(num_lanes)
    refs = _spec_off(tuple(_prompts(8)))
    ex = toy.ToyExecutor()
    engine = SpeculativeEngine(ex, _make_drafter(kind, refs, budgeted), draft_tokens=k, draft_rows=8)
    late = prompts[-1] if num_lanes > 1 else None
    ids = {engine.add_lane(p, GREEDY): p for p in (prompts[:-1] if late else prompts)}
    steps = 0
    while engine.has_unfinished or late:
        engine.step()
        steps += 1
        if late and steps == 2:
            ids[engine.add_lane(late, GREEDY)] = late
            late = None
    for lane_id, prompt in ids.items():
        res = engine.pop_result(lane_id)
        assert res.finish_reason == "length" and len(res.output_token_ids) == MAX_TOKENS
        _assert_greedy_equal(prompt, res.output_token_ids, refs[prompt], f"{kind} k={k} lanes={num_lanes}")
    if budgeted:  # the row budget holds in every round that drafts (record=True)
        assert all(sum(cols) <= 8 for cols, record in ex.calls if record)
    m = engine.metrics
    if kind == "right" and m.rounds_total:
        assert m.accepted_tokens_total > m.rounds_total
    if kind == "wrong":
        assert m.accepted_tokens_total == m.rounds_total and sum(m.position_accepted_total.values()) == 0


def test_state_after_every_round_equals_feeding_the_committed_tokens_alone():
    """Rejected, partly and fully accepted runs: KV, conv and recurrent state (target and drafter)."""
    prompts = _prompts(3)
    refs = _spec_off(tuple(prompts), 30)
    ex, dex = toy.ToyExecutor(), toy.ToyExecutor()
    engine = SpeculativeEngine(ex, ModelDrafter(dex, mode="greedy"), draft_tokens=4)
    # a drafter that is right with p = 0.6, wrapped so that the ModelDrafter's lanes are checked too
    noisy = right_with_probability(refs, 0.6, vocab_size=VOCAB, seed=5)
    model_drafter = engine.drafter

    class Both(BaseDrafter):
        def start_lane(self, lane_id, prompt):
            noisy.start_lane(lane_id, prompt)
            model_drafter.start_lane(lane_id, prompt)

        def propose(self, requests):
            model_drafter.propose(requests)  # runs and discards the drafter's own columns
            return noisy.propose(requests)

        def commit(self, spans):
            model_drafter.commit(spans)

        def end_lane(self, lane_id):
            noisy.end_lane(lane_id)
            model_drafter.end_lane(lane_id)

    engine.drafter = Both()
    for p in prompts:
        engine.add_lane(p, SamplingParams(temperature=0, max_tokens=30))
    run_lengths, first = set(), True
    while engine.has_unfinished:
        updates = engine.step()
        if not first:
            run_lengths |= {len(u.new_token_ids) for u in updates if not u.is_finished}
        first = False
        for lane in engine._active:
            fed = [*lane.prompt, *lane.output[:-1]]
            assert lane.state.num_tokens == len(fed)
            assert toy.ToyExecutor.states_equal(lane.state, ex.state_after(fed))
            assert toy.ToyExecutor.states_equal(model_drafter._states[lane.lane_id], dex.state_after(fed))
    assert {1, 5} <= run_lengths and run_lengths & {2, 3, 4}  # rejected, fully and partly accepted
    for lane_id, p in enumerate(prompts):
        assert engine.pop_result(lane_id).output_token_ids == refs[p]


def test_no_leakage_between_lanes_under_seeded_sampling():
    """Each lane's seeded sampled output equals what it produces alone (own stream, own state)."""
    prompts = _prompts(6)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=16) for i in range(6)]
    for make in (
        lambda: BigramDrafter(VOCAB, seed=3),
        lambda: ModelDrafter(toy.ToyExecutor(), temperature=1.5),
    ):
        together = SpeculativeEngine(toy.ToyExecutor(), make(), draft_tokens=3).generate(prompts, params)
        for p, sp, res in zip(prompts, params, together, strict=True):
            alone = SpeculativeEngine(toy.ToyExecutor(), make(), draft_tokens=3).generate([p], sp)[0]
            assert res.output_token_ids == alone.output_token_ids


def test_seeded_reproducible_and_unseeded_lanes_differ():
    prompt = _prompts(1)[0]
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=20)
    a = SpeculativeEngine(toy.ToyExecutor(), BigramDrafter(VOCAB), draft_tokens=3).generate([prompt] * 2, sp)
    b = SpeculativeEngine(toy.ToyExecutor(), BigramDrafter(VOCAB), draft_tokens=3).generate([prompt], sp)
    assert a[0].output_token_ids == a[1].output_token_ids == b[0].output_token_ids and a[0].seed == 7
    free = SpeculativeEngine(toy.ToyExecutor()).generate(
        [prompt] * 3, SamplingParams(temperature=1.0, max_tokens=20)
    )
    assert len({r.output_token_ids for r in free}) == 3 and len({r.seed for r in free}) == 3
    replay = SpeculativeEngine(toy.ToyExecutor()).generate(
        [prompt], SamplingParams(temperature=1.0, max_tokens=20, seed=free[0].seed)
    )[0]
    assert replay.output_token_ids == free[0].output_token_ids


# ----------------------------------------------------------------------------- sampling distribution

SAMPLING = SamplingParams(temperature=0.8, top_k=3, max_tokens=4)
SAMPLE_PROMPT = (4, 17)
NUM_SAMPLES = 2000


@cache
def _exact_joint():
    """P(t1, t2, t3) and the marginal P(t4) of the toy model under SAMPLING (enumerated)."""
    return exact_joint(toy.ToyExecutor(), SAMPLE_PROMPT, SAMPLING, VOCAB)


SAMPLING_DRAFTERS = {
    "off": (None, None),
    "accept-always (q = p)": (lambda: ModelDrafter(toy.ToyExecutor(), mode="sample"), 3.0),
    "reject-always (argmin, outside top-k)": (lambda: ModelDrafter(toy.ToyExecutor(), mode="worst"), 1.0),
    "mixed (model at T=2, q returned)": (lambda: ModelDrafter(toy.ToyExecutor(), temperature=2.0), None),
    "greedy drafter (point-mass q)": (lambda: ModelDrafter(toy.ToyExecutor(), mode="greedy"), None),
    "bigram (random q)": (lambda: BigramDrafter(VOCAB, seed=9, temperature=0.5), None),
}


@pytest.mark.parametrize("name", list(SAMPLING_DRAFTERS))
def test_sampled_output_distribution_is_the_models(name):
    make, tokens_per_round = SAMPLING_DRAFTERS[name]
    engine = SpeculativeEngine(toy.ToyExecutor(), make() if make else None, draft_tokens=2)
    params = [
        SamplingParams(temperature=SAMPLING.temperature, top_k=SAMPLING.top_k, max_tokens=4, seed=10_000 + i)
        for i in range(NUM_SAMPLES)
    ]
    results = engine.generate([SAMPLE_PROMPT] * NUM_SAMPLES, params)
    joint, t4 = _exact_joint()
    counts = dict.fromkeys(joint, 0)
    fourth = torch.zeros(VOCAB)
    for r in results:
        assert len(r.output_token_ids) == 4
        head = tuple(r.output_token_ids[:3])
        assert head in counts, f"{name}: {head} has probability 0 under the model"
        counts[head] += 1
        fourth[r.output_token_ids[3]] += 1
    assert torch.all(fourth[t4 == 0] == 0)
    pv = pooled_chi2([counts[c] for c in joint], [joint[c] * NUM_SAMPLES for c in joint])
    assert pv > ALPHA, f"{name}: (t1, t2, t3) deviates from the model (p-value {pv:.2e})"
    pv4 = pooled_chi2(fourth[t4 > 0].tolist(), (t4[t4 > 0] * NUM_SAMPLES).tolist())
    assert pv4 > ALPHA, f"{name}: t4 deviates from the model (p-value {pv4:.2e})"
    if tokens_per_round is not None:
        assert engine.metrics.rounds_total > 0 and engine.metrics.tokens_per_round == tokens_per_round


# ----------------------------------------------------------------------------- stops inside a run


def _always_right_engine(prompt, max_tokens=40, **kw):
    refs = _spec_off((prompt,), max_tokens)
    ex = toy.ToyExecutor()
    return ex, refs[prompt], SpeculativeEngine(ex, always_right(refs, vocab_size=VOCAB), draft_tokens=7, **kw)


def test_eos_inside_a_committed_run():
    prompt = _prompts(3)[2]
    _, ref, _ = _always_right_engine(prompt)
    j = next(i for i in range(2, 8) if ref[i] not in ref[:i])  # lands inside the first round's run of 8
    ex, ref, engine = _always_right_engine(prompt, eos_token_ids=[ref[j]])
    engine.add_lane(prompt, SamplingParams(temperature=0, max_tokens=40))
    (update,) = engine.step()  # prefill and the first round: the run of 8 is cut after the EOS
    assert update.new_token_ids == tuple(ref[: j + 1]) and update.finish_reason == "stop"
    res = engine.pop_result(0)
    assert res.output_token_ids == ref[: j + 1] and res.stop_reason is None
    assert ex.calls[-1] == ([8], True) and not engine.has_unfinished


def test_stop_token_id_inside_a_committed_run():
    prompt = _prompts(4)[3]
    _, ref, _ = _always_right_engine(prompt)
    j = next(i for i in range(2, 8) if ref[i] not in ref[:i])
    _, _, engine = _always_right_engine(prompt)
    (res,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ref[j]]))
    assert res.output_token_ids == ref[: j + 1] and res.stop_reason == ref[j]


def _piece(t):
    return chr(97 + t % 26) + chr(97 + (t * 7 + 3) % 26)


def _detok(ids):
    return "".join(_piece(t) for t in ids)


def test_stop_string_spanning_tokens_inside_a_committed_run():
    prompt = _prompts(2)[1]
    _, ref, _ = _always_right_engine(prompt)
    for j in range(3, 8):  # the stop string: last char of token j-1 + first char of token j
        stop = _piece(ref[j - 1])[1] + _piece(ref[j])[0]
        m = next(i for i in range(1, len(ref) + 1) if stop in _detok(ref[:i]))
        if 2 <= m <= 8:
            break
    else:
        pytest.fail("no suitable stop string in the reference")
    _, _, engine = _always_right_engine(prompt, detokenize=_detok)
    (res,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))
    assert res.output_token_ids == ref[:m] and res.stop_reason == stop and res.finish_reason == "stop"
    assert res.text == _detok(ref[:m])[: _detok(ref[:m]).index(stop)]


def test_max_tokens_and_context_end_are_never_exceeded():
    prompt = _prompts(2)[1]
    ex, ref, engine = _always_right_engine(prompt)
    (res,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5))
    assert res.output_token_ids == ref[:5] and res.finish_reason == "length"
    assert ex.calls[-1] == ([4], True)  # 4 tokens left after prefill: 3 drafts, no wasted row
    cfg = toy.ToyConfig(max_position_embeddings=len(prompt) + 10)
    ex = toy.ToyExecutor(cfg)
    refs = {prompt: ref}
    engine = SpeculativeEngine(ex, always_right(refs, vocab_size=VOCAB), draft_tokens=7)
    (res,) = engine.generate([prompt], SamplingParams(temperature=0))
    assert res.output_token_ids == ref[:10] and res.finish_reason == "length"  # the toy raises past its end


# ----------------------------------------------------------------------------- row budget, lanes, protocol


def test_row_budget_in_rounds():
    """Budget 8, 3 draft tokens: 3 drafts at 1-2 lanes, 1 at 3-4, none from 5 (one forward per round)."""
    prompts = _prompts(5)
    refs = _spec_off(tuple(_prompts(8)))
    for num_lanes, cols in [(1, 4), (2, 4), (3, 2), (4, 2), (5, 1)]:
        ex = toy.ToyExecutor()
        drafter = always_right(refs, vocab_size=VOCAB, is_row_budgeted=True)
        engine = SpeculativeEngine(ex, drafter, draft_tokens=3, draft_rows=0)
        for p in prompts[:num_lanes]:
            engine.add_lane(p, GREEDY)
        engine.step()
        assert ex.calls[0] == ([len(p) for p in prompts[:num_lanes]], False)  # prefill
        assert ex.calls[1] == ([cols] * num_lanes, cols > 1)  # the first verify round


def test_lanes_that_finish_free_rows_for_the_others():
    prompts = _prompts(3)
    refs = _spec_off(tuple(prompts))
    ex = toy.ToyExecutor()
    engine = SpeculativeEngine(ex, always_right(refs, vocab_size=VOCAB, is_row_budgeted=True), draft_tokens=3)
    engine.add_lane(prompts[0], SamplingParams(temperature=0, max_tokens=3))
    engine.add_lane(prompts[1], GREEDY)
    engine.add_lane(prompts[2], GREEDY)
    engine.step()
    assert ex.calls[-1][0] == [2, 2, 2]
    engine.step()
    assert ex.calls[-1][0] == [4, 4]  # lane 0 finished: two lanes draft 3 each


def test_max_lanes_admits_first_come_first_served():
    prompts = _prompts(5)
    ex = toy.ToyExecutor()
    engine = SpeculativeEngine(ex, max_lanes=2)
    ids = [engine.add_lane(p, SamplingParams(temperature=0, max_tokens=3 + i)) for i, p in enumerate(prompts)]
    while engine.has_unfinished:
        engine.step()
        assert engine.num_active <= 2
    assert all(len(c) <= 2 for c, _ in ex.calls)
    refs = _spec_off(tuple(prompts))
    for i, lane_id in enumerate(ids):
        assert engine.pop_result(lane_id).output_token_ids == refs[prompts[i]][: 3 + i]


def test_committed_spans_carry_the_right_hidden_states_and_taps():
    """What DFlash2 / MTP will read: spans tile the positions, tokens align, features are the model's."""
    prompts = _prompts(3)
    refs = _spec_off(tuple(prompts))
    inner = right_with_probability(refs, 0.5, vocab_size=VOCAB, seed=4)
    seen = {}

    class Recording(BaseDrafter):
        needs_hidden_states = True
        tap_layers = (1, 0)

        def start_lane(self, lane_id, prompt):
            inner.start_lane(lane_id, prompt)
            seen[lane_id] = ([], [], [], [])

        def propose(self, requests):
            return inner.propose(requests)

        def commit(self, spans):
            for s in spans:
                ins, nexts, hid, taps = seen[s.lane_id]
                m = len(s.input_token_ids)
                assert s.start == len(ins) and m == len(s.next_token_ids) >= 1
                assert s.hidden_states.shape == (m, 16) and s.taps.shape == (m, 32)
                seen[s.lane_id] = (
                    ins + list(s.input_token_ids),
                    nexts + list(s.next_token_ids),
                    [*hid, s.hidden_states],
                    [*taps, s.taps],
                )

    ex = toy.ToyExecutor()
    engine = SpeculativeEngine(ex, Recording(), draft_tokens=3)
    results = engine.generate(prompts, GREEDY)
    for lane_id, (p, res) in enumerate(zip(prompts, results, strict=True)):
        ins, nexts, hid, taps = seen[lane_id]
        tokens = [*p, *res.output_token_ids]
        assert ins == tokens[: len(ins)] and nexts == tokens[1 : len(ins) + 1]
        full = ex.forward([ex.new_lane()], [torch.tensor(ins)], output_hidden_states=True, tap_layers=(1, 0))
        assert torch.equal(torch.cat(hid), full.hidden_states[0])
        assert torch.equal(torch.cat(taps), full.taps[0])


class _Bad(BaseDrafter):
    def __init__(self, fn):
        self.fn = fn

    def propose(self, requests):
        return self.fn(requests)


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda rs: [DraftProposal(torch.tensor([1] * (r.num_drafts + 1))) for r in rs], "int64"),
        (lambda rs: [DraftProposal(torch.tensor([VOCAB])) for r in rs], "outside"),
        (lambda rs: [], "proposals"),
        (lambda rs: [DraftProposal(torch.tensor([1]), torch.ones(2, VOCAB)) for r in rs], "draft_probs"),
    ],
)
def test_drafter_protocol_violations_are_typed_errors(fn, match):
    engine = SpeculativeEngine(toy.ToyExecutor(), _Bad(fn), draft_tokens=2)
    engine.add_lane([1, 2, 3], GREEDY)
    with pytest.raises(DrafterError, match=match):
        engine.step()


def test_short_proposals_are_fine():
    prompt = _prompts(1)[0]
    refs = _spec_off((prompt,))
    engine = SpeculativeEngine(
        toy.ToyExecutor(),
        _Bad(lambda rs: [DraftProposal(torch.tensor([], dtype=torch.int64)) for _ in rs]),
        draft_tokens=3,
    )
    assert engine.generate([prompt], GREEDY)[0].output_token_ids == refs[prompt]
    assert engine.metrics.rounds_total == 0


def test_lane_and_config_errors():
    ex = toy.ToyExecutor()
    engine = SpeculativeEngine(ex)
    with pytest.raises(LaneRequestError, match="empty"):
        engine.add_lane([], GREEDY)
    with pytest.raises(LaneRequestError, match="vocabulary"):
        engine.add_lane([1, VOCAB], GREEDY)
    with pytest.raises(LaneRequestError, match="no room"):
        engine.add_lane([1] * 256, GREEDY)
    with pytest.raises(SamplingParamsError, match="detokenize"):
        engine.add_lane([1], SamplingParams(stop=["x"]))
    with pytest.raises(LaneRequestError):
        engine.pop_result(99)
    with pytest.raises(ConfigError, match="draft_tokens"):
        SpeculativeEngine(ex, BigramDrafter(VOCAB))
    with pytest.raises(ConfigError, match="draft_tokens"):
        SpeculativeEngine(ex, BigramDrafter(VOCAB), draft_tokens=8)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        SpeculativeEngine(ex, max_context=257)
    with pytest.raises(ConfigError, match="draft_rows"):
        SpeculativeEngine(ex, BigramDrafter(VOCAB), draft_tokens=3, draft_rows=40)


def test_abort_waiting_and_running_lanes():
    prompts = _prompts(3)
    refs = _spec_off(tuple(prompts))
    drafter = always_right(refs, vocab_size=VOCAB)
    engine = SpeculativeEngine(toy.ToyExecutor(), drafter, draft_tokens=2)
    a, b = engine.add_lane(prompts[0], GREEDY), engine.add_lane(prompts[1], GREEDY)
    engine.abort(b)
    engine.step()
    engine.abort(a)
    assert not engine.has_unfinished and a not in drafter._lanes
    ra, rb = engine.pop_result(a), engine.pop_result(b)
    assert (ra.finish_reason, rb.finish_reason) == ("abort", "abort")
    assert rb.output_token_ids == () and ra.output_token_ids == refs[prompts[0]][:4]
    with pytest.raises(LaneRequestError, match="unknown"):
        engine.abort(1234)


def test_step_updates_stream_every_token_once():
    prompts = _prompts(3)
    refs = _spec_off(tuple(prompts))
    engine = SpeculativeEngine(
        toy.ToyExecutor(), right_with_probability(refs, 0.7, vocab_size=VOCAB), draft_tokens=3
    )
    ids = [engine.add_lane(p, GREEDY) for p in prompts]
    streamed = {i: [] for i in ids}
    finished = []
    while engine.has_unfinished:
        for u in engine.step():
            assert u.lane_id not in finished
            streamed[u.lane_id] += u.new_token_ids
            if u.is_finished:
                finished.append(u.lane_id)
    assert sorted(finished) == ids
    for i, p in zip(ids, prompts, strict=True):
        assert tuple(streamed[i]) == refs[p]


def test_toy_executor_keeps_the_protocol():
    ex = toy.ToyExecutor()
    st = ex.new_lane()
    with pytest.raises(StateError, match="without a pending"):
        ex.commit([st], [1])
    ex.forward([st], [torch.tensor([1, 2, 3])], record=False)
    with pytest.raises(StateError, match="partially"):
        ex.commit([st], [2])
    with pytest.raises(StateError, match="not committed"):
        ex.forward([st], [torch.tensor([1])])
    ex.commit([st], [3])
    ex.forward([st], [torch.tensor([4, 5])])
    with pytest.raises(StateError, match="outside"):
        ex.commit([st], [3])
    ex.commit([st], [1])
    assert toy.ToyExecutor.states_equal(st, ex.state_after([1, 2, 3, 4]))
    with pytest.raises(StateError, match="max_position_embeddings"):
        ex.forward([st], [torch.zeros(253, dtype=torch.int64)])
