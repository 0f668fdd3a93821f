"""The text table `ignis-bench` prints last: the run's aggregate figures, the latency distributions in
milliseconds, the speculative figures from /metrics, and for `--multi-turn` a row per turn."""

from __future__ import annotations

from typing import Any

__all__ = ["format_report", "format_sweep"]

_W = 78


def _num(v: Any, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _row(label: str, value: str) -> str:
    return f"{label:<44}{value:>{_W - 44}}"


def _title(text: str) -> str:
    return f" {text} ".center(_W, "=")


def _latencies(summary: dict[str, Any], pkeys: list[str]) -> list[str]:
    head = ["metric (ms)", "mean", *pkeys, "max"]
    rows = [head]
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E latency"}
    for key, name in names.items():
        d = summary[key]
        rows.append([name, *(_ms(d.get(k)) for k in ["mean", *pkeys, "max"])])
    d = summary["decode_tok_s"]
    rows.append(["lane tok/s (decode)", *(_num(d.get(k), ".1f") for k in ["mean", *pkeys, "max"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return [
        "  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)) for r in rows
    ]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.2f}"


def format_report(report: dict[str, Any]) -> str:
    """The table for a report of `run_load` / `run_multi_turn`."""
    s = report["summary"]
    pkeys = [
        "p" + (str(int(q)) if float(q).is_integer() else str(q)) for q in report["config"]["percentiles"]
    ]
    title = "ignis-bench: multi-turn agent replay" if report["mode"] == "multi-turn" else "ignis-bench"
    if report.get("label"):
        title += f" [{report['label']}]"
    lines = [_title(title + (" (interrupted)" if report["interrupted"] else ""))]
    cfg = report["config"]
    rate = "inf" if cfg["request_rate"] is None else f"{cfg['request_rate']:g}/s"
    sampling = "greedy" if cfg["temperature"] == 0 else f"temperature {cfg['temperature']:g}"
    lines += [
        _row("Server / model", f"{report['server']} / {report['model']}"),
        _row(
            "Endpoint, concurrency, rate, server lanes",
            f"{cfg['endpoint']}, {cfg['concurrency']}, {rate}, {_num(report.get('server_lanes'), '.0f')}",
        ),
        _row("Output tokens asked, sampling", f"{cfg['max_tokens']}, {sampling}"),
        _row("Requests completed / failed", f"{s['completed']} / {s['failed']}"),
        *([_row("Requests cancelled in flight (Ctrl-C)", str(s["cancelled"]))] if s["cancelled"] else []),
    ]
    for reason, n in sorted(s["errors"].items()):
        lines.append(_row(f"  failed: {reason}", str(n)))
    lines += [
        _row("Duration (s)", _num(s["duration_s"])),
        _row("Prompt tokens (reused)", f"{s['prompt_tokens']} ({s['prompt_tokens_reused_pct']:.1f} %)"),
        _row("Output tokens", str(s["output_tokens"])),
        _row("Request throughput (req/s)", _num(s["request_throughput"], ".3f")),
        _row("Output throughput, all lanes (tok/s)", _num(s["output_throughput"])),
        _row("Total token throughput (tok/s)", _num(s["total_token_throughput"])),
    ]
    side = report.get("server_side")
    if side is not None and side.get("ttft_mean_s") is not None:
        lines.append(
            _row(
                "Server-side mean TTFT / duration (ms)",
                f"{_ms(side['ttft_mean_s'])} / {_ms(side['request_duration_mean_s'])}",
            )
        )
    lines += [
        _title("Latency"),
        *_latencies(s, pkeys),
    ]
    spec = report.get("speculative")
    lines.append(_title("Speculative (from /metrics)"))
    if spec is None:
        lines.append("the server has no readable /metrics")
    elif spec["rounds"] == 0:
        lines.append("no speculative rounds in the run (speculation off, or no drafts)")
    else:
        lines += [
            _row("Speculative lane-rounds", str(spec["rounds"])),
            _row("Tokens per round", _num(spec["tokens_per_round"], ".3f")),
            _row("Draft acceptance rate", _num(spec["draft_acceptance_rate"], ".3f")),
            _row(
                "Acceptance by position",
                " ".join(_num(p["rate"], ".2f") for p in spec["per_position"]),
            ),
        ]
    ck = report.get("prompt_checkpoints")
    if ck is not None:
        tiers = ", ".join(f"{k} {v}" for k, v in ck["hits_by_tier"].items()) or "-"
        lines += [
            _title("Prompt checkpoints (from /metrics)"),
            _row("Lookups / hits (by tier)", f"{ck['lookups']} / {ck['hits']} ({tiers})"),
            _row("Prompt tokens reused", str(ck["reused_tokens"])),
            _row(
                "Evictions (by tier)",
                ", ".join(f"{k} {v}" for k, v in ck["evictions_by_tier"].items()) or "0",
            ),
        ]
    mt = report.get("multi_turn")
    if mt is not None:
        lines += [
            _title("Turns"),
            _row("Prompt tokens reused (cached_tokens)", f"{mt['prompt_tokens_reused_pct']:.1f} %"),
            _row(
                "TTFT first -> last turn (ms)",
                f"{_ms(mt['ttft_first_turn_mean_s'])} -> {_ms(mt['ttft_last_turn_mean_s'])}",
            ),
            _row("TTFT ms per 1k prompt tokens (fit)", _num(mt["ttft_ms_per_1k_prompt_tokens"])),
            _row("TTFT ms per 1k new (uncached) tokens (fit)", _num(mt["ttft_ms_per_1k_new_tokens"])),
            _row("Sessions ended", ", ".join(f"{k} {v}" for k, v in sorted(mt["sessions_ended"].items()))),
            f"{'turn':>4} {'reqs':>5} {'prompt tok':>11} {'reused':>9} {'new':>8} {'TTFT ms':>9} "
            f"{'TTFT p90':>9} {'lane tok/s':>10}",
        ]
        for t in mt["per_turn"]:
            lines.append(
                f"{t['turn']:>4} {t['requests']:>5} {_num(t['prompt_tokens']['mean'], '.0f'):>11} "
                f"{_num(t['cached_tokens']['mean'], '.0f'):>9} {_num(t['new_tokens']['mean'], '.0f'):>8} "
                f"{_ms(t['ttft']['mean']):>9} {_ms(t['ttft'].get('p90')):>9} "
                f"{_num(t['decode_tok_s']['mean'], '.1f'):>10}"
            )
    lines.append("=" * _W)
    return "\n".join(lines)


def format_sweep(reports: list[dict[str, Any]]) -> str:
    """One row per run of a `--concurrency` sweep: throughput, medians of the latencies, lane decode
    rate and tokens per round."""
    head = (
        f"{'concurrency':>11} {'done':>5} {'fail':>5} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} "
        f"{'TPOT p50':>9} {'E2E p50':>9} {'lane tok/s':>10} {'tok/round':>9}"
    )
    lines = [_title("ignis-bench: sweep (latencies in ms)"), head]
    for r in reports:
        s, spec = r["summary"], r.get("speculative") or {}
        lines.append(
            f"{r['config']['concurrency']:>11} {s['completed']:>5} {s['failed']:>5} "
            f"{_num(s['request_throughput'], '.3f'):>8} {_num(s['output_throughput']):>10} "
            f"{_ms(s['ttft'].get('p50')):>9} {_ms(s['tpot'].get('p50')):>9} {_ms(s['e2e'].get('p50')):>9} "
            f"{_num(s['decode_tok_s'].get('mean'), '.1f'):>10} {_num(spec.get('tokens_per_round'), '.3f'):>9}"
        )
    lines.append("=" * _W)
    return "\n".join(lines)
