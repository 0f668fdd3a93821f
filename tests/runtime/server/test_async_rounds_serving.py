"""`ignis-run --async-rounds` (config `async_rounds`) reaches ModelSettings and the engine the artifact
source builds; served over HTTP, greedy completions (concurrent, streamed, with a stop sequence) equal
the ordinary rounds' (`ignis.runtime.async_rounds`)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import toy_model
from click.testing import CliRunner
from server_helpers import build_tiny_hybrid_artifact, serve, short_tmpdir

from ignis.runtime import cli
from ignis.runtime.config_file import load_config_file
from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.server.model import ModelSettings

pytest.importorskip("ignis.compiler.build")
pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 200, 11], [300, 1, 2, 3, 4, 5, 6, 7, 8], [9]]


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    settings: list[object] = []
    load = toy_model.ToySource.load

    def spy(self, s):  # type: ignore[no-untyped-def]
        settings.append(s)
        return load(self, s)

    monkeypatch.setattr(toy_model.ToySource, "load", spy)
    return settings


def test_flag_and_config_key_reach_the_model_settings(captured, seen, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    sock = short_tmpdir() / "s.sock"
    cfg = tmp_path / "ignis.yaml"
    cfg.write_text(f"socket: {sock}\nasync_rounds: true\n")
    assert load_config_file(cfg).server["async_rounds"] is True
    for args, want in (
        (["--socket", str(sock)], False),
        (["--socket", str(sock), "--async-rounds"], True),
        (["--config", str(cfg)], True),
        (["--config", str(cfg), "--no-async-rounds"], False),
    ):
        assert _async_rounds(args, seen) is want, args


def _async_rounds(args: list[str], seen: list[object]) -> bool:
    """`ignis-run --model-factory toy_model:from_env ARGS` (it returns once the test's `captured`
    fixture has the server): the `async_rounds` of the ModelSettings its load got."""
    result = CliRunner().invoke(
        cli.main, ["--model-factory", "toy_model:from_env", *args], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    value = seen[-1].async_rounds  # type: ignore[attr-defined]
    assert isinstance(value, bool)
    return value


@pytest.fixture
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy source says it serves on CUDA (it runs on the CPU), the engine stays in the server's
    thread, and its config knows an ngram drafter."""
    monkeypatch.setattr(toy_model.ToySource, "serves_on_cuda", lambda self, s: True, raising=False)
    monkeypatch.setattr(cli, "ENGINE_PROCESS_ON_CUDA", False)
    monkeypatch.setenv("IGNIS_TOY_KINDS", "ngram")


def test_the_config_file_turns_the_cuda_default_off(captured, seen, on_cuda, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """For a model served on CUDA the default (on with speculation off) yields to `async_rounds: false`
    in the config file (YAML and TOML), the command line wins over the file, and a drafter chosen in the
    file (its `spec` section or the model's own section) leaves the default off."""
    sock = short_tmpdir() / "s.sock"
    yaml_off = tmp_path / "off.yaml"
    yaml_off.write_text(f"socket: {sock}\nasync_rounds: false\n")
    toml_off = tmp_path / "off.toml"
    toml_off.write_text(f'socket = "{sock}"\nasync_rounds = false\n')
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"socket: {sock}\n")
    ngram = tmp_path / "ngram.yaml"
    ngram.write_text(f"socket: {sock}\nspec:\n  backend: ngram\n")
    own = tmp_path / "own.yaml"
    own.write_text(f"socket: {sock}\nspec:\n  toy:\n    backend: ngram\n")
    assert _async_rounds(["--socket", str(sock)], seen)  # the CUDA default, speculation off
    assert _async_rounds(["--config", str(plain)], seen)
    assert not _async_rounds(["--config", str(yaml_off)], seen)
    assert not _async_rounds(["--config", str(toml_off)], seen)
    assert _async_rounds(["--config", str(yaml_off), "--async-rounds"], seen)  # the command line wins
    assert not _async_rounds(["--config", str(ngram)], seen)  # a drafter from the file: off
    assert not _async_rounds(["--config", str(own)], seen)  # the model's own spec section too
    assert _async_rounds(["--config", str(ngram), "--spec-backend", "off"], seen)


def test_the_default_is_on_for_cuda_with_speculation_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ASYNC_ROUNDS_ON_CUDA` turns the default on for a model served on CUDA with speculation off only;
    a drafter, the CPU or a source that cannot say leave it off; the flag wins either way."""

    class OnCuda:
        def serves_on_cuda(self, settings: object) -> bool:
            return True

    off = SpecDefaults("off")
    dflash2 = SpecDefaults("dflash2", draft_tokens=7)
    cuda, cpu, unset = (ModelSettings(spec=off, device=d) for d in ("cuda", "cpu", None))
    assert cli.ASYNC_ROUNDS_ON_CUDA  # on by default since session 16's H200 run
    assert cli._async_rounds(None, toy_model.ToySource(), cuda)
    assert cli._async_rounds(None, OnCuda(), unset)
    assert not cli._async_rounds(None, OnCuda(), cpu)
    assert not cli._async_rounds(None, toy_model.ToySource(), unset)  # a source that cannot say: off
    assert not cli._async_rounds(None, OnCuda(), ModelSettings(spec=dflash2, device="cuda"))
    assert not cli._async_rounds(False, OnCuda(), cuda)
    assert cli._async_rounds(True, toy_model.ToySource(), cpu)
    monkeypatch.setattr(cli, "ASYNC_ROUNDS_ON_CUDA", False)
    assert not cli._async_rounds(None, OnCuda(), cuda)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hybrid_artifact(tmp_path_factory.mktemp("art"))


class _AsyncSource:
    """The artifact source, loaded with `async_rounds` set (what `ignis-run --async-rounds` passes)."""

    def __init__(self, artifact: Path, on: bool) -> None:
        from ignis.runtime.server.artifact_source import ArtifactSource

        self._inner = ArtifactSource(artifact)
        self._on = on

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name == "_inner":  # not set yet (unpickled in an engine process)
            raise AttributeError(name)
        return getattr(self._inner, name)

    def load(self, settings):  # type: ignore[no-untyped-def]
        return self._inner.load(dataclasses.replace(settings, async_rounds=self._on))


def test_the_artifact_engine_takes_the_option(artifact: Path) -> None:
    from ignis.runtime.metrics import SpeculativeMetrics
    from ignis.runtime.server.artifact_source import ArtifactSource

    for on in (False, True):
        model = ArtifactSource(artifact).load(
            ModelSettings(SpecDefaults("off"), device="cpu", async_rounds=on)
        )
        try:
            engine = model.make_engine(2, SpeculativeMetrics())
            assert (engine._async is not None) is on
        finally:
            model.close()


def _complete(running, prompt: list[int], stop: list[str] | None = None, stream: bool = False):  # type: ignore[no-untyped-def]
    body = {
        "prompt": prompt,
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if stop:
        body["stop"] = stop
    with running.client() as c:
        if stream:
            r = c.post("/v1/completions", json={**body, "stream": True})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            return r.text.count("data: {")
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["token_ids"], choice["text"], choice["finish_reason"]


def test_async_rounds_over_http_equal_the_ordinary_rounds(artifact: Path) -> None:
    outs = []
    for on in (False, True):
        with serve(_AsyncSource(artifact, on), SpecDefaults("off"), lanes=4) as running:  # type: ignore[arg-type]
            with ThreadPoolExecutor(4) as pool:  # lanes joining while others decode
                got = list(pool.map(lambda p, r=running: _complete(r, p), PROMPTS))
            text = got[0][1]
            assert len(text) > 6, text
            stop = [text[len(text) // 2 : len(text) // 2 + 3]]
            stopped = _complete(running, PROMPTS[0], stop)
            chunks = _complete(running, PROMPTS[1], stream=True)
            rounds = running.server.lanes._engine._async  # the engine's own: the rounds ran ahead
            assert (rounds is not None and rounds.num_issued > rounds.num_drained) is on
            outs.append((got, stopped, chunks))
    assert outs[0] == outs[1]
    (full, _, _), (ids, text, reason) = outs[1][0][0], outs[1][1]
    assert reason == "stop" and len(ids) < len(full) and ids == full[: len(ids)]


def _counter(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_metrics_count_the_rounds_issued_ahead_and_drained(artifact: Path) -> None:
    """/metrics shows whether async rounds engage: `ignis_async_rounds_issued_total` and
    `ignis_async_rounds_drained_total` equal the engine's own counters; absent without the option."""
    for on in (False, True):
        with serve(_AsyncSource(artifact, on), SpecDefaults("off"), lanes=4) as running:  # type: ignore[arg-type]
            with ThreadPoolExecutor(2) as pool:  # the second request joins while the first decodes
                list(pool.map(lambda p, r=running: _complete(r, p), PROMPTS[:2]))
            _complete(running, PROMPTS[2])
            with running.client() as c:
                text = c.get("/metrics").text
            issued = _counter(text, "ignis_async_rounds_issued_total")
            drained = _counter(text, "ignis_async_rounds_drained_total")
            if not on:
                assert issued is None and drained is None
                continue
            rounds = running.server.lanes._engine._async
            assert (issued, drained) == (rounds.num_issued, rounds.num_drained)
            assert issued is not None and issued >= 19  # the lone third request: 19 rounds ahead


def test_the_counters_keep_a_replaced_engines_rounds() -> None:
    """An engine rebuilt after a failure adds to the counters (they never go down); None: off."""
    from types import SimpleNamespace

    from ignis.runtime.server.async_rounds_metrics import AsyncRoundsCollector

    collector = AsyncRoundsCollector()
    first = SimpleNamespace(num_issued=5, num_drained=2)
    collector.track(first)  # type: ignore[arg-type]
    first.num_issued = 7
    assert collector.counts() == (7, 2)
    collector.track(SimpleNamespace(num_issued=3, num_drained=1))  # type: ignore[arg-type]
    assert collector.counts() == (10, 3)
    collector.track(None)
    got = {m.name: m.samples[0].value for m in collector.collect()}
    assert got == {"ignis_async_rounds_issued": 10, "ignis_async_rounds_drained": 3}


def _tokens(running, prompt: list[int], max_tokens: int, **extra):  # type: ignore[no-untyped-def]
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with running.client() as c:
        r = c.post("/v1/completions", json={**body, "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["token_ids"], j["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_a_follow_up_turn_restores_the_reply_checkpoint(artifact: Path, engine_process: bool) -> None:
    """Over HTTP with prompt checkpoints: a reply stopped by a stop token while another request decodes
    (with async rounds its lane rides one more round, committed with keep 0), then the follow-up turn
    (prompt = the first prompt + the reply + more): the same tokens and the same restored prefix as
    without async rounds, the reply's checkpoint used."""
    from test_server_checkpoints import WithCheckpoints

    first, other = PROMPTS[2], PROMPTS[0]
    outs = []
    for on in (False, True):
        source = WithCheckpoints(artifact, async_rounds=on, checkpoint_host_bytes=1 << 30)
        with serve(source, SpecDefaults("off"), lanes=4, engine_process=engine_process and on) as running:  # type: ignore[arg-type]
            if not outs:
                full, _ = _tokens(running, first, 12)
                stop = full[5]
            with ThreadPoolExecutor(2) as pool:
                long = pool.submit(_tokens, running, other, 24)
                reply, _ = _tokens(running, first, 12, stop_token_ids=[stop])
                long.result()
            follow = [*first, *reply, 7, 8]
            outs.append((reply, _tokens(running, follow, 8)))
    assert outs[0] == outs[1]
    reply, (_, cached) = outs[1]
    assert reply[-1] == stop and len(reply) < 12
    assert cached >= len(first) + len(reply) - 1  # from the reply's checkpoint, not the prompt's


class _MoeSource(_AsyncSource):
    """The tiny MoE artifact loaded on the CPU with an expert cache smaller than its experts (what
    `--expert-cache-bytes 100KiB` passes) and `async_rounds` set."""

    def load(self, settings):  # type: ignore[no-untyped-def]
        return self._inner.load(
            dataclasses.replace(settings, async_rounds=self._on, expert_cache="100KiB", device="cpu")
        )


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_a_served_moe_with_an_expert_cache_equals_the_ordinary_rounds(
    tmp_path: Path, engine_process: bool
) -> None:
    """A served qwen3_5_moe artifact with an expert cache (misses every round) and async rounds, as
    `ignis-run` serves a MoE model on CUDA with speculation off (there in an engine process by default):
    concurrent, stopped and streamed greedy completions equal the ordinary rounds' (served in a thread);
    /metrics carries the cache's misses and the rounds issued ahead."""
    from test_expert_cache_cli import _tiny_moe_artifact

    art = _tiny_moe_artifact(tmp_path)
    outs = []
    for on in (False, True):
        process = engine_process and on
        with serve(_MoeSource(art, on), SpecDefaults("off"), lanes=4, engine_process=process) as running:  # type: ignore[arg-type]
            with ThreadPoolExecutor(4) as pool:
                got = list(pool.map(lambda p, r=running: _complete(r, p), PROMPTS))
            text = got[0][1]
            stop = [text[len(text) // 2 : len(text) // 2 + 3]]
            stopped = _complete(running, PROMPTS[0], stop)
            chunks = _complete(running, PROMPTS[1], stream=True)
            with running.client() as c:
                metrics = c.get("/metrics").text
            misses = _counter(metrics, "ignis_expert_cache_misses_total")
            assert misses is not None and misses > 0
            issued = _counter(metrics, "ignis_async_rounds_issued_total")
            drained = _counter(metrics, "ignis_async_rounds_drained_total")
            if on:
                assert issued is not None and drained is not None and issued > drained
            else:
                assert issued is None
            outs.append((got, stopped, chunks))
    assert outs[0] == outs[1]
    assert outs[1][1][2] == "stop"
