"""The conversion rate of `ignis-build`'s weight step (checkpoint -> .ninfer), per thread count.

    python -m ignis.tools.bench.convert_rate --model CKPT [--drafter DIR] [--card h200]
        [--threads 1,4,16] [--max-params 2e9] [--out-dir /tmp] [--json-out FILE]

Plans the build (`make_plan`, as `ignis-build` does), takes the target's and drafter's tensors in
build order until --max-params parameters, and converts them into a scratch .ninfer with
`IGNIS_BUILD_THREADS` set to each thread count (`convert.write_jobs`, the build's own code). Prints,
per thread count, the wall and CPU seconds and the parameters per second of the q4_g32 and the plain
(bf16) tensors, checks that every thread count wrote the same bytes (sha256), and estimates the
weight step of the whole plan (its parameter count at the measured rates). The checkpoint should sit
in the page cache or RAM (/dev/shm) so the rate is the conversion's, not the disk's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "measure"]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def measure(
    model: Path,
    *,
    drafter: Path | None,
    card: str,
    threads: list[int],
    max_params: float,
    out_dir: Path,
) -> dict[str, Any]:
    """Convert the first `max_params` parameters at each thread count; returns the figures (module
    docstring)."""
    from ignis.compiler.build import convert
    from ignis.compiler.build.plan import make_plan
    from ignis.formats import NinferWriter

    recipe = out_dir / f"convert-rate-{os.getpid()}.toml"
    recipe.write_text('name = "rate"\n[shortlist]\nsize = 1000000000\n')  # the whole vocabulary
    try:
        plan = make_plan(
            card=card, model=model, drafter=drafter, recipe=recipe, out=out_dir / "convert-rate-plan"
        )
    finally:
        recipe.unlink()
    jobs_all = plan.target_jobs + plan.drafter_jobs
    total = {"q4": 0, "plain": 0}
    for j in jobs_all:
        total["q4" if j.dtype == "q4_g32" else "plain"] += math.prod(j.shape)
    jobs, n = [], 0
    for j in jobs_all:
        if n >= max_params:
            break
        jobs.append(j)
        n += math.prod(j.shape)
    counts = {"q4": 0, "plain": 0}
    for j in jobs:
        counts["q4" if j.dtype == "q4_g32" else "plain"] += math.prod(j.shape)
    runs = []
    digests = set()
    for t in threads:
        os.environ[convert.BUILD_THREADS_ENV] = str(t)
        secs = {"q4": [0.0, 0.0], "plain": [0.0, 0.0]}  # wall, cpu
        path = out_dir / f"convert-rate-{os.getpid()}.ninfer"
        with NinferWriter(path, metadata={}) as w:
            for j in jobs:
                kind = "q4" if j.dtype == "q4_g32" else "plain"
                w0, c0 = time.perf_counter(), time.process_time()
                convert.write_jobs(w, [j])
                secs[kind][0] += time.perf_counter() - w0
                secs[kind][1] += time.process_time() - c0
        digests.add(_sha256(path))
        path.unlink()
        rates = {k: counts[k] / v[0] if v[0] else None for k, v in secs.items()}
        estimate = sum(total[k] / r for k, r in rates.items() if r)
        runs.append(
            {
                "threads": t,
                "wall_s": {k: v[0] for k, v in secs.items()},
                "cpu_s": {k: v[1] for k, v in secs.items()},
                "params_per_s": rates,
                "params_per_cpu_s": {k: counts[k] / v[1] if v[1] else None for k, v in secs.items()},
                "estimated_plan_weights_s": estimate,
            }
        )
        print(
            f"threads {t:>3}: q4 {counts['q4'] / 1e9:.2f} B params in {secs['q4'][0]:.1f} s "
            f"({(rates['q4'] or 0) / 1e6:.1f} M/s, cpu {secs['q4'][1]:.1f} s); plain "
            f"{counts['plain'] / 1e9:.2f} B in {secs['plain'][0]:.1f} s; the whole plan "
            f"({(total['q4'] + total['plain']) / 1e9:.1f} B params) ~{estimate:.0f} s",
            flush=True,
        )
    return {
        "model": str(model),
        "card": card,
        "measured_params": counts,
        "plan_params": total,
        "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "same_bytes": len(digests) == 1,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ignis.tools.bench.convert_rate", description=__doc__)
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--drafter", type=Path, default=None)
    p.add_argument("--card", default="h200")
    p.add_argument("--threads", default="1")
    p.add_argument("--max-params", type=float, default=2e9)
    p.add_argument("--out-dir", type=Path, default=Path("/tmp"))
    p.add_argument("--json-out", type=Path, default=None)
    a = p.parse_args(argv)
    threads = [int(t) for t in a.threads.split(",") if t.strip()]
    res = measure(
        a.model, drafter=a.drafter, card=a.card, threads=threads, max_params=a.max_params, out_dir=a.out_dir
    )
    if not res["same_bytes"]:
        print("convert_rate: the thread counts wrote different bytes", file=sys.stderr)
    if a.json_out is not None:
        a.json_out.write_text(json.dumps(res, indent=1) + "\n")
    sys.exit(0 if res["same_bytes"] else 1)


if __name__ == "__main__":
    main()
