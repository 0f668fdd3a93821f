"""Benchmark of the q4_g32 linear kernels on the chain of 8 layers x (5120 -> 17408 -> 5120).

Two steps, because the GPU host has no TVM compiler:

  python -m ignis.tools.bench.q4_linear build --out .device/q4     # build host (tvm + nvcc)
  python -m ignis.tools.bench.q4_linear run --modules .device/q4 --out $OUT   # GPU host

``run`` needs only torch, tvm_ffi and TVM's runtime libraries (``--tvm-lib`` or
``$IGNIS_TVM_LIB_DIR``). On fresh random data it prints, side by side per row width: ours (the
modules ``build_q4_linear`` makes, f16 and bf16), the best tile configuration of a sweep, TVM
dlight's default schedules, cuBLAS bf16 on the dequantized weights (torch), torch's int4 tinygemm,
and the Q4 bytes floor at the measured copy bandwidth; plus each kernel's error against a float64
reference. Everything is written as JSON under ``--out``. Each chain is timed as CUDA-graph
replays (16 launches per replay), median of per-replay device-event times.

Focused iterations (same two-step pattern): ``build-decode`` / ``decode`` (1..8 rows, split-K
candidates against an earlier ``build``) and ``build-wide`` / ``wide`` (layout-"n" candidates, per
shape at their widths, then the best (up, down) pairs per width bucket timed on the whole chain);
``profile --wide`` launches chosen candidates for ncu.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

NUM_LAYERS = 8
HIDDEN = 5120
INTER = 17408
SHAPES = {"up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}  # name: (out_features, in_features)
WIDTHS = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 28, 32]
DLIGHT_WIDTHS = [1, 8, 16, 32]
TINYGEMM_WIDTHS = [1, 2, 4, 8, 16, 32]
# Sweep: tile configurations per n-tile count, and the row widths each is timed at.
SWEEP_WIDTHS = {1: [1, 8], 2: [16], 3: [24], 4: [32]}


def sweep_configs() -> list[Any]:
    from ignis.compiler.kernels.q4_linear import Q4TileConfig as C

    cfgs = []
    # (n_tiles, m_tiles, warps, stages, x_ring, min_blocks); vec 1 throughout
    for nt, mt, w, st, xr, mb in (
        (1, 2, 4, 4, True, 1),
        (1, 1, 8, 4, False, 1),
        (1, 2, 8, 3, True, 1),
        (1, 1, 8, 4, False, 4),
        (1, 1, 4, 4, False, 8),
        (1, 2, 4, 3, True, 4),
        (1, 2, 4, 2, True, 5),
        (1, 1, 4, 3, True, 6),
        (1, 1, 8, 3, True, 3),
        (2, 4, 4, 3, True, 1),
        (2, 2, 8, 4, False, 1),
        (2, 2, 4, 3, True, 3),
        (3, 2, 4, 3, True, 1),
        (3, 2, 8, 4, False, 1),
        (4, 2, 8, 2, True, 1),
        (4, 2, 8, 4, False, 1),
        (4, 2, 4, 2, True, 2),
    ):
        cfgs.append(C(nt, mt, w, st, nt == 1 and not xr, vec=1, x_ring=xr, min_blocks=mb))
    cfgs += [C(1, 1, 8, 4, False, vec=1, min_blocks=4), C(1, 1, 4, 4, False, vec=1, min_blocks=8)]
    return cfgs


# ----------------------------------------------------------------------------------------------
# build (on the build host)


def cmd_build(args: argparse.Namespace) -> None:
    from ignis.compiler.kernels.q4_linear import (
        build_q4_cuda_bundle,
        build_q4_linear,
        build_q4_tir_bundle,
        cuda_binary_info,
        default_tile_config,
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"built": time.strftime("%Y-%m-%dT%H:%M:%S"), "api": {}, "sm_120": {}}
    t0 = time.time()

    # 1. The modules build_q4_linear makes (what the artifact pipeline ships), per shape and width.
    archs = (("sm_90", "api"),) if args.skip_sm120 else (("sm_90", "api"), ("sm_120", "sm_120"))
    for arch, key in archs:
        for shape, (n, k) in SHAPES.items():
            for rows in WIDTHS:
                src = build_q4_linear({"kind": "cuda", "arch": arch}, n, k, rows)
                dest = out / arch / src.name
                dest.parent.mkdir(exist_ok=True)
                if not dest.exists():
                    shutil.copy2(src, dest)
                info = cuda_binary_info(dest)
                if not info.is_binary_only or info.sass_archs != (arch,):
                    raise SystemExit(f"{dest} does not hold {arch} SASS only: {info}")
                manifest[key][f"{shape}_r{rows}"] = {
                    "file": f"{arch}/{src.name}",
                    "tile": default_tile_config(rows, n, k, arch=arch).tag,
                }
        print(f"[build] {arch} modules: {time.time() - t0:.0f}s", flush=True)

    # 2. The sweep bundle (sm_90 only: it is measured, not shipped).
    if not args.skip_sweep:
        cfgs = sweep_configs()
        exports = {f"q4_{c.tag}": c for c in cfgs}
        build_q4_cuda_bundle("sm_90", exports, out / "sweep_sm90.so")
        manifest["sweep"] = {name: c.tag for name, c in exports.items()}
        print(f"[build] sweep bundle ({len(exports)} configs): {time.time() - t0:.0f}s", flush=True)

    # 3. TVM dlight default schedules (the baseline).
    if not args.skip_dlight:
        funcs = {
            f"dlight_{shape}_r{rows}": (rows, n, k, "float16")
            for shape, (n, k) in SHAPES.items()
            for rows in DLIGHT_WIDTHS
        }
        build_q4_tir_bundle({"kind": "cuda", "arch": "sm_90"}, funcs, out / "dlight_sm90.so")
        info = cuda_binary_info(out / "dlight_sm90.so")
        if not info.is_binary_only:
            raise SystemExit(f"dlight module is not a binary: {info}")
        manifest["dlight"] = sorted(funcs)
        print(f"[build] dlight bundle: {time.time() - t0:.0f}s", flush=True)

    # 4. The lean runtime's libraries (what a deployment host gets).
    import importlib.util

    spec = importlib.util.find_spec("tvm")
    assert spec is not None and spec.submodule_search_locations
    lib_src = Path(next(iter(spec.submodule_search_locations))) / "lib"
    lib_dst = out / "tvm_lib"
    lib_dst.mkdir(exist_ok=True)
    for name in ("libtvm_runtime.so", "libtvm_runtime_cuda.so"):
        shutil.copy2(lib_src / name, lib_dst / name)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"[build] done in {time.time() - t0:.0f}s, {total / 2**20:.1f} MiB under {out}")


# ----------------------------------------------------------------------------------------------
# run (on the GPU host)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.torch = torch
        self.args = args
        self.dev = torch.device("cuda")
        self.results: dict[str, Any] = {"timings_ms": {}, "errors": {}, "notes": []}

    # -- helpers --------------------------------------------------------------------------------

    def note(self, msg: str) -> None:
        print(msg, flush=True)
        self.results["notes"].append(msg)

    def time_chain(self, enqueue: Any, *, reps: int | None = None, ffi: bool = True) -> tuple[float, str]:
        """Median device time (ms) of one replay of `enqueue` captured in a CUDA graph."""
        import tvm_ffi

        torch = self.torch
        reps = reps or self.args.reps
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), tvm_ffi.use_torch_stream():
            for _ in range(2):
                enqueue()
        torch.cuda.synchronize()
        mode = "graph"
        try:
            graph = torch.cuda.CUDAGraph()
            with tvm_ffi.use_torch_stream(torch.cuda.graph(graph)):
                enqueue()
            run = graph.replay
        except Exception as exc:  # capture unsupported: time eager launches instead
            torch.cuda.synchronize()
            mode = f"eager ({type(exc).__name__})"

            def run() -> None:
                with tvm_ffi.use_torch_stream():
                    enqueue()

        for _ in range(3):
            run()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
        return statistics.median(times), mode

    # -- setup ----------------------------------------------------------------------------------

    def _setup_old_new(self) -> tuple[Path, dict[str, Any], dict[str, Any], float]:
        """Shared start of the old-vs-new benches (`DecodeBench`, `WideBench`): load the TVM runtime
        and both manifests, record the environment, measure the copy bandwidth, make the weights,
        load the old modules. Returns (new_dir, new manifest, old functions by tag, start time s)."""
        from ignis.runtime.kernels.tvm_runtime import load_module, load_tvm_runtime

        torch, args = self.torch, self.args
        old_dir, new_dir = Path(args.old), Path(args.new)
        old_man = json.loads((old_dir / "manifest.json").read_text())
        new_man = json.loads((new_dir / "manifest.json").read_text())
        load_tvm_runtime(cuda=True, lib_dir=args.tvm_lib or (old_dir / "tvm_lib"))
        props = torch.cuda.get_device_properties(0)
        self.results["env"] = {
            "gpu": props.name,
            "sms": props.multi_processor_count,
            "torch": torch.__version__,
        }
        self.results["ptxas"] = new_man.get("ptxas", [])
        self.note(f"[env] {self.results['env']}")
        t0 = time.time()
        bw = self.measure_copy_bandwidth()
        self.make_weights()
        self.results.update(copy_tbps=bw, weight_bytes=self.weight_bytes)
        self.results["floor_ms"] = self.weight_bytes / (bw * 1e12) * 1e3
        self.note(f"[setup] copy {bw:.2f} TB/s, floor {self.results['floor_ms']:.3f} ms")
        old = {k: load_module(old_dir / v["file"], cuda=True)["q4_linear"] for k, v in old_man["api"].items()}
        return new_dir, new_man, old, t0

    def measure_copy_bandwidth(self) -> float:
        torch = self.torch
        n = 1 << 30  # 2 GiB of f16 per buffer
        a = torch.randn(n // 2, device=self.dev, dtype=torch.float16)
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            b.copy_(a)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        ms = statistics.median(times)
        del a, b
        return 2 * n / (ms * 1e-3) / 1e12  # TB/s, read + write

    def make_weights(self) -> None:
        """Fresh random Q4 weights for the chain: 8 x (up, down)."""
        torch = self.torch
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(int.from_bytes(os.urandom(4), "little"))
        self.layers: list[dict[str, Any]] = []
        for _ in range(NUM_LAYERS):
            layer = {}
            for shape, (n, k) in SHAPES.items():
                bits = torch.randint(
                    0, 1 << 32, (n, k // 8), device=self.dev, dtype=torch.int64, generator=gen
                )
                qw = bits.to(torch.int32)  # wraps: every nibble uniform in 0..15
                del bits
                # Keep activations O(1) through the chain: std((q-8) s) sqrt(k) ~ 1.
                s = (torch.rand((n, k // 32), device=self.dev, generator=gen) + 0.5) / (4.6 * k**0.5)
                layer[shape] = {"qw": qw, "qw_u32": qw.view(torch.uint32), "scales": s.to(torch.float16)}
            self.layers.append(layer)
        self.weight_bytes = sum(
            t["qw"].numel() * 4 + t["scales"].numel() * 2 for layer in self.layers for t in layer.values()
        )

    def dequant(self, qw: Any, scales: Any, dtype: Any) -> Any:
        """The dense weight (exact: `ignis.runtime.linear.dequantize_q4`), in `dtype`."""
        from ignis.runtime.linear import dequantize_q4

        return dequantize_q4(qw, scales, dtype)

    # -- methods --------------------------------------------------------------------------------

    def chain_buffers(self, rows: int, dtype: Any, zeros: bool = False) -> list[Any]:
        torch = self.torch
        make = torch.zeros if zeros else torch.randn  # random, not empty: zeros only as a diagnostic
        bufs = [make(rows, HIDDEN, device=self.dev, dtype=dtype)]
        for _ in range(NUM_LAYERS):
            bufs.append(make(rows, INTER, device=self.dev, dtype=dtype))
            bufs.append(make(rows, HIDDEN, device=self.dev, dtype=dtype))
        return bufs

    def q4_chain(
        self,
        funcs: dict[str, Any],
        rows: int,
        dtype: Any,
        only: str | None = None,
        u32: bool = False,
        zeros: bool = False,
    ) -> Any:
        bufs = self.chain_buffers(rows, dtype, zeros)
        key = "qw_u32" if u32 else "qw"

        def enqueue() -> None:
            for i, layer in enumerate(self.layers):
                x, h, y = bufs[2 * i], bufs[2 * i + 1], bufs[2 * i + 2]
                if only in (None, "up"):
                    funcs["up"](x, layer["up"][key], layer["up"]["scales"], h)
                if only in (None, "down"):
                    src = h if only is None else bufs[2 * i + 1]
                    funcs["down"](src, layer["down"][key], layer["down"]["scales"], y)

        return enqueue

    def run(self) -> None:
        try:
            self._run()
        finally:
            out = Path(self.args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "q4_bench.json").write_text(json.dumps(self.results, indent=1))
            if "floor_ms" in self.results:
                self.print_table()

    def _run(self) -> None:
        import tvm_ffi

        torch = self.torch
        args = self.args
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        mods = Path(args.modules)
        manifest = json.loads((mods / "manifest.json").read_text())
        from ignis.runtime.kernels.tvm_runtime import load_module, load_tvm_runtime

        load_tvm_runtime(cuda=True, lib_dir=args.tvm_lib or (mods / "tvm_lib"))
        props = torch.cuda.get_device_properties(0)
        self.results["env"] = {
            "gpu": props.name,
            "sms": props.multi_processor_count,
            "torch": torch.__version__,
            "tvm_ffi": tvm_ffi.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        self.note(f"[env] {self.results['env']}")
        t_start = time.time()
        bw = self.measure_copy_bandwidth()
        self.make_weights()
        floor_ms = self.weight_bytes / (bw * 1e12) * 1e3
        self.results["copy_tbps"] = bw
        self.results["weight_bytes"] = self.weight_bytes
        self.results["floor_ms"] = floor_ms
        self.note(
            f"[setup] copy {bw:.2f} TB/s; Q4 bytes {self.weight_bytes / 1e6:.0f} MB; "
            f"floor {floor_ms:.3f} ms; {time.time() - t_start:.0f}s"
        )
        T = self.results["timings_ms"]
        E = self.results["errors"]

        # Numerics (and module loading) first: if a kernel is wrong, its timing means nothing.
        api = {
            key: load_module(mods / v["file"], cuda=True)["q4_linear"] for key, v in manifest["api"].items()
        }
        w_ref = {
            shape: self.dequant(self.layers[0][shape]["qw"], self.layers[0][shape]["scales"], torch.float64)
            for shape in SHAPES
        }
        for dtype, dname in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
            for rows in WIDTHS:
                for shape, (n, k) in SHAPES.items():
                    x = torch.randn(rows, k, device=self.dev, dtype=dtype)
                    y = torch.full((rows, n), float("nan"), device=self.dev, dtype=dtype)
                    with tvm_ffi.use_torch_stream():
                        api[f"{shape}_r{rows}"](
                            x, self.layers[0][shape]["qw"], self.layers[0][shape]["scales"], y
                        )
                    ref = x.double() @ w_ref[shape].T
                    err = ((y.double() - ref).norm() / ref.norm()).item()
                    if not torch.isfinite(y).all():
                        err = float("nan")
                    E[f"ours_{dname}_{shape}_r{rows}"] = err
        self.note(
            "[numerics] ours done; "
            f"worst f16 {max(v for k, v in E.items() if k.startswith('ours_f16')):.2e}, "
            f"worst bf16 {max(v for k, v in E.items() if k.startswith('ours_bf16')):.2e}"
        )

        # Ours: the shipped modules, whole chain, per width and dtype.
        for dtype, dname in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
            for rows in WIDTHS:
                funcs = {s: api[f"{s}_r{rows}"] for s in SHAPES}
                T[f"ours_{dname}_r{rows}"], mode = self.time_chain(self.q4_chain(funcs, rows, dtype))
        self.note(f"[ours] chain timed ({mode}); {time.time() - t_start:.0f}s")

        # Sweep of tile configurations, per shape (8 layers of one shape), f16.
        if "sweep" in manifest:
            try:
                self.run_sweep(mods, t_start)
            except Exception as exc:
                self.note(f"[sweep] failed: {type(exc).__name__}: {exc}")
        self.run_baselines(mods, manifest, t_start, w_ref)
        for rows in (1, 8, 32):
            funcs = {s: api[f"{s}_r{rows}"] for s in SHAPES}
            T[f"ours_f16_r{rows}_again"], _ = self.time_chain(self.q4_chain(funcs, rows, torch.float16))

    def run_sweep(self, mods: Path, t_start: float) -> None:
        from ignis.runtime.kernels.tvm_runtime import load_module

        torch = self.torch
        T = self.results["timings_ms"]
        manifest = json.loads((mods / "manifest.json").read_text())
        if True:
            sw = load_module(mods / "sweep_sm90.so", cuda=True)
            sweep_t: dict[str, float] = {}
            for name, tag in manifest["sweep"].items():
                nt = int(tag.split("_")[0][2:])
                f = sw[name]
                for rows in SWEEP_WIDTHS[nt] if "streamonly" not in tag else [1]:
                    for shape in SHAPES:
                        ms, _ = self.time_chain(
                            self.q4_chain({"up": f, "down": f}, rows, torch.float16, only=shape), reps=20
                        )
                        sweep_t[f"{tag}|{shape}|r{rows}"] = ms
            self.results["sweep_ms"] = sweep_t
            best: dict[str, Any] = {}
            for key, ms in sweep_t.items():
                tag, shape, r = key.split("|")
                if "streamonly" in tag:
                    continue
                bk = f"{shape}|{r}"
                if bk not in best or ms < best[bk][1]:
                    best[bk] = (tag, ms)
            self.results["sweep_best"] = best
            self.note(f"[sweep] {len(sweep_t)} timings; {time.time() - t_start:.0f}s")
            for bk, (tag, ms) in sorted(best.items()):
                self.note(f"[sweep] best {bk}: {tag} {ms:.4f} ms (8 layers)")
            # One kernel alone (a graph of one launch) against the 8-layer chains: the per-kernel cost.
            for tag in sorted({t for t, _ in best.values() if t.startswith("nt1_")}):
                f = sw[f"q4_{tag}"]
                for shape in SHAPES:
                    saved = self.layers
                    self.layers = saved[:1]
                    try:
                        ms, _ = self.time_chain(
                            self.q4_chain({"up": f, "down": f}, 1, torch.float16, only=shape)
                        )
                    finally:
                        self.layers = saved
                    sweep_t[f"{tag}|{shape}|r1|single"] = ms
            # torch reading each weight matrix once (a reduction): the read floor with kernel boundaries.
            for shape in SHAPES:

                def enqueue(shape: str = shape) -> None:
                    for layer in self.layers:
                        torch.sum(layer[shape]["qw"].view(torch.float32))

                ms, _ = self.time_chain(enqueue)
                sweep_t[f"torch_sum|{shape}|r0"] = ms
            sweep_t["torch_sum|chain|r0"], _ = self.time_chain(
                lambda: [
                    torch.sum(layer[s]["qw"].view(torch.float32)) for layer in self.layers for s in SHAPES
                ]
            )
            # Best configurations composed into the whole chain.
            for widths in SWEEP_WIDTHS.values():
                for rows in widths:
                    funcs = {s: sw[f"q4_{best[f'{s}|r{rows}'][0]}"] for s in SHAPES}
                    T[f"sweepbest_f16_r{rows}"], _ = self.time_chain(
                        self.q4_chain(funcs, rows, torch.float16)
                    )
                    T[f"sweepbest_bf16_r{rows}"], _ = self.time_chain(
                        self.q4_chain(funcs, rows, torch.bfloat16)
                    )

    def run_baselines(
        self, mods: Path, manifest: dict[str, Any], t_start: float, w_ref: dict[str, Any]
    ) -> None:
        # cuBLAS bf16 on the same (dequantized) weights.
        try:
            self.run_cublas(t_start)
        except Exception as exc:
            self.note(f"[cublas] failed: {type(exc).__name__}: {exc}")
        self.run_dlight(mods, manifest, t_start, w_ref)
        self.run_tinygemm(t_start, w_ref)

    def run_cublas(self, t_start: float) -> None:
        torch = self.torch
        T = self.results["timings_ms"]
        wb = [
            {s: self.dequant(layer[s]["qw"], layer[s]["scales"], torch.bfloat16) for s in SHAPES}
            for layer in self.layers
        ]
        for rows in WIDTHS:
            bufs = self.chain_buffers(rows, torch.bfloat16)

            def enqueue(bufs: list[Any] = bufs) -> None:
                for i, layer in enumerate(wb):
                    torch.matmul(bufs[2 * i], layer["up"].T, out=bufs[2 * i + 1])
                    torch.matmul(bufs[2 * i + 1], layer["down"].T, out=bufs[2 * i + 2])

            T[f"cublas_bf16_r{rows}"], _ = self.time_chain(enqueue)

        torch.cuda.empty_cache()
        self.note(f"[cublas] done; {time.time() - t_start:.0f}s")

    def run_dlight(self, mods: Path, manifest: dict[str, Any], t_start: float, w_ref: dict[str, Any]) -> None:
        import tvm_ffi

        from ignis.runtime.kernels.tvm_runtime import load_module

        torch = self.torch
        T, E = self.results["timings_ms"], self.results["errors"]
        # TVM dlight defaults (f16).
        if "dlight" in manifest:
            try:
                dlm = load_module(mods / "dlight_sm90.so", cuda=True)
                for rows in DLIGHT_WIDTHS:
                    funcs = {s: dlm[f"dlight_{s}_r{rows}"] for s in SHAPES}
                    x = torch.randn(rows, HIDDEN, device=self.dev, dtype=torch.float16)
                    y = torch.full((rows, INTER), float("nan"), device=self.dev, dtype=torch.float16)
                    with tvm_ffi.use_torch_stream():
                        funcs["up"](x, self.layers[0]["up"]["qw_u32"], self.layers[0]["up"]["scales"], y)
                    ref = x.double() @ w_ref["up"].T
                    E[f"dlight_f16_up_r{rows}"] = ((y.double() - ref).norm() / ref.norm()).item()
                    T[f"dlight_f16_r{rows}"], mode = self.time_chain(
                        self.q4_chain(funcs, rows, torch.float16, u32=True), reps=20
                    )
                self.note(f"[dlight] done ({mode}); {time.time() - t_start:.0f}s")
            except Exception as exc:
                self.note(f"[dlight] failed: {type(exc).__name__}: {exc}")

    def run_tinygemm(self, t_start: float, w_ref: dict[str, Any]) -> None:
        torch = self.torch
        T, E = self.results["timings_ms"], self.results["errors"]
        # torch int4 tinygemm (bf16 activations), same codes and scales, zero points 0.
        try:
            packs = []
            for layer in self.layers:
                lp = {}
                for s, (n, k) in SHAPES.items():
                    qw = layer[s]["qw"]
                    shifts = torch.arange(0, 32, 4, device=self.dev, dtype=torch.int32)
                    q = ((qw.unsqueeze(-1) >> shifts) & 15).reshape(n, k)
                    u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
                    packed = torch.ops.aten._convert_weight_to_int4pack(u8, 8)
                    sz = torch.zeros((k // 32, n, 2), device=self.dev, dtype=torch.bfloat16)
                    sz[:, :, 0] = layer[s]["scales"].T.to(torch.bfloat16)
                    lp[s] = (packed, sz)
                packs.append(lp)
            x = torch.randn(4, HIDDEN, device=self.dev, dtype=torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm(x, packs[0]["up"][0], 32, packs[0]["up"][1])
            ref = x.double() @ w_ref["up"].T
            E["tinygemm_bf16_up_r4"] = ((y.double() - ref).norm() / ref.norm()).item()
            for rows in TINYGEMM_WIDTHS:
                bufs = self.chain_buffers(rows, torch.bfloat16)

                def enqueue(bufs: list[Any] = bufs) -> None:
                    h = bufs[0]
                    for lp in packs:
                        h = torch.ops.aten._weight_int4pack_mm(h, lp["up"][0], 32, lp["up"][1])
                        h = torch.ops.aten._weight_int4pack_mm(h, lp["down"][0], 32, lp["down"][1])

                T[f"tinygemm_bf16_r{rows}"], _ = self.time_chain(enqueue)

            self.note(f"[tinygemm] done; {time.time() - t_start:.0f}s")
        except Exception as exc:
            self.note(f"[tinygemm] failed: {type(exc).__name__}: {exc}")

        self.results["wall_s"] = time.time() - t_start

    def print_table(self) -> None:
        T, E, r = self.results["timings_ms"], self.results["errors"], self.results

        def f(key: str) -> str:
            v = T.get(key)
            return f"{v:7.3f}" if v is not None else "     - "

        print()
        print(
            f"q4_g32 chain 8 x (5120->17408->5120), {r['weight_bytes'] / 1e6:.0f} MB Q4; "
            f"copy {r['copy_tbps']:.2f} TB/s -> floor {r['floor_ms']:.3f} ms; "
            "times in ms (graph replay, median)"
        )
        head = ["R", "ours f16", "ours bf16", "sweep f16", "dlight f16", "cuBLAS bf16", "tinygemm"]
        print(" | ".join([*head, "%floor(f16)", "err f16", "err bf16"]))
        keys = ["ours_f16", "ours_bf16", "sweepbest_f16", "dlight_f16", "cublas_bf16", "tinygemm_bf16"]
        for rows in WIDTHS:
            of = T.get(f"ours_f16_r{rows}")
            pct = f"{100 * r['floor_ms'] / of:6.1f}%" if of else "   -  "
            cells = [f"{rows:2d}"] + [f(f"{k}_r{rows}") for k in keys]
            print(" | ".join([*cells, pct, _err(E, "f16", rows), _err(E, "bf16", rows)]))
        again = [f"r{x}: {T.get(f'ours_f16_r{x}_again', float('nan')):.3f}" for x in (1, 8, 32)]
        print("ours f16 timed again at the end: " + ", ".join(again))


def _err(E: dict[str, float], dname: str, rows: int) -> str:
    vals = [E[k] for k in (f"ours_{dname}_up_r{rows}", f"ours_{dname}_down_r{rows}") if k in E]
    return f"{max(vals):7.1e}" if vals else "     - "


def cmd_profile(args: argparse.Namespace) -> None:
    """Run a few sweep kernels a few times each (for ncu): up and down, at the given widths."""
    import torch
    import tvm_ffi

    from ignis.runtime.kernels.tvm_runtime import load_module, load_tvm_runtime

    mods = Path(args.modules)
    load_tvm_runtime(cuda=True, lib_dir=args.tvm_lib or (mods / "tvm_lib"))
    if args.wide:  # a `build-wide` output: --tags are candidate names
        man = json.loads((Path(args.wide) / "manifest.json").read_text())
        bundles = {b: load_module(Path(args.wide) / b, cuda=True) for b in set(man["bundles"].values())}
        funcs = {k: bundles[man["bundles"][k]][f"q4_{k}"] for k in man["bundles"]}
    else:
        sw = load_module(mods / "sweep_sm90.so", cuda=True)
        funcs = {tag: sw[f"q4_{tag}"] for tag in args.tags.split(",")}
    dev = torch.device("cuda")
    for tag in args.tags.split(","):
        f = funcs[tag]
        for rows in [int(r) for r in args.rows.split(",")]:
            for shape, (n, k) in SHAPES.items():
                qw = torch.randint(-(1 << 31), (1 << 31) - 1, (n, k // 8), device=dev, dtype=torch.int32)
                sc = ((torch.rand(n, k // 32, device=dev) + 0.5) / (4.6 * k**0.5)).to(torch.float16)
                x = torch.randn(rows, k, device=dev, dtype=torch.float16)
                y = torch.empty(rows, n, device=dev, dtype=torch.float16)
                with tvm_ffi.use_torch_stream():
                    f(x, qw, sc, y)
                torch.cuda.synchronize()
                print(f"[profile] {tag} {shape} r{rows} done", flush=True)


# ----------------------------------------------------------------------------------------------
# decode: old shipped modules against new kernel variants, rows 1..8 only (one focused run)

DECODE_WIDTHS = [1, 2, 3, 4, 5, 6, 7, 8]
DECODE_BUCKETS = ((1, 4), (5, 8))  # the width buckets of the frozen rules (_WIDE_RULES / _NARROW_RULES)


def decode_configs() -> dict[str, Any]:
    """Candidates for rows 1..8: the frozen tiles (fragment prefetch off) and prefetch variants."""
    from ignis.compiler.kernels.q4_linear import Q4TileConfig as C

    return {
        # the frozen decode tiles (run 7), rebuilt from the current source
        "A": C(1, 2, 4, 3, False, x_ring=True, min_blocks=4),  # up, 1..4 rows
        "B": C(1, 2, 8, 3, False, x_ring=True),  # up, 5..8 rows
        "C": C(1, 1, 8, 4, True),  # down, 1..8 rows
        # up: fragment prefetch
        "u1": C(1, 2, 4, 3, False, x_ring=True, min_blocks=4, frag_prefetch=1),
        "u2": C(1, 2, 4, 3, False, x_ring=True, min_blocks=4, frag_prefetch=2),
        "u3": C(1, 2, 4, 4, False, x_ring=True, frag_prefetch=1),
        "u4": C(1, 2, 4, 3, False, x_ring=True, frag_prefetch=1),
        "u5": C(1, 2, 8, 3, False, x_ring=True, frag_prefetch=1),
        # down: fragment prefetch
        "d1": C(1, 1, 8, 4, True, frag_prefetch=1),
        "d2": C(1, 1, 8, 4, True, min_blocks=3, frag_prefetch=1),
        "d3": C(1, 1, 8, 5, True, min_blocks=3, frag_prefetch=1),
        "d5": C(1, 1, 8, 4, False, frag_prefetch=1),
        "d6": C(1, 1, 8, 5, False, frag_prefetch=1),
        "d7": C(1, 1, 8, 4, False, min_blocks=3, frag_prefetch=1),
    }


def cmd_build_decode(args: argparse.Namespace) -> None:
    import contextlib
    import io

    from ignis.compiler.kernels.q4_linear import build_q4_cuda_bundle

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cfgs = decode_configs()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        build_q4_cuda_bundle(
            "sm_90", {f"q4_{k}": c for k, c in cfgs.items()}, out / "decode_sm90.so", verbose=True
        )
    ptxas, entry = [], ""
    for ln in buf.getvalue().splitlines():  # "Compiling entry function '_Z...'" then its figures
        if "Compiling entry function" in ln:
            entry = _demangle(ln.split("'")[1]) if "'" in ln else ln
        elif "spill" in ln:
            spill = ln.strip()
        elif "registers" in ln:
            ptxas.append(f"{entry}: {ln.split(':', 1)[-1].strip()}; {spill}")
    manifest = {
        "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "configs": {k: c.tag for k, c in cfgs.items()},
        "ptxas": ptxas,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print("\n".join(ptxas))
    print(f"[build-decode] {len(cfgs)} configs in {time.time() - t0:.0f}s under {out}")


def _demangle(name: str) -> str:
    """The kernel's template arguments, shortened (c++filt when present)."""
    try:
        out = subprocess.run(["c++filt", name], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return name
    out = (
        out.replace("ignis_q4::q4_linear_mma_kernel", "k")
        .replace("__nv_bfloat16", "bf16")
        .replace("__half", "f16")
    )
    return out.split("(")[0]


class DecodeBench(Bench):
    """Old modules (a previous `build`) against the new candidates, same run, same fresh data."""

    def _run(self) -> None:
        import tvm_ffi

        from ignis.runtime.kernels.tvm_runtime import load_module

        torch = self.torch
        args = self.args
        new_dir, new_man, old, t0 = self._setup_old_new()
        T, E = self.results["timings_ms"], self.results["errors"]
        nb = load_module(new_dir / "decode_sm90.so", cuda=True)
        new = {k: nb[f"q4_{k}"] for k in new_man["configs"]}
        tags = new_man["configs"]

        # Numerics: every candidate, both dtypes, the chain's shapes and a partial-tile shape.
        w_ref = {
            s: self.dequant(self.layers[0][s]["qw"], self.layers[0][s]["scales"], torch.float64)
            for s in SHAPES
        }
        small_n, small_k = 272, 1024
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(7)
        sq = torch.randint(
            -(1 << 31),
            (1 << 31) - 1,
            (small_n, small_k // 8),
            device=self.dev,
            dtype=torch.int32,
            generator=gen,
        )
        ss = (
            (torch.rand(small_n, small_k // 32, device=self.dev, generator=gen) + 0.5) / (4.6 * small_k**0.5)
        ).to(torch.float16)
        sref = self.dequant(sq, ss, torch.float64)
        cases = [(s, self.layers[0][s]["qw"], self.layers[0][s]["scales"], w_ref[s]) for s in SHAPES]
        cases.append(("small", sq, ss, sref))

        def check(f: Any, dtype: Any, rows: int, qw: Any, sc: Any, wd: Any) -> float:
            x = torch.randn(rows, wd.shape[1], device=self.dev, dtype=dtype)
            y = torch.full((rows, wd.shape[0]), float("nan"), device=self.dev, dtype=dtype)
            with tvm_ffi.use_torch_stream():
                f(x, qw, sc, y)
            if not torch.isfinite(y).all():
                return float("nan")
            ref = x.double() @ wd.T
            return ((y.double() - ref).norm() / ref.norm()).item()

        for dtype, dn in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
            for rows in DECODE_WIDTHS:
                for name, qw, sc, wd in cases:
                    if name != "small":
                        E[f"old_{dn}_{name}_r{rows}"] = check(old[f"{name}_r{rows}"], dtype, rows, qw, sc, wd)
                    for k, f in new.items():
                        if name == "small" or rows in (1, 5, 8):
                            E[f"{k}_{dn}_{name}_r{rows}"] = check(f, dtype, rows, qw, sc, wd)
        bad = {k: v for k, v in E.items() if not (v < (2e-3 if "_f16_" in k else 1e-2))}
        self.results["bad_numerics"] = bad
        self.note(
            f"[numerics] {len(E)} checks, worst f16 {max(v for k, v in E.items() if '_f16_' in k):.2e}, "
            f"worst bf16 {max(v for k, v in E.items() if '_bf16_' in k):.2e}; failing: {sorted(bad)}"
        )
        torch.cuda.synchronize()

        # Per shape (8 layers of one shape), every candidate, every decode width, f16.
        per: dict[str, float] = {}
        for k, f in new.items():
            if any(b.startswith(f"{k}_") for b in bad):
                continue
            for shape in SHAPES:
                for rows in DECODE_WIDTHS:
                    per[f"{k}|{shape}|r{rows}"], _ = self.time_chain(
                        self.q4_chain({"up": f, "down": f}, rows, torch.float16, only=shape), reps=20
                    )
        self.results["per_shape_ms"] = per
        self.note(f"[per-shape] {len(per)} timings; {time.time() - t0:.0f}s")
        choice: dict[str, str] = {}
        for shape in SHAPES:
            for lo, hi in DECODE_BUCKETS:
                cands = {k for k in new if f"{k}|{shape}|r1" in per}
                best = min(cands, key=lambda k: sum(per[f"{k}|{shape}|r{r}"] for r in range(lo, hi + 1)))
                choice[f"{shape}|{lo}-{hi}"] = best
                self.note(
                    f"[choice] {shape} rows {lo}-{hi}: {best} ({tags[best]}) "
                    + " ".join(
                        f"{k}:{sum(per[f'{k}|{shape}|r{r}'] for r in range(lo, hi + 1)) / (hi - lo + 1):.4f}"
                        for k in sorted(cands)
                    )
                )
        self.results["choice"] = {k: tags[v] for k, v in choice.items()}

        def pick(shape: str, rows: int) -> Any:
            return new[
                next(
                    v
                    for key, v in choice.items()
                    if key.startswith(shape)
                    and int(key.split("|")[1].split("-")[0]) <= rows <= int(key.split("|")[1].split("-")[1])
                )
            ]

        if args.new_api:  # the modules `build` makes from the current rules: what ships
            api_dir = Path(args.new_api)
            api_man = json.loads((api_dir / "manifest.json").read_text())
            shipped = {
                k: load_module(api_dir / v["file"], cuda=True)["q4_linear"] for k, v in api_man["api"].items()
            }
            self.results["shipped_tiles"] = {
                k: v["tile"] for k, v in api_man["api"].items() if k.endswith(("r1", "r4", "r8"))
            }
            for dtype, dn in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
                for rows in DECODE_WIDTHS:
                    for name, qw, sc, wd in cases[:2]:
                        E[f"shipped_{dn}_{name}_r{rows}"] = check(
                            shipped[f"{name}_r{rows}"], dtype, rows, qw, sc, wd
                        )

            def pick(shape: str, rows: int) -> Any:
                return shipped[f"{shape}_r{rows}"]

        # Diagnostic: the same frozen tiles on all-zero activations (data-dependent cost?).
        for rows in DECODE_WIDTHS:
            for k, shape in (("A", "up"), ("C", "down")):
                per[f"{k}|{shape}|r{rows}|zeros"], _ = self.time_chain(
                    self.q4_chain(
                        {"up": new[k], "down": new[k]}, rows, torch.float16, only=shape, zeros=True
                    ),
                    reps=20,
                )

        # Whole chain, old shipped modules against the new ones, interleaved per width.
        for rows in DECODE_WIDTHS:
            for dtype, dn in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
                T[f"old_{dn}_r{rows}"], _ = self.time_chain(
                    self.q4_chain({s: old[f"{s}_r{rows}"] for s in SHAPES}, rows, dtype)
                )
                T[f"new_{dn}_r{rows}"], _ = self.time_chain(
                    self.q4_chain({s: pick(s, rows) for s in SHAPES}, rows, dtype)
                )
        self.note(f"[chain] done; {time.time() - t0:.0f}s")
        try:
            wb = [
                {s: self.dequant(layer[s]["qw"], layer[s]["scales"], torch.bfloat16) for s in SHAPES}
                for layer in self.layers
            ]
            for rows in DECODE_WIDTHS:
                bufs = self.chain_buffers(rows, torch.bfloat16)

                def enqueue(bufs: list[Any] = bufs) -> None:
                    for i, layer in enumerate(wb):
                        torch.matmul(bufs[2 * i], layer["up"].T, out=bufs[2 * i + 1])
                        torch.matmul(bufs[2 * i + 1], layer["down"].T, out=bufs[2 * i + 2])

                T[f"cublas_bf16_r{rows}"], _ = self.time_chain(enqueue)
        except Exception as exc:
            self.note(f"[cublas] failed: {type(exc).__name__}: {exc}")
        for rows in (1, 8):
            T[f"old_f16_r{rows}_again"], _ = self.time_chain(
                self.q4_chain({s: old[f"{s}_r{rows}"] for s in SHAPES}, rows, torch.float16)
            )
            T[f"new_f16_r{rows}_again"], _ = self.time_chain(
                self.q4_chain({s: pick(s, rows) for s in SHAPES}, rows, torch.float16)
            )
        self.results["wall_s"] = time.time() - t0

    def print_table(self) -> None:
        T, E, r = self.results["timings_ms"], self.results["errors"], self.results
        print()
        for line in r.get("ptxas", []):
            print("[ptxas]", line)
        per = r.get("per_shape_ms", {})
        if per:
            keys = sorted({k.split("|")[0] for k in per})
            print("per shape, 8 layers, f16, ms:  cfg | " + " | ".join(f"r{x}" for x in DECODE_WIDTHS))
            for shape in SHAPES:
                for k in keys + [f"{k}|{shape}" for k in ("A", "C")]:
                    if "|" in k:
                        k, sh = k.split("|")
                        if sh != shape:
                            continue
                        print(
                            f"  {shape:4s} {k}0s | "
                            + " | ".join(
                                f"{per.get(f'{k}|{shape}|r{x}|zeros', float('nan')):.4f}"
                                for x in DECODE_WIDTHS
                            )
                        )
                        continue
                    print(
                        f"  {shape:4s} {k:3s} | "
                        + " | ".join(
                            f"{per.get(f'{k}|{shape}|r{x}', float('nan')):.4f}" for x in DECODE_WIDTHS
                        )
                    )
        print(f"choice: {r.get('choice')}")
        if "shipped_tiles" in r:
            print(f"new = the shipped modules of the current rules: {r['shipped_tiles']}")
        print(
            f"q4_g32 chain 8 x (5120->17408->5120), {r['weight_bytes'] / 1e6:.0f} MB Q4; copy "
            f"{r['copy_tbps']:.2f} TB/s -> floor {r['floor_ms']:.3f} ms; ms per chain (graph replay, median)"
        )
        print(
            "R | old f16 | new f16 | old bf16 | new bf16 | cuBLAS bf16 | new/old f16 | %floor new f16"
            " | err new f16 | err new bf16"
        )

        def g(key: str) -> float:
            return T.get(key, float("nan"))

        for x in DECODE_WIDTHS:
            ef = max(
                [
                    v
                    for k, v in E.items()
                    if k.endswith(f"_f16_up_r{x}") or k.endswith(f"_f16_down_r{x}")
                    if not k.startswith("old")
                ]
                or [float("nan")]
            )
            eb = max(
                [
                    v
                    for k, v in E.items()
                    if k.endswith(f"_bf16_up_r{x}") or k.endswith(f"_bf16_down_r{x}")
                    if not k.startswith("old")
                ]
                or [float("nan")]
            )
            print(
                f"{x} | {g(f'old_f16_r{x}'):.3f} | {g(f'new_f16_r{x}'):.3f} | {g(f'old_bf16_r{x}'):.3f} | "
                f"{g(f'new_bf16_r{x}'):.3f} | {g(f'cublas_bf16_r{x}'):.3f} | "
                f"{g(f'new_f16_r{x}') / g(f'old_f16_r{x}'):.3f} | "
                f"{100 * r['floor_ms'] / g(f'new_f16_r{x}'):.1f}% | "
                f"{ef:.1e} | {eb:.1e}"
            )
        print("timed again: " + ", ".join(f"{k}: {T[k]:.3f}" for k in sorted(T) if k.endswith("_again")))


# ----------------------------------------------------------------------------------------------
# wide: the "n" layout (block-shared activations, cluster split-K) against the shipped modules

WIDE_BUCKETS = ((1, 4), (5, 8), (9, 16), (17, 24), (25, 32))  # width buckets of the rules
WIDE_TIMED = {1: [1, 4, 8], 2: [12, 16], 3: [20, 24], 4: [28, 32]}  # widths timed per n-tile count
WIDE_ONLY_BUCKETS = WIDE_BUCKETS[2:]


def wide_configs() -> dict[str, Any]:
    """Candidates of layout "n" per name (the name ends in its n-tile count): the shipped tiles of
    run 14 (mC, mSC, gSC, fK, fKSC: MT 2, WN 4; m: KC 4, g / f: KC 8; C: activations through L1,
    S: contiguous k-spans, K: two k-steps per stage) and blocks of one m-tile per warp (more warps
    per SM at fewer registers) or of 8 warps (run 15)."""
    from ignis.compiler.kernels.q4_linear import Q4TileConfig as C

    sc = {"k_span": True, "x_ca": True}
    cfgs: dict[str, Any] = {}
    for nt in (2, 3, 4):
        for name, (mt, wn, kc, st, kw) in {
            "mC": (2, 4, 4, 2, {"x_ca": True}),
            "mSC": (2, 4, 4, 2, sc),
            "gSC": (2, 4, 8, 2, sc),
            "fK": (2, 4, 8, 2, {"vec": 2}),
            "fKSC": (2, 4, 8, 2, {**sc, "vec": 2}),
            "a": (1, 8, 4, 2, sc),
            "b": (1, 8, 8, 2, sc),
            "c": (1, 4, 8, 2, sc),
            "e": (1, 8, 8, 2, {**sc, "vec": 2}),
            "h": (2, 8, 4, 2, sc),
            "i": (1, 4, 4, 2, sc),
        }.items():
            cfgs[f"{name}{nt}"] = C(nt, mt, wn, st, False, layout="n", cluster_k=kc, **kw)
    return cfgs


def cmd_build_wide(args: argparse.Namespace) -> None:
    """Build the layout-"n" candidates (two bundles in parallel: the build host has 2 cores)."""
    import contextlib
    import io
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from ignis.compiler.kernels.q4_linear import build_q4_cuda_bundle

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cfgs = wide_configs()
    names = sorted(cfgs)
    parts = [names[i :: args.jobs] for i in range(args.jobs)]

    bufs: dict[int, io.StringIO] = {}

    class _PerThreadStdout(io.TextIOBase):  # redirect_stdout is process-wide: split by thread
        def write(self, text: str) -> int:
            return bufs.setdefault(threading.get_ident(), io.StringIO()).write(text)

    def build(i: int) -> str:
        build_q4_cuda_bundle(
            "sm_90", {f"q4_{k}": cfgs[k] for k in parts[i]}, out / f"wide{i}_sm90.so", verbose=True
        )
        return bufs.pop(threading.get_ident(), io.StringIO()).getvalue()

    with contextlib.redirect_stdout(_PerThreadStdout()), ThreadPoolExecutor(args.jobs) as ex:
        logs = list(ex.map(build, range(args.jobs)))
    ptxas, entry, spill = [], "", ""
    for ln in "\n".join(logs).splitlines():
        if "Compiling entry function" in ln:
            entry = _demangle(ln.split("'")[1]) if "'" in ln else ln
        elif "spill" in ln:
            spill = ln.strip()
        elif "registers" in ln:
            ptxas.append(f"{entry}: {ln.split(':', 1)[-1].strip()}; {spill}")
    manifest = {
        "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "configs": {k: cfgs[k].tag for k in names},
        "bundles": {k: f"wide{i}_sm90.so" for i, part in enumerate(parts) for k in part},
        "ptxas": ptxas,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print("\n".join(ptxas))
    print(f"[build-wide] {len(cfgs)} configs in {time.time() - t0:.0f}s under {out}")


class WideBench(Bench):
    """The shipped modules of a previous `build` against the layout-"n" candidates, same data."""

    def _run(self) -> None:
        import tvm_ffi

        from ignis.runtime.kernels.tvm_runtime import load_module

        torch = self.torch
        args = self.args
        new_dir, new_man, old, t0 = self._setup_old_new()
        T, E = self.results["timings_ms"], self.results["errors"]
        bundles = {b: load_module(new_dir / b, cuda=True) for b in sorted(set(new_man["bundles"].values()))}
        tags = new_man["configs"]
        new = {k: bundles[new_man["bundles"][k]][f"q4_{k}"] for k in tags}
        nt_of = {k: int(tags[k].split("_")[0][1:]) for k in tags}  # names end in their n-tiles
        stream_only = {k for k in tags if "streamonly" in tags[k]}  # timed only (wrong output)

        w_ref = {
            s: self.dequant(self.layers[0][s]["qw"], self.layers[0][s]["scales"], torch.float64)
            for s in SHAPES
        }
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(7)
        cases = [(s, self.layers[0][s]["qw"], self.layers[0][s]["scales"], w_ref[s]) for s in SHAPES]
        for sn, sk in ((272, 1024), (272, 512)):  # partial blocks; at K=512 some cluster ranks idle
            sq = torch.randint(
                -(1 << 31), (1 << 31) - 1, (sn, sk // 8), device=self.dev, dtype=torch.int32, generator=gen
            )
            ss = ((torch.rand(sn, sk // 32, device=self.dev, generator=gen) + 0.5) / (4.6 * sk**0.5)).to(
                torch.float16
            )
            cases.append((f"small{sk}", sq, ss, self.dequant(sq, ss, torch.float64)))

        def check(f: Any, dtype: Any, rows: int, qw: Any, sc: Any, wd: Any) -> float:
            x = torch.randn(rows, wd.shape[1], device=self.dev, dtype=dtype)
            y = torch.full((rows, wd.shape[0]), float("nan"), device=self.dev, dtype=dtype)
            with tvm_ffi.use_torch_stream():
                f(x, qw, sc, y)
            if not torch.isfinite(y).all():
                return float("nan")
            ref = x.double() @ wd.T
            return ((y.double() - ref).norm() / ref.norm()).item()

        for dtype, dn in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
            for k, f in new.items():
                if k in stream_only:
                    continue
                nt = nt_of[k]
                for rows in sorted({8 * nt - 7, 8 * nt - 3, 8 * nt}):
                    for name, qw, sc, wd in cases:
                        E[f"{k}_{dn}_{name}_r{rows}"] = check(f, dtype, rows, qw, sc, wd)
            for rows in WIDTHS:
                for name, qw, sc, wd in cases[:2]:
                    E[f"old_{dn}_{name}_r{rows}"] = check(old[f"{name}_r{rows}"], dtype, rows, qw, sc, wd)
        bad = sorted({k.split("_")[0] for k, v in E.items() if not (v < (2e-3 if "_f16_" in k else 1e-2))})
        self.results["bad_candidates"] = bad
        self.note(
            f"[numerics] {len(E)} checks, worst f16 {max(v for k, v in E.items() if '_f16_' in k):.2e}, "
            f"worst bf16 {max(v for k, v in E.items() if '_bf16_' in k):.2e}; failing: {bad}"
        )
        # Determinism: the same inputs twice give the same bits (fixed-order reductions).
        nondet = []
        for k, f in new.items():
            if k in stream_only:
                continue
            x = torch.randn(8 * nt_of[k], HIDDEN, device=self.dev, dtype=torch.float16)
            ys = []
            for _ in range(2):
                y = torch.empty(8 * nt_of[k], INTER, device=self.dev, dtype=torch.float16)
                with tvm_ffi.use_torch_stream():
                    f(x, self.layers[0]["up"]["qw"], self.layers[0]["up"]["scales"], y)
                ys.append(y)
            if not torch.equal(ys[0], ys[1]):
                nondet.append(k)
        self.note(f"[determinism] differing run to run: {nondet}")
        torch.cuda.synchronize()

        # Per shape (8 layers of one shape), f16: every candidate at its widths, and the old modules.
        per: dict[str, float] = {}
        for shape in SHAPES:
            for rows in sorted({r for rs in WIDE_TIMED.values() for r in rs}):
                per[f"old|{shape}|r{rows}"], _ = self.time_chain(
                    self.q4_chain(
                        {"up": old[f"up_r{rows}"], "down": old[f"down_r{rows}"]},
                        rows,
                        torch.float16,
                        only=shape,
                    ),
                    reps=20,
                )
            for k, f in new.items():
                if k in bad:
                    continue
                for rows in WIDE_TIMED[nt_of[k]]:
                    per[f"{k}|{shape}|r{rows}"], _ = self.time_chain(
                        self.q4_chain({"up": f, "down": f}, rows, torch.float16, only=shape), reps=20
                    )
        self.results["per_shape_ms"] = per
        self.note(f"[per-shape] {len(per)} timings; {time.time() - t0:.0f}s")

        # Best per shape and width bucket (by the summed time over the bucket's timed widths).
        choice: dict[str, str] = {}
        for shape in SHAPES:
            for lo, hi in WIDE_BUCKETS:
                ws = [r for rs in WIDE_TIMED.values() for r in rs if lo <= r <= hi]
                cands = [
                    k
                    for k in ["old", *new]
                    if k not in stream_only and all(f"{k}|{shape}|r{r}" in per for r in ws)
                ]
                best = min(cands, key=lambda k: sum(per[f"{k}|{shape}|r{r}"] for r in ws))
                choice[f"{shape}|{lo}-{hi}"] = best
                ranked = sorted(cands, key=lambda k: sum(per[f"{k}|{shape}|r{r}"] for r in ws))[:6]
                self.note(
                    f"[choice] {shape} rows {lo}-{hi}: {best} ({tags.get(best, 'shipped')}); top: "
                    + " ".join(
                        f"{k}:{sum(per[f'{k}|{shape}|r{r}'] for r in ws) / len(ws):.4f}" for k in ranked
                    )
                )
        # The two shapes' kernels share the SMs in the chain (programmatic launch overlaps them),
        # so the best per shape need not be the best pair: time the chain for the top pairs.
        pairs: dict[str, float] = {}
        for lo, hi in WIDE_ONLY_BUCKETS:
            ws = [r for rs in WIDE_TIMED.values() for r in rs if lo <= r <= hi]
            top = {}
            for shape in SHAPES:
                cands = [k for k in new if k not in stream_only and f"{k}|{shape}|r{ws[0]}" in per]
                top[shape] = sorted(cands, key=lambda k: sum(per[f"{k}|{shape}|r{r}"] for r in ws))[
                    : args.pairs
                ]
            best_pair, best_t = None, float("inf")
            for ku in top["up"]:
                for kd in top["down"]:
                    t_pair = sum(
                        self.time_chain(
                            self.q4_chain({"up": new[ku], "down": new[kd]}, r, torch.float16), reps=20
                        )[0]
                        for r in ws
                    )
                    pairs[f"{ku}+{kd}|{lo}-{hi}"] = t_pair / len(ws)
                    if t_pair < best_t:
                        best_pair, best_t = (ku, kd), t_pair
            assert best_pair is not None
            choice[f"up|{lo}-{hi}"], choice[f"down|{lo}-{hi}"] = best_pair
            self.note(
                f"[pairs] rows {lo}-{hi}: best {best_pair} {best_t / len(ws):.4f}; "
                + " ".join(
                    f"{k.split('|')[0]}:{v:.4f}" for k, v in pairs.items() if k.endswith(f"|{lo}-{hi}")
                )
            )
        self.results["pairs_ms"] = pairs
        self.results["choice"] = {k: tags.get(v, "old") for k, v in choice.items()}

        def pick(shape: str, rows: int) -> Any:
            for key, k in choice.items():
                sh, rng = key.split("|")
                lo, hi = (int(v) for v in rng.split("-"))
                if sh == shape and lo <= rows <= hi:
                    return old[f"{shape}_r{rows}"] if k == "old" else new[k]
            raise KeyError((shape, rows))

        # Whole chain: the shipped modules against the composed best, interleaved per width.
        for rows in WIDTHS:
            for dtype, dn in ((torch.float16, "f16"), (torch.bfloat16, "bf16")):
                T[f"old_{dn}_r{rows}"], _ = self.time_chain(
                    self.q4_chain({s: old[f"{s}_r{rows}"] for s in SHAPES}, rows, dtype)
                )
                T[f"new_{dn}_r{rows}"], _ = self.time_chain(
                    self.q4_chain({s: pick(s, rows) for s in SHAPES}, rows, dtype)
                )
        self.note(f"[chain] done; {time.time() - t0:.0f}s")
        try:
            self.run_cublas(t0)
        except Exception as exc:
            self.note(f"[cublas] failed: {type(exc).__name__}: {exc}")
        for rows in (1, 16, 32):
            T[f"new_f16_r{rows}_again"], _ = self.time_chain(
                self.q4_chain({s: pick(s, rows) for s in SHAPES}, rows, torch.float16)
            )
        self.results["wall_s"] = time.time() - t0

    def print_table(self) -> None:
        T, E, r = self.results["timings_ms"], self.results["errors"], self.results
        print()
        for line in r.get("ptxas", []):
            print("[ptxas]", line)
        per = r.get("per_shape_ms", {})
        keys = sorted({k.split("|")[0] for k in per}, key=lambda k: (k != "old", k[-1:], k))
        print("per shape, 8 layers, f16, ms")
        for shape in SHAPES:
            for k in keys:
                cells = [f"r{x}:{per[f'{k}|{shape}|r{x}']:.4f}" for x in WIDTHS if f"{k}|{shape}|r{x}" in per]
                print(f"  {shape:4s} {k:4s} " + " ".join(cells))
        print(f"choice: {r.get('choice')}")
        print(
            f"q4_g32 chain 8 x (5120->17408->5120), {r['weight_bytes'] / 1e6:.0f} MB Q4; copy "
            f"{r['copy_tbps']:.2f} TB/s -> floor {r['floor_ms']:.3f} ms; ms per chain (graph replay, median)"
        )
        print("R | old f16 | new f16 | old bf16 | new bf16 | cuBLAS bf16 | new/old f16 | %floor new f16")

        def g(key: str) -> float:
            return T.get(key, float("nan"))

        for x in WIDTHS:
            print(
                f"{x} | {g(f'old_f16_r{x}'):.3f} | {g(f'new_f16_r{x}'):.3f} | {g(f'old_bf16_r{x}'):.3f} | "
                f"{g(f'new_bf16_r{x}'):.3f} | {g(f'cublas_bf16_r{x}'):.3f} | "
                f"{g(f'new_f16_r{x}') / g(f'old_f16_r{x}'):.3f} | "
                f"{100 * r['floor_ms'] / g(f'new_f16_r{x}'):.1f}%"
            )
        bad = set(r.get("bad_candidates", []))
        for dn in ("f16", "bf16"):
            good = [v for k, v in E.items() if f"_{dn}_" in k and k.split("_")[0] not in bad]
            print(f"worst rel. error of the passing candidates and the old modules, {dn}: {max(good):.2e}")
        print("timed again: " + ", ".join(f"{k}: {T[k]:.3f}" for k in sorted(T) if k.endswith("_again")))
        print(f"bad candidates: {r.get('bad_candidates')}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the modules (build host: tvm + nvcc)")
    b.add_argument("--out", default=".device/q4")
    b.add_argument("--skip-sweep", action="store_true")
    b.add_argument("--skip-dlight", action="store_true")
    b.add_argument("--skip-sm120", action="store_true", help="do not build the sm_120 modules")
    r = sub.add_parser("run", help="run the benchmark (GPU host: torch + tvm_ffi + runtime libs)")
    r.add_argument("--modules", default=".device/q4")
    r.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    r.add_argument("--tvm-lib", default=os.environ.get("IGNIS_TVM_LIB_DIR"))
    r.add_argument("--reps", type=int, default=50)
    pr = sub.add_parser("profile", help="launch chosen sweep kernels a few times (run under ncu)")
    pr.add_argument("--modules", default=".device/q4")
    pr.add_argument("--tvm-lib", default=os.environ.get("IGNIS_TVM_LIB_DIR"))
    pr.add_argument("--tags", required=True, help="comma-separated sweep tags")
    pr.add_argument("--rows", default="1,8")
    pr.add_argument("--wide", default=None, help="a `build-wide` output to take the kernels from")
    bd = sub.add_parser("build-decode", help="build the decode candidates (build host)")
    bd.add_argument("--out", default=".device/q4new")
    d = sub.add_parser("decode", help="old modules vs the decode candidates, rows 1..8 (GPU host)")
    d.add_argument("--old", default=".device/q4", help="a previous `build` (its api modules)")
    d.add_argument("--new", default=".device/q4new", help="a `build-decode` output")
    d.add_argument("--new-api", default=None, help="a `build` of the current rules: the chain's 'new'")
    d.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    d.add_argument("--tvm-lib", default=os.environ.get("IGNIS_TVM_LIB_DIR"))
    d.add_argument("--reps", type=int, default=50)
    bw = sub.add_parser("build-wide", help="build the layout-n candidates (build host)")
    bw.add_argument("--out", default=".device/q4w")
    bw.add_argument("--jobs", type=int, default=2)
    w = sub.add_parser("wide", help="shipped modules vs the layout-n candidates, every width (GPU host)")
    w.add_argument("--old", default=".device/q4", help="a previous `build` (its api modules)")
    w.add_argument("--new", default=".device/q4w", help="a `build-wide` output")
    w.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    w.add_argument("--tvm-lib", default=os.environ.get("IGNIS_TVM_LIB_DIR"))
    w.add_argument("--reps", type=int, default=50)
    w.add_argument("--pairs", type=int, default=3, help="top candidates per shape timed as chain pairs")
    args = p.parse_args(argv)
    if args.cmd == "build":
        cmd_build(args)
    elif args.cmd == "build-decode":
        cmd_build_decode(args)
    elif args.cmd == "build-wide":
        cmd_build_wide(args)
    elif args.cmd == "wide":
        WideBench(args).run()
    elif args.cmd == "decode":
        DecodeBench(args).run()
    elif args.cmd == "profile":
        cmd_profile(args)
    else:
        Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
