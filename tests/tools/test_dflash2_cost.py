"""`python -m ignis.tools.bench.dflash2_cost`: a CPU smoke run of the tiny preset (the table, the JSON,
the static route's drafts equal to the eager path's in float32)."""

from __future__ import annotations

import json

from click.testing import CliRunner
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.tools.bench.dflash2_cost import bench_config, main


def test_dflash2_cost_tiny_cpu(tmp_path) -> None:
    out = tmp_path / "cost.json"
    args = ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--rounds", "3", "--warmup", "1"]
    args += ["--context", "80", "--lanes", "1,3", "--json", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "graphed path is left out" in res.output and "propose" in res.output
    data = json.loads(out.read_text())
    rows = {(r["path"], r["lanes"]): r for r in data["results"]}
    assert set(rows) == {("eager", 1), ("eager", 3), ("static", 1), ("static", 3)}
    for r in rows.values():
        assert r["round"]["median_ms"] > 0 and r["propose"]["median_ms"] > 0
        assert r["lanes_differing"] == 0 and r["compared_with"] == "eager"
    assert rows[("static", 3)]["graphs_captured"] == 0


def test_bench_config_is_the_public_27b_drafter() -> None:
    c = bench_config("27b")
    assert (c.hidden_size, c.num_hidden_layers, c.block_size, c.vocab_size) == (5120, 5, 8, 248320)
    assert c.context_retention(0) == 2047
