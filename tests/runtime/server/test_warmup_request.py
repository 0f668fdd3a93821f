"""The load-time warm-up request (`ignis.runtime.server.warmup.warm_up_engine`) runs the engine's
paths once and leaves no trace: metrics, the prompt-checkpoint cache and later outputs are as if it
never ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.errors import StateError
from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.prefix_cache import PrefixCache
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.server.warmup import warm_up_engine


def _engine(cache: PrefixCache | None, metrics: SpeculativeMetrics) -> SpeculativeEngine:
    return SpeculativeEngine(_executor(), None, metrics=metrics, prefix_cache=cache, max_prefill_tokens=64)


_EX: dict[str, object] = {}


def _executor():  # type: ignore[no-untyped-def]
    import tempfile

    from hf_tiny_hybrid import make_tiny_hybrid

    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor

    if "ex" not in _EX:
        tiny = make_tiny_hybrid("qwen3_5", Path(tempfile.mkdtemp()) / "m")
        _EX["ex"] = (tiny.config, tiny.tensors)
    config, tensors = _EX["ex"]
    return StaticHybridExecutor(
        config, tensors, device="cpu", dtype=torch.float32, max_lanes=4, max_columns=8
    )


def test_warm_up_request_leaves_no_trace() -> None:
    prompt = [5, 9, 13, 2, 7, 11, 3, 8, 4, 6] * 3
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    cold_metrics = SpeculativeMetrics()
    cold = _engine(PrefixCache(card_bytes=0, host_bytes=1 << 30), cold_metrics)
    want = cold.generate([prompt], params)[0].output_token_ids

    metrics = SpeculativeMetrics()
    cache = PrefixCache(card_bytes=0, host_bytes=1 << 30)
    engine = _engine(cache, metrics)
    before = (metrics.samples(), cache.samples())
    seconds = warm_up_engine(engine)
    assert seconds > 0
    assert engine.metrics is metrics and cache.num_entries("host") == 0 and cache.num_entries("card") == 0
    assert (metrics.samples(), cache.samples()) == before
    got = engine.generate([prompt], params)[0].output_token_ids
    assert got == want
    assert cache.samples() == cold.checkpoints.cache.samples()  # the same counters as a cold engine's
    assert metrics.samples() == cold_metrics.samples()


def test_warm_up_request_refuses_an_engine_with_lanes() -> None:
    engine = _engine(None, SpeculativeMetrics())
    engine.add_lane([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    with pytest.raises(StateError, match="at load"):
        warm_up_engine(engine)


def test_the_server_warms_the_text_side_at_start() -> None:
    """At start, before any request: the chat template compiled, the tokenizer's truncating copy for the
    context built and the longest token's bytes counted (each a one-time cost of the first chat
    request otherwise); the first chat request's prompt is then encoded with that same copy."""
    from server_helpers import serve
    from toy_model import ToySource

    source = ToySource()
    with serve(source, max_context=96) as running:
        tok = running.server.model.tokenizer
        assert 96 in tok._truncating_by_length  # built at start
        assert "max_token_bytes" in vars(tok)  # the cached_property computed
        copy = tok._truncating_by_length[96]
        with running.client() as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            r = c.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            assert r.status_code == 200, r.text
        assert tok._truncating_by_length[96] is copy


def test_warm_up_text_never_raises_for_a_template_that_refuses() -> None:
    from ignis.runtime.server.warmup import warm_up_text

    class Refusing:
        def render_chat(self, *a, **k):  # type: ignore[no-untyped-def]
            raise RuntimeError("this template needs a system message")

    assert warm_up_text(Refusing(), 64) >= 0.0
    assert warm_up_text(object(), None) >= 0.0
