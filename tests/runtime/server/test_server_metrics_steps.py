"""The server's metrics per step: `ServerMetrics.step_emitted` gives the same series as observing every
token, and the lane loop leaves the updates to the event loop (applied before the step's events)."""

from __future__ import annotations

import asyncio
import re

import pytest
import toy_executor as toy

from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.server.lanes import LaneLoop, LaneSnapshot, RequestHandle
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


def _lane_loop(metrics: ServerMetrics) -> LaneLoop:
    lanes = LaneLoop(
        lambda n, m: SpeculativeEngine(toy.ToyExecutor(), max_lanes=n, metrics=m), max_lanes=2, queue_size=2
    )
    lanes.metrics = metrics
    return lanes


def _queue(lanes: LaneLoop, handle: RequestHandle) -> None:
    """What `submit` queues (it needs the lane thread running)."""
    lanes._num_inflight += 1
    lanes._ops.append(("add", handle))


def test_the_lane_thread_leaves_the_metrics_to_the_event_loop() -> None:
    """The lane thread only queues a step's metric updates; the event loop applies them just before it
    queues the step's events, so a client that has its tokens reads counters that include them."""
    metrics = ServerMetrics(LaneSnapshot, 2)
    lanes = _lane_loop(metrics)
    loop = asyncio.new_event_loop()
    try:
        handle = RequestHandle([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), loop)
        _queue(lanes, handle)
        while lanes._engine.has_unfinished or lanes._ops:
            lanes._run_once()  # the lane thread's loop body
        text = metrics.render().decode()
        assert _series(text)["ignis_generation_tokens_total"] == 0  # not on the lane thread
        assert handle._queue.qsize() == 0
        loop.run_until_complete(asyncio.sleep(0))  # the event loop runs the step callbacks
        series = _series(metrics.render().decode())
        assert series["ignis_generation_tokens_total"] == 4
        assert series["ignis_time_to_first_token_seconds_count"] == 1
        assert 'ignis_request_finished_total{finish_reason="length"} 1.0' in metrics.render().decode()
        events = [handle._queue.get_nowait() for _ in range(handle._queue.qsize())]
        assert sum(len(e.token_ids) for e in events) == 4 and events[-1].finish_reason == "length"
    finally:
        loop.close()


def test_a_failing_metrics_update_loses_no_token(caplog: pytest.LogCaptureFixture) -> None:
    metrics = ServerMetrics(LaneSnapshot, 2)

    def broken(*args: object) -> None:
        raise RuntimeError("metrics bug (test)")

    metrics.step_emitted = broken  # type: ignore[method-assign]
    lanes = _lane_loop(metrics)
    loop = asyncio.new_event_loop()
    try:
        handle = RequestHandle([5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), loop)
        _queue(lanes, handle)
        while lanes._engine.has_unfinished or lanes._ops:
            lanes._run_once()
        loop.run_until_complete(asyncio.sleep(0))
        events = [handle._queue.get_nowait() for _ in range(handle._queue.qsize())]
        assert sum(len(e.token_ids) for e in events) == 3 and events[-1].finish_reason == "length"
        assert "a metrics update failed" in caplog.text
    finally:
        loop.close()
