"""Benchmark and exactness check of the compiled top-k against torch.topk (GPU host).

    python -m ignis.tools.bench.topk --modules .device/topk --out $OUT

``--modules``: a folder holding ``topk_<arch>.so`` (``build_topk`` output, e.g. ``topk_sm90.so``)
or the ``.so`` itself; needs torch with CUDA, tvm_ffi and TVM's runtime libraries
(``$IGNIS_TVM_LIB_DIR``). At V = 248,320 (the Qwen3.8 vocabulary) it prints one line per
rows x k in (1, 2, 4, 8) x (8, 32, 64), on float32 logits, microseconds per call: our kernel and
``torch.topk`` as device time (``--inner`` calls captured in one CUDA graph, median over ``--reps``
timed replays), and eagerly (``--inner`` back-to-back calls between two CUDA events, median over
``--reps``): our raw module call, torch.topk, our wrapper (``TopKModule``: allocations, stream
context) and the exact torch fallback (``ignis.runtime.kernels.topk.topk_torch``). Then it checks
exactness against the stable-sort reference (indices equal, values bit-equal) on tie-heavy data:
float32 randn, the same quantized to 9 levels, bf16-rounded logits (bf16 input), f16 input,
special values (NaN, +-inf, +-0.0; float32 and bf16), +-0.0 at the top, all-equal bf16, at every
rows x k and on odd shapes. The reference runs on the CPU (torch's CUDA sort of bf16 does not rank
NaN first). Writes ``topk.json`` to
``--out``. Exit status 1 when any exactness check failed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

VOCAB = 248_320
ROWS = (1, 2, 4, 8)
KS = (8, 32, 64)


def _find_module(path: Path, arch: str) -> Path:
    if path.is_file():
        return path
    for name in (f"topk_{arch.replace('_', '')}.so", f"topk_{arch}.so", "topk.so"):
        if (path / name).exists():
            return path / name
    raise SystemExit(f"no topk module for {arch} under {path}")


def _bits(t: Any) -> Any:
    import torch

    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _time_us(fn: Any, *, inner: int, reps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / inner)
    return statistics.median(times)


def _reference(x: Any, k: int) -> tuple[Any, Any]:
    """The stable-sort reference, computed on the CPU and moved back to x's device: torch's CUDA
    sort of bfloat16 does not rank NaN first (seen on an H200, torch 2.11); its CPU sort does."""
    from ignis.compiler.kernels.topk import topk_reference

    v, i = topk_reference(x.cpu(), k)
    return v.to(x.device), i.to(x.device)


def _graph_us(fn: Any, *, inner: int, reps: int) -> float:
    """Device time per call: ``inner`` calls captured in one CUDA graph, replays timed."""
    import torch

    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch's docs ask before capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return _time_us(graph.replay, inner=1, reps=reps) / inner


def _data(kind: str, rows: int, vocab: int, gen: Any) -> Any:
    import torch

    x = torch.randn(rows, vocab, generator=gen, device="cuda") * 3.0
    if kind == "randn_f32":
        return x
    if kind == "quant9_f32":  # 9 levels: thousands of ties at the top level
        return torch.clamp(torch.round(x / 2.0), -4, 4)
    if kind == "bf16_logits":
        return x.bfloat16()
    if kind == "f16_logits":
        return x.half()
    if kind == "special_f32":
        x = torch.round(x)
        n = x.shape[1]
        x[:, torch.arange(0, n, 211, device="cuda")] = float("nan")
        x[:, torch.arange(5, n, 307, device="cuda")] = float("inf")
        x[:, torch.arange(9, n, 13, device="cuda")] = float("-inf")
        x[:, torch.arange(1, n, 3, device="cuda")] = 0.0
        x[:, torch.arange(2, n, 3, device="cuda")] = -0.0
        return x
    if kind == "special_bf16":
        return _data("special_f32", rows, vocab, gen).bfloat16()
    if kind == "zeros_f32":  # +0.0 and -0.0 (equal under the rule) at the top
        x = -torch.abs(x)
        x[:, 1::3] = 0.0
        x[:, 2::5] = -0.0
        return x
    if kind == "allequal_bf16":
        return torch.full((rows, vocab), 1.5, device="cuda", dtype=torch.bfloat16)
    raise ValueError(kind)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)

    import torch

    from ignis.compiler.kernels.topk import workspace_numel
    from ignis.runtime.kernels.topk import load_topk_module, topk_torch

    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    mod_path = _find_module(args.modules, arch)
    mod = load_topk_module(mod_path)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "arch": arch,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "module": str(mod_path),
        "vocab": VOCAB,
        "inner": args.inner,
        "reps": args.reps,
        "timing": [],
        "exactness": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / "topk.json"

    def save() -> None:
        out_file.write_text(json.dumps(result, indent=2) + "\n")

    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{result['device']} ({arch}), torch {torch.__version__}, V = {VOCAB}, float32 logits, us per call")
    print(
        f"{'rows':>4} {'k':>3} | {'ours graph':>10} {'torch graph':>11} {'speedup':>7} | {'ours eager':>10} "
        f"{'torch eager':>11} {'ours+wrapper':>12} {'topk_torch':>10} | exact"
    )
    import tvm_ffi

    for rows in ROWS:
        x = _data("randn_f32", rows, VOCAB, gen)
        for k in KS:
            vals = torch.empty((rows, k), device="cuda")
            idx = torch.empty((rows, k), device="cuda", dtype=torch.int64)
            ws = torch.empty(workspace_numel(rows, VOCAB), device="cuda", dtype=torch.int64)

            def ours_raw(x: Any = x, vals: Any = vals, idx: Any = idx, ws: Any = ws) -> None:
                with tvm_ffi.use_torch_stream():
                    mod.func(x, vals, idx, ws)

            def torch_topk(x: Any = x, k: int = k) -> Any:
                return torch.topk(x, k, dim=-1)

            row: dict[str, Any] = {"rows": rows, "k": k}
            row["ours_eager_us"] = _time_us(ours_raw, inner=args.inner, reps=args.reps)
            row["torch_topk_eager_us"] = _time_us(torch_topk, inner=args.inner, reps=args.reps)
            row["ours_wrapper_us"] = _time_us(lambda x=x, k=k: mod(x, k), inner=args.inner, reps=args.reps)
            row["topk_torch_us"] = _time_us(
                lambda x=x, k=k: topk_torch(x, k), inner=args.inner, reps=args.reps
            )
            for name, fn in (("ours_graph_us", ours_raw), ("torch_topk_graph_us", torch_topk)):
                try:
                    row[name] = _graph_us(fn, inner=args.inner, reps=args.reps)
                except Exception as exc:  # capture not supported: record, keep going
                    row[name] = None
                    row[name + "_error"] = repr(exc)
            rv, ri = _reference(x, k)
            ours_raw()
            torch.cuda.synchronize()
            row["exact"] = bool(torch.equal(idx, ri) and torch.equal(_bits(vals), _bits(rv)))
            result["timing"].append(row)
            og, tg = row["ours_graph_us"], row["torch_topk_graph_us"]
            sp = f"{tg / og:6.2f}x" if og and tg else "   n/a"
            print(
                f"{rows:>4} {k:>3} | {og or float('nan'):10.2f} {tg or float('nan'):11.2f} {sp:>7} | "
                f"{row['ours_eager_us']:10.2f} {row['torch_topk_eager_us']:11.2f} "
                f"{row['ours_wrapper_us']:12.2f} "
                f"{row['topk_torch_us']:10.2f} | {row['exact']}"
            )
            save()
    # the wrapper (allocations, stream context) captured in a graph: the drafter's use under graphs
    try:
        x = _data("randn_f32", 8, VOCAB, gen)
        mod(x, 64)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gv, gi = mod(x, 64)
        graph.replay()
        torch.cuda.synchronize()
        rv, ri = _reference(x, 64)
        ok = bool(torch.equal(gi, ri) and torch.equal(_bits(gv), _bits(rv)))
        result["graph_wrapper_8x64"] = {"exact": ok}
        print(f"wrapper captured in a CUDA graph, 8 x 64: exact {ok}")
    except Exception as exc:  # report and carry on with the checks
        result["graph_wrapper_8x64"] = {"error": repr(exc)}
        print(f"CUDA graph capture of the wrapper failed: {exc!r}")
    save()

    failures = 0
    shapes = [(r, VOCAB, k) for r in ROWS for k in KS] + [
        (3, 4097, 64),
        (5, 100, 1),
        (2, 64, 64),
        (1, 262_144, 64),
        (16, 131_071, 16),
        (56, VOCAB, 16),
        (1, 1_048_576, 64),
    ]
    kinds = (
        "randn_f32",
        "quant9_f32",
        "bf16_logits",
        "f16_logits",
        "special_f32",
        "special_bf16",
        "zeros_f32",
        "allequal_bf16",
    )
    for rows, vocab, k in shapes:
        for kind in kinds:
            x = _data(kind, rows, vocab, gen)
            v, i = mod(x, k)
            v2, i2 = mod(x, k)
            rv, ri = _reference(x, k)
            tv = torch.topk(x, k, dim=-1).values
            ok = bool(torch.equal(i, ri) and torch.equal(_bits(v), _bits(rv)))
            det = bool(torch.equal(i, i2) and torch.equal(_bits(v), _bits(v2)))
            fb_v, fb_i = topk_torch(x, k)
            fb_ok = bool(torch.equal(fb_i, ri) and torch.equal(_bits(fb_v), _bits(rv)))
            # torch.topk's values as a multiset (ties may pick other indices, -0.0/+0.0 may differ)
            same_values = bool(torch.equal(tv.float().nan_to_num(7e30), rv.float().nan_to_num(7e30)))
            n_bad = int((i != ri).any(dim=-1).sum())
            entry = {
                "rows": rows,
                "vocab": vocab,
                "k": k,
                "data": kind,
                "exact": ok,
                "deterministic": det,
                "topk_torch_exact": fb_ok,
                "torch_topk_same_values": same_values,
                "rows_with_wrong_indices": n_bad,
            }
            result["exactness"].append(entry)
            if not (ok and det and fb_ok):
                failures += 1
                print(f"MISMATCH {entry}")
    result["exactness_failures"] = failures
    n = len(result["exactness"])
    print(f"exactness: {n - failures}/{n} cases bit-exact against the stable-sort reference")
    save()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
