"""Where a llama artifact's decode round goes on the GPU: the graph's kernels against the host's step
(issue 25, item 5: SmolLM2-135M served at 3.6 ms a token on the H200).

    python -m ignis.tools.bench.llama_round ARTIFACT [--lanes 1,8] [--tokens 128] [--routes q4,dense]
                                                     [--norms artifact,torch]
    python -m ignis.tools.bench.llama_round ARTIFACT --device cpu --tokens 16     # plumbing check

For each route and lane count, the engine in this process (`SpeculativeEngine` over the executor the
server builds: `StaticLlamaExecutor` with CUDA graphs on CUDA, warmed up as at load) decodes
``--tokens`` tokens a lane from 20-token prompts, greedy, speculation off, after one untimed run.
Reported per round (one token a lane):

- ``step_ms``: wall milliseconds of an engine step (the whole round as a client's engine sees it);
- ``replay_ms`` (CUDA): GPU milliseconds of the decode round's graph alone (CUDA events around
  ``--replays`` back-to-back replays of the graph the steps used, at the KV bucket of the lanes'
  last round; no host work between them);
- ``host_ms`` = step_ms - replay_ms: what the host adds (the engine's step, the executor's input
  copy, the launch, the argmax and its read-back);
- ``kernels`` and ``kernel_ms`` (CUDA, ``--profile``): the CUDA kernels of one replay as CUPTI
  reports them (torch.profiler) and the sum of their durations; replay_ms - kernel_ms is the time
  the GPU spends between the graph's kernels.

Routes: ``q4`` (the artifact's compiled q4 linears, as `ignis-run` serves it) and ``dense`` (the
weights dequantized to the executor's dtype at load, every linear a torch `F.linear`: cuBLAS on
CUDA), so that a linear route that scales badly with the rows of a round shows as the difference
between the two at 8 lanes. Norms (``--norms``): ``artifact`` (the fused residual add + RMSNorm
and SwiGLU activation of the artifact's fused_norms library when it has ``add_rms_norm_llama``, as
`ignis-run` serves it) and ``torch`` (the executor's torch norms), so that the fused kernels' effect
shows on one artifact. Prints one line a (route, norms, lanes) and a table last; writes
``llama_round.json`` into ``--out`` (default $OUT or .).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.families.llama_graphs import lane_width
from ignis.runtime.families.static_rounds import kv_bucket, warm_up_static
from ignis.runtime.sampling import SamplingParams

__all__ = ["main", "measure"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _decode_graph(executor: Any, lanes: int, context: int) -> Any:
    """The captured graph of a decode round (one column) of `lanes` lanes at the KV bucket of
    `context` tokens, or None."""
    graphs = getattr(executor, "_graphs", None)
    if not graphs:
        return None
    bucket = kv_bucket(context, executor.kv_bucket, executor.capacity)
    entry = graphs.get((lane_width(lanes), 1, bucket, False, ()))
    return None if entry is None else entry.graph


def _replay_ms(graph: Any, replays: int) -> float:
    """GPU ms of one replay of `graph` (back-to-back replays between two CUDA events)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / replays


def _profile_replay(graph: Any) -> tuple[int, float]:
    """(kernels, the sum of their GPU ms) of one replay of `graph`, from torch.profiler (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels), sum(e.device_time for e in kernels) / 1000.0


def measure(
    engine: SpeculativeEngine,
    *,
    lanes: int,
    tokens: int,
    replays: int = 50,
    profile: bool = False,
) -> dict[str, Any]:
    """One (engine, lane count): the module docstring's figures (None where the device has none)."""
    device = engine.device
    prompts = [[7 + i] * 20 for i in range(lanes)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts, params)  # untimed: captures, allocator growth
    ids = [engine.add_lane(p, params) for p in prompts]
    engine.step()  # the prefill and the first round
    _sync(device)
    steps: list[float] = []
    while any(engine.result(i) is None for i in ids):
        t0 = time.perf_counter()
        engine.step()
        steps.append(1000.0 * (time.perf_counter() - t0))
    for i in ids:
        engine.pop_result(i)
    step_ms = statistics.median(steps)
    row: dict[str, Any] = {
        "lanes": lanes,
        "step_ms": round(step_ms, 4),
        "tok_s": round(lanes * 1000 / step_ms, 1),
    }
    graph = _decode_graph(engine.executor, lanes, len(prompts[0]) + tokens) if device.type == "cuda" else None
    replay = None if graph is None else _replay_ms(graph, replays)
    row["replay_ms"] = None if replay is None else round(replay, 4)
    row["host_ms"] = None if replay is None else round(step_ms - replay, 4)
    if profile and graph is not None:
        num, ms = _profile_replay(graph)
        row["kernels"], row["kernel_ms"] = num, round(ms, 4)
    return row


def _engine(
    artifact: Any, route: str, device: str, max_lanes: int, context: int, norms: str = "artifact"
) -> SpeculativeEngine:
    dtype = artifact.default_dtype() if torch.device(device).type != "cpu" else torch.float32
    linear = artifact.linear_backend() if route == "q4" else None
    executor = artifact.make_executor(device=device, dtype=dtype, linear=linear, max_lanes=max_lanes)
    if norms == "torch" and getattr(executor, "norms_module", None) is not None:
        executor.norms_module = None  # type: ignore[attr-defined]
    warm_up_static(executor, context=context)  # every round shape up to `context` tokens
    tok = artifact.tokenizer()
    eos = tuple(tok.eos_token_ids) if tok is not None else ()
    return SpeculativeEngine(executor, None, eos_token_ids=eos, max_lanes=max_lanes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lanes", default="1,8")
    ap.add_argument("--tokens", type=int, default=128, help="output tokens a lane")
    ap.add_argument("--routes", default="q4,dense", help="q4 (compiled linears), dense (torch F.linear)")
    ap.add_argument("--norms", default="artifact", help="artifact (its fused norms, if any), torch")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--profile", action="store_true", help="count the kernels of one replay (CUPTI)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    a = ap.parse_args(argv)
    from ignis.runtime.artifact import load_artifact

    art = load_artifact(a.artifact)
    lane_counts = [int(x) for x in a.lanes.split(",") if x]
    rows: list[dict[str, Any]] = []
    combos = [(r, n) for r in a.routes.split(",") if r for n in a.norms.split(",") if n]
    for route, norms in combos:
        engine = _engine(art, route, a.device, max(lane_counts), 20 + a.tokens + 8, norms)
        fused = getattr(engine.executor, "norms_module", None) is not None
        for lanes in lane_counts:
            row = {
                "route": route,
                "norms": "fused" if fused else "torch",
                **measure(engine, lanes=lanes, tokens=a.tokens, replays=a.replays, profile=a.profile),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        del engine
        if torch.device(a.device).type == "cuda":
            torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "llama_round.json").write_text(json.dumps({"artifact": str(a.artifact), "rows": rows}, indent=1))
    print("route | norms | lanes | step ms | tok/s | replay ms | host ms | kernels | kernel ms")
    for r in rows:
        cells = [r["step_ms"], r["tok_s"], r["replay_ms"], r["host_ms"], r.get("kernels"), r.get("kernel_ms")]
        head = f"{r['route']} | {r['norms']} | {r['lanes']} |"
        print(head, " | ".join("-" if c is None else str(c) for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
