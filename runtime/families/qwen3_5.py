"""The hybrid families: `qwen3_5` (dense), `qwen3_5_moe` and `qwen3_next` (sparse MoE MLP).

Each decoder layer is either a Gated DeltaNet linear-attention layer or a gated full-attention
layer (`layer_types`, or every `full_attention_interval`-th layer full attention when absent),
followed by a SwiGLU MLP (dense) or a sparse MoE block. Architecture references: HF transformers
`models/qwen3_5/modeling_qwen3_5.py`, `models/qwen3_5_moe/modeling_qwen3_5_moe.py`,
`models/qwen3_next/modeling_qwen3_next.py`; the math lives in `gated_deltanet.py`, `moe.py` and
`hybrid_executor.py`.

Canonical tensor names are the text model's HF names (`model.layers.{i}...`, `model.embed_tokens`,
`model.norm`, `lm_head`). Multimodal-style checkpoints (`Qwen3_5ForConditionalGeneration`, whose
config.json nests a `text_config`) keep the text weights under `model.language_model.`:
`map_hf_name` moves them to the canonical names and drops the vision tower (`model.visual.`).
`mtp.*` tensors (the multi-token-prediction head) are not used by the trunk: check the trunk with
`check_tensor_set(..., ignore_prefixes=("mtp.",))` and the head with `mtp_tensor_shapes(config)`.

Routed experts come in two layouts: fused (`mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I], how the released Qwen3.5-MoE checkpoints store them) and per
expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, how the released Qwen3-Next checkpoints and
HF's `save_pretrained` store them). The tables name the family's canonical layout
(`<Config>.expert_layout`); the executor accepts either; `canonicalize_moe_tensors` converts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from ignis.runtime.errors import ConfigError
from ignis.runtime.families.base import Family, FamilyConfig, register_family

__all__ = [
    "HYBRID_FUSED_LINEARS",
    "HybridConfig",
    "Qwen3NextConfig",
    "Qwen3_5Config",
    "Qwen3_5MoeConfig",
    "Qwen3_5MoeTextConfig",
    "Qwen3_5TextConfig",
    "canonicalize_moe_tensors",
    "make_hybrid_executor",
    "map_hf_name",
    "mtp_tensor_shapes",
    "tensor_shapes",
]

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
ExpertLayout = Literal["fused", "per_expert"]

# rope types whose text-only positions reduce to plain RoPE (mrope: all three sections get the same
# position when there is no image or video, so the interleaving is the identity).
_PLAIN_ROPE_TYPES = ("default", "mrope")


@dataclass(frozen=True, kw_only=True)
class HybridConfig(FamilyConfig):
    """Fields shared by the three hybrid families (HF field names; HF's defaults where HF has one).

    Raises:
        ConfigError: from `__post_init__` / `from_hf` on any invalid or unsupported value.
    """

    # ---- behaviour switches of the subclasses (not config.json fields) ----
    is_moe: ClassVar[bool] = False
    # GDN input projections: "split" = in_proj_qkv/_z/_b/_a (qwen3_5*),
    # "fused" = in_proj_qkvz/_ba (qwen3_next).
    gdn_projections: ClassVar[Literal["split", "fused"]] = "split"
    # canonical routed-expert tensor layout of the family (MoE families only).
    expert_layout: ClassVar[ExpertLayout] = "per_expert"

    vocab_size: int  # tokens in the embedding table and the LM head
    hidden_size: int  # width of the residual stream
    num_hidden_layers: int  # decoder layers, linear-attention and full-attention together
    num_attention_heads: int  # query heads of the full-attention layers
    num_key_value_heads: int  # key/value heads of the full-attention layers (GQA)
    layer_types: tuple[str, ...]  # per layer "linear_attention" | "full_attention"
    head_dim: int = 256  # width of one full-attention head (HF default 256, not hidden / heads)
    hidden_act: str = "silu"  # MLP and conv activation; only "silu" is supported
    max_position_embeddings: int = 32768  # longest context (tokens) a lane may reach
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm, the gated GDN norm included
    tie_word_embeddings: bool = False  # LM head reuses model.embed_tokens.weight (no lm_head.weight)
    attention_bias: bool = False  # q/k/v/o projections of full attention carry biases
    rope_theta: float = 10000.0  # RoPE base (from rope_parameters / rope_scaling / top level)
    partial_rotary_factor: float = 0.25  # fraction of head_dim that is rotated (the first dims)
    linear_conv_kernel_dim: int = 4  # taps of the GDN causal depthwise conv (state keeps kernel-1)
    linear_key_head_dim: int = 128  # GDN query/key head width
    linear_value_head_dim: int = 128  # GDN value head width
    linear_num_key_heads: int = 16  # GDN query/key heads
    linear_num_value_heads: int = 32  # GDN value heads (a multiple of the key heads)
    mtp_num_hidden_layers: int = 1  # decoder layers of the MTP head (`mtp.layers.*`)

    def __post_init__(self) -> None:
        if not isinstance(self.layer_types, tuple):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
        ):
            value = getattr(self, name)
            self._require(
                isinstance(value, int) and not isinstance(value, bool) and value > 0,
                f"{name} must be a positive int, got {value!r}",
            )
        self._require(
            isinstance(self.mtp_num_hidden_layers, int) and self.mtp_num_hidden_layers >= 0,
            f"mtp_num_hidden_layers must be an int >= 0, got {self.mtp_num_hidden_layers!r}",
        )
        self._require(
            len(self.layer_types) == self.num_hidden_layers,
            f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
        )
        bad = sorted({t for t in self.layer_types if t not in (LINEAR_ATTENTION, FULL_ATTENTION)})
        self._require(
            not bad,
            f"layer_types holds unknown type(s) {bad}; expected {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}",
        )
        self._require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads {self.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {self.num_key_value_heads}",
        )
        self._require(
            self.linear_num_value_heads % self.linear_num_key_heads == 0,
            f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads {self.linear_num_key_heads}",
        )
        self._require(
            self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported (only 'silu')"
        )
        self._require(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        self._require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        self._require(
            0 < self.partial_rotary_factor <= 1,
            f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}",
        )
        rot = self.rotary_dim
        self._require(
            rot > 0 and rot % 2 == 0,
            f"head_dim {self.head_dim} * partial_rotary_factor {self.partial_rotary_factor} "
            f"gives rotary dim {rot}; it must be even and > 0",
        )

    # ---- derived sizes ----
    @property
    def rotary_dim(self) -> int:
        """Rotated leading dims of each attention head: int(head_dim * partial_rotary_factor), as HF."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        """GDN query (and key) width: linear_num_key_heads * linear_key_head_dim."""
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        """GDN value (and output gate) width: linear_num_value_heads * linear_value_head_dim."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the GDN conv (q, k and v together): 2 * key dim + value dim."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_full_attention(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) is a full-attention layer."""
        return self.layer_types[layer] == FULL_ATTENTION

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has a sparse MoE MLP (else a dense SwiGLU MLP)."""
        return self.is_moe

    def dense_intermediate_size(self, layer: int) -> int:
        """Intermediate width of a dense layer's MLP (only for layers where `is_moe_layer` is False)."""
        raise ConfigError(f"{type(self).__name__}: layer {layer} has no dense MLP")

    # ---- HF config.json parsing ----
    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> FamilyConfig:
        """Build the config from an HF `config.json` dict.

        Accepts the text model's own config (`model_type` qwen3_5_text / qwen3_5_moe_text / qwen3_next)
        and the multimodal wrapper that nests it under `text_config` (`tie_word_embeddings` is then
        taken from the top level, as HF ties by the outer config). `num_nextn_predict_layers` is read
        as `mtp_num_hidden_layers` when only it is given. RoPE settings are read from
        `rope_parameters`, `rope_scaling` or the top level (in that order); `layer_types` is derived
        from `full_attention_interval` (default 4) when absent, as HF does.

        Raises:
            ConfigError: a required field is missing, a value is invalid, or the RoPE type is not
                plain RoPE (only "default" and text-only "mrope" are supported).
        """
        return super().from_hf(_flatten_hf_config(cls, raw))


def _flatten_hf_config(cls: type[HybridConfig], raw: Mapping[str, Any]) -> dict[str, Any]:
    text = raw.get("text_config")
    if text is not None:
        if not isinstance(text, Mapping):
            raise ConfigError(f"{cls.__name__}: text_config must be an object, got {type(text).__name__}")
        d = dict(text)
        if "tie_word_embeddings" in raw:
            d["tie_word_embeddings"] = raw["tie_word_embeddings"]
    else:
        d = dict(raw)
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{cls.__name__}: rope_parameters must be an object, got {type(rope).__name__}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _PLAIN_ROPE_TYPES:
        raise ConfigError(
            f"{cls.__name__}: rope_type {rope_type!r} is not supported (supported: {list(_PLAIN_ROPE_TYPES)})"
        )
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope:
            d[key] = rope[key]
    if d.get("layer_types") is None:
        interval = d.get("full_attention_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:
            raise ConfigError(
                f"{cls.__name__}: full_attention_interval must be a positive int, got {interval!r}"
            )
        num_layers = d.get("num_hidden_layers")
        if isinstance(num_layers, int):
            d["layer_types"] = [
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)
            ]
    if "mtp_num_hidden_layers" not in d and "num_nextn_predict_layers" in d:  # DeepSeek-style name
        d["mtp_num_hidden_layers"] = d["num_nextn_predict_layers"]
    if isinstance(d.get("mlp_only_layers"), list):
        d["mlp_only_layers"] = tuple(d["mlp_only_layers"])
    if d.get("mlp_only_layers", ()) is None:
        d["mlp_only_layers"] = ()
    return d


@dataclass(frozen=True, kw_only=True)
class Qwen3_5Config(HybridConfig):
    """`qwen3_5`: dense hybrid (Qwen3.5 27B-style). HF: `Qwen3_5TextConfig` (nested in `Qwen3_5Config`)."""

    model_type: ClassVar[str] = "qwen3_5"

    intermediate_size: int  # SwiGLU MLP width of every layer

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(
            isinstance(self.intermediate_size, int) and self.intermediate_size > 0,
            f"intermediate_size must be a positive int, got {self.intermediate_size!r}",
        )

    def dense_intermediate_size(self, layer: int) -> int:
        return self.intermediate_size


@dataclass(frozen=True, kw_only=True)
class Qwen3_5TextConfig(Qwen3_5Config):
    """`qwen3_5_text`: a text-only `Qwen3_5ForCausalLM` checkpoint (same architecture as `qwen3_5`)."""

    model_type: ClassVar[str] = "qwen3_5_text"


def _check_moe_fields(cfg: Qwen3_5MoeConfig | Qwen3NextConfig, *, allow_no_experts: bool) -> None:
    low = 0 if allow_no_experts else 1
    cfg._require(
        isinstance(cfg.num_experts, int) and cfg.num_experts >= low,
        f"num_experts must be an int >= {low}, got {cfg.num_experts!r}",
    )
    if cfg.num_experts > 0:
        cfg._require(
            isinstance(cfg.num_experts_per_tok, int) and 0 < cfg.num_experts_per_tok <= cfg.num_experts,
            f"num_experts_per_tok must be in 1..num_experts ({cfg.num_experts}), "
            f"got {cfg.num_experts_per_tok!r}",
        )
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        value = getattr(cfg, name)
        cfg._require(isinstance(value, int) and value > 0, f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Qwen3_5MoeConfig(HybridConfig):
    """`qwen3_5_moe`: MoE hybrid (Qwen3.5-122B-A10B-style). HF: `Qwen3_5MoeTextConfig`.

    Every layer's MLP is a sparse MoE block; the top-k router weights are always renormalized
    (HF's `Qwen3_5MoeTopKRouter` has no `norm_topk_prob` switch).
    """

    model_type: ClassVar[str] = "qwen3_5_moe"
    is_moe: ClassVar[bool] = True
    expert_layout: ClassVar[ExpertLayout] = "fused"
    norm_topk_prob: ClassVar[bool] = True

    num_experts: int  # routed experts per MoE layer
    num_experts_per_tok: int  # experts each token is routed to (top-k)
    moe_intermediate_size: int  # SwiGLU width of one routed expert
    shared_expert_intermediate_size: int  # SwiGLU width of the shared expert

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_moe_fields(self, allow_no_experts=False)


@dataclass(frozen=True, kw_only=True)
class Qwen3_5MoeTextConfig(Qwen3_5MoeConfig):
    """`qwen3_5_moe_text`: a text-only `Qwen3_5MoeForCausalLM` checkpoint (same as `qwen3_5_moe`)."""

    model_type: ClassVar[str] = "qwen3_5_moe_text"


@dataclass(frozen=True, kw_only=True)
class Qwen3NextConfig(HybridConfig):
    """`qwen3_next`: MoE hybrid (Qwen3-Next-80B-A3B-style). HF: `Qwen3NextConfig`.

    Layer i has a sparse MoE MLP when num_experts > 0, i is not in `mlp_only_layers` and
    (i + 1) % decoder_sparse_step == 0; otherwise a dense SwiGLU MLP of `intermediate_size`.
    """

    model_type: ClassVar[str] = "qwen3_next"
    is_moe: ClassVar[bool] = True
    gdn_projections: ClassVar[Literal["split", "fused"]] = "fused"
    expert_layout: ClassVar[ExpertLayout] = "per_expert"

    intermediate_size: int  # SwiGLU width of the dense (non-MoE) layers
    num_experts: int  # routed experts per MoE layer (0: every layer dense)
    num_experts_per_tok: int  # experts each token is routed to (top-k)
    moe_intermediate_size: int  # SwiGLU width of one routed expert
    shared_expert_intermediate_size: int  # SwiGLU width of the shared expert
    norm_topk_prob: bool = True  # renormalize the k kept router probabilities to sum 1
    decoder_sparse_step: int = 1  # every decoder_sparse_step-th layer is MoE
    mlp_only_layers: tuple[int, ...] = ()  # layers forced to a dense MLP

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.mlp_only_layers, tuple):
            object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        self._require(
            isinstance(self.intermediate_size, int) and self.intermediate_size > 0,
            f"intermediate_size must be a positive int, got {self.intermediate_size!r}",
        )
        _check_moe_fields(self, allow_no_experts=True)
        self._require(
            isinstance(self.decoder_sparse_step, int) and self.decoder_sparse_step > 0,
            f"decoder_sparse_step must be a positive int, got {self.decoder_sparse_step!r}",
        )
        bad = [
            i for i in self.mlp_only_layers if not (isinstance(i, int) and 0 <= i < self.num_hidden_layers)
        ]
        self._require(
            not bad, f"mlp_only_layers holds layer indices outside 0..{self.num_hidden_layers - 1}: {bad}"
        )

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def dense_intermediate_size(self, layer: int) -> int:
        return self.intermediate_size


# ---------------------------------------------------------------------------------------------
# tensor tables
# ---------------------------------------------------------------------------------------------


def _attention_shapes(c: HybridConfig, p: str) -> dict[str, tuple[int, ...]]:
    q_out = c.num_attention_heads * c.head_dim
    kv_out = c.num_key_value_heads * c.head_dim
    out = {
        f"{p}.self_attn.q_proj.weight": (2 * q_out, c.hidden_size),  # query and output gate per head
        f"{p}.self_attn.k_proj.weight": (kv_out, c.hidden_size),
        f"{p}.self_attn.v_proj.weight": (kv_out, c.hidden_size),
        f"{p}.self_attn.o_proj.weight": (c.hidden_size, q_out),
        f"{p}.self_attn.q_norm.weight": (c.head_dim,),
        f"{p}.self_attn.k_norm.weight": (c.head_dim,),
    }
    if c.attention_bias:
        out |= {
            f"{p}.self_attn.q_proj.bias": (2 * q_out,),
            f"{p}.self_attn.k_proj.bias": (kv_out,),
            f"{p}.self_attn.v_proj.bias": (kv_out,),
            f"{p}.self_attn.o_proj.bias": (c.hidden_size,),
        }
    return out


def _gdn_shapes(c: HybridConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, hv = c.hidden_size, c.linear_num_value_heads
    out: dict[str, tuple[int, ...]] = {}
    if c.gdn_projections == "split":
        out |= {
            f"{p}.linear_attn.in_proj_qkv.weight": (c.linear_conv_dim, h),
            f"{p}.linear_attn.in_proj_z.weight": (c.linear_value_dim, h),
            f"{p}.linear_attn.in_proj_b.weight": (hv, h),
            f"{p}.linear_attn.in_proj_a.weight": (hv, h),
        }
    else:
        out |= {
            f"{p}.linear_attn.in_proj_qkvz.weight": (2 * c.linear_key_dim + 2 * c.linear_value_dim, h),
            f"{p}.linear_attn.in_proj_ba.weight": (2 * hv, h),
        }
    out |= {
        f"{p}.linear_attn.conv1d.weight": (c.linear_conv_dim, 1, c.linear_conv_kernel_dim),
        f"{p}.linear_attn.dt_bias": (hv,),
        f"{p}.linear_attn.A_log": (hv,),
        f"{p}.linear_attn.norm.weight": (c.linear_value_head_dim,),
        f"{p}.linear_attn.out_proj.weight": (h, c.linear_value_dim),
    }
    return out


def _swiglu_shapes(p: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{p}.gate_proj.weight": (inter, hidden),
        f"{p}.up_proj.weight": (inter, hidden),
        f"{p}.down_proj.weight": (hidden, inter),
    }


def _moe_shapes(
    c: Qwen3_5MoeConfig | Qwen3NextConfig, p: str, layout: ExpertLayout
) -> dict[str, tuple[int, ...]]:
    h, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
    out: dict[str, tuple[int, ...]] = {f"{p}.mlp.gate.weight": (e, h)}
    if layout == "fused":
        out[f"{p}.mlp.experts.gate_up_proj"] = (e, 2 * i, h)
        out[f"{p}.mlp.experts.down_proj"] = (e, h, i)
    else:
        for j in range(e):
            out |= _swiglu_shapes(f"{p}.mlp.experts.{j}", h, i)
    out |= _swiglu_shapes(f"{p}.mlp.shared_expert", h, c.shared_expert_intermediate_size)
    out[f"{p}.mlp.shared_expert_gate.weight"] = (1, h)
    return out


def _mlp_shapes(
    c: HybridConfig, p: str, moe: bool, layer: int, layout: ExpertLayout
) -> dict[str, tuple[int, ...]]:
    if moe:
        assert isinstance(c, Qwen3_5MoeConfig | Qwen3NextConfig)
        return _moe_shapes(c, p, layout)
    return _swiglu_shapes(f"{p}.mlp", c.hidden_size, c.dense_intermediate_size(layer))


def tensor_shapes(
    config: HybridConfig, *, expert_layout: ExpertLayout | None = None
) -> dict[str, tuple[int, ...]]:
    """{canonical HF name: shape} of every tensor the trunk executor uses (no `mtp.*`, no vision).

    Args:
        expert_layout: routed-expert layout to list ("fused" or "per_expert"); the family's
            canonical `config.expert_layout` when None. Ignored for dense families.
    """
    layout = expert_layout or config.expert_layout
    h = config.hidden_size
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out |= _attention_shapes(config, p) if config.is_full_attention(i) else _gdn_shapes(config, p)
        out |= _mlp_shapes(config, p, config.is_moe_layer(i), i, layout)
    return out


def mtp_tensor_shapes(
    config: HybridConfig, *, expert_layout: ExpertLayout | None = None
) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the MTP head's tensors (`mtp.*`), for the MTP companion container.

    The head (as in vLLM's `qwen3_next_mtp.py` / `qwen3_5_mtp.py`): `mtp.pre_fc_norm_embedding` and
    `mtp.pre_fc_norm_hidden` ((1 + w) RMSNorms of the next token's embedding and the trunk's last
    hidden state), `mtp.fc` [hidden, 2 * hidden] over their concatenation, `mtp_num_hidden_layers`
    full-attention decoder layers `mtp.layers.{j}` with the family's MLP kind, and `mtp.norm`. The
    embedding and LM head are shared with the trunk. Empty when mtp_num_hidden_layers is 0.
    """
    if config.mtp_num_hidden_layers == 0:
        return {}
    layout = expert_layout or config.expert_layout
    h = config.hidden_size
    out: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
    }
    for j in range(config.mtp_num_hidden_layers):
        p = f"mtp.layers.{j}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out |= _attention_shapes(config, p)
        moe = config.is_moe and (not isinstance(config, Qwen3NextConfig) or config.is_moe_layer(j))
        out |= _mlp_shapes(config, p, moe, 0, layout)
    return out


def map_hf_name(name: str) -> str | None:
    """HF checkpoint tensor name -> canonical name, or None to drop it.

    `model.language_model.X` -> `model.X` (multimodal wrapper); `model.visual.*` / `visual.*` (the
    vision tower) -> None; everything else (`model.*`, `lm_head.*`, `mtp.*`) unchanged.
    """
    if name.startswith(("model.visual.", "visual.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    return name


def _moe_prefixes(config: HybridConfig) -> list[str]:
    prefixes = [f"model.layers.{i}" for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    if config.is_moe:
        for j in range(config.mtp_num_hidden_layers):
            if not isinstance(config, Qwen3NextConfig) or config.is_moe_layer(j):
                prefixes.append(f"mtp.layers.{j}")
    return prefixes


def canonicalize_moe_tensors(
    config: HybridConfig, tensors: Mapping[str, torch.Tensor], *, expert_layout: ExpertLayout | None = None
) -> dict[str, torch.Tensor]:
    """Rewrite routed-expert tensors into one layout (the family's canonical one by default).

    fused -> per_expert gives views (no copy); per_expert -> fused stacks (a copy). Layers already
    in the target layout, and all other tensors, pass through unchanged. Layers that have neither
    layout complete are left as they are (the tensor-set check then names what is missing).

    Args:
        tensors: canonical name -> tensor (after `map_hf_name`).
        expert_layout: target layout; `config.expert_layout` when None.

    Returns:
        A new dict; the input is not modified.
    """
    layout = expert_layout or config.expert_layout
    out = dict(tensors)
    if not config.is_moe:
        return out
    assert isinstance(config, Qwen3_5MoeConfig | Qwen3NextConfig)
    num_experts, inter = config.num_experts, config.moe_intermediate_size
    for p in _moe_prefixes(config):
        fused_gu, fused_down = f"{p}.mlp.experts.gate_up_proj", f"{p}.mlp.experts.down_proj"
        per = [
            [f"{p}.mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")]
            for e in range(num_experts)
        ]
        if layout == "per_expert" and fused_gu in out and fused_down in out:
            gu, down = out.pop(fused_gu), out.pop(fused_down)
            for e, (g_name, u_name, d_name) in enumerate(per):
                out[g_name], out[u_name], out[d_name] = gu[e, :inter], gu[e, inter:], down[e]
        elif layout == "fused" and all(n in out for names in per for n in names):
            out[fused_gu] = torch.stack([torch.cat([out.pop(g), out.pop(u)], dim=0) for g, u, _ in per])
            out[fused_down] = torch.stack([out.pop(d) for _, _, d in per])
    return out


def make_hybrid_executor(
    config: HybridConfig,
    weights: Mapping[str, Any],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    linear: Any = None,
    expert_cache: Any = None,
    moe_module: Any = None,
) -> Any:
    """Build the torch `HybridExecutor` (see `hybrid_executor.py`) for any of the hybrid families;
    `linear` is the executor's linear hook (base.py's `Family.make_executor`); `expert_cache` an
    `ignis.runtime.expert_cache.ExpertCache` for the routed experts (MoE families), or None;
    `moe_module` the compiled grouped expert kernels, or None."""
    from ignis.runtime.families.hybrid_executor import HybridExecutor

    return HybridExecutor(
        config,
        weights,
        device=device,
        dtype=dtype,
        linear=linear,
        expert_cache=expert_cache,
        moe_module=moe_module,
    )


#: The hybrid executors' own fusions of a decoder layer's linear weights (as `Family.fused_linears`:
#: the module path under ``model.layers.N``, the members stacked along the output rows in this
#: order): one GEMM each for the attention's q|k|v, the split-projection GDN's qkv|z and the dense
#: MLP's gate|up. The executor stacks a group when its compiled functions serve the stacked shape
#: (the build compiles it: `ignis.compiler.build.modules.FUSED_LINEARS`) or serve none of the
#: members' shapes either (torch runs them), else it keeps the members apart (an artifact built
#: before these fusions).
HYBRID_FUSED_LINEARS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attn", ("q_proj", "k_proj", "v_proj")),
    ("linear_attn", ("in_proj_qkv", "in_proj_z")),
    ("mlp", ("gate_proj", "up_proj")),
)


def _canonicalize_tensors(config: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`Family.canonicalize_tensors` of the hybrid families: routed experts into the family's layout."""
    return canonicalize_moe_tensors(config, tensors)


for _cls in (Qwen3_5Config, Qwen3_5TextConfig, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3NextConfig):
    register_family(
        Family(
            model_type=_cls.model_type,
            config_cls=_cls,
            tensor_shapes=tensor_shapes,
            make_executor=make_hybrid_executor,
            map_hf_name=map_hf_name,
            canonicalize_tensors=_canonicalize_tensors if _cls.is_moe else None,
            fused_linears=HYBRID_FUSED_LINEARS,
        )
    )
del _cls
