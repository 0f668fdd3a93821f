"""`--spec-backend replay` (runtime/drafters/replay.py): the benchmarking drafter at a fixed acceptance.

On a tiny random qwen3_5 artifact (tools/random_checkpoint.py, cpu card): the greedy speculation-off
outputs are recorded, then replayed at p = 0.885 (7 drafts): the output equals speculation off, and
the first position's acceptance is ~p with ~1 + sum p^j tokens per round; p = 0 accepts nothing and
still matches; a prompt not in the file drafts nothing. Unit checks: the file's errors name the line,
a lane that leaves its reference stops drafting, the draws do not depend on the other lanes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from ignis.runtime.drafters.base import DraftRequest
from ignis.runtime.drafters.replay import ReplayDrafter, ReplayOptions, load_replay_file
from ignis.runtime.errors import ConfigError
from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.profiles import SpecDefaults
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.server.artifact_source import ArtifactSource
from ignis.runtime.server.model import ModelSettings

build = pytest.importorskip("ignis.compiler.build")

P = 0.885
MAX_TOKENS = 40
PROMPTS = [[(7 * i + 3 * j) % 1000 + 5 for j in range(6 + i)] for i in range(6)]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ignis.tools.random_checkpoint import write_random_checkpoint

    root = tmp_path_factory.mktemp("replay")
    write_random_checkpoint(root / "ckpt", model="tiny")
    (root / "r.toml").write_text('name = "tiny"\n[modules]\nwidths = []\n')
    res = build.build_artifact(
        card="cpu",
        model=root / "ckpt",
        recipe=root / "r.toml",
        out=root / "art",
        progress=False,
        echo=lambda _l: None,
    )
    return Path(res.out)


def _generate(
    artifact: Path, spec: SpecDefaults, prompts: Sequence[list[int]], replay: ReplayOptions | None = None
) -> tuple[list[list[int]], SpeculativeMetrics]:
    model = ArtifactSource(artifact, replay=replay).load(ModelSettings(spec, device="cpu"))
    metrics = SpeculativeMetrics()
    try:
        engine = model.make_engine(4, metrics)
        out = engine.generate(
            list(prompts), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        )
        return [list(r.output_token_ids) for r in out], metrics
    finally:
        if model.close is not None:
            model.close()


@pytest.fixture(scope="module")
def reference(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[int]], Path]:
    outs, metrics = _generate(artifact, SpecDefaults("off"), PROMPTS)
    assert metrics.rounds_total == 0 and all(len(o) == MAX_TOKENS for o in outs)
    path = tmp_path_factory.mktemp("replay-file") / "ref.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt_token_ids": p, "output_token_ids": o}) + "\n"
            for p, o in zip(PROMPTS, outs, strict=True)
        )
    )
    return outs, path


def test_replay_at_p_matches_spec_off_and_accepts_about_p(
    artifact: Path, reference: tuple[list[list[int]], Path]
) -> None:
    want, path = reference
    got, m = _generate(artifact, SpecDefaults("replay", 7), PROMPTS, ReplayOptions(path, accept=P))
    assert got == want  # the verify round decides every token
    assert m.rounds_total > 0
    first = m.acceptance_rate(0)
    assert abs(first - P) < 0.1, first
    assert m.acceptance_rate(1) < first  # position j is reached with probability p^(j+1)
    expected = 1 + sum(P**j for j in range(1, 8))  # 5.43 with 7 drafts, fewer at each output's end
    assert expected - 1.3 < m.tokens_per_round <= expected + 0.5, m.tokens_per_round


def test_replay_at_zero_accepts_nothing_and_unknown_prompts_draft_nothing(
    artifact: Path, reference: tuple[list[list[int]], Path]
) -> None:
    want, path = reference
    got, m = _generate(artifact, SpecDefaults("replay", 3), PROMPTS[:3], ReplayOptions(path, accept=0.0))
    assert got == want[:3]
    assert m.drafted_tokens_total > 0 and sum(m.position_accepted_total.values()) == 0
    other = [[11, 12, 13, 14, 15]]
    off, _ = _generate(artifact, SpecDefaults("off"), other)
    got, m = _generate(artifact, SpecDefaults("replay", 7), other, ReplayOptions(path, accept=1.0))
    assert got == off and m.drafted_tokens_total == 0


def test_the_server_settings_take_replay_only_with_a_file(artifact: Path, tmp_path: Path) -> None:
    from ignis.runtime.server.settings import SpecLayer, resolve_spec

    src = ArtifactSource(artifact)
    assert "replay" not in src.spec_kinds
    with pytest.raises(ConfigError, match="--spec-replay FILE"):
        resolve_spec(
            [SpecLayer("command line", {"backend": "replay"})],
            spec_kinds=src.spec_kinds,
            missing_backend_reason={"replay": src.missing_backend_reason("replay")},
        )
    f = tmp_path / "r.jsonl"
    f.write_text("")
    with_file = ArtifactSource(artifact, replay=ReplayOptions(f))
    resolved = resolve_spec(
        [SpecLayer("command line", {"backend": "replay"})], spec_kinds=with_file.spec_kinds
    )
    assert resolved.spec.backend == "replay" and resolved.spec.draft_tokens == 7


def _request(lane: int, prompt: list[int], output: list[int], k: int = 4) -> DraftRequest:
    return DraftRequest(
        lane_id=lane,
        num_drafts=k,
        token_ids=[*prompt, *output],
        num_prompt_tokens=len(prompt),
        params=SamplingParams(temperature=0),
        generator=torch.Generator(),
    )


def test_a_lane_that_leaves_its_reference_stops_drafting() -> None:
    d = ReplayDrafter({(1, 2): [10, 11, 12, 13, 14, 15]}, vocab_size=50, accept=1.0)
    d.start_lane(0, [1, 2])
    (p,) = d.propose([_request(0, [1, 2], [10])])
    assert p.draft_token_ids.tolist() == [11, 12, 13, 14]
    (p,) = d.propose([_request(0, [1, 2], [10, 11, 12, 13, 14])])
    assert p.draft_token_ids.tolist() == [15]  # the reference's end
    d.start_lane(1, [1, 2])
    (p,) = d.propose([_request(1, [1, 2], [10, 40])])  # sampled off the reference
    assert p.draft_token_ids.tolist() == [] and d.left_reference == 1
    (p,) = d.propose([_request(1, [1, 2], [10, 40, 12])])
    assert p.draft_token_ids.tolist() == []


def test_draws_are_per_prompt_whatever_else_runs() -> None:
    refs = {(1,): list(range(100, 140)), (2,): list(range(200, 240))}
    alone = ReplayDrafter(refs, vocab_size=1000, accept=0.5, seed=7)
    alone.start_lane(0, [1])
    a = alone.propose([_request(0, [1], [], k=7)])[0].draft_token_ids.tolist()
    busy = ReplayDrafter(refs, vocab_size=1000, accept=0.5, seed=7)
    busy.start_lane(3, [2])
    busy.propose([_request(3, [2], [], k=7)])
    busy.start_lane(5, [1])
    b = busy.propose([_request(5, [1], [], k=7)])[0].draft_token_ids.tolist()
    assert a == b and len(a) == 7
    assert all(0 <= t < 1000 for t in a)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", ":1: not JSON"),
        ('{"prompt_token_ids": [], "output_token_ids": [1]}', "non-empty prompt"),
        ('{"prompt_token_ids": [1], "output_token_ids": [-1]}', "non-negative"),
        ('{"prompt_token_ids": [1, true], "output_token_ids": []}', "integer ids"),
    ],
)
def test_a_bad_replay_file_names_the_line(tmp_path: Path, line: str, message: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ConfigError, match=message):
        load_replay_file(f)


def test_a_prompt_keeps_its_distinct_outputs(tmp_path: Path) -> None:
    f = tmp_path / "r.jsonl"
    rows = [([1, 2], [3]), ([1, 2], [3, 4, 5]), ([9], [8]), ([1, 2], [3, 6, 5]), ([1, 2], [3, 4, 5])]
    f.write_text(
        "\n".join(json.dumps({"prompt_token_ids": p, "output_token_ids": o}) for p, o in rows) + "\n\n"
    )
    assert load_replay_file(f) == {(1, 2): [[3, 4, 5], [3, 6, 5]], (9,): [[8]]}  # [3] is a prefix: dropped
    with pytest.raises(ConfigError, match=r"must be in \[0, 1\]"):
        ReplayDrafter({}, vocab_size=10, accept=1.5)


def test_a_lane_follows_the_recorded_output_it_agrees_with() -> None:
    """Two runs of one prompt differed at the third token (other lane counts): a lane that takes the
    second branch switches to that output and keeps drafting."""
    refs = {(1, 2): [[10, 11, 12, 13, 14, 15], [10, 11, 20, 21, 22, 23]]}
    d = ReplayDrafter(refs, vocab_size=50, accept=1.0)
    d.start_lane(0, [1, 2])
    (p,) = d.propose([_request(0, [1, 2], [10], k=2)])
    assert p.draft_token_ids.tolist() == [11, 12]
    (p,) = d.propose([_request(0, [1, 2], [10, 11, 20], k=2)])  # the verify round chose 20, not 12
    assert p.draft_token_ids.tolist() == [21, 22] and d.left_reference == 0
    (p,) = d.propose([_request(0, [1, 2], [10, 11, 20, 21, 22, 30], k=2)])  # agrees with neither
    assert p.draft_token_ids.tolist() == [] and d.left_reference == 1


@pytest.mark.gpu
def test_replay_on_the_gpu_matches_spec_off_at_one_and_eight_lanes(tmp_path: Path) -> None:
    """On a GPU host, a hybrid artifact built for its card ($IGNIS_GDN_ARTIFACT, e.g. the tiny qwen3_5
    built for h200): greedy replay at p = 0.885 (7 drafts, the graphed route) equals speculation off,
    one request alone and eight together, with ~p accepted at the first position."""
    import os

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = os.environ.get("IGNIS_GDN_ARTIFACT")
    if not env:
        pytest.skip("set IGNIS_GDN_ARTIFACT to a hybrid artifact built for this GPU's card")
    art = Path(env)
    prompts = [[(11 * i + 5 * j) % 200 + 10 for j in range(8 + i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    def run(spec: SpecDefaults, replay: ReplayOptions | None, batch: list[list[int]]) -> tuple[Any, Any]:
        model = ArtifactSource(art, replay=replay).load(ModelSettings(spec, device="cuda"))
        metrics = SpeculativeMetrics()
        try:
            engine = model.make_engine(8, metrics)
            return [list(r.output_token_ids) for r in engine.generate(batch, params)], metrics
        finally:
            if model.close is not None:
                model.close()

    alone, _ = run(SpecDefaults("off"), None, prompts[:1])
    together, _ = run(SpecDefaults("off"), None, prompts)
    ref = tmp_path / "ref.jsonl"
    rows = [(prompts[0], alone[0]), *zip(prompts, together, strict=True)]
    ref.write_text(
        "".join(json.dumps({"prompt_token_ids": p, "output_token_ids": o}) + "\n" for p, o in rows)
    )
    opts = ReplayOptions(ref, accept=P)
    got_alone, m1 = run(SpecDefaults("replay", 7), opts, prompts[:1])
    got_together, m8 = run(SpecDefaults("replay", 7), opts, prompts)
    assert got_alone == alone and got_together == together
    assert abs(m8.acceptance_rate(0) - P) < 0.1 and m1.rounds_total > 0
