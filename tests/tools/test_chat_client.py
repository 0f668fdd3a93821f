"""ignis-chat and the quickstart name the speculative rates unambiguously (ADR 0002: the accepted
counter includes each round's model token), and a client without a socket says how to point it."""

from __future__ import annotations

from click.testing import CliRunner

from ignis.tools.chat import NO_SOCKET_HINT, ChatClient, ChatError, SpecCounters, main

METRICS = """# HELP ignis_speculative_rounds_total speculative lane-rounds
# TYPE ignis_speculative_rounds_total counter
ignis_speculative_rounds_total 14.0
ignis_speculative_drafted_tokens_total 56.0
ignis_speculative_accepted_tokens_total 22.0
ignis_speculative_position_drafted_total{position="0"} 14.0
ignis_speculative_position_drafted_total{position="1"} 14.0
ignis_speculative_position_accepted_total{position="0"} 6.0
ignis_speculative_position_accepted_total{position="1"} 2.0
ignis_speculative_position_accepted_total{position="2"} 0.0
ignis_requests_total{endpoint="chat",status="200"} 1.0
"""


def test_counters_give_tokens_per_round_and_the_draft_acceptance() -> None:
    c = SpecCounters.parse(METRICS)
    assert (c.rounds, c.drafted, c.committed, c.drafts_accepted) == (14, 56, 22, 8)
    assert abs(c.tokens_per_round - 22 / 14) < 1e-12
    assert abs(c.draft_acceptance - 8 / 56) < 1e-12  # 14 %, not the 39 % that 22 of 56 suggests
    line = c.describe()
    assert "1.57 tokens per verify round" in line and "draft acceptance 14.3 %" in line
    assert "8 of 56 draft tokens accepted" in line
    d = c - SpecCounters(rounds=4, drafted=16, committed=6, drafts_accepted=2)
    assert (d.rounds, d.drafted, d.committed, d.drafts_accepted) == (10, 40, 16, 6)
    assert SpecCounters.parse("").describe() == "no speculative round ran"


def test_without_a_socket_the_error_says_how_to_point_the_client(monkeypatch) -> None:
    monkeypatch.delenv("IGNIS_SOCKET", raising=False)
    client = ChatClient(url="http://127.0.0.1:9", timeout=5)
    try:
        client.model()
        raise AssertionError("no server listens on port 9")
    except ChatError as exc:
        assert str(exc).endswith(NO_SOCKET_HINT) and "IGNIS_SOCKET" in str(exc)
    finally:
        client.close()
    result = CliRunner().invoke(main, ["--url", "http://127.0.0.1:9", "hi"], env={"IGNIS_SOCKET": None})
    assert result.exit_code == 1 and "--socket PATH" in result.output and "IGNIS_SOCKET" in result.output


def test_the_socket_comes_from_ignis_socket(tmp_path) -> None:
    missing = str(tmp_path / "none.sock")
    result = CliRunner().invoke(main, ["hi"], env={"IGNIS_SOCKET": missing})
    assert result.exit_code == 1 and f"unix socket {missing}" in result.output
    assert "IGNIS_SOCKET=PATH" not in result.output  # a socket was given: no hint
