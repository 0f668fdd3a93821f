"""Penalties (presence, frequency, repetition), min_tokens and logprobs, exact under speculation:
greedy speculation on equals speculation off token for token and logprob for logprob, with drafters
that commit whole runs (so a row's penalties must count the drafts before it), mostly-rejected
drafters, the toy model drafter and n-gram lookup; and speculation off equals a plain reference loop
written from vLLM's / OpenAI's definitions."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from ignis.runtime.drafters.ngram import build_ngram_drafter
from ignis.runtime.drafters.testing import ModelDrafter, ReferenceDrafter
from ignis.runtime.engine import SpeculativeEngine
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


toy = _toy()
VOCAB = 50
EOS = 7
PROMPTS = [(3, 9, 3, 9, 3), (11,), (20, 21, 22, 20, 21, 22, 20), (5, 5, 5, 5)]
PARAMS = {
    "presence": SamplingParams(temperature=0, max_tokens=20, presence_penalty=1.5, logprobs=2),
    "frequency": SamplingParams(temperature=0, max_tokens=20, frequency_penalty=0.9, logprobs=0),
    "repetition": SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.7, logprobs=3),
    "all": SamplingParams(
        temperature=0,
        max_tokens=20,
        presence_penalty=0.4,
        frequency_penalty=0.6,
        repetition_penalty=1.3,
        min_tokens=12,
        stop_token_ids=(12,),
        logprobs=5,
    ),
    "min_tokens": SamplingParams(temperature=0, max_tokens=20, min_tokens=15, logprobs=1),
}


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    num = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num)


def _reference(prompt: tuple[int, ...], params: SamplingParams) -> tuple[list[int], list[float]]:
    """Greedy decoding written out from the definitions, one token at a time (no engine)."""
    ex = toy.ToyExecutor()
    out: list[int] = []
    lps: list[float] = []
    while len(out) < params.max_tokens:
        raw = ex.next_logits([*prompt, *out]).double()
        x = raw.clone()
        for t in set(prompt) | set(out):
            if params.repetition_penalty != 1.0:
                x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        for t in set(out):
            x[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
        if len(out) < params.min_tokens:
            for t in (EOS, *params.stop_token_ids):
                x[t] = -math.inf
        token = int(x.argmax())
        out.append(token)
        lps.append(float(torch.log_softmax(raw, -1)[token]))
        if len(out) >= params.min_tokens and (token == EOS or token in params.stop_token_ids):
            break
    return out, lps


def _run(params: SamplingParams, drafter=None, draft_tokens=None):
    engine = SpeculativeEngine(toy.ToyExecutor(), drafter, draft_tokens=draft_tokens, eos_token_ids=(EOS,))
    return engine.generate(PROMPTS, params)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_speculation_off_follows_the_definitions(name: str) -> None:
    params = PARAMS[name]
    for prompt, result in zip(PROMPTS, _run(params), strict=True):
        want, lps = _reference(prompt, params)
        assert list(result.output_token_ids) == want, prompt
        got = [lp.logprob for lp in result.logprobs]
        assert got == pytest.approx(lps, abs=1e-5)  # float32 logits; the reference in float64
        assert all(len(lp.top) == params.logprobs for lp in result.logprobs)
        for lp in result.logprobs:
            if lp.top:
                assert lp.top[0][1] >= lp.logprob - 1e-12  # the first of the top is the most likely


def _drafters(references):
    yield "always-right", ReferenceDrafter(references, vocab_size=VOCAB, p_correct=1.0), 4
    yield "scripted", ReferenceDrafter(references, vocab_size=VOCAB, num_correct=[0, 3, 1, 7, 2], seed=1), 7
    yield "model", ModelDrafter(toy.ToyExecutor(), mode="greedy"), 3
    yield "ngram", build_ngram_drafter(), 4


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_speculation_on_equals_off_token_for_token_and_logprob_for_logprob(name: str) -> None:
    params = PARAMS[name]
    off = _run(params)
    references = {p: r.output_token_ids for p, r in zip(PROMPTS, off, strict=True)}
    for label, drafter, k in _drafters(references):
        on = _run(params, drafter, k)
        for a, b in zip(off, on, strict=True):
            assert a.output_token_ids == b.output_token_ids, (label, a.prompt_token_ids)
            assert a.finish_reason == b.finish_reason
            assert [(x.token_id, x.top) for x in a.logprobs] == [(x.token_id, x.top) for x in b.logprobs]
            assert [x.logprob for x in a.logprobs] == pytest.approx(
                [x.logprob for x in b.logprobs], abs=1e-12
            )
        if label == "always-right":
            assert max(r.num_rounds for r in on) < params.max_tokens  # whole runs were committed


def test_penalties_change_the_output() -> None:
    """The cases above are not vacuous: each setting changes some lane's greedy output."""
    plain = _run(SamplingParams(temperature=0, max_tokens=20))
    for name, params in PARAMS.items():
        got = _run(params)
        assert any(a.output_token_ids != b.output_token_ids for a, b in zip(plain, got, strict=True)), name


def test_min_tokens_holds_back_eos_and_stop_tokens() -> None:
    base = _run(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(12,)))
    held = _run(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(12,), min_tokens=15))
    stopped_early = [r for r in base if r.finish_reason == "stop" and len(r.output_token_ids) < 15]
    assert stopped_early  # the toy stops some lanes early without min_tokens
    for r in held:
        assert len(r.output_token_ids) >= 15
        assert not {EOS, 12} & set(r.output_token_ids[:14])


def test_min_tokens_delays_stop_strings() -> None:
    from ignis.runtime.stops import StopChecker

    decode = lambda ids: "".join(chr(97 + t % 26) for t in ids)  # noqa: E731
    sc = StopChecker(
        SamplingParams(stop=("bc",), min_tokens=4, max_tokens=10), num_prompt_tokens=1, detokenize=decode
    )
    assert sc.extend([1, 2, 3]) == 3 and not sc.is_finished  # "bcd": a stop string inside min_tokens
    assert sc.extend([1, 2]) == 2 and sc.stop_reason == "bc"  # "bcdbc": the one past it stops
    assert sc.text == "bcd"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"repetition_penalty": 0},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 4},
        {"logprobs": 21},
    ],
)
def test_out_of_range_values_are_refused(kwargs) -> None:
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kwargs)


# ----------------------------------------------------------------------------- sampling keeps p

SAMPLED = SamplingParams(temperature=0.8, top_k=3, max_tokens=3, presence_penalty=-1.0, frequency_penalty=0.3)
SAMPLE_PROMPT = (4, 17)
NUM_SAMPLES = 2000
ALPHA = 1e-6


def _penalised_probs(prefix: tuple[int, ...]) -> torch.Tensor:
    """p of the next token after SAMPLE_PROMPT + prefix under SAMPLED, from the definitions."""
    from ignis.runtime.sampling import logits_to_probs

    x = toy.ToyExecutor().next_logits([*SAMPLE_PROMPT, *prefix]).double()
    for t in set(prefix):
        x[t] -= SAMPLED.frequency_penalty * prefix.count(t) + SAMPLED.presence_penalty
    return logits_to_probs(x, SAMPLED).double()


@pytest.mark.parametrize("mode", ["sample", "greedy"])
def test_sampled_output_with_penalties_keeps_the_models_distribution(mode: str) -> None:
    """Rejection sampling against the penalised p of every row (drafts before it counted) keeps the
    output distribution the one decoding without speculation samples from."""
    from sampling_checks import pooled_chi2

    joint: dict[tuple[int, int, int], float] = {}
    p1 = _penalised_probs(())
    for a in torch.nonzero(p1).flatten().tolist():
        p2 = _penalised_probs((a,))
        for b in torch.nonzero(p2).flatten().tolist():
            p3 = _penalised_probs((a, b))
            for c in torch.nonzero(p3).flatten().tolist():
                joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    engine = SpeculativeEngine(toy.ToyExecutor(), ModelDrafter(toy.ToyExecutor(), mode=mode), draft_tokens=2)
    params = [
        SamplingParams(**{**SAMPLED.__dict__, "seed": 20_000 + i, "stop": ()}) for i in range(NUM_SAMPLES)
    ]
    counts = dict.fromkeys(joint, 0)
    for r in engine.generate([SAMPLE_PROMPT] * NUM_SAMPLES, params):
        head = tuple(r.output_token_ids)
        assert head in counts, f"{head} has probability 0 under the penalised model"
        counts[head] += 1
    assert engine.metrics.accepted_tokens_total > engine.metrics.rounds_total  # drafts were accepted
    pv = pooled_chi2([counts[c] for c in joint], [joint[c] * NUM_SAMPLES for c in joint])
    assert pv > ALPHA, f"{mode}: the output deviates from the penalised model (p-value {pv:.2e})"


# ----------------------------------------------------------------------------- fuzz-found edges


def test_min_tokens_over_stop_ids_covering_the_vocabulary_still_samples() -> None:
    """Every token a stop id (found by the API fuzzer: NaN probabilities failed the engine): the rows
    keep their logits and the lane decodes on, greedy and sampled."""
    from ignis.runtime.logits_processors import process_rows

    every = tuple(range(VOCAB))
    for temperature in (0.0, 1.0):
        params = SamplingParams(
            temperature=temperature, max_tokens=6, min_tokens=4, stop_token_ids=every, seed=1
        )
        rows = process_rows(torch.randn(3, VOCAB), params, prompt=(1,), output=(2,), drafts=(3, 4))
        assert torch.isfinite(rows).all()
        (result,) = SpeculativeEngine(toy.ToyExecutor(), eos_token_ids=(EOS,)).generate([(1, 2)], params)
        assert len(result.output_token_ids) == 4 and result.finish_reason == "stop"


def test_extreme_repetition_penalties_are_refused() -> None:
    for value in (1e-300, 0.001, 101.0):
        with pytest.raises(SamplingParamsError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=value)
    SamplingParams(repetition_penalty=0.01)
    SamplingParams(repetition_penalty=100)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rows_and_logprobs_match_the_cpu(dtype) -> None:
    """The per-lane state lives on the logits' device: CUDA rows equal the CPU's to the dtype's rounding
    (the two devices' elementwise kernels may round a product differently: not bit for bit, as an
    H200 run showed), with the same greedy choice in every row, and the same logprobs."""
    from ignis.runtime.logits_processors import LanePenalties, token_logprobs

    g = torch.Generator().manual_seed(0)
    vocab = 151_936  # a real vocabulary's size
    logits = (torch.randn(8, vocab, generator=g) * 4).to(dtype)
    params = PARAMS["all"]
    prompt = torch.randint(0, vocab, (4096,), generator=g).tolist()
    output = torch.randint(0, vocab, (300,), generator=g).tolist()
    drafts = [output[5], output[5], 12, output[7], 3, 3, 9]
    rows = {}
    for device in ("cpu", "cuda"):
        state = LanePenalties(params, prompt, eos_token_ids=(EOS,))
        state.extend(output[:100])
        state.process(logits[:1].to(device), [])  # counts built, then extended
        state.extend(output[100:])
        rows[device] = state.process(logits.to(device), drafts).cpu()
    torch.testing.assert_close(rows["cuda"], rows["cpu"])
    assert torch.equal(rows["cpu"].isinf(), rows["cuda"].isinf())  # the same tokens masked
    tokens = rows["cpu"].argmax(-1).tolist()
    if dtype == torch.float32:  # bf16 rows can hold exact ties that one rounding step reorders
        assert rows["cuda"].argmax(-1).tolist() == tokens
    cpu = token_logprobs(logits.float(), tokens, 5)
    gpu = token_logprobs(logits.float().cuda(), tokens, 5)
    assert [x.top[0][0] for x in cpu] == [x.top[0][0] for x in gpu]
    # log-softmax over 151,936 logits sums in another order on each device: ~1e-5 apart (H200 run)
    assert [x.logprob for x in cpu] == pytest.approx([x.logprob for x in gpu], rel=1e-4, abs=1e-4)
