"""The confident random checkpoint (`random_checkpoint --confident`) on CUDA in bf16: greedy outputs
do not depend on the verify round's row count, which the plain init's near-flat logits cannot promise.

The tiny preset (the 27B's structure: Gated DeltaNet + gated attention) and its DFlash2 drafter, on
the static, CUDA-graphed hybrid executor in bfloat16: the same prompts greedy at one lane (1-row
rounds), at eight lanes at once (8-row rounds), and with the drafter at 7 drafts (8 x 8 rows) give
the same tokens; the top-2 logprob gap is > 2 nats at every token; each token is pi of the one
before. `run_confident` also runs on the CPU (the module's last test, float32), so the code of the
GPU case is exercised everywhere.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from ignis.tools import random_checkpoint as rc

PROMPTS = [[(11 * i + 5 * j) % 1000 + 3 for j in range(5 + 2 * i)] for i in range(8)]


def run_confident(folder: Path, device: str, dtype: torch.dtype, singles: int) -> dict[str, Any]:
    """Write the tiny confident checkpoint and drafter under `folder`, generate greedy three ways (the
    first `singles` prompts alone)."""
    from safetensors.torch import load_file

    from ignis.runtime.drafters.dflash2 import build_dflash2_drafter
    from ignis.runtime.engine import SpeculativeEngine
    from ignis.runtime.families.hybrid_graphs import StaticHybridExecutor
    from ignis.runtime.sampling import SamplingParams

    cfg = rc.write_random_checkpoint(folder / "ckpt", model="tiny", confident=True)
    rc.write_random_dflash2(folder / "ckpt", folder / "d", model="tiny")
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted((folder / "ckpt").glob("*.safetensors")):
        tensors |= load_file(str(f))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)

    def generate(prompts: list[list[int]], spec: bool) -> tuple[list[list[int]], list[float]]:
        ex = StaticHybridExecutor(cfg, tensors, device=device, dtype=dtype, max_lanes=8, max_context=256)
        drafter = None
        if spec:
            drafter = build_dflash2_drafter(
                target_config=cfg, target_weights=tensors, checkpoint=folder / "d", device=device, dtype=dtype
            )
        engine = SpeculativeEngine(ex, drafter, draft_tokens=7 if spec else None, max_lanes=8)
        out = engine.generate(prompts, params)
        gaps = [lp.top[0][1] - lp.top[1][1] for r in out for lp in r.logprobs]
        return [list(r.output_token_ids) for r in out], gaps

    one = [generate([p], False)[0][0] for p in PROMPTS[:singles]]
    many, gaps = generate(PROMPTS, False)
    drafted, dgaps = generate(PROMPTS, True)
    return {"one": one, "many": many, "drafted": drafted, "gaps": gaps + dgaps, "config": cfg}


def _check(res: dict[str, Any]) -> None:
    assert res["one"] == res["many"][: len(res["one"])] and res["many"] == res["drafted"]
    assert min(res["gaps"]) > 2.0, min(res["gaps"])
    cfg = res["config"]
    pi = rc.confident_permutation(cfg.vocab_size, cfg.hidden_size)
    for p, o in zip(PROMPTS, res["many"], strict=True):
        walk = [p[-1], *o]
        assert all(int(pi[a]) == b for a, b in itertools.pairwise(walk))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_confident_outputs_do_not_depend_on_the_row_count_in_bf16(tmp_path: Path) -> None:
    _check(run_confident(tmp_path, "cuda", torch.bfloat16, singles=len(PROMPTS)))


def test_the_same_check_on_the_cpu(tmp_path: Path) -> None:
    _check(run_confident(tmp_path, "cpu", torch.float32, singles=2))
