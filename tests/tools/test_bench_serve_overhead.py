"""`python -m ignis.tools.bench.serve_overhead --synthetic`: the synthetic model is an exact executor
(greedy output = its fixed next-token rule), and the benchmark serves it through a real `ignis-run`
subprocess, checks the served ids against in-process, and writes its table and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.server.model import ModelSettings
from ignis.tools.bench.serve_overhead import SyntheticSource, next_token

REPO = Path(__file__).resolve().parents[2]


def test_synthetic_engine_follows_the_next_token_rule() -> None:
    model = SyntheticSource(vocab_size=512, round_s=0.0).load(ModelSettings(spec=SpecDefaults(backend="off")))
    vocab = int(model.tokenizer.vocab_size)
    assert 300 <= vocab <= 512
    engine = model.make_engine(4, SpeculativeMetrics())
    prompts = [[5, 9, 200], [7], [300, 1, 2, 3, 4]]
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        seq = list(prompt)
        for _ in range(20):
            seq.append(next_token(seq[-1], len(seq) - 1, vocab))
        assert list(res.output_token_ids) == seq[len(prompt) :]
        assert 0 not in res.output_token_ids  # never EOS


def test_synthetic_tokenizer_round_trips_text() -> None:
    tok = SyntheticSource(vocab_size=1024).load(ModelSettings(spec=SpecDefaults(backend="off"))).tokenizer
    text = "the quick brown fox, éàü."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize(
    "order", ["--interleave", "--no-interleave", "--in-process-thread", "--async-rounds"]
)
def test_bench_runs_in_process_and_served(tmp_path: Path, order: str) -> None:
    out = tmp_path / "ovh.json"
    cmd = [sys.executable, "-m", "ignis.tools.bench.serve_overhead", "--synthetic", "--round-ms", "0.5"]
    cmd += [
        "--lanes",
        "1,3",
        "--max-tokens",
        "24",
        "--input-len",
        "5",
        "--repeat",
        "1",
        "--json-out",
        str(out),
        order,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["lanes"] for r in doc["rows"]] == [1, 3] and doc["server_lanes"] == 3
    assert doc["interleaved"] == (order != "--no-interleave")
    assert doc["in_process_thread"] == (order == "--in-process-thread")
    assert doc["async_rounds"] == (order == "--async-rounds")  # the served ids equal in-process ones
    for row in doc["rows"]:
        assert row["in_process_tok_s"] > 0 and row["served_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["served_tok_s"] / row["in_process_tok_s"])
        assert row["server_cpu_s_per_token"] > 0
    assert "| 3 |" in proc.stdout and "served / in-process" in proc.stdout


def test_bench_needs_exactly_one_model() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ignis.tools.bench.serve_overhead"], capture_output=True, text=True, cwd=REPO
    )
    assert proc.returncode == 2 and "exactly one of --artifact DIR and --synthetic" in proc.stderr


def test_bench_serves_with_and_without_the_engine_process(tmp_path: Path) -> None:
    """`--engine-process both`: two servers, one table each; the engine process's CPU is counted."""
    out = tmp_path / "ovh.json"
    cmd = [sys.executable, "-m", "ignis.tools.bench.serve_overhead", "--synthetic", "--round-ms", "0.5"]
    cmd += ["--lanes", "2", "--max-tokens", "24", "--input-len", "5", "--repeat", "1", "--json-out", str(out)]
    cmd += ["--engine-process", "both", "--no-interleave"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["engine_process"] == "both" and sorted(doc["modes"]) == ["process", "thread"]
    for rows in doc["modes"].values():
        (row,) = rows
        assert row["lanes"] == 2 and row["served_tok_s"] > 0 and row["server_cpu_s_per_token"] > 0
    assert doc["rows"] == doc["modes"]["thread"]
    assert "engine in its own process" in proc.stdout and "engine in a thread" in proc.stdout
