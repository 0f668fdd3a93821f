"""Benchmark of the q4_g32 linear kernels on the chain of 8 layers x (5120 -> 17408 -> 5120).

Two steps, because the GPU host has no TVM compiler:

  python -m ignis.tools.bench_q4_linear build --out .device/q4     # build host (tvm + nvcc)
  python -m ignis.tools.bench_q4_linear run --modules .device/q4 --out $OUT   # GPU host

``run`` needs only torch, tvm_ffi and TVM's runtime libraries (``--tvm-lib`` or
``$IGNIS_TVM_LIB_DIR``). On fresh random data it prints, side by side per row width: ours (the
modules ``build_q4_linear`` makes, f16 and bf16), the best tile configuration of a sweep, TVM
dlight's default schedules, cuBLAS bf16 on the dequantized weights (torch), torch's int4 tinygemm,
and the Q4 bytes floor at the measured copy bandwidth; plus each kernel's error against a float64
reference. Everything is written as JSON under ``--out``. Each chain is timed as CUDA-graph
replays (16 launches per replay), median of per-replay device-event times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
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
        torch = self.torch
        shifts = torch.arange(0, 32, 4, device=self.dev, dtype=torch.int32)
        q = ((qw.unsqueeze(-1) >> shifts) & 15).reshape(qw.shape[0], -1)
        return ((q.to(torch.float64) - 8.0) * scales.to(torch.float64).repeat_interleave(32, dim=1)).to(dtype)

    # -- methods --------------------------------------------------------------------------------

    def chain_buffers(self, rows: int, dtype: Any) -> list[Any]:
        torch = self.torch
        bufs = [torch.randn(rows, HIDDEN, device=self.dev, dtype=dtype)]
        for _ in range(NUM_LAYERS):  # random, not empty: never time on zeros
            bufs.append(torch.randn(rows, INTER, device=self.dev, dtype=dtype))
            bufs.append(torch.randn(rows, HIDDEN, device=self.dev, dtype=dtype))
        return bufs

    def q4_chain(
        self, funcs: dict[str, Any], rows: int, dtype: Any, only: str | None = None, u32: bool = False
    ) -> Any:
        bufs = self.chain_buffers(rows, dtype)
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
        from ignis.runtime.tvm_runtime import load_module, load_tvm_runtime

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
        from ignis.runtime.tvm_runtime import load_module

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

        from ignis.runtime.tvm_runtime import load_module

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

    from ignis.runtime.tvm_runtime import load_module, load_tvm_runtime

    mods = Path(args.modules)
    load_tvm_runtime(cuda=True, lib_dir=args.tvm_lib or (mods / "tvm_lib"))
    sw = load_module(mods / "sweep_sm90.so", cuda=True)
    dev = torch.device("cuda")
    for tag in args.tags.split(","):
        f = sw[f"q4_{tag}"]
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
    args = p.parse_args(argv)
    if args.cmd == "build":
        cmd_build(args)
    elif args.cmd == "profile":
        cmd_profile(args)
    else:
        Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
