"""The `cpu` card profile's prefill budget keeps the other lanes responsive: ignis-run defaults
`--max-prefill-tokens` to the card profile's value (cpu: 256, not the GPU-sized 2048), and with it a
lane already decoding gets a token every step while a 2,733-token prompt is prefilled in chunks."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import toy_executor as toy
from click.testing import CliRunner
from server_helpers import short_tmpdir

from ignis.runtime import cli
from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.profiles import get_profile, load_profiles, profile_max_prefill_tokens
from ignis.runtime.sampling import SamplingParams
from ignis.runtime.scheduler import DEFAULT_MAX_PREFILL_TOKENS


def invoke(*args: str, env: dict[str, str] | None = None) -> object:
    return CliRunner().invoke(
        cli.main, ["--model-factory", "toy_model:from_env", *args], env=env, catch_exceptions=False
    )


def test_the_cpu_profile_has_a_small_prefill_budget_and_the_gpu_profiles_the_default() -> None:
    cpu = get_profile("cpu").max_prefill_tokens
    assert 0 < cpu <= 256 and cpu % 64 == 0  # whole 64-column Gated DeltaNet chunks
    for name, p in load_profiles().items():
        if name != "cpu":
            assert p.max_prefill_tokens == DEFAULT_MAX_PREFILL_TOKENS, name
    assert profile_max_prefill_tokens("cpu") == cpu and profile_max_prefill_tokens(None) == 2048


def test_ignis_run_takes_the_profiles_budget_unless_one_is_given(captured, tmp_path: Path) -> None:
    sock = short_tmpdir() / "s.sock"
    cpu = get_profile("cpu").max_prefill_tokens
    cfg = tmp_path / "ignis.toml"
    cfg.write_text(f'socket = "{sock}"\nmax_prefill_tokens = 2048\n')
    for args, env, want in (
        (["--socket", str(sock)], {"IGNIS_TOY_PROFILE": "cpu"}, cpu),  # the model's own card
        (["--socket", str(sock), "--profile", "cpu"], None, cpu),
        (["--socket", str(sock), "--profile", "h200"], {"IGNIS_TOY_PROFILE": "cpu"}, 2048),
        (["--socket", str(sock), "--max-prefill-tokens", "512"], {"IGNIS_TOY_PROFILE": "cpu"}, 512),
        (["--config", str(cfg)], {"IGNIS_TOY_PROFILE": "cpu"}, 2048),  # the file's explicit value
    ):
        result = invoke(*args, env=env)
        assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
        assert captured[-1].lanes._engine.max_prefill_tokens == want, args


def test_a_decoding_lane_emits_every_step_behind_a_long_prompt_with_the_cpu_budget() -> None:
    budget = get_profile("cpu").max_prefill_tokens
    g = torch.Generator().manual_seed(0)
    short = tuple(torch.randint(0, 50, (12,), generator=g).tolist())
    long_ = tuple(torch.randint(0, 50, (2733,), generator=g).tolist())
    ex = toy.ToyExecutor(toy.ToyConfig(max_position_embeddings=4096))
    engine = SpeculativeEngine(ex, None, max_prefill_tokens=budget)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = engine.add_lane(short, greedy)
    engine.step()
    b = engine.add_lane(long_, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    steps = 0
    while True:
        updates = {u.lane_id: u for u in engine.step()}
        steps += 1
        assert a in updates and updates[a].new_token_ids, "the decoding lane waited a whole step"
        if b in updates:
            break
    # each step held the decoding lane for at most `budget` prompt tokens, not 2048
    assert steps == math.ceil(2733 / budget) > math.ceil(2733 / DEFAULT_MAX_PREFILL_TOKENS)
