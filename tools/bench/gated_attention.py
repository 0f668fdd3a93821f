"""Benchmark the fused gated attention (``gated_attention`` of the fused mixers' module) against the
torch path it replaces in ``StaticHybridExecutor._static_attention`` (two cache gathers, the mask,
SDPA, the head permutes, sigmoid and the gate multiply), on the 27B-shaped qwen3_5 attention layer
(24 query heads, 4 kv heads, head_dim 256, bf16), 1 lane and 8 lanes, per round width and context.

    python -m ignis.tools.bench.gated_attention --mixers-module .device/final/fused_mixers_sm90.so \\
        [--out DIR] [--contexts 16,1024,4096,16384] [--widths 1,8,32]

Prints a table (microseconds a call, median of CUDA-event timings of 50 calls after 10 warm-up
calls; max |fused - torch| over the outputs) and writes ``bench_gated_attention.json`` to OUT.
Needs a CUDA GPU and the lean runtime (tvm-ffi, ``IGNIS_TVM_LIB_DIR``).

Raises:
    SystemExit: no CUDA device, or a module without ``gated_attention``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 24, 4, 256  # Qwen3.5-27B full attention (public config)


def torch_path(q, kc, vc, gate, pos, slots, bucket: int, lanes: int, n: int) -> torch.Tensor:
    """The executor's SDPA route (`_static_attention` after qk_norm_rope_kv)."""
    rows, nh, hd = q.shape
    nkv = kc.shape[2]
    rep = nh // nkv
    mask = torch.arange(bucket, device=q.device)[None, None, :] <= pos.view(lanes, n)[:, :, None]
    mask = mask[:, None].expand(lanes, rep, n, bucket).reshape(lanes, 1, rep * n, bucket)
    keys = kc[:, :bucket].index_select(0, slots).transpose(1, 2)
    values = vc[:, :bucket].index_select(0, slots).transpose(1, 2)
    qq = q.view(lanes, n, nkv, rep, hd).permute(0, 2, 3, 1, 4).reshape(lanes, nkv, rep * n, hd)
    o = F.scaled_dot_product_attention(qq, keys, values, attn_mask=mask, scale=hd**-0.5)
    o = o.view(lanes, nkv, rep, n, hd).permute(0, 3, 1, 2, 4).reshape(rows, nh * hd)
    return o * torch.sigmoid(gate.reshape(rows, nh * hd))


def time_us(fn, reps: int = 50, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixers-module", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--contexts", default="16,1024,4096,16384")
    ap.add_argument("--widths", default="1,8,32")
    ap.add_argument("--lanes", default="1,8")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    from ignis.runtime.kernels.fused_mixers import FusedMixersKernel

    mixers = FusedMixersKernel(args.mixers_module)
    if not mixers.has_gated_attention:
        raise SystemExit(f"{args.mixers_module} has no gated_attention (built before it)")
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for lanes in (int(x) for x in args.lanes.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            for n in (int(x) for x in args.widths.split(",")):
                if lanes * n > 64:
                    continue
                bucket = ctx + n
                kc = torch.randn(lanes, bucket, KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=gen)
                vc = torch.randn(lanes, bucket, KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=gen)
                q = torch.randn(lanes * n, HEADS, HEAD_DIM, device=dev, dtype=dt, generator=gen)
                gate = torch.randn(lanes * n, HEADS, 2 * HEAD_DIM, device=dev, dtype=dt, generator=gen)
                gate = gate[..., HEAD_DIM:]
                slots = torch.arange(lanes, device=dev)
                pos = (ctx + torch.arange(n, device=dev))[None, :].expand(lanes, n).reshape(-1).contiguous()
                fused = partial(mixers.gated_attention, q, kc, vc, gate, pos, slots, bucket, HEAD_DIM**-0.5)
                plain = partial(torch_path, q, kc, vc, gate, pos, slots, bucket, lanes, n)

                diff = float((fused().float() - plain().float()).abs().max())
                row = {
                    "lanes": lanes,
                    "columns": n,
                    "context": ctx,
                    "fused_us": round(time_us(fused), 1),
                    "torch_us": round(time_us(plain), 1),
                    "max_abs_diff": round(diff, 4),
                }
                kv_bytes = 2 * lanes * (ctx + n) * KV_HEADS * HEAD_DIM * 2
                row["fused_kv_GBps"] = round(kv_bytes / row["fused_us"] / 1e3, 1)
                rows_out.append(row)
                print(row, flush=True)
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(),
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
        "rows": rows_out,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_gated_attention.json").write_text(json.dumps(res, indent=1))
    print()
    print("| lanes | columns | context | fused us | torch path us | speed-up | KV GB/s | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows_out:
        print(
            f"| {r['lanes']} | {r['columns']} | {r['context']} | {r['fused_us']} | {r['torch_us']} | "
            f"{r['torch_us'] / r['fused_us']:.1f}x | {r['fused_kv_GBps']} | {r['max_abs_diff']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
