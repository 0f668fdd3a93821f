"""`ignis-run`'s async-rounds default against the config file, for a model served on CUDA: the default
(on with speculation off, `cli.ASYNC_ROUNDS_ON_CUDA`) yields to `async_rounds: false` in the config
file (YAML and TOML), the command line wins over the file, and a drafter chosen in the file (its `spec`
section or the model's own section) leaves the default off. The toy source only says it serves on
CUDA (`serves_on_cuda`); it runs on the CPU, in the server's thread."""

from __future__ import annotations

from pathlib import Path

import pytest
import toy_model
from click.testing import CliRunner
from server_helpers import short_tmpdir

from ignis.runtime import cli


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The ModelSettings each load got; the toy source claims CUDA; the engine stays in this process."""
    settings: list[object] = []
    load = toy_model.ToySource.load

    def spy(self, s):  # type: ignore[no-untyped-def]
        settings.append(s)
        return load(self, s)

    monkeypatch.setattr(toy_model.ToySource, "load", spy)
    monkeypatch.setattr(toy_model.ToySource, "serves_on_cuda", lambda self, s: True, raising=False)
    monkeypatch.setattr(cli, "ENGINE_PROCESS_ON_CUDA", False)
    monkeypatch.setenv("IGNIS_TOY_KINDS", "ngram")
    return settings


def _async_rounds(args: list[str], seen: list[object]) -> bool:
    args = ["--model-factory", "toy_model:from_env", *args]
    result = CliRunner().invoke(cli.main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    value = seen[-1].async_rounds  # type: ignore[attr-defined]
    assert isinstance(value, bool)
    return value


def test_the_config_file_turns_the_cuda_default_off(captured, seen, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
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
