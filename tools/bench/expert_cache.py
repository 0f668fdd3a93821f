"""Flash-Next on smaller cards: decode through the routed-expert cache at a card's memory (issue 22).

    python -m ignis.tools.bench.expert_cache [--cards 32,96] [--lanes 1,2,3,4,8]
        [--modes off,mtp,mtp-rows3] [--tokens 24] [--layers 48] [--baselines] [--mods DIR] [--out DIR]
        [--host pageable|pinned|mmap] [--mmap-dir DIR]
    python -m ignis.tools.bench.expert_cache --tiny        # CPU plumbing check at toy sizes

The model is Qwen3.5-122B-A10B-shaped (`qwen3_5_moe_text`: hidden 3,072; 48 layers, 3 Gated DeltaNet
: 1 gated attention; 32 query / 2 KV heads of 256; GDN 16 key / 64 value heads of 128; 256 experts,
8 a token, expert and shared-expert intermediate 1,024; vocabulary 248,320; one MTP layer) with
RANDOM weights: q4_g32 codes (random u32) + small f16 scales of random sign for every projection and
expert (the router, the shared-expert gate and GDN `in_proj_a/b` bf16), bf16 for the rest. Routed experts are
generated on the device layer by layer and moved to host memory (~65 GB at 48 layers: the GPU host has
128 GB). `--layers N` keeps the shape with N layers. Where the host experts live (`--host`):

* pageable (default): plain CPU tensors, the cache with `pin="off"`: every miss through the staging
  ring (a CPU memcpy into a pinned buffer, then a DMA), the path of a host where registration fails;
* pinned: `pin_memory` tensors: every miss one DMA (the upper bound: no registration needed);
* mmap: the experts written to a container in `--mmap-dir` (default /dev/shm; a disk directory measures
  a file not in tmpfs) and memory-mapped as the artifact is (`NinferReader`: private, copy-on-write),
  the cache with `pin="auto"`: registered as `ignis-run` registers them (`ignis.runtime.host_pin`),
  every miss one DMA from the page cache. The file takes the experts' size (60.7 GiB at 48 layers: more
  than the GPU host's /dev/shm or disk may hold; `--layers 24` halves it).

Each case's JSON has the copy path taken (`direct_copies` / `staged_copies`) and, for mmap, what the
registration cost (`pin_populate_s`, `pin_register_s`).

Per emulated card (`--cards`, GiB: the budget is what `plan_expert_cache` leaves of that card after
the resident weights, 8 lanes' KV at `--context`, the round workspace and the headroom; with MTP on,
the head's reserve comes out of the cache) and per mode:

* off: speculation off; off-async: speculation off with async rounds (`ignis.runtime.async_rounds`:
  what `ignis-run` serves on CUDA with speculation off; each round issued from the previous one's
  device argmax before the host reads it, so the host's work on round N overlaps round N+1's pieces
  after its last MoE layer's sync; rounds issued ahead reported as `async_issued`); mtp: the MTP
  head, 3 drafts, row budget 8; mtp-rows3: 3 drafts, row budget 3;

and per lane count: `--tokens` greedy tokens per lane through `SpeculativeEngine` (random prompts of
32 tokens, prefill excluded from the timing): measured tok/s (wall time over every round), the median
step (verify round) time, the median host time a round (`host_ms`: CPU time of the engine thread,
`time.thread_time`, which counts spin-waiting at the MoE layers' host syncs; `sync_wait_ms`: the wall
time of those waits a round, so host_ms - sync_wait_ms is the host's own work), tok/s without the
rounds that captured CUDA graphs of a new round shape (`tok_s_steady`, when any did), the miss copy path
(`copies`: the batched driver call or torch copies; `--copies torch` forces the latter), with
`--lookahead` the experts prefetched by router lookahead, its recall (the share of the experts a
layer needed that the previous layer's prediction named) and `hit_rate_lru_lookahead` (the trace
replayed with the recorded prefetches: equal to the measured rate, while `hit_rate_lru` is then what
LRU without lookahead gets on the same routing),
rounds, expert-cache hit rate, bytes copied per emitted token and per round, the routing's spread
(distinct experts per layer forward and per layer over the decode) and the hit rates the decode's
routing trace would get under LRU (a check: equal to the measured rate), LFU and Belady's offline
optimum, replayed from the cache's state at the decode's start (`simulate_policy`: Belady is the
bound on any smarter policy, router lookahead included) at the same slots. Random weights route
nearly uniformly (a trained router has locality: real hit rates are higher) and a random MTP head is
almost never accepted, so for MTP the table also gives the projected tok/s = lanes x E[tokens per
lane-round] / median round time, with E from the documented acceptance (`--accept`, default 0.815:
80-83 % of the first four drafts) and the drafts the row budget allows each lane.

The MTP head (`--mtp-head`, default static): the pooled head the server builds on CUDA
(`ignis.runtime.drafters.mtp_static.StaticMTPDrafter`: CUDA graphs when every routed expert of its
MoE layer is resident and the grouped kernels run it), its graphs captured before the decode as at
the server's load; `eager` builds `MTPDrafter`. Each MTP case reports the drafter's time a round
(``drafter_ms``: its `propose` and `commit` calls, each synced before and after, so the round time
includes those syncs; ``propose_ms`` and ``commit_ms`` apart) beside the round's.

`--baselines`: the same decode with every expert resident (fits the H200) and with no cache (every
expert copied on demand each round: the slots are flushed after every forward). The host-to-device
bandwidth is measured in the same run: one 1 GiB copy from pinned and from pageable memory, and the
expert cache's own copier moving 1 GiB in one-expert parts through each of its paths (`copier_rates`:
the staging ring from pageable memory, direct from pinned memory, direct from a registered memory map
in `--mmap-dir`, with what registering that map cost per GiB; and for page-locked sources the
batched driver copy, 32 parts a call: `copier_batched_*_GBps` and the host microseconds a call takes
to issue).

Linears: with `--mods` (a bundle from ``python -m ignis.tools.bench.build_gpu_modules --out DIR
--shapes flash-next``, which serves every linear shape of this model) through its compiled tiled
functions (resident weights and the cache's slots in the tiled layout), else torch (dequantize +
GEMM): the figures then show the cache's copy traffic and hit rates faithfully but not the kernels'
speed. The routed experts: with the bundle's ``moe_experts_sm<NN>.so`` the grouped MoE block
(`ignis.runtime.families.moe_grouped`: two grouped launches a layer over row-major q4 stacks, one
host sync a layer with a cache, none resident); `--moe-loop` (or no such file) keeps the reference
loop of `sparse_moe_block` (one tiled linear per routed expert, host syncs per expert).

A full run (2 cards x 3 modes x 5 lane counts, baselines) takes longer than one 10-minute device
command: split it, e.g. ``--cards 32 --modes off,mtp --lanes 1,2,4``.

Prints a table last; writes ``bench_expert_cache.json`` into `--out` (default $OUT or .).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import mmap
import os
import re
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ignis.formats.reader import NinferReader
from ignis.formats.writer import NinferWriter
from ignis.runtime.drafters.mtp import build_mtp_drafter
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.expert_cache import (
    POLICIES,
    ExpertCache,
    _Copier,
    is_routed_expert,
    lane_state_bytes,
    plan_expert_cache,
    round_workspace_bytes,
    simulate_policy,
)
from ignis.runtime.families.hybrid_executor import HybridExecutor
from ignis.runtime.families.qwen3_5 import Qwen3_5MoeTextConfig, mtp_tensor_shapes, tensor_shapes
from ignis.runtime.host_breakdown import HostBreakdown
from ignis.runtime.host_pin import HostPin
from ignis.runtime.linear import Q4Weight
from ignis.runtime.sampling import SamplingParams
from ignis.tools.bench.e2e_gpu import random_dense

GIB = 1024**3
_PRECISE = re.compile(r"(in_proj_(a|b|ba)\.weight|mlp\.gate\.weight|shared_expert_gate\.weight)$")
_LINEAR = re.compile(r"(proj[A-Za-z0-9_]*(\.weight)?|lm_head\.weight|mtp\.fc\.weight)$")


def issue_config(layers: int = 48, *, tiny: bool = False) -> Qwen3_5MoeTextConfig:
    """The issue's shape with `layers` layers (every 4th full attention), or a toy one (`tiny`)."""
    types = tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers))
    if tiny:
        return Qwen3_5MoeTextConfig(
            vocab_size=512, hidden_size=128, num_hidden_layers=layers, layer_types=types,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=16,
            num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            max_position_embeddings=4096,
        )  # fmt: skip
    return Qwen3_5MoeTextConfig(
        vocab_size=248320, hidden_size=3072, num_hidden_layers=layers, layer_types=types,
        num_attention_heads=32, num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=64, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
        max_position_embeddings=262144, rope_theta=10_000_000.0,
    )  # fmt: skip


def _q4(shape: tuple[int, ...], dev: torch.device, gen: torch.Generator) -> Q4Weight:
    *lead, n, k = shape
    packed = torch.randint(
        -(2**31), 2**31 - 1, (*lead, n, k // 8), generator=gen, device=dev, dtype=torch.int32
    ).view(torch.uint32)
    # signed scales (as llama.cpp's Q4_0 has: d = max / -8): codes uniform on 0..15 give q - 8 a mean
    # of -1/2, which with positive scales adds the same direction to every row's output; through 48
    # layers that common mode swamps the tokens' own features and the router sends every token to the
    # same few experts (measured: 8-16 distinct experts a layer over 12 tokens)
    mag = torch.rand(*lead, n, k // 32, generator=gen, device=dev) * (2 / (7 * math.sqrt(k)))
    sign = torch.randint(0, 2, mag.shape, generator=gen, device=dev) * 2 - 1
    return Q4Weight(packed, (mag * sign).half())


def make_weights(shapes: dict[str, tuple[int, ...]], dev: torch.device, seed: int) -> dict[str, Any]:
    """Random weights (module docstring) on `dev`; routed experts moved to host memory."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    out: dict[str, Any] = {}
    for name, shape in shapes.items():
        quantize = len(shape) >= 2 and shape[-1] % 32 == 0 and not _PRECISE.search(name)
        if quantize and _LINEAR.search(name):
            w = _q4(shape, dev, gen)
            out[name] = w.to("cpu") if is_routed_expert(name) else w
            continue
        out[name] = random_dense(name, shape, dev, gen)
    return out


def static_kernels(mods: Path | None, dev: torch.device) -> dict[str, Any]:
    """The fused GDN / norms / mixers libraries of a `build_gpu_modules` bundle, as
    `StaticHybridExecutor` arguments (those present for this device's arch)."""
    if mods is None or dev.type != "cuda":
        return {}
    from ignis.tools.bench.build_gpu_modules import bundle_library

    out: dict[str, Any] = {}
    for arg, stem in (
        ("gdn_module", "gdn_recurrent"),
        ("norms_module", "fused_norms"),
        ("mixers_module", "fused_mixers"),
    ):
        path = bundle_library(mods, stem, dev)
        if path.exists():
            out[arg] = path
    return out


def nbytes(w: Any) -> int:
    if isinstance(w, Q4Weight):
        return w.packed.numel() * 4 + w.scales.numel() * 2
    return int(w.numel() * w.element_size())


def bandwidth(dev: torch.device, size: int = GIB) -> dict[str, float]:
    """Host-to-device GB/s (pinned and pageable) of one `size`-byte copy, best of 3."""
    if dev.type != "cuda":
        return {}
    out = {}
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    for kind, src in (
        ("pinned", torch.empty(size, dtype=torch.uint8, pin_memory=True)),
        ("pageable", torch.empty(size, dtype=torch.uint8)),
    ):
        src.fill_(1)
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=kind == "pinned")
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[f"h2d_{kind}_GBps"] = round(size / best / 1e9, 2)
    return out


def _private_map(path: Path, nbytes: int) -> torch.Tensor:
    """`nbytes` of a new file at `path` (filled), mapped private copy-on-write as `NinferReader` maps an
    artifact: a uint8 CPU tensor over the mapping."""
    with open(path, "wb") as f:
        chunk = bytes(range(256)) * (2**20 // 256)
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)
    return torch.from_numpy(np.frombuffer(mm, dtype=np.uint8, count=nbytes))


def copier_rates(dev: torch.device, mmap_dir: Path, part: int = 5 * 2**20, size: int = GIB) -> dict[str, Any]:
    """GB/s of the expert cache's copier (`_Copier.copy`, one `part`-byte expert a call, `size` bytes in
    all, best of 3) from pageable memory (`pin="off"`: the staging ring), pinned memory and a private
    memory map registered by `HostPin` as the runtime registers the artifact. Keys name the path taken
    (`copier_direct_mmap_GBps`, or `copier_staged_mmap_GBps` with `mmap_pin_reason` when registration
    was refused), plus that registration's populate and pin seconds per GiB."""
    if dev.type != "cuda":
        return {}
    n = size // part
    dst = torch.empty(n, part, dtype=torch.uint8, device=dev)
    out: dict[str, Any] = {}
    path = mmap_dir / f"ignis-bench-copier-{os.getpid()}.bin"
    sources: list[tuple[str, Any]] = [
        ("pageable", lambda: (torch.ones(n * part, dtype=torch.uint8), "off")),
        ("pinned", lambda: (torch.ones(n * part, dtype=torch.uint8, pin_memory=True), "auto")),
    ]
    if shutil.disk_usage(mmap_dir).free > n * part + GIB:
        sources.append(("mmap", lambda: (_private_map(path, n * part), "auto")))
    else:
        out["mmap_pin_reason"] = f"{mmap_dir}: not enough free space for {size / GIB:.1f} GiB"
    try:
        for kind, make in sources:
            flat, mode = make()
            pin = HostPin(dev, mode)
            src = pin.adopt([flat[i * part : (i + 1) * part] for i in range(n)])
            how = "direct" if all(pin.covers(t) for t in src) else "staged"
            copier = _Copier(dev, part, pin=pin)
            best = float("inf")
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(n):
                    copier.copy([dst[i]], [src[i]])
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            out[f"copier_{how}_{kind}_GBps"] = round(n * part / best / 1e9, 2)
            if how == "direct":  # the batched path (ADR 0013): 32 parts a driver call
                out |= _batched_rate(kind, src, dst, dev)
            if kind == "mmap":
                gib = n * part / GIB
                out["mmap_populate_s_per_GiB"] = round(pin.populate_seconds / gib, 3)
                out["mmap_register_s_per_GiB"] = round(pin.register_seconds / gib, 3)
                if pin.reason:
                    out["mmap_pin_reason"] = pin.reason
            pin.close()
            del src, flat, copier
    finally:
        path.unlink(missing_ok=True)
    return out


def _batched_rate(kind: str, src: list[torch.Tensor], dst: torch.Tensor, dev: torch.device) -> dict[str, Any]:
    """GB/s of `src` (page-locked parts) into the rows of `dst` through the batched driver copy, 32
    parts a call on a side stream (best of 3), and the host microseconds a call took to issue."""
    from ignis.runtime.expert_transfer import PartTable, driver_batch_copy

    dma = driver_batch_copy()
    if dma is None:
        return {}
    table = PartTable([[t] for t in src], [[dst[i]] for i in range(len(src))])
    stream = torch.cuda.Stream(device=dev)
    idx = list(range(len(src)))
    calls = [table.gather(idx[i : i + 32], idx[i : i + 32]) for i in range(0, len(idx), 32)]
    best = issue = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, s_, z in calls:
            dma.copy(d, s_, z, stream.cuda_stream)
        t1 = time.perf_counter()
        stream.synchronize()
        best, issue = min(best, time.perf_counter() - t0), min(issue, t1 - t0)
    total = sum(int(z.sum()) for _, _, z in calls)
    return {
        f"copier_batched_{kind}_GBps": round(total / best / 1e9, 2),
        f"copier_batched_{kind}_issue_us_per_call": round(issue / len(calls) * 1e6, 1),
        "copier_batched_call": dma.name,
    }


def host_experts_to(weights: dict[str, Any], host: str, mmap_dir: Path) -> tuple[Any, Path | None]:
    """Move the routed experts of `weights` (CPU `Q4Weight`s, in place) to `host` memory: "pageable"
    (unchanged), "pinned" (`pin_memory`) or "mmap" (written to a container in `mmap_dir`, one tensor
    at a time so the host never holds both, and replaced by views of its memory map). Returns the
    reader (mmap; close it after the run) and the file to delete, else (None, None)."""
    names = [n for n in weights if is_routed_expert(n)]
    if host == "pageable":
        return None, None
    if host == "pinned":
        for n in names:
            w = weights[n]
            weights[n] = Q4Weight(w.packed.pin_memory(), w.scales.pin_memory())
        return None, None
    path = mmap_dir / f"ignis-bench-experts-{os.getpid()}.ninfer"
    need = sum(nbytes(weights[n]) for n in names)
    free = shutil.disk_usage(mmap_dir).free
    if free < need + GIB:
        raise SystemExit(
            f"--host mmap: {mmap_dir} has {free / GIB:.1f} GiB free, the experts take {need / GIB:.1f} GiB "
            "(+1 GiB spare): give another --mmap-dir or fewer --layers"
        )
    with NinferWriter(path) as writer:
        for n in names:
            w = weights[n]
            writer.add_q4_g32(n, w.packed.numpy(), w.scales.numpy())
            weights[n] = None  # the pageable copy goes as its bytes reach the file
        writer.finish()
    reader = NinferReader(path)
    for n in names:
        weights[n] = Q4Weight(**reader.torch_parts(n))
    return reader, path


def expected_tokens(k: int, accept: float) -> float:
    """E[tokens a lane-round commits] with k drafts each accepted with probability `accept` in turn."""
    return sum(accept**i for i in range(k + 1))


def drafts_per_lane(lanes: int, k: int, rows: int) -> int:
    """The scheduler's rule for a row-budgeted drafter: min(k, rows // lanes - 1), at least 0."""
    return max(0, min(k, (rows or 8) // lanes - 1))


def _time_drafter(drafter: Any, spent: dict[str, float], sync: Any) -> None:
    """Wrap the drafter's `propose` and `commit` (on the instance) to add their wall time, each call
    synced before and after, to spent["propose"] / spent["commit"] (seconds)."""
    for name in ("propose", "commit"):
        call = getattr(type(drafter), name)

        def timed(arg: Any, _call: Any = call, _name: str = name) -> Any:
            sync()
            t0 = time.perf_counter()
            out = _call(drafter, arg)
            sync()
            spent[_name] += time.perf_counter() - t0
            return out

        setattr(drafter, name, timed)


def run_case(
    ex: HybridExecutor,
    drafter: Any,
    *,
    lanes: int,
    k: int,
    rows: int,
    tokens: int,
    vocab: int,
    cache: ExpertCache | None,
    flush: bool,
    seed: int,
    async_rounds: bool = False,
) -> dict[str, Any]:
    """Greedy decode of `lanes` random prompts; step times after the prefill; cache counters.
    `async_rounds`: the engine's async rounds (speculation off only)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (32,), generator=gen).tolist() for _ in range(lanes)]
    engine = SpeculativeEngine(
        ex,
        drafter,
        draft_tokens=k if drafter is not None else None,
        draft_rows=rows,
        async_rounds=async_rounds,
    )
    params = SamplingParams(temperature=0, max_tokens=tokens)
    for p in prompts:
        engine.add_lane(p, params)
    sync = torch.cuda.synchronize if ex.device.type == "cuda" else (lambda: None)
    spent = {"propose": 0.0, "commit": 0.0}
    if drafter is not None:  # the drafter's time a round: its propose and commit calls, synced
        _time_drafter(drafter, spent, sync)
    engine.step()  # the prefill and the first round (with async rounds: issued, read at the next step)
    # async rounds: the first timed step reads the round the prefill step issued (untimed): its tokens
    # are left out, so that tokens, bytes and routing cover the same rounds as without
    skip_first = engine.async_rounds is not None
    issued0 = engine.async_rounds.num_issued if engine.async_rounds is not None else 0
    if flush and cache is not None:
        cache.flush()
    # the routing trace runs from the cache's creation (main), so a policy replayed below starts the
    # decode from the state the real cache had: every earlier case's and this prefill's routing
    start = len(cache.stats.trace) if cache is not None and cache.stats.trace is not None else 0
    before = dict(cache.stats.snapshot()) if cache is not None else {}
    look0 = (cache.stats.lookahead_right, cache.stats.lookahead_needed) if cache is not None else (0, 0)
    emitted = steady_tokens = 0
    times: list[float] = []
    drafter_parts: dict[str, list[float]] = {"propose": [], "commit": []}
    cpu: list[float] = []  # the engine thread's CPU time a round (time.thread_time)
    captured: list[bool] = []  # rounds that captured CUDA graphs (a new round shape)
    routing = cache.layers[0].routing if cache is not None and cache.layers else None
    waited0 = routing.wait_seconds if routing is not None else 0.0
    timer = cache.breakdown if cache is not None else None
    if timer is not None:
        timer.reset()
    while engine.has_unfinished:
        sync()
        graphs = getattr(ex, "num_captures", 0)
        spent["propose"] = spent["commit"] = 0.0
        if timer is not None:
            timer.begin_round()
        t0, c0 = time.perf_counter(), time.thread_time()
        updates = engine.step()
        c1 = time.thread_time()
        if timer is not None:  # rounds that captured graphs are left out, as from tok_s_steady
            timer.end_round() if getattr(ex, "num_captures", 0) == graphs else timer.drop_round()
        sync()
        times.append(time.perf_counter() - t0)
        for part in drafter_parts:
            drafter_parts[part].append(spent[part])
        cpu.append(c1 - c0)
        captured.append(getattr(ex, "num_captures", 0) != graphs)
        got = 0 if skip_first else sum(len(u.new_token_ids) for u in updates)
        skip_first = False
        emitted += got
        steady_tokens += 0 if captured[-1] else got
        if flush and cache is not None:
            cache.flush()
    wall = sum(times)
    res: dict[str, Any] = {
        "lanes": lanes,
        # forwards timed (with async rounds the last step only reads the last round)
        "rounds": engine.async_rounds.num_issued - issued0 if engine.async_rounds is not None else len(times),
        "tokens": emitted,
        "tok_s": round(emitted / wall, 2) if wall else 0.0,
        "round_ms": round(statistics.median(times) * 1e3, 2) if times else 0.0,
        "host_ms": round(statistics.median(cpu) * 1e3, 2) if cpu else 0.0,
    }
    if engine.async_rounds is not None:  # rounds issued before the host read the previous one
        res["async_issued"] = engine.async_rounds.num_issued - issued0
    if drafter is not None and times:
        per_round = [p + c for p, c in zip(drafter_parts["propose"], drafter_parts["commit"], strict=True)]
        res |= {
            "drafter_ms": round(statistics.median(per_round) * 1e3, 2),
            "propose_ms": round(statistics.median(drafter_parts["propose"]) * 1e3, 2),
            "commit_ms": round(statistics.median(drafter_parts["commit"]) * 1e3, 2),
            "mtp_head": type(drafter).__name__,
            "mtp_graphs": bool(getattr(drafter, "cuda_graphs", False)),
        }
    steady = sum(t for t, c in zip(times, captured, strict=True) if not c)
    if any(captured):  # rounds of a new shape captured their graphs: tok/s without them too
        res["capture_rounds"] = sum(captured)
        res["tok_s_steady"] = round(steady_tokens / steady, 2) if steady else 0.0
    if routing is not None and times:
        # wall time the engine thread waited in the MoE layers' host syncs (spin-waiting counts as CPU
        # time in host_ms: host_ms - sync_wait_ms is the host's own work)
        res["sync_wait_ms"] = round((routing.wait_seconds - waited0) / len(times) * 1e3, 2)
    if timer is not None:
        res["breakdown"] = timer.report()
    if cache is not None:
        after = cache.stats.snapshot()
        needed = cache.stats.lookahead_needed - look0[1]
        if needed:  # router lookahead: the share of the needed experts it had predicted
            res["lookahead_recall"] = round((cache.stats.lookahead_right - look0[0]) / needed, 4)
        res |= {
            "direct_copies": after["direct_copies"] - before["direct_copies"],
            "staged_copies": after["staged_copies"] - before["staged_copies"],
            "copies": (
                getattr(cache.layers[0]._copier.dma, "name", "torch")
                if cache.layers and cache.layers[0].batched
                else "torch"
            ),
        }
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        copied = after["bytes_copied"] - before["bytes_copied"]
        res |= {
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
            "prefetches": after["prefetches"] - before["prefetches"],
            "MB_per_token": round(copied / max(emitted, 1) / 1e6, 2),
            "MB_per_round": round(copied / max(res["rounds"], 1) / 1e6, 2),
            "slots_in_use": after["slots_in_use"],
        }
        if cache.stats.trace is not None:
            trace = cache.stats.trace[start:]
            layers_seen = {layer for layer, _ in trace}
            # routing spread: distinct experts a layer's forward runs, and a layer's distinct experts
            # over the whole decode (a router that collapses shows few of either)
            res["experts_per_forward"] = round(statistics.mean(len(e) for _, e in trace), 2) if trace else 0.0
            per_layer = [len({x for l2, e in trace if l2 == layer for x in e}) for layer in layers_seen]
            res["experts_per_layer_run"] = round(statistics.mean(per_layer), 1) if per_layer else 0.0
            for policy in POLICIES:
                sim = simulate_policy(cache.stats.trace, cache.slots_per_layer, policy, warmup=start)
                total = sim["hits"] + sim["misses"]
                res[f"hit_rate_{policy}"] = round(sim["hits"] / total, 4) if total else 0.0
            if cache.stats.prefetch_trace:  # lookahead on: hit_rate_lru is what LRU alone would get;
                # replayed with the prefetches it is the run's own rate (a check)
                sim = simulate_policy(
                    cache.stats.trace, cache.slots_per_layer, "lru", warmup=start,
                    prefetch=cache.stats.prefetch_trace,
                )  # fmt: skip
                total = sim["hits"] + sim["misses"]
                res["hit_rate_lru_lookahead"] = round(sim["hits"] / total, 4) if total else 0.0
                # what the lookahead adds to LRU's hit rate on the same routing
                res["lookahead_hit_gain"] = round(res["hit_rate_lru_lookahead"] - res["hit_rate_lru"], 4)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cards", default="32,96", help="emulated card memory, GiB, comma-separated")
    ap.add_argument("--lanes", default="1,2,3,4,8")
    ap.add_argument("--modes", default="off,mtp,mtp-rows3", help="of off, off-async, mtp, mtp-rows3")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per lane")
    ap.add_argument("--layers", type=int, default=None, help="layers (default 48; --tiny: 4)")
    ap.add_argument("--context", type=int, default=8192, help="context per lane the KV is planned for")
    ap.add_argument("--accept", type=float, default=0.815, help="MTP per-draft acceptance for projections")
    ap.add_argument("--baselines", action="store_true", help="also every expert resident, and no cache")
    ap.add_argument("--mods", type=Path, help="a build_gpu_modules bundle covering these shapes")
    ap.add_argument(
        "--moe-loop",
        action="store_true",
        help="run the routed experts by the reference loop even when --mods has moe_experts_sm<NN>.so",
    )
    ap.add_argument(
        "--executor",
        choices=("static", "eager"),
        default=None,
        help="static: StaticHybridExecutor with the bundle's fused kernels (the server's route on CUDA; "
        "on the CPU its rounds split at the MoE layers run eagerly); eager: HybridExecutor "
        "[static on CUDA and with --lookahead, else eager]",
    )
    ap.add_argument(
        "--mtp-head", choices=("static", "eager"), default="static",
        help="static: the pooled head, CUDA-graphed when capturable (the server's on CUDA); eager: "
        "MTPDrafter [static]",
    )  # fmt: skip
    ap.add_argument(
        "--no-graphs", action="store_true",
        help="static executor without CUDA graphs (whole rounds or pieces): its rounds run eagerly",
    )  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (plumbing check)")
    ap.add_argument(
        "--host", choices=("pageable", "pinned", "mmap"), default="pageable",
        help="where the routed experts live on the host (module docstring)",
    )  # fmt: skip
    ap.add_argument(
        "--mmap-dir", type=Path, default=Path("/dev/shm") if os.path.isdir("/dev/shm") else None,
        help="directory of the memory-mapped expert file (--host mmap) and of copier_rates' mapped file",
    )  # fmt: skip
    ap.add_argument(
        "--copies", choices=("auto", "torch", "memmove"), default="auto",
        help="how the cache copies misses (`ExpertCache`'s copies): auto = one batched driver call a "
        "group from page-locked experts; torch = one torch copy per part of each miss (the old path); "
        "memmove = the batched path's plan by memmove (CPU only)",
    )  # fmt: skip
    ap.add_argument(
        "--breakdown", action="store_true",
        help="time the cached rounds' host path section by section (`ignis.runtime.host_breakdown`): "
        "each case's JSON gets `breakdown` (ms a round, us a MoE layer per section) and it is printed",
    )  # fmt: skip
    ap.add_argument(
        "--source-order", choices=("stream", "any"), default="stream",
        help="the batched driver copy's source access order (`DriverBatchCopy.set_source_order`)",
    )  # fmt: skip
    ap.add_argument(
        "--ids-wait", choices=("spin", "block", "hybrid"), default="spin",
        help="how the host waits for each MoE layer's routed ids (`ExpertCache`'s ids_wait)",
    )  # fmt: skip
    ap.add_argument(
        "--lookahead", action="store_true",
        help="router lookahead prefetch (`ExpertCache`'s lookahead): each MoE layer's routing also "
        "predicts the next layer's experts and copies them early; reports its recall",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args(argv)

    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.host == "pinned" and dev.type != "cuda":
        ap.error("--host pinned needs CUDA (pinned memory is CUDA's)")
    if args.copies == "memmove" and dev.type != "cpu":
        ap.error("--copies memmove runs on host memory only (the CPU)")
    if args.source_order != "stream" and dev.type == "cuda":
        from ignis.runtime.expert_transfer import driver_batch_copy

        dma = driver_batch_copy()
        if dma is not None:
            dma.set_source_order(args.source_order)
    if args.executor is None:
        args.executor = "static" if dev.type == "cuda" or args.lookahead else "eager"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    # --tiny: 4 layers unless --layers is given (many tiny layers: the host path's per-layer cost)
    cfg = issue_config(args.layers or (4 if args.tiny else 48), tiny=args.tiny)
    t0 = time.perf_counter()
    weights = make_weights(tensor_shapes(cfg), dev, seed=0)
    mtp_weights = make_weights(mtp_tensor_shapes(cfg), dev, seed=1)
    if dtype != torch.bfloat16:
        weights = {n: w if isinstance(w, Q4Weight) else w.to(dtype) for n, w in weights.items()}
        mtp_weights = {n: w if isinstance(w, Q4Weight) else w.to(dtype) for n, w in mtp_weights.items()}
    print(f"weights generated in {time.perf_counter() - t0:.1f} s", flush=True)
    mmap_dir = args.mmap_dir or args.out
    mmap_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    reader, expert_file = host_experts_to(weights, args.host, mmap_dir)
    print(f"routed experts in {args.host} host memory ({time.perf_counter() - t0:.1f} s)", flush=True)
    linear = None
    moe_module = None
    if args.mods is not None:
        from ignis.runtime.linear import LinearBackend
        from ignis.tools.bench.e2e_gpu import load_compiled

        linear = LinearBackend(load_compiled(args.mods))
        if dev.type == "cuda" and not args.moe_loop:
            from ignis.runtime.kernels.moe_experts import MoeExpertsKernel
            from ignis.tools.bench.build_gpu_modules import bundle_library

            moe_path = bundle_library(args.mods, "moe_experts", dev)
            if moe_path.exists():
                moe_module = MoeExpertsKernel(moe_path)
    else:
        from ignis.runtime.linear import torch_linear

        linear = torch_linear

    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    expert_total = sum(nbytes(w) for n, w in weights.items() if is_routed_expert(n))
    expert_bytes = expert_total // (moe_layers * cfg.num_experts)
    resident = sum(nbytes(w) for n, w in weights.items() if not is_routed_expert(n))
    mtp_bytes = sum(nbytes(w) for w in mtp_weights.values())
    lanes_list = [int(x) for x in args.lanes.split(",")]
    lane_bytes = lane_state_bytes(cfg, lanes=max(lanes_list), context=args.context, dtype=dtype)
    mtp_kv = max(lanes_list) * args.context * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    results: dict[str, Any] = {
        "config": {
            "layers": cfg.num_hidden_layers,
            "experts": cfg.num_experts,
            "top_k": cfg.num_experts_per_tok,
        },
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "linears": "compiled" if args.mods else "torch",
        "experts": "grouped kernels" if moe_module is not None else "reference loop",
        "bytes": {
            "experts": expert_total,
            "expert": expert_bytes,
            "resident": resident,
            "mtp_head": mtp_bytes,
            "lane_state": lane_bytes,
        },
        "bandwidth": {**bandwidth(dev), **copier_rates(dev, mmap_dir)},
        "host": args.host,
        "cases": [],
    }
    print(
        json.dumps({k: results[k] for k in ("config", "device", "experts", "bytes", "bandwidth")}), flush=True
    )

    modes = {"off": (0, 0), "off-async": (0, 0), "mtp": (3, 8), "mtp-rows3": (3, 3)}
    wanted = [m for m in args.modes.split(",") if m]
    cases: list[tuple[str, int | None]] = [
        (f"{c}GiB", int(float(c) * GIB)) for c in args.cards.split(",") if c
    ]
    if args.tiny:  # toy budgets: 1 and 4 slots a layer
        cases = [(f"{s}slots", s * moe_layers * expert_bytes) for s in (1, 4)]
    if args.baselines:
        cases += [("resident", None), ("no-cache", -1)]
    for label, card in cases:
        for mode in wanted:
            k, rows = modes[mode]
            mtp_on = k > 0
            cache = None
            if card is not None:
                workspace = round_workspace_bytes(cfg, rows=max(8, rows, max(lanes_list)), dtype=dtype)
                if card == -1:  # no cache: top_k slots, flushed after every round
                    slots = cfg.num_experts_per_tok
                elif args.tiny:
                    slots = card // (moe_layers * expert_bytes)
                else:
                    plan = plan_expert_cache(
                        expert_bytes=expert_bytes, moe_layers=moe_layers, num_experts=cfg.num_experts,
                        resident_bytes=resident, lane_bytes=lane_bytes, workspace_bytes=workspace,
                        mtp_reserve_bytes=(mtp_bytes + mtp_kv) if mtp_on else 0, card_bytes=card,
                        card_name=label,
                    )  # fmt: skip
                    print(plan.describe(), flush=True)
                    slots = plan.slots_per_layer
                if card != -1 and not args.tiny and slots >= cfg.num_experts:
                    # as the server does (`cache_for_artifact`, auto): every expert fits, no cache
                    print(f"{label}: every routed expert fits: resident, no expert cache", flush=True)
                else:
                    pin = "off" if args.host == "pageable" else "auto"
                    cache = ExpertCache(
                        slots, device=dev, pin=pin, copies=args.copies, lookahead=args.lookahead,
                        ids_wait=args.ids_wait,
                    )  # fmt: skip
                    if args.breakdown:
                        cache.set_breakdown(HostBreakdown())
                    if card != -1:
                        cache.stats.trace = []  # every forward's routing (run_case replays it)
            run_weights = weights
            if cache is None:  # every expert resident
                run_weights = {n: (w.to(dev) if is_routed_expert(n) else w) for n, w in weights.items()}
            if args.executor == "static":
                # the server's route: pooled lanes, the bundle's fused kernels, CUDA graphs: whole
                # rounds when every expert is resident, in pieces between the MoE layers' host syncs
                # with an expert cache (moe_piecewise.py)
                from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor

                kernels = static_kernels(args.mods, dev)
                ex = StaticHybridExecutor(
                    cfg, run_weights, device=dev, dtype=dtype, linear=linear, expert_cache=cache,
                    moe_module=moe_module, max_lanes=max(lanes_list), max_columns=max(8, rows),
                    max_context=min(args.context, 4096), cuda_graphs=False if args.no_graphs else None,
                    **kernels,
                )  # fmt: skip
            else:
                ex = HybridExecutor(
                    cfg, run_weights, device=dev, dtype=dtype, linear=linear, expert_cache=cache,
                    moe_module=moe_module,
                )  # fmt: skip
            pinned: dict[str, Any] = {}
            if cache is not None:
                print(f"{label}: {cache.describe_host()}", flush=True)
                pinned = {
                    "host_pinned_GB": round(cache.pin.pinned_bytes / 1e9, 2),
                    "pin_populate_s": round(cache.pin.populate_seconds, 2),
                    "pin_register_s": round(cache.pin.register_seconds, 2),
                }
                if cache.pin.reason:
                    pinned["pin_reason"] = cache.pin.reason
            drafter = None
            if mtp_on:
                shared = {
                    n: weights[n]
                    for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
                }
                static = args.mtp_head == "static"
                drafter = build_mtp_drafter(
                    target_config=cfg, target_weights=shared, mtp_weights=mtp_weights, device=dev,
                    dtype=dtype, linear=linear, moe_module=moe_module, static=static,
                    max_lanes=max(lanes_list), max_context=min(args.context, 4096),
                )  # fmt: skip
                if static:  # the server's load: every shape these rounds meet captured now
                    t0 = time.perf_counter()
                    n = drafter.warm_up(columns=(k + 1,), context=32 + args.tokens + 8)  # type: ignore[attr-defined]
                    graphed = getattr(drafter, "cuda_graphs", False)
                    print(f"{label} {mode}: MTP head graphs captured at load: {n} in "
                          f"{time.perf_counter() - t0:.1f} s (graphs {graphed})", flush=True)  # fmt: skip
            for lanes in lanes_list:
                res = run_case(
                    ex, drafter, lanes=lanes, k=k, rows=rows, tokens=args.tokens, vocab=cfg.vocab_size,
                    cache=cache, flush=card == -1, seed=lanes, async_rounds=mode == "off-async",
                )  # fmt: skip
                res |= {
                    "card": label,
                    "mode": mode,
                    "host": args.host,
                    "slots_per_layer": cache.slots_per_layer if cache else None,
                    "ids_wait": args.ids_wait,
                    "source_order": args.source_order,
                    **pinned,
                }
                if mtp_on and res["round_ms"]:
                    d = drafts_per_lane(lanes, k, rows)
                    res["drafts_per_lane"] = d
                    res["projected_tok_s"] = round(
                        lanes * expected_tokens(d, args.accept) / res["round_ms"] * 1e3, 2
                    )
                print(json.dumps(res), flush=True)
                if res.get("breakdown"):
                    print(
                        f"{label} {mode} {lanes} lanes: " + HostBreakdown.format(res["breakdown"]), flush=True
                    )
                results["cases"].append(res)
            if cache is not None:
                cache.close()
            del ex, drafter, cache, run_weights
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    del weights
    gc.collect()
    if reader is not None:
        reader.close()
    if expert_file is not None:
        expert_file.unlink(missing_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_expert_cache.json").write_text(json.dumps(results, indent=1))
    cols = ("card", "mode", "lanes", "slots_per_layer", "tok_s", "tok_s_steady", "projected_tok_s")
    cols += ("round_ms", "host_ms", "async_issued", "drafter_ms", "propose_ms", "commit_ms", "mtp_graphs")
    cols += ("sync_wait_ms", "hit_rate", "prefetches", "lookahead_recall", "hit_rate_lru_lookahead")
    cols += ("lookahead_hit_gain", "copies")
    cols += ("hit_rate_lru", "hit_rate_lfu", "hit_rate_belady", "MB_per_token", "MB_per_round")
    cols += ("experts_per_forward", "experts_per_layer_run", "host", "direct_copies", "staged_copies")
    print(" | ".join(cols))
    for r in results["cases"]:
        print(" | ".join(str(r.get(c, "")) for c in cols))
    print(f"bandwidth: {results['bandwidth']}; wrote {args.out / 'bench_expert_cache.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
