"""Long-prompt prefill and long-context decode of the full-size 27B-shaped `qwen3_5` on one GPU (issue 24).

    python -m ignis.tools.bench.prefill --mods DIR [--lens 2048,8192,32768] [--chunks 2048,8192]
        [--rounds 20] [--routes] [--profile] [--no-dequant] [--out DIR]

The model is `ignis.tools.bench.e2e_gpu`'s (the public Qwen3.5-27B text config, random q4_g32 weights
generated on the device, placed in the tiled layout of the bundle `--mods` from
`ignis.tools.bench.build_gpu_modules`), run by `StaticHybridExecutor` with every fused module of
the bundle, one lane, `max_columns` 8. For every prompt length n and prefill chunk c <= n:

* the prefill: ``forward(record=False, logits="last") + commit`` over chunks of c tokens (what the
  engine does with ``--max-prefill-tokens c``), wall time with a device sync after each chunk,
  tok/s, the first and last chunk's time and the peak of allocated device memory;
* with ``--rounds R``: the median of R one-column decode rounds (``record=True``) after the prompt,
  i.e. a decode round at n tokens of context.

The linears of a prefill chunk take the dequantize + GEMM route (`LinearBackend`, rows >=
`DEQUANT_MIN_ROWS`) when the bundle exports ``q4_g32_tiled_dequant``; ``--no-dequant`` also runs
every case without it (the verify-round kernel on 64-row chunks). ``--routes`` times one linear of
three shapes at 64-2,048 rows both ways (the crossover that sets `DEQUANT_MIN_ROWS`); ``--profile``
prints the kernels of the second 2,048-token chunk of the 8,192-token prompt by device time.

Prints a table last; writes ``bench_prefill.json`` into `--out` (default $OUT or .).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ignis.runtime.families import get_family
from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
from ignis.runtime.families.qwen3_5 import Qwen3_5TextConfig
from ignis.runtime.kernels.q4_tiled import tile_q4
from ignis.runtime.kernels.tvm_runtime import load_module
from ignis.runtime.linear import LinearBackend, Q4Weight, find_dequant, place_weight, row_splits_of
from ignis.tools.bench import e2e_gpu
from ignis.tools.bench.build_gpu_modules import bundle_library


def _sync() -> None:
    torch.cuda.synchronize()


def time_routes(backend: LinearBackend, dev: torch.device) -> list[dict[str, Any]]:
    """ms of one linear (median of 5 after 2 warm-ups) by route, per shape and rows."""
    compiled = backend.compiled
    assert compiled is not None
    out = []
    for n, k in [(17408, 5120), (5120, 17408), (248320, 5120)]:
        qw = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device=dev, dtype=torch.int64).to(torch.int32)
        sc = (torch.rand(n, k // 32, device=dev) / 100).half()
        tq, ts = tile_q4(qw, sc)
        w = Q4Weight(tq, ts, layout="tiled", rows=n)
        del qw
        for rows in (64, 128, 256, 512, 2048):
            x = torch.randn(rows, k, device=dev).to(torch.bfloat16)
            row: dict[str, Any] = {"n": n, "k": k, "rows": rows}
            saved = compiled.dequant
            for route in ("dequant", "chunks"):
                compiled.dequant = saved if route == "dequant" else None
                ts_ = []
                for i in range(7):
                    _sync()
                    t0 = time.perf_counter()
                    backend(x, w)
                    _sync()
                    if i >= 2:
                        ts_.append(time.perf_counter() - t0)
                row[f"{route}_ms"] = round(sorted(ts_)[2] * 1e3, 3)
            compiled.dequant = saved
            print(f"  linear [{n}, {k}] x {rows} rows: {row}", flush=True)
            out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--mods", type=Path, required=True, help="a build_gpu_modules bundle for the device's arch"
    )
    ap.add_argument("--lens", default="2048,8192,32768")
    ap.add_argument("--chunks", default="2048,8192")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--routes", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-dequant", action="store_true", help="also run every case without the dequant route")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench prefill needs a CUDA GPU")
    dev = torch.device("cuda")
    cfg = Qwen3_5TextConfig.from_hf(e2e_gpu.FULL)
    weights, _ = e2e_gpu.make_weights(cfg, dev, seed=1)
    compiled = e2e_gpu.load_compiled(args.mods)
    man = json.loads((args.mods / "manifest.json").read_text())
    compiled.dequant = find_dequant(load_module(args.mods / man["file"], cuda=True))
    backend = LinearBackend(compiled)
    family = get_family(cfg.model_type)
    weights = {
        n: w if family.is_fused_member(n) else place_weight(backend, w, row_splits=row_splits_of(n))
        for n, w in weights.items()
    }
    lens = [int(x) for x in args.lens.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]

    def lib(stem: str) -> Path:
        return bundle_library(args.mods, stem, dev)

    ex = StaticHybridExecutor(
        cfg, weights, device=dev, dtype=torch.bfloat16, linear=backend, max_lanes=1, max_columns=8,
        max_context=max(lens) + args.rounds + 8, gdn_module=lib("gdn_recurrent"),
        norms_module=lib("fused_norms"), mixers_module=lib("fused_mixers"),
    )  # fmt: skip
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name(),
        "dequant_export": compiled.dequant is not None,
        "weights_gb": round(torch.cuda.memory_allocated() / 1e9, 2),
        "cases": [],
    }
    print(f"weights + executor: {res['weights_gb']} GB; dequant export: {res['dequant_export']}", flush=True)
    if args.routes:
        res["routes"] = time_routes(backend, dev)
    gen = torch.Generator().manual_seed(0)

    def run(n: int, chunk: int, profile: bool) -> dict[str, Any]:
        st = ex.new_lane()
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
        _sync()
        torch.cuda.reset_peak_memory_stats()
        per = []
        t0 = time.perf_counter()
        for s in range(0, n, chunk):
            part = ids[s : s + chunk]
            t1 = time.perf_counter()
            if profile and s == chunk:
                acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                with torch.profiler.profile(activities=acts) as prof:
                    ex.forward([st], [part], record=False, logits="last")
                    ex.commit([st], [len(part)])
                    _sync()
                rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]
                rows.sort(key=lambda e: -e.self_device_time_total)
                total = sum(e.self_device_time_total for e in rows) / 1e3
                print(f"  profile of chunk 2 of {n} (under the profiler): {total:.1f} ms of kernels")
                for e in rows[:22]:
                    print(f"  {e.self_device_time_total / 1e3:9.2f} ms {e.count:6d}x  {e.key[:100]}")
            else:
                ex.forward([st], [part], record=False, logits="last")
                ex.commit([st], [len(part)])
            _sync()
            per.append(time.perf_counter() - t1)
        wall = time.perf_counter() - t0
        row: dict[str, Any] = {
            "n": n, "chunk": chunk, "s": round(wall, 3), "tok_s": round(n / wall),
            "first_chunk_s": round(per[0], 3), "last_chunk_s": round(per[-1], 3),
            "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2), "profiled": profile,
        }  # fmt: skip
        if args.rounds:
            tok = torch.tensor([1])
            times = []
            for i in range(args.rounds + 3):
                _sync()
                t1 = time.perf_counter()
                ex.forward([st], [tok], record=True, logits="all")
                ex.commit([st], [1])
                _sync()
                if i >= 3:
                    times.append(time.perf_counter() - t1)
            row["round_ms"] = round(sorted(times)[len(times) // 2] * 1e3, 3)
        ex.release_lane(st)
        return row

    run(256, 256, False)  # warm-up: loads the modules, captures the small rounds
    saved = compiled.dequant
    for route in ("dequant", "chunks") if args.no_dequant else ("dequant",):
        compiled.dequant = saved if route == "dequant" else None
        for n in lens:
            for chunk in chunks:
                if chunk > n and chunk != chunks[0]:
                    continue
                prof = args.profile and route == "dequant" and n == 8192 and chunk == 2048
                row = {"route": route, **run(n, min(chunk, n), prof)}
                print(row, flush=True)
                res["cases"].append(row)
                gc.collect()
                torch.cuda.empty_cache()
                if prof:  # the profiled case's wall time is not a figure: run it again
                    row = {"route": route, **run(n, chunk, False)}
                    print(row, flush=True)
                    res["cases"].append(row)
    compiled.dequant = saved
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_prefill.json").write_text(json.dumps(res, indent=1))
    print("\n| route | prompt | chunk | s | tok/s | first / last chunk s | peak GB | round ms after |")
    print("|---|---|---|---|---|---|---|---|")
    for r in res["cases"]:
        if r["profiled"]:
            continue
        print(
            f"| {r['route']} | {r['n']} | {r['chunk']} | {r['s']} | {r['tok_s']} | "
            f"{r['first_chunk_s']} / {r['last_chunk_s']} | {r['peak_gb']} | {r.get('round_ms', '-')} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
