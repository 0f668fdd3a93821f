"""Layering gate (ADR 0000: formats <- runtime <- compiler <- tools): nothing under runtime/ or formats/
imports `ignis.compiler`, in any form -- `import`, `from ... import` (absolute or relative), or an
`importlib.import_module` / `__import__` call with a literal module name -- so a deployment host can
run without the compiler package installed (tests/runtime/test_no_compiler.py serves an artifact so).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it installs as (pyproject's package-dir)
LOWER_LAYERS = {"runtime": "ignis.runtime", "formats": "ignis.formats"}
FORBIDDEN = "ignis.compiler"


def _forbidden(name: str) -> bool:
    return name == FORBIDDEN or name.startswith(FORBIDDEN + ".")


def _resolve(package: str, module: str | None, level: int) -> str:
    """The absolute module a `from <level dots><module> import ...` in `package` names."""
    if level == 0:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (level - 1)] if level - 1 < len(parts) else []
    return ".".join([*base, *([module] if module else [])])


def _literal_prefix(node: ast.expr) -> str | None:
    """The module name a call's first argument spells, or its literal head for an f-string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        head = node.values[0]
        if isinstance(head, ast.Constant) and isinstance(head.value, str):
            return head.value
    return None


def compiler_imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, what) for every reach into `ignis.compiler` in `source`, a module of `package`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if _forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(package, node.module, node.level)
            names = [a.name for a in node.names]
            if _forbidden(target) or any(_forbidden(f"{target}.{n}") for n in names):
                found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import {names}"))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                name = _literal_prefix(node.args[0])
                if name is not None and (_forbidden(name) or name.rstrip(".") == FORBIDDEN):
                    found.append((node.lineno, f"{called}({name!r})"))
    return found


def _package_of(path: Path, folder: str) -> str:
    """The package a module's relative imports resolve against (an __init__.py's is its own folder's,
    the same as its siblings')."""
    folders = path.relative_to(ROOT / folder).parts[:-1]
    return ".".join((LOWER_LAYERS[folder], *folders))


@pytest.mark.parametrize(
    ("source", "package"),
    [
        ("import ignis.compiler", "ignis.runtime"),
        ("import ignis.compiler.kernels.topk as k", "ignis.runtime"),
        ("from ignis.compiler.kernels import fused_mixers", "ignis.runtime.families"),
        ("from ignis import compiler", "ignis.runtime"),
        ("from ..compiler.build import build_artifact", "ignis.runtime"),
        ("from ...compiler import errors", "ignis.runtime.kernels"),
        ("def f():\n    from ignis.compiler.kernels.fused_mixers import MAX_HEAD_DIM", "ignis.runtime"),
        ("import importlib\nimportlib.import_module('ignis.compiler.build')", "ignis.formats"),
        ("__import__('ignis.compiler')", "ignis.runtime"),
        ("import importlib\nimportlib.import_module(f'ignis.compiler.kernels.{1}')", "ignis.runtime"),
    ],
)
def test_the_scan_finds_every_form(source: str, package: str) -> None:
    assert compiler_imports(source, package), source


@pytest.mark.parametrize(
    "source",
    [
        "import ignis.compilers_elsewhere",
        "from ignis.runtime.kernels import topk",
        "from . import kernels",
        '"""Built by ignis.compiler.kernels.topk."""',
        "import importlib\nimportlib.import_module('ignis.runtime.kernels')",
    ],
)
def test_the_scan_passes_what_is_not_the_compiler(source: str) -> None:
    assert compiler_imports(source, "ignis.runtime") == []


def test_runtime_and_formats_never_import_the_compiler() -> None:
    problems: list[str] = []
    scanned = 0
    for folder in LOWER_LAYERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            scanned += 1
            for line, what in compiler_imports(path.read_text(), _package_of(path, folder)):
                problems.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert scanned > 40  # the scan saw the packages (not an empty glob)
    assert problems == [], "the runtime layer reaches the compiler:\n" + "\n".join(problems)
