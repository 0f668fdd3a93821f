"""`python -m ignis.tools.bench.mtp_head --tiny` on the CPU: the MTP head benchmark's plumbing at toy
sizes (both heads, both shapes, greedy and sampled) writes its table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.tools.bench.mtp_head import main


@pytest.mark.parametrize(("shape", "sampled"), [("flash-next", False), ("27b", True)])
def test_tiny_run_writes_cases(tmp_path: Path, capsys, shape: str, sampled: bool) -> None:
    argv = ["--tiny", "--shape", shape, "--lanes", "1,2", "--rounds", "3", "--context", "12"]
    assert main([*argv, *(["--sampled"] if sampled else []), "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_mtp_head.json").read_text())
    assert res["shape"] == shape and res["sampled"] is sampled and res["device"] == "cpu"
    cases = {(c["head"], c["lanes"]): c for c in res["cases"]}
    assert set(cases) == {("eager", 1), ("eager", 2), ("static", 1), ("static", 2)}
    for c in cases.values():
        assert c["drafts"] == 3 and c["propose_ms"] > 0 and c["commit_ms"] > 0
        assert c["drafter_ms"] >= max(c["propose_ms"], c["commit_ms"]) * 0.5
        assert c["graphs"] is False  # no CUDA here
    assert "head | graphs | lanes" in capsys.readouterr().out
