"""The benches find a module bundle's libraries through `build_gpu_modules.bundle_library` (the
device's arch), never by a spelled-out arch: no string in the code of `tools/bench` (docstrings
aside, which show example paths) names one of the bundle's libraries for a fixed arch."""

from __future__ import annotations

import ast
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench"
FIXED = re.compile(r"(gdn_recurrent|fused_norms|fused_mixers|moe_experts)_sm\d+\.so")


def _code_strings(tree: ast.AST) -> list[str]:
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_no_bench_names_a_bundle_library_for_a_fixed_arch() -> None:
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        if path.name == "build_gpu_modules.py":  # where the names are made
            continue
        found += [
            f"{path.name}: {s!r}" for s in _code_strings(ast.parse(path.read_text())) if FIXED.search(s)
        ]
    assert not found, found
