"""The MTP head's time a decode round, alone: the eager head against the pooled, graphed one (issue 22).

    python -m ignis.tools.bench.mtp_head [--shape flash-next|27b] [--mods DIR] [--lanes 1,2,4,8]
        [--drafts 3] [--rounds 30] [--context 512] [--heads eager,static] [--sampled] [--out DIR]
    python -m ignis.tools.bench.mtp_head --tiny        # CPU plumbing check at toy sizes

The head of the issue's Qwen3.5-122B-A10B shape (``flash-next``: one gated-attention layer with a MoE
MLP of 256 experts, 8 a token, and the shared lm_head of vocabulary 248,320; the config of
`ignis.tools.bench.expert_cache.issue_config`) or of the 27B shape (``27b``: a dense MLP of 17,408;
`ignis.tools.random_checkpoint.MODELS`), with RANDOM weights made as `expert_cache.make_weights` makes
them (q4_g32 linears and experts, bf16 for the rest), without the trunk: the trunk's hidden states
fed to the head are random rows. A random head is never accepted, so the rounds here commit a scripted
number of columns a lane (1, 2, .., drafts + 1 in turn), as accepted drafts would.

Linears: with `--mods` (a ``build_gpu_modules`` bundle serving these shapes, e.g. ``--shapes
flash-next``) through its compiled functions, and the MoE head's routed experts through the bundle's
``moe_experts_sm<NN>.so`` (the grouped kernels: the static head is then captured in CUDA graphs); else
torch (dequantize + GEMM: a MoE head then runs its reference expert loop, eagerly).

Heads (`--heads`): ``eager`` (`MTPDrafter`: each draft step its own launches and host syncs) and
``static`` (`StaticMTPDrafter`: pooled lanes, whole greedy proposals and commits from CUDA graphs when
the head is capturable, captured before the rounds as the server's load does: ``warmup_s``).

Per head and lane count: each lane starts with a prompt of `--context` positions (one eager span),
then `--rounds` rounds of ``propose`` (`--drafts` drafts a lane, greedy; `--sampled`: temperature
0.8, top-p 0.95) and ``commit`` of the scripted columns; each call synced before and after and timed.
Reported: the medians of propose, commit and their sum a round (``drafter_ms``), in ms. The round with
MTP on a card is then the verify round of the target plus ``drafter_ms``.

Prints a table last; writes ``bench_mtp_head.json`` into `--out` (default $OUT or .).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ignis.runtime.drafters.base import CommittedSpan
from ignis.runtime.drafters.mtp import build_mtp_drafter
from ignis.runtime.drafters.testing import draft_request
from ignis.runtime.families.qwen3_5 import HybridConfig, mtp_tensor_shapes
from ignis.runtime.linear import Q4Weight
from ignis.runtime.sampling import SamplingParams
from ignis.tools.bench.expert_cache import issue_config, make_weights

__all__ = ["head_config", "main", "run_head"]


def head_config(shape: str, *, tiny: bool = False) -> HybridConfig:
    """The target config whose MTP head is measured: "flash-next" (the issue's MoE shape) or "27b"
    (dense), one MTP layer; `tiny`: toy sizes of the same kind."""
    from ignis.runtime.families import get_family

    if shape == "flash-next":
        return issue_config(4, tiny=tiny)
    from ignis.tools.random_checkpoint import MODELS

    raw = dict(MODELS["tiny" if tiny else "qwen3_5-27b"], mtp_num_hidden_layers=1)
    config = get_family(str(raw["model_type"])).config_cls.from_hf(raw)
    assert isinstance(config, HybridConfig)
    return config


def run_head(
    drafter: Any,
    *,
    lanes: int,
    drafts: int,
    rounds: int,
    context: int,
    sampled: bool,
    seed: int = 0,
) -> dict[str, Any]:
    """Time `rounds` rounds of propose + commit over `lanes` lanes of `context` committed positions
    (module docstring); returns the medians in ms."""
    c, dev = drafter.config, drafter.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(seed)
    vocab, hidden = c.vocab_size, c.hidden_size
    params = SamplingParams(temperature=0.8, top_p=0.95) if sampled else SamplingParams(temperature=0)
    seqs: list[list[int]] = []
    for lane in range(lanes):
        seq = torch.randint(0, vocab, (context + 1,), generator=gen).tolist()
        h = torch.randn(context, hidden, generator=gen).to(device=dev, dtype=drafter.dtype)
        drafter.start_lane(lane, seq[:-1])
        drafter.commit([CommittedSpan(lane, 0, tuple(seq[:-1]), tuple(seq[1:]), hidden_states=h)])
        seqs.append(seq)
    times: dict[str, list[float]] = {"propose": [], "commit": []}
    for r in range(rounds):
        reqs = [draft_request(i, seqs[i], drafts, params, seed=r) for i in range(lanes)]
        sync()
        t0 = time.perf_counter()
        got = drafter.propose(reqs)
        sync()
        times["propose"].append(time.perf_counter() - t0)
        spans = []
        for i, seq in enumerate(seqs):
            m = 1 + (r + i) % (drafts + 1)  # the accepted drafts + the bonus column, scripted
            ids = got[i].draft_token_ids.tolist()[: m - 1]
            ext = seq + ids + torch.randint(0, vocab, (m - len(ids),), generator=gen).tolist()
            pos = len(seq) - 1
            h = torch.randn(m, hidden, generator=gen).to(device=dev, dtype=drafter.dtype)
            spans.append(
                CommittedSpan(i, pos, tuple(ext[pos : pos + m]), tuple(ext[pos + 1 : pos + m + 1]), h)
            )
            seqs[i] = ext
        sync()
        t0 = time.perf_counter()
        drafter.commit(spans)
        sync()
        times["commit"].append(time.perf_counter() - t0)
    for lane in range(lanes):
        drafter.end_lane(lane)
    per_round = [p + q for p, q in zip(times["propose"], times["commit"], strict=True)]
    return {
        "lanes": lanes,
        "drafts": drafts,
        "propose_ms": round(statistics.median(times["propose"]) * 1e3, 3),
        "commit_ms": round(statistics.median(times["commit"]) * 1e3, 3),
        "drafter_ms": round(statistics.median(per_round) * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=("flash-next", "27b"), default="flash-next")
    ap.add_argument("--mods", type=Path, help="a build_gpu_modules bundle covering these shapes")
    ap.add_argument("--lanes", default="1,2,4,8")
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--context", type=int, default=512, help="committed positions a lane holds")
    ap.add_argument("--heads", default="eager,static")
    ap.add_argument("--sampled", action="store_true", help="sampled lanes (temperature 0.8, top-p 0.95)")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on the CPU (plumbing check)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args(argv)

    dev = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = head_config(args.shape, tiny=args.tiny)
    names = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    shapes = {n: s for n, s in {**mtp_tensor_shapes(cfg), **_shared_shapes(cfg)}.items()}
    t0 = time.perf_counter()
    weights = make_weights(shapes, dev, seed=1)
    if dtype != torch.bfloat16:
        weights = {n: w if isinstance(w, Q4Weight) else w.to(dtype) for n, w in weights.items()}
    shared = {n: weights.pop(n) for n in names}
    print(f"weights generated in {time.perf_counter() - t0:.1f} s", flush=True)
    linear: Any = None
    moe_module = None
    if args.mods is not None:
        from ignis.runtime.linear import LinearBackend
        from ignis.tools.bench.e2e_gpu import load_compiled

        linear = LinearBackend(load_compiled(args.mods))
        if dev.type == "cuda" and cfg.is_moe:
            from ignis.runtime.kernels.moe_experts import MoeExpertsKernel
            from ignis.tools.bench.build_gpu_modules import bundle_library

            moe_path = bundle_library(args.mods, "moe_experts", dev)
            if moe_path.exists():
                moe_module = MoeExpertsKernel(moe_path)
    else:
        from ignis.runtime.linear import torch_linear

        linear = torch_linear
    lanes_list = [int(x) for x in args.lanes.split(",") if x]
    results: dict[str, Any] = {
        "shape": args.shape,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "linears": "compiled" if args.mods else "torch",
        "experts": "grouped kernels" if moe_module is not None else "reference loop",
        "context": args.context,
        "sampled": args.sampled,
        "cases": [],
    }
    for head in [h for h in args.heads.split(",") if h]:
        static = head == "static"
        drafter: Any = build_mtp_drafter(
            target_config=cfg, target_weights=shared, mtp_weights=weights, device=dev, dtype=dtype,
            linear=linear, moe_module=moe_module, static=static, max_lanes=max(lanes_list),
            max_context=args.context + args.rounds * (args.drafts + 1) + 16,
        )  # fmt: skip
        warm = 0.0
        if static:
            t0 = time.perf_counter()
            n = drafter.warm_up(
                columns=(args.drafts + 1,), context=args.context + args.rounds * (args.drafts + 1)
            )
            warm = time.perf_counter() - t0
            print(
                f"static head: {n} graphs captured in {warm:.1f} s (graphs {drafter.cuda_graphs})", flush=True
            )
        for lanes in lanes_list:
            res = run_head(
                drafter, lanes=lanes, drafts=args.drafts, rounds=args.rounds, context=args.context,
                sampled=args.sampled, seed=lanes,
            )  # fmt: skip
            res |= {"head": head, "graphs": bool(getattr(drafter, "cuda_graphs", False))}
            if static:
                res["warmup_s"] = round(warm, 2)
            print(json.dumps(res), flush=True)
            results["cases"].append(res)
        del drafter
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_mtp_head.json").write_text(json.dumps(results, indent=1))
    cols = ("head", "graphs", "lanes", "drafts", "propose_ms", "commit_ms", "drafter_ms")
    print(" | ".join(cols))
    for r in results["cases"]:
        print(" | ".join(str(r.get(c, "")) for c in cols))
    print(f"wrote {args.out / 'bench_mtp_head.json'}")
    return 0


def _shared_shapes(cfg: HybridConfig) -> dict[str, tuple[int, ...]]:
    """The target tensors the head shares: embedding, final norm, lm_head."""
    v, h = cfg.vocab_size, cfg.hidden_size
    return {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}


if __name__ == "__main__":
    raise SystemExit(main())
