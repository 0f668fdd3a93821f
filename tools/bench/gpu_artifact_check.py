"""Run a built CUDA artifact's compiled modules on the GPU and check them (issue 5, last item).

    python -m ignis.tools.bench.gpu_artifact_check ART_DIR [ART_DIR ...] [--out DIR] [--steps 8]

Per artifact, on the GPU (a host with torch + CUDA, `tvm_ffi`, and `IGNIS_TVM_LIB_DIR` naming a
folder with libtvm_runtime.so and libtvm_runtime_cuda.so; no `import tvm`):

1. modules: `load_artifact` + `compiled_linears()` (the lean runtime). For every compiled width W
   and every function (N, K) of the manifest: fresh random activations x [W, K] in the function's
   dtype, y poisoned with NaN, the module called directly on the artifact's own Q4 weight of that
   shape (q|k|v and gate|up fused from layer 0 for llama / qwen2; random codes when no stored weight
   has the shape); error = ||y - x @ W64^T|| / ||x @ W64^T|| against float64 over the exactly
   dequantized weight. Then the same through `LinearBackend` at every R = 1..max(width) (the widths
   between the compiled ones run padded / dynamic-row on the next wider module).
2. executors: the compiled executor (`make_executor(linear=art.linear_backend())`, profile dtype),
   the torch executor over the dequantized weights (same dtype) and a float32 torch reference.
   The reference decodes greedily; the other two are fed the same tokens (prefill of the prompt,
   `--steps` single-token decode steps, one verify round of 8 columns) and compared by logits
   (relative error per call, worst over the calls) and argmax tokens.
3. time per round (forward + commit(0), CUDA events, median) at a few widths, both executors.

Prints one table per artifact last and writes `gpu_artifact_check.json` into `--out` (default
$OUT or the current folder). Without a CUDA device it still runs steps 2-3 on the CPU (the
compiled backend then falls back to torch), which only checks the script's plumbing.

Imports: the installed `ignis` package. On a GPU host without an install, put a folder whose `ignis/`
holds links to the checkout's formats/, runtime/, compiler/, tools/ on PYTHONPATH (tools/bench/gpu_suite.sh
does this).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ignis.runtime.artifact import load_artifact
from ignis.runtime.linear import Q4Weight, dequantize_q4

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FUSED = {
    "llama": (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))),
    "qwen2": (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))),
}


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a64, r64 = a.double(), ref.double()
    if not torch.isfinite(a64).all():
        return float("nan")
    return float((a64 - r64).norm() / r64.norm().clamp_min(1e-300))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def q4_by_shape(art: Any, dev: torch.device) -> dict[tuple[int, int], tuple[Q4Weight, str]]:
    """(N, K) -> (a stored Q4 weight of that shape on dev, its name)."""
    weights = art.target_weights(device="cpu", keep_q4=True)
    out: dict[tuple[int, int], tuple[Q4Weight, str]] = {}
    for name, w in sorted(weights.items()):
        if not isinstance(w, Q4Weight):
            continue
        while w.packed.dim() > 2:  # stacked experts: the first one
            w = w[0]
        out.setdefault((w.out_features, w.in_features), (w.contiguous().to(dev), name))
    for path, members in FUSED.get(art.manifest.family, ()):
        names = [f"model.layers.0.{path}.{m}.weight" for m in members]
        if all(isinstance(weights.get(n), Q4Weight) for n in names):
            w = Q4Weight.cat_rows([weights[n] for n in names]).contiguous().to(dev)
            out.setdefault((w.out_features, w.in_features), (w, f"layer0 {path} fused"))
    return out


def random_q4(n: int, k: int, dev: torch.device, gen: torch.Generator) -> Q4Weight:
    packed = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=gen, dtype=torch.int64)
    packed = packed.to(torch.int32).view(torch.uint32)
    scales = (torch.rand(n, k // 32, generator=gen) * 2 / (7 * k**0.5)).to(torch.float16)
    return Q4Weight(packed.to(dev), scales.to(dev))


def check_modules(art: Any, dev: torch.device, res: dict[str, Any]) -> None:
    from ignis.runtime.kernels.tvm_runtime import torch_stream

    t0 = time.perf_counter()
    compiled = art.compiled_linears()
    res["modules_load_s"] = round(time.perf_counter() - t0, 3)
    res["functions_loaded"] = len(compiled)
    res["functions_in_manifest"] = sum(len(e.functions) for e in art.manifest.modules)
    res["module_files"] = sorted({e.file for e in art.manifest.modules})
    res["routes"] = sorted({e.route for e in art.manifest.modules})
    gen = torch.Generator().manual_seed(1234)
    weights = q4_by_shape(art, dev)
    shapes = sorted(
        {(f.out_features, f.in_features, f.dtype, e.route) for e in art.manifest.modules for f in e.functions}
    )
    kinds = {(f.out_features, f.in_features): f.kind for e in art.manifest.modules for f in e.functions}
    res["shapes"] = [f"{n}x{k} {d} {r}" for n, k, d, r in shapes]
    per_width: dict[str, dict[str, float]] = {}
    wref: dict[tuple[int, int], tuple[Q4Weight, torch.Tensor, str]] = {}
    for n, k, _d, _r in shapes:
        if (n, k) not in wref:
            w, src = weights.get((n, k), (None, "random"))
            if w is None:
                w = random_q4(n, k, dev, gen)
            wref[(n, k)] = (w, dequantize_q4(w.packed, w.scales, torch.float32).double(), src)
    res["weight_source"] = {f"{n}x{k}": v[2] for (n, k), v in wref.items()}
    for width in compiled.widths:
        row: dict[str, float] = {}
        for n, k, dname, _route in shapes:
            kind = kinds[(n, k)]  # "q4_g32", or "q4_g32_tiled" (the weight in the tiled layout)
            fn = compiled.get(width, kind, n, k, dname)
            key = f"{n}x{k}"
            if fn is None:
                row[key] = float("nan")
                res.setdefault("missing", []).append(f"w{width} {key} {dname}")
                continue
            w, w64, _ = wref[(n, k)]
            if kind == "q4_g32_tiled":
                w = w.to_tiled()
            x = torch.randn(width, k, generator=gen).to(dev, TORCH_DTYPES[dname])
            y = torch.full((width, n), float("nan"), device=dev, dtype=x.dtype)
            if fn.cuda:
                with torch_stream():
                    fn.call(x, w.packed, w.scales, y)
            else:
                fn.call(x, w.packed, w.scales, y)
            sync(dev)
            row[key] = rel(y, x.double() @ w64.T)
        per_width[str(width)] = row
    res["module_rel_err"] = per_width
    # through the backend at every R (padded / dynamic rows for widths between the compiled ones)
    backend = art.linear_backend()
    top = max(compiled.widths) if compiled.widths else 0
    by_r: dict[str, float] = {}
    for r in range(1, top + 1):
        worst = 0.0
        for (n, k), (w, w64, _) in wref.items():
            dname = next(d for nn, kk, d, _ in shapes if (nn, kk) == (n, k))
            x = torch.randn(r, k, generator=gen).to(dev, TORCH_DTYPES[dname])
            y = backend(x, backend.place(w))  # tiled where a tiled function serves the shape
            sync(dev)
            e = rel(y, x.double() @ w64.T)
            worst = e if e != e else max(worst, e)  # NaN sticks
        by_r[str(r)] = worst
    res["backend_rel_err_by_R"] = by_r
    res["backend_counts"] = dict(backend.counts)


def run_lane(ex: Any, prompt: torch.Tensor, feed: list[int], steps: int, verify: list[int]) -> dict[str, Any]:
    """Prefill, `steps` decode steps fed `feed[i]`, one verify round of `verify` (teacher-forced).
    Returns every call's logits (float32, CPU)."""
    lane = ex.new_lane()
    calls = []
    out = ex.forward([lane], [prompt])
    calls.append(out.logits[0].float().cpu())
    ex.commit([lane], [int(prompt.numel())])
    for i in range(steps):
        out = ex.forward([lane], [torch.tensor([feed[i]])])
        calls.append(out.logits[0].float().cpu())
        ex.commit([lane], [1])
    out = ex.forward([lane], [torch.tensor(verify)])
    calls.append(out.logits[0].float().cpu())
    ex.commit([lane], [len(verify)])
    return {"calls": calls, "lane": lane}


def greedy_reference(ex: Any, prompt: torch.Tensor, n_new: int) -> list[int]:
    lane = ex.new_lane()
    out = ex.forward([lane], [prompt], logits="last")
    ex.commit([lane], [int(prompt.numel())])
    toks = [int(out.logits[0][-1].argmax())]
    for _ in range(n_new - 1):
        out = ex.forward([lane], [torch.tensor([toks[-1]])])
        ex.commit([lane], [1])
        toks.append(int(out.logits[0][-1].argmax()))
    return toks


def check_executors(art: Any, dev: torch.device, steps: int, res: dict[str, Any]) -> dict[str, Any]:
    backend = art.linear_backend()
    ex_c = art.make_executor(device=dev, linear=backend)
    ex_t = art.make_executor(device=dev)
    ex_r = art.make_executor(device=dev, dtype=torch.float32)
    res["executor_dtype"] = str(art.default_dtype()).replace("torch.", "")
    vocab = int(art.config.vocab_size)
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, vocab, (20,), generator=gen)
    ref_toks = greedy_reference(ex_r, prompt, steps + 1 + 8)
    # after the prefill, decode step i is fed token i (what the prefill / step i-1 chose)
    feed, verify = ref_toks[:steps], ref_toks[steps : steps + 8]
    counts_before = dict(backend.counts)
    runs = {
        name: run_lane(ex, prompt, feed, steps, verify)["calls"]
        for name, ex in (("compiled", ex_c), ("torch", ex_t), ("ref_f32", ex_r))
    }
    res["backend_counts_executor"] = {k: backend.counts[k] - counts_before[k] for k in backend.counts}
    labels = ["prefill(20)"] + [f"decode{i + 1}" for i in range(steps)] + ["verify(8)"]
    table = []
    for j, lab in enumerate(labels):
        c, t, r = runs["compiled"][j], runs["torch"][j], runs["ref_f32"][j]
        table.append(
            {
                "call": lab,
                "compiled_vs_torch": rel(c, t),
                "compiled_vs_f32": rel(c, r),
                "torch_vs_f32": rel(t, r),
                "argmax_compiled_eq_torch": bool((c.argmax(-1) == t.argmax(-1)).all()),
                "argmax_compiled_eq_f32": bool((c.argmax(-1) == r.argmax(-1)).all()),
                "argmax_torch_eq_f32": bool((t.argmax(-1) == r.argmax(-1)).all()),
            }
        )
    res["executor_calls"] = table
    # the greedy continuation each executor picks at the last column of each call (teacher-forced)
    pick = {n: [int(cl[-1].argmax()) for cl in calls[: steps + 1]] for n, calls in runs.items()}
    res["greedy_tokens"] = pick
    res["greedy_equal_compiled_torch"] = pick["compiled"] == pick["torch"]
    res["greedy_equal_compiled_f32"] = pick["compiled"] == pick["ref_f32"]
    res["verify_argmax_equal_compiled_torch"] = table[-1]["argmax_compiled_eq_torch"]
    return {"compiled": ex_c, "torch": ex_t, "prompt": prompt}


def time_rounds(exs: dict[str, Any], dev: torch.device, widths: list[int], res: dict[str, Any]) -> None:
    out: dict[str, dict[str, float]] = {}
    prompt = exs["prompt"]
    vocab = 0
    for name in ("compiled", "torch"):
        ex = exs[name]
        vocab = int(ex.config.vocab_size)
        lane = ex.new_lane()
        ex.forward([lane], [prompt])
        ex.commit([lane], [int(prompt.numel())])
        row: dict[str, float] = {}
        for w in widths:
            cols = torch.arange(w) % (vocab - 3) + 3
            for _ in range(3):
                ex.forward([lane], [cols])
                ex.commit([lane], [0])
            ts = []
            for _ in range(15):
                if dev.type == "cuda":
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    ex.forward([lane], [cols])
                    ex.commit([lane], [0])
                    b.record()
                    b.synchronize()
                    ts.append(a.elapsed_time(b))
                else:
                    t0 = time.perf_counter()
                    ex.forward([lane], [cols])
                    ex.commit([lane], [0])
                    ts.append((time.perf_counter() - t0) * 1e3)
            row[str(w)] = statistics.median(ts)
        out[name] = row
    res["round_ms"] = out


def fmt(x: float) -> str:
    return "nan" if x != x else f"{x:.1e}"


def summary(name: str, res: dict[str, Any]) -> None:
    print(
        f"\n== {name}: {res.get('family')} card {res.get('card')} arch {res.get('arch')} "
        f"routes {res.get('routes')} =="
    )
    if "error" in res:
        print("  ERRORS:", "; ".join(res["error"]))
    mre = res.get("module_rel_err")
    if mre:
        shapes = list(next(iter(mre.values())).keys())
        print(
            f"  modules: {res['functions_loaded']}/{res['functions_in_manifest']} functions loaded "
            f"in {res['modules_load_s']} s; rel. err vs float64 (direct call, NaN-poisoned y):"
        )
        print("  | W | " + " | ".join(shapes) + " | worst |")
        for w, row in mre.items():
            vals = list(row.values())
            worst = float("nan") if any(v != v for v in vals) else max(vals)
            print(f"  | {w} | " + " | ".join(fmt(v) for v in vals) + f" | {fmt(worst)} |")
        br = res.get("backend_rel_err_by_R", {})
        if br:
            vals = list(br.values())
            worst = float("nan") if any(v != v for v in vals) else max(vals)
            print(
                f"  backend R=1..{len(vals)}: worst rel. err {fmt(worst)}; counts {res.get('backend_counts')}"
            )
    calls = res.get("executor_calls")
    if calls:
        print(
            f"  executors ({res['executor_dtype']}): compiled-linear hook vs torch (dequantized), "
            f"both vs float32 torch; hook counts {res.get('backend_counts_executor')}"
        )
        print("  | call | compiled vs torch | compiled vs f32 | torch vs f32 | argmax c=t | c=f32 |")
        for c in calls:
            print(
                f"  | {c['call']} | {fmt(c['compiled_vs_torch'])} | {fmt(c['compiled_vs_f32'])} | "
                f"{fmt(c['torch_vs_f32'])} | {c['argmax_compiled_eq_torch']} | "
                f"{c['argmax_compiled_eq_f32']} |"
            )
        print(
            f"  greedy tokens equal compiled/torch: {res['greedy_equal_compiled_torch']}, "
            f"compiled/f32: {res['greedy_equal_compiled_f32']}; tokens {res['greedy_tokens']['compiled']}"
        )
    rm = res.get("round_ms")
    if rm:
        print(
            "  ms per round (forward + commit(0), median of 15): "
            + "; ".join(
                f"R={w}: compiled {rm['compiled'][w]:.2f} / torch {rm['torch'][w]:.2f}"
                for w in rm["compiled"]
            )
        )


def check_artifact(path: str, dev: torch.device, steps: int, widths: list[int]) -> dict[str, Any]:
    """Steps 1-3 of the module docstring for one artifact; failures are recorded under "error"."""
    name = Path(path).name
    res: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        art = load_artifact(path)
    except Exception:
        traceback.print_exc()
        res["error"] = ["load_artifact failed"]
        return res
    res.update(
        family=art.manifest.family,
        card=art.manifest.card,
        arch=art.manifest.arch,
        routes=sorted({e.route for e in art.manifest.modules}),
    )
    torch.manual_seed(0)
    exs: dict[str, Any] = {}
    for label in ("modules", "executors", "timing"):
        try:
            if label == "modules":
                check_modules(art, dev, res)
            elif label == "executors":
                exs.update(check_executors(art, dev, steps, res))
            elif exs:
                time_rounds(exs, dev, widths, res)
        except Exception as exc:
            traceback.print_exc()
            res.setdefault("error", []).append(f"{label}: {type(exc).__name__}: {exc}")
    res["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"{name}: done in {res['seconds']} s", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--widths", default="1,4,8,16,32")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    try:
        import tvm_ffi

        info["tvm_ffi"] = getattr(tvm_ffi, "__version__", "?")
    except ImportError as exc:
        info["tvm_ffi"] = f"missing: {exc}"
    print(json.dumps(info), flush=True)
    results: dict[str, Any] = {"info": info, "artifacts": {}}
    widths = [int(w) for w in args.widths.split(",")]
    for path in args.artifacts:
        results["artifacts"][Path(path).name] = check_artifact(path, dev, args.steps, widths)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_artifact_check.json").write_text(json.dumps(results, indent=1, default=str))
    for name, res in results["artifacts"].items():
        summary(name, res)
    return 0 if all("error" not in r for r in results["artifacts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
