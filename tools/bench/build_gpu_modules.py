"""Build, on a host without a GPU, every CUDA module the GPU benchmarks carry to the device.

    python -m ignis.tools.bench.build_gpu_modules --out .device/final [--arch sm_90] [--shapes flash-next]

Writes into OUT (about 6 MB for sm_90):

* ``q4_e2e_<arch>.so`` + ``manifest.json``: one q4 bundle serving every (width, N, K) that
  `tools/bench/e2e_gpu.py` runs for the 27B-shaped ``qwen3_5`` (the 8 linear shapes of that model x
  widths 1..8, 16, 24, 32, and 40, 48, 56, 64 on the tiled route). ``--q4-route tiled`` (the default, the
  build's CUDA route): the tiled stream-K kernel, one export per n-tile count (`tiled_config_for`),
  weights placed in the tiled layout (manifest ``"kind": "q4_g32_tiled"``); ``--q4-route mma``: the
  row-major kernels, the tiles `default_tile_config` chooses. ``manifest.json`` maps ``"W|N|K"`` to
  the exported function (the format `ignis.tools.bench.e2e_gpu.load_compiled` reads);
* ``gdn_recurrent_<arch>.so`` (`build_gdn_recurrent`), ``fused_norms_<arch>.so``
  (`build_fused_norms`), ``topk_<arch>.so`` (`build_topk`), ``moe_experts_<arch>.so``
  (`build_moe_experts`: the grouped routed-expert kernels `tools/bench/expert_cache.py` loads from
  ``--mods``) and, where the kernel exists, ``fused_mixers_<arch>.so``.

Needs nvcc (CUDA 12.8+ for sm_120) and tvm-ffi; takes 1-2 minutes on two cores.

Raises:
    SystemExit: nvcc missing or a build failing (the compiler's message is printed).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

#: (out_features, in_features) of every q4 linear of the 27B-shaped qwen3_5 in ignis.tools.bench.e2e_gpu
#: (GDN in_proj_qkv / z, attention q / k+v, o_proj from 6144, MLP up/gate and down, LM head), and
#: the executor's fusions of them (attention q|k|v, GDN qkv|z, MLP gate|up: `HYBRID_FUSED_LINEARS`).
E2E_SHAPES = (
    (12288, 5120),
    (1024, 5120),
    (6144, 5120),
    (10240, 5120),
    (5120, 6144),
    (17408, 5120),
    (5120, 17408),
    (248320, 5120),
    (14336, 5120),
    (16384, 5120),
    (34816, 5120),
)
#: The same for the Qwen3.5-122B-A10B-shaped `qwen3_5_moe` of `ignis.tools.bench.expert_cache`
#: (hidden 3,072): attention q (with its gate) / k, v / q|k|v / o_proj, GDN in_proj_qkv / z / qkv|z /
#: out_proj, a routed or shared expert's gate or up and down, the LM head, the MTP head's fc.
FLASH_NEXT_SHAPES = (
    (16384, 3072),
    (512, 3072),
    (17408, 3072),
    (3072, 8192),
    (12288, 3072),
    (8192, 3072),
    (20480, 3072),
    (1024, 3072),
    (3072, 1024),
    (248320, 3072),
    (3072, 6144),
)
SHAPE_SETS = {"qwen3_5-27b": E2E_SHAPES, "flash-next": FLASH_NEXT_SHAPES}
E2E_WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32)
#: The tiled route's widths: also 40-64 (33-64 rows in one call, every 8 rows as the h200 profile
#: compiles: docs/perf/log runs 69-72); the mma route's kernels stop at 32 rows.
E2E_WIDTHS_TILED = (*E2E_WIDTHS, 40, 48, 56, 64)


def bundle_library(mods: Path, stem: str, device: object = None) -> Path:
    """Where a bundle of this script keeps library `stem` (e.g. "gdn_recurrent", "moe_experts") for
    the arch of CUDA `device` (None: the current one): ``<mods>/<stem>_sm<major><minor>.so``, as
    `main` names them; the file may not exist."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return mods / f"{stem}_sm{major}{minor}.so"


def build_q4_e2e_bundle(
    out: Path, arch: str, route: str = "tiled", shapes: tuple[tuple[int, int], ...] = E2E_SHAPES
) -> dict[str, object]:
    """Build the q4 bundle for `shapes` (default `E2E_SHAPES`) x `E2E_WIDTHS` (`E2E_WIDTHS_TILED` on the
    tiled route) into `out`; returns the manifest dict.

    route "tiled": the tiled stream-K kernel (`ignis.compiler.kernels.q4_tiled`; weights in the tiled
    layout, manifest ``kind`` "q4_g32_tiled"), one export per n-tile count; "mma": the row-major
    kernels of `ignis.compiler.kernels.q4_linear`, one export per (width, shape) tile rule.
    """
    if route == "tiled":
        from ignis.compiler.kernels.q4_tiled import build_q4_tiled_module, tiled_config_for

        texports, ttable = {}, {}
        for w in E2E_WIDTHS_TILED:
            for n, k in shapes:
                cfg = tiled_config_for(w, n, k, arch)
                name = "q4t_" + cfg.tag
                texports[name] = cfg
                ttable[f"{w}|{n}|{k}"] = name
        tfile = f"q4_e2e_{arch.replace('_', '')}.so"
        build_q4_tiled_module(arch, texports, out / tfile)
        tman: dict[str, object] = {
            "table": ttable,
            "exports": sorted(texports),
            "file": tfile,
            "kind": "q4_g32_tiled",
        }
        (out / "manifest.json").write_text(json.dumps(tman, indent=1))
        return tman
    from ignis.compiler.kernels.q4_linear import build_q4_cuda_bundle, default_tile_config

    exports, table = {}, {}
    for w in E2E_WIDTHS:
        for n, k in shapes:
            cfg = default_tile_config(w, n, k, arch=arch)
            name = "q4_" + cfg.tag
            exports[name] = cfg
            table[f"{w}|{n}|{k}"] = name
    file = f"q4_e2e_{arch.replace('_', '')}.so"
    build_q4_cuda_bundle(arch, exports, out / file)
    manifest: dict[str, object] = {"table": table, "exports": sorted(exports), "file": file, "kind": "q4_g32"}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (created)")
    ap.add_argument("--arch", default="sm_90", help="CUDA arch (sm_90, sm_120) [default: sm_90]")
    ap.add_argument("--skip-q4", action="store_true", help="do not rebuild the q4 bundle")
    ap.add_argument("--q4-route", choices=("tiled", "mma"), default="tiled", help="q4 kernel route [tiled]")
    ap.add_argument(
        "--shapes",
        choices=sorted(SHAPE_SETS),
        default="qwen3_5-27b",
        help="the model whose linear shapes the q4 bundle serves: e2e_gpu's 27B, or expert_cache's "
        "Flash-Next [qwen3_5-27b]",
    )
    args = ap.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tag = args.arch.replace("_", "")
    rows: list[tuple[str, float, int]] = []

    def timed(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        path = fn()
        rows.append((name, time.perf_counter() - t, Path(path).stat().st_size if path else 0))

    if not args.skip_q4:
        timed(
            "q4 e2e bundle",
            lambda: (
                build_q4_e2e_bundle(out, args.arch, args.q4_route, SHAPE_SETS[args.shapes]),
                out / f"q4_e2e_{tag}.so",
            )[1],
        )
    from ignis.compiler.kernels.fused_norms import build_fused_norms
    from ignis.compiler.kernels.gdn_recurrent import build_gdn_recurrent
    from ignis.compiler.kernels.topk import build_topk

    timed("gdn_recurrent", lambda: build_gdn_recurrent(args.arch, out_path=out / f"gdn_recurrent_{tag}.so"))
    timed("fused_norms", lambda: build_fused_norms(args.arch, out_path=out / f"fused_norms_{tag}.so"))
    timed("topk", lambda: build_topk(args.arch, out_path=out / f"topk_{tag}.so"))
    from ignis.compiler.kernels.moe_experts import build_moe_experts

    timed("moe_experts", lambda: build_moe_experts(args.arch, out_path=out / f"moe_experts_{tag}.so"))
    try:
        from ignis.compiler.kernels.fused_mixers import build_fused_mixers  # type: ignore[import-not-found]
    except ImportError:
        build_fused_mixers = None
    if build_fused_mixers is not None:
        timed("fused_mixers", lambda: build_fused_mixers(args.arch, out_path=out / f"fused_mixers_{tag}.so"))
    print(f"{'module':<16} {'seconds':>8} {'bytes':>10}")
    for name, s, size in rows:
        print(f"{name:<16} {s:8.1f} {size:10d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
