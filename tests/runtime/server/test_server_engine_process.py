"""The server with its engine in a child process (`ignis-run --engine-process`, `engine_process.py`).

The key behaviours of the default mode's tests run here again against a server in engine-process
mode: the tests below imported from other modules are collected in this module, where the `server`,
`client` and `spec_server` fixtures serve with `engine_process=True` (the same wire format: the
golden SSE file; streaming, stops, seeds, logprobs, errors, metrics). test_server_concurrency.py
parametrizes its own (abort on disconnect, busy 503, engine failure, eight concurrent lanes). Then
what only this mode has: the child dying, giving up, load errors, grammars crossing the boundary,
shutdown by signal and no orphan process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import Running, serve, short_tmpdir
from test_server_api import (  # noqa: F401  (collected here, against this module's fixtures)
    test_a_refused_max_tokens_leaves_the_other_lanes_serving,
    test_bad_completion_requests_get_openai_errors,
    test_bad_requests_leave_the_server_healthy,
    test_chat_renders_the_template,
    test_chat_stream_role_first_then_content,
    test_completion_token_ids_prompt_matches_the_engine,
    test_eos_finishes_with_stop_and_is_counted,
    test_metrics_exposes_the_counters,
    test_models_and_health,
    test_prompt_too_long_says_context_length_exceeded,
    test_seed_fixes_the_random_stream,
    test_stop_strings_cut_text_identically_streamed_or_not,
    test_stop_token_ids,
    test_streamed_completion_one_token_per_chunk_with_usage,
)
from test_server_stream_bytes import (  # noqa: F401
    test_one_token_per_event_and_one_write_per_committed_run,
    test_streams_are_byte_identical_to_the_golden_file,
)
from toy_model import ToySource

from ignis.runtime.errors import ConfigError
from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.server import engine_process
from ignis.runtime.server.engine_process import EngineSpec, ProcessLaneLoop
from ignis.runtime.server.model import ModelSettings

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def server() -> Iterator[Running]:
    """The shared server of test_server_api's tests, its engine in a child process."""
    with serve(lanes=8, queue_size=16, engine_process=True) as running:
        assert isinstance(running.server.lanes, ProcessLaneLoop)
        yield running


@pytest.fixture(scope="module")
def client(server: Running) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module", params=["dflash2", "off"])
def spec_server(request: pytest.FixtureRequest) -> Iterator[Running]:
    """test_server_stream_bytes's servers, their engines in a child process."""
    spec = SpecDefaults(backend="dflash2", draft_tokens=3) if request.param != "off" else SpecDefaults("off")
    with serve(spec=spec, lanes=4, engine_process=True) as running:
        assert isinstance(running.server.lanes, ProcessLaneLoop)
        yield running


def _alive(pid: int) -> bool:
    """True while a process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return f"{pid} (gone)"


def _wait(pred, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split(" ")[1])
    return 0.0


# ---------------------------------------------------------------- the same replies in both modes


SAME_REQUESTS = [
    ("/v1/completions", {"prompt": "hello", "max_tokens": 9, "temperature": 0, "logprobs": 2}),
    (
        "/v1/completions",
        {"prompt": [3, 4], "max_tokens": 12, "temperature": 0.8, "seed": 7, "presence_penalty": 0.5},
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 10,
            "temperature": 0,
            "stop": ["e"],
            "logprobs": True,
            "top_logprobs": 3,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "give json"}],
            "max_tokens": 16,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "n",
                    "schema": {"type": "object", "properties": {"a": {"enum": ["x"]}}},
                },
            },
        },
    ),
]


def _normalized(body: dict) -> dict:  # type: ignore[type-arg]
    body = dict(body)
    body.pop("id", None)
    body.pop("created", None)
    return body


def test_replies_equal_the_default_modes(server: Running) -> None:
    """Logprobs, seeded sampling with penalties, stop strings and a JSON-schema grammar (compiled in
    both processes) give the same replies as with the engine in a thread."""
    with serve(lanes=8, queue_size=16) as threaded, threaded.client() as tc, server.client() as pc:
        for path, body in SAME_REQUESTS:
            want, got = tc.post(path, json=body), pc.post(path, json=body)
            assert got.status_code == want.status_code == 200, (path, body, got.text)
            assert _normalized(got.json()) == _normalized(want.json()), (path, body)


def test_metrics_right_after_a_reply_hold_its_counters(server: Running) -> None:
    """The step message carries the lane gauges and speculative counters, applied before its events
    are delivered: /metrics read right after a reply includes it."""
    with server.client() as c:
        before = _metric(c, "ignis_speculative_accepted_tokens_total")
        for stream in (False, True):
            body = {"prompt": "ab", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200
            after = _metric(c, "ignis_speculative_accepted_tokens_total")
            assert after == before + 11  # every token but the prefill's came from a speculative round
            assert _metric(c, "ignis_lanes_active") == 0
            before = after


# ---------------------------------------------------------------- the engine process's failures


def test_a_killed_engine_process_fails_its_requests_and_is_restarted() -> None:
    source = ToySource(step_delay=0.02)
    with serve(source, SpecDefaults("off"), lanes=2, engine_process=True) as running, running.client() as c:
        lanes = running.server.lanes
        assert isinstance(lanes, ProcessLaneLoop)
        pid = lanes.child_pid
        assert pid is not None and pid != os.getpid() and _alive(pid)
        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"prompt": [1, 2], "max_tokens": 200, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert first.wait(20)
        os.kill(pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive()
        errors = [json.loads(x[len("data: ") :])["error"] for x in lines if x.startswith('data: {"error"')]
        assert len(errors) == 1, lines[-3:]
        error = errors[0]
        assert error["type"] == "server_error" and "engine process was killed by signal 9" in error["message"]
        # meanwhile the health check says so (a new process takes seconds to load); then it serves
        health = c.get("/health")
        assert health.status_code == 503
        assert health.json()["error"]["message"] == "the engine process is being restarted after a failure"
        assert _wait(lambda: c.get("/health").status_code == 200, 60)
        assert lanes.child_pid != pid and not _alive(pid)
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert c.get("/status").json()["lanes"]["engine_restarts"] == 1
        assert _metric(c, 'ignis_request_finished_total{finish_reason="error"}') == 1
        assert lanes.num_inflight == 0


def test_the_server_gives_up_after_too_many_deaths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_RESTARTS deaths the server stops restarting and shuts itself down with status 1."""
    monkeypatch.setattr(engine_process, "MAX_RESTARTS", 0)
    with serve(ToySource(), SpecDefaults("off"), lanes=1, engine_process=True) as running:
        lanes = running.server.lanes
        assert isinstance(lanes, ProcessLaneLoop)
        pid = lanes.child_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert _wait(lambda: not running.server.started.is_set(), 30), "the server did not shut down"
        assert lanes.fatal_status == 1 and "died 1 times" in (lanes.fatal_error or "")
        assert not lanes.is_alive


class _FailingSource(ToySource):
    """A source whose load fails (in the engine process)."""

    def load(self, settings):  # type: ignore[no-untyped-def]
        raise ConfigError("this model cannot be loaded: a test's refusal")


def test_a_load_error_in_the_engine_process_reaches_the_caller_typed() -> None:
    spec = EngineSpec(_FailingSource(), ModelSettings(spec=SpecDefaults("off")))
    with pytest.raises(ConfigError, match="a test's refusal"):
        ProcessLaneLoop(spec, max_lanes=1, queue_size=0)


def test_a_source_that_cannot_cross_is_refused_before_a_process_starts() -> None:
    from ignis.runtime.errors import IgnisRuntimeError

    source = ToySource()
    source.hook = lambda: None  # type: ignore[attr-defined]  # a lambda does not pickle
    spec = EngineSpec(source, ModelSettings(spec=SpecDefaults("off")))
    with pytest.raises(IgnisRuntimeError, match="ToySource cannot be sent to an engine process"):
        ProcessLaneLoop(spec, max_lanes=1, queue_size=0)


# ---------------------------------------------------------------- ignis-run --engine-process


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def _start(sock: Path, *args: str, delay: float) -> subprocess.Popen[str]:
    from test_server_cli import _start as start

    return start(sock, "--engine-process", *args, delay=delay)


def test_a_killed_server_leaves_no_engine_process() -> None:
    sock = short_tmpdir() / "ignis.sock"
    proc = _start(sock, delay=0.01)
    try:
        kids = _descendants(proc.pid)
        assert kids, "no engine process"
        proc.kill()  # SIGKILL: no cleanup runs in the server process
        proc.wait(10)
        assert _wait(lambda: not any(_alive(k) for k in kids), 10), [_cmdline(k) for k in kids if _alive(k)]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def test_sigterm_finishes_the_stream_and_stops_both_processes() -> None:
    from test_server_cli import _stream_in_thread

    sock = short_tmpdir() / "ignis.sock"
    proc = _start(sock, delay=0.02)
    try:
        kids = _descendants(proc.pid)
        lines: list[str] = []
        first = threading.Event()
        t = _stream_in_thread(sock, {"prompt": [1, 2], "max_tokens": 60, "ignore_eos": True}, lines, first)
        assert first.wait(20)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        t.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    chunks = [json.loads(x[len("data: ") :]) for x in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert _wait(lambda: not any(_alive(k) for k in kids), 10), [_cmdline(k) for k in kids if _alive(k)]
    assert not os.path.lexists(sock)


def test_the_cli_flag_and_its_default(captured, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """--engine-process serves through a ProcessLaneLoop (config key engine_process too); on a CPU
    the default keeps the engine in a thread."""
    from test_server_hardening import invoke

    sock = str(short_tmpdir() / "s.sock")
    invoke("--socket", sock, "--lanes", "2")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine_process: true\n")
    invoke("--socket", sock, "--lanes", "2", "--config", str(cfg))
    invoke("--socket", sock, "--lanes", "2", "--config", str(cfg), "--no-engine-process")
    try:
        kinds = [type(s.lanes).__name__ for s in captured]
        assert kinds == ["LaneLoop", "ProcessLaneLoop", "LaneLoop"]
        assert captured[1].lanes.max_context == 256 and captured[1].lanes.max_lanes == 2
    finally:
        for s in captured:
            s.lanes.stop()


def test_the_default_follows_the_device_once_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ENGINE_PROCESS_ON_CUDA` turns the default on for a model served on CUDA only; the flag wins."""
    from ignis.runtime import cli

    class OnCuda:
        def serves_on_cuda(self, settings: object) -> bool:
            return True

    cuda, cpu, unset = (ModelSettings(spec=SpecDefaults("off"), device=d) for d in ("cuda", "cpu", None))
    assert cli.ENGINE_PROCESS_ON_CUDA  # on by default since session 15's H200 run
    assert cli._engine_process(True, ToySource(), cpu)
    monkeypatch.setattr(cli, "ENGINE_PROCESS_ON_CUDA", False)
    assert not cli._engine_process(None, OnCuda(), cuda)
    monkeypatch.setattr(cli, "ENGINE_PROCESS_ON_CUDA", True)
    assert cli._engine_process(None, ToySource(), cuda)
    assert not cli._engine_process(None, OnCuda(), cpu)
    assert cli._engine_process(None, OnCuda(), unset)
    assert not cli._engine_process(None, ToySource(), unset)  # a source that cannot say: off
    assert not cli._engine_process(False, OnCuda(), cuda)


def test_run_exits_with_status_1_when_it_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """`IgnisServer.run` (what ignis-run runs, signal handlers included) returns 1 once the server gave
    up on its engine process, having shut itself down."""
    from ignis.runtime.server import IgnisServer, ServerOptions

    monkeypatch.setattr(engine_process, "MAX_RESTARTS", 0)
    source, settings = ToySource(), ModelSettings(spec=SpecDefaults("off"))
    options = ServerOptions(socket=str(short_tmpdir() / "s.sock"), lanes=1, log_level="warning")
    server = IgnisServer(source.load(settings), options, engine=EngineSpec(source, settings))
    lanes = server.lanes
    assert isinstance(lanes, ProcessLaneLoop) and lanes.child_pid is not None

    def kill_when_started() -> None:
        if server.started.wait(30):
            os.kill(lanes.child_pid, signal.SIGKILL)  # type: ignore[arg-type]

    threading.Thread(target=kill_when_started, daemon=True).start()
    assert server.run() == 1
    assert lanes.fatal_status == 1 and not _alive(lanes.child_pid)  # type: ignore[arg-type]


class _SourceOnly:
    """What of a `Grammar` crosses to the engine process: its source and description."""

    def __init__(self, source: str, description: str) -> None:
        self.source, self.description = source, description


def test_a_request_the_engine_refuses_comes_back_typed_and_others_go_on() -> None:
    """A prompt the engine refuses (`LaneRequestError`, past the server's checks) is a 400 event from the
    engine process; a request beside it is served; grammars cross as their source."""
    import asyncio

    from ignis.runtime.grammar import Grammar
    from ignis.runtime.sampling import SamplingParams
    from ignis.runtime.server.agents import grammar_tokenizer
    from ignis.runtime.server.errors import InvalidRequestError
    from ignis.runtime.server.lanes import ErrorEvent

    settings = ModelSettings(spec=SpecDefaults("off"))
    model = ToySource().load(settings)
    lanes = ProcessLaneLoop(EngineSpec(ToySource(), settings), max_lanes=2, queue_size=1)

    async def run(handle):  # type: ignore[no-untyped-def]
        ids: list[int] = []
        while True:
            event = await asyncio.wait_for(handle.next_event(), 30)
            if isinstance(event, ErrorEvent):
                return event
            ids += event.token_ids
            if event.finish_reason is not None:
                return ids

    async def main() -> None:
        lanes.start()
        try:
            bad = lanes.submit([1, 10_000], SamplingParams(max_tokens=3))
            regex = Grammar.regex(grammar_tokenizer(model.tokenizer, lanes.vocab_size), "ab{2,4}")
            good = lanes.submit([3, 4], SamplingParams(temperature=0, max_tokens=8, grammar=regex))
            unknown = SamplingParams(max_tokens=3, grammar=_SourceOnly('{"grammars": 7}', "a broken grammar"))
            broken = lanes.submit([3, 4], unknown)  # refused as the child compiles it
            refused, ids, uncompiled = await run(bad), await run(good), await run(broken)
            assert isinstance(refused, ErrorEvent) and isinstance(refused.error, InvalidRequestError)
            assert refused.error.status_code == 400 and "outside the vocabulary" in refused.error.message
            assert isinstance(uncompiled, ErrorEvent) and isinstance(uncompiled.error, InvalidRequestError)
            assert "a broken grammar cannot be compiled" in uncompiled.error.message
            assert model.tokenizer.decode(ids, skip_special_tokens=True) in ("abb", "abbb", "abbbb")
        finally:
            await asyncio.to_thread(lanes.stop)

    asyncio.run(main())
    assert lanes.num_inflight == 0


def test_an_artifact_is_mapped_in_the_engine_process_only(tmp_path: Path) -> None:
    """An `ArtifactSource` crosses as its path (`load_text` here: the tokenizer, then the mapping
    closed); the engine process maps the weights; greedy replies equal the default mode's."""
    from server_helpers import build_tiny_hybrid_artifact

    from ignis.runtime.server.artifact_source import ArtifactSource

    art = build_tiny_hybrid_artifact(tmp_path)
    weights = str(next(art.glob("*.ninfer")).resolve())
    spec = SpecDefaults("dflash2", 3)
    body = {"prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    with serve(ArtifactSource(art), spec, engine_process=True) as running, running.client() as c:
        got = c.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        child = running.server.lanes.child_pid  # type: ignore[union-attr]
        assert weights in Path(f"/proc/{child}/maps").read_text()
        assert weights not in Path("/proc/self/maps").read_text()  # (first: a threaded server maps it)
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny-hybrid"
    with serve(ArtifactSource(art), spec) as threaded, threaded.client() as c:
        want = c.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    assert got == want and len(got) == 10


class _OnDevice:
    """An `ArtifactSource` loaded on a given device (it pickles: the inner source as its path)."""

    def __init__(self, artifact: Path, device: str) -> None:
        from ignis.runtime.server.artifact_source import ArtifactSource

        self.inner = ArtifactSource(artifact)
        self.device = device
        for name in ("name", "aliases", "spec_kinds", "profile"):
            setattr(self, name, getattr(self.inner, name))

    def missing_backend_reason(self, backend: str) -> str:
        return self.inner.missing_backend_reason(backend)

    def load(self, settings):  # type: ignore[no-untyped-def]
        import dataclasses

        return self.inner.load(dataclasses.replace(settings, device=self.device))

    def load_text(self, settings):  # type: ignore[no-untyped-def]
        return self.inner.load_text(settings)


def served_both_ways(artifact: Path, device: str) -> tuple[list[list[int]], list[list[int]], dict]:  # type: ignore[type-arg]
    """Greedy replies to the same requests from the engine process and from the default mode (in that
    order), and the engine process's `/status`."""
    spec = SpecDefaults("dflash2", 3)
    bodies = [
        {"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        for p in ([5, 6, 7], list(range(3, 40)))
    ]
    replies = []
    status: dict = {}  # type: ignore[type-arg]
    for ep in (True, False):
        with serve(_OnDevice(artifact, device), spec, max_context=512, engine_process=ep) as running:
            with running.client() as c:
                replies.append(
                    [c.post("/v1/completions", json=b).json()["choices"][0]["token_ids"] for b in bodies]
                )
                if ep:
                    status = c.get("/status").json()
    return replies[0], replies[1], status


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_engine_process_serves_like_the_default_mode(tmp_path: Path) -> None:
    """On CUDA (spawned child, CUDA graphs, the warm-up request at load): greedy replies equal the
    default mode's, and `/status` reports the engine process's device memory."""
    import sys

    if str(HERE.parent) not in sys.path:  # tests/runtime: only on the path when a test there was collected
        sys.path.insert(0, str(HERE.parent))
    from test_hybrid_warmup import _tiny_hybrid_artifact

    got, want, status = served_both_ways(_tiny_hybrid_artifact(tmp_path), "cuda")
    assert got == want and all(len(ids) == 24 for ids in got)
    assert status["gpu"] is not None and status["gpu"]["allocated_bytes"] > 0


def test_the_lane_gauges_drop_to_zero_when_the_engine_process_dies() -> None:
    """The lanes a dead engine process held are free once its requests failed: /health, /status and
    ignis_lanes_active say 0 while the new process loads and after it, before any new request."""
    source = ToySource(step_delay=0.02)
    with serve(source, SpecDefaults("off"), lanes=2, engine_process=True) as running, running.client() as c:
        lanes = running.server.lanes
        assert isinstance(lanes, ProcessLaneLoop)
        pid = lanes.child_pid
        assert pid is not None
        done: list[int] = []

        def request() -> None:
            r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 200, "ignore_eos": True})
            done.append(r.status_code)

        threads = [threading.Thread(target=request, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        assert _wait(lambda: c.get("/status").json()["lanes"]["active"] == 2, 20)
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert done == [500, 500]
        assert c.get("/status").json()["lanes"]["active"] == 0
        assert _metric(c, "ignis_lanes_active") == 0
        assert _wait(lambda: c.get("/health").status_code == 200, 60)
        assert c.get("/health").json()["lanes_active"] == 0
        assert c.get("/status").json()["lanes"]["active"] == 0
        assert _metric(c, "ignis_lanes_active") == 0
        assert _metric(c, "ignis_requests_waiting") == 0


class _WaitPolicySource(ToySource):
    """The toy source whose engine's context limit tells the engine process's OMP_WAIT_POLICY."""

    def load(self, settings):  # type: ignore[no-untyped-def]
        context = _CONTEXT_OF_POLICY.get(os.environ.get("OMP_WAIT_POLICY"), 100)
        return super().load(dataclasses.replace(settings, max_context=context))


_CONTEXT_OF_POLICY = {"PASSIVE": 111, "ACTIVE": 122}


@pytest.mark.parametrize("outer", [None, "ACTIVE"])
def test_the_engine_process_waits_passively_in_openmp(
    monkeypatch: pytest.MonkeyPatch, outer: str | None
) -> None:
    """The engine process runs torch's CPU ops from its main thread, where GNU OpenMP's active
    spin-waiting at every parallel region's barrier stalls the engine on a host whose cores are shared
    (measured ~5-10x slower than the default mode on the 2-core build box): it starts with
    OMP_WAIT_POLICY=PASSIVE unless the environment already sets a policy, and the server process's own
    environment is left as it was."""
    if outer is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", outer)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    lanes = ProcessLaneLoop(
        EngineSpec(_WaitPolicySource(), ModelSettings(spec=SpecDefaults("off"))), max_lanes=1, queue_size=0
    )
    try:
        assert lanes.max_context == _CONTEXT_OF_POLICY[outer or "PASSIVE"]
    finally:
        lanes.stop(10)
    assert os.environ.get("OMP_WAIT_POLICY") == outer


def test_a_refused_load_in_the_engine_process_logs_no_traceback(capfd: pytest.CaptureFixture[str]) -> None:
    """A load the model refuses with a typed error (a bad --expert-cache-bytes, a missing drafter: an
    IgnisRuntimeError) reaches the server as that error, and the engine process's log says it in one
    line, as the default mode does: no traceback, and no claim that the server process is gone."""
    spec = EngineSpec(_FailingSource(), ModelSettings(spec=SpecDefaults("off")))
    with pytest.raises(ConfigError, match="a test's refusal"):
        ProcessLaneLoop(spec, max_lanes=1, queue_size=0)
    time.sleep(0.5)  # the engine process's last lines
    err = capfd.readouterr().err
    assert "Traceback" not in err and "server process is gone" not in err, err
