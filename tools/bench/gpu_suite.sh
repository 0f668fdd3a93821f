#!/usr/bin/env bash
# The GPU runs that belong together, in one command on a CUDA host with only the lean runtime
# (torch + the cp312 apache-tvm-ffi wheel + libtvm_runtime*.so; no TVM compiler, no nvcc there).
#
# Build host first (no GPU needed):
#   python -m ignis.tools.bench.build_gpu_modules --out .device/final
# GPU host, repository root, carrying .whl/ (the tvm-ffi wheel), .device/q4/tvm_lib (the runtime
# libraries), .device/final (the modules) and .device/gdn-art (a tiny qwen3_5 h200 artifact with a
# DFlash2 drafter, for the artifact tests):
#   bash tools/bench/gpu_suite.sh [BENCH_BUDGET_S]
# Writes under $OUT (or ./gpu-suite-out): gpu_tests.log, bench_topk JSON, bench_e2e_gpu.json,
# bench_graphed_families.json, and prints a short table last.
set -u
OUT=${OUT:-$PWD/gpu-suite-out}
mkdir -p "$OUT"
BUDGET=${1:-150}
M=$PWD/.device/final
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/ns/ignis && for d in compiler runtime tools formats; do ln -sfn "$PWD/$d" /tmp/ns/ignis/$d; done
export PYTHONPATH=/tmp/site:/tmp/ns IGNIS_TVM_LIB_DIR=$PWD/.device/q4/tvm_lib PYTHONUNBUFFERED=1
export IGNIS_GDN_MODULE=$M/gdn_recurrent_sm90.so IGNIS_NORMS_MODULE=$M/fused_norms_sm90.so
export IGNIS_TOPK_MODULE=$M/topk_sm90.so
[ -f "$M/fused_mixers_sm90.so" ] && export IGNIS_MIXERS_MODULE=$M/fused_mixers_sm90.so
# the grouped MoE expert kernels (tests/runtime/test_moe_grouped.py)
[ -f "$M/moe_experts_sm90.so" ] && export IGNIS_MOE_MODULE=$M/moe_experts_sm90.so
ART=${IGNIS_GDN_ARTIFACT:-$PWD/.device/gdn-art/tiny-hybrid-h200}
export IGNIS_GDN_ARTIFACT=$ART IGNIS_TOPK_ARTIFACT=$ART
# the tiled q4 kernel: the bundle in $M (tools/bench/build_gpu_modules.py) and a tiny tiled-route llama
# artifact (tests/runtime/test_linear_tiled.py `_build_tiny_tiled_llama`, in .device/tiled-art)
export IGNIS_Q4T_BUNDLE=$M
# the rules with cp.async staging (cards before sm_90), from the chain bench's build if present
[ -f "$PWD/.device/q4t/manifest.json" ] && export IGNIS_Q4T_CANDIDATES=$PWD/.device/q4t
[ -d "$PWD/.device/tiled-art/tiny-llama-h200" ] && export IGNIS_TILED_ARTIFACT=$PWD/.device/tiled-art/tiny-llama-h200
# the same tiny llama built at the h200 profile's widths (every 8 rows to 64: `_build_tiny_tiled_llama(..,
# widths=None)`, in .device/wide-art)
[ -d "$PWD/.device/wide-art/tiny-llama-h200-wide" ] && export IGNIS_TILED_WIDE_ARTIFACT=$PWD/.device/wide-art/tiny-llama-h200-wide
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# 1. GPU tests of everything that runs on CUDA (graphs, fused kernels, top-k, artifacts).
timeout ${GPU_TESTS_TIMEOUT:-110} python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rs \
  -k "${GPU_TESTS_K:-fused_mixers or gated_attention or artifact or topk or tiled or gdn or llama_graphs or moe_grouped}" \
  tests/runtime/test_hybrid_graphs.py tests/runtime/test_topk.py tests/runtime/test_artifact.py \
  tests/runtime/test_llama_graphs.py tests/runtime/test_moe_grouped.py \
  tests/compiler/test_gdn_kernel.py \
  tests/compiler/test_q4_tiled.py tests/runtime/test_linear_tiled.py \
  >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.log"

# 2. Top-k against torch.topk (exactness on tie-heavy data, time).
if [ -z "${SKIP_TOPK:-}" ]; then
  timeout 45 python3 -m ignis.tools.bench.topk --modules "$M" --out "$OUT" >"$OUT/bench_topk.log" 2>&1
  echo "bench_topk rc=$?"
fi

# 3. End to end: 27B-shaped qwen3_5, graphed rounds per width with every fused module, graphed decode
#    (1 and 8 lanes; speculation off and 7 drafts at fixed acceptance), the bf16 (cuBLAS) route
#    graphed, and HF transformers generating on the same weights.
MIX=""; [ -n "${IGNIS_MIXERS_MODULE:-}" ] && MIX="--mixers-module $IGNIS_MIXERS_MODULE"
timeout $((BUDGET + 45)) python3 -m ignis.tools.bench.e2e_gpu --mods "$M" --gdn-module "$IGNIS_GDN_MODULE" \
  --norms-module "$IGNIS_NORMS_MODULE" $MIX --fused-only --no-eager-rounds --no-eager --widths 1,2,4,8,16,32,48,64 \
  --budget-s "$BUDGET" --reps 5 ${E2E_EXTRA:-} --hf-tokens 16 --out "$OUT" >"$OUT/bench_e2e.log" 2>&1
echo "bench_e2e rc=$?"
# 4. A small llama on its static, graphed route next to a qwen3_5 of the same size (1 and 8 lanes,
#    first request and steady; issue 25's >= 0.8x target).
if [ -z "${SKIP_GRAPHED_FAMILIES:-}" ]; then
  timeout 240 python3 -m ignis.tools.bench.graphed_families --out "$OUT" >"$OUT/bench_graphed_families.log" 2>&1
  echo "bench_graphed_families rc=$?"
fi
[ -f "$OUT/bench_topk.log" ] && { echo "== top-k =="; tail -n 16 "$OUT/bench_topk.log"; }
[ -f "$OUT/bench_graphed_families.log" ] && { echo "== graphed families =="; tail -n 12 "$OUT/bench_graphed_families.log"; }
echo "== end to end (tables last) =="; tail -n 60 "$OUT/bench_e2e.log"
