"""Issue 25: the fixed-acceptance drafter served through `ignis-run`'s own option, driven by
`ignis-bench` over the socket, as tools/bench/fullsize_27b.sh does on the GPU.

A tiny random qwen3_5 artifact (tools/random_checkpoint.py, cpu card) is served with speculation
off while `ignis-bench --save-outputs` records the greedy outputs of its token-id prompts; then with
`--spec-backend replay --spec-replay FILE --spec-replay-accept 0.885`: the recorded outputs come back
token for token, and the report's first-position acceptance is ~0.885.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

build = pytest.importorskip("ignis.compiler.build")

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
BENCH = ["--input-len", "12", "--num-requests", "6", "--max-tokens", "40", "--concurrency", "3"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ignis.tools.random_checkpoint import write_random_checkpoint

    root = tmp_path_factory.mktemp("bench-replay")
    write_random_checkpoint(root / "ckpt", model="tiny")
    (root / "r.toml").write_text('name = "tiny-replay"\n[modules]\nwidths = []\n')
    res = build.build_artifact(
        card="cpu",
        model=root / "ckpt",
        recipe=root / "r.toml",
        out=root / "art",
        progress=False,
        echo=lambda _l: None,
    )
    return Path(res.out)


def _serve_and_bench(artifact: Path, folder: Path, spec: list[str], bench: list[str]) -> None:
    sock = folder / "s.sock"
    cmd = [sys.executable, "-m", "ignis.runtime.cli", "--artifact", str(artifact), "--socket", str(sock)]
    cmd += ["--lanes", "4", "--log-level", "warning", "--device", "cpu", *spec]
    with (folder / "server.log").open("wb") as log:
        proc = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, (folder / "server.log").read_text()
                assert time.monotonic() < deadline, "ignis-run did not start"
                try:
                    if sock.exists():
                        transport = httpx.HTTPTransport(uds=str(sock))
                        with httpx.Client(transport=transport, base_url="http://ignis") as c:
                            if c.get("/health").status_code == 200:
                                break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            run = subprocess.run(
                [sys.executable, "-m", "ignis.tools.bench.serve.cli", "--no-progress", "--socket", str(sock),
                 *BENCH, *bench],
                env=ENV, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _rows(path: Path) -> dict[tuple[int, ...], list[int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {tuple(r["prompt_token_ids"]): r["output_token_ids"] for r in rows}


def test_replay_served_matches_spec_off_and_accepts_about_p(artifact: Path, tmp_path: Path) -> None:
    ref, got, report = tmp_path / "ref.jsonl", tmp_path / "got.jsonl", tmp_path / "replay.json"
    _serve_and_bench(artifact, tmp_path, ["--spec-backend", "off"], ["--save-outputs", str(ref)])
    recorded = _rows(ref)
    assert len(recorded) == 6 and all(len(o) == 40 for o in recorded.values())
    assert all(len(p) == 12 for p in recorded)
    spec = ["--spec-backend", "replay", "--spec-replay", str(ref), "--spec-replay-accept", "0.885"]
    _serve_and_bench(artifact, tmp_path, spec, ["--save-outputs", str(got), "--json-out", str(report)])
    assert _rows(got) == recorded  # exact: greedy with the replay drafter == speculation off
    s = json.loads(report.read_text())["speculative"]
    assert s["rounds"] > 0 and s["per_position"][0]["drafted"] > 0
    first = s["per_position"][0]["rate"]
    assert abs(first - 0.885) < 0.12, first
    assert s["tokens_per_round"] > 3.5, s


def test_save_outputs_is_refused_on_the_chat_endpoint(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ignis.tools.bench.serve.cli", "--socket", str(tmp_path / "none.sock"),
         "--endpoint", "chat", "--save-outputs", str(tmp_path / "o.jsonl")],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "--save-outputs records /v1/completions" in run.stderr
