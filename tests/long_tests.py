"""The `long` tests (see tests/conftest.py): node-id prefixes, relative to the repository root."""

from __future__ import annotations

#: Node-id prefixes (relative to the repository root) of the `long` tests.
LONG = (
    "tests/compiler/test_build_artifacts.py::",  # builds 3 families' artifacts: ~3 min the file
    "tests/tools/test_bench_e2e_tiny.py::",  # bench_e2e_gpu.py in subprocesses: ~1.5 min
    "tests/runtime/server/test_server_real_model.py::",  # builds and serves SmolLM2: ~1.5 min
    # nvcc builds the tiny qwen3_5's tiled and kernel libraries for h200: ~1-3 min
    "tests/compiler/test_build_without_tvm.py::test_an_all_nvcc_qwen3_5_builds_for_h200_without_tvm",
    "tests/tools/test_fullsize_27b.py::",  # tools/bench/fullsize_27b.sh's phases on the CPU: ~1 min
)
