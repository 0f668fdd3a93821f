"""tools/bench/fullsize_27b.sh (issue 25 item 4) dry-run on the CPU: every phase the GPU host runs
(write, build, off, dflash2, replay, table) on the tiny preset, card cpu, through the shell wrapper.

The table's JSON must hold a row per backend and concurrency, every output equal to speculation
off's (dflash2 and replay), and the replay drafter's first-position acceptance near 0.885. The
default weights are the confident ones; serving the artifact as the other kind is refused. Each
server also answers the equality prompts (socket_equality): every output equals off's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ignis.compiler.build")

ROOT = Path(__file__).resolve().parents[2]


def test_every_phase_runs_on_the_tiny_model(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "IGNIS_NS": str(tmp_path / "ns"), "OMP_NUM_THREADS": "1"}
    env.pop("IGNIS_TVM_LIB_DIR", None)
    out = tmp_path / "out"
    args = ["--model", "tiny", "--card", "cpu", "--widths", "", "--ckpt-root", str(tmp_path / "ckpt"),
            "--art-root", str(tmp_path / "art"), "--out", str(out), "--num-requests", "4",
            "--max-tokens", "32", "--keep-checkpoint", "--equality-prompts", "2",
            "--equality-tokens", "16"]  # fmt: skip
    first = subprocess.run(
        ["bash", "tools/bench/fullsize_27b.sh", *args, "write", "build", "off", "replay"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-4000:]
    second = subprocess.run(  # a later command: the state carries over (the write phase is skipped)
        ["bash", "tools/bench/fullsize_27b.sh", *args, "write", "dflash2", "table"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-4000:]
    assert "already holds the tiny confident checkpoint" in second.stderr
    assert "27B-shaped qwen3_5 at the socket" in second.stdout
    table = json.loads((out / "fullsize_27b.json").read_text())
    rows = {(r["backend"], r["concurrency"]): r for r in table["rows"]}
    assert set(rows) == {(b, c) for b in ("off", "dflash2", "replay") for c in (1, 8)}
    assert all(r["same_as_off"] == "4/4" and r["failed"] == 0 for r in rows.values())
    for c in (1, 8):
        assert abs(rows[("replay", c)]["first_acceptance"] - 0.885) < 0.15
        assert rows[("replay", c)]["tokens_per_round"] > 3.0
        assert rows[("off", c)]["tokens_per_round"] == 1.0
        assert "drafter_ms_per_round" in rows[("dflash2", c)]
    assert table["build"]["rc"] == 0 and (tmp_path / "art" / "replay.jsonl").exists()
    assert table["weights"] == "confident" and table["build"]["weights"] == "confident"
    eq = {r["pair"]: r for r in json.loads((out / "socket_equality.json").read_text())["rows"]}
    passes = ((1, ""), (1, " (repeats)"), (8, " (repeats)"))
    pairs = {f"{b} vs off at {c} clients{r}" for b in ("dflash2", "replay") for c, r in passes}
    assert set(eq) == {"off repeat vs first at 1 clients", "off 8 vs 1 clients (repeats)"} | pairs
    assert all(r["compared"] == 2 and r["divergent"] == 0 for r in eq.values())
    from ignis.tools.bench.socket_equality import make_prompts, read_records

    records = read_records(out)  # logprobs from every backend, speculation on too; the confident margins
    assert {r["label"] for r in records} == {"off", "dflash2", "replay"}
    assert all(len(r["gaps"]) == 16 and min(r["gaps"]) > 2.0 for r in records)

    replayed = [json.loads(line)["prompt_token_ids"] for line in (tmp_path / "art" / "replay.jsonl").open()]
    assert all(p in replayed for p in make_prompts("ids", 2, 32, 1000, 1))  # off's equality outputs too
    assert "greedy outputs at the socket against off" in second.stdout
    other = subprocess.run(  # the plain init's figures never come from the confident artifact
        ["bash", "tools/bench/fullsize_27b.sh", *args, "--weights", "random", "off"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert other.returncode != 0 and "built from confident weights, not random" in other.stderr
