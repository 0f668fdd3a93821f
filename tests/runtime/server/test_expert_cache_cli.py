"""`ignis-run --expert-cache-bytes` and the config file's `expert_cache_bytes` reach ModelSettings; bad
sizes are refused before any load (in process, the serving loop stubbed by `captured`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import toy_model
from click.testing import CliRunner
from server_helpers import short_tmpdir

from ignis.runtime import cli
from ignis.runtime.config_file import ConfigFileError, load_config_file


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    settings: list[object] = []
    load = toy_model.ToySource.load

    def spy(self, s):  # record what the toy source was loaded with
        settings.append(s)
        return load(self, s)

    monkeypatch.setattr(toy_model.ToySource, "load", spy)
    return settings


def _invoke(*args: str):
    return CliRunner().invoke(
        cli.main, ["--model-factory", "toy_model:from_env", *args], catch_exceptions=False
    )


def test_flag_and_config_key_reach_the_model_settings(captured, seen, tmp_path: Path) -> None:
    sock = short_tmpdir() / "s.sock"
    cfg = tmp_path / "ignis.yaml"
    cfg.write_text(f"socket: {sock}\nexpert_cache_bytes: 24GiB\n")
    for args, want in (
        (["--socket", str(sock)], None),
        (["--socket", str(sock), "--expert-cache-bytes", "512MiB"], "512MiB"),
        (["--config", str(cfg)], "24GiB"),
        (["--config", str(cfg), "--expert-cache-bytes", "off"], "off"),
    ):
        result = _invoke(*args)
        assert result.exit_code == 0, result.output
        assert seen[-1].expert_cache == want, args
    result = _invoke("--socket", str(sock), "--expert-cache-bytes", "lots")
    assert result.exit_code == 1 and "not a byte count" in result.output


def test_config_file_values(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    for text, want in (("expert_cache_bytes: off\n", "off"), ("expert_cache_bytes: 4096\n", "4096")):
        path.write_text(text)
        assert load_config_file(path).server["expert_cache_bytes"] == want
    path.write_text("expert_cache_bytes: [1]\n")
    with pytest.raises(ConfigFileError, match="expert_cache_bytes must be str"):
        load_config_file(path)


class _CachedSource:
    """An `ArtifactSource` loaded with an expert-cache budget (what --expert-cache-bytes passes)."""

    def __init__(self, inner, budget: str) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.budget = inner, budget

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name == "inner":  # not set yet (unpickling, for an engine process)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def load(self, settings):  # type: ignore[no-untyped-def]
        import dataclasses

        return self.inner.load(dataclasses.replace(settings, expert_cache=self.budget, device="cpu"))


def _tiny_moe_artifact(tmp_path: Path) -> Path:
    """A cpu-card artifact of a tiny random qwen3_5_moe (no compiled modules) with a 320-token tokenizer."""
    import hf_tiny
    from hf_tiny_hybrid import make_tiny_hybrid

    from ignis.compiler.build import build_artifact

    make_tiny_hybrid("qwen3_5_moe", tmp_path / "ckpt")
    hf_tiny.tiny_tokenizer(vocab_size=320).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "r.toml").write_text('name = "tiny-moe"\n[modules]\nwidths = []\n')
    res = build_artifact(
        card="cpu", model=tmp_path / "ckpt", recipe=tmp_path / "r.toml", out=tmp_path / "art", progress=False,
        echo=lambda _l: None,
    )  # fmt: skip
    assert res.out is not None
    return Path(res.out)


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_metrics_report_the_expert_cache(tmp_path: Path, engine_process: bool) -> None:
    """A served MoE artifact with a small expert cache: its greedy output equals the resident one's
    and /metrics carries the cache's series (misses counted)."""
    from server_helpers import serve

    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.server.artifact_source import ArtifactSource

    art = _tiny_moe_artifact(tmp_path)
    off = SpecDefaults(backend="off")
    body = {"prompt": [5, 9, 200, 31, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    outs, texts = [], []
    for source in (ArtifactSource(art), _CachedSource(ArtifactSource(art), "100KiB")):
        with serve(source, off, engine_process=engine_process) as running, running.client() as c:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            outs.append(r.json()["choices"][0]["token_ids"])
            texts.append(c.get("/metrics").text)
    assert outs[0] == outs[1] and len(outs[0]) == 8
    assert "ignis_expert_cache" not in texts[0]
    misses = next(
        float(line.split()[1])
        for line in texts[1].splitlines()
        if line.startswith("ignis_expert_cache_misses_total")
    )
    assert misses > 0 and "ignis_expert_cache_slots_in_use" in texts[1]


def test_pin_flag_and_config_key_reach_the_model_settings(captured, seen, tmp_path: Path) -> None:
    sock = short_tmpdir() / "s.sock"
    cfg = tmp_path / "ignis.yaml"
    cfg.write_text(f"socket: {sock}\nexpert_cache_pin: off\n")  # YAML 1.1: a bare off is false
    for args, want in (
        (["--socket", str(sock)], "auto"),
        (["--socket", str(sock), "--expert-cache-pin", "on"], "on"),
        (["--config", str(cfg)], "off"),
        (["--config", str(cfg), "--expert-cache-pin", "auto"], "auto"),
    ):
        result = _invoke(*args)
        assert result.exit_code == 0, result.output
        assert seen[-1].expert_cache_pin == want, args
    result = _invoke("--socket", str(sock), "--expert-cache-pin", "sometimes")
    assert result.exit_code == 2 and "sometimes" in result.output


def test_lookahead_flag_and_config_key_reach_the_model_settings(captured, seen, tmp_path: Path) -> None:
    sock = short_tmpdir() / "s.sock"
    cfg = tmp_path / "ignis.yaml"
    cfg.write_text(f"socket: {sock}\nexpert_cache_lookahead: true\n")
    for args, want in (
        (["--socket", str(sock)], False),
        (["--socket", str(sock), "--expert-cache-lookahead"], True),
        (["--config", str(cfg)], True),
        (["--config", str(cfg), "--no-expert-cache-lookahead"], False),
    ):
        result = _invoke(*args)
        assert result.exit_code == 0, result.output
        assert seen[-1].expert_cache_lookahead is want, args


def test_lookahead_where_the_rounds_run_eagerly_says_it_does_nothing(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """--expert-cache-lookahead acts only in verify rounds replayed from CUDA graphs in pieces; on the
    CPU (or with --no-cuda-graphs) the engine runs eagerly and never prefetches: the load says so
    instead of ignoring the flag silently."""
    import logging

    from ignis.runtime.metrics import SpeculativeMetrics
    from ignis.runtime.profiles import SpecDefaults
    from ignis.runtime.server.artifact_source import ArtifactSource
    from ignis.runtime.server.model import ModelSettings

    art = _tiny_moe_artifact(tmp_path)
    source = ArtifactSource(art)
    for lookahead in (False, True):
        caplog.clear()
        settings = ModelSettings(
            spec=SpecDefaults(backend="off"),
            device="cpu",
            expert_cache="100KiB",
            expert_cache_lookahead=lookahead,
        )
        with caplog.at_level(logging.INFO, logger="ignis.runtime.server"):
            engine = source.load(settings).make_engine(1, SpeculativeMetrics())
        assert engine is not None
        said = [r for r in caplog.records if "--expert-cache-lookahead" in r.getMessage()]
        if lookahead:
            assert len(said) == 1 and said[0].levelno == logging.WARNING
            assert "no effect" in said[0].getMessage() and "CUDA graphs" in said[0].getMessage()
        else:
            assert not said
    # every expert resident (--expert-cache-bytes off): there is no cache to prefetch into
    caplog.clear()
    settings = ModelSettings(
        spec=SpecDefaults(backend="off"), device="cpu", expert_cache="off", expert_cache_lookahead=True
    )
    with caplog.at_level(logging.INFO, logger="ignis.runtime.server"):
        source.load(settings).make_engine(1, SpeculativeMetrics())
    said = [r for r in caplog.records if "--expert-cache-lookahead" in r.getMessage()]
    assert len(said) == 1 and "no expert cache" in said[0].getMessage(), [r.getMessage() for r in said]
