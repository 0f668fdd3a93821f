"""`ignis-bench`'s statistics, prompt files and table on synthetic data (no server): percentiles by
linear interpolation, per-request TTFT / TPOT / ITL, aggregate counts and throughput, speculative
figures from /metrics deltas, prompt-file errors, seeded random prompts."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from ignis.tools.bench.serve.report import format_report
from ignis.tools.bench.serve.run import arrival_gaps
from ignis.tools.bench.serve.stats import (
    RequestResult,
    checkpoint_summary,
    counters_json,
    distribution,
    linear_fit,
    parse_metrics,
    percentile,
    server_side_summary,
    speculative_summary,
    summarize,
)
from ignis.tools.bench.serve.workload import (
    DatasetError,
    default_dataset,
    load_jsonl,
    random_token_prompts,
    tool_output_text,
)


def test_percentiles_interpolate_between_closest_ranks() -> None:
    values = list(range(1, 101))  # 1..100
    random.Random(0).shuffle(values)
    # rank q/100 * 99: p50 -> 49.5 -> 50.5; p90 -> 89.1 -> 90.1; p99 -> 98.01 -> 99.01
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 100
    assert percentile([7.0], 99) == 7.0
    assert percentile([10.0, 20.0], 25) == pytest.approx(12.5)
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_distribution_keys_and_empty() -> None:
    d = distribution([4.0, 1.0, 3.0, 2.0], [50, 99.9])
    assert d["count"] == 4 and d["mean"] == 2.5 and d["min"] == 1.0 and d["max"] == 4.0
    assert d["p50"] == pytest.approx(2.5) and d["p99.9"] == pytest.approx(1 + 0.999 * 3)
    assert d["std"] == pytest.approx(math.sqrt(1.25))
    empty = distribution([], [50, 90])
    assert empty == {
        "count": 0,
        "mean": None,
        "std": None,
        "min": None,
        "max": None,
        "p50": None,
        "p90": None,
    }


def _result(i: int, times: list[float], *, e2e: float, prompt: int = 10, cached: int = 0) -> RequestResult:
    return RequestResult(
        index=i,
        prompt_id=f"p{i}",
        ok=True,
        status=200,
        ttft=times[0],
        e2e=e2e,
        token_times=times,
        prompt_tokens=prompt,
        output_tokens=len(times),
        cached_tokens=cached,
    )


def test_request_timings() -> None:
    r = _result(0, [0.5, 0.6, 0.6, 0.9], e2e=1.0)
    assert r.itl == pytest.approx([0.1, 0.0, 0.3])
    assert r.tpot == pytest.approx((1.0 - 0.5) / 3)
    assert r.decode_tok_s == pytest.approx(3 / 0.5)
    one = _result(1, [0.2], e2e=0.2)
    assert one.itl == [] and one.tpot is None and one.decode_tok_s is None
    j = r.to_json()
    assert j["ttft"] == 0.5 and j["itl"] == pytest.approx([0.1, 0.0, 0.3]) and "text" not in j
    assert "session" not in j and "token_times" not in j


def test_summary_counts_throughput_and_latencies() -> None:
    ok = [
        _result(0, [0.1, 0.2, 0.3], e2e=0.3, prompt=100, cached=40),
        _result(1, [0.3, 0.5, 0.7, 0.9], e2e=1.0, prompt=50, cached=0),
    ]
    bad = [
        RequestResult(2, "p2", error="HTTP 503: queue_full: the queue is full", status=503),
        RequestResult(3, "p3", error="HTTP 503: queue_full: the queue is full", status=503),
        RequestResult(4, "p4", error="connection error: ConnectError()"),
        RequestResult(5, "p5", error="cancelled: the run was interrupted"),
    ]
    s = summarize([*ok, *bad], duration=2.0, percentiles=[50, 90])
    assert (s["requests"], s["completed"], s["failed"], s["cancelled"]) == (6, 2, 3, 1)
    assert s["errors"] == {"HTTP 503": 2, "connection error": 1}
    assert (s["prompt_tokens"], s["cached_prompt_tokens"], s["output_tokens"]) == (150, 40, 7)
    assert s["prompt_tokens_reused_pct"] == pytest.approx(100 * 40 / 150)
    assert s["output_throughput"] == pytest.approx(3.5) and s["request_throughput"] == pytest.approx(1.0)
    assert s["total_token_throughput"] == pytest.approx(157 / 2)
    assert s["ttft"]["count"] == 2 and s["ttft"]["p50"] == pytest.approx(0.2)
    assert s["itl"]["count"] == 2 + 3 and s["itl"]["max"] == pytest.approx(0.2)
    assert s["tpot"]["mean"] == pytest.approx(((0.3 - 0.1) / 2 + (1.0 - 0.3) / 3) / 2)
    assert s["e2e"]["p90"] == pytest.approx(0.3 + 0.9 * 0.7)
    assert s["decode_tok_s"]["count"] == 2


METRICS_BEFORE = """\
# HELP ignis_speculative_rounds_total speculative lane-rounds
# TYPE ignis_speculative_rounds_total counter
ignis_speculative_rounds_total 10.0
# TYPE ignis_speculative_accepted_tokens_total counter
ignis_speculative_accepted_tokens_total 25.0
# TYPE ignis_speculative_drafted_tokens_total counter
ignis_speculative_drafted_tokens_total 30.0
# TYPE ignis_speculative_position_drafted_total counter
ignis_speculative_position_drafted_total{position="0"} 10.0
ignis_speculative_position_drafted_total{position="1"} 10.0
ignis_speculative_position_drafted_total{position="2"} 10.0
# TYPE ignis_speculative_position_accepted_total counter
ignis_speculative_position_accepted_total{position="0"} 8.0
ignis_speculative_position_accepted_total{position="1"} 5.0
ignis_speculative_position_accepted_total{position="2"} 2.0
# TYPE ignis_lanes_active gauge
ignis_lanes_active 3.0
"""


def test_speculative_figures_come_from_counter_deltas() -> None:
    before = parse_metrics(METRICS_BEFORE)
    after_text = (
        METRICS_BEFORE.replace("rounds_total 10.0", "rounds_total 30.0")
        .replace("accepted_tokens_total 25.0", "accepted_tokens_total 75.0")
        .replace("drafted_tokens_total 30.0", "drafted_tokens_total 90.0")
        .replace('drafted_total{position="0"} 10.0', 'drafted_total{position="0"} 30.0')
        .replace('drafted_total{position="1"} 10.0', 'drafted_total{position="1"} 30.0')
        .replace('drafted_total{position="2"} 10.0', 'drafted_total{position="2"} 30.0')
        .replace('accepted_total{position="0"} 8.0', 'accepted_total{position="0"} 24.0')
        .replace('accepted_total{position="1"} 5.0', 'accepted_total{position="1"} 15.0')
        .replace('accepted_total{position="2"} 2.0', 'accepted_total{position="2"} 2.0')
        .replace("lanes_active 3.0", "lanes_active 0.0")
    )
    delta = parse_metrics(after_text).delta(before)
    spec = speculative_summary(delta)
    assert (spec["rounds"], spec["accepted_tokens"], spec["drafted_tokens"]) == (20, 50, 60)
    assert spec["tokens_per_round"] == pytest.approx(2.5)
    assert [p["rate"] for p in spec["per_position"]] == pytest.approx([16 / 20, 10 / 20, 0.0])
    assert spec["draft_acceptance_rate"] == pytest.approx(26 / 60)
    flat = counters_json(delta)
    assert flat["ignis_speculative_rounds_total"] == 20
    assert 'ignis_speculative_position_accepted_total{position="2"}' not in flat  # no change
    assert not any(k.startswith("ignis_lanes_active") for k in flat)  # gauges are not deltas


def test_server_side_means_come_from_histogram_deltas() -> None:
    def hist(total: float, count: float) -> str:
        return (
            "# TYPE ignis_time_to_first_token_seconds histogram\n"
            f'ignis_time_to_first_token_seconds_bucket{{le="+Inf"}} {count}\n'
            f"ignis_time_to_first_token_seconds_sum {total}\n"
            f"ignis_time_to_first_token_seconds_count {count}\n"
            "# TYPE ignis_generation_tokens_total counter\n"
            f"ignis_generation_tokens_total {count * 10}\n"
        )

    side = server_side_summary(parse_metrics(hist(7.0, 6.0)).delta(parse_metrics(hist(1.0, 2.0))))
    assert side["ttft_mean_s"] == pytest.approx(6.0 / 4) and side["generation_tokens"] == 40
    assert side["request_duration_mean_s"] is None  # no such histogram


def test_prompt_checkpoint_counters_are_summarized_when_the_server_has_them() -> None:
    def text(lookups: int, card: int, host: int, reused: int, evicted: int, held: int) -> str:
        return (
            "# TYPE ignis_prompt_checkpoint_lookups_total counter\n"
            f"ignis_prompt_checkpoint_lookups_total {lookups}\n"
            "# TYPE ignis_prompt_checkpoint_hits_total counter\n"
            f'ignis_prompt_checkpoint_hits_total{{tier="card"}} {card}\n'
            f'ignis_prompt_checkpoint_hits_total{{tier="host"}} {host}\n'
            "# TYPE ignis_prompt_checkpoint_reused_tokens_total counter\n"
            f"ignis_prompt_checkpoint_reused_tokens_total {reused}\n"
            "# TYPE ignis_prompt_checkpoint_evictions_total counter\n"
            f'ignis_prompt_checkpoint_evictions_total{{tier="card"}} {evicted}\n'
            "# TYPE ignis_prompt_checkpoint_bytes gauge\n"
            f'ignis_prompt_checkpoint_bytes{{tier="card"}} {held}\n'
        )

    before, after = parse_metrics(text(4, 1, 0, 100, 0, 10)), parse_metrics(text(14, 7, 2, 5100, 3, 99))
    ck = checkpoint_summary(after.delta(before), after)
    assert ck is not None
    assert (ck["lookups"], ck["hits"], ck["reused_tokens"]) == (10, 8, 5000)
    assert ck["hit_rate"] == pytest.approx(0.8) and ck["hits_by_tier"] == {"card": 6, "host": 2}
    assert ck["evictions_by_tier"] == {"card": 3} and ck["bytes_held_by_tier"] == {"card": 99}
    plain = parse_metrics(METRICS_BEFORE)
    assert checkpoint_summary(plain.delta(plain), plain) is None


def test_no_speculation_gives_empty_figures() -> None:
    snap = parse_metrics("# TYPE ignis_prompt_tokens_total counter\nignis_prompt_tokens_total 5.0\n")
    spec = speculative_summary(snap.delta(snap))
    assert spec["rounds"] == 0 and spec["tokens_per_round"] is None and spec["per_position"] == []


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_have_the_rate_and_the_burstiness(burstiness: float) -> None:
    gaps = arrival_gaps(20001, rate=5.0, burstiness=burstiness, seed=0)
    assert len(gaps) == 20000 and gaps == arrival_gaps(20001, 5.0, burstiness, seed=0)
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert mean == pytest.approx(0.2, rel=0.03)  # 1 / rate
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)  # gamma: cv = 1 / sqrt(shape)
    assert arrival_gaps(3, math.inf, burstiness, seed=0) == [0.0, 0.0]


def test_linear_fit() -> None:
    assert linear_fit([1, 2, 3], [5, 7, 9]) == pytest.approx((2.0, 3.0))
    assert linear_fit([1, 1], [2, 3]) is None


def test_prompt_file(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(
        '{"id": "a", "kind": "code", "messages": [{"role": "user", "content": "hi"}]}\n'
        "\n# a comment\n"
        '{"prompt": [5, 6, 7]}\n{"prompt": "text"}\n'
    )
    prompts = load_jsonl(f)
    assert [p.id for p in prompts] == ["a", "line-4", "line-5"]
    assert prompts[0].chat_messages() == [{"role": "user", "content": "hi"}]
    assert prompts[0].completion_prompt() == "hi"
    assert prompts[1].completion_prompt() == [5, 6, 7]
    assert prompts[2].chat_messages() == [{"role": "user", "content": "text"}]
    with pytest.raises(DatasetError, match="token ids"):
        prompts[1].chat_messages()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{nope\n", r"p\.jsonl:1: not JSON"),
        ("[1, 2]\n", "expected a JSON object"),
        ('{"id": "x"}\n', 'needs "messages" or "prompt"'),
        ('{"messages": "hi"}\n', '"messages" must be'),
        ('{"prompt": [1, "2"]}\n', '"prompt" must be'),
        ("\n\n", "holds no prompt"),
    ],
)
def test_bad_prompt_files_name_file_and_line(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    with pytest.raises(DatasetError, match=match):
        load_jsonl(f)
    with pytest.raises(DatasetError, match="cannot read"):
        load_jsonl(tmp_path / "missing.jsonl")


def test_the_shared_prompt_set_is_found_beside_a_worktrees_main_checkout(tmp_path: Path) -> None:
    main = tmp_path / "main"
    (main / ".git" / "worktrees" / "bench").mkdir(parents=True)
    (tmp_path / "shared" / "bench").mkdir(parents=True)
    (tmp_path / "shared" / "bench" / "prompts.jsonl").write_text('{"prompt": "x"}\n')
    wt = tmp_path / "wt" / "bench"
    wt.mkdir(parents=True)
    (wt / ".git").write_text(f"gitdir: {main / '.git' / 'worktrees' / 'bench'}\n")
    found, tried = default_dataset(wt, wt)
    assert found == (tmp_path / "shared" / "bench" / "prompts.jsonl").resolve()
    assert tried[0] == (tmp_path / "wt" / "shared" / "bench" / "prompts.jsonl").resolve()
    found, tried = default_dataset(tmp_path / "wt" / "other", tmp_path / "wt" / "other")
    assert found is None and tried


def test_the_shared_prompt_set_parses() -> None:
    found, _ = default_dataset(Path(__file__).resolve().parents[2], Path.cwd())
    if found is None:
        pytest.skip("no ../shared/bench/prompts.jsonl beside this checkout")
    prompts = load_jsonl(found)
    assert len(prompts) == len([line for line in found.read_text().splitlines() if line.strip()])
    assert all(p.messages for p in prompts)


def test_random_prompts_are_seeded() -> None:
    a = random_token_prompts(5, [3, 8], (16, 256), seed=1)
    assert [len(p.prompt or []) for p in a] == [3, 8, 3, 8, 3]
    assert all(16 <= t < 256 for p in a for t in p.prompt or [])
    assert a == random_token_prompts(5, [3, 8], (16, 256), seed=1)
    assert a != random_token_prompts(5, [3, 8], (16, 256), seed=2)
    shared = random_token_prompts(4, [2], (16, 256), seed=1, prefix_len=6)
    assert all(
        len(p.prompt or []) == 8 and (p.prompt or [])[:6] == (shared[0].prompt or [])[:6] for p in shared
    )
    assert len({tuple((p.prompt or [])[6:]) for p in shared}) == 4
    text = tool_output_text(random.Random(0), 50)
    assert 50 <= len(text.split()) <= 60  # the words plus one line number per 6-12 words


def test_the_table_renders_a_report() -> None:
    results = [_result(0, [0.1, 0.2], e2e=0.2)]
    report = {
        "mode": "load",
        "server": "unix socket /x",
        "model": "m",
        "config": {
            "percentiles": [50, 99],
            "request_rate": None,
            "temperature": 0.0,
            "endpoint": "chat",
            "concurrency": 2,
            "max_tokens": 2,
        },
        "interrupted": False,
        "summary": summarize(results, 1.0, [50, 99]),
        "speculative": speculative_summary(parse_metrics(METRICS_BEFORE).delta(parse_metrics(""))),
    }
    table = format_report(report)
    assert "TTFT" in table and "p99" in table and "Tokens per round" in table and "2.500" in table
    json.dumps(report)


def test_warmup_variant_shares_no_prefix_with_its_prompt() -> None:
    """ignis-bench's warm-up request must not leave a prompt checkpoint of the first measured prompt
    (its TTFT would be a restore): the variant has the same size and a different first token / word."""
    from ignis.tools.bench.serve.workload import Prompt

    ids = Prompt("random-0", prompt=[5, 9, 2, 7, 3], kind="random")
    v = ids.warmup_variant()
    assert v.prompt == [3, 7, 2, 9, 5] and v.kind == "random" and v.id == "warm-up-random-0"
    text = Prompt("p", prompt="one two three")
    assert text.warmup_variant().prompt == "three two one"
    chat = Prompt(
        "c", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"}]
    )
    w = chat.warmup_variant()
    assert w.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "c b a"}]
    assert chat.messages[-1]["content"] == "a b c"  # the measured prompt is untouched
