#!/usr/bin/env bash
# Issue 25 item 4 on the GPU host: the 27B-shaped qwen3_5 written, built (ignis-build --card h200, a
# DFlash2 drafter grafted) and served (ignis-run + ignis-bench at 1 and 8 clients: speculation off,
# dflash2 at 7 drafts, the replay drafter at p = 0.885). The phases are
# tools/bench/fullsize_27b.py's; run from the repository root, each command under 10 minutes:
#
#   bash tools/bench/fullsize_27b.sh write          # 53.7 GiB random bf16 into /dev/shm    (~2 min)
#   bash tools/bench/fullsize_27b.sh build          # ignis-build --card h200 into /tmp     (~5-7 min)
#   bash tools/bench/fullsize_27b.sh off replay     # record greedy outputs, replay at p    (~3-5 min)
#   bash tools/bench/fullsize_27b.sh dflash2 table  # the grafted drafter at 7 drafts       (~2-4 min)
#
# (`write build` fit one command when the build is known to take < 7 min; `rate` between them
# measures the weight step's conversion rate at 1 thread and every core.) State between commands:
# the checkpoint (53.7 GiB) in /dev/shm/ignis-fullsize (RAM: the 64 GB disk cannot hold it beside the
# 17.8 GiB artifact; deleted once built), the artifact and the replay file in /tmp/ignis-fullsize-art
# (where /dev/shm is too small: the checkpoint on /tmp, the artifact in /dev/shm), the choice kept in
# /tmp/ignis-fullsize-state.json. Figures, logs and the table's JSON go to $OUT (./fullsize-out).
# Extra arguments go to the Python driver (e.g. --num-requests 32, --lanes 8; --model tiny --card cpu
# --widths '' for a CPU dry run).
#
# Weights: confident by default (tools/random_checkpoint.py --confident: the same shapes and compute,
# so the same throughput, but greedy choices with ~65-nat margins, so outputs do not depend on the
# verify round's row count and the replay drafter keeps its recording at 8 clients);
# IGNIS_FULLSIZE_WEIGHTS=random (or --weights random) writes the plain std-0.02 init. write and build
# must be run again to switch: the serving phases refuse an artifact of the other kind.
#
# Environment, as .device/env.sh does: the wheels in .whl/ installed into /tmp/site (no network),
# the checkout linked as the `ignis` namespace in /tmp/ns, TVM's runtime libraries from
# .device/q4/tvm_lib (IGNIS_TVM_LIB_DIR; the build itself needs no TVM: every 27B linear takes the
# nvcc-built tiled route). ignis-build reads the checkpoint with `safetensors`; a host without it
# needs its wheel in .whl/.
set -euo pipefail
PY=${PYTHON:-python3}            # the interpreter (a venv's for a dry run elsewhere)
NS=${IGNIS_NS:-/tmp/ns}          # where the checkout is linked as the `ignis` namespace
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1 || echo "fullsize_27b.sh: installing .whl/ into /tmp/site failed" >&2
fi
mkdir -p "$NS/ignis"
for d in compiler runtime tools formats; do ln -sfn "$PWD/$d" "$NS/ignis/$d"; done
export PYTHONPATH="/tmp/site:$NS${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${IGNIS_TVM_LIB_DIR:-}" ] && [ -d .device/q4/tvm_lib ]; then
  export IGNIS_TVM_LIB_DIR="$PWD/.device/q4/tvm_lib"
fi
export OUT="${OUT:-$PWD/fullsize-out}"
"$PY" -c "import safetensors, tokenizers" 2>/dev/null \
  || echo "fullsize_27b.sh: warning: safetensors or tokenizers is not importable (write/build need them)" >&2
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
free -g | head -2; df -h /dev/shm /tmp | tail -2
exec "$PY" -m ignis.tools.bench.fullsize_27b "$@"
