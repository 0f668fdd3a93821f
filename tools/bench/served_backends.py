"""Speculation backends of one artifact served at the socket: tok/s and whether greedy outputs equal
speculation off's (issue 25, item 5).

    python -m ignis.tools.bench.served_backends ARTIFACT [--backends off,ngram,draft-model]
        [--draft-model DRAFT_ARTIFACT] [--max-tokens 128] [--lanes 8] [--out DIR]

For each backend, one `ignis-run` (``--lanes``; draft-model with ``--spec-draft-model``, default the
artifact itself: the mechanism and its cost, not a useful pair) on a fresh Unix socket, then 8 fixed
chat prompts (code, prose, lists) sent greedy with ``--max-tokens`` each: one client (one prompt after
another, after one untimed request) and 8 clients at once. Reports tok/s (completion tokens over the
wall time) for both, how many texts equal speculation off's (1 and 8 clients) and the backend's own
1 vs 8 clients, the server's start time, and the speculative counters of `/metrics` (drafted and
accepted per position). Prints a table last; writes ``served_backends.json`` (rows and texts) into
``--out`` (default $OUT or .). Where texts differ, `python -m ignis.tools.bench.socket_equality serve
ARTIFACT` tells whether at near-ties: the same prompts with top logprobs, off's gap at each divergence.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from ignis.tools.bench.serve_overhead import ServerProcess

PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Explain in three sentences what a hash table is.",
    "List five countries in Europe and their capitals.",
    "Write a short poem about the sea.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "Give me a recipe for pancakes.",
    "Write a SQL query that counts the rows of a table named users grouped by country.",
)


def _client(server: ServerProcess) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=server.socket), timeout=600)


def _ask(client: httpx.Client, model: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    """One greedy chat request: (text, completion tokens)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    r = client.post("http://ignis/v1/chat/completions", json=body)
    r.raise_for_status()
    j = r.json()
    return j["choices"][0]["message"]["content"], int(j["usage"]["completion_tokens"])


def _speculative_counters(server: ServerProcess) -> dict[str, float]:
    out = {}
    for line in _client(server).get("http://ignis/metrics").text.splitlines():
        parts = line.split()
        if line.startswith("ignis_speculative_") and len(parts) == 2 and "total" in parts[0]:
            out[parts[0]] = float(parts[1])
    return out


def run_backend(server: ServerProcess, max_tokens: int) -> dict[str, Any]:
    """The 8 prompts from one client, then from 8 at once: texts, tok/s."""
    client = _client(server)
    model = client.get("http://ignis/v1/models").json()["data"][0]["id"]
    _ask(client, model, "Hello", max_tokens)  # not timed
    t0 = time.perf_counter()
    one = [_ask(client, model, p, max_tokens) for p in PROMPTS]
    t1 = time.perf_counter() - t0
    many: list[tuple[str, int]] = [("", 0)] * len(PROMPTS)

    def worker(i: int) -> None:
        many[i] = _ask(_client(server), model, PROMPTS[i], max_tokens)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t8 = time.perf_counter() - t0
    return {
        "texts_1": [t for t, _ in one],
        "texts_8": [t for t, _ in many],
        "tok_s_1": round(sum(n for _, n in one) / t1, 1),
        "tok_s_8": round(sum(n for _, n in many) / t8, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--backends", default="off,ngram,draft-model")
    ap.add_argument("--draft-model", help="draft-model's artifact [default: the artifact itself]")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lanes", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    texts: dict[str, tuple[list[str], list[str]]] = {}
    for backend in [b for b in a.backends.split(",") if b]:
        spec = ["--spec-backend", backend]
        if backend == "draft-model":
            spec += ["--spec-draft-model", a.draft_model or a.artifact]
        args = ["--artifact", a.artifact, "--lanes", str(a.lanes), *spec]
        with ServerProcess(args, dict(os.environ), 300.0, log=a.out / f"server-{backend}.log") as server:
            res = run_backend(server, a.max_tokens)
            counters = _speculative_counters(server)
        texts[backend] = (res["texts_1"], res["texts_8"])
        row: dict[str, Any] = {"backend": backend, "ready_s": round(server.ready_s, 1)}
        row |= {"tok_s_1": res["tok_s_1"], "tok_s_8": res["tok_s_8"]}
        if "off" in texts and backend != "off":
            row["equal_off_1"] = sum(x == y for x, y in zip(res["texts_1"], texts["off"][0], strict=True))
            row["equal_off_8"] = sum(x == y for x, y in zip(res["texts_8"], texts["off"][1], strict=True))
        row["equal_1_vs_8"] = sum(x == y for x, y in zip(res["texts_1"], res["texts_8"], strict=True))
        row["counters"] = counters
        rows.append(row)
        print(json.dumps(row), flush=True)
    (a.out / "served_backends.json").write_text(json.dumps({"rows": rows, "texts": texts}, indent=1))
    print("backend | ready s | tok/s 1 client | tok/s 8 clients | =off (1) | =off (8) | own 1 vs 8")
    for r in rows:
        cells = (
            r["ready_s"],
            r["tok_s_1"],
            r["tok_s_8"],
            r.get("equal_off_1", "-"),
            r.get("equal_off_8", "-"),
        )
        print(r["backend"], "|", " | ".join(str(c) for c in cells), "|", r["equal_1_vs_8"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
