"""Statistics of `ignis-bench`: percentiles, per-request results, aggregate summaries, /metrics deltas.

Percentiles use linear interpolation between closest ranks (numpy's default `method="linear"`, the
same as `vllm bench serve`): for sorted values v[0..n-1], percentile q sits at rank r = q/100 * (n-1)
and is v[floor(r)] + (r - floor(r)) * (v[floor(r)+1] - v[floor(r)]).

Speculative figures come from the server's counters (`ignis.runtime.metrics`, docs/adr/0002): over a
run, delta(accepted_tokens_total) / delta(rounds_total) is the committed tokens per verify lane-round,
and delta(position_accepted_total{i}) / delta(position_drafted_total{i}) the acceptance rate of the
draft at position i (0-based). The counters are server-wide, so these figures cover every request the
server ran in the interval, the benchmark's own and anyone else's.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_PERCENTILES",
    "MetricsSnapshot",
    "RequestResult",
    "checkpoint_summary",
    "counters_json",
    "distribution",
    "linear_fit",
    "parse_metrics",
    "percentile",
    "server_side_summary",
    "speculative_summary",
    "summarize",
]

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)

# Label sets of a Prometheus sample, frozen so a snapshot can key on (name, labels).
SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of `values` by linear interpolation (module docstring).

    Raises:
        ValueError: `values` is empty or q is outside [0, 100].
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if len(values) == 0:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def distribution(
    values: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict[str, Any]:
    """{"count", "mean", "std", "min", "max", "p50", "p90", ...} of `values` (all None when empty).

    Percentile keys are "p" plus the percentile with a trailing ".0" dropped (p50, p99.9).
    """
    keys = [_pkey(q) for q in percentiles]
    if len(values) == 0:
        return {"count": 0, "mean": None, "std": None, "min": None, "max": None, **dict.fromkeys(keys)}
    arr = np.asarray(values, dtype=np.float64)
    out: dict[str, Any] = {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "std": float(arr.std()),
        "min": float(arr.min()),
        "max": float(arr.max()),
    }
    for key, q in zip(keys, percentiles, strict=True):
        out[key] = percentile(arr, q)  # type: ignore[arg-type]
    return out


def _pkey(q: float) -> str:
    return "p" + (str(int(q)) if float(q).is_integer() else str(q))


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds, measured with `time.perf_counter`.

    Attributes:
        index: the request's position in the run (0-based).
        prompt_id: the dataset's id of its prompt (or "random-<i>", "session-<s>/turn-<t>").
        ok: the request completed (HTTP 200 and a full stream).
        error: None when ok, else a short reason ("HTTP 503 queue_full: ...", "stream error: ...").
        status: the HTTP status (None when the connection failed).
        start: when the request was sent, seconds from the run's start.
        ttft: seconds from sending to the first token's chunk (None without a token).
        e2e: seconds from sending to the end of the stream.
        token_times: arrival of each token's chunk, seconds from sending (one token per chunk).
        prompt_tokens: the server's usage.prompt_tokens (or the client's count before usage arrives).
        output_tokens: tokens received (usage.completion_tokens when reported).
        cached_tokens: usage.prompt_tokens_details.cached_tokens (0 when the server does not report it).
        finish_reason: the last chunk's finish_reason.
        text: the generated text (kept for multi-turn replay; left out of the JSON).
        generated_ids: the generated token ids when the server sends them (`return_token_ids`; left out
            of the JSON).
        prompt_ids: the prompt's token ids as the server saw them, when it sends them (/v1/completions
            with `return_token_ids`; left out of the JSON).
        session: the multi-turn session index (None outside --multi-turn).
        turn: the turn index in its session (None outside --multi-turn).
    """

    index: int
    prompt_id: str
    ok: bool = False
    error: str | None = None
    status: int | None = None
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    generated_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    session: int | None = None
    turn: int | None = None

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive token chunks, seconds (n - 1 of them)."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (output_tokens - 1) (None if < 2 tokens)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def decode_tok_s(self) -> float | None:
        """This lane's decode rate: (output_tokens - 1) / (e2e - ttft), tokens/s (None if undefined)."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2 or self.e2e <= self.ttft:
            return None
        return (self.output_tokens - 1) / (self.e2e - self.ttft)

    def to_json(self) -> dict[str, Any]:
        """The JSON record of this request (times in seconds; `text` left out)."""
        out = asdict(self)
        del out["text"], out["token_times"], out["generated_ids"], out["prompt_ids"]
        if self.session is None:
            del out["session"], out["turn"]
        out["itl"] = self.itl
        out["tpot"] = self.tpot
        out["decode_tok_s"] = self.decode_tok_s
        return out


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The aggregate figures of a run.

    Args:
        results: every request that was sent (completed or failed).
        duration: seconds from the run's first request to its last completion (> 0).
        percentiles: which percentiles the distributions report.

    Returns:
        A dict: counts ("requests" sent, "completed", "failed", "errors" by reason, "cancelled" in flight
        by Ctrl-C, not failures), token totals, throughput
        ("request_throughput" req/s, "output_throughput" and "total_token_throughput" tok/s over
        `duration`), and distributions (`distribution`) of "ttft", "tpot", "itl", "e2e" (seconds) and
        "decode_tok_s" (each completed request's own tokens per second after its first token).
        Token totals and distributions cover completed requests only.
    """
    done = [r for r in results if r.ok]
    cancelled = sum(1 for r in results if not r.ok and _error_key(r) == "cancelled")
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok and _error_key(r) != "cancelled":
            key = _error_key(r)
            errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    duration = max(duration, 1e-9)
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done) - cancelled,
        "cancelled": cancelled,
        "errors": errors,
        "duration_s": duration,
        "prompt_tokens": in_tokens,
        "cached_prompt_tokens": cached,
        "prompt_tokens_reused_pct": 100.0 * cached / in_tokens if in_tokens else 0.0,
        "output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft": distribution([r.ttft for r in done if r.ttft is not None], percentiles),
        "tpot": distribution([t for r in done if (t := r.tpot) is not None], percentiles),
        "itl": distribution([g for r in done for g in r.itl], percentiles),
        "e2e": distribution([r.e2e for r in done if r.e2e is not None], percentiles),
        "decode_tok_s": distribution([v for r in done if (v := r.decode_tok_s) is not None], percentiles),
    }


def _error_key(r: RequestResult) -> str:
    """A failure's class for counting: "HTTP 503", "stream error", "connection error", "cancelled"."""
    if r.error is None:
        return "unknown"
    return r.error.split(":", 1)[0]


@dataclass
class MetricsSnapshot:
    """The numeric samples of one GET /metrics: (name, sorted labels) -> value."""

    samples: dict[SampleKey, float]

    def value(self, name: str) -> float | None:
        """The sum of `name`'s samples over their labels (None when the server has no such metric)."""
        found = [v for (n, _labels), v in self.samples.items() if n == name]
        return sum(found) if found else None

    def delta(self, before: MetricsSnapshot) -> dict[SampleKey, float]:
        """Counter increases since `before`: every `*_total` and histogram `_sum`/`_count` sample of self,
        minus its value in `before` (0 where absent). Gauges and buckets are left out."""
        out: dict[SampleKey, float] = {}
        for key, value in self.samples.items():
            name = key[0]
            if name.endswith(("_total", "_sum", "_count")) and not name.endswith("_created"):
                out[key] = value - before.samples.get(key, 0.0)
        return out


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse Prometheus text exposition (prometheus_client's parser) into a snapshot.

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return MetricsSnapshot(samples)


def _value(delta: Mapping[SampleKey, float], name: str) -> float:
    return sum(v for (n, _labels), v in delta.items() if n == name)


def _by_position(delta: Mapping[SampleKey, float], name: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for (n, labels), v in delta.items():
        if n == name:
            pos = dict(labels).get("position")
            if pos is not None and pos.isdigit():
                out[int(pos)] = out.get(int(pos), 0.0) + v
    return out


def speculative_summary(delta: Mapping[SampleKey, float]) -> dict[str, Any]:
    """Speculative figures over a run from the counters' increases (module docstring).

    Returns:
        {"rounds", "drafted_tokens", "accepted_tokens", "tokens_per_round" (None without rounds),
        "draft_acceptance_rate" (accepted drafts / drafted, None without drafts),
        "per_position": [{"position", "drafted", "accepted", "rate"}...] ascending}.
    """
    rounds = _value(delta, "ignis_speculative_rounds_total")
    drafted = _value(delta, "ignis_speculative_drafted_tokens_total")
    accepted = _value(delta, "ignis_speculative_accepted_tokens_total")
    pos_drafted = _by_position(delta, "ignis_speculative_position_drafted_total")
    pos_accepted = _by_position(delta, "ignis_speculative_position_accepted_total")
    per_position = []
    for pos in sorted(set(pos_drafted) | set(pos_accepted)):
        d, a = pos_drafted.get(pos, 0.0), pos_accepted.get(pos, 0.0)
        per_position.append(
            {"position": pos, "drafted": int(d), "accepted": int(a), "rate": a / d if d else None}
        )
    accepted_drafts = sum(pos_accepted.values())
    return {
        "rounds": int(rounds),
        "drafted_tokens": int(drafted),
        "accepted_tokens": int(accepted),
        "tokens_per_round": accepted / rounds if rounds else None,
        "draft_acceptance_rate": accepted_drafts / drafted if drafted else None,
        "per_position": per_position,
    }


def server_side_summary(delta: Mapping[SampleKey, float]) -> dict[str, Any]:
    """The server's own view of the run from its histograms' `_sum`/`_count` increases: mean TTFT and
    mean request duration (seconds, None when the server has no such histogram or counted nothing),
    prompt and generation tokens it counted. Beside the client's figures it shows what the socket,
    HTTP and the client add."""

    def mean(name: str) -> float | None:
        n = _value(delta, f"{name}_count")
        return _value(delta, f"{name}_sum") / n if n else None

    return {
        "ttft_mean_s": mean("ignis_time_to_first_token_seconds"),
        "request_duration_mean_s": mean("ignis_request_duration_seconds"),
        "inter_token_latency_mean_s": mean("ignis_inter_token_latency_seconds"),
        "prompt_tokens": int(_value(delta, "ignis_prompt_tokens_total")),
        "generation_tokens": int(_value(delta, "ignis_generation_tokens_total")),
    }


def _by_label(delta: Mapping[SampleKey, float], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in delta.items():
        if n == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def checkpoint_summary(
    delta: Mapping[SampleKey, float], after: MetricsSnapshot | None
) -> dict[str, Any] | None:
    """Prompt-checkpoint reuse over a run from the `ignis_prompt_checkpoint_*` counters' increases
    (lookups, hits by tier, prompt tokens reused, evictions by tier) and the bytes held per tier at the
    end; None when the server exports no such counters."""
    if not any(n == "ignis_prompt_checkpoint_lookups_total" for n, _labels in delta):
        return None
    hits = _by_label(delta, "ignis_prompt_checkpoint_hits_total", "tier")
    lookups = _value(delta, "ignis_prompt_checkpoint_lookups_total")
    held: dict[str, float] = {}
    if after is not None:
        for (n, labels), v in after.samples.items():
            if n == "ignis_prompt_checkpoint_bytes":
                held[dict(labels).get("tier", "")] = v
    return {
        "lookups": int(lookups),
        "hits": int(sum(hits.values())),
        "hit_rate": sum(hits.values()) / lookups if lookups else None,
        "hits_by_tier": {k: int(v) for k, v in sorted(hits.items())},
        "reused_tokens": int(_value(delta, "ignis_prompt_checkpoint_reused_tokens_total")),
        "evictions_by_tier": {
            k: int(v)
            for k, v in sorted(_by_label(delta, "ignis_prompt_checkpoint_evictions_total", "tier").items())
        },
        "bytes_held_by_tier": {k: int(v) for k, v in sorted(held.items())},
    }


def counters_json(delta: Mapping[SampleKey, float]) -> dict[str, float]:
    """The counter deltas keyed by Prometheus sample text, e.g. `ignis_requests_total{endpoint="..."}`,
    zero deltas left out."""
    out: dict[str, float] = {}
    for (name, labels), v in sorted(delta.items()):
        if v == 0 or math.isnan(v):
            continue
        label = ",".join(f'{k}="{val}"' for k, val in labels)
        out[f"{name}{{{label}}}" if label else name] = v
    return out


def linear_fit(xs: Iterable[float], ys: Iterable[float]) -> tuple[float, float] | None:
    """Least-squares (slope, intercept) of y on x; None with fewer than 2 distinct x."""
    x = np.asarray(list(xs), dtype=np.float64)
    y = np.asarray(list(ys), dtype=np.float64)
    if x.size < 2 or np.unique(x).size < 2:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    return float(slope), float(intercept)
