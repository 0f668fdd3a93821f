"""Benchmark of the grouped MoE expert kernels and of the MoE block on one layer (GPU host).

    python -m ignis.tools.bench.moe_experts --modules DIR [--rows 1,3,8,33,64] [--out DIR]

``--modules``: a folder holding ``moe_experts_sm<NN>.so`` (``build_moe_experts`` output, e.g. from
``python -m ignis.tools.bench.build_gpu_modules``) or the ``.so`` itself. At the Qwen3.5-122B-A10B
shape (hidden 3,072; 256 experts, 8 a token, intermediate 1,024; random q4_g32 weights, bf16
activations, random distinct experts per row) it prints per row count R:

* ``gate_up_us`` / ``down_us``: device time of one ``moe_q4_gate_up`` / ``moe_q4_down`` launch (median
  of ``--reps`` timings of ``--inner`` launches replayed from one CUDA graph), the bytes of the
  distinct experts' weights those launches must read, and the GB/s that makes;
* ``block_us``: the grouped MoE block (router, top-k, both kernels, the sum, the shared expert)
  replayed from a CUDA graph, and ``block_eager_us``: the same block run eagerly (host included);
* ``loop_us``: the reference loop of `sparse_moe_block` over the same row-major experts, eagerly:
  host syncs and, per routed expert, two torch linears (dequantize + GEMM: slower per linear than the
  compiled tiled ones the served loop uses, the same launches and syncs) -- ``--no-loop`` skips it.

Writes ``bench_moe_experts.json`` into ``--out`` (default $OUT or .).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

HIDDEN, INTER, EXPERTS, TOP_K = 3072, 1024, 256, 8
COLUMNS = ("rows", "distinct_experts", "gate_up_us", "gate_up_GBps", "down_us", "down_GBps", "block_us",
           "block_eager_us", "loop_us")  # fmt: skip


def _module_path(path: Path) -> Path:
    from ignis.tools.bench.build_gpu_modules import bundle_library

    if path.is_file():
        return path
    cand = bundle_library(path, "moe_experts")
    if not cand.exists():
        raise SystemExit(f"no {cand.name} under {path}")
    return cand


def _stack(n: int, k: int, gen: Any) -> Any:
    import torch

    from ignis.runtime.linear import Q4Weight

    shape = (EXPERTS, n, k // 8)
    packed = torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, device="cuda", dtype=torch.int32)
    signs = torch.randint(0, 2, (EXPERTS, n, k // 32), generator=gen, device="cuda") * 2 - 1
    scales = torch.rand(EXPERTS, n, k // 32, generator=gen, device="cuda") * signs * (2 / (7 * math.sqrt(k)))
    scales = scales.half()
    return Q4Weight(packed.view(torch.uint32), scales)


def _graph_us(fn: Any, *, inner: int, reps: int) -> float:
    """Median device microseconds of one `fn()` call, `inner` calls captured in one graph."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / inner)
    return statistics.median(times)


def _eager_us(fn: Any, *, inner: int, reps: int) -> float:
    """Median wall microseconds of one eager `fn()` call (host and device), synchronized."""
    import time

    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / inner)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", type=Path, required=True)
    ap.add_argument("--rows", default="1,3,8,33,64")
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-loop", action="store_true", help="skip the reference loop (slow)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args(argv)

    import torch

    from ignis.runtime.families.moe import SparseMoeWeights, SwiGLUWeights, sparse_moe_block
    from ignis.runtime.families.moe_grouped import GroupedExperts
    from ignis.runtime.kernels.moe_experts import MoeExpertsKernel
    from ignis.runtime.linear import torch_linear

    kernel = MoeExpertsKernel(_module_path(args.modules))
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up, down = _stack(2 * INTER, HIDDEN, gen), _stack(HIDDEN, INTER, gen)
    dense = (torch.randn(INTER, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5).bfloat16()
    shared = SwiGLUWeights(dense, dense.clone(), (dense.T.contiguous() * 0.5))
    router = (torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5).bfloat16()
    experts = [SwiGLUWeights(gate_up[e, :INTER], gate_up[e, INTER:], down[e]) for e in range(EXPERTS)]
    block = SparseMoeWeights(
        router, experts, shared, router[:1].clone(), GroupedExperts(gate_up, down, kernel)
    )
    loop = dataclasses.replace(block, grouped=None)
    expert_bytes = {
        "gate_up": 2 * INTER * (HIDDEN // 2 + HIDDEN // 16),
        "down": HIDDEN * (INTER // 2 + INTER // 16),
    }
    rows_list = [int(r) for r in args.rows.split(",") if r]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "rows": []}
    print(" | ".join(COLUMNS))
    for rows in rows_list:
        g = torch.Generator().manual_seed(rows)
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(rows)]).int().cuda()
        distinct = int(torch.unique(ids).numel())
        x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
        h = kernel.gate_up(x, ids, gate_up)
        route_w = torch.rand(rows, TOP_K, device="cuda")
        y = torch.empty(rows, TOP_K, HIDDEN, device="cuda")

        def run_gate_up(x: Any = x, ids: Any = ids) -> Any:
            return kernel.gate_up(x, ids, gate_up)

        def run_down(h: Any = h, ids: Any = ids, route_w: Any = route_w, y: Any = y) -> Any:
            return kernel.down(h, ids, down, route_w, y)

        def run_block(x: Any = x, w: Any = block) -> Any:
            return sparse_moe_block(x, w, top_k=TOP_K, norm_topk_prob=True, linear=torch_linear)

        gu_us = _graph_us(run_gate_up, inner=args.inner, reps=args.reps)
        dn_us = _graph_us(run_down, inner=args.inner, reps=args.reps)

        row: dict[str, Any] = {
            "rows": rows,
            "distinct_experts": distinct,
            "gate_up_us": round(gu_us, 2),
            "gate_up_GBps": round(distinct * expert_bytes["gate_up"] / gu_us / 1e3, 1),
            "down_us": round(dn_us, 2),
            "down_GBps": round(distinct * expert_bytes["down"] / dn_us / 1e3, 1),
            "block_us": round(_graph_us(run_block, inner=args.inner, reps=args.reps), 2),
            "block_eager_us": round(_eager_us(run_block, inner=args.inner, reps=args.reps), 2),
        }
        if not args.no_loop:
            loop_us = _eager_us(lambda: run_block(w=loop), inner=max(1, args.inner // 10), reps=3)
            row["loop_us"] = round(loop_us, 1)
        results["rows"].append(row)
        print(" | ".join(str(row.get(k, "")) for k in COLUMNS), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_moe_experts.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
