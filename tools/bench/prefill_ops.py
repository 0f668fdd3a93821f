"""Operator count and wall of one long-prompt prefill chunk on the CPU (issue 24), per layer kind.

    python -m ignis.tools.bench.prefill_ops [--tokens 2048] [--layers 4] [--hidden 256] [--reps 3]
        [--top 25]

A scaled-down `qwen3_5` with the 27B shape's token mixers (Gated DeltaNet: 16 key heads, 48 value
heads of 128 x 128, conv kernel 4; attention: 24 query heads, 4 KV heads of 256) but a narrow trunk
(`--hidden`, intermediate 2x, vocabulary 512; dense random bfloat16 weights) runs one prefill chunk
of `--tokens` tokens (a ``record=False`` forward past ``max_columns``: `StaticHybridExecutor`'s eager
path, the one a 2,048-token `max_prefill_tokens` chunk takes on the GPU) under `torch.profiler`.
Every `--layers`-th layer is full attention (3 GDN : 1 attention, as the 27B), so the per-layer
counts scale to the 27B's 48 GDN + 16 attention layers: the operator calls of a GDN layer and of an
attention layer are what the GPU launches a layer (plus the linears' dequantization there).

Prints the operators by calls (the top `--top`), the totals per GDN layer (calls of `aten::` leaf
operators, `copy_`, elementwise and matmul-family calls; the ``copy_`` of self onto itself that an
in-place ``baddbmm_`` makes is not counted: it returns without a kernel), the same for the chunked rule alone
(`gated_delta_rule_chunked` on the layer's inputs) and the median wall of `--reps` forwards and of
`--reps` calls of the rule alone (CPU wall: a relative figure, not a GPU prediction).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

import torch

from ignis.runtime.families import gated_deltanet as gdn
from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
from ignis.runtime.families.qwen3_5 import Qwen3_5TextConfig, tensor_shapes
from ignis.tools.bench import e2e_gpu

# aten ops that are views / metadata only (no kernel on the GPU)
_VIEWS = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::transpose",
    "aten::permute", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::expand",
    "aten::split", "aten::split_with_sizes", "aten::narrow", "aten::t", "aten::alias", "aten::detach",
    "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_",
    "aten::_unsafe_view", "aten::unbind", "aten::diagonal", "aten::result_type", "aten::is_nonzero",
    "aten::item", "aten::_local_scalar_dense", "aten::contiguous", "aten::to", "aten::_to_copy",
    "aten::matmul", "aten::linear", "aten::numpy_T", "aten::mT", "aten::expand_as", "aten::view_as",
    "aten::broadcast_tensors", "aten::chunk", "aten::new_empty", "aten::new_empty_strided",
    "aten::rms_norm", "aten::_conj", "aten::resolve_conj",
    "aten::resolve_neg", "aten::conv1d", "aten::convolution", "aten::_convolution", "aten::tensor_split",
    "aten::movedim", "aten::swapaxes", "aten::flatten", "aten::unflatten", "aten::new_zeros",
    "aten::zeros", "aten::zeros_like", "aten::ones", "aten::full", "aten::arange", "aten::scalar_tensor",
    "aten::sigmoid", "aten::softplus", "aten::silu", "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::embedding", "aten::index_select_backward",
}  # fmt: skip
_GEMM = ("aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm", "aten::linalg_solve_triangular",
         "aten::baddbmm_", "aten::mkldnn_convolution")  # fmt: skip


_IN_PLACE = ("aten::baddbmm_", "aten::addmm_")


def scaled_config(hidden: int, layers: int) -> Qwen3_5TextConfig:
    """The 27B config with its token mixers' head shapes and a narrow trunk of `layers` layers."""
    return Qwen3_5TextConfig.from_hf(
        dict(
            e2e_gpu.FULL,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            vocab_size=512,
            max_position_embeddings=1 << 16,
        )
    )


def random_weights(cfg: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """Dense bfloat16 random weights of `cfg` (the layout of e2e_gpu.make_weights, no q4)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in tensor_shapes(cfg).items():
        if name.endswith("A_log"):
            t = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log_()
        elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
            t = torch.ones(shape)
        elif name.endswith("conv1d.weight"):
            t = torch.randn(shape, generator=gen) * 0.3
        elif len(shape) == 1:
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        out[name] = t.to(torch.bfloat16)
    return out


def leaf_counts(prof: Any, scope: str | None = None) -> Counter[str]:
    """Calls per aten operator that does its own work (views, dispatch wrappers and allocations out),
    only those under a `record_function` range named `scope` when given."""
    counts: Counter[str] = Counter()
    for e in prof.events():
        if not e.name.startswith("aten::") or e.name in _VIEWS:
            continue
        if e.name == "aten::copy_" and e.cpu_parent is not None and e.cpu_parent.name in _IN_PLACE:
            continue  # an in-place product's copy of self onto itself: returns at once, no kernel
        if scope is not None:
            p = e.cpu_parent
            while p is not None and p.name != scope:
                p = p.cpu_parent
            if p is None:
                continue
        counts[e.name] += 1
    return counts


def _ranged(fn: Any, name: str) -> Any:
    def wrapped(*a: Any, **kw: Any) -> Any:
        with torch.profiler.record_function(name):
            return fn(*a, **kw)

    return wrapped


def summarize(counts: Counter[str], per: int) -> dict[str, float]:
    total = sum(counts.values())
    copies = sum(v for k, v in counts.items() if k in ("aten::copy_", "aten::clone", "aten::cat"))
    gemm = sum(v for k, v in counts.items() if k in _GEMM)
    return {
        "ops": total / per,
        "copies (copy_/clone/cat)": copies / per,
        "matmul/solve": gemm / per,
        "other (elementwise, reductions, fills)": (total - copies - gemm) / per,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    cfg = scaled_config(args.hidden, args.layers)
    n = args.tokens
    ex = StaticHybridExecutor(
        cfg, random_weights(cfg), dtype=torch.bfloat16, max_lanes=1, max_context=n + 16, kv_bucket=256
    )
    n_gdn = sum(1 for i in range(cfg.num_hidden_layers) if not cfg.is_full_attention(i))
    n_attn = cfg.num_hidden_layers - n_gdn
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1))

    def forward() -> None:
        st = ex.new_lane()
        ex.forward([st], [ids], record=False, logits="last")
        ex.commit([st], [n])
        ex.release_lane(st)

    forward()  # warm-up
    acts = [torch.profiler.ProfilerActivity.CPU]
    ex._static_gdn = _ranged(ex._static_gdn, "ignis::gdn_layer")  # type: ignore[method-assign]
    ex._static_attention = _ranged(ex._static_attention, "ignis::attention_layer")  # type: ignore[method-assign]
    with torch.profiler.profile(activities=acts) as prof:
        forward()
    del ex._static_gdn, ex._static_attention  # the class's methods again
    counts = leaf_counts(prof)
    per_gdn = leaf_counts(prof, "ignis::gdn_layer")
    per_attn = leaf_counts(prof, "ignis::attention_layer")
    print(f"config: {n_gdn} GDN + {n_attn} attention layers, hidden {args.hidden}, {n} tokens, bf16, CPU")
    print(f"whole forward: {sum(counts.values())} operator calls")
    print("one GDN mixer (projections, conv, rule, gated norm, out_proj), operator calls:")
    for name, v in per_gdn.most_common(args.top):
        print(f"  {v / n_gdn:6.0f}  {name}")
    print("one attention mixer, operator calls:")
    for name, v in per_attn.most_common(args.top):
        print(f"  {v / n_attn:6.0f}  {name}")

    # the chunked rule alone on one GDN layer's shapes (float32, as the layer feeds it), and (when
    # this tree has it) the prefill entry from the conv output (bf16, key heads shared)
    gen = torch.Generator().manual_seed(2)
    hk, hv, dk, dv = (
        cfg.linear_num_key_heads,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    q = gdn.l2_normalize(torch.randn(n, hv, dk, generator=gen)) * dk**-0.5
    k = gdn.l2_normalize(torch.randn(n, hv, dk, generator=gen))
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen)
    beta = torch.rand(n, hv, generator=gen)
    s0 = torch.zeros(hv, dk, dv)
    calls = {"chunked rule": lambda: gdn.gated_delta_rule_chunked(q, k, v, g, beta, s0)}
    if hasattr(gdn, "gated_delta_prefill"):
        conv = torch.randn(2 * hk * dk + hv * dv, n, generator=gen).to(torch.bfloat16).t()
        qk_raw = conv[:, : 2 * hk * dk].unflatten(-1, (2, hk, dk))
        v_raw = conv[:, 2 * hk * dk :].unflatten(-1, (hv, dv))
        calls["prefill entry"] = lambda: gdn.gated_delta_prefill(qk_raw, v_raw, g, beta, s0)
    alone: dict[str, tuple[Counter[str], float]] = {}
    for label, fn in calls.items():
        fn()
        with torch.profiler.profile(activities=acts) as prof_fn:
            fn()
        secs = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn()
            secs.append(time.perf_counter() - t0)
        alone[label] = (leaf_counts(prof_fn), statistics.median(secs))
    rule = alone["chunked rule"][0]
    fwd_s = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        forward()
        fwd_s.append(time.perf_counter() - t0)
    print("\nchunked rule alone, operator calls:")
    for name, val in rule.most_common(args.top):
        print(f"  {val:6d}  {name}")
    print(f"\n| scope | {' | '.join(summarize(rule, 1))} |")
    print("|---|" + "---|" * 4)
    rows = [
        *((f"{label} alone ({n} tokens)", summarize(cnt, 1)) for label, (cnt, _) in alone.items()),
        ("GDN mixer, a layer", summarize(per_gdn, n_gdn)),
        ("attention mixer, a layer", summarize(per_attn, n_attn)),
        ("whole forward, a layer (incl. MLP, norms)", summarize(counts, n_gdn + n_attn)),
    ]
    for label, row in rows:
        print(f"| {label} | {' | '.join(f'{x:.0f}' for x in row.values())} |")
    walls = ", ".join(f"{label} alone {secs * 1e3:.0f} ms" for label, (_, secs) in alone.items())
    print(f"\nwall (median of {args.reps}): forward {statistics.median(fwd_s) * 1e3:.0f} ms, {walls}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
