"""`ignis.tools.bench.prefill_ops` runs end to end on a small prompt and prints its per-layer table."""

from __future__ import annotations

import sys

import pytest

from ignis.tools.bench import prefill_ops


def test_prefill_ops_prints_the_per_layer_counts(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    argv = ["prefill_ops", "--tokens", "128", "--hidden", "64", "--layers", "4", "--reps", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    assert prefill_ops.main() == 0
    out = capsys.readouterr().out
    assert "config: 3 GDN + 1 attention layers, hidden 64, 128 tokens" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    gdn = [int(x) for x in rows["GDN mixer, a layer"].split("|")[2:6]]
    assert gdn[0] == sum(gdn[1:]) and gdn[2] > 0  # ops = copies + matmul/solve + other
    assert "prefill entry alone (128 tokens)" in rows and "attention mixer, a layer" in rows
