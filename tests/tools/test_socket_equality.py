"""`tools/bench/socket_equality.py` (issue 25): greedy outputs compared at the socket, with the
reference's top-2 logprob gap where they part.

Unit checks of the reply parsing (chat's list, completions' text-keyed map with a collision and an
exact tie) and of the comparison (a divergence at a near-tie passes, one at a wide gap does not).
End to end on a tiny random qwen3_5 artifact (cpu card): `ignis-run` with speculation off and with
ngram, chat and token-id prompts cold at 1 client, repeated at 1 client (served from the prompt
checkpoints) and at 3 clients; every reply carries token ids and logprobs (speculation on too), the
gaps are the model's (one per output token), and the outputs are equal.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ignis.tools.bench import socket_equality as se

build = pytest.importorskip("ignis.compiler.build")


def test_gaps_from_chat_and_completions_replies() -> None:
    chat = {
        "logprobs": {
            "content": [
                {"logprob": -0.1, "top_logprobs": [{"logprob": -0.1}, {"logprob": -2.6}]},
                {"logprob": -0.7, "top_logprobs": [{"logprob": -0.7}, {"logprob": -0.7}]},
            ]
        }
    }
    assert se.gaps_of_reply(chat) == ([-0.1, -0.7], [2.5, 0.0])
    completions = {
        "logprobs": {
            "token_logprobs": [-0.25, -0.5, -1.0, -0.5],
            "top_logprobs": [
                {" a": -0.25, " b": -1.5, " c": -3.0},  # plain
                {" a": -2.0, " b": -3.0},  # top-1 and top-2 share a text: the map kept top-2's value
                {" a": -1.0, " b": -1.0},  # an exact tie
                {" a": -0.5},  # nothing below the chosen token: unknown
            ],
        }
    }
    assert se.gaps_of_reply(completions) == ([-0.25, -0.5, -1.0, -0.5], [1.25, 1.5, 0.0, None])
    with pytest.raises(ValueError, match="no logprobs"):
        se.gaps_of_reply({"logprobs": None})


def _rec(label: str, clients: int, prompt: str, ids: list[int], gaps: list[float]) -> dict[str, object]:
    return {"label": label, "clients": clients, "prompt": prompt, "output_token_ids": ids, "gaps": gaps}


def test_a_divergence_passes_only_at_a_near_tie() -> None:
    off = [_rec("off", n, p, [1, 2, 3, 4], [3.0, 0.1, 2.0, 0.0]) for n in (1, 8) for p in ("a", "b")]
    near = [
        _rec("ngram", 8, "a", [1, 2, 9, 9], [3.0, 0.1, 1.0, 1.0]),
        _rec("ngram", 8, "b", [1, 9, 8, 7], [3, 0.2, 1, 1]),
    ]
    rep = se.compare(off + near, threshold=0.25)
    rows = {r["pair"]: r for r in rep["rows"]}
    assert rows["off 8 vs 1 clients"]["divergent"] == 0 and rows["off 8 vs 1 clients"]["equal"] == 2
    ngram = rows["ngram vs off at 8 clients"]
    assert ngram["divergent"] == 2 and ngram["equal"] == 0 and not ngram["equal_up_to_near_ties"]
    assert sorted((d["position"], d["reference_gap"]) for d in ngram["divergences"]) == [(1, 0.1), (2, 2.0)]
    assert ngram["widest_divergent_gap"] == 2.0
    # position 2 of prompt a has off's gap 2.0: not a near-tie
    assert [d["near_tie"] for d in sorted(ngram["divergences"], key=lambda d: d["position"])] == [True, False]
    assert not se.compare(off + near[:1], threshold=0.25)["rows"][1]["equal_up_to_near_ties"]
    assert se.compare(off + near[1:], threshold=0.25)["rows"][1]["equal_up_to_near_ties"]
    g = rep["reference_gaps"]["1"]
    assert g["positions"] == 8 and g["exact_ties"] == 2 and g["below_threshold"] == 4 and g["min"] == 0.0
    with pytest.raises(ValueError, match="no records of the reference 'off'"):
        se.compare(near)
    # the same tokens with other gaps (a wrong state the tokens do not show): gap_delta tells
    moved = [
        _rec("replay", 8, "a", [1, 2, 3, 4], [3.5, 0.1, 2.0, 0.75]),
        _rec("replay", 8, "b", [1, 2, 7, 7], [3, 0.1, 9, 9]),
    ]
    row = se.compare(off + moved)["rows"][1]
    assert row["pair"] == "replay vs off at 8 clients" and row["equal"] == 1 and row["divergent"] == 1
    assert row["gap_delta"] == {"positions": 4 + 2, "p50": 0.0, "p99": 0.75, "max": 0.75}
    assert ngram["gap_delta"]["max"] == 0.0 and ngram["gap_delta"]["positions"] == 2 + 1


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ignis.tools.random_checkpoint import write_random_checkpoint

    root = tmp_path_factory.mktemp("socket-equality")
    write_random_checkpoint(root / "ckpt", model="tiny")
    (root / "r.toml").write_text('name = "tiny-eq"\n[modules]\nwidths = []\n')
    res = build.build_artifact(
        card="cpu", model=root / "ckpt", recipe=root / "r.toml", out=root / "art", progress=False,
        echo=lambda _l: None,
    )  # fmt: skip
    return Path(res.out)


def test_served_outputs_and_gaps_for_off_and_a_spec_backend(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ignis.tools.bench.serve_overhead import ServerProcess

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    chat = se.make_prompts("chat", 2, 0, 0, 0)
    ids = se.make_prompts("ids", 2, 10, 1000, 0)
    for backend in ("off", "ngram"):
        args = ["--artifact", str(artifact), "--lanes", "3", "--device", "cpu", "--spec-backend", backend]
        with ServerProcess(args, dict(os.environ), 180.0) as server:
            for prompts in (chat, ids):
                recs = se.collect(
                    server.socket, backend, prompts, clients=[1, 3], max_tokens=12, top_logprobs=3
                )
                se.append_records(out, recs)
    assert se.main(["report", "--out", str(out)]) == 0
    assert "greedy outputs at the socket against off" in capsys.readouterr().out
    records = se.read_records(out)
    assert len(records) == 2 * 2 * 3 * 2  # backends x prompt kinds x passes x prompts
    for r in records:  # every reply: 12 ids and one finite gap >= 0 per token, speculation on or off
        assert len(r["output_token_ids"]) == 12 and len(r["gaps"]) == 12
        assert all(g is not None and g >= 0 for g in r["gaps"])
        if not r["repeat"] and isinstance(r["prompt"], list):  # a cold prefill: nothing reused
            assert r["cached_tokens"] == 0
    rep = json.loads((out / "socket_equality.json").read_text())
    rows = {r["pair"]: r for r in rep["rows"]}
    assert set(rows) == {
        "off repeat vs first at 1 clients",  # a reused prompt against a cold prefill
        "off 3 vs 1 clients (repeats)",  # 3-row rounds against 1-row ones
        "ngram vs off at 1 clients",
        "ngram vs off at 1 clients (repeats)",
        "ngram vs off at 3 clients (repeats)",
    }
    assert all(r["compared"] == 4 and r["divergent"] == 0 for r in rows.values())
    assert rows["off repeat vs first at 1 clients"]["cached_share"] > 0.8
    assert rows["ngram vs off at 1 clients"]["cached_share"] < 0.5  # chat prompts share the template
    assert set(rep["reference_gaps"]) == {"1", "1 repeat", "3 repeat"}
    assert rep["reference_gaps"]["1"]["positions"] == 48


def test_the_warm_up_prompt_shares_no_prefix() -> None:
    prompts = [[0, 5, 6], [1, 5, 6], [3, 9]]
    warm = se._unrelated(prompts)
    assert warm[0] not in {p[0] for p in prompts} and len(warm) == 3
    assert isinstance(se._unrelated(["a prompt"]), str)


def test_the_cli_refuses_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="off: ConnectError"):
        se.main(
            ["collect", "--socket", str(tmp_path / "none.sock"), "--label", "off", "--out", str(tmp_path)]
        )
    with pytest.raises(SystemExit, match="no records at"):
        se.main(["report", "--out", str(tmp_path / "empty")])
    with pytest.raises(SystemExit, match="--clients: expected"):
        se.main(["collect", "--socket", "s", "--label", "x", "--clients", "1,a"])
