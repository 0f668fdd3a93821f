"""Prometheus metrics of the server (GET /metrics, text exposition format 0.0.4).

Speculative decoding (`ignis.runtime.metrics` defines each precisely; they appear once the first
speculative round has been counted, so a server with speculation off shows none of them):

- `ignis_speculative_rounds_total`, `ignis_speculative_drafted_tokens_total`,
  `ignis_speculative_accepted_tokens_total` (accepted / rounds = tokens per round),
  `ignis_speculative_position_drafted_total{position}`, `ignis_speculative_position_accepted_total{position}`.

Requests and tokens:

- `ignis_requests_total{endpoint, status}`: every HTTP request to /v1/chat/completions and
  /v1/completions by the status code it was answered with: refusals included (400, 404, 405, 413,
  415, 503 of a full queue), and 500; 499 when a non-streamed client disconnected first.
- `ignis_request_finished_total{finish_reason}`: requests that got a lane and ended: "stop",
  "length", "abort" (client gone, shutdown) or "error" (engine failure).
- `ignis_prompt_tokens_total`, `ignis_generation_tokens_total`: prompt tokens of admitted requests
  and tokens emitted to clients (stop tokens included, nothing past a stop).
- `ignis_lanes_active`, `ignis_requests_waiting` (gauges), `ignis_lanes_max` (gauge, `--lanes`).

Latency histograms (seconds):

- `ignis_time_to_first_token_seconds`: from the request's submission to the step that emitted its
  first token (queueing and prefill included).
- `ignis_inter_token_latency_seconds`: per token after the first step's, the time between two steps
  of the request divided by the tokens the later step emitted (see `ignis.runtime.server.lanes`).
- `ignis_request_duration_seconds`: submission to the last token.

Each server has its own `CollectorRegistry`, so several servers in one process (tests) do not mix.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ignis.runtime.server.lanes import LaneSnapshot, RequestHandle

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_DURATION_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    300.0,
)

_SPEC_HELP = {
    "ignis_speculative_rounds": (
        "Speculative lane-rounds: one lane's share of a verify round in which it drafted."
    ),
    "ignis_speculative_drafted_tokens": "Draft tokens proposed in speculative lane-rounds.",
    "ignis_speculative_accepted_tokens": (
        "Tokens committed and emitted by speculative lane-rounds (accepted drafts plus the model's own "
        "token); divided by rounds it is tokens per round."
    ),
    "ignis_speculative_position_drafted": "Speculative lane-rounds that drafted at this position.",
    "ignis_speculative_position_accepted": (
        "Speculative lane-rounds whose draft at this position was accepted."
    ),
}


class _LiveCollector(Collector):
    """Reads the lane loop's snapshot at scrape time (speculative counters and lane gauges)."""

    def __init__(self, snapshot: Callable[[], LaneSnapshot], max_lanes: int) -> None:
        self._snapshot = snapshot
        self._max_lanes = max_lanes

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield GaugeMetricFamily(
            "ignis_lanes_active", "Lanes decoding or being prefilled now.", value=snap.num_active
        )
        yield GaugeMetricFamily(
            "ignis_requests_waiting",
            "Requests waiting for a lane (not yet prefilled).",
            value=snap.num_waiting,
        )
        yield GaugeMetricFamily(
            "ignis_lanes_max", "Lanes that may decode at once (--lanes).", value=self._max_lanes
        )
        samples = snap.spec_samples
        if not any(name == "ignis_speculative_rounds_total" and value > 0 for name, _, value in samples):
            return
        families: dict[str, CounterMetricFamily] = {}
        for name, labels, value in samples:
            base = name.removesuffix("_total")
            fam = families.get(base)
            if fam is None:
                fam = CounterMetricFamily(base, _SPEC_HELP.get(base, base), labels=sorted(labels))
                families[base] = fam
            fam.add_metric([labels[k] for k in sorted(labels)], value)
        yield from families.values()


def _observe_n(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of `value` (>= 0) in a label-less histogram: its matching bucket and count
    grow by `count` and its sum by value * count under one lock each (prometheus_client's `Histogram`
    keeps `_upper_bounds`, `_buckets` and `_sum`; a histogram without them is observed `count` times)."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if count == 1 or bounds is None or buckets is None or total is None:
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    buckets[bisect.bisect_left(bounds, value)].inc(count)


class ServerMetrics:
    """The server's Prometheus registry (module docstring). Thread-safe (prometheus_client's objects are).

    Args:
        snapshot: returns the lane loop's latest `LaneSnapshot`.
        max_lanes: `--lanes`.
    """

    def __init__(self, snapshot: Callable[[], LaneSnapshot], max_lanes: int) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "ignis_requests",
            "HTTP requests to the generation endpoints, by endpoint and status code.",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "ignis_request_finished",
            "Requests that got a lane and ended, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("ignis_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(
            "ignis_generation_tokens", "Tokens emitted to clients (stop tokens included).", registry=r
        )
        self.ttft = Histogram(
            "ignis_time_to_first_token_seconds",
            "Submission to the first token, in seconds.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "ignis_inter_token_latency_seconds",
            "Time per token between two steps of a request (a step's time spread over its tokens), seconds.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "ignis_request_duration_seconds",
            "Submission to the last token, in seconds.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        r.register(_LiveCollector(snapshot, max_lanes))

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)

    # Called by the lane thread.

    def request_admitted(self, handle: RequestHandle) -> None:
        """A request got into the engine (its prompt tokens count)."""
        self.prompt_tokens.inc(len(handle.prompt_token_ids))

    def tokens_emitted(self, handle: RequestHandle, num_tokens: int, now: float) -> None:
        """A step emitted num_tokens (>= 1) for a request at time now (monotonic seconds)."""
        self.step_emitted([(handle, num_tokens)], now)

    def step_emitted(self, emitted: Sequence[tuple[RequestHandle, int]], now: float) -> None:
        """One step emitted tokens for several requests at time now (monotonic seconds): (request, its
        tokens >= 1) each. The generation counter is incremented once; a request's n inter-token
        samples (all equal) go into the histogram as one observation of weight n."""
        total = 0
        for handle, num_tokens in emitted:
            total += num_tokens
            if handle.first_token_at is None:
                handle.first_token_at = now
                self.ttft.observe(now - handle.arrival)
            else:
                assert handle.last_token_at is not None
                _observe_n(self.itl, (now - handle.last_token_at) / num_tokens, num_tokens)
            handle.last_token_at = now
        if total:
            self.generation_tokens.inc(total)

    def request_finished(self, handle: RequestHandle, finish_reason: str, now: float) -> None:
        """A request that got a lane ended."""
        self.finished.labels(finish_reason=finish_reason).inc()
        if handle.first_token_at is not None:
            self.duration.observe(now - handle.arrival)
