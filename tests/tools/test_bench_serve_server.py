"""`ignis-bench` against a real `ignis-run` on the CPU: a tiny qwen2 artifact built by `ignis-build`,
served with the draft-model backend drafting with the artifact itself (every greedy draft is the
model's own choice, so the acceptance counters move), over its Unix socket and over TCP.

Checked: the JSON report has its fields and its counts match the requests sent (the warm-up left
out, also in the /metrics deltas); tokens per round and per-position acceptance come out of the
counters; failed requests are counted by reason; the multi-turn replay grows each session's prompt
by the reply and the tool output; Ctrl-C reports what finished and exits 130.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

build = pytest.importorskip("ignis.compiler.build")
pytest.importorskip("transformers")

BASE_URL = "http://ignis"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import hf_tiny

    root = tmp_path_factory.mktemp("bench-art")
    ckpt = hf_tiny.save_tiny(
        hf_tiny.tiny_model("qwen2", seed=0, max_position_embeddings=1024),
        root / "ckpt",
        tokenizer=hf_tiny.tiny_tokenizer(),
    )
    (root / "r.toml").write_text('name = "tiny-bench"\n[modules]\nwidths = [1]\n')
    res = build.build_artifact(
        card="cpu", model=ckpt, recipe=root / "r.toml", out=root / "art", progress=False, echo=lambda _l: None
    )
    return Path(res.out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, sock: Path, port: int, proc: subprocess.Popen[bytes]) -> None:
        self.sock, self.port, self.proc = sock, port, proc

    def http(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)), base_url=BASE_URL, timeout=60)

    def counter(self, name: str) -> float:
        with self.http() as c:
            text = c.get("/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def server(artifact: Path) -> Iterator[Server]:
    folder = Path(tempfile.mkdtemp(prefix="ignb-", dir="/tmp"))
    sock, port, log = folder / "s.sock", _free_port(), (folder / "server.log").open("wb")
    cmd = [sys.executable, "-m", "ignis.runtime.cli", "--artifact", str(artifact), "--socket", str(sock)]
    cmd += ["--port", str(port), "--lanes", "4", "--log-level", "warning"]
    cmd += ["--spec-backend", "draft-model", "--spec-draft-model", str(artifact), "--spec-draft-tokens", "3"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    running = Server(sock, port, proc)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (folder / "server.log").read_text()
            assert time.monotonic() < deadline, "ignis-run did not start"
            try:
                if sock.exists():
                    with running.http() as c:
                        if c.get("/health").status_code == 200:
                            break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield running
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)


def _bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "ignis.tools.bench.serve.cli", "--no-progress", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_load_over_the_socket_reports_every_request_and_the_acceptance(
    server: Server, tmp_path: Path
) -> None:
    out = tmp_path / "r.json"
    gen_before = server.counter("ignis_generation_tokens_total")
    proc = _bench(
        "--socket", str(server.sock), "--input-len", "8,16", "--num-requests", "6", "--max-tokens", "12",
        "--concurrency", "3", "--warmup", "1", "--json-out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["mode"] == "load" and rep["model"] == "tiny-bench" and not rep["interrupted"]
    assert rep["config"]["endpoint"] == "completions" and rep["config"]["concurrency"] == 3
    s = rep["summary"]
    assert (s["requests"], s["completed"], s["failed"], s["errors"]) == (6, 6, 0, {})
    assert s["output_tokens"] == 6 * 12 and s["prompt_tokens"] == 3 * 8 + 3 * 16
    for key in ("ttft", "tpot", "itl", "e2e", "decode_tok_s"):
        assert set(s[key]) >= {"mean", "p50", "p90", "p99", "min", "max", "count"}, key
    assert s["ttft"]["count"] == 6 and s["itl"]["count"] == 6 * 11 and s["output_throughput"] > 0
    reqs = rep["requests"]
    assert [r["index"] for r in reqs] == list(range(6))
    assert [r["prompt_tokens"] for r in reqs] == [8, 16, 8, 16, 8, 16]
    for r in reqs:
        assert r["ok"] and r["output_tokens"] == 12 and len(r["itl"]) == 11
        assert 0 < r["ttft"] <= r["e2e"] and r["finish_reason"] == "length"
    # The counters moved by the measured requests only (the warm-up ran before the first read).
    delta = rep["metrics_delta"]
    assert delta["ignis_generation_tokens_total"] == 6 * 12
    assert server.counter("ignis_generation_tokens_total") - gen_before == 7 * 12
    spec = rep["speculative"]
    assert spec["rounds"] > 0 and spec["drafted_tokens"] > 0
    assert spec["tokens_per_round"] == pytest.approx(spec["accepted_tokens"] / spec["rounds"])
    assert spec["tokens_per_round"] > 3.0  # its own drafts: 4 tokens a round but where max_tokens cuts
    assert [p["position"] for p in spec["per_position"]] == [0, 1, 2]
    assert all(p["drafted"] > 0 and p["rate"] == 1.0 for p in spec["per_position"])
    assert "Tokens per round" in proc.stdout and "TTFT" in proc.stdout and "p99" in proc.stdout
    assert rep["server_lanes"] == 4 and rep["argv"][:2] == ["ignis-bench", "--no-progress"]
    assert "prompt_checkpoints" in rep  # None until the server exports ignis_prompt_checkpoint_*
    side = rep["server_side"]
    assert side["generation_tokens"] == 6 * 12 and side["prompt_tokens"] == 3 * 8 + 3 * 16
    assert 0 < side["ttft_mean_s"] <= s["ttft"]["mean"]  # the server's clock starts after the client's


def test_chat_prompts_sampled_over_tcp_at_a_request_rate(server: Server, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    lines = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"Say {i} words."}]} for i in range(3)]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "r.json"
    proc = _bench(
        "--url", f"http://127.0.0.1:{server.port}", "--dataset", str(prompts), "--max-tokens", "6",
        "--temperature", "0.8", "--seed", "3", "--request-rate", "20", "--concurrency", "2",
        "--percentiles", "50,95", "--json-out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["server"] == f"http://127.0.0.1:{server.port}" and rep["config"]["endpoint"] == "chat"
    assert rep["config"]["request_rate"] == 20 and rep["config"]["temperature"] == 0.8
    assert rep["summary"]["completed"] == 3 and rep["summary"]["output_tokens"] == 18
    assert [r["prompt_id"] for r in rep["requests"]] == ["q0", "q1", "q2"]
    assert set(rep["summary"]["ttft"]) >= {"p50", "p95"} and "p99" not in rep["summary"]["ttft"]
    starts = [r["start"] for r in rep["requests"]]
    assert starts == sorted(starts) and starts[-1] > starts[0]  # Poisson gaps, not all at once


def test_a_concurrency_sweep_runs_each_and_compares_them(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = _bench(
        "--socket", str(server.sock), "--input-len", "8", "--prefix-len", "5", "--num-requests", "4",
        "--max-tokens", "6", "--max-concurrency", "1,4", "--label", "self-drafted", "--json-out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"]["concurrency"] for r in runs] == [1, 4]
    assert all(r["summary"]["completed"] == 4 and r["summary"]["output_tokens"] == 24 for r in runs)
    assert all(r["summary"]["prompt_tokens"] == 4 * 13 and r["label"] == "self-drafted" for r in runs)
    # one at a time: each request starts after the one before it ended
    seq = runs[0]["requests"]
    assert all(b["start"] >= a["start"] + a["e2e"] for a, b in itertools.pairwise(seq))
    assert proc.stdout.count("Tokens per round") == 2  # each run's table, then the comparison last
    assert proc.stdout.rindex("Tokens per round") < proc.stdout.index("ignis-bench: sweep")


def test_failed_requests_are_counted_by_reason(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    # ids past the vocabulary (384): every request is refused with a 400, the run goes on
    proc = _bench(
        "--socket", str(server.sock), "--input-len", "4", "--token-id-range", "1000:2000",
        "--num-requests", "3", "--warmup", "0", "--max-tokens", "4", "--json-out", str(out),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["summary"]["completed"] == 0 and rep["summary"]["failed"] == 3
    assert rep["summary"]["errors"] == {"HTTP 400": 3}
    assert all("outside the vocabulary" in r["error"] and r["status"] == 400 for r in rep["requests"])
    assert "failed: HTTP 400" in proc.stdout
    # with a warm-up, the same refusal stops the run before it starts
    proc = _bench(
        "--socket", str(server.sock), "--input-len", "4", "--token-id-range", "1000:2000", "--max-tokens", "4"
    )
    assert proc.returncode == 1 and "warm-up request failed: HTTP 400" in proc.stderr


def test_multi_turn_sessions_grow_by_reply_and_tool_output(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = _bench(
        "--socket", str(server.sock), "--multi-turn", "--endpoint", "completions", "--sessions", "3",
        "--turns", "3", "--tool-tokens", "10:20", "--opener-tokens", "30", "--max-tokens", "8",
        "--concurrency", "2", "--json-out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["mode"] == "multi-turn" and rep["summary"]["completed"] == 9
    by_session: dict[int, list[dict]] = {}
    for r in rep["requests"]:
        by_session.setdefault(r["session"], []).append(r)
    assert sorted(by_session) == [0, 1, 2]
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2] and turns[0]["prompt_tokens"] == 30
        for a, b in itertools.pairwise(turns):
            assert 10 <= b["prompt_tokens"] - a["prompt_tokens"] - 8 <= 20
        assert all(0 <= r["cached_tokens"] <= r["prompt_tokens"] for r in turns)
    # sessions interleave: with 2 clients, session 2's first turn comes before session 0's last
    order = [(r["session"], r["turn"]) for r in sorted(rep["requests"], key=lambda r: r["start"])]
    assert order.index((2, 0)) < order.index((0, 2))
    mt = rep["multi_turn"]
    assert [t["turn"] for t in mt["per_turn"]] == [0, 1, 2]
    assert mt["turns_completed"] == 9 and mt["sessions_ended"] == {"turns": 3}
    total = sum(r["prompt_tokens"] for r in rep["requests"])
    cached = sum(r["cached_tokens"] for r in rep["requests"])
    assert mt["prompt_tokens"] == total and mt["prompt_tokens_reused_pct"] == pytest.approx(
        100 * cached / total
    )
    assert mt["ttft_ms_per_1k_prompt_tokens"] is not None
    assert "Prompt tokens reused" in proc.stdout


def test_multi_turn_chat_sessions_end_at_the_context(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = _bench(
        "--socket", str(server.sock), "--multi-turn", "--sessions", "2", "--turns", "50",
        "--tool-tokens", "100:150", "--opener-tokens", "60", "--max-tokens", "8", "--concurrency", "2",
        "--json-out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    mt = rep["multi_turn"]
    assert mt["sessions_ended"] == {"context": 2} and rep["summary"]["failed"] == 0
    assert 2 * 3 <= rep["summary"]["completed"] < 2 * 50
    assert all(r["prompt_tokens"] + 8 <= rep["max_model_len"] for r in rep["requests"])
    for s in (0, 1):
        grows = [
            r["prompt_tokens"] for r in sorted(rep["requests"], key=lambda r: r["turn"]) if r["session"] == s
        ]
        assert grows == sorted(grows) and len(set(grows)) == len(grows)


def test_ctrl_c_reports_what_finished(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    finished = server.counter("ignis_request_finished_total")
    cmd = [sys.executable, "-m", "ignis.tools.bench.serve.cli", "--socket", str(server.sock)]
    cmd += ["--input-len", "8", "--num-requests", "400", "--max-tokens", "32", "--concurrency", "2"]
    cmd += ["--json-out", str(out)]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while server.counter("ignis_request_finished_total") < finished + 4:  # warm-up + 3 measured
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    assert "(interrupted)" in stdout and "report written" in stderr and "requests:" in stderr  # the bar
    rep = json.loads(out.read_text())
    s = rep["summary"]
    assert rep["interrupted"] and s["completed"] >= 1 and s["failed"] == 0
    assert s["completed"] + s["cancelled"] == s["requests"] < 400
    assert s["output_tokens"] == 32 * s["completed"]


def test_an_unreachable_server_is_named() -> None:
    proc = _bench("--socket", "/tmp/ignis-bench-no-such.sock", "--input-len", "4")
    assert (
        proc.returncode == 1
        and "cannot reach the server at unix socket /tmp/ignis-bench-no-such.sock" in (proc.stderr)
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input-len", "4", "--endpoint", "chat"], "only --endpoint completions"),
        (["--multi-turn", "--input-len", "4"], "leave out --dataset and --input-len"),
        (["--input-len", "0"], "every value must be >= 1"),
        (["--input-len", "4", "--turns", "3"], "--turns applies only with --multi-turn"),
        (["--multi-turn", "--request-rate", "2"], "--multi-turn takes no --request-rate"),
        (["--token-id-range", "9:3", "--input-len", "2"], "LOW < HIGH"),
        (["--percentiles", "50,120", "--input-len", "2"], "percentiles must be in [0, 100]"),
    ],
)
def test_bad_usage_exits_2(args: list[str], message: str) -> None:
    proc = _bench("--socket", "/tmp/x.sock", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_partial_acceptance_by_position_adds_up(tmp_path: Path) -> None:
    """The toy model served by `ignis-run --model-factory` with a drafter of other weights (mostly
    rejected): the per-position rates fall with the position and the counters' identity holds,
    tokens per round = 1 + accepted drafts per round (the bonus token is always emitted here)."""
    tests = Path(__file__).resolve().parents[1]
    folder = Path(tempfile.mkdtemp(prefix="ignb-", dir="/tmp"))
    sock, log = folder / "t.sock", (folder / "server.log").open("wb")
    env = {
        **ENV,
        "PYTHONPATH": os.pathsep.join([str(tests), str(tests / "runtime" / "server")]),
        "IGNIS_TOY_DRAFTER_SEED": "1",
        "IGNIS_TOY_CONTEXT": "512",
    }
    cmd = [sys.executable, "-m", "ignis.runtime.cli", "--model-factory", "toy_model:from_env"]
    cmd += ["--socket", str(sock), "--spec-backend", "dflash2", "--spec-draft-tokens", "3", "--lanes", "4"]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None, (folder / "server.log").read_text()
            assert time.monotonic() < deadline, "ignis-run did not start"
            time.sleep(0.1)
        out = tmp_path / "r.json"
        run = _bench(
            "--socket", str(sock), "--input-len", "5,9", "--token-id-range", "3:50", "--num-requests", "8",
            "--max-tokens", "40", "--concurrency", "4", "--json-out", str(out),
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
    spec = json.loads(out.read_text())["speculative"]
    rates = [p["rate"] for p in spec["per_position"]]
    assert len(rates) == 3 and rates[0] < 1.0 and rates[0] >= rates[1] >= rates[2]
    accepted_drafts = sum(p["accepted"] for p in spec["per_position"])
    assert spec["accepted_tokens"] == spec["rounds"] + accepted_drafts
    assert spec["draft_acceptance_rate"] == pytest.approx(accepted_drafts / spec["drafted_tokens"])
    assert 1.0 <= spec["tokens_per_round"] < 4.0


def test_an_unwritable_json_out_is_refused_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    proc = _bench(
        "--socket", "/tmp/x.sock", "--input-len", "4", "--json-out", str(tmp_path / "file" / "r.json")
    )
    assert proc.returncode == 2 and "cannot write" in proc.stderr and "--json-out" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_server_that_is_not_openai_compatible_is_named(tmp_path: Path) -> None:
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html>hello</html>"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        proc = _bench("--url", f"http://127.0.0.1:{httpd.server_address[1]}", "--input-len", "4")
    finally:
        httpd.shutdown()
    assert proc.returncode == 1 and "is not an OpenAI-compatible server" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
