"""The DFlash2 drafter's cost per round: eager path against its static route (pooled rings, proposals
replayed from CUDA graphs), at the public 27B drafter's shape with random weights.

    python -m ignis.tools.bench.dflash2_cost [--lanes 1,8] [--drafts 7] [--context 1024]
        [--rounds 40] [--warmup 5] [--accepted 3] [--head full|shortlist] [--dtype bfloat16]
        [--sampled] [--paths eager,static,graphed] [--preset 27b|tiny] [--device cuda]
        [--topk-modules DIR] [--json PATH]

What it builds (on the device, no checkpoint on disk): the drafter of `PUBLIC_27B_DFLASH2`
(tools/random_checkpoint.py: hidden 5,120, 5 sliding layers of 32 / 8 heads of 128, MLP 17,408,
block 8, 5 taps, selector rank 256 over the top 16) with random weights in `--dtype`, against a
27B-shaped target head: a random embedding and lm_head of [248,320, 5,120] (`--head shortlist`: a
[131,072, 5,120] shortlist head instead, the artifact's Q4 shortlist's rows, here in `--dtype`). The
linears run in torch (`F.linear`), not through an artifact's compiled Q4 modules: the weights read a
round are the bf16 ones (~3.3 GB of drafter layers + the head), so the figures bound the product's
q4 drafter from above. `--preset tiny` shrinks everything (hidden 64, vocabulary 320) for a CPU smoke
run.

Per lane count and path: `--lanes` lanes each start with a `--context`-token prompt (random taps,
committed in one span), then `--warmup` untimed and `--rounds` timed rounds of: `propose` (every lane
asks `--drafts` drafts; greedy, or sampled at temperature 0.8 with `--sampled`), a device sync (the
engine reads the drafts right after), then `commit` of `--accepted` + 1 columns per lane (random
taps), synced. Times are wall-clock per call (perf_counter around the call and its sync), reported as
the median and p90 in ms per round for propose, commit and both. Paths: `eager` (the drafter as
before: per-lane windows and attention calls, the selector walk read back token by token),
`static` (the pooled route without graphs), `graphed` (the pooled route replayed from the CUDA graphs
captured at load for widths 1 .. max(--lanes) and every context bucket; the capture time is
reported). The drafts of every path are compared with the first path's (eager by default) for the
first timed round: `lanes_differing` counts the lanes whose drafts differ (greedy: none expected up
to bf16 near-ties between the paths' differently shaped kernels).

Prints a table, then the JSON (also written to `--json`).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from typing import Any

import click
import torch

from ignis.runtime.drafters.base import CommittedSpan, DraftRequest
from ignis.runtime.drafters.dflash2 import DFlash2Config, DFlash2Drafter, dflash2_tensor_shapes
from ignis.runtime.sampling import SamplingParams

SHORTLIST_ROWS = 131_072  # the artifact's Q4 shortlist head: the most frequent tokens
PATHS = ("eager", "static", "graphed")


def bench_config(preset: str) -> DFlash2Config:
    """The drafter config of a preset: `27b` (the public 27B drafter) or `tiny` (a CPU smoke shape)."""
    from ignis.tools.random_checkpoint import PUBLIC_27B_DFLASH2

    config = DFlash2Config.from_hf(PUBLIC_27B_DFLASH2)
    if preset == "27b":
        return config
    import dataclasses

    return dataclasses.replace(
        config,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=320,
        mask_token_id=319,
        layer_types=(config.layer_types[0],) * 2,
        sliding_window=64,
        selector_rank=8,
        num_target_layers=4,
        target_layer_ids=(0, 1, 2, 3),
        max_position_embeddings=4096,
    )


def random_weights(
    config: DFlash2Config, *, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random drafter tensors drawn on `device` in `dtype` (the scales of
    `make_test_drafter.random_dflash2_weights`: unit-ish norms, fan-in scaled linears)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in dflash2_tensor_shapes(config).items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        if name.endswith("base_kernel"):
            t = 0.15 + 0.05 * t
            t[:, 0] += 0.85
        elif name.endswith("kernel_projection.weight"):
            t = t * (0.05 / math.sqrt(shape[-1]))
        elif name.endswith("_codebook"):
            t = t / config.selector_rank**0.25
        elif len(shape) == 1 and name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        elif len(shape) == 1:
            t = 0.02 * t
        else:
            t = t / math.sqrt(shape[-1])
        out[name] = t.to(dtype)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _taps(config: DFlash2Config, n: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator):
    return torch.randn(n, config.num_taps * config.hidden_size, generator=gen, device=device).to(dtype)


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "median_ms": 1e3 * statistics.median(s),
        "p90_ms": 1e3 * s[min(len(s) - 1, int(0.9 * len(s)))],
        "mean_ms": 1e3 * statistics.fmean(s),
    }


def run_path(
    drafter: DFlash2Drafter,
    *,
    lanes: int,
    drafts: int,
    context: int,
    rounds: int,
    warmup: int,
    accepted: int,
    sampled: bool,
    seed: int = 0,
) -> dict[str, Any]:
    """Drive one drafter through the rounds (module docstring); returns the timings and the first
    timed round's drafts (lists per lane)."""
    c, device, dtype = drafter.config, drafter.device, drafter.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    tokgen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.8) if sampled else SamplingParams(temperature=0)
    seqs = []
    for lane in range(lanes):
        seq = torch.randint(0, c.vocab_size, (context + 1,), generator=tokgen).tolist()
        drafter.start_lane(lane, seq[:-1])
        taps = _taps(c, context, device, dtype, gen)
        drafter.commit([CommittedSpan(lane, 0, tuple(seq[:-1]), tuple(seq[1:]), taps=taps)])
        seqs.append(seq)
    _sync(device)
    propose_s, commit_s, first = [], [], None
    for r in range(warmup + rounds):
        reqs = [
            DraftRequest(
                lane_id=lane,
                num_drafts=drafts,
                token_ids=tuple(seqs[lane]),
                num_prompt_tokens=context,
                params=params,
                generator=torch.Generator(device=device).manual_seed(1000 * lane + r),
            )
            for lane in range(lanes)
        ]
        t0 = time.perf_counter()
        props = drafter.propose(reqs)
        _sync(device)
        t1 = time.perf_counter()
        if r == warmup:
            first = [p.draft_token_ids.tolist() for p in props]
        spans = []
        keep = accepted + 1
        for lane in range(lanes):
            start = len(seqs[lane]) - 1
            new = torch.randint(0, c.vocab_size, (keep,), generator=tokgen).tolist()
            cols = (seqs[lane][-1], *new[:-1])
            spans.append(
                CommittedSpan(lane, start, cols, tuple(new), taps=_taps(c, keep, device, dtype, gen))
            )
            seqs[lane] = seqs[lane] + new
        _sync(device)
        t2 = time.perf_counter()
        drafter.commit(spans)
        _sync(device)
        t3 = time.perf_counter()
        if r >= warmup:
            propose_s.append(t1 - t0)
            commit_s.append(t3 - t2)
    for lane in range(lanes):
        drafter.end_lane(lane)
    total = [a + b for a, b in zip(propose_s, commit_s, strict=True)]
    return {
        "propose": _stats(propose_s),
        "commit": _stats(commit_s),
        "round": _stats(total),
        "first_drafts": first,
    }


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--lanes", default="1,8", show_default=True, help="Lane counts, comma-separated.")
@click.option("--drafts", default=7, show_default=True, type=click.IntRange(1, 7))
@click.option(
    "--context", default=1024, show_default=True, type=click.IntRange(1), help="Prompt tokens a lane."
)
@click.option("--rounds", default=40, show_default=True, type=click.IntRange(1))
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(1))
@click.option(
    "--accepted", default=3, show_default=True, type=click.IntRange(0, 7), help="Drafts kept a round."
)
@click.option(
    "--head", "head_kind", default="full", show_default=True, type=click.Choice(["full", "shortlist"])
)
@click.option(
    "--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float16", "float32"])
)
@click.option("--sampled", is_flag=True, help="Lanes sample at temperature 0.8 (default greedy).")
@click.option("--paths", default=",".join(PATHS), show_default=True)
@click.option("--preset", default="27b", show_default=True, type=click.Choice(["27b", "tiny"]))
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default=True)
@click.option("--topk-modules", type=click.Path(exists=True), default=None, help="Folder of topk_<arch>.so.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(
    lanes: str,
    drafts: int,
    context: int,
    rounds: int,
    warmup: int,
    accepted: int,
    head_kind: str,
    dtype: str,
    sampled: bool,
    paths: str,
    preset: str,
    device: str,
    topk_modules: str | None,
    json_path: str | None,
) -> None:
    """Milliseconds per DFlash2 proposal and commit, eager vs static vs graphed (module docstring)."""
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    lane_counts = sorted({int(x) for x in lanes.split(",") if x.strip()})
    chosen = [p.strip() for p in paths.split(",") if p.strip()]
    bad = sorted(set(chosen) - set(PATHS))
    if bad or not chosen or not lane_counts or lane_counts[0] < 1:
        raise click.BadParameter(f"paths must be some of {PATHS} and lanes >= 1 (got {paths!r}, {lanes!r})")
    if "graphed" in chosen and dev.type != "cuda":
        chosen.remove("graphed")
        click.echo("no CUDA device: the graphed path is left out", err=True)
    config = bench_config(preset)
    t0 = time.perf_counter()
    weights = random_weights(config, device=dev, dtype=dt)
    g = torch.Generator(device=dev).manual_seed(1)
    v, h = config.vocab_size, config.hidden_size
    embed = (torch.randn(v, h, generator=g, device=dev, dtype=torch.float32)).to(dt)
    lm_head = (torch.randn(v, h, generator=g, device=dev, dtype=torch.float32) / math.sqrt(h)).to(dt)
    head_kwargs: dict[str, Any] = {}
    if head_kind == "shortlist":
        rows = min(SHORTLIST_ROWS, v)
        head_kwargs = {
            "draft_head": "shortlist",
            "shortlist_weight": lm_head[:rows],
            "shortlist_token_ids": torch.arange(rows, device=dev),
        }
    topk_module = None
    if topk_modules is not None and dev.type == "cuda":
        from pathlib import Path

        from ignis.runtime.kernels.topk import load_topk_module

        major, minor = torch.cuda.get_device_capability(dev)
        topk_module = load_topk_module(Path(topk_modules) / f"topk_sm{major}{minor}.so")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    setup_s = time.perf_counter() - t0
    results: list[dict[str, Any]] = []
    reference: dict[int, list[list[int]]] = {}
    for path in chosen:
        drafter = DFlash2Drafter(
            config, weights, embed_tokens=embed, lm_head=lm_head, device=dev, dtype=dt, **head_kwargs
        )
        drafter.topk_module = topk_module
        capture_s, captured = 0.0, 0
        if path != "eager":
            t1 = time.perf_counter()
            drafter.use_static(
                max_lanes=max(lane_counts),
                max_context=context + (warmup + rounds) * 8 + 8,
                cuda_graphs=path == "graphed",
            )
            captured = drafter.warm_up()
            capture_s = time.perf_counter() - t1
        for n in lane_counts:
            r = run_path(
                drafter,
                lanes=n,
                drafts=drafts,
                context=context,
                rounds=rounds,
                warmup=warmup,
                accepted=accepted,
                sampled=sampled,
            )
            first = r.pop("first_drafts")
            if path == chosen[0]:
                reference[n] = first
            differ = sum(a != b for a, b in zip(first, reference[n], strict=True))
            results.append(
                {
                    "path": path,
                    "lanes": n,
                    **r,
                    "lanes_differing": differ,
                    "compared_with": chosen[0],
                    "graphs_captured": captured,
                    "capture_s": capture_s,
                }
            )
        del drafter
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    click.echo(
        f"DFlash2 cost ({preset} drafter, {head_kind} head, {dtype}, {drafts} drafts, {context}-token "
        f"contexts, {accepted + 1} columns committed a round, {'sampled' if sampled else 'greedy'}, "
        f"median of {rounds} rounds, ms)"
    )
    click.echo(
        f"{'path':<8} {'lanes':>5} {'propose':>9} {'commit':>8} {'round':>8} {'p90 round':>10} {'differ':>7}"
    )
    for r in results:
        click.echo(
            f"{r['path']:<8} {r['lanes']:>5} {r['propose']['median_ms']:>9.3f} "
            f"{r['commit']['median_ms']:>8.3f} {r['round']['median_ms']:>8.3f} "
            f"{r['round']['p90_ms']:>10.3f} {r['lanes_differing']:>7}"
        )
    out = {
        "bench": "dflash2_cost",
        "preset": preset,
        "head": head_kind,
        "dtype": dtype,
        "drafts": drafts,
        "context": context,
        "rounds": rounds,
        "warmup": warmup,
        "accepted": accepted,
        "sampled": sampled,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "setup_s": setup_s,
        "results": results,
    }
    click.echo(json.dumps(out, indent=2))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
