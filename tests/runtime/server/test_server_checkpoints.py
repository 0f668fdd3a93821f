"""Prompt checkpoints served over HTTP: a tiny hybrid (qwen3_5) artifact with its grafted DFlash2.

A multi-turn conversation reuses the previous turn (`usage.prompt_tokens_details.cached_tokens`, in
plain and streamed responses) and the opener (system prompt + tools) across conversations, with
output equal to a server without checkpoints; /metrics exports the pool; a restarted server with a
snapshot directory (`--checkpoint-dir`) starts warm; sizes and budgets parse from flags, config keys
and the card profile.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from server_helpers import build_tiny_hybrid_artifact, serve, short_tmpdir

from ignis.runtime.errors import ConfigError
from ignis.runtime.profiles import SpecDefaults, get_profile
from ignis.runtime.server.checkpoints import opener_length, parse_size, resolve_checkpoint_budgets

build = pytest.importorskip("ignis.compiler.build")
pytest.importorskip("transformers")

SYSTEM = "You are a careful coding agent. Tools: read_file(path), run(cmd). Answer briefly."


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_hybrid_artifact(tmp_path_factory.mktemp("art"))


class WithCheckpoints:
    """An `ArtifactSource` loaded with prompt checkpoint settings (the helper's `serve` passes only
    spec and max_context)."""

    def __init__(self, artifact: Path, **settings: object) -> None:
        from ignis.runtime.server.artifact_source import ArtifactSource

        self.inner = ArtifactSource(artifact)
        self.settings = settings
        for name in ("name", "aliases", "spec_kinds", "profile"):
            setattr(self, name, getattr(self.inner, name))

    def missing_backend_reason(self, backend: str) -> str:
        return self.inner.missing_backend_reason(backend)

    def load(self, settings):  # type: ignore[no-untyped-def]
        return self.inner.load(dataclasses.replace(settings, **self.settings))


def _chat(running, messages, *, stream: bool = False) -> tuple[str, dict]:  # type: ignore[no-untyped-def]
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with running.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        j = r.json()
        return j["choices"][0]["message"]["content"], j["usage"]
    chunks = [json.loads(b[6:]) for b in r.text.split("\n\n") if b.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, chunks[-1]["usage"]


def _conversation(running) -> list[tuple[str, dict]]:  # type: ignore[no-untyped-def]
    out = []
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "list the files"}]
    text, usage = _chat(running, msgs)
    out.append((text, usage))
    msgs += [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "tool output: main.py util.py README.md"},
    ]
    out.append(_chat(running, msgs, stream=True))
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "run the tests"}]
    out.append(_chat(running, other))
    return out


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_conversation_reuses_checkpoints_over_http(artifact: Path, engine_process: bool) -> None:
    spec = SpecDefaults("dflash2", 3)
    with serve(WithCheckpoints(artifact, checkpoint_card_bytes=0, checkpoint_host_bytes=0), spec) as off:
        want = _conversation(off)
        with off.client() as c:
            assert "ignis_prompt_checkpoint" not in c.get("/metrics").text
    assert [u["prompt_tokens_details"]["cached_tokens"] for _, u in want] == [0, 0, 0]
    with serve(
        WithCheckpoints(artifact, checkpoint_card_bytes=1 << 30, checkpoint_host_bytes=1 << 30),
        spec,
        engine_process=engine_process,
    ) as on:
        got = _conversation(on)
        with on.client() as c:
            metrics = c.get("/metrics").text
    assert [t for t, _ in got] == [t for t, _ in want]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for _, u in got]
    prompts = [u["prompt_tokens"] for _, u in got]
    assert [u["prompt_tokens"] for _, u in want] == prompts
    assert cached[0] == 0
    # turn 2 starts from turn 1 (its reply checkpoint, or at least its prompt's), the other
    # conversation from the opener (the system prompt rendered alone)
    assert prompts[0] <= cached[1] < prompts[1], (cached, prompts)
    assert 0 < cached[2] < prompts[2], (cached, prompts)
    assert 'ignis_prompt_checkpoint_hits_total{tier="card"} 2.0' in metrics
    assert 'ignis_prompt_checkpoint_recorded_total{kind="opener"}' in metrics
    assert f"ignis_prompt_checkpoint_reused_tokens_total {float(cached[1] + cached[2])}" in metrics
    assert 'ignis_prompt_checkpoint_budget_bytes{tier="card"} 1.073741824e+09' in metrics


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "engine-process"])
def test_restart_with_a_snapshot_directory_starts_warm(artifact: Path, engine_process: bool) -> None:
    spec = SpecDefaults("dflash2", 3)
    folder = short_tmpdir() / "ckpt"
    settings = {"checkpoint_card_bytes": 1 << 30, "checkpoint_host_bytes": 0, "checkpoint_dir": str(folder)}
    with serve(WithCheckpoints(artifact, **settings), spec, engine_process=engine_process) as first:
        want = _conversation(first)
    assert list(folder.glob("*.snapshot.ninfer"))  # written at shutdown
    with serve(WithCheckpoints(artifact, **settings), spec, engine_process=engine_process) as second:
        got = _conversation(second)
    assert [t for t, _ in got] == [t for t, _ in want]
    # every turn of the replayed conversation now starts from a checkpoint of the first server
    assert all(u["prompt_tokens_details"]["cached_tokens"] > 0 for _, u in got)
    # another drafter: the snapshots are bound to dflash2 and refused (a cold start)
    with serve(WithCheckpoints(artifact, **settings), SpecDefaults("ngram", 3)) as third:
        _, usage = _chat(third, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}])
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_opener_length_is_a_token_prefix(tmp_path: Path) -> None:
    import hf_tiny

    from ignis.compiler.importers.hf import read_hf_tokenizer
    from ignis.runtime.tokenizer import Tokenizer

    hf_tiny.tiny_tokenizer(vocab_size=320).save_pretrained(tmp_path)
    spec = read_hf_tokenizer(tmp_path)
    assert spec is not None
    tok = Tokenizer(spec)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    ids = tok.encode_chat(msgs, add_generation_prompt=True)
    n = opener_length(tok, msgs, None, ids)
    assert n is not None and 0 < n < len(ids)
    assert ids[:n] == tok.encode_chat(msgs[:1])
    assert opener_length(tok, msgs[1:], None, tok.encode_chat(msgs[1:])) is None  # no system message


def test_sizes_and_budgets() -> None:
    assert parse_size("16GiB", what="x") == 16 * 2**30
    assert parse_size("512 MB", what="x") == 512 * 10**6
    assert parse_size(123, what="x") == 123 and parse_size("0", what="x") == 0
    for bad in ("-1", "12 parsecs", "GiB", True, -5):
        with pytest.raises(ConfigError):
            parse_size(bad, what="x")  # type: ignore[arg-type]
    h200 = get_profile("h200")
    assert resolve_checkpoint_budgets("h200", None, None) == (
        h200.checkpoint_card_bytes,
        h200.checkpoint_host_bytes,
    )
    assert resolve_checkpoint_budgets("h200", "1GiB", 0) == (2**30, 0)
    assert resolve_checkpoint_budgets(None, None, None) == (0, 0)


def test_config_file_sizes(tmp_path: Path) -> None:
    from ignis.runtime.config_file import ConfigFileError, load_config_file

    p = tmp_path / "c.toml"
    p.write_text(
        'checkpoint_card_memory = "2GiB"\ncheckpoint_host_memory = 1024\ncheckpoint_dir = "/tmp/x"\n'
    )
    cfg = load_config_file(p)
    assert cfg.server["checkpoint_card_memory"] == 2 * 2**30 and cfg.server["checkpoint_host_memory"] == 1024
    p.write_text('checkpoint_card_memory = "lots"\n')
    with pytest.raises(ConfigFileError, match="checkpoint_card_memory"):
        load_config_file(p)


def test_cli_budgets_reach_the_pool(artifact: Path, captured, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """--checkpoint-card-memory / --checkpoint-host-memory, else the config file, else the card
    profile's (the artifact's card: cpu); 0 and 0 serve without a pool."""
    from click.testing import CliRunner

    from ignis.runtime import cli

    sock = short_tmpdir() / "s.sock"
    cpu = get_profile("cpu")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"socket: {sock}\ncheckpoint_card_memory: 3MiB\ncheckpoint_host_memory: 5MB\n")
    for args, want in (
        ([], {"card": cpu.checkpoint_card_bytes, "host": cpu.checkpoint_host_bytes}),
        (
            ["--checkpoint-card-memory", "1MiB", "--checkpoint-host-memory", "2GB"],
            {"card": 2**20, "host": 2 * 10**9},
        ),
        (["--config", str(cfg)], {"card": 3 * 2**20, "host": 5 * 10**6}),
        (["--checkpoint-card-memory", "0", "--checkpoint-host-memory", "0"], None),
    ):
        base = [] if "--config" in args else ["--socket", str(sock)]
        result = CliRunner().invoke(
            cli.main,
            ["--artifact", str(artifact), *base, "--spec-backend", "off", *args],
            catch_exceptions=False,
        )
        assert result.exit_code == 0, result.output
        server = captured[-1]
        pool = server.model.prefix_cache
        assert (None if pool is None else pool.budget) == want, args
        if pool is not None:
            assert (
                server.lanes._engine.checkpoints.cache is pool and server.lanes._engine.checkpoints.is_enabled
            )
        if server.model.close is not None:
            server.model.close()
    bad = CliRunner().invoke(
        cli.main, ["--artifact", str(artifact), "--socket", str(sock), "--checkpoint-card-memory", "lots"]
    )
    assert bad.exit_code == 1 and "checkpoint_card_memory" in bad.output
