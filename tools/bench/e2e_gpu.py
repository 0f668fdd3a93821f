"""End-to-end benchmark of a full-size 27B-shaped `qwen3_5` model on one GPU (issue 7).

    python -m ignis.tools.bench.e2e_gpu --mods DIR [--out DIR] [--budget-s 280] [--tokens 64]
    python -m ignis.tools.bench.e2e_gpu --tiny            # CPU plumbing check at toy sizes
    python -m ignis.tools.bench.e2e_gpu --mods DIR --graphs-only --budget-s 150   # graphed rounds first

The model is the public Qwen3.5-27B text config (hidden 5120, 64 layers, 3 Gated DeltaNet : 1 gated
attention, 24 query / 4 KV heads of 256, GDN 16 key / 48 value heads of 128, conv 4, intermediate
17408, vocabulary 248,320, untied head) with RANDOM weights generated on the device: q4_g32 codes
(random u32) + small f16 scales for every quantizable linear (the lm_head included; the GDN
`in_proj_a/b` stay bf16, as `compiler/build/convert.py` keeps them), bf16 for the rest. The bf16
route's linears are the exact dequantization of the same codes, so both routes run the same model.

Phases (in priority order; each is skipped, and said so, when the time budget is spent):

0. Graphed route (`--no-graphs` skips it): `StaticHybridExecutor` (runtime/families/hybrid_graphs.py)
   over the same backend, rounds replayed from CUDA graphs. Per width R (1 lane, R columns, one
   executor with max_columns = the widest R, every R a column width: no padding): round time, the
   first call's time (warm-up + capture) and max |logits - eager HybridExecutor's|; then decode as
   in 2 (8 lane slots, 8 columns), each run twice (the first captures; the second is reported,
   first_wall_s kept). With `--gdn-module PATH`
   (a `.so` from `ignis.compiler.kernels.gdn_recurrent.build_gdn_recurrent`): the rounds per width
   again with the fused GDN recurrence (`rounds_fused`), one GDN layer's recurrence alone (torch
   loop vs the kernel, CUDA-graph replay, `gdn_layer`), and the decode with the kernel. With
   `--norms-module PATH` too (a `.so` from `ignis.compiler.kernels.fused_norms.build_fused_norms`):
   the rounds per width with every fused module (`rounds_all_fused`: the GDN recurrence + the fused
   add/RMSNorm and gated norm), printed per width against the GDN-only rounds and the floor; the
   decode then uses both. With `--mixers-module PATH` (a `.so` from
   `ignis.compiler.kernels.fused_mixers.build_fused_mixers`): the rounds per width with every given
   module plus the fused mixer pieces (`rounds_mixers`: GDN conv + SiLU, q/k norm + RoPE + KV write),
   printed against the previous all-fused rounds; the decode then uses every given module. Before the
   decode, on its executor: the prefill of the 16-token prompts on 1 and 8 lanes (`prefill`: graphed
   as chunks of 8-column static rounds, `chunked_prefill`, against eager), and graphed rounds per
   (lanes, columns) of `LANE_SHAPES` (`lane_rounds`: 1/2/4/8 x 1, 1 x 8, 8 x 8, committing one
   column per lane; docs/perf/log/2026-11-29-before-session-3.md, "Graphed prefill").
1. Q4 compiled route: `HybridExecutor(bf16, linear=LinearBackend(CompiledLinears(...)))` over the
   carried sm_90 bundle (`--mods`: `q4_e2e_sm90.so` + `manifest.json` mapping (width, N, K) to an
   export; every width 1..8, 16, 32). Per width R: the linears of one forward alone (eager through
   the backend, and replayed from a CUDA graph = kernel time), and a round (1 lane, R columns,
   forward(record=True) + commit(0)), CUDA events, warm-up, median; against the weight-bytes floor.
2. Decode tokens/s through `SpeculativeEngine`, 1 and 8 lanes, greedy, `--tokens` per lane after a
   16-token random prompt: speculation off, and draft_tokens=7 with `right_with_probability`
   drafters (p = 0.74 and 0.885: ~3.5 and ~5.4 expected tokens per round) replaying the
   speculation-off output, so the round cost is separated from the drafter's quality.
3. bf16 route (cuBLAS through `F.linear`, same executor): rounds per width and decode; then HF
   transformers `Qwen3_5ForCausalLM` (config built here, the same bf16 tensors assigned, torch
   fallback for the GDN) generating greedily, 1 and 8 lanes.

Prints a table last; writes `bench_e2e_gpu.json` into `--out` (default $OUT or .). Imports the installed
`ignis` package; on a GPU host without an install, tools/bench/gpu_suite.sh puts a folder of links to the
checkout on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ignis.runtime.drafters.testing import right_with_probability
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.families import get_family
from ignis.runtime.families.hybrid_executor import HybridExecutor
from ignis.runtime.families.hybrid_graphs import CHUNKED_PREFILL_ROUNDS, StaticHybridExecutor
from ignis.runtime.families.qwen3_5 import Qwen3_5TextConfig, tensor_shapes
from ignis.runtime.linear import CompiledLinears, LinearBackend, Q4Weight, place_weight, row_splits_of
from ignis.runtime.sampling import SamplingParams

T0 = time.perf_counter()
BW = 4.2e12  # H200 HBM3e copy bandwidth used for the floor (bytes/s)
WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
PROMPT_LEN = 16
#: tokens committed before the timed graphed rounds and the profiled round (`--context`): the KV length
#: their attention layers read
ROUND_CONTEXT = PROMPT_LEN

# Public Qwen3.5-27B text config (HF `Qwen/Qwen3.5-27B` config.json text_config; the same numbers in
# THUDM/slime scripts/models/qwen3.5-27B.sh: 24 heads, 4 query groups, kv-channels 256, rotary 0.25,
# rotary base 1e7).
FULL = {
    "model_type": "qwen3_5_text",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "full_attention_interval": 4,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attn_output_gate": True,
    "hidden_act": "silu",
    "mtp_num_hidden_layers": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}
TINY = dict(
    FULL,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    vocab_size=512,
    max_position_embeddings=4096,
)

# As compiler/build/convert.py: quantizable = a linear weight by name, not a precise gate.
_LINEAR_NAME = re.compile(r"(^|\.)([A-Za-z0-9_]*proj[A-Za-z0-9_]*\.weight|(lm_)?head\.weight)$")
_KEEP_PRECISE = re.compile(r"(^|\.)(in_proj_(a|b|ba)\.weight)$")


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Any, dev: torch.device, *, reps: int, warmup: int) -> list[float]:
    """Milliseconds per call of fn(), CUDA events on a GPU (wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


# ------------------------------------------------------------------------------------------ weights


def make_weights(cfg: Any, dev: torch.device, seed: int) -> tuple[dict[str, Any], int]:
    """{name: Q4Weight | bf16 tensor} (random, on dev) and the total Q4 bytes."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    out: dict[str, Any] = {}
    q4_bytes = 0
    for name, shape in tensor_shapes(cfg).items():
        if len(shape) == 2 and _LINEAR_NAME.search(name) and not _KEEP_PRECISE.search(name):
            n, k = shape
            packed = torch.randint(
                -(2**31), 2**31 - 1, (n, k // 8), generator=gen, device=dev, dtype=torch.int32
            ).view(torch.uint32)
            scales = (torch.rand(n, k // 32, generator=gen, device=dev) * (2 / (7 * math.sqrt(k)))).half()
            out[name] = Q4Weight(packed, scales)
            q4_bytes += packed.numel() * 4 + scales.numel() * 2
            continue
        out[name] = random_dense(name, shape, dev, gen)
    return out, q4_bytes


def random_dense(
    name: str,
    shape: tuple[int, ...],
    dev: torch.device,
    gen: torch.Generator,
    *,
    one_plus_norms: bool = True,
    bias_std: float | None = None,
) -> torch.Tensor:
    """One random bf16 tensor of a hybrid / llama checkpoint that is not quantized, on `dev`, drawn
    from `gen`: GDN A_log log U(1, 16), dt_bias and the GDN output norm 1, conv N(0, 0.3^2),
    embeddings N(0, 1), 1-D biases N(0, bias_std^2) when `bias_std` is given, other 1-D tensors (the
    RMSNorms) 0 for (1 + w) norms (`one_plus_norms`) else 1, matrices N(0, 1/fan_in)."""
    if name.endswith("A_log"):
        t = torch.empty(shape, device=dev).uniform_(1.0, 16.0, generator=gen).log_()
    elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        t = torch.ones(shape, device=dev)
    elif name.endswith("conv1d.weight"):
        t = torch.randn(shape, generator=gen, device=dev) * 0.3
    elif name.endswith("embed_tokens.weight"):
        t = torch.randn(shape, generator=gen, device=dev)
    elif len(shape) == 1 and bias_std is not None and name.endswith("bias"):
        t = torch.randn(shape, generator=gen, device=dev) * bias_std
    elif len(shape) == 1:
        t = torch.zeros(shape, device=dev) if one_plus_norms else torch.ones(shape, device=dev)
    else:
        t = torch.randn(shape, generator=gen, device=dev) / math.sqrt(shape[-1])
    return t.to(torch.bfloat16)


def dense_from_q4(weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The same model with every Q4 linear dequantized to bf16 (other tensors shared)."""
    out = {}
    for name, w in weights.items():
        out[name] = w.dequantize(torch.bfloat16) if isinstance(w, Q4Weight) else w
    return out


# ------------------------------------------------------------------------------------------ modules


def load_compiled(mods: Path) -> CompiledLinears:
    from ignis.runtime.kernels.tvm_runtime import load_module

    man = json.loads((mods / "manifest.json").read_text())
    mod = load_module(mods / man["file"], cuda=True)
    fns: dict[tuple[int, str, int, int, str], tuple[Any, bool, bool]] = {}
    cache: dict[str, Any] = {}
    kind = man.get("kind", "q4_g32")  # "q4_g32_tiled": the weights are placed in the tiled layout
    for key, export in man["table"].items():
        w, n, k = (int(v) for v in key.split("|"))
        if export not in cache:
            cache[export] = mod[export]
        fns[(w, kind, n, k, "bfloat16")] = (cache[export], True, True)
    return CompiledLinears(fns, sorted({k[0] for k in fns}))


def linear_chain(ex: HybridExecutor) -> list[Any]:
    """The linear weights one forward multiplies, in order (lm_head last)."""
    chain: list[Any] = []
    for layer in ex._layers:
        if layer.attn is not None:
            a = layer.attn
            chain += [a.q_proj, a.k_proj, a.v_proj, a.o_proj]
        else:
            g = layer.gdn
            chain += [
                w for w in (g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a, g.out_proj) if w is not None
            ]
        chain += [layer.mlp.gate, layer.mlp.up, layer.mlp.down]
    chain.append(ex._lm_head)
    return chain


def kfeat(w: Any) -> int:
    return w.in_features if isinstance(w, Q4Weight) else int(w.shape[1])


def bench_linears(
    ex: HybridExecutor, dev: torch.device, widths: tuple[int, ...], reps: int, graph: bool, eager: bool = True
) -> dict:
    """Per width: ms of all linears of one forward (eager through the hook; CUDA-graph replay)."""
    chain = linear_chain(ex)
    lin = ex.linear
    res: dict[str, Any] = {}
    for r in widths:
        xs = {k: torch.randn(r, k, device=dev, dtype=ex.dtype) for k in {kfeat(w) for w in chain}}

        def run(xs: dict[int, torch.Tensor] = xs) -> None:
            for w in chain:
                lin(xs[kfeat(w)], w)

        row = {"eager_ms": med(timed(run, dev, reps=reps, warmup=2))} if eager else {}
        if graph and dev.type == "cuda":
            try:
                from ignis.runtime.kernels.tvm_runtime import torch_stream

                g = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    run()  # warm on the side stream before capture
                torch.cuda.current_stream().wait_stream(s)
                with torch_stream(torch.cuda.graph(g)):
                    run()
                row["graph_ms"] = med(timed(g.replay, dev, reps=reps, warmup=1))
                del g
            except Exception as exc:
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        res[str(r)] = row
        log(f"  linears R={r}: {row}")
    return res


def bench_rounds(
    ex: HybridExecutor, dev: torch.device, widths: tuple[int, ...], reps: int, vocab: int
) -> dict:
    """Per width R: ms of one round (1 lane, R columns, forward(record=True) + commit(0))."""
    gen = torch.Generator().manual_seed(7)
    st = ex.new_lane()
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=gen)
    ex.forward([st], [prompt.to(dev)], logits="last", record=False)
    ex.commit([st], [PROMPT_LEN])
    res = {}
    for r in widths:
        cols = torch.randint(0, vocab, (r,), generator=gen).to(dev)

        def rnd(cols: torch.Tensor = cols) -> None:
            ex.forward([st], [cols], logits="all", record=True)
            ex.commit([st], [0])

        res[str(r)] = med(timed(rnd, dev, reps=reps, warmup=2))
        log(f"  round R={r}: {res[str(r)]} ms")
    return res


def bench_graph_rounds(
    ex: StaticHybridExecutor,
    ref: HybridExecutor,
    dev: torch.device,
    widths: tuple[int, ...],
    reps: int,
    vocab: int,
) -> dict:
    """Per width R: ms of one graphed round (1 lane, R columns, forward(record=True) + commit(0)),
    the capture's cost (first call), and max |logits - eager HybridExecutor's| for that round."""
    gen = torch.Generator().manual_seed(7)
    st, rs = ex.new_lane(), ref.new_lane()
    prompt = torch.randint(0, vocab, (ROUND_CONTEXT,), generator=gen).to(dev)
    for e, lane in ((ex, st), (ref, rs)):
        e.forward([lane], [prompt], logits="last", record=False)
        e.commit([lane], [ROUND_CONTEXT])
    res: dict[str, Any] = {}
    for r in widths:
        if r > ex.max_columns:
            continue
        cols = torch.randint(0, vocab, (r,), generator=gen).to(dev)

        def rnd(cols: torch.Tensor = cols) -> torch.Tensor:
            out = ex.forward([st], [cols], logits="all", record=True)
            ex.commit([st], [0])
            return out.logits[0]

        sync(dev)
        t = time.perf_counter()
        got = rnd()  # warm-up + capture + first replay
        sync(dev)
        first_ms = (time.perf_counter() - t) * 1e3
        want = ref.forward([rs], [cols], logits="all", record=True).logits[0]
        ref.commit([rs], [0])
        row = {
            "graph_ms": med(timed(rnd, dev, reps=reps, warmup=1)),
            "first_call_ms": round(first_ms, 1),
            "max_abs_diff_vs_eager": round(float((got - want).abs().max()), 4),
            "argmax_equal_vs_eager": f"{int((got.argmax(-1) == want.argmax(-1)).sum())}/{r}",
        }
        res[str(r)] = row
        log(f"  graphed round R={r}: {row}")
    ex.release_lane(st)
    return res


def profile_round(ex: StaticHybridExecutor, dev: torch.device, r: int, vocab: int, reps: int = 3) -> dict:
    """Where one graphed round's GPU time goes (1 lane, r columns): the kernels of `reps` replays
    recorded by torch.profiler (CUPTI records the kernels a CUDA graph launches), summed per kernel
    name and per replay. Returns {"kernels": [{name, calls, us}], "us_per_round", "launches_per_round"},
    us = microseconds of kernel time per round (gaps between kernels are not counted)."""
    gen = torch.Generator().manual_seed(11)
    st = ex.new_lane()
    prompt = torch.randint(0, vocab, (ROUND_CONTEXT,), generator=gen).to(dev)
    ex.forward([st], [prompt], logits="last", record=False)
    ex.commit([st], [ROUND_CONTEXT])
    cols = torch.randint(0, vocab, (r,), generator=gen).to(dev)

    def rnd() -> None:
        ex.forward([st], [cols], logits="all", record=True)
        ex.commit([st], [0])

    rnd()  # capture
    sync(dev)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            rnd()
        sync(dev)
    per: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            acc = per.setdefault(ev.name, [0, 0.0])
            acc[0] += 1
            acc[1] += ev.device_time_total
    ex.release_lane(st)
    rows = sorted(
        ({"name": n[:160], "calls": c / reps, "us": round(t / reps, 1)} for n, (c, t) in per.items()),
        key=lambda x: -x["us"],
    )
    return {
        "columns": r,
        "us_per_round": round(sum(x["us"] for x in rows), 1),
        "launches_per_round": sum(x["calls"] for x in rows),
        "kernels": rows,
    }


def bench_gdn_layer(cfg: Any, dev: torch.device, kernel: Any, reps: int) -> dict:
    """One GDN layer's recurrence at the model's shape, replayed from a CUDA graph: the torch path of
    a static round (preparation + `StaticHybridExecutor._recurrence`) against the fused kernel, per
    (lanes, columns); ms per layer and max |difference| of outputs (bf16) and record (float32)."""
    res: dict[str, Any] = {}
    for lanes, n in ((1, 1), (1, 8), (8, 1), (8, 8)):
        row = _gdn_layer_case(cfg, dev, kernel, reps, lanes, n)
        res[f"L{lanes}_n{n}"] = row
        log(f"  GDN layer lanes={lanes} columns={n}: {row}")
    return res


def _gdn_layer_case(cfg: Any, dev: torch.device, kernel: Any, reps: int, lanes: int, n: int) -> dict:
    import torch.nn.functional as F

    from ignis.runtime.families.gated_deltanet import l2_normalize
    from ignis.runtime.kernels.tvm_runtime import capture

    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_dim = 2 * hk * dk + hv * dv
    gen = torch.Generator(device=dev).manual_seed(5)
    mixed = torch.randn(lanes, n, conv_dim, generator=gen, device=dev).bfloat16()
    b = torch.randn(lanes, n, hv, generator=gen, device=dev).bfloat16()
    a = torch.randn(lanes, n, hv, generator=gen, device=dev).bfloat16()
    neg_a = -torch.rand(hv, generator=gen, device=dev) * 8
    dt_bias = torch.ones(hv, device=dev)
    state = torch.randn(lanes, hv, dk, dv, generator=gen, device=dev) * 0.1
    slots = torch.arange(lanes, device=dev)
    rec_t = torch.empty(n, lanes, hv, dk, dv, device=dev)
    rec_k = torch.empty_like(rec_t)
    out_k = torch.empty(lanes, n, hv, dv, device=dev, dtype=torch.bfloat16)
    outs: dict[str, torch.Tensor] = {}

    def torch_path() -> None:
        beta = torch.sigmoid(b).float()
        decay = neg_a * F.softplus(a.float() + dt_bias)
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = l2_normalize(q.float().reshape(lanes, n, hk, dk))
        k = l2_normalize(k.float().reshape(lanes, n, hk, dk))
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
        q = q * dk**-0.5
        v = v.float().reshape(lanes, n, hv, dv)
        prev = state.index_select(0, slots)
        out = StaticHybridExecutor._recurrence(q, k, v, decay, beta, prev, rec_t)
        outs["torch"] = out.to(torch.bfloat16)

    def kernel_path() -> None:
        kernel(mixed, b, a, neg_a, dt_bias, state, slots, rec_k, out_k, hk, dk**-0.5)

    row: dict[str, Any] = {}
    for name, fn in (("torch", torch_path), ("kernel", kernel_path)):
        fn()
        sync(dev)
        g = torch.cuda.CUDAGraph()
        with capture(g):
            fn()
        row[f"{name}_ms"] = med(timed(g.replay, dev, reps=max(reps, 10), warmup=2))
    row["max_abs_out_diff"] = float((outs["torch"].float() - out_k.float()).abs().max())
    row["max_abs_record_diff"] = float((rec_t - rec_k).abs().max())
    return row


def decode_twice(ex: Any, prompts: list[list[int]], tokens: int, drafter_fn: Any = None) -> dict:
    """`decode` run twice with fresh drafters: the first captures the graphs (its wall time is
    reported as first_wall_s), the second replays them."""
    first = decode(ex, prompts, tokens, drafter_fn() if drafter_fn else None)
    out = decode(ex, prompts, tokens, drafter_fn() if drafter_fn else None)
    out["first_wall_s"] = first["wall_s"]
    out["same_as_first"] = first["outputs"] == out["outputs"]
    return out


def bench_prefill(ex: Any, prompts8: list[list[int]], dev: torch.device, reps: int) -> dict:
    """ms of one prefill (forward(record=False, logits="last") + commit(0)) of the 16-token prompts
    on 1 and 8 fresh lanes: graphed (chunks of max_columns static rounds, `chunked_prefill`) and
    eager (chunked_prefill=0); the first call captures (warm-up, not timed)."""
    res: dict[str, Any] = {"prompt_len": PROMPT_LEN, "chunked_prefill": ex.chunked_prefill}
    chunked = ex.chunked_prefill
    for lanes in (1, 8):
        cols = [torch.tensor(p, device=dev) for p in prompts8[:lanes]]
        states = [ex.new_lane() for _ in cols]

        def pre(states: list = states, cols: list = cols) -> None:
            ex.forward(states, cols, logits="last", record=False)
            ex.commit(states, [0] * len(states))

        for mode, knob in (("graphed", chunked), ("eager", 0)):
            if mode == "graphed" and PROMPT_LEN > chunked:
                res[f"{lanes}lane_{mode}_ms"] = "off (chunked_prefill < prompt)"
                continue
            ex.chunked_prefill = knob
            try:
                res[f"{lanes}lane_{mode}_ms"] = med(timed(pre, dev, reps=reps, warmup=1))
            finally:
                ex.chunked_prefill = chunked
        for st in states:
            ex.release_lane(st)
        log(f"  prefill {lanes} lane(s): { {k: v for k, v in res.items() if k.startswith(str(lanes))} }")
    return res


LANE_SHAPES = ((1, 1), (2, 1), (4, 1), (8, 1), (1, 8), (8, 8))
"""(lanes, columns) of the graphed rounds timed by `bench_lane_rounds`."""


def bench_lane_rounds(ex: Any, prompts8: list[list[int]], dev: torch.device, reps: int) -> dict:
    """ms of one graphed round (forward(record=True) + commit of 1 column per lane, as a decode step
    keeps at least one: the commit's state gather is timed too) per (lanes, columns) of `LANE_SHAPES`,
    the lanes prefilled with the 16-token prompts (docs/perf/log/2026-11-29-before-session-3.md,
    "Graphed prefill"). The lanes grow by one token a call (<= 7 per shape): the KV bucket stays the
    same."""
    states = [ex.new_lane() for _ in range(8)]
    ex.forward(states, [torch.tensor(p, device=dev) for p in prompts8[:8]], logits="last", record=False)
    ex.commit(states, [PROMPT_LEN] * 8)
    gen = torch.Generator().manual_seed(5)
    res: dict[str, Any] = {}
    for lanes, n in LANE_SHAPES:
        cols = [torch.randint(0, ex.config.vocab_size, (n,), generator=gen).to(dev) for _ in range(lanes)]

        def rnd(cols: list = cols, lanes: int = lanes) -> None:
            ex.forward(states[:lanes], cols, logits="all", record=True)
            ex.commit(states[:lanes], [1] * lanes)

        res[f"{lanes}x{n}"] = med(timed(rnd, dev, reps=reps, warmup=2))
        log(f"  graphed round {lanes} lanes x {n} columns: {res[f'{lanes}x{n}']} ms")
    for st in states:
        ex.release_lane(st)
    return res


def graphed_decode_suite(
    ex: Any, prompts8: list[list[int]], tokens: int, vocab: int, budget: Budget, ps: tuple[float, ...]
) -> dict:
    res: dict[str, Any] = {}
    for lanes in (1, 8):
        prompts = prompts8[:lanes]
        key = f"{lanes}lane_off"
        if budget.left() < 15:
            res[key] = "skipped: time"
            continue
        off = decode_twice(ex, prompts, tokens)
        res[key] = off
        log(f"  graphed {key}: { ({k: v for k, v in off.items() if k != 'outputs'}) }")
        refs = {tuple(p): o for p, o in zip(prompts, off["outputs"], strict=True)}
        for p in ps:
            key = f"{lanes}lane_p{p:g}"
            if budget.left() < 15:
                res[key] = "skipped: time"
                continue

            def mk(p: float = p, refs: dict = refs) -> Any:
                return right_with_probability(refs, p, vocab_size=vocab, seed=11)

            on = decode_twice(ex, prompts, tokens, mk)
            same = sum(a == b for a, b in zip(on["outputs"], off["outputs"], strict=True))
            on["expected_tokens_per_round"] = round((1 - p**8) / (1 - p), 3)
            on["outputs_equal_to_off"] = f"{same}/{lanes}"
            res[key] = on
            log(f"  graphed {key}: { ({k: v for k, v in on.items() if k != 'outputs'}) }")
    for v in res.values():
        if isinstance(v, dict):
            v.pop("outputs", None)
    return res


# ------------------------------------------------------------------------------------------ decode


def decode(ex: Any, prompts: list[list[int]], tokens: int, drafter: Any = None) -> dict:
    dev = ex.device
    eng = SpeculativeEngine(ex, drafter, draft_tokens=7 if drafter is not None else None)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    ids = [eng.add_lane(p, params) for p in prompts]
    sync(dev)
    t0 = time.perf_counter()
    first = eng.step()  # prefill + the first round
    sync(dev)
    t1 = time.perf_counter()
    first_tokens = sum(len(u.new_token_ids) for u in first)
    while eng.has_unfinished:
        eng.step()
    sync(dev)
    t2 = time.perf_counter()
    results = [eng.pop_result(i) for i in ids]
    total = sum(len(r.output_token_ids) for r in results)
    rounds = sum(r.num_rounds for r in results)
    out = {
        "lanes": len(prompts),
        "tokens": total,
        "wall_s": round(t2 - t0, 3),
        "tok_s": round(total / (t2 - t0), 2),
        "prefill_and_first_round_s": round(t1 - t0, 3),
        "rounds_per_lane": round(rounds / len(results), 2),
        # the prefill emits each lane's first token; every later token came from a round
        "tokens_per_round": round((total - len(results)) / max(rounds, 1), 3),
    }
    if t2 > t1:
        out["decode_tok_s"] = round((total - first_tokens) / max(t2 - t1, 1e-9), 2)
    out["outputs"] = [list(r.output_token_ids) for r in results]
    return out


def decode_suite(
    ex: Any,
    prompts8: list[list[int]],
    tokens: int,
    vocab: int,
    budget: Budget,
    tag: str,
    ps: tuple[float, ...],
    lanes_list: tuple[int, ...] = (1, 8),
    need_s: float = 20.0,
) -> dict:
    res: dict[str, Any] = {}
    for lanes in lanes_list:
        prompts = prompts8[:lanes]
        key = f"{lanes}lane_off"
        if budget.left() < need_s:
            res[key] = "skipped: time"
            continue
        off = decode(ex, prompts, tokens)
        res[key] = off
        log(f"  {tag} {key}: { ({k: v for k, v in off.items() if k != 'outputs'}) }")
        refs = {tuple(p): o for p, o in zip(prompts, off["outputs"], strict=True)}
        for p in ps:
            key = f"{lanes}lane_p{p:g}"
            if budget.left() < need_s:
                res[key] = "skipped: time"
                continue
            drafter = right_with_probability(refs, p, vocab_size=vocab, seed=11)
            on = decode(ex, prompts, tokens, drafter)
            same = sum(a == b for a, b in zip(on["outputs"], off["outputs"], strict=True))
            on["expected_tokens_per_round"] = round((1 - p**8) / (1 - p), 3)
            on["outputs_equal_to_off"] = f"{same}/{lanes}"
            res[key] = on
            log(f"  {tag} {key}: { ({k: v for k, v in on.items() if k != 'outputs'}) }")
    for v in res.values():
        if isinstance(v, dict):
            v.pop("outputs", None)
    return res


# ------------------------------------------------------------------------------------------ HF


def hf_bench(
    raw: dict,
    weights: dict[str, torch.Tensor],
    dev: torch.device,
    prompts8: list[list[int]],
    tokens: int,
    budget: Budget,
) -> dict:
    import transformers
    from transformers import Qwen3_5ForCausalLM
    from transformers import Qwen3_5TextConfig as HFConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    res: dict[str, Any] = {"transformers": transformers.__version__}
    kw = {k: v for k, v in raw.items() if k != "model_type"}
    hcfg = HFConfig(**kw)
    hcfg.use_cache = True
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(hcfg)
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    res["missing"] = list(missing)[:8]
    res["unexpected"] = list(unexpected)[:8]
    model.model.rotary_emb = mq.Qwen3_5TextRotaryEmbedding(config=hcfg).to(dev)
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if still_meta:
        raise RuntimeError(f"HF model has meta tensors left: {still_meta[:8]}")
    model.eval()
    res["fast_path"] = bool(getattr(mq, "is_fast_path_available", False))
    for lanes in (1, 8):
        if budget.left() < 25:
            res[f"{lanes}lane"] = "skipped: time"
            continue
        ids = torch.tensor(prompts8[:lanes], device=dev)
        kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
            sync(dev)
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            sync(dev)
            t_prefill = time.perf_counter() - t
            t = time.perf_counter()
            out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
            sync(dev)
            wall = time.perf_counter() - t
        n = int(out.shape[1] - ids.shape[1]) * lanes
        dec = max(wall - t_prefill, 1e-9)
        res[f"{lanes}lane"] = {
            "tokens": n,
            "wall_s": round(wall, 3),
            "tok_s": round(n / wall, 2),
            "decode_tok_s": round((n - lanes) / dec, 2),
            "prefill_s": round(t_prefill, 3),
        }
        log(f"  HF {lanes}lane: {res[f'{lanes}lane']}")
    del model
    return res


# ------------------------------------------------------------------------------------------ main


class _Skip(Exception):
    pass


def fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.2f}"
    return str(x) if x is not None else "-"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (plumbing check)")
    ap.add_argument("--mods", type=Path, default=None, help="folder with q4_e2e_sm90.so + manifest.json")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--budget-s", type=float, default=280.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hf-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument(
        "--graphs-only",
        action="store_true",
        help="graphed phase, eager rounds per width and the linears' kernel time only "
        "(no eager decode, no bf16 route, no HF)",
    )
    ap.add_argument("--no-graphs", action="store_true", help="skip the graphed phase")
    ap.add_argument(
        "--gdn-module",
        type=Path,
        default=None,
        help="fused GDN recurrence .so (build_gdn_recurrent): graphed rounds per width with and "
        "without it, the layer alone, decode with it",
    )
    ap.add_argument(
        "--norms-module",
        type=Path,
        default=None,
        help="fused norms .so (build_fused_norms): graphed rounds per width with every fused module",
    )
    ap.add_argument(
        "--mixers-module",
        type=Path,
        default=None,
        help="fused mixers .so (build_fused_mixers): graphed rounds per width with every given fused "
        "module plus the mixers; the graphed decode uses it too",
    )
    ap.add_argument("--widths", default=None, help="comma-separated round widths (default 1..8,16,32)")
    ap.add_argument(
        "--fused-only",
        action="store_true",
        help="with --gdn-module: skip the graphed rounds without the kernel",
    )
    ap.add_argument("--no-decode", action="store_true", help="skip the graphed decode")
    ap.add_argument(
        "--context",
        type=int,
        default=PROMPT_LEN,
        help=f"tokens committed before the graphed rounds per width and --profile-round (default "
        f"{PROMPT_LEN}): the KV length their attention reads",
    )
    ap.add_argument(
        "--profile-round",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[],
        help="with --mixers-module: comma-separated widths whose graphed round is also run under "
        "torch.profiler (kernel time by name)",
    )
    ap.add_argument(
        "--gdn-record",
        action="store_true",
        help="with --gdn-module: run its record round (the state after every column written, commit "
        "copies it out) even when the module has the stash round and the replay (A/B)",
    )
    ap.add_argument("--no-eager-rounds", action="store_true", help="skip the eager rounds per width")
    ap.add_argument(
        "--no-eager",
        action="store_true",
        help="no eager phases at all: the Q4 route only graphed (plus its linears' kernel time), the bf16 "
        "(cuBLAS) route as graphed rounds per width with the given fused modules, then HF",
    )
    args = ap.parse_args()
    if args.context < 1:
        ap.error("--context must be >= 1")
    if args.gdn_record and args.gdn_module is None:
        ap.error("--gdn-record needs --gdn-module")
    global ROUND_CONTEXT
    ROUND_CONTEXT = args.context
    budget = Budget(args.budget_s)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    raw = TINY if args.tiny else FULL
    cfg = Qwen3_5TextConfig.from_hf(raw)
    widths = WIDTHS if not args.tiny else (1, 4, 8)
    if args.widths:
        widths = tuple(int(w) for w in args.widths.split(","))
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": raw,
        "argv": sys.argv,
        "round_context": ROUND_CONTEXT,  # tokens committed before the timed graphed rounds (--context)
        "not_done": [],
    }
    out_path = args.out / "bench_e2e_gpu.json"
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out_path.write_text(json.dumps(res, indent=1, default=str))

    if args.gdn_module is not None and dev.type == "cuda":
        from ignis.runtime.kernels.gdn_recurrent import GdnRecurrentKernel

        kernel = GdnRecurrentKernel(args.gdn_module)
        if args.gdn_record:  # the record round only: the function without the stash round and replay
            kernel = GdnRecurrentKernel(kernel.func)
        res["gdn_path"] = "replay" if kernel.has_replay else "record"
        res["gdn_module_file"] = str(args.gdn_module)
        log(f"GDN recurrence: the {res['gdn_path']} path ({args.gdn_module})")
        args.gdn_module = kernel

    vocab = cfg.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts8 = [torch.randint(0, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(8)]
    tokens = args.tokens if not args.tiny else 12
    ps = (0.74, 0.885)

    # ---------------------------------------------------------------- phase 1+2: Q4 compiled
    t = time.perf_counter()
    weights, q4_bytes = make_weights(cfg, dev, seed=1)
    sync(dev)
    res["weights_gen_s"] = round(time.perf_counter() - t, 2)
    res["q4_bytes"] = q4_bytes
    res["floor_ms"] = q4_bytes / BW * 1e3
    res["bf16_linear_bytes"] = sum(
        w.out_features * w.in_features * 2 for w in weights.values() if isinstance(w, Q4Weight)
    )
    res["bf16_floor_ms"] = res["bf16_linear_bytes"] / BW * 1e3
    log(f"weights: Q4 {q4_bytes / 1e9:.2f} GB (floor {res['floor_ms']} ms), gen {res['weights_gen_s']} s")
    try:
        compiled = load_compiled(args.mods) if (args.mods and dev.type == "cuda") else None
    except Exception as exc:
        res["modules_error"] = f"{type(exc).__name__}: {exc}"
        log(f"modules NOT loaded: {res['modules_error']}")
        compiled = None
    res["compiled_functions"] = len(compiled) if compiled is not None else 0
    backend = LinearBackend(compiled)
    # the layout the modules take, once (tiled for "q4_g32_tiled" functions), so that the executors
    # built below share these weights instead of each re-laying its own copy
    # (not the members of the executor's own fusions, which it stacks row-major and then places)
    family = get_family(cfg.model_type)
    weights = {
        n: w if family.is_fused_member(n) else place_weight(backend, w, row_splits=row_splits_of(n))
        for n, w in weights.items()
    }
    gr: dict[str, Any] = {}
    if not args.no_graphs:
        try:
            ctx = max(PROMPT_LEN, ROUND_CONTEXT) + 2 * tokens + 64
            ref = HybridExecutor(cfg, weights, device=dev, dtype=torch.bfloat16, linear=backend)
            if args.fused_only:
                res["not_done"].append("graphed rounds without the fused GDN kernel (--fused-only)")
            else:
                wide = StaticHybridExecutor(
                    cfg, weights, device=dev, dtype=torch.bfloat16, linear=backend,
                    max_lanes=1, max_columns=max(widths), column_widths=widths, max_context=ctx,
                )  # fmt: skip
                gr["cuda_graphs"] = wide.cuda_graphs
                log(f"graphed route (cuda_graphs={wide.cuda_graphs}): rounds per width")
                gr["rounds"] = bench_graph_rounds(wide, ref, dev, widths, args.reps, vocab)
                gr["captures_rounds"] = wide.num_captures
                save()
                del wide
                gc.collect()
            if args.gdn_module is not None:
                fused = StaticHybridExecutor(
                    cfg, weights, device=dev, dtype=torch.bfloat16, linear=backend,
                    max_lanes=1, max_columns=max(widths), column_widths=widths, max_context=ctx,
                    gdn_module=args.gdn_module,
                )  # fmt: skip
                gr["gdn_module"] = res.get("gdn_module_file", str(args.gdn_module))
                log("graphed route with the fused GDN recurrence: rounds per width")
                gr["rounds_fused"] = bench_graph_rounds(fused, ref, dev, widths, args.reps, vocab)
                save()
                log("one GDN layer: torch loop vs the fused kernel")
                gr["gdn_layer"] = bench_gdn_layer(cfg, dev, fused.gdn_module, args.reps)
                save()
                del fused
                gc.collect()
            if args.norms_module is not None:
                allf = StaticHybridExecutor(
                    cfg, weights, device=dev, dtype=torch.bfloat16, linear=backend,
                    max_lanes=1, max_columns=max(widths), column_widths=widths, max_context=ctx,
                    gdn_module=args.gdn_module,
                    norms_module=args.norms_module,
                )  # fmt: skip
                gr["norms_module"] = str(args.norms_module)
                log("graphed route with every fused module (GDN recurrence + norms): rounds per width")
                gr["rounds_all_fused"] = bench_graph_rounds(allf, ref, dev, widths, args.reps, vocab)
                save()
                del allf
                gc.collect()
            if args.mixers_module is not None:
                mixf = StaticHybridExecutor(
                    cfg, weights, device=dev, dtype=torch.bfloat16, linear=backend,
                    max_lanes=1, max_columns=max(widths), column_widths=widths, max_context=ctx,
                    gdn_module=args.gdn_module,
                    norms_module=args.norms_module, mixers_module=args.mixers_module,
                )  # fmt: skip
                gr["mixers_module"] = str(args.mixers_module)
                log("graphed route with every given fused module + the mixers: rounds per width")
                gr["rounds_mixers"] = bench_graph_rounds(mixf, ref, dev, widths, args.reps, vocab)
                save()
                for r in args.profile_round:
                    log(f"graphed round of {r} columns under torch.profiler: kernel time by name")
                    prof = profile_round(mixf, dev, r, vocab)
                    gr[f"profile_r{r}"] = prof
                    log(f"  {prof['us_per_round']} us of kernels in {prof['launches_per_round']} launches")
                    for row in prof["kernels"][:25]:
                        log(f"  {row['us']:9.1f} us {row['calls']:6.1f}x  {row['name'][:100]}")
                    save()
                del mixf
                gc.collect()
            if args.no_decode:
                res["not_done"].append("graphed decode (--no-decode)")
            else:
                lanes8 = StaticHybridExecutor(
                    cfg, weights, device=dev, dtype=torch.bfloat16, linear=backend,
                    max_lanes=8, max_columns=8, max_context=ctx, gdn_module=args.gdn_module,
                    norms_module=args.norms_module, mixers_module=args.mixers_module,
                    chunked_prefill=CHUNKED_PREFILL_ROUNDS * 8,  # the CUDA default; on in --tiny too
                )  # fmt: skip
                gr["decode_fused"] = args.gdn_module is not None
                gr["decode_fused_norms"] = args.norms_module is not None
                gr["decode_fused_mixers"] = args.mixers_module is not None
                log(
                    f"graphed route: decode (fused GDN: {gr['decode_fused']}, norms: "
                    f"{gr['decode_fused_norms']}, mixers: {gr['decode_fused_mixers']})"
                )
                if budget.left() > 30:
                    log("graphed route: prefill of the 16-token prompts (chunked static rounds vs eager)")
                    gr["prefill"] = bench_prefill(lanes8, prompts8, dev, args.reps)
                    log("graphed route: rounds per (lanes, columns)")
                    gr["lane_rounds"] = bench_lane_rounds(lanes8, prompts8, dev, args.reps)
                else:
                    res["not_done"].append("graphed prefill and lane rounds (time)")
                gr["decode"] = graphed_decode_suite(lanes8, prompts8, tokens, vocab, budget, ps)
                gr["captures_decode"] = lanes8.num_captures
                gr["replays_decode"] = lanes8.num_replays
                del lanes8
            if dev.type == "cuda":
                gr["max_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
            del ref
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        except Exception as exc:
            gr["error"] = traceback.format_exc()[-3000:]
            log(f"graphed phase failed: {exc}")
        res["graphs"] = gr
        save()
    q4 = {}
    try:
        ex = HybridExecutor(cfg, weights, device=dev, dtype=torch.bfloat16, linear=backend)
        if args.no_eager:
            args.no_eager_rounds = True
        if args.graphs_only or args.no_eager:
            res["not_done"].append("q4 eager linears (--graphs-only / --no-eager)")
        else:
            log("Q4 route: linears per width")
            q4["linears"] = bench_linears(ex, dev, widths, args.reps, graph=False)
            q4["route_counts_after_linears"] = dict(backend.counts)
            save()
        if args.no_eager_rounds:
            res["not_done"].append("q4 eager rounds (--no-eager-rounds)")
        else:
            log("Q4 route: rounds per width")
            q4["rounds"] = bench_rounds(ex, dev, widths, args.reps, vocab)
        res["q4"] = q4
        save()
        if args.graphs_only or args.no_eager:
            res["not_done"].append("q4 eager decode (--graphs-only / --no-eager)")
        else:
            log("Q4 route: decode")
            q4["decode"] = decode_suite(ex, prompts8, tokens, vocab, budget, "q4", ps)
        q4["route_counts"] = dict(backend.counts)
        save()
        if (
            dev.type == "cuda" and budget.left() > 60
        ):  # last in this phase: a failed capture can't spoil the rest
            log("Q4 route: linears per width from a CUDA graph (kernel time)")
            for k, v in bench_linears(ex, dev, widths, args.reps, graph=True, eager=False).items():
                q4.setdefault("linears", {}).setdefault(k, {}).update(v)
        else:
            res["not_done"].append("q4 linears graph replay")
        if dev.type == "cuda":
            q4["max_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    except Exception as exc:
        q4["error"] = traceback.format_exc()[-3000:]
        log(f"Q4 phase failed: {exc}")
    res["q4"] = q4
    save()

    # ---------------------------------------------------------------- phase 3: bf16 + HF
    bf: dict[str, Any] = {}
    dense: dict[str, torch.Tensor] = {}
    if args.graphs_only:
        res["not_done"] += ["bf16 route (--graphs-only)", "HF (--graphs-only)"]
        args.no_hf = True
    try:
        if args.graphs_only:
            raise _Skip
        ex = None
        gc.collect()
        dense = dense_from_q4(weights)
        del weights
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        ex = HybridExecutor(cfg, dense, device=dev, dtype=torch.bfloat16)
        if args.no_eager:
            ctx_b = max(PROMPT_LEN, ROUND_CONTEXT) + 2 * tokens + 64
            gb = StaticHybridExecutor(
                cfg, dense, device=dev, dtype=torch.bfloat16,
                max_lanes=1, max_columns=max(widths), column_widths=widths, max_context=ctx_b,
                    gdn_module=args.gdn_module,
                norms_module=args.norms_module, mixers_module=args.mixers_module,
            )  # fmt: skip
            log("bf16 route (cuBLAS), graphed with the given fused modules: rounds per width")
            bf["graphed_rounds"] = bench_graph_rounds(gb, ex, dev, widths, args.reps, vocab)
            save()
            del gb
            ex = None
            gc.collect()
            raise _Skip
        if budget.left() > 40:
            log("bf16 route: linears per width")
            bf["linears"] = bench_linears(ex, dev, widths, args.reps, graph=False)
            log("bf16 route: rounds per width")
            bf["rounds"] = bench_rounds(ex, dev, widths, args.reps, vocab)
            save()
        else:
            res["not_done"].append("bf16 rounds (time)")
        log("bf16 route: decode")
        bf["decode"] = decode_suite(ex, prompts8, tokens, vocab, budget, "bf16", (0.885,), need_s=45)
        ex = None
    except _Skip:
        pass
    except Exception as exc:
        bf["error"] = traceback.format_exc()[-3000:]
        log(f"bf16 phase failed: {exc}")
    res["bf16"] = bf
    save()
    if args.no_hf:
        if not args.graphs_only:
            res["not_done"].append("HF (--no-hf)")
    elif budget.left() < 30:
        res["not_done"].append("HF (time)")
    else:
        try:
            gc.collect()
            log("HF transformers")
            res["hf"] = hf_bench(raw, dense, dev, prompts8, args.hf_tokens if not args.tiny else 6, budget)
        except Exception as exc:
            res["hf"] = {"error": traceback.format_exc()[-3000:]}
            log(f"HF phase failed: {exc}")
    res["elapsed_s"] = round(time.perf_counter() - T0, 1)
    save()

    # ---------------------------------------------------------------- table
    floor = res["floor_ms"]
    print(
        f"\n== {res['device']} | Q4 {q4_bytes / 1e9:.2f} GB, floor {floor:.3f} ms/round @4.2 TB/s | "
        f"bf16 floor {res['bf16_floor_ms']:.3f} ms =="
    )
    print(
        "| R | q4 linears eager ms | q4 linears graph ms | q4 round ms | round / floor "
        "| q4 graphed round ms | graphed / floor | fused-GDN graphed round ms | bf16 linears ms "
        "| bf16 round ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ql, qr = q4.get("linears", {}), q4.get("rounds", {})
    bl, br = bf.get("linears", {}), bf.get("rounds", {})
    grr = gr.get("rounds", {})
    grf = gr.get("rounds_fused", {})
    for r in widths:
        k = str(r)
        rr = qr.get(k)
        gms = grr.get(k, {}).get("graph_ms")
        q, b = ql.get(k, {}), bl.get(k, {})
        ratio = fmt(rr / floor) if rr and floor else "-"
        gratio = fmt(gms / floor) if gms and floor else "-"
        print(
            f"| {r} | {fmt(q.get('eager_ms'))} | {fmt(q.get('graph_ms'))} | {fmt(rr)} | {ratio} "
            f"| {fmt(gms)} | {gratio} | {fmt(grf.get(k, {}).get('graph_ms'))} "
            f"| {fmt(b.get('eager_ms'))} | {fmt(br.get(k))} |"
        )
    gra = gr.get("rounds_all_fused", {})
    if gra:
        print("\n| R | graphed round ms (no kernels) | + fused GDN | + fused norms (all) | saved vs GDN-only "
              "| all / floor | argmax vs eager |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for r in widths:
            k = str(r)
            a = gra.get(k, {}).get("graph_ms")
            f = grf.get(k, {}).get("graph_ms")
            saved = fmt(f - a) if a and f else "-"
            am = gra.get(k, {}).get("argmax_equal_vs_eager")
            print(
                f"| {r} | {fmt(grr.get(k, {}).get('graph_ms'))} | {fmt(f)} | {fmt(a)} | {saved} "
                f"| {fmt(a / floor) if a and floor else '-'} | {am} |"
            )
    grm = gr.get("rounds_mixers", {})
    if grm:
        print(
            "\n| R | previous all-fused round ms | + fused mixers ms | saved | mixers / floor "
            "| argmax vs eager |"
        )
        print("|---|---|---|---|---|---|")
        for r in widths:
            k = str(r)
            m = grm.get(k, {}).get("graph_ms")
            a = (gra or grf).get(k, {}).get("graph_ms")
            am = grm.get(k, {}).get("argmax_equal_vs_eager")
            saved = fmt(a - m) if a and m else "-"
            print(
                f"| {r} | {fmt(a)} | {fmt(m)} | {saved} | {fmt(m / floor) if m and floor else '-'} | {am} |"
            )
    bgr = bf.get("graphed_rounds", {})
    if bgr:
        bfloor = res["bf16_floor_ms"]
        print(
            "\n| R | bf16 (cuBLAS) graphed round ms | bf16 floor ms | round / bf16 floor | argmax vs eager |"
        )
        print("|---|---|---|---|---|")
        for r in widths:
            v = bgr.get(str(r), {})
            gms = v.get("graph_ms")
            ratio = fmt(gms / bfloor) if gms else "-"
            print(f"| {r} | {fmt(gms)} | {fmt(bfloor)} | {ratio} | {v.get('argmax_equal_vs_eager')} |")
    pf, lr = gr.get("prefill", {}), gr.get("lane_rounds", {})
    if pf:
        print(f"\n| prefill ({pf.get('prompt_len')} tokens) | graphed ms (chunked) | eager ms |")
        print("|---|---|---|")
        for lanes in (1, 8):
            g, e = pf.get(f"{lanes}lane_graphed_ms"), pf.get(f"{lanes}lane_eager_ms")
            print(f"| {lanes} lane(s) | {fmt(g)} | {fmt(e)} |")
    if lr:
        print("\n| graphed round, lanes x columns | " + " | ".join(lr) + " |")
        print("|---|" + "---|" * len(lr))
        print("| ms | " + " | ".join(fmt(v) for v in lr.values()) + " |")
    print("\n| route | run | tok/s | tokens/round | rounds/lane | wall s |")
    print("|---|---|---|---|---|---|")
    for route, d in (
        (
            "q4 graphed"
            + (" fused GDN" if gr.get("decode_fused") else "")
            + (" +norms" if gr.get("decode_fused_norms") else "")
            + (" +mixers" if gr.get("decode_fused_mixers") else ""),
            gr.get("decode", {}),
        ),
        ("q4", q4.get("decode", {})),
        ("bf16", bf.get("decode", {})),
    ):
        for key, v in d.items():
            if isinstance(v, dict):
                print(
                    f"| {route} | {key} | {v['tok_s']} (decode {v.get('decode_tok_s')}) "
                    f"| {v['tokens_per_round']} | {v['rounds_per_lane']} | {v['wall_s']} |"
                )
            else:
                print(f"| {route} | {key} | {v} | | | |")
    hf = res.get("hf", {})
    for key in ("1lane", "8lane"):
        v = hf.get(key)
        if isinstance(v, dict):
            print(f"| HF {hf.get('transformers')} | {key}_off | {v['tok_s']} | 1 | | {v['wall_s']} |")
        elif v:
            print(f"| HF | {key} | {v} | | | |")
    if "error" in hf:
        print("| HF | error | see json | | | |")
    print(
        f"\nroute counts (q4): {q4.get('route_counts')}; elapsed {res['elapsed_s']} s; "
        f"not done: {res['not_done']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
