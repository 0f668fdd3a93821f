"""Tiny random checkpoints of the hybrid families, written by HF transformers' own classes.

`make_tiny_hybrid(family, folder)` builds a seeded HF model (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration` or `Qwen3NextForCausalLM`) small enough for CPU tests but with
every structural feature on: both layer types (4 layers, full attention every 2nd), more GDN value
heads than key heads and k_dim != v_dim, GQA with partial rotary, a 4-expert top-2 MoE with a shared
expert, a dense layer inside qwen3_next (`mlp_only_layers`). Every weight is redrawn from
N(0, 1/fan_in) (norm weights near their identity, A_log / dt_bias so decays span slow and fast) so
that logits are O(1) and greedy choices are not ties. The model is saved with `save_pretrained`;
the returned tensors are read back from the safetensors file, mapped through the family's
`map_hf_name` (vision tower dropped) and given random `mtp.*` tensors of the MTP table's shapes, as
a released checkpoint carries them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file

from ignis.runtime.families import get_family
from ignis.runtime.families.qwen3_5 import HybridConfig, canonicalize_moe_tensors, mtp_tensor_shapes

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

_TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=4,
    full_attention_interval=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
)
_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    num_position_embeddings=16,
)


@dataclass
class TinyHybrid:
    """A tiny checkpoint and its HF oracle.

    Attributes:
        family: our family name (model_type of the saved config.json).
        folder: the `save_pretrained` folder.
        hf_model: the HF model in eval mode, float32, on CPU (the oracle).
        raw_config: the saved config.json as a dict.
        config: our parsed config.
        tensors: canonical name -> tensor as saved by HF (mapped, vision dropped, mtp added).
    """

    family: str
    folder: Path
    hf_model: Any
    raw_config: dict[str, Any]
    config: HybridConfig
    tensors: dict[str, torch.Tensor]

    def canonical_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors with routed experts in the family's canonical layout."""
        return canonicalize_moe_tensors(self.config, self.tensors)


def _hf_model(family: str, *, tie: bool) -> Any:
    if family == "qwen3_5":
        cfg = transformers.Qwen3_5Config(
            text_config=dict(intermediate_size=96, tie_word_embeddings=tie, **_TEXT),
            vision_config=_VISION,
            tie_word_embeddings=tie,
        )
        return transformers.Qwen3_5ForConditionalGeneration(cfg)
    if family == "qwen3_5_moe":
        cfg = transformers.Qwen3_5MoeConfig(
            text_config=dict(tie_word_embeddings=tie, **_MOE, **_TEXT),
            vision_config=_VISION,
            tie_word_embeddings=tie,
        )
        return transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    if family == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(
            intermediate_size=96,
            mlp_only_layers=[2],
            norm_topk_prob=True,
            tie_word_embeddings=tie,
            **_MOE,
            **_TEXT,
        )
        return transformers.Qwen3NextForCausalLM(cfg)
    raise ValueError(f"unknown family {family!r}")


def _redraw(model: Any, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("linear_attn.norm.weight"):  # plain weight (gated RMSNorm)
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # (1 + w) RMSNorms and biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:  # linear / embedding / conv / stacked experts: N(0, 1/fan_in), fan_in = last dim
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def make_tiny_hybrid(family: str, folder: Path, *, seed: int = 0, tie: bool = False) -> TinyHybrid:
    """Build, redraw, save and reload a tiny checkpoint of `family` (see the module docstring)."""
    torch.manual_seed(seed)
    model = _hf_model(family, tie=tie)
    _redraw(model, torch.Generator().manual_seed(seed))
    if tie:
        model.tie_weights()
    model.eval()
    model.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    fam = get_family(raw["model_type"])
    config = fam.config_cls.from_hf(raw)
    assert isinstance(config, HybridConfig)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        mapped = fam.map_hf_name(name)
        if mapped is not None:
            tensors[mapped] = tensor
    gen = torch.Generator().manual_seed(seed + 1)
    for name, shape in mtp_tensor_shapes(config, expert_layout="per_expert").items():
        tensors[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    return TinyHybrid(family, folder, model, raw, config, tensors)
