"""Decode tok/s of a small llama on its static, graphed route next to a qwen3_5 of the same size (issue 25,
item 1: "small llama on the GPU: >= 0.8x the hybrid route's tok/s on a model of the same size, first
request included").

    python -m ignis.tools.bench.graphed_families                       # H200: random bf16 weights
    python -m ignis.tools.bench.graphed_families --llama-artifact A --qwen-artifact B   # built artifacts
    python -m ignis.tools.bench.graphed_families --tiny --device cpu   # plumbing check at toy sizes

Models (random weights, generated on the device): llama with vocabulary 4,096, hidden 1,024, 4 layers,
intermediate 2,048, 16 query / 4 KV heads of 64; qwen3_5 with the same vocabulary, hidden, layers and
intermediate (3 Gated DeltaNet : 1 gated attention; 8 query / 2 KV heads of 128; GDN 8 key / 16 value
heads of 64). bf16 weights, torch linears (cuBLAS). With ``--llama-artifact`` / ``--qwen-artifact``
(artifacts from ``ignis-build --card h200`` of such checkpoints) the executors come from
``Artifact.make_executor(linear=art.linear_backend())`` instead: the compiled q4 route a server runs.

Routes: ``llama eager`` (`LlamaExecutor`), ``llama graphed`` (`StaticLlamaExecutor`) and ``qwen3_5
graphed`` (`StaticHybridExecutor`). The static executors are warmed up as the server's load does
(`ignis.runtime.families.static_rounds.warm_up_static`; its time is printed as ``load_warmup_s``):
both capture the shapes of every KV bucket up to the context (``--graph-warmup-context``'s default).

Per route and lane count (1 and 8): greedy generation through `SpeculativeEngine`, speculation off
(and with ``--spec``: 7 drafts from the test drafter right with p = 0.885, or ngram),
``--prompt`` random tokens per lane and ``--tokens`` output tokens per lane (ignore_eos), run ``--runs``
times; reported: the first run's tok/s (``first``), the median of the others (``steady``), and
``first / steady``. Then the ratio of llama graphed to qwen3_5 graphed (steady and first), against the
0.8 target. Prints a table last; writes ``bench_graphed_families.json`` into ``--out`` (default $OUT
or .).
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
from ignis.runtime.families.static_rounds import warm_up_static
from ignis.runtime.sampling import SamplingParams

LLAMA = {
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
QWEN3_5 = {
    "model_type": "qwen3_5_text",
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attn_output_gate": True,
    "hidden_act": "silu",
    "mtp_num_hidden_layers": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}
TINY = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
TINY_GDN = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32}
TINY_GDN["linear_value_head_dim"] = 32
TARGET = 0.8  # llama graphed / qwen3_5 graphed


def random_weights(config: Any, dev: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """{canonical name: bf16 tensor} for every tensor the family's executor takes, random on `dev`:
    matrices N(0, 1/fan_in), embeddings N(0, 1), norms 1 (llama) or 0 ((1 + w) norms of qwen3_5),
    GDN A_log log U(1, 16), dt_bias 1, conv N(0, 0.3^2)."""
    from ignis.runtime.families import get_family
    from ignis.tools.bench.e2e_gpu import random_dense

    gen = torch.Generator(device=dev).manual_seed(seed)
    one_plus = config.model_type != "llama"
    shapes = get_family(config.model_type).tensor_shapes(config)
    return {
        name: random_dense(name, shape, dev, gen, one_plus_norms=one_plus, bias_std=0.1)
        for name, shape in shapes.items()
    }


def executors(args: argparse.Namespace, dev: torch.device) -> dict[str, Any]:
    """route -> executor (module docstring), with max_lanes 8."""
    from ignis.runtime.families import config_from_hf
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
    from ignis.runtime.families.llama import LlamaExecutor
    from ignis.runtime.families.llama_graphs import StaticLlamaExecutor

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    context = args.prompt + args.tokens + 16
    if args.llama_artifact or args.qwen_artifact:
        from ignis.runtime.artifact import load_artifact

        out = {}
        for route, path, graphs in (
            ("llama eager", args.llama_artifact, False),
            ("llama graphed", args.llama_artifact, None),
            ("qwen3_5 graphed", args.qwen_artifact, None),
        ):
            if path:
                art = load_artifact(path)
                out[route] = art.make_executor(
                    device=dev,
                    linear=art.linear_backend(),
                    cuda_graphs=graphs,
                    max_lanes=8,
                    max_context=context,
                )
        return out
    llama_raw, qwen_raw = dict(LLAMA), dict(QWEN3_5)
    if args.tiny:
        llama_raw.update(TINY)
        qwen_raw.update(TINY, **TINY_GDN)
    llama = config_from_hf(llama_raw)
    qwen = config_from_hf(qwen_raw)
    lw = {k: v.to(dtype) for k, v in random_weights(llama, dev, 0).items()}
    qw = {k: v.to(dtype) for k, v in random_weights(qwen, dev, 1).items()}
    graphs = None if dev.type == "cuda" else False
    return {
        "llama eager": LlamaExecutor(llama, lw, device=dev, dtype=dtype),
        "llama graphed": StaticLlamaExecutor(
            llama, lw, device=dev, dtype=dtype, max_lanes=8, max_context=context, cuda_graphs=graphs
        ),
        "qwen3_5 graphed": StaticHybridExecutor(
            qwen, qw, device=dev, dtype=dtype, max_lanes=8, max_context=context, cuda_graphs=graphs
        ),
    }


def generate(
    ex: Any, prompts: list[list[int]], tokens: int, drafter: Any = None, k: int = 0
) -> tuple[float, list[tuple[int, ...]]]:
    """(wall seconds, outputs) of one greedy `generate` of the prompts (speculation off without a
    drafter, else `k` drafts a round)."""
    engine = SpeculativeEngine(
        ex, drafter, draft_tokens=k if drafter is not None else None, max_lanes=len(prompts)
    )
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    if ex.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    if ex.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, [r.output_token_ids for r in out]


def spec_runs(
    ex: Any, prompts: list[list[int]], off: list[tuple[int, ...]], args: argparse.Namespace
) -> dict:
    """`--runs` generations with 7 drafts (`--spec`): first and steady tok/s, and whether the output
    equals speculation off (greedy: it must)."""
    from ignis.runtime.drafters.ngram import NgramDrafter
    from ignis.runtime.drafters.testing import right_with_probability

    refs = {tuple(p): o for p, o in zip(prompts, off, strict=True)}
    walls, same = [], True
    for run in range(max(args.runs, 2)):
        if args.spec == "ngram":
            drafter: Any = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=3)
        else:
            drafter = right_with_probability(refs, 0.885, vocab_size=ex.config.vocab_size, seed=run)
        wall, out = generate(ex, prompts, args.tokens, drafter, 7)
        walls.append(wall)
        same = same and out == off
    n = len(prompts) * args.tokens
    steady = statistics.median(walls[1:])
    return {
        "first_tok_s": round(n / walls[0], 1),
        "steady_tok_s": round(n / steady, 1),
        "first_over_steady": round(walls[0] / steady, 2),
        "equals_off": same,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="toy sizes (plumbing check)")
    ap.add_argument(
        "--llama-artifact", help="a built llama artifact (compiled route) instead of random weights"
    )
    ap.add_argument(
        "--qwen-artifact", help="a built qwen3_5 artifact (compiled route) instead of random weights"
    )
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per lane")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per lane")
    ap.add_argument("--runs", type=int, default=4, help="generations per route and lane count (>= 2)")
    ap.add_argument("--lanes", default="1,8")
    ap.add_argument(
        "--spec",
        default="off",
        choices=["off", "p0.885", "ngram"],
        help="also run with 7 drafts: the test drafter right with p = 0.885 (replaying the speculation-off "
        "output: the round cost at that acceptance) or ngram (prompt lookup on the random prompts)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    lanes_list = [int(x) for x in args.lanes.split(",")]
    exs = executors(args, dev)
    results: dict[str, Any] = {
        "config": {"llama": LLAMA, "qwen3_5": QWEN3_5, "tiny": args.tiny},
        "routes": {},
    }
    for route, ex in exs.items():
        t0 = time.perf_counter()
        captured = warm_up_static(ex, columns=(8,) if args.spec != "off" else ())
        warm_s = time.perf_counter() - t0
        vocab = ex.config.vocab_size
        gen = torch.Generator().manual_seed(7)
        prompts = [
            torch.randint(0, vocab, (args.prompt,), generator=gen).tolist() for _ in range(max(lanes_list))
        ]
        row: dict[str, Any] = {
            "executor": type(ex).__name__,
            "load_warmup_s": round(warm_s, 3),
            "graphs_at_load": captured,
        }
        for lanes in lanes_list:
            walls, outs = [], []
            for _ in range(max(args.runs, 2)):
                wall, out = generate(ex, prompts[:lanes], args.tokens)
                walls.append(wall)
                outs.append(out)
            n = lanes * args.tokens
            steady = statistics.median(walls[1:])
            row[f"lanes{lanes}"] = {
                "first_tok_s": round(n / walls[0], 1),
                "steady_tok_s": round(n / steady, 1),
                "first_over_steady": round(walls[0] / steady, 2),
                "walls_s": [round(w, 4) for w in walls],
                "same_outputs": all(o == outs[0] for o in outs),
            }
            print(f"{route:16s} lanes {lanes}: {row[f'lanes{lanes}']}", flush=True)
            if args.spec != "off":
                row[f"lanes{lanes}_{args.spec}"] = spec_runs(ex, prompts[:lanes], outs[0], args)
                print(
                    f"{route:16s} lanes {lanes} {args.spec}: {row[f'lanes{lanes}_{args.spec}']}", flush=True
                )
        row["graphs_total"] = getattr(ex, "num_captures", None)
        results["routes"][route] = row
    ratios: dict[str, Any] = {}
    routes = results["routes"]
    if "llama graphed" in routes and "qwen3_5 graphed" in routes:
        for lanes in lanes_list:
            a, b = routes["llama graphed"][f"lanes{lanes}"], routes["qwen3_5 graphed"][f"lanes{lanes}"]
            ratios[f"lanes{lanes}"] = {
                "steady": round(a["steady_tok_s"] / b["steady_tok_s"], 3),
                "first": round(a["first_tok_s"] / b["steady_tok_s"], 3),
                "target": TARGET,
            }
    results["llama_over_qwen3_5"] = ratios
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_graphed_families.json").write_text(json.dumps(results, indent=2))
    print()
    head = f"{'route':22s} {'lanes':>5s} {'first tok/s':>12s} {'steady tok/s':>13s} {'first/steady':>13s}"
    print(head)
    print("-" * len(head))
    for route, row in routes.items():
        for suffix in ("", f"_{args.spec}") if args.spec != "off" else ("",):
            for lanes in lanes_list:
                r = row[f"lanes{lanes}{suffix}"]
                name = route + (f" {args.spec}" if suffix else "")
                print(
                    f"{name:22s} {lanes:5d} {r['first_tok_s']:12.1f} {r['steady_tok_s']:13.1f} "
                    f"{r['first_over_steady']:13.2f}"
                )
    for lanes, r in ratios.items():
        print(
            f"llama graphed / qwen3_5 graphed, {lanes}: steady {r['steady']}, first {r['first']} "
            f"(target >= {TARGET})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
