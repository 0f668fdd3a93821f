"""Greedy output equality at the socket, with the margins where outputs part (issue 25).

    python -m ignis.tools.bench.socket_equality serve ARTIFACT [--backends off,ngram,draft-model]
        [--draft-model DRAFT_ARTIFACT] [--lanes 8] [--clients 1,8] [--prompts chat|ids] [--out DIR]
    python -m ignis.tools.bench.socket_equality collect --socket PATH --label BACKEND [--out DIR]
    python -m ignis.tools.bench.socket_equality report [--out DIR] [--threshold 0.25]

`serve` starts one `ignis-run` per backend (`serve_overhead.ServerProcess`; draft-model drafts with
``--draft-model``, default the artifact itself), `collect`s from it, and `report`s. `collect` sends
the prompts to a running server (e.g. from `fullsize_27b --after-bench`, whose $IGNIS_SOCK and
$IGNIS_BACKEND it reads by default): greedy, EOS ignored, ``--max-tokens`` each, with
``logprobs``/``top_logprobs`` (``--top-logprobs``, default 5) and ``return_token_ids``, in passes
(`collect`): at the first ``--clients`` value with every prompt new (a cold prefill), the same again
(a repeat: the server's prompt checkpoints serve what they hold), then at each other value (repeats:
that many requests in flight at once). One JSON line per request is appended to
``<out>/socket_equality.jsonl``: {label, clients, repeat, prompt, output_token_ids, logprobs, gaps,
prompt_tokens, cached_tokens}, where gaps[i] is the top-1 minus top-2 logprob at output position i
(nats; None where the reply cannot tell). Prompts: ``--prompts chat`` sends
`served_backends.PROMPTS` to /v1/chat/completions; ``ids`` sends ``--num-prompts`` token-id prompts
of ``--input-len`` ids (seeded, below ``--vocab-max``) to /v1/completions, as `ignis-bench` does.

`report` compares pairs of passes that differ in one thing: the reference's (``--reference``,
default off) repeat with its first pass (a reused prompt against a cold prefill), the reference at
each other client count with its repeat at the first (the rounds' row count), and every other label
with the reference at the same pass. For each output that differs: the first divergent position i,
the reference's gap there (and the other side's). Over the positions before any divergence (the same
tokens so far), the differences of the two sides' gaps (``gap_delta``: p50, p99, max): rounding moves
them by a few bf16 spacings of the logits; a wrong state (a reused prefix or a rolled-back round that
is not what a cold run computes) moves them by the spread of the model's logits, even where the tokens
agree. A pair is **equal up to near-ties** when every divergence sits at a reference gap below
``--threshold`` (default 0.25 nats); the share of prompt tokens the checkpoints served is given per
pair, and the reference's gap distribution over every position per pass, so how often near-ties
occur is in view. Writes ``<out>/socket_equality.json`` and prints a table.

The threshold. Logits leave the LM head in bf16 (the model dtype) before the float32 log-softmax, so a
top-2 gap is a multiple of the bf16 spacing of the logits there (both in one binade): 2^-4 in [8, 16),
2^-3 in [16, 32). A verify round of another row count runs other GEMM tilings, whose float32 sums differ
in their last bits; where a sum sits near a bf16 rounding boundary, the logit moves by one spacing, and
the hidden states' one-spacing moves in earlier layers add a few thousandths relative. So two logits at
most two spacings apart (0.25 nats for logits below 32) can swap between row counts; a divergence at a
wider gap is not explained by rounding and is a fault to chase.

The gap from a completions reply: `top_logprobs` is a {token text: logprob} map, so two top tokens
that decode to the same text share one key (the later, smaller value kept at the first one's place).
The chosen token is the greedy top-1, whose logprob `token_logprobs` gives: the gap is top-1 minus
the largest map value once one value equal to top-1 is taken out (none is when the top-2 token's
value overwrote it: a collision). Chat replies list each top token apart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "DEFAULT_THRESHOLD",
    "append_records",
    "collect",
    "compare",
    "gaps_of_reply",
    "main",
    "make_prompts",
    "read_records",
    "write_report",
]

#: Gap (nats) below which a divergence is a near-tie (module docstring: two bf16 spacings below 32).
DEFAULT_THRESHOLD = 0.25

RECORDS = "socket_equality.jsonl"
REPORT = "socket_equality.json"


def make_prompts(kind: str, num: int, input_len: int, vocab_max: int, seed: int) -> list[Any]:
    """`num` chat prompts (str, `served_backends.PROMPTS`) or token-id prompts of `input_len` ids drawn
    below `vocab_max` from a `random.Random(seed)`."""
    if kind == "chat":
        from ignis.tools.bench.served_backends import PROMPTS

        return list(PROMPTS[:num])
    rng = random.Random(seed)
    return [[rng.randrange(vocab_max) for _ in range(input_len)] for _ in range(num)]


def gaps_of_reply(choice: dict[str, Any]) -> tuple[list[float], list[float | None]]:
    """(chosen tokens' logprobs, top-1 minus top-2 gaps) of one reply's choice (module docstring).

    Raises:
        ValueError: the choice has no logprobs (the server ignored the request's).
    """
    lp = choice.get("logprobs")
    if not lp:
        raise ValueError("the reply carries no logprobs")
    if "content" in lp:  # chat
        chosen = [float(e["logprob"]) for e in lp["content"]]
        gaps: list[float | None] = []
        for e in lp["content"]:
            top = [float(t["logprob"]) for t in e.get("top_logprobs") or []]
            gaps.append(top[0] - top[1] if len(top) >= 2 else None)
        return chosen, gaps
    chosen = [float(v) for v in lp["token_logprobs"]]
    gaps = []
    for first, top_map in zip(chosen, lp.get("top_logprobs") or [None] * len(chosen), strict=True):
        values = sorted((float(v) for v in (top_map or {}).values()), reverse=True)
        same = next((i for i, v in enumerate(values) if abs(v - first) <= 1e-6), None)
        if same is not None:  # the chosen token's own entry; the next one is top-2 (an exact tie: 0)
            del values[same]
        gaps.append(first - values[0] if values else None)
    return chosen, gaps


def _request(client: httpx.Client, prompt: Any, max_tokens: int, top: int) -> dict[str, Any]:
    common = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    if isinstance(prompt, str):
        body = {"messages": [{"role": "user", "content": prompt}], "logprobs": True, "top_logprobs": top}
        path = "/v1/chat/completions"
    else:
        body, path = {"prompt": list(prompt), "logprobs": top}, "/v1/completions"
    r = client.post(path, json={**body, **common})
    if r.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:300]}")
    reply = r.json()
    choice = reply["choices"][0]
    chosen, gaps = gaps_of_reply(choice)
    ids = choice.get("token_ids")
    if ids is None or len(ids) != len(chosen):
        raise RuntimeError(f"{path}: the reply's token_ids ({ids!r:.80}) do not match its logprobs")
    usage = reply.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "prompt": prompt,
        "output_token_ids": list(ids),
        "logprobs": chosen,
        "gaps": gaps,
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "cached_tokens": int(cached),
    }


def _unrelated(prompts: Sequence[Any]) -> Any:
    """A prompt of the same kind that starts unlike every one of `prompts` (so that the prompt
    checkpoints it leaves serve none of them): a chat text, or ids whose first differs from theirs."""
    if isinstance(prompts[0], str):
        return "Say hello."
    firsts = {int(p[0]) for p in prompts if len(p)}
    first = next(t for t in range(len(firsts) + 1) if t not in firsts)
    return [first, *prompts[0][1:]]


def collect(
    socket: str,
    label: str,
    prompts: Sequence[Any],
    *,
    clients: Sequence[int],
    max_tokens: int,
    top_logprobs: int = 5,
    timeout: float = 900.0,
) -> list[dict[str, Any]]:
    """The prompts' greedy outputs from the server at `socket` (records as in the module docstring,
    in prompt order per pass), in passes: the first at ``clients[0]`` (every prompt new to the
    server: a cold prefill), the same again at ``clients[0]`` (``repeat``: the server has seen each
    prompt, so its prompt checkpoints serve what they hold, `cached_tokens`), then at each other
    count (repeats too). So a pass differs from the one it is compared with in one thing only: the
    prompt's reuse, or the rounds' row count.

    Raises:
        RuntimeError: a request failed or its reply lacks token ids or logprobs.
    """
    if top_logprobs < 2:
        raise ValueError("top_logprobs must be >= 2 (the gap needs the second token)")

    def client() -> httpx.Client:
        return httpx.Client(
            transport=httpx.HTTPTransport(uds=socket), base_url="http://ignis", timeout=timeout
        )

    with client() as c:  # one untimed request first, sharing no prefix with the prompts
        _request(c, _unrelated(prompts), min(max_tokens, 4), top_logprobs)
    out: list[dict[str, Any]] = []
    passes = [(clients[0], False), (clients[0], True), *((n, True) for n in clients[1:])]
    for n, repeat in passes:
        local = [client() for _ in range(n)]
        try:
            with ThreadPoolExecutor(max_workers=n) as pool:
                futures = [
                    pool.submit(_request, local[i % n], p, max_tokens, top_logprobs)
                    for i, p in enumerate(prompts)
                ]
                out += [{"label": label, "clients": n, "repeat": repeat, **f.result()} for f in futures]
        finally:
            for c in local:
                c.close()
    return out


def _quantiles(values: Sequence[float], *, top: bool = False) -> dict[str, float | None]:
    """min, p1, p5, p50 of `values` (None each when empty); with `top`: p50, p99, max."""
    keys = ("p50", "p99", "max") if top else ("min", "p1", "p5", "p50")
    if not values:
        return dict.fromkeys(keys)
    v = sorted(values)

    def q(x: float) -> float:
        return v[min(len(v) - 1, int(x * len(v)))]

    if top:
        return {"p50": statistics.median(v), "p99": q(0.99), "max": v[-1]}
    return {"min": v[0], "p1": q(0.01), "p5": q(0.05), "p50": statistics.median(v)}


def _key(prompt: Any) -> str:
    return json.dumps(prompt)


def _pair(
    name: str, got: Sequence[dict[str, Any]], ref: Sequence[dict[str, Any]], threshold: float
) -> dict[str, Any]:
    """One comparison row: `got`'s outputs against `ref`'s for the same prompts."""
    by_prompt = {_key(r["prompt"]): r for r in ref}
    divergences = []
    equal = 0
    gap_deltas: list[float] = []
    for g in got:
        r = by_prompt.get(_key(g["prompt"]))
        if r is None:
            continue
        a, b = r["output_token_ids"], g["output_token_ids"]
        i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        gap_deltas += [  # the same tokens so far: how far the two distributions' top-2 gaps differ
            abs(x - y)
            for x, y in zip(r["gaps"][:i], g["gaps"][:i], strict=False)
            if x is not None and y is not None
        ]
        if a == b:
            equal += 1
            continue
        ref_gap = r["gaps"][i] if i < len(r["gaps"]) else None
        got_gap = g["gaps"][i] if i < len(g["gaps"]) else None
        divergences.append(
            {
                "prompt": g["prompt"] if isinstance(g["prompt"], str) else f"{len(g['prompt'])} ids",
                "position": i,
                "reference_token": a[i] if i < len(a) else None,
                "token": b[i] if i < len(b) else None,
                "reference_gap": ref_gap,
                "gap": got_gap,
                "near_tie": ref_gap is not None and ref_gap < threshold,
            }
        )
    compared = equal + len(divergences)
    worst = max((d["reference_gap"] for d in divergences if d["reference_gap"] is not None), default=None)
    return {
        "pair": name,
        "compared": compared,
        "equal": equal,
        "divergent": len(divergences),
        "equal_up_to_near_ties": compared > 0 and all(d["near_tie"] for d in divergences),
        "widest_divergent_gap": worst,
        "gap_delta": {"positions": len(gap_deltas), **_quantiles(gap_deltas, top=True)},
        "divergences": divergences,
        "_got": got,
    }


def compare(
    records: Sequence[dict[str, Any]], *, reference: str = "off", threshold: float = DEFAULT_THRESHOLD
) -> dict[str, Any]:
    """The report of `records` (module docstring): one row per compared pair, and the reference's gap
    distribution per client count.

    Raises:
        ValueError: no records of `reference`.
    """
    runs: dict[tuple[str, int, bool], list[dict[str, Any]]] = {}
    for r in records:
        runs.setdefault((r["label"], int(r["clients"]), bool(r.get("repeat", False))), []).append(r)
    ref_keys = sorted(k for k in runs if k[0] == reference)
    if not ref_keys:
        raise ValueError(
            f"no records of the reference {reference!r} (labels: {sorted({k[0] for k in runs})})"
        )
    base = min(k[1] for k in ref_keys)
    rows = []
    for _, n, repeat in ref_keys:
        if n == base and repeat and (reference, base, False) in runs:  # the prompt's reuse alone
            name = f"{reference} repeat vs first at {n} clients"
            rows.append(_pair(name, runs[(reference, n, True)], runs[(reference, n, False)], threshold))
        elif n != base and (reference, base, repeat) in runs:  # the rounds' row count alone
            name = f"{reference} {n} vs {base} clients{' (repeats)' if repeat else ''}"
            rows.append(_pair(name, runs[(reference, n, repeat)], runs[(reference, base, repeat)], threshold))
    for (label, n, repeat), got in sorted(runs.items()):
        if label != reference and (reference, n, repeat) in runs:
            name = f"{label} vs {reference} at {n} clients{' (repeats)' if repeat else ''}"
            rows.append(_pair(name, got, runs[(reference, n, repeat)], threshold))
    for row in rows:  # how much of the prompts the checkpoints served, on the pair's `got` side
        got = row.pop("_got")
        prompt = sum(int(r.get("prompt_tokens", 0)) for r in got)
        row["cached_share"] = sum(int(r.get("cached_tokens", 0)) for r in got) / prompt if prompt else None
    gaps = {}
    for _, n, repeat in ref_keys:
        values = [g for r in runs[(reference, n, repeat)] for g in r["gaps"] if g is not None]
        below = sum(1 for g in values if g < threshold)
        gaps[f"{n}{' repeat' if repeat else ''}"] = {
            **_quantiles(values),
            "positions": len(values),
            "below_threshold": below,
            "exact_ties": sum(1 for g in values if g == 0.0),
        }
    return {"reference": reference, "threshold": threshold, "rows": rows, "reference_gaps": gaps}


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def print_report(rep: dict[str, Any]) -> None:
    print(
        f"\ngreedy outputs at the socket against {rep['reference']} (near-tie: gap < {rep['threshold']} nats)"
    )
    print(
        f"{'pair':<44} {'equal':>7} {'divergent':>9} {'widest gap':>10} {'max |dgap|':>10} "
        f"{'cached':>6}  verdict"
    )
    for r in rep["rows"]:
        verdict = (
            "equal"
            if r["divergent"] == 0
            else ("equal up to near-ties" if r["equal_up_to_near_ties"] else "DIVERGES ABOVE THE THRESHOLD")
        )
        ratio = f"{r['equal']}/{r['compared']}"
        cells = (
            f"{ratio:>7} {r['divergent']:>9} {_fmt(r['widest_divergent_gap']):>10} "
            f"{_fmt(r['gap_delta']['max']):>10} "
            f"{'-' if r['cached_share'] is None else format(r['cached_share'], '.0%'):>6}"
        )
        print(f"{r['pair']:<44} {cells}  {verdict}")
        for d in r["divergences"]:
            print(
                f"    at token {d['position']:>4}: {rep['reference']} {d['reference_token']} (gap "
                f"{_fmt(d['reference_gap'])}), this one {d['token']} (gap {_fmt(d['gap'])})"
                f"  [{str(d['prompt'])[:40]}]"
            )
    print(f"{rep['reference']}'s top-1 minus top-2 logprob over every output position:")
    for n, g in rep["reference_gaps"].items():
        print(
            f"  {n}: {g['positions']} positions, min {_fmt(g['min'])} p1 {_fmt(g['p1'])} "
            f"p5 {_fmt(g['p5'])} p50 {_fmt(g['p50'])}; {g['below_threshold']} below the threshold, "
            f"{g['exact_ties']} exact ties"
        )


def read_records(out: Path) -> list[dict[str, Any]]:
    """The records collected under `out` (SystemExit when there are none)."""
    path = out / RECORDS
    if not path.exists():
        raise SystemExit(f"no records at {path}: run collect or serve first")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_records(out: Path, records: Sequence[dict[str, Any]]) -> None:
    """Append `records` to `out`'s records file (JSON lines)."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / RECORDS).open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def write_report(out: Path, reference: str, threshold: float) -> dict[str, Any]:
    """`compare` the records under `out`, write the JSON report there and print the table.

    Raises:
        SystemExit: no records, or none of `reference`.
    """
    try:
        rep = compare(read_records(out), reference=reference, threshold=threshold)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    (out / REPORT).write_text(json.dumps(rep, indent=1) + "\n")
    print_report(rep)
    print(f"(written to {out / REPORT})")
    return rep


def _collect_or_exit(
    socket: str, label: str, prompts: list[Any], load: dict[str, Any]
) -> list[dict[str, Any]]:
    try:
        return collect(socket, label, prompts, **load)
    except (RuntimeError, ValueError, httpx.HTTPError) as exc:
        raise SystemExit(f"{label}: {type(exc).__name__}: {exc}") from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ignis.tools.bench.socket_equality",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "."))
    common.add_argument("--reference", default="off", help="the label the others are compared with")
    common.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="near-tie gap, nats")
    load = argparse.ArgumentParser(add_help=False)
    load.add_argument("--clients", default="1,8", help="requests in flight at once, comma-separated")
    load.add_argument("--prompts", choices=["chat", "ids"], default="chat")
    load.add_argument("--num-prompts", type=int, default=8, help="--prompts chat: at most 8")
    load.add_argument("--input-len", type=int, default=32, help="--prompts ids: ids per prompt")
    load.add_argument("--vocab-max", type=int, default=1000, help="--prompts ids: ids drawn below this")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--max-tokens", type=int, default=128)
    load.add_argument("--top-logprobs", type=int, default=5)
    s = sub.add_parser("serve", parents=[common, load], help="start ignis-run per backend, collect, report")
    s.add_argument("artifact")
    s.add_argument("--backends", default="off,ngram,draft-model")
    s.add_argument("--draft-model", help="draft-model's artifact [default: the artifact itself]")
    s.add_argument("--lanes", type=int, default=8)
    s.add_argument("--ready-timeout", type=float, default=420.0)
    s.add_argument("--server-arg", action="append", default=[], help="an extra ignis-run argument")
    c = sub.add_parser("collect", parents=[common, load], help="collect from a running server")
    c.add_argument("--socket", default=os.environ.get("IGNIS_SOCK"), help="default $IGNIS_SOCK")
    c.add_argument("--label", default=os.environ.get("IGNIS_BACKEND"), help="default $IGNIS_BACKEND")
    sub.add_parser("report", parents=[common], help="compare what was collected under --out")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.command == "report":
        write_report(a.out, a.reference, a.threshold)
        return 0
    try:
        clients = [int(x) for x in a.clients.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--clients: expected comma-separated integers, got {a.clients!r}") from None
    if not clients or min(clients) < 1 or a.num_prompts < 1 or a.max_tokens < 1 or a.top_logprobs < 2:
        raise SystemExit(
            "need --clients >= 1 each, --num-prompts >= 1, --max-tokens >= 1, --top-logprobs >= 2"
        )
    prompts = make_prompts(a.prompts, a.num_prompts, a.input_len, a.vocab_max, a.seed)
    load = {"clients": clients, "max_tokens": a.max_tokens, "top_logprobs": a.top_logprobs}
    if a.command == "collect":
        if not a.socket or not a.label:
            raise SystemExit("collect needs --socket and --label (or $IGNIS_SOCK and $IGNIS_BACKEND)")
        append_records(a.out, _collect_or_exit(a.socket, a.label, prompts, load))
        print(f"collected {a.label} at {clients} client(s) into {a.out / RECORDS}")
        return 0
    from ignis.tools.bench.serve_overhead import BenchError, ServerProcess

    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / RECORDS).unlink(missing_ok=True)
    for backend in [b for b in a.backends.split(",") if b]:
        spec = ["--spec-backend", backend]
        if backend == "draft-model":
            spec += ["--spec-draft-model", a.draft_model or a.artifact]
        args = ["--artifact", a.artifact, "--lanes", str(a.lanes), *spec, *a.server_arg]
        try:
            server = ServerProcess(
                args, dict(os.environ), a.ready_timeout, log=a.out / f"server-{backend}.log"
            )
        except BenchError as exc:
            raise SystemExit(f"{backend}: {exc}") from None
        with server:
            append_records(a.out, _collect_or_exit(server.socket, backend, prompts, load))
        print(f"{backend}: collected (server ready after {server.ready_s:.1f} s)", flush=True)
    write_report(a.out, a.reference, a.threshold)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
