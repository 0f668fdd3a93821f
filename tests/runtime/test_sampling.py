"""SamplingParams validation, p after temperature / top-k / top-p, per-lane random streams."""

import math

import pytest
import torch

from ignis.runtime.errors import IgnisRuntimeError
from ignis.runtime.sampling import (
    LaneRandom,
    SamplingParams,
    SamplingParamsError,
    logits_to_probs,
    sample_token,
)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": math.inf},
        {"temperature": math.nan},
        {"temperature": "1"},
        {"temperature": True},
        {"top_k": -2},
        {"top_k": 2.0},
        {"top_k": True},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": -1},
        {"seed": -1},
        {"seed": 2**64},
        {"seed": 1.5},
        {"max_tokens": 0},
        {"max_tokens": 2.0},
        {"stop": [""]},
        {"stop": [1]},
        {"stop": 3},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": [1.0]},
        {"stop_token_ids": 7},
        {"ignore_eos": 1},
    ],
)
def test_invalid_params_raise_a_typed_error_naming_the_field(kwargs):
    with pytest.raises(SamplingParamsError, match=next(iter(kwargs))) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, IgnisRuntimeError) and isinstance(info.value, ValueError)


def test_params_normalize():
    p = SamplingParams(stop="###", stop_token_ids=[3, 4], top_k=-1)
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4) and p.top_k == 0
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_greedy_is_a_point_mass_at_the_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, -1.0], [0.0, 0.0, 0.0, 5.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0, top_k=1, top_p=0.1))
    assert probs.tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]


def test_temperature_only_is_softmax_of_scaled_logits():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    for t in (0.3, 1.0, 2.5):
        ref = torch.softmax(logits.double() / t, dim=-1)
        got = logits_to_probs(logits, SamplingParams(temperature=t))
        assert got.dtype == torch.float32 and torch.allclose(got.double(), ref, atol=1e-6)
    assert logits_to_probs(logits[0], SamplingParams()).shape == (11,)


def test_top_k_keeps_ties_with_the_kth_logit():
    logits = torch.tensor([2.0, 1.0, 1.0, 0.0, 3.0])
    probs = logits_to_probs(logits, SamplingParams(top_k=2))
    ref = torch.softmax(torch.tensor([3.0, 2.0]), dim=0)
    assert probs[4].item() == pytest.approx(ref[0].item()) and probs[0].item() == pytest.approx(ref[1].item())
    assert probs[[1, 2, 3]].tolist() == [0, 0, 0]
    tied = logits_to_probs(logits, SamplingParams(top_k=3))  # the two 1.0s tie for third: both kept
    assert (tied > 0).tolist() == [True, True, True, False, True]
    assert torch.equal(
        logits_to_probs(logits, SamplingParams(top_k=5)), logits_to_probs(logits, SamplingParams())
    )


@pytest.mark.parametrize(
    "top_p,kept", [(0.49, [0]), (0.51, [0, 1]), (0.79, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])]
)
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    got = logits_to_probs(probs.log(), SamplingParams(top_p=top_p))
    assert torch.nonzero(got).flatten().tolist() == kept
    assert torch.allclose(got[kept], probs[kept] / probs[kept].sum())


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    # after top_k=2: [4/7, 3/7]; top_p=0.5 keeps only the first (a plain top_p=0.5 would keep two)
    got = logits_to_probs(probs.log(), SamplingParams(top_k=2, top_p=0.5))
    assert got.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_matches_hf_warpers():
    """HF transformers' own warper chain is the oracle (temperature -> top-k -> top-p)."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    gen = torch.Generator().manual_seed(1)
    for trial in range(40):
        logits = torch.randn(4, 37, generator=gen, dtype=torch.float64) * 3
        t = [0.5, 1.0, 1.7][trial % 3]
        k = [0, 1, 5, 36][trial % 4]
        p = [1.0, 0.9, 0.5, 0.2, 0.97][trial % 5]
        scores = lp.TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            scores = lp.TopKLogitsWarper(k)(None, scores)
        if p < 1:
            scores = lp.TopPLogitsWarper(p)(None, scores)
        ref = torch.softmax(scores, dim=-1)
        got = logits_to_probs(logits, SamplingParams(temperature=t, top_k=k, top_p=p))
        assert torch.equal(got > 0, ref > 0), (t, k, p)
        assert torch.allclose(got, ref, atol=1e-12)


def test_lane_random_streams():
    a, b = LaneRandom(1234), LaneRandom(1234)
    ra = torch.rand(5, generator=a.generator())
    assert torch.equal(ra, torch.rand(5, generator=b.generator()))
    assert a.generator() is a.generator("cpu")  # one stream per device, reused
    unseeded = [LaneRandom() for _ in range(4)]
    assert len({u.seed for u in unseeded}) == 4
    draws = [torch.rand(3, generator=u.generator()).tolist() for u in unseeded]
    assert len({tuple(d) for d in draws}) == 4
    replay = LaneRandom(unseeded[0].seed)  # the recorded seed replays an unseeded stream
    assert torch.rand(3, generator=replay.generator()).tolist() == draws[0]


def test_sample_token_only_draws_from_the_support():
    gen = LaneRandom(0).generator()
    probs = torch.tensor([0.0, 0.7, 0.0, 0.3])
    assert {sample_token(probs, gen) for _ in range(200)} == {1, 3}


def test_logits_shape_is_checked():
    with pytest.raises(ValueError, match="vocab"):
        logits_to_probs(torch.zeros(2, 3, 4), SamplingParams())
