"""Issue 21's server items: start-up log, option checks before loading, API keys, unknown request
fields, special tokens in chat content, prompts tokenized off the event loop, metrics published with
the last token, repeated signals."""

from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner
from server_helpers import short_tmpdir

from ignis.runtime import cli

FACTORY = "toy_model:from_env"
KINDS = {"IGNIS_TOY_KINDS": "dflash2,mtp,ngram"}


def invoke(*args: str, env: dict[str, str] | None = None) -> object:
    return CliRunner().invoke(cli.main, ["--model-factory", FACTORY, *args], env=env, catch_exceptions=False)


# ---------------------------------------------------------------- start-up log


@pytest.mark.parametrize("backend", ["ngram", "off"])
def test_the_start_up_log_names_no_setting_the_backend_ignores(
    captured, caplog: pytest.LogCaptureFixture, backend: str
) -> None:
    """An ignored --spec-draft-head is warned about and then not listed as a setting in force."""
    sock = short_tmpdir() / "s.sock"
    with caplog.at_level(logging.INFO):
        result = invoke(
            "--socket", str(sock), "--spec-backend", backend, "--spec-draft-head", "shortlist", env=KINDS
        )
    assert result.exit_code == 0, result.output
    heads = [r.getMessage() for r in caplog.records if r.name == "ignis.runtime.draft_head"]
    assert len(heads) == 1 and heads[0].startswith("proposal head: none; backend " + backend)
    assert "proposal head full" not in heads[0] and "shortlist" not in heads[0]
    assert "row budget" not in heads[0]
    assert any("--spec-draft-head applies to dflash2 and mtp" in r.getMessage() for r in caplog.records)


def test_the_start_up_log_names_the_row_budget_for_mtp_only(captured, caplog) -> None:
    sock = short_tmpdir() / "s.sock"
    for backend, extra, has_rows in (("mtp", [], True), ("dflash2", ["--spec-draft-tokens", "3"], False)):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert invoke("--socket", str(sock), "--spec-backend", backend, *extra).exit_code == 0
        (head,) = [r.getMessage() for r in caplog.records if r.name == "ignis.runtime.draft_head"]
        assert ("row budget" in head) == has_rows, head
        assert "proposal head full" in head
