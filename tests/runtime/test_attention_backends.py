"""The llama / qwen2 executor's torch attention runs with cuDNN's SDPA off (`runtime/families/attention.py`):
cuDNN builds a plan per new shape, which put plan builds on the request path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hf_tiny
import pytest
import torch
import torch.nn.functional as F

from ignis.compiler.importers import load_checkpoint
from ignis.runtime.families import get_family
from ignis.runtime.families.attention import SDPA_BACKENDS, sdpa


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool, bool]]:
    """Records (cudnn, flash, efficient) SDPA enablement at every scaled_dot_product_attention call."""
    seen: list[tuple[bool, bool, bool]] = []
    real = F.scaled_dot_product_attention

    def record(*args: Any, **kwargs: Any) -> torch.Tensor:
        b = torch.backends.cuda
        seen.append((b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    return seen


def test_sdpa_turns_cudnn_off_and_restores_it(spy: list[tuple[bool, bool, bool]]) -> None:
    assert torch.backends.cuda.cudnn_sdp_enabled()  # torch's default, restored after each call
    q = torch.randn(1, 2, 5, 8)
    out = sdpa(q, q, q, is_causal=True)
    ref = torch.ops.aten._scaled_dot_product_attention_math(q, q, q, is_causal=True)[0]
    torch.testing.assert_close(out, ref)
    assert spy == [(False, True, True)]
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in SDPA_BACKENDS


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_executors_attend_without_cudnn(
    family: str, tmp_path: Path, spy: list[tuple[bool, bool, bool]]
) -> None:
    folder = hf_tiny.save_tiny(hf_tiny.tiny_model(family, seed=0), tmp_path / "ckpt")
    ckpt = load_checkpoint(folder)
    ex = get_family(ckpt.config.model_type).make_executor(
        ckpt.config, ckpt.tensors.load_all(), "cpu", torch.float32
    )
    lane = ex.new_lane()
    ex.forward([lane], [torch.tensor([3, 5, 7, 9])], record=False)
    ex.commit([lane], [4])
    ex.forward([lane], [torch.tensor([11, 13])])
    assert spy and all(s == (False, True, True) for s in spy), spy
