"""The expert cache's host path alone, section by section, at the issue's routing shape (issue 22).

    python -m ignis.tools.bench.expert_host_path [--layers 48] [--experts 256] [--top-k 8]
        [--slots 92] [--rows 1,8] [--rounds 30] [--locality 0.6] [--out DIR]

What a cached verify round does on the host once per MoE layer, without the model around it: the
routed ids to the host, `np.unique`, the LRU lookups of `ExpertSlots`, the misses' address arrays
and one batched copy (``memmove`` over small host "slots": `ExpertCache(copies="memmove")`, the plan
the CUDA driver gets on the GPU), the slot-id table, the grouped expert kernels' launches (no-op
stand-ins: the Python and binding cost of a launch, not the kernel) and the last-use marks. Each
section is timed by `ignis.runtime.host_breakdown.HostBreakdown`. The copies move small parts (the
real part count a miss, 4 for a fused q4 expert, not its bytes), so the figures are the host
path's own cost; on the GPU host the same sections come from `expert_cache --breakdown`, with the
CUDA calls' own costs added.

Routing: each layer's `rows` rows pick `top_k` distinct experts; with probability `locality` a pick
repeats one of the layer's previous round's experts (a stand-in for a trained router's temporal
locality, tuned to land near the measured hit rate), else a uniform expert.

Prints the breakdown (ms a round, us a MoE layer per section) and the hit rate per row count, and
writes ``bench_expert_host_path.json`` into `--out` (default $OUT or .).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ignis.runtime.expert_cache import ExpertCache
from ignis.runtime.families.moe import SwiGLUWeights
from ignis.runtime.families.moe_grouped import GroupedExperts, run_cached_experts
from ignis.runtime.host_breakdown import HostBreakdown
from ignis.runtime.kernels.moe_experts import MoeExpertsKernel
from ignis.runtime.linear import Q4Weight

__all__ = ["host_path", "main"]


def _experts(n: int, hidden: int, inter: int) -> list[SwiGLUWeights]:
    """n q4 experts as an artifact hands them over: views of fused stacks (gate|up [n, 2I, H], down
    [n, H, I]), zero bytes (only their layout matters here)."""
    gu = Q4Weight(
        torch.zeros(n, 2 * inter, hidden // 8, dtype=torch.int32),
        torch.zeros(n, 2 * inter, hidden // 32, dtype=torch.float16),
    )
    dn = Q4Weight(
        torch.zeros(n, hidden, inter // 8, dtype=torch.int32),
        torch.zeros(n, hidden, inter // 32, dtype=torch.float16),
    )
    return [SwiGLUWeights(gu[e, :inter], gu[e, inter:], dn[e]) for e in range(n)]


def _noop(*_args: Any) -> None:
    return None


def host_path(
    *,
    layers: int = 48,
    experts: int = 256,
    top_k: int = 8,
    slots: int = 92,
    rows: int = 1,
    rounds: int = 30,
    locality: float = 0.45,
    seed: int = 0,
    hidden: int = 64,
    inter: int = 32,
) -> dict[str, Any]:
    """Run `rounds` rounds of `layers` MoE layers' host parts (module docstring); returns the
    breakdown (`HostBreakdown.report`, the first 3 rounds left out as warm-up) with "hit_rate",
    "misses_per_layer", "host_us_per_layer" (the round's wall time a layer) and "cpu_us_per_layer"
    (the thread's CPU time a layer: on a loaded machine the wall sections include waits for a core)."""
    cache = ExpertCache(slots, device="cpu", copies="memmove")
    kernel = MoeExpertsKernel({"moe_q4_gate_up": _noop, "moe_q4_down": _noop})
    blocks = []
    for _ in range(layers):
        layer = cache.make_layer(_experts(experts, hidden, inter), linear=lambda *a: None, stacked=True)
        blocks.append(GroupedExperts(*layer.stacks(), kernel=kernel, slots=layer))
    timer = HostBreakdown()
    cache.set_breakdown(timer)
    rng = np.random.default_rng(seed)
    x = torch.zeros(rows, hidden)
    route_w = torch.zeros(rows, top_k)
    y = torch.zeros(rows, top_k, hidden)
    previous: list[np.ndarray] = [rng.choice(experts, top_k, replace=False) for _ in range(layers)]
    hits0 = misses0 = 0
    cpu = 0.0
    for r in range(rounds):
        if r == 3:
            timer.reset()
            hits0, misses0 = cache.stats.hits, cache.stats.misses
            cpu = 0.0
        ids = []
        for i in range(layers):
            picks = np.empty((rows, top_k), dtype=np.int64)
            for row in range(rows):
                chosen: list[int] = []
                while len(chosen) < top_k:
                    e = (
                        int(rng.choice(previous[i]))
                        if rng.random() < locality
                        else int(rng.integers(experts))
                    )
                    if e not in chosen:
                        chosen.append(e)
                picks[row] = chosen
            previous[i] = np.unique(picks)
            ids.append(torch.from_numpy(picks))
        timer.begin_round()
        c0 = time.thread_time()
        for g, layer_ids in zip(blocks, ids, strict=True):
            host = g.slots.routing.to_host(layer_ids)  # (marks the layer)
            run_cached_experts(x, host, route_w, g, y)
        timer.end_round()
        cpu += time.thread_time() - c0
    out = timer.report()
    hits, misses = cache.stats.hits - hits0, cache.stats.misses - misses0
    out["hit_rate"] = round(hits / max(hits + misses, 1), 4)
    out["misses_per_layer"] = round(misses / max(timer.layers, 1), 2)
    out["host_us_per_layer"] = round(out["round_ms"] * 1e3 / layers, 1)
    # the thread's CPU time a layer: the wall figures less the time this thread waited for a core
    out["cpu_us_per_layer"] = round(cpu / max(timer.layers, 1) * 1e6, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--slots", type=int, default=92)
    ap.add_argument("--rows", default="1,8", help="rows a round (lanes x columns), comma-separated")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--locality", type=float, default=0.45)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"args": vars(args) | {"out": str(args.out)}, "cases": []}
    for rows in (int(r) for r in args.rows.split(",") if r):
        t0 = time.perf_counter()
        rep = host_path(
            layers=args.layers, experts=args.experts, top_k=args.top_k, slots=args.slots, rows=rows,
            rounds=args.rounds, locality=args.locality,
        )  # fmt: skip
        rep["rows"] = rows
        results["cases"].append(rep)
        print(
            f"rows {rows}: hit rate {rep['hit_rate']}, {rep['misses_per_layer']} misses a layer, "
            f"{rep['host_us_per_layer']} us a layer (CPU {rep['cpu_us_per_layer']} us; "
            f"{time.perf_counter() - t0:.1f} s)",
            flush=True,
        )
        print(HostBreakdown.format(rep), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_expert_host_path.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
