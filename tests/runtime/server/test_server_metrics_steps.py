"""`ServerMetrics.step_emitted`: one call per step gives the same series as observing every token."""

from __future__ import annotations

import asyncio
import re

import pytest

from ignis.runtime.sampling import SamplingParams
from ignis.runtime.server.lanes import LaneSnapshot, RequestHandle
from ignis.runtime.server.metrics import ServerMetrics


def _series(text: str) -> dict[str, float]:
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(ignis_(?:inter_token|time_to_first|generation)\S*) (\S+)$", text, re.M)
    }


def test_a_step_counts_like_one_observation_per_token() -> None:
    loop = asyncio.new_event_loop()
    try:
        handles = [RequestHandle([1, 2], SamplingParams(), loop) for _ in range(3)]
        batched = ServerMetrics(LaneSnapshot, 8)
        # per step: (request index, tokens), at times 1.0, 1.004, 1.0101, 1.5
        steps = [
            (1.0, [(0, 1), (1, 1)]),
            (1.004, [(0, 5), (1, 1), (2, 2)]),
            (1.0101, [(0, 3)]),
            (1.5, [(1, 7)]),
        ]
        for now, emitted in steps:
            batched.step_emitted([(handles[i], n) for i, n in emitted], now)
        # the reference: every token observed on its own (prometheus_client's Histogram.observe)
        ref = ServerMetrics(LaneSnapshot, 8)
        last: dict[int, float] = {}
        for now, emitted in steps:
            for i, n in emitted:
                ref.generation_tokens.inc(n)
                if i not in last:
                    ref.ttft.observe(now - handles[i].arrival)
                else:
                    for _ in range(n):
                        ref.itl.observe((now - last[i]) / n)
                last[i] = now
        got, want = _series(batched.render().decode()), _series(ref.render().decode())
        assert got.keys() == want.keys() and any("_bucket" in k for k in got)
        for key, value in want.items():
            if "_created" in key:  # creation times of the two registries
                continue
            if key.endswith("_sum"):  # a sum of n equal values is value * n here (rounding aside)
                assert got[key] == pytest.approx(value, rel=1e-12), key
            else:
                assert got[key] == value, key
        # after each first step (TTFT): request 0 emits 5 + 3 tokens, request 1 1 + 7, request 2 none
        assert got["ignis_inter_token_latency_seconds_count"] == 5 + 3 + 1 + 7
    finally:
        loop.close()
