#!/usr/bin/env bash
# CPU preflight of the performance page's "Next runs" (docs/perf/README.md): every GPU-session command
# in its tiny CPU form, so that an argument or an import error shows here and not in device time.
# Run from the repository root on any host (no GPU), ~3 minutes on 2 cores:
#
#   PYTHON=.venv/bin/python bash tools/bench/preflight_cpu.sh [GPU test files ...]
#
# What it runs, each under its own timeout, and with its GPU form beside it:
#   dflash2_cost --preset tiny        (GPU: dflash2_cost [--topk-modules DIR])
#   mtp_head --tiny                   (GPU: mtp_head --shape flash-next --mods DIR --lanes 1,2,4,8)
#   expert_cache --tiny, twice: the session-14 knobs (--breakdown --lookahead --ids-wait hybrid
#     --source-order any) and the GPU run's own flags (--cards 32 --modes off --host mmap --breakdown)
#   expert_host_path, engine_step (also off vs off-async), serve_overhead --synthetic at short sizes
#   fullsize_27b.sh --model tiny --card cpu --widths '' write build off replay dflash2 table (the GPU
#     commands' phases and --server-arg=--graph-warmup-context 512, a tiny qwen3_5 with a drafter)
#   serve_overhead --artifact (the tiny artifact just built) --device cpu --engine-process both
#   socket_equality serve (the tiny artifact) --backends off,ngram,draft-model --prompts chat
#   serve_overhead --artifact (the tiny artifact) --async-rounds; fullsize_27b.sh off table with
#     --server-arg=--async-rounds (the async-rounds runs of "Next runs")
#   pytest --collect-only -m gpu over the GPU test files (the arguments, else the default list below)
# Everything goes under $PREFLIGHT_DIR (default /tmp/ignis-preflight-$USER), the fullsize phases' state
# included (not /tmp/ignis-fullsize-*, which the GPU host's real runs use). Prints one line per command
# (rc, seconds, log) and exits 1 when any failed. The servers are started and stopped by the benches.
set -u
PY=${PYTHON:-python3}
D=${PREFLIGHT_DIR:-/tmp/ignis-preflight-${USER:-$(id -u)}}
rm -rf "$D" && mkdir -p "$D"
failed=0
step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" >"$D/$name.log" 2>&1
  rc=$?
  [ "$rc" -ne 0 ] && failed=1
  printf '%-22s rc %-3s %4ss  %s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$D/$name.log"
}
B="$PY -m ignis.tools.bench"
step dflash2_cost 120 $B.dflash2_cost --preset tiny --lanes 1,8 --rounds 3 --json "$D/dflash2_cost.json"
step mtp_head 120 $B.mtp_head --tiny --out "$D/mtp_head"
step expert_cache_knobs 240 $B.expert_cache --tiny --breakdown --lookahead --ids-wait hybrid \
  --source-order any --out "$D/expert_cache_knobs"
step expert_cache_gpu_flags 120 $B.expert_cache --tiny --cards 32 --modes off --lanes 1,8 --tokens 12 \
  --host mmap --breakdown --out "$D/expert_cache_gpu_flags"
step expert_host_path 120 $B.expert_host_path --rounds 3 --rows 1,8 --out "$D/expert_host_path"
step engine_step 120 $B.engine_step --repeat 1 --max-tokens 32 --json-out "$D/engine_step.json"
step engine_step_async 120 $B.engine_step --repeat 1 --max-tokens 32 --backends off,off-async \
  --json-out "$D/engine_step_async.json"
step serve_overhead_synth 180 $B.serve_overhead --synthetic --engine-process both --repeat 1 \
  --max-tokens 32 --json-out "$D/serve_overhead_synth.json"
step fullsize_27b 500 env PYTHON="$PY" IGNIS_NS="$D/ns" OUT="$D/fullsize-out" bash tools/bench/fullsize_27b.sh \
  --model tiny --card cpu --widths '' --ckpt-root "$D/ckpt" --art-root "$D/art" --state "$D/state.json" \
  --num-requests 4 --max-tokens 16 --equality-tokens 16 \
  --server-arg=--graph-warmup-context --server-arg=512 write build off replay dflash2 table
ART="$D/art/art"
if [ -f "$ART/manifest.json" ]; then
  step serve_overhead_art 240 $B.serve_overhead --artifact "$ART" --device cpu --lanes 1,8 --repeat 1 \
    --max-tokens 16 --allow-divergence --engine-process both --json-out "$D/serve_overhead_art.json"
  step socket_equality 240 $B.socket_equality serve "$ART" --backends off,ngram,draft-model \
    --prompts chat --max-tokens 8 --out "$D/socket_equality"
  step serve_overhead_async 240 $B.serve_overhead --artifact "$ART" --device cpu --lanes 1,8 --repeat 1 \
    --max-tokens 16 --allow-divergence --async-rounds --json-out "$D/serve_overhead_async.json"
  step fullsize_async 240 env PYTHON="$PY" IGNIS_NS="$D/ns" OUT="$D/fullsize-async" \
    bash tools/bench/fullsize_27b.sh --model tiny --card cpu --widths '' --ckpt-root "$D/ckpt" \
    --art-root "$D/art" --state "$D/state.json" --num-requests 4 --max-tokens 16 --equality-tokens 16 \
    --server-arg=--graph-warmup-context --server-arg=512 --server-arg=--async-rounds off table
else
  echo "no tiny artifact at $ART (fullsize_27b failed): serve_overhead_art and socket_equality not run"
  failed=1
fi
if [ $# -gt 0 ]; then
  FILES=("$@")
else
  FILES=(tests/runtime/test_dflash2_graphs.py tests/runtime/test_prefix_reuse_gpu.py
    tests/runtime/test_dflash2.py tests/runtime/test_hybrid_warmup.py tests/runtime/test_mtp_static.py
    tests/tools/test_confident_checkpoint_gpu.py tests/runtime/test_llama_graphs.py
    tests/runtime/test_capture_gc.py tests/runtime/test_mtp.py
    tests/runtime/server/test_server_engine_process.py tests/runtime/test_engine_step.py
    tests/runtime/test_host_breakdown.py tests/runtime/test_expert_transfer.py
    tests/runtime/test_moe_grouped.py tests/runtime/test_expert_cache.py tests/runtime/test_host_pin.py
    tests/runtime/test_async_rounds.py tests/tools/test_bench_llama_round.py)
fi
step gpu_collect 240 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --collect-only "${FILES[@]}"
tail -1 "$D/gpu_collect.log"
for f in "${FILES[@]}"; do  # a file named here that holds no GPU test is worth knowing before device time
  grep -q "^$f::" "$D/gpu_collect.log" || echo "note: $f has no test marked gpu"
done
exit $failed
