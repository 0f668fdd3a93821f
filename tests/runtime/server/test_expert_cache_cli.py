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
