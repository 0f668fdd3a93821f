"""Serving artifacts built by ignis-build: a tiny hybrid (qwen3_5) with a grafted DFlash2 drafter.

The artifact is built for the `cpu` card from tiny random checkpoints written by HF transformers'
own classes (tests/hf_tiny*.py) and a random DFlash2 drafter (`ignis.tools.make_test_drafter`).
Served with speculation, greedy output over HTTP equals speculation off token for token, with the
full and the shortlist proposal heads; the card profile recorded in the manifest gives the defaults;
`--spec-backend mtp` without the companion container refuses to start.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner
from server_helpers import build_tiny_hybrid_artifact, serve, short_tmpdir

from ignis.runtime import cli
from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.sampling import SamplingParams

build = pytest.importorskip("ignis.compiler.build")
pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 200, 11], [300, 1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hybrid_artifact(tmp_path_factory.mktemp("art"))


@pytest.fixture(scope="module")
def source(artifact: Path):  # type: ignore[no-untyped-def]
    from ignis.runtime.server.artifact_source import ArtifactSource

    return ArtifactSource(artifact)


def _greedy(running, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    with running.client() as c:
        r = c.post(
            "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]


def test_source_reports_the_artifacts_parts(source) -> None:  # type: ignore[no-untyped-def]
    assert source.name == "tiny-hybrid"
    assert source.spec_kinds == ("dflash2", "ngram")  # drafter kind first (its profile entry)
    assert source.profile.name == "cpu" and source.profile.spec["dflash2"].draft_tokens == 7
    assert "companion" in source.missing_backend_reason("mtp")


def test_speculation_on_equals_off_over_http(artifact: Path) -> None:
    from ignis.runtime.server.artifact_source import ArtifactSource

    # A server closes its model (unmaps the artifact) at exit: each server gets a fresh source.
    with serve(ArtifactSource(artifact), SpecDefaults("off"), lanes=4) as off:
        want = [_greedy(off, p) for p in PROMPTS]
    for spec in (SpecDefaults("dflash2", 3), SpecDefaults("dflash2", 7, 0, "shortlist")):
        with serve(ArtifactSource(artifact), spec, lanes=4) as on:
            assert [_greedy(on, p) for p in PROMPTS] == want, spec
            with on.client() as c:
                metrics = c.get("/metrics").text
            assert "ignis_speculative_rounds_total" in metrics
            chat = on.client().post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True},
            )
            assert chat.status_code == 200 and chat.text.endswith("data: [DONE]\n\n")


def test_executor_and_drafter_run_the_artifacts_compiled_linears(artifact: Path) -> None:
    from ignis.runtime.linear import LinearBackend, Q4Weight
    from ignis.runtime.metrics import SpeculativeMetrics
    from ignis.runtime.server.artifact_source import ArtifactSource
    from ignis.runtime.server.model import ModelSettings

    for spec in (SpecDefaults("dflash2", 3), SpecDefaults("dflash2", 7, 0, "shortlist")):
        model = ArtifactSource(artifact).load(ModelSettings(spec, device="cpu"))
        try:
            engine = model.make_engine(2, SpeculativeMetrics())
            backend = engine.executor.linear
            assert isinstance(backend, LinearBackend) and backend.compiled is not None
            drafter = engine.drafter
            assert drafter.network.linear is backend and drafter.linear is backend  # one shared backend
            if spec.draft_head == "shortlist":  # the Q4 shortlist head stays packed for the modules
                assert isinstance(drafter.head_weight, Q4Weight)
            before = backend.counts["compiled"]
            engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4))
            assert backend.counts["compiled"] > before and backend.counts["fallback"] == 0
        finally:
            if model.close is not None:
                model.close()


def test_cli_takes_the_manifests_profile_defaults(artifact: Path, captured, caplog) -> None:  # type: ignore[no-untyped-def]
    sock = short_tmpdir() / "s.sock"
    with caplog.at_level(logging.INFO, logger="ignis.runtime.draft_head"):
        result = CliRunner().invoke(cli.main, ["--artifact", str(artifact), "--socket", str(sock)])
    assert result.exit_code == 0, result.output
    spec = captured[0].model.spec
    assert (spec.backend, spec.draft_tokens, spec.draft_head) == ("dflash2", 7, "full")
    line = next(r.getMessage() for r in caplog.records if r.name == "ignis.runtime.draft_head")
    assert line.startswith("proposal head: full; backend dflash2 (profile cpu)")


def test_cli_refuses_mtp_without_the_companion(artifact: Path, captured) -> None:  # type: ignore[no-untyped-def]
    sock = short_tmpdir() / "s.sock"
    result = CliRunner().invoke(
        cli.main, ["--artifact", str(artifact), "--socket", str(sock), "--spec-backend", "mtp"]
    )
    assert result.exit_code == 1
    assert "tiny-hybrid_mtp.ninfer" in result.output and "refused" in result.output
    assert not captured and not sock.exists()


def test_ngram_and_draft_model_backends_equal_off_over_http(artifact: Path) -> None:
    """--spec-backend ngram, and draft-model with the artifact as its own draft model (same tokenizer:
    every draft is the model's own choice), serve the same greedy ids as speculation off."""
    from ignis.runtime.server.artifact_source import ArtifactSource

    with serve(ArtifactSource(artifact), SpecDefaults("off"), lanes=4) as off:
        want = [_greedy(off, p) for p in PROMPTS]
    for source, spec in (
        (ArtifactSource(artifact), SpecDefaults("ngram", 4)),
        (ArtifactSource(artifact, draft_model=artifact), SpecDefaults("draft-model", 3)),
    ):
        assert spec.backend in source.spec_kinds
        with serve(source, spec, lanes=4) as on:
            assert [_greedy(on, p) for p in PROMPTS] == want, spec
            with on.client() as c:
                metrics = c.get("/metrics").text
        if spec.backend == "draft-model":  # its own drafts: every drafting round commits 4 tokens
            rounds = float(metrics.split("\nignis_speculative_rounds_total ")[1].split()[0])
            accepted = float(metrics.split("\nignis_speculative_accepted_tokens_total ")[1].split()[0])
            assert rounds > 0 and accepted / rounds > 3.0


def test_cli_refuses_draft_model_without_its_artifact(artifact: Path, captured) -> None:  # type: ignore[no-untyped-def]
    sock = short_tmpdir() / "s.sock"
    result = CliRunner().invoke(
        cli.main, ["--artifact", str(artifact), "--socket", str(sock), "--spec-backend", "draft-model"]
    )
    assert result.exit_code == 1 and "--spec-draft-model" in result.output
    assert not captured and not sock.exists()


@pytest.mark.parametrize("entry", ["load", "load_text"])
def test_source_without_a_tokenizer_refuses_to_load(artifact: Path, entry: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Both loads (in process, and the server side of an engine process) refuse an artifact that
    carries no tokenizer with a TokenizerError naming the directory."""
    from ignis.runtime.errors import TokenizerError
    from ignis.runtime.server.artifact_source import ArtifactSource
    from ignis.runtime.server.model import ModelSettings

    fresh = ArtifactSource(artifact)  # its own mapping: a load closes or keeps it
    try:
        monkeypatch.setattr(fresh.artifact, "tokenizer", lambda: None)
        with pytest.raises(TokenizerError, match="has no tokenizer") as err:
            getattr(fresh, entry)(ModelSettings(spec=SpecDefaults("off"), device="cpu"))
        assert str(artifact) in str(err.value)
    finally:
        fresh.artifact.close()
