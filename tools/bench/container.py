"""Benchmark of the `.ninfer` container (not a test): open a 1 GiB container and get every view
(memory-mapped, no copy), and stream a 2 GiB write with bounded memory.

    python -m ignis.tools.bench.container --json bench-formats.json

Each measured phase runs in its own fresh Python process, so its peak RSS (getrusage ru_maxrss) is its
own; RSS figures are reported as the increase over that process's baseline after imports.

Phases:
  make      write the read benchmark's container (--read-gib, default 1 GiB; tensors of 4 MiB: f32,
            bf16 and q4_g32 mixed); its write rate is reported too.
  open      in a fresh process: NinferReader(...) (preamble + whole-header validation), then a numpy
            view (or q4_g32 part views) and a torch view of every tensor; RSS must not grow by the
            data size (no copy, no page touched); then verify() (crc32 of every byte) for the rate.
  write     in a fresh process: stream --write-gib (default 2 GiB) as 64 MiB tensors produced one at
            a time (each freed before the next), then finish (header, fsync, rename); peak RSS over
            baseline must stay near one tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1024 * 1024
GIB = 1024 * MIB


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def phase_make(path: str, total: int) -> dict[str, Any]:
    from ignis.formats import NinferWriter, quantize_q4_g32

    tensor_bytes = 4 * MIB
    n = total // tensor_bytes
    rng = np.random.default_rng(0)
    base = rng.standard_normal(tensor_bytes // 4, dtype=np.float32)  # 4 MiB of f32
    bf16 = (base.view(np.uint32) >> 16).astype(np.uint16)
    bf16 = np.concatenate([bf16, bf16]).reshape(1024, -1)  # 4 MiB of bf16 bits
    # q4_g32 of a [rows, 4096] matrix stores 2304 bytes per row: 1820 rows ~ 4 MiB
    q4 = quantize_q4_g32(rng.standard_normal((1820, 4096), dtype=np.float32))
    start = time.perf_counter()
    written = 0
    with NinferWriter(path, metadata={"bench": "read", "tensors": n}) as w:
        for i in range(n):
            kind = i % 3
            if kind == 0:
                info = w.add_tensor(f"layers.{i}.f32", base.reshape(1024, -1))
            elif kind == 1:
                info = w.add_tensor(f"layers.{i}.bf16", bf16, dtype="bf16")
            else:
                info = w.add_q4_g32(f"layers.{i}.q4", *q4)
            written += info.length
    seconds = time.perf_counter() - start
    return {"tensors": n, "data_bytes": written, "file_bytes": os.path.getsize(path), "seconds": seconds}


def phase_open(path: str) -> dict[str, Any]:
    import torch

    from ignis.formats import NinferReader

    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    r = NinferReader(path)
    t1 = time.perf_counter()
    views: list[Any] = []
    for name in r:
        if r.info(name).is_block_encoded:
            views.extend(r.parts(name).values())
        else:
            views.append(r.numpy(name))
    t2 = time.perf_counter()
    tviews: list[Any] = []
    for name in r:
        if r.info(name).is_block_encoded:
            tviews.extend(r.torch_parts(name).values())
        else:
            tviews.append(r.torch(name))
    t3 = time.perf_counter()
    rss_views = _rss_bytes()
    data = sum(t.length for t in r.tensors.values())
    zero_copy = all(np.shares_memory(v, r.raw(n)) for v, n in zip(views[:3], list(r)[:3], strict=False))
    bf16 = next(t for t in tviews if t.dtype == torch.bfloat16)
    t4 = time.perf_counter()
    r.verify()
    t5 = time.perf_counter()
    out = {
        "tensors": len(r),
        "data_bytes": data,
        "open_ms": (t1 - t0) * 1e3,
        "numpy_views_ms": (t2 - t1) * 1e3,
        "torch_views_ms": (t3 - t2) * 1e3,
        "views": len(views),
        "rss_growth_after_views_bytes": rss_views - rss0,
        "zero_copy_checked": bool(zero_copy and bf16.dtype == torch.bfloat16),
        "verify_seconds": t5 - t4,
        "verify_gb_per_s": data / (t5 - t4) / 1e9,
        "rss_growth_after_verify_bytes": _rss_bytes() - rss0,
    }
    r.close()
    return out


def phase_write(path: str, total: int) -> dict[str, Any]:
    from ignis.formats import NinferWriter

    tensor_bytes = 64 * MIB
    n = total // tensor_bytes
    rss0 = _rss_bytes()
    start = time.perf_counter()
    with NinferWriter(path, metadata={"bench": "write"}) as w:
        for i in range(n):
            a = np.full(tensor_bytes // 4, i, dtype=np.float32)  # the one tensor held in memory
            w.add_tensor(f"t.{i}", a)
            del a
        t_data = time.perf_counter()
    end = time.perf_counter()
    return {
        "tensors": n,
        "tensor_bytes": tensor_bytes,
        "file_bytes": os.path.getsize(path),
        "seconds": end - start,
        "finish_fsync_rename_seconds": end - t_data,
        "gb_per_s": total / (end - start) / 1e9,
        "baseline_rss_bytes": rss0,
        "peak_rss_bytes": _peak_rss_bytes(),
        # An upper bound: the process peak (imports included) minus the RSS before writing.
        "peak_rss_over_baseline_bytes": _peak_rss_bytes() - rss0,
    }


def _child(phase: str, path: str, total: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "ignis.tools.bench.container", "--phase", phase, "--path", path]
    cmd += ["--bytes", str(total)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"phase {phase} failed:\n{proc.stdout}\n{proc.stderr}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _fmt_mib(n: float) -> str:
    return f"{n / MIB:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory for the temporary files (default: system temp)")
    ap.add_argument("--read-gib", type=float, default=1.0, help="size of the container opened (GiB)")
    ap.add_argument("--write-gib", type=float, default=2.0, help="size of the streamed write (GiB)")
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    ap.add_argument("--keep", action="store_true", help="keep the files written")
    ap.add_argument("--phase", choices=["make", "open", "write"], help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.phase:
        fn = {"make": lambda: phase_make(args.path, args.bytes), "open": lambda: phase_open(args.path)}
        fn["write"] = lambda: phase_write(args.path, args.bytes)
        print(json.dumps(fn[args.phase]()))
        return 0

    work = Path(tempfile.mkdtemp(prefix="ignis-bench-", dir=args.dir))
    try:
        read_path, write_path = str(work / "read.ninfer"), str(work / "write.ninfer")
        make = _child("make", read_path, int(args.read_gib * GIB))
        opened = _child("open", read_path, 0)
        os.unlink(read_path)
        wrote = _child("write", write_path, int(args.write_gib * GIB))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpu(s), {platform.platform()}",
        "python": platform.python_version(),
        "numpy": np.__version__,
        "make": make,
        "open": opened,
        "write": wrote,
    }
    rows = [
        (
            "make: write read container",
            f"{make['data_bytes'] / GIB:.2f} GiB, {make['tensors']} tensors",
            f"{make['seconds']:.2f} s ({make['data_bytes'] / make['seconds'] / 1e9:.2f} GB/s)",
        ),
        ("open: validate header", f"{opened['tensors']} tensors", f"{opened['open_ms']:.2f} ms"),
        ("open: every numpy view", f"{opened['views']} views", f"{opened['numpy_views_ms']:.2f} ms"),
        ("open: every torch view", "bf16 as torch.bfloat16", f"{opened['torch_views_ms']:.2f} ms"),
        (
            "open: RSS growth after all views",
            f"of {_fmt_mib(opened['data_bytes'])} data",
            _fmt_mib(opened["rss_growth_after_views_bytes"]),
        ),
        (
            "open: verify (crc32 all bytes)",
            _fmt_mib(opened["data_bytes"]),
            f"{opened['verify_seconds']:.2f} s ({opened['verify_gb_per_s']:.2f} GB/s)",
        ),
        (
            "write: stream + fsync + rename",
            f"{wrote['file_bytes'] / GIB:.2f} GiB, {wrote['tensors']} x 64 MiB",
            f"{wrote['seconds']:.2f} s ({wrote['gb_per_s']:.2f} GB/s; "
            f"finish {wrote['finish_fsync_rename_seconds']:.2f} s)",
        ),
        (
            "write: peak RSS over baseline",
            f"baseline {_fmt_mib(wrote['baseline_rss_bytes'])}",
            _fmt_mib(wrote["peak_rss_over_baseline_bytes"]),
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
