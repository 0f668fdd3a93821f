"""`ignis-run`: options, refusals, config files, the draft-head log line (in process, the serving loop
stubbed), and the real command in a subprocess: serve, SIGTERM, finish or cancel lanes, socket removed."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from server_helpers import BASE_URL, serve, short_tmpdir

from ignis.runtime import cli

HERE = Path(__file__).resolve().parent
TESTS = HERE.parents[1]
FACTORY = "toy_model:from_env"


def invoke(*args: str, env: dict[str, str] | None = None) -> object:
    return CliRunner().invoke(cli.main, ["--model-factory", FACTORY, *args], env=env, catch_exceptions=False)


def test_help_explains_every_option() -> None:
    result = CliRunner().invoke(cli.main, ["--help"])
    assert result.exit_code == 0
    for param in cli.main.params:
        assert param.help, f"{param.name} has no help"
        for opt in param.opts:
            assert opt in result.output
    for name in (
        "--spec-backend",
        "--spec-draft-tokens",
        "--spec-draft-rows",
        "--spec-draft-head",
        "--model-max-context",
        "--profile",
        "--config",
        "--lanes",
        "--max-prefill-tokens",
        "--socket-group",
    ):
        assert name in result.output


def test_resolves_and_logs_the_draft_head(captured, caplog: pytest.LogCaptureFixture) -> None:
    sock = short_tmpdir() / "s.sock"
    with caplog.at_level(logging.INFO, logger="ignis.runtime.draft_head"):
        result = invoke(
            "--socket",
            str(sock),
            "--spec-backend",
            "dflash2",
            "--spec-draft-tokens",
            "5",
            "--spec-draft-head",
            "shortlist",
            "--lanes",
            "3",
            "--model-max-context",
            "128",
        )
    assert result.exit_code == 0, result.output
    (server,) = captured
    assert server.model.spec.backend == "dflash2" and server.model.spec.draft_tokens == 5
    assert server.options.lanes == 3 and server.lanes.max_context == 128
    heads = [r.getMessage() for r in caplog.records if r.name == "ignis.runtime.draft_head"]
    assert len(heads) == 1 and heads[0].startswith("proposal head: shortlist")
    assert not sock.exists()


def test_profile_defaults_apply(captured) -> None:
    sock = short_tmpdir() / "s.sock"
    result = invoke("--socket", str(sock), env={"IGNIS_TOY_KINDS": "mtp", "IGNIS_TOY_PROFILE": "rtxpro6000"})
    assert result.exit_code == 0, result.output
    spec = captured[0].model.spec
    assert (spec.backend, spec.draft_tokens, spec.draft_rows) == ("mtp", 3, 8)
    result = invoke("--socket", str(sock), "--profile", "rtx5090", env={"IGNIS_TOY_KINDS": "mtp"})
    assert result.exit_code == 0, result.output
    assert captured[1].model.spec.backend == "off"


def test_config_file_per_model_section_and_command_line_precedence(captured, tmp_path: Path) -> None:
    sock = short_tmpdir() / "s.sock"
    cfg = tmp_path / "ignis.yaml"
    cfg.write_text(
        f"socket: {sock}\nlanes: 3\nqueue_size: 5\nspec:\n  backend: dflash2\n  draft_tokens: 6\n"
        "  toy:\n    backend: off\nmodel:\n  toy: {max_context: 100}\n"
    )
    result = invoke("--config", str(cfg))
    assert result.exit_code == 0, result.output
    server = captured[0]
    assert server.model.spec.backend == "off"  # the per-model section turned it off
    assert server.options.lanes == 3 and server.options.queue_size == 5
    assert server.lanes.max_context == 100
    result = invoke(
        "--config", str(cfg), "--lanes", "2", "--spec-backend", "dflash2", "--served-model-name", "other"
    )
    assert result.exit_code == 0, result.output
    server = captured[1]
    assert server.options.lanes == 2
    assert server.model.spec == captured[1].model.spec and server.model.spec.draft_tokens == 6
    assert server.model.name == "other" and server.model.accepts("toy")


@pytest.mark.parametrize(
    ("args", "env", "match"),
    [
        (["--spec-draft-tokens", "3"], {}, "without a speculative backend"),
        (["--spec-backend", "off", "--spec-draft-tokens", "3"], {}, "without a speculative backend"),
        (["--spec-backend", "dflash2"], {}, "needs draft tokens"),
        (["--spec-backend", "mtp"], {"IGNIS_TOY_KINDS": "dflash2"}, "no mtp drafter"),
        (["--profile", "nocard"], {}, "unknown card"),
        (["--model-max-context", "100000"], {}, "max_position_embeddings"),
    ],
)
def test_refusals_exit_1_with_the_reason(captured, args: list[str], env: dict[str, str], match: str) -> None:
    sock = short_tmpdir() / "s.sock"
    result = invoke("--socket", str(sock), *args, env=env)
    assert result.exit_code == 1, result.output
    assert match in result.output
    assert not captured and not sock.exists()


@pytest.mark.parametrize(
    ("args", "code", "match"),
    [
        (["--spec-draft-tokens", "8"], 2, "1<=x<=7"),
        (["--spec-draft-rows", "33"], 2, "0<=x<=32"),
        (["--spec-backend", "medusa"], 2, "dflash2"),
        (["--lanes", "0"], 2, "x>=1"),
        (["--max-prefill-tokens", "-1"], 2, "x>=0"),
    ],
)
def test_out_of_range_options_are_usage_errors(args: list[str], code: int, match: str) -> None:
    result = invoke("--socket", "/tmp/unused.sock", *args)
    assert result.exit_code == code and match in result.output


def test_max_prefill_tokens_reaches_the_engine(captured, tmp_path: Path) -> None:
    """--max-prefill-tokens, else the config file's max_prefill_tokens, else 2048; 0 (no limit) allowed."""
    sock = short_tmpdir() / "s.sock"
    cfg = tmp_path / "ignis.toml"
    cfg.write_text(f'socket = "{sock}"\nmax_prefill_tokens = 96\n')
    for args, want in (
        (["--socket", str(sock)], 2048),
        (["--socket", str(sock), "--max-prefill-tokens", "0"], 0),
        (["--config", str(cfg)], 96),
        (["--config", str(cfg), "--max-prefill-tokens", "512"], 512),
    ):
        result = invoke(*args)
        assert result.exit_code == 0, result.output
        assert captured[-1].lanes._engine.max_prefill_tokens == want, args
    cfg.write_text(f'socket = "{sock}"\nmax_prefill_tokens = -4\n')
    result = invoke("--config", str(cfg))
    assert result.exit_code == 1 and "max_prefill_tokens must be >= 0" in result.output


def test_a_source_that_drops_the_prefill_budget_is_named_in_a_warning(
    captured, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A custom source whose engines ignore ModelSettings.max_prefill_tokens serves with its own
    budget, and ignis-run says so (once, at start); a source that passes it on gets no warning."""
    sock = short_tmpdir() / "s.sock"
    with caplog.at_level(logging.WARNING, logger="ignis.runtime.cli"):
        assert invoke("--socket", str(sock), "--max-prefill-tokens", "64").exit_code == 0
    assert "max_prefill_tokens" not in caplog.text
    monkeypatch.setenv("IGNIS_TOY_IGNORE_PREFILL_BUDGET", "1")
    with caplog.at_level(logging.WARNING, logger="ignis.runtime.cli"):
        assert invoke("--socket", str(sock), "--max-prefill-tokens", "64").exit_code == 0
    assert captured[-1].lanes.max_prefill_tokens == 2048
    assert "built its engine with max_prefill_tokens 2048, not the 64 asked for" in caplog.text


def test_needs_exactly_one_model_and_a_listener(captured) -> None:
    result = CliRunner().invoke(cli.main, ["--socket", "/tmp/x.sock"])
    assert result.exit_code == 2 and "exactly one of --artifact" in result.output
    result = invoke()
    assert result.exit_code == 2 and "socket path or a TCP port" in result.output


def test_a_live_servers_socket_is_refused_before_loading(captured) -> None:
    with serve() as running:
        result = invoke("--socket", str(running.socket))
        assert result.exit_code == 1 and "live server" in result.output
        with running.client() as client:
            assert client.get("/health").status_code == 200


# ---------------------------------------------------------------- the real command


def _start(sock: Path, *args: str, delay: float) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(HERE)]),
        "IGNIS_TOY_DELAY": str(delay),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ignis.runtime.cli",
            "--model-factory",
            FACTORY,
            "--socket",
            str(sock),
            "--spec-backend",
            "dflash2",
            "--spec-draft-tokens",
            "3",
            "--lanes",
            "2",
            *args,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ignis-run exited early: {proc.stderr.read()}")
        if sock.exists():
            try:
                with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url=BASE_URL) as c:
                    if c.get("/health").status_code == 200:
                        return proc
            except httpx.TransportError:
                pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("ignis-run did not start")


def _stream_in_thread(sock: Path, body: dict, lines: list[str], first: threading.Event) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.Client(
                transport=httpx.HTTPTransport(uds=str(sock)), base_url=BASE_URL, timeout=30
            ) as c:
                with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    for line in r.iter_lines():
                        if line:
                            lines.append(line)
                            first.set()
        except httpx.HTTPError as exc:
            lines.append(f"error: {exc!r}")
        first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_sigterm_finishes_lanes_and_removes_the_socket() -> None:
    sock = short_tmpdir() / "ignis.sock"
    proc = _start(sock, delay=0.01)
    try:
        assert (sock.stat().st_mode & 0o777) == 0o600
        lines: list[str] = []
        first = threading.Event()
        t = _stream_in_thread(
            sock, {"prompt": [1, 2], "max_tokens": 60, "ignore_eos": True, "temperature": 0}, lines, first
        )
        assert first.wait(20)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert lines[-1] == "data: [DONE]"  # the request in flight finished
    chunks = [json.loads(x[len("data: ") :]) for x in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 60
    assert not os.path.lexists(sock)
    assert "ignis.runtime.draft_head: proposal head: full" in err


def test_sigterm_past_the_shutdown_timeout_cancels_lanes() -> None:
    sock = short_tmpdir() / "ignis.sock"
    proc = _start(sock, "--shutdown-timeout", "0.5", delay=0.08)
    try:
        lines: list[str] = []
        first = threading.Event()
        t = _stream_in_thread(sock, {"prompt": [1, 2], "max_tokens": 250, "ignore_eos": True}, lines, first)
        assert first.wait(20)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
        t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err  # a request was cut
    # The request alone needs ~20 s more (250 rounds x 0.08 s); the bound leaves room for a loaded CI box.
    assert elapsed < 10.0
    assert lines[-1] == "data: [DONE]"  # the stream ended properly ...
    chunks = [json.loads(x[len("data: ") :]) for x in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"  # ... as cancelled
    assert chunks[-1]["usage"]["completion_tokens"] == len(chunks) - 1 < 250
    assert not os.path.lexists(sock)
