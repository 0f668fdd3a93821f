"""`python -m ignis.tools.bench.expert_cache --tiny` on the CPU: the benchmark's plumbing at toy sizes
(cached cards of 1 and 4 slots a layer, speculation off and MTP) writes its table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.tools.bench.expert_cache import drafts_per_lane, expected_tokens, main


def test_tiny_run_writes_cases(tmp_path: Path, capsys) -> None:
    assert (
        main(["--tiny", "--lanes", "1", "--modes", "off,mtp", "--tokens", "6", "--out", str(tmp_path)]) == 0
    )
    res = json.loads((tmp_path / "bench_expert_cache.json").read_text())
    cases = {(c["card"], c["mode"]): c for c in res["cases"]}
    assert set(cases) == {("1slots", "off"), ("1slots", "mtp"), ("4slots", "off"), ("4slots", "mtp")}
    one = cases[("1slots", "off")]
    assert one["slots_per_layer"] == 1 and one["tokens"] >= 1 and one["MB_per_token"] > 0
    assert 0 <= one["hit_rate"] < 1
    # host time a round is reported beside the wall time (CPU time of the engine thread)
    assert 0 < one["host_ms"] and one["copies"] == "torch" and "sync_wait_ms" in one
    assert one["hit_rate_lru"] == one["hit_rate"] and one["hit_rate_belady"] >= one["hit_rate"]
    assert (
        cases[("1slots", "mtp")]["drafts_per_lane"] == 3 and cases[("1slots", "mtp")]["projected_tok_s"] > 0
    )
    mtp = cases[("1slots", "mtp")]  # the drafter's time a round, beside the round's
    assert mtp["mtp_head"] == "StaticMTPDrafter" and mtp["mtp_graphs"] is False  # (no CUDA here)
    assert 0 < mtp["drafter_ms"] < mtp["round_ms"] and mtp["propose_ms"] > 0 and mtp["commit_ms"] > 0
    assert "drafter_ms" not in one
    assert res["bytes"]["expert"] * 16 * 4 == res["bytes"]["experts"]  # 16 experts x 4 MoE layers
    assert "card | mode | lanes" in capsys.readouterr().out


def test_tiny_off_async_routes_as_off(tmp_path: Path) -> None:
    """Mode off-async (async rounds, what ignis-run serves with speculation off on CUDA): the same
    tokens, hit rate and bytes a token as mode off (the same routing through a cache of the same
    state), its rounds issued ahead reported."""
    argv = ["--tiny", "--lanes", "1,2", "--modes", "off,off-async", "--tokens", "6", "--out", str(tmp_path)]
    assert main(argv) == 0
    res = json.loads((tmp_path / "bench_expert_cache.json").read_text())
    cases = {(c["card"], c["mode"], c["lanes"]): c for c in res["cases"]}
    for card in ("1slots", "4slots"):
        for lanes in (1, 2):
            off, ahead = cases[(card, "off", lanes)], cases[(card, "off-async", lanes)]
            keys = (
                "tokens",
                "rounds",
                "hit_rate",
                "MB_per_token",
                "MB_per_round",
                "prefetches",
                "experts_per_forward",
            )
            assert {k: off[k] for k in keys} == {k: ahead[k] for k in keys}
            assert "async_issued" not in off and ahead["async_issued"] >= 4


def test_projection_rules() -> None:
    assert expected_tokens(0, 0.8) == 1 and abs(expected_tokens(3, 0.5) - 1.875) < 1e-12
    # the default row budget of 8: 3 drafts at 1-2 lanes, 1 at 3-4, none from 5 on; budget 3: 1 lane only
    assert [drafts_per_lane(n, 3, 8) for n in (1, 2, 3, 4, 5, 8)] == [3, 3, 1, 1, 0, 0]
    assert [drafts_per_lane(n, 3, 3) for n in (1, 2)] == [2, 0]


def test_tiny_mmap_host_matches_pageable(tmp_path: Path) -> None:
    """--host mmap: the experts written to a container in --mmap-dir and served from its memory map
    route and copy exactly as pageable ones (same hits, same bytes); the file is removed after."""
    runs = {}
    for host in ("pageable", "mmap"):
        out = tmp_path / host
        argv = ["--tiny", "--lanes", "1", "--modes", "off", "--tokens", "3", "--out", str(out)]
        assert main([*argv, "--host", host, "--mmap-dir", str(tmp_path)]) == 0
        runs[host] = json.loads((out / "bench_expert_cache.json").read_text())
    assert runs["mmap"]["host"] == "mmap" and all(c["host"] == "mmap" for c in runs["mmap"]["cases"])
    keys = ("card", "tokens", "hit_rate", "MB_per_token", "rounds")
    assert [[c[k] for k in keys] for c in runs["mmap"]["cases"]] == [
        [c[k] for k in keys] for c in runs["pageable"]["cases"]
    ]
    assert not list(tmp_path.glob("ignis-bench-experts-*"))


def test_tiny_lookahead_reports_prefetches_and_recall(tmp_path: Path) -> None:
    """--lookahead (the static executor's split rounds, on the CPU too): prefetches and recall."""
    argv = ["--tiny", "--lanes", "2", "--modes", "off", "--tokens", "4", "--lookahead"]
    argv += ["--out", str(tmp_path)]
    assert main(argv) == 0
    res = json.loads((tmp_path / "bench_expert_cache.json").read_text())
    four = next(c for c in res["cases"] if c["card"] == "4slots")
    assert four["prefetches"] > 0 and 0 <= four["lookahead_recall"] <= 1
    assert four["hit_rate_lru_lookahead"] == four["hit_rate"]  # the replay with the prefetches


def test_tiny_breakdown_reports_the_host_sections(tmp_path: Path, capsys) -> None:
    """--breakdown (the static executor's split rounds on the CPU, misses by memmove): each cached
    case's JSON has the per-section host time of its rounds, printed too."""
    argv = ["--tiny", "--lanes", "1", "--modes", "off", "--tokens", "3", "--breakdown", "--copies", "memmove"]
    assert main([*argv, "--executor", "static", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_expert_cache.json").read_text())
    for case in res["cases"]:
        bd = case["breakdown"]
        assert case["copies"] == "memmove" and bd["rounds"] >= 1 and bd["moe_layers_per_round"] == 4
        assert {"piece", "ids_copy", "lookup", "table", "launch", "engine"} <= set(bd["ms_per_round"])
        assert abs(sum(bd["ms_per_round"].values()) - bd["round_ms"]) < 0.05
    assert "host breakdown:" in capsys.readouterr().out


def test_host_path_probe(tmp_path: Path) -> None:
    """`expert_host_path`: the cache's host path alone at a routing shape, every section timed."""
    from ignis.tools.bench.expert_host_path import main as probe

    argv = ["--layers", "3", "--experts", "16", "--top-k", "4", "--slots", "6", "--rows", "1,3"]
    assert probe([*argv, "--rounds", "6", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "bench_expert_host_path.json").read_text())
    assert [c["rows"] for c in res["cases"]] == [1, 3]
    for case in res["cases"]:
        assert case["rounds"] == 3 and case["moe_layers_per_round"] == 3 and 0 <= case["hit_rate"] < 1
        assert {"ids_copy", "lookup", "miss_gather", "miss_issue", "table", "launch"} <= set(
            case["us_per_layer"]
        )
