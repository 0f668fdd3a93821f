"""`ignis.tools.bench.llama_round`: the per-round figures on a tiny llama (CPU: the step only; CUDA: the
graph's replay, the host's share and the kernels of one replay)."""

from __future__ import annotations

import hf_tiny  # tests/ is on pytest's pythonpath
import pytest
import torch
from torch_threads import one_torch_thread  # noqa: F401 (autouse: one torch thread a module)

from ignis.runtime.engine import SpeculativeEngine
from ignis.runtime.families.llama_graphs import StaticLlamaExecutor
from ignis.runtime.families.static_rounds import warm_up_static
from ignis.tools.bench.llama_round import measure


def _engine(tmp_path, device: str) -> SpeculativeEngine:  # type: ignore[no-untyped-def]
    from ignis.compiler.importers import load_checkpoint

    ckpt = load_checkpoint(hf_tiny.save_tiny(hf_tiny.tiny_model("llama", seed=0), tmp_path / "c"))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    ex = StaticLlamaExecutor(
        ckpt.config,
        ckpt.tensors.load_all(),
        device=device,
        dtype=dtype,
        max_lanes=2,
        max_context=64,
        kv_bucket=16,
    )
    warm_up_static(ex, context=40)
    return SpeculativeEngine(ex, None, max_lanes=2)


def test_measure_on_the_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(tmp_path, "cpu")
    row = measure(engine, lanes=2, tokens=6)
    assert row["lanes"] == 2 and row["step_ms"] > 0
    assert row["tok_s"] == pytest.approx(2 * 1000 / row["step_ms"], rel=1e-2)
    assert row["replay_ms"] is None and row["host_ms"] is None  # no graphs on the CPU
    assert not engine.has_unfinished


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_measure_on_cuda_splits_the_round(tmp_path) -> None:  # type: ignore[no-untyped-def]
    engine = _engine(tmp_path, "cuda")
    for lanes in (1, 2):
        row = measure(engine, lanes=lanes, tokens=12, replays=5, profile=True)
        assert row["replay_ms"] is not None and 0 < row["replay_ms"] < row["step_ms"]
        assert row["host_ms"] == pytest.approx(row["step_ms"] - row["replay_ms"], abs=1e-3)
        assert row["kernels"] > 2 * 10  # tiny's 2 layers launch ~20 kernels each
        assert 0 < row["kernel_ms"] <= row["replay_ms"] * 1.5
