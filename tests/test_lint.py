"""Lint gate: ruff on the whole repository, and mypy (strict on formats/, configured in
pyproject.toml) must both be clean. ruff and mypy come with the `test` extra; a missing one fails the gate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUFF_PATHS = ["."]  # the whole repository (exclusions in pyproject.toml)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_clean() -> None:
    proc = _run("ruff", "check", "--no-cache", *RUFF_PATHS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_clean() -> None:
    proc = _run("mypy")  # files and strictness come from [tool.mypy] in pyproject.toml
    assert proc.returncode == 0, proc.stdout + proc.stderr
