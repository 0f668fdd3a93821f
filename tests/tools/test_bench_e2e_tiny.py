"""`python -m ignis.tools.bench.e2e_gpu --tiny` on the CPU: the plumbing of the end-to-end benchmark (toy
sizes), with the rounds timed after `--context` committed tokens, writes its JSON and refuses a bad
context."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ignis.tools.bench.e2e_gpu", "--tiny", "--no-hf", "--widths", "1,4"]
    cmd += ["--budget-s", "60", "--out", str(tmp_path), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_tiny_run_times_rounds_after_the_given_context(tmp_path: Path) -> None:
    proc = _run(tmp_path, "--context", "30")
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "bench_e2e_gpu.json").read_text())
    assert res["round_context"] == 30 and res["device"] == "cpu"
    assert "| 1 |" in proc.stdout  # the round tables have their 1-column rows


@pytest.mark.parametrize("bad", ["0", "-3"])
def test_a_context_below_one_is_a_usage_error(tmp_path: Path, bad: str) -> None:
    proc = _run(tmp_path, "--context", bad)
    assert proc.returncode == 2 and "--context must be >= 1" in proc.stderr
