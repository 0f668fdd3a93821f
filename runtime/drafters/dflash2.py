"""DFlash2: the block-diffusion drafter grafted into the 27B (issue 4, "Drafters"; DESIGN.md).

What it is (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding",
arXiv:2602.06036, plus the DFlash2 additions):

* a small Qwen3-style decoder of `num_hidden_layers` (5) non-causal sliding-window (2,048) layers;
* context: the target's outputs at the tapped decoder layers `target_layer_ids`, concatenated
  ([n, len(taps) * H]), projected by `fc` and normed by `hidden_norm` into one context feature per
  committed position, which every layer projects with its own `k_proj`/`v_proj` (+ `k_norm`, RoPE at
  the position) into its keys and values. The context is never re-read: each lane keeps those
  per-layer keys/values for the last `sliding_window - 1` committed positions (all of them for a
  `full_attention` layer) and advances them by committed spans only (`commit`), so a rejected draft
  leaves no trace;
* one forward per round over the block [anchor, mask x (block_size - 1)] at positions P..P+B-1
  (P = the anchor's position), embedded with the target's embedding; the block attends to the
  context and to itself (non-causal, `is_causal` false), each query seeing keys within
  `sliding_window` positions of it (|q - k| < W);
* the grouped dynamic causal convolution (`attention_conv`, `mlp_conv`) around attention and MLP:
  one projection of the sublayer input gives two coefficient sets (input side, output side); each is
  a learned per-channel base kernel plus a per-group, content-dependent correction, over
  `conv_kernel_size` taps along the block (zero before the anchor);
* the target's output head on the final-normed mask rows gives per-slot logits; the candidate
  selector takes the top `selector_top_k` candidates per slot (unary scores = their logits) and scores
  each transition predecessor -> candidate bilinearly:
  ``score[s, c] = unary[s, c] + <pred_codebook[prev] * hidden_projection(h_s), succ_codebook[c]>``,
  walking from the verified anchor: greedy (argmax) at temperature 0, sampled at T > 0 from
  ``q = softmax(score / T)`` over the K candidates by the exponential race (``argmax(q / E)``,
  E ~ Exp(1) drawn from the lane's generator, `dflash2_graphs.draw_race_noise`), q recorded
  (scattered to the full vocabulary).

On CUDA the server switches the drafter to its static route (`use_static`,
`ignis.runtime.drafters.dflash2_graphs`): pooled lane windows, one proposal forward per (lanes,
context bucket) replayed from CUDA graphs captured at load, the commit batched over lanes; it
proposes what this eager path proposes.

The target's embedding and output head are shared (passed in; moved only if device/dtype differ),
not copied into the drafter. Proposal head: `full` (the target's lm_head, default) or `shortlist`
(a head over a subset of the vocabulary, e.g. the artifact's Q4 head over the 131,072 most frequent
tokens, with an id map back to the full vocabulary).

Checkpoint layout (the public Qwen3.8-27B DFlash2 checkpoint, `architectures: ["DFlash2DraftModel"]`,
`model_type: "qwen3"`; `DFLASH2_TENSOR_SHAPES`): `fc.weight`, `hidden_norm.weight`, `norm.weight`,
`layers.{i}.{input_layernorm,post_attention_layernorm}.weight`,
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{attention,mlp}_conv.base_kernel` [2, K, H],
`layers.{i}.{attention,mlp}_conv.kernel_projection.weight` [2 K H / G, H],
`candidate_selector.hidden_projection.weight` [R, H],
`candidate_selector.{predecessor,successor}_codebook` [V, R] (also accepted with a `.weight` suffix).
The DFlash2 hyper-parameters sit in a `dflash_config` sub-dict of config.json (block_size,
target_layer_ids, mask_token_id, conv_kernel_size, conv_group_size, selector_rank, selector_top_k);
the flat top-level spelling is accepted too.

Sources (read to learn, not copied): the z-lab reference `dflash/model.py` (DFlashDraftModel,
DFlash2DraftModel, GroupedDynamicCausalConv, CandidateSelector, `_attention_mask`); its test fixtures
`tests/fixtures/dflash2-config.json` and `dflash2-safetensors-header.json` (names and shapes); a public
BF16 DFlash2 fixture generator (explicit float32 reference of the conv, attention, selector walk);
an MLX port of DFlash2 (sliding cache of `window - 1` context rows, selector walk); HF transformers'
`DFlashTokenCandidateGenerator` and `MuseGlimmerAssistant` (the DFlash v1 design: context keys/values
cached per layer, block cropped every round).

Assumptions (where the sources disagree or are silent):

1. Block length: always the trained `block_size` (z-lab's `dflash_generate` and HF's candidate
   generator do the same); a request for k drafts takes the first k mask slots, at most
   block_size - 1. The drafts for slots 1..k therefore do not depend on k. (An MLX port runs the
   whole block too.)
2. Context window: the anchor at P sees keys at P-W+1..P, so the W-1 committed positions before it
   are all any block query can see; only they are kept (an MLX port's RotatingKVCache keeps W-1; the
   z-lab reference keeps all and masks). "Over the last 2,048" in the issue is read this way.
3. `is_causal` absent from config.json means False (DFlash2 configs always spell it; z-lab derives a
   default from the layer type, which matters only for DFlash v1 checkpoints).
4. Sampled drafting uses the lane's temperature only (z-lab's selector does; top-k/top-p of the lane
   are not applied to q). Without a selector (a DFlash v1 checkpoint: selector_rank = 0, and no
   conv when conv_kernel_size = 0) the drafts are the argmax of the head, or samples from the lane's
   full distribution (`logits_to_probs`), as z-lab does.
5. Scores are computed in float32 (the fixture generator computes the bilinear term in bf16 and then
   adds in float32); greedy ties go to the first candidate in descending-logit order.
6. `output_multiplier` and `final_logit_softcapping` (present in some DFlash2 configs, not the 27B's)
   are applied to the head's logits before the top-K, as z-lab's `compute_logits` does.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from ignis.runtime.checkpoints import DrafterSnapshot
from ignis.runtime.drafters import DRAFTERS, register_drafter
from ignis.runtime.drafters.base import BaseDrafter, CommittedSpan, DrafterError, DraftProposal, DraftRequest
from ignis.runtime.drafters.common import (
    HiddenSizeMismatchError,
    MaskTokenOutOfRangeError,
    TapLayerOutOfRangeError,
    TargetDepthMismatchError,
    VocabSizeMismatchError,
    apply_rope,
    check_names,
    read_hf_folder,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
)
from ignis.runtime.drafters.dflash2_graphs import StaticDFlash2, draw_race_noise
from ignis.runtime.errors import ConfigError, StateError, TensorShapeError
from ignis.runtime.families.attention import sdpa
from ignis.runtime.families.base import FamilyConfig
from ignis.runtime.families.moe import SwiGLUWeights, swiglu_mlp
from ignis.runtime.kernels.topk import TopKModule, topk
from ignis.runtime.linear import LinearFn, Q4Weight, WeightLoader, place_weight
from ignis.runtime.sampling import logits_to_probs

__all__ = [
    "DFlash2Config",
    "DFlash2Drafter",
    "DFlash2Network",
    "DraftHead",
    "LaneContext",
    "build_dflash2_drafter",
    "check_dflash2_fits",
    "dflash2_tensor_shapes",
    "load_dflash2_checkpoint",
    "normalize_dflash2_names",
    "transform_head_logits",
]

logger = logging.getLogger("ignis.runtime.draft_head")

SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
DraftHead = Literal["full", "shortlist"]

# keys of config.json's `dflash_config` sub-dict (each may also be spelled at the top level)
_DFLASH_KEYS = (
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
    "input_embedding_scale",
)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class DFlash2Config(FamilyConfig):
    """DFlash2 drafter hyper-parameters (HF / public-checkpoint field names), validated on construction.

    The public Qwen3.8-27B DFlash2: hidden 5120, 5 layers, 32 heads / 8 KV heads of 128, MLP 17408,
    vocab 248,320, sliding window 2048, rope_theta 1e7, block_size 8, target_layer_ids
    [5, 19, 33, 47, 61] of 64, mask_token_id 248,070, conv 2 taps in groups of 16, selector rank 256,
    top-16.

    Raises:
        ConfigError: from `__post_init__` / `from_hf` on any missing, mistyped or out-of-range field.
    """

    model_type: ClassVar[str] = "dflash2"

    hidden_size: int  # width of the residual stream (= the target's hidden size)
    num_hidden_layers: int  # drafter decoder layers (5 in the public checkpoint)
    num_attention_heads: int  # query heads per layer
    num_key_value_heads: int  # key/value heads per layer (GQA)
    head_dim: int  # width of one attention head
    intermediate_size: int  # SwiGLU MLP width
    vocab_size: int  # vocabulary of the shared head and of the selector's codebooks
    block_size: int  # rows of one drafting block: the anchor plus block_size - 1 mask slots
    target_layer_ids: tuple[int, ...]  # target decoder layers tapped, concatenated in this order
    mask_token_id: int  # token id embedded at the mask slots (a row of the target's embedding)
    layer_types: tuple[str, ...]  # per layer "sliding_attention" | "full_attention"
    sliding_window: int | None = 2048  # keys within this distance of a query are seen (|q - k| < W)
    is_causal: bool = False  # False: the block attends to itself both ways (DFlash2)
    conv_kernel_size: int = 0  # taps of the grouped dynamic conv (0: no conv, DFlash v1)
    conv_group_size: int = 16  # channels sharing one dynamic coefficient
    selector_rank: int = 0  # rank of the selector's bilinear score (0: no selector, DFlash v1)
    selector_top_k: int = 0  # candidates per mask slot the selector walks
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    rope_theta: float = 10000.0  # RoPE base (rope_parameters.rope_theta)
    max_position_embeddings: int = 262144  # longest position the drafter was set up for
    num_target_layers: int = 0  # decoder layers of the target it was trained on (0: not recorded)
    attention_bias: bool = False  # q/k/v/o projections carry biases
    hidden_act: str = "silu"  # MLP activation (only "silu")
    output_multiplier: float = 1.0  # head logits are scaled by this before the top-K
    final_logit_softcapping: float | None = None  # tanh softcap of the head logits (None: off)
    input_embedding_scale: float = 1.0  # block embeddings are scaled by this
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # unparsed keys kept

    def __post_init__(self) -> None:
        for name in ("layer_types", "target_layer_ids"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            self._require(_is_int(value) and value > 0, f"{name} must be a positive int, got {value!r}")
        self._require(
            _is_int(self.block_size) and self.block_size >= 2,
            f"block_size must be an int >= 2 (anchor + at least one mask slot), got {self.block_size!r}",
        )
        self._require(
            isinstance(self.target_layer_ids, tuple)
            and len(self.target_layer_ids) > 0
            and all(_is_int(i) and i >= 0 for i in self.target_layer_ids),
            f"target_layer_ids must be a non-empty list of layer indices >= 0, got {self.target_layer_ids!r}",
        )
        self._require(
            _is_int(self.mask_token_id) and 0 <= self.mask_token_id < self.vocab_size,
            f"mask_token_id {self.mask_token_id!r} is outside the vocabulary 0..{self.vocab_size - 1}",
        )
        self._require(
            isinstance(self.layer_types, tuple) and len(self.layer_types) == self.num_hidden_layers,
            f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
        )
        bad = sorted({t for t in self.layer_types if t not in (SLIDING_ATTENTION, FULL_ATTENTION)})
        self._require(not bad, f"layer_types holds unknown type(s) {bad}")
        if SLIDING_ATTENTION in self.layer_types:
            self._require(
                _is_int(self.sliding_window) and self.sliding_window >= 1,  # type: ignore[operator]
                f"sliding_window must be a positive int for sliding layers, got {self.sliding_window!r}",
            )
        self._require(isinstance(self.is_causal, bool), f"is_causal must be a bool, got {self.is_causal!r}")
        self._require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads {self.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {self.num_key_value_heads}",
        )
        self._require(
            self.head_dim % 2 == 0, f"head_dim must be even (rotate-half RoPE), got {self.head_dim}"
        )
        self._require(
            _is_int(self.conv_kernel_size) and self.conv_kernel_size >= 0,
            f"conv_kernel_size must be an int >= 0, got {self.conv_kernel_size!r}",
        )
        if self.conv_kernel_size:
            self._require(
                _is_int(self.conv_group_size)
                and self.conv_group_size > 0
                and self.hidden_size % self.conv_group_size == 0,
                f"conv_group_size {self.conv_group_size!r} must be a positive divisor of hidden_size "
                f"{self.hidden_size}",
            )
        self._require(
            _is_int(self.selector_rank)
            and _is_int(self.selector_top_k)
            and self.selector_rank >= 0
            and self.selector_top_k >= 0
            and (self.selector_rank == 0) == (self.selector_top_k == 0),
            f"selector_rank ({self.selector_rank!r}) and selector_top_k ({self.selector_top_k!r}) must "
            "both be positive (DFlash2) or both 0 (no selector)",
        )
        self._require(
            self.selector_top_k <= self.vocab_size,
            f"selector_top_k {self.selector_top_k} exceeds vocab_size {self.vocab_size}",
        )
        self._require(
            _is_int(self.num_target_layers) and self.num_target_layers >= 0,
            f"num_target_layers must be an int >= 0, got {self.num_target_layers!r}",
        )
        if self.num_target_layers:
            past = [i for i in self.target_layer_ids if i >= self.num_target_layers]
            self._require(
                not past, f"target_layer_ids {past} are past num_target_layers {self.num_target_layers}"
            )
        self._require(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} unsupported (silu only)")
        self._require(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        self._require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        self._require(
            self.output_multiplier > 0, f"output_multiplier must be > 0, got {self.output_multiplier}"
        )
        self._require(
            self.final_logit_softcapping is None or self.final_logit_softcapping > 0,
            f"final_logit_softcapping must be > 0 or null, got {self.final_logit_softcapping}",
        )
        self._require(
            self.input_embedding_scale > 0,
            f"input_embedding_scale must be > 0, got {self.input_embedding_scale}",
        )

    # ---- derived ----
    @property
    def num_taps(self) -> int:
        """Tapped target layers (len(target_layer_ids))."""
        return len(self.target_layer_ids)

    @property
    def max_drafts(self) -> int:
        """Most drafts one block yields: block_size - 1 mask slots."""
        return self.block_size - 1

    @property
    def has_conv(self) -> bool:
        """Whether the layers carry the grouped dynamic convolutions (DFlash2)."""
        return self.conv_kernel_size > 0

    @property
    def has_selector(self) -> bool:
        """Whether the drafter carries the candidate selector (DFlash2)."""
        return self.selector_rank > 0

    @property
    def num_conv_groups(self) -> int:
        """Dynamic coefficient groups per conv side: hidden_size / conv_group_size."""
        return self.hidden_size // self.conv_group_size

    def context_retention(self, layer: int) -> int | None:
        """Committed positions layer `layer` keeps: sliding_window - 1 (sliding), None = all (full)."""
        if self.layer_types[layer] == SLIDING_ATTENTION:
            assert self.sliding_window is not None
            return self.sliding_window - 1
        return None

    # ---- HF config.json ----
    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> DFlash2Config:
        """Parse a DFlash / DFlash2 drafter's config.json (the public checkpoint's layout).

        DFlash fields are read from the `dflash_config` sub-dict first, then the top level; RoPE from
        `rope_parameters` (or `rope_scaling`, or a top-level `rope_theta`); `layer_types` defaults to
        "sliding_attention" for every layer when `use_sliding_window` and `sliding_window` are set,
        else "full_attention"; `head_dim` defaults to hidden_size / num_attention_heads.

        Raises:
            ConfigError: a required field is missing or invalid, or the RoPE type is not "default".
        """
        if not isinstance(raw, Mapping):
            raise ConfigError(f"DFlash2Config: config.json must be an object, got {type(raw).__name__}")
        d: dict[str, Any] = {k: v for k, v in raw.items() if k != "dflash_config"}
        dfc = raw.get("dflash_config") or {}
        if not isinstance(dfc, Mapping):
            raise ConfigError("DFlash2Config: dflash_config must be an object")
        for key in _DFLASH_KEYS:
            if key in dfc:
                d[key] = dfc[key]
        if "is_causal" not in d and "causal" in dfc:
            d["is_causal"] = dfc["causal"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise ConfigError("DFlash2Config: rope_parameters must be an object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"DFlash2Config: rope_type {rope_type!r} is not supported (only 'default')")
        if "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError("DFlash2Config: partial_rotary_factor != 1 is not supported")
        hidden, heads = d.get("hidden_size"), d.get("num_attention_heads")
        if d.get("head_dim") is None and _is_int(hidden) and _is_int(heads):
            d["head_dim"] = int(hidden) // int(heads)  # type: ignore[arg-type]
        if not d.get("layer_types") and _is_int(d.get("num_hidden_layers")):
            sliding = d.get("use_sliding_window", True) and d.get("sliding_window")
            d["layer_types"] = [SLIDING_ATTENTION if sliding else FULL_ATTENTION] * d["num_hidden_layers"]
        if d.get("sliding_window") is None:
            d["sliding_window"] = None
        if d.get("final_logit_softcapping") is not None:
            d["final_logit_softcapping"] = float(d["final_logit_softcapping"])
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name in names
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and f.name not in d
        ]
        if missing:
            raise ConfigError(f"DFlash2Config: config.json lacks required field(s) {missing}")
        kwargs = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in raw.items() if k not in names}
        try:
            return cls(**kwargs, extra=extra)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"DFlash2Config: {exc}") from exc

    def to_hf(self) -> dict[str, Any]:
        """The public checkpoint's config.json layout (DFlash fields under `dflash_config`)."""
        out: dict[str, Any] = dict(self.extra)
        out.update(
            architectures=["DFlash2DraftModel"],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            num_target_layers=self.num_target_layers,
            sliding_window=self.sliding_window,
            use_sliding_window=SLIDING_ATTENTION in self.layer_types,
            is_causal=self.is_causal,
            layer_types=list(self.layer_types),
            attention_bias=self.attention_bias,
            hidden_act=self.hidden_act,
            tie_word_embeddings=False,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
        )
        dfc: dict[str, Any] = {
            "block_size": self.block_size,
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
        }
        if self.has_conv:
            dfc |= {"conv_kernel_size": self.conv_kernel_size, "conv_group_size": self.conv_group_size}
        if self.has_selector:
            dfc |= {"selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k}
        if self.output_multiplier != 1.0:
            dfc["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dfc["final_logit_softcapping"] = self.final_logit_softcapping
        if self.input_embedding_scale != 1.0:
            dfc["input_embedding_scale"] = self.input_embedding_scale
        out["dflash_config"] = dfc
        return out


# ------------------------------------------------------------------------------------ tensors

_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def dflash2_tensor_shapes(config: DFlash2Config) -> dict[str, tuple[int, ...]]:
    """{public checkpoint name: shape} of every drafter tensor (no embedding, no head: both shared)."""
    c = config
    h, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    out: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, c.num_taps * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}"
        out |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (nh * hd, h),
            f"{p}.self_attn.k_proj.weight": (nkv * hd, h),
            f"{p}.self_attn.v_proj.weight": (nkv * hd, h),
            f"{p}.self_attn.o_proj.weight": (h, nh * hd),
            f"{p}.self_attn.q_norm.weight": (hd,),
            f"{p}.self_attn.k_norm.weight": (hd,),
            f"{p}.mlp.gate_proj.weight": (c.intermediate_size, h),
            f"{p}.mlp.up_proj.weight": (c.intermediate_size, h),
            f"{p}.mlp.down_proj.weight": (h, c.intermediate_size),
        }
        if c.attention_bias:
            out |= {
                f"{p}.self_attn.q_proj.bias": (nh * hd,),
                f"{p}.self_attn.k_proj.bias": (nkv * hd,),
                f"{p}.self_attn.v_proj.bias": (nkv * hd,),
                f"{p}.self_attn.o_proj.bias": (h,),
            }
        if c.has_conv:
            for conv in ("attention_conv", "mlp_conv"):
                out[f"{p}.{conv}.base_kernel"] = (2, c.conv_kernel_size, h)
                out[f"{p}.{conv}.kernel_projection.weight"] = (2 * c.conv_kernel_size * c.num_conv_groups, h)
    if c.has_selector:
        out["candidate_selector.hidden_projection.weight"] = (c.selector_rank, h)
        for name in _CODEBOOKS:
            out[name] = (c.vocab_size, c.selector_rank)
    return out


def normalize_dflash2_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map accepted aliases to the public names: `candidate_selector.*_codebook.weight` (the
    nn.Embedding spelling of HF `key_mapping` / MLX ports) -> `candidate_selector.*_codebook`."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_codebook.weight") and name[: -len(".weight")] in _CODEBOOKS:
            name = name[: -len(".weight")]
        out[name] = t
    return out


def load_dflash2_checkpoint(folder: str | Path) -> tuple[DFlash2Config, dict[str, torch.Tensor]]:
    """Read a drafter checkpoint folder as published (config.json + model.safetensors or shards).

    Returns:
        (config, public name -> CPU tensor in its stored dtype), the set checked against
        `dflash2_tensor_shapes`.

    Raises:
        ConfigError: unreadable folder/config or invalid fields.
        TensorSetError: all missing and unexpected tensor names at once.
        TensorShapeError: a tensor of the wrong shape.
    """
    raw, tensors = read_hf_folder(folder)
    config = DFlash2Config.from_hf(raw)
    weights = normalize_dflash2_names(tensors)
    check_names(dflash2_tensor_shapes(config), weights, source=str(folder))
    return config, weights


def check_dflash2_fits(config: DFlash2Config, target: Any, *, embed_rows: int | None = None) -> None:
    """The checks a build (and a load) makes before grafting a DFlash2 drafter onto a target.

    Args:
        config: the drafter's config.
        target: the target's family config (fields `hidden_size`, `num_hidden_layers`, `vocab_size`).
        embed_rows: rows of the target's embedding table when known (defaults to target.vocab_size).

    Raises:
        HiddenSizeMismatchError: drafter hidden_size != target hidden_size.
        TapLayerOutOfRangeError: a target_layer_id >= the target's num_hidden_layers.
        TargetDepthMismatchError: num_target_layers recorded and != the target's num_hidden_layers.
        MaskTokenOutOfRangeError: mask_token_id is not a row of the target's embedding.
        VocabSizeMismatchError: the drafter's vocab_size differs from the target's.
    """
    th, tl, tv = int(target.hidden_size), int(target.num_hidden_layers), int(target.vocab_size)
    rows = tv if embed_rows is None else int(embed_rows)
    if config.hidden_size != th:
        raise HiddenSizeMismatchError(
            f"DFlash2 drafter hidden_size {config.hidden_size} != target hidden_size {th}: the drafter "
            "reads the target's hidden states and shares its embedding and head; use a drafter trained "
            "for this target"
        )
    past = [i for i in config.target_layer_ids if i >= tl]
    if past:
        raise TapLayerOutOfRangeError(
            f"DFlash2 target_layer_ids {list(config.target_layer_ids)}: {past} past the target's last "
            f"decoder layer {tl - 1}; the drafter was trained for a deeper target"
        )
    if config.num_target_layers and config.num_target_layers != tl:
        raise TargetDepthMismatchError(
            f"DFlash2 drafter was trained on a {config.num_target_layers}-layer target; this one has {tl}"
        )
    if not 0 <= config.mask_token_id < rows:
        raise MaskTokenOutOfRangeError(
            f"DFlash2 mask_token_id {config.mask_token_id} is outside the target's embedding rows "
            f"0..{rows - 1}"
        )
    if config.vocab_size != tv:
        raise VocabSizeMismatchError(
            f"DFlash2 drafter was trained for a {config.vocab_size}-token vocabulary; the target has {tv}"
        )


def check_span_taps(span: CommittedSpan, width: int, tap_layers: Sequence[int]) -> None:
    """Refuse a committed span whose taps are missing or not [len(input_token_ids), width] (width =
    num_taps * hidden_size); shared by the eager and the static commit.

    Raises:
        DrafterError: no taps (the engine did not run the target with `tap_layers`), or the wrong shape.
    """
    m = len(span.input_token_ids)
    if span.taps is None:
        raise DrafterError(
            f"dflash2: lane {span.lane_id} committed without taps; the engine must run the target with "
            f"tap_layers={list(tap_layers)}"
        )
    if span.taps.dim() != 2 or span.taps.shape != (m, width):
        raise DrafterError(
            f"dflash2: lane {span.lane_id} taps have shape {tuple(span.taps.shape)}, expected [{m}, {width}]"
        )


def check_snapshot_layer(config: DFlash2Config, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Refuse a snapshot layer whose keys and values differ in shape or are not [n, nkv, head_dim];
    shared by the eager and the static restore.

    Raises:
        CheckpointError: the shapes do not fit the config.
    """
    from ignis.runtime.checkpoints import CheckpointError

    c = config
    if keys.shape != values.shape or tuple(keys.shape[1:]) != (c.num_key_value_heads, c.head_dim):
        raise CheckpointError(
            f"dflash2: snapshot layer {layer} keys {tuple(keys.shape)} / values {tuple(values.shape)} do not "
            f"fit [n, {c.num_key_value_heads}, {c.head_dim}]"
        )


# ------------------------------------------------------------------------------------ network


_Weight = torch.Tensor | Q4Weight


@dataclass(frozen=True)
class _Conv:
    base: torch.Tensor  # [2, taps, hidden]: side 0 = sublayer input, side 1 = sublayer output
    projection: _Weight  # [2 * taps * groups, hidden]


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    q_proj: _Weight  # [nh * hd, H]
    k_proj: _Weight  # [nkv * hd, H]
    v_proj: _Weight  # [nkv * hd, H]
    o_proj: _Weight  # [H, nh * hd]
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor  # [hd]
    k_norm: torch.Tensor  # [hd]
    mlp: SwiGLUWeights
    attention_conv: _Conv | None
    mlp_conv: _Conv | None


def grouped_dynamic_conv(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int
) -> torch.Tensor:
    """The grouped dynamic causal convolution along the block.

    ``y[t] = sum_j (base[j] + dynamic[t, j, group(c)]) * x[t - j]`` per channel c, with x[t - j] = 0
    before the block's first row (the anchor has no in-block predecessor).

    Args:
        x: [N, L, H] (N blocks of L rows).
        dynamic: [N, L, taps, H / group_size] content-dependent corrections.
        base: [taps, H] learned per-channel kernel.
        group_size: channels per dynamic coefficient.

    Returns:
        [N, L, H] in x's dtype.
    """
    n, length, h = x.shape
    groups = h // group_size
    xg = x.view(n, length, groups, group_size)
    out: torch.Tensor | None = None  # the first tap's term starts the sum (no zeros + term)
    for j in range(base.shape[0]):
        shifted = xg if j == 0 else F.pad(xg[:, :-j], (0, 0, 0, 0, j, 0))
        coeff = base[j].view(1, 1, groups, group_size).to(x.dtype) + dynamic[:, :, j, :, None].to(x.dtype)
        out = coeff * shifted if out is None else out + coeff * shifted
    assert out is not None
    return out.reshape(n, length, h)


def transform_head_logits(logits: torch.Tensor, config: DFlash2Config) -> torch.Tensor:
    """Head logits (float32 [..., V]) times `output_multiplier`, then tanh-softcapped at
    `final_logit_softcapping` when set (z-lab's `compute_logits`); identity for the 27B's drafter."""
    if config.output_multiplier != 1.0:
        logits = logits * config.output_multiplier
    if config.final_logit_softcapping is not None:
        cap = config.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


class DFlash2Network:
    """The drafter's forward pass in torch (CPU or CUDA; float32 or bfloat16), weights on `device`.

    Two entry points, both batched over lanes: `context_keys_values` turns tapped target hidden states
    into every layer's context keys/values, and `block_hidden` runs the [anchor, mask...] blocks
    against given contexts. Their steps (`embed_ids`, `context_key_value`, a layer's `attention_in`
    and `layer_out` around the attention call) are public so that the static route
    (`ignis.runtime.drafters.dflash2_graphs.StaticDFlash2`) runs the same ops in the same order over
    its pooled buffers. No per-lane state lives here (see `DFlash2Drafter`).

    Args:
        config: the drafter's config.
        weights: public name -> tensor (`dflash2_tensor_shapes`; codebook aliases accepted); linear
            weights may be `Q4Weight`s when `linear` takes them.
        device, dtype: where and in which dtype to compute (selector scores are float32 always).
        linear: the linear hook ``linear(x, weight, bias)`` every linear layer runs through (an
            artifact's `LinearBackend`); `F.linear` when None.

    Raises:
        TensorSetError / TensorShapeError: the weights do not match the config.
    """

    def __init__(
        self,
        config: DFlash2Config,
        weights: Mapping[str, _Weight],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        linear: LinearFn | None = None,
    ) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be floating, got {dtype}")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.linear: LinearFn = linear or F.linear
        w = normalize_dflash2_names(weights)  # type: ignore[arg-type]
        check_names(dflash2_tensor_shapes(config), w, source="dflash2 weights")

        load = WeightLoader(w, self.device, dtype, source="dflash2 weights", linear=linear)
        get, lin, opt = load.plain, load.linear, load.optional

        c = config
        self.fc = lin("fc.weight")
        self.hidden_norm = get("hidden_norm.weight")
        self.norm = get("norm.weight")
        self.layers: list[_Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}"
            convs = {}
            for conv in ("attention_conv", "mlp_conv"):
                convs[conv] = (
                    _Conv(get(f"{p}.{conv}.base_kernel"), lin(f"{p}.{conv}.kernel_projection.weight"))
                    if c.has_conv
                    else None
                )
            self.layers.append(
                _Layer(
                    input_norm=get(f"{p}.input_layernorm.weight"),
                    post_norm=get(f"{p}.post_attention_layernorm.weight"),
                    q_proj=lin(f"{p}.self_attn.q_proj.weight"),
                    k_proj=lin(f"{p}.self_attn.k_proj.weight"),
                    v_proj=lin(f"{p}.self_attn.v_proj.weight"),
                    o_proj=lin(f"{p}.self_attn.o_proj.weight"),
                    q_bias=opt(f"{p}.self_attn.q_proj.bias"),
                    k_bias=opt(f"{p}.self_attn.k_proj.bias"),
                    v_bias=opt(f"{p}.self_attn.v_proj.bias"),
                    o_bias=opt(f"{p}.self_attn.o_proj.bias"),
                    q_norm=get(f"{p}.self_attn.q_norm.weight"),
                    k_norm=get(f"{p}.self_attn.k_norm.weight"),
                    mlp=SwiGLUWeights(
                        lin(f"{p}.mlp.gate_proj.weight"),
                        lin(f"{p}.mlp.up_proj.weight"),
                        lin(f"{p}.mlp.down_proj.weight"),
                    ),
                    attention_conv=convs["attention_conv"],
                    mlp_conv=convs["mlp_conv"],
                )
            )
        if c.has_selector:
            self.selector_projection: _Weight | None = lin("candidate_selector.hidden_projection.weight")
            self.predecessor_codebook: torch.Tensor | None = get(_CODEBOOKS[0])
            self.successor_codebook: torch.Tensor | None = get(_CODEBOOKS[1])
        else:
            self.selector_projection = self.predecessor_codebook = self.successor_codebook = None
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, self.device)

    # ---- context ----

    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """[n, num_taps * H] tapped target hidden states -> [n, H] context features (fc, hidden_norm)."""
        x = self.linear(taps.to(device=self.device, dtype=self.dtype), self.fc, None)
        return rms_norm(x, self.hidden_norm, self.config.rms_norm_eps)

    def context_keys_values(
        self, features: torch.Tensor, positions: torch.Tensor, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys (k_norm, RoPE at `positions`) and values of context features.

        Args:
            features: [n, H] from `context_features`.
            positions: int64 [n] absolute positions of the rows.

        Returns:
            (keys, values), each [n, num_key_value_heads, head_dim] in the network dtype.
        """
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)
        return self.context_key_value(features, self.layers[layer], cos, sin)

    def context_key_value(
        self, features: torch.Tensor, lw: _Layer, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's context keys and values: k_proj, k_norm, RoPE; v_proj (shared by the eager
        `context_keys_values` and the static commit of `StaticDFlash2`).

        Args:
            features: [n, H] from `context_features`.
            lw: the layer's weights (an entry of `layers`).
            cos, sin: [n, head_dim] from `rope_cos_sin` at the rows' positions.

        Returns:
            (keys, values), each [n, num_key_value_heads, head_dim] in the network dtype.
        """
        c = self.config
        nkv, hd = c.num_key_value_heads, c.head_dim
        k = rms_norm(self.linear(features, lw.k_proj, lw.k_bias).view(-1, nkv, hd), lw.k_norm, c.rms_norm_eps)
        v = self.linear(features, lw.v_proj, lw.v_bias).view(-1, nkv, hd)
        return apply_rope(k, cos, sin), v

    # ---- block ----

    def embed_block(self, anchor_ids: torch.Tensor, embed_tokens: torch.Tensor) -> torch.Tensor:
        """[N] anchors -> [N, block_size, H] embeddings of [anchor, mask x (block_size - 1)]."""
        c = self.config
        shape = (anchor_ids.shape[0], c.block_size)
        ids = torch.full(shape, c.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, 0] = anchor_ids.to(self.device)
        return self.embed_ids(ids, embed_tokens)

    def embed_ids(self, ids: torch.Tensor, embed_tokens: torch.Tensor) -> torch.Tensor:
        """int64 [N, L] token ids -> [N, L, H] embeddings in the network dtype, times
        `input_embedding_scale` when it is not 1."""
        c = self.config
        x = F.embedding(ids, embed_tokens).to(self.dtype)
        return x * c.input_embedding_scale if c.input_embedding_scale != 1.0 else x

    def _attention_mask(self, num_context: int, layer: int) -> torch.Tensor | None:
        """bool [L, num_context + L]: True where a block query sees a key (module docstring)."""
        c = self.config
        length = c.block_size
        q = torch.arange(num_context, num_context + length, device=self.device)[:, None]
        k = torch.arange(num_context + length, device=self.device)[None, :]
        visible = torch.ones(length, num_context + length, dtype=torch.bool, device=self.device)
        if c.is_causal:
            visible &= k <= q
        if c.layer_types[layer] == SLIDING_ATTENTION:
            assert c.sliding_window is not None
            visible &= (q - k).abs() < c.sliding_window
        return None if bool(visible.all()) else visible

    def block_hidden(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        contexts: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
    ) -> torch.Tensor:
        """Run the blocks through every layer and the final norm.

        Args:
            x: [N, L, H] block embeddings (L = block_size).
            positions: int64 [N] the anchor's position per block (block rows at P..P+L-1).
            contexts: per block, per layer, (keys, values) each [n_i, nkv, hd] of the committed
                positions P-n_i..P-1 (n_i may be 0).

        Returns:
            [N, L, H] final-normed hidden states (row 0 is the anchor's, rows 1.. the mask slots').
        """
        c = self.config
        n_blocks, length, _ = x.shape
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        offsets = torch.arange(length, device=self.device)
        pos = (positions.to(self.device)[:, None] + offsets[None, :]).reshape(-1)
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.dtype)
        for li, lw in enumerate(self.layers):
            q, k, v, att_dyn = self.attention_in(x, lw, cos, sin)
            out = torch.empty_like(q)
            for b in range(n_blocks):
                sl = slice(b * length, (b + 1) * length)
                ck, cv = contexts[b][li]
                keys = torch.cat([ck.to(self.dtype), k[sl]], dim=0) if ck.shape[0] else k[sl]
                values = torch.cat([cv.to(self.dtype), v[sl]], dim=0) if cv.shape[0] else v[sl]
                o = sdpa(
                    q[sl].transpose(0, 1).unsqueeze(0),
                    keys.transpose(0, 1).unsqueeze(0),
                    values.transpose(0, 1).unsqueeze(0),
                    attn_mask=self._attention_mask(ck.shape[0], li),
                    scale=hd**-0.5,
                    enable_gqa=nh != nkv,
                )
                out[sl] = o[0].transpose(0, 1)
            x = self.layer_out(x, out.reshape(n_blocks, length, nh * hd), lw, att_dyn)
        return rms_norm(x, self.norm, c.rms_norm_eps)

    def _conv_in(self, x: torch.Tensor, conv: _Conv | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A sublayer's input side of its dynamic conv: (x convolved, the dynamic coefficients
        [N, L, 2, taps, groups] for both sides); (x, None) without a conv. x: [N, L, H]."""
        if conv is None:
            return x, None
        c = self.config
        dyn = self.linear(x, conv.projection, None).view(
            x.shape[0], x.shape[1], 2, c.conv_kernel_size, c.num_conv_groups
        )
        return grouped_dynamic_conv(x, dyn[:, :, 0], conv.base[0], c.conv_group_size), dyn

    def _conv_out(self, y: torch.Tensor, conv: _Conv | None, dyn: torch.Tensor | None) -> torch.Tensor:
        """A sublayer's output side of its dynamic conv (dyn from `_conv_in`); y unchanged without one."""
        if conv is None:
            return y
        assert dyn is not None
        return grouped_dynamic_conv(y, dyn[:, :, 1], conv.base[1], self.config.conv_group_size)

    def attention_in(
        self, x: torch.Tensor, lw: _Layer, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A layer's attention prologue over block rows: input norm, the attention conv's input side,
        q/k/v projections, q_norm/k_norm, RoPE (shared by `block_hidden` and `StaticDFlash2`).

        Args:
            x: [N, L, H] the residual stream.
            lw: the layer's weights (an entry of `layers`).
            cos, sin: [N * L, head_dim] at the rows' positions (block-major).

        Returns:
            (q [N * L, nh, hd], k [N * L, nkv, hd], v [N * L, nkv, hd], the attention conv's dynamic
            coefficients for `layer_out`, None without a conv).
        """
        c = self.config
        nh, nkv, hd, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        a, att_dyn = self._conv_in(rms_norm(x, lw.input_norm, eps), lw.attention_conv)
        rows = a.reshape(x.shape[0] * x.shape[1], x.shape[2])
        linear = self.linear
        q = rms_norm(linear(rows, lw.q_proj, lw.q_bias).view(-1, nh, hd), lw.q_norm, eps)
        k = rms_norm(linear(rows, lw.k_proj, lw.k_bias).view(-1, nkv, hd), lw.k_norm, eps)
        v = linear(rows, lw.v_proj, lw.v_bias).view(-1, nkv, hd)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, att_dyn

    def layer_out(
        self, x: torch.Tensor, attn_out: torch.Tensor, lw: _Layer, att_dyn: torch.Tensor | None
    ) -> torch.Tensor:
        """A layer's rest after attention: o_proj, the attention conv's output side, the residual add,
        post norm, the MLP conv's input side, SwiGLU, its output side, the residual add.

        Args:
            x: [N, L, H] the layer's input residual stream.
            attn_out: [N, L, nh * hd] the attention output (heads concatenated).
            lw: the layer's weights.
            att_dyn: from `attention_in`.

        Returns:
            [N, L, H] the layer's output residual stream.
        """
        attn = self._conv_out(self.linear(attn_out, lw.o_proj, lw.o_bias), lw.attention_conv, att_dyn)
        x = x + attn
        m, mlp_dyn = self._conv_in(rms_norm(x, lw.post_norm, self.config.rms_norm_eps), lw.mlp_conv)
        y = self._conv_out(swiglu_mlp(m, lw.mlp, linear=self.linear), lw.mlp_conv, mlp_dyn)
        return x + y

    def head_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`transform_head_logits` with this network's config."""
        return transform_head_logits(logits, self.config)

    def selector_scores(
        self,
        hidden: torch.Tensor,
        candidate_ids: torch.Tensor,
        unary: torch.Tensor,
        previous_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Transition scores of one slot for N blocks at once.

        Args:
            hidden: [N, H] the slot's final-normed hidden state.
            candidate_ids: int64 [N, K] the slot's candidates (full-vocabulary ids).
            unary: float32 [N, K] their head logits.
            previous_ids: int64 [N] the token chosen for the previous slot (the anchor for slot 1).

        Returns:
            float32 [N, K]: unary + <pred_codebook[prev] * hidden_projection(hidden), succ_codebook[c]>.
        """
        assert self.selector_projection is not None
        assert self.predecessor_codebook is not None and self.successor_codebook is not None
        g = self.linear(hidden, self.selector_projection, None).float()  # [N, R]
        pre = self.predecessor_codebook[previous_ids].float() * g  # [N, R]
        suc = self.successor_codebook[candidate_ids].float()  # [N, K, R]
        return unary + torch.einsum("nr,nkr->nk", pre, suc)


# ------------------------------------------------------------------------------------ lanes


class _Window:
    """One layer's context keys/values of one lane: the last `retain` committed positions (None: all).

    Rows live in a buffer [capacity, nkv, hd]; appending past the capacity slides the kept rows to
    the front (at most once per `retain` rows, so the cost per position stays O(1))."""

    def __init__(
        self, retain: int | None, nkv: int, hd: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.retain = retain
        cap = 16 if retain is None else max(2 * retain, 16)
        self.keys = torch.zeros(cap, nkv, hd, device=device, dtype=dtype)
        self.values = torch.zeros(cap, nkv, hd, device=device, dtype=dtype)
        self.start = 0  # first live row in the buffer
        self.length = 0  # live rows

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        m = k.shape[0]
        if self.retain is not None and m >= self.retain:
            k, v = k[m - self.retain :], v[m - self.retain :]
            self.start, self.length, m = 0, 0, self.retain
        keep = self.length if self.retain is None else min(self.length, self.retain - m)
        drop = self.length - keep
        self.start += drop
        self.length = keep
        if self.start + self.length + m > self.keys.shape[0]:
            cap = self.keys.shape[0]
            if self.retain is None:
                cap = max(2 * cap, self.length + m)
            new_k = self.keys.new_zeros(cap, *self.keys.shape[1:])
            new_v = self.values.new_zeros(cap, *self.values.shape[1:])
            live = slice(self.start, self.start + self.length)
            new_k[: self.length] = self.keys[live]
            new_v[: self.length] = self.values[live]
            self.keys, self.values, self.start = new_k, new_v, 0
        end = self.start + self.length
        self.keys[end : end + m] = k
        self.values[end : end + m] = v
        self.length += m

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        live = slice(self.start, self.start + self.length)
        return self.keys[live], self.values[live]


@dataclass
class LaneContext:
    """A lane's DFlash2 context (read-only outside the drafter).

    Attributes:
        num_positions: committed positions the lane has advanced by (its anchor sits at this position).
        windows: per drafter layer, the kept context keys/values (`keys_values(layer)`).
    """

    num_positions: int
    windows: list[_Window]

    def keys_values(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s context (keys, values), each [n, nkv, hd], rows for positions
        num_positions - n .. num_positions - 1 (keys after k_norm and RoPE). Views: do not modify."""
        return self.windows[layer].view()

    def num_kept(self, layer: int) -> int:
        """Context positions layer `layer` currently keeps."""
        return self.windows[layer].length


class DFlash2Drafter(BaseDrafter):
    """The `dflash2` backend: the `Drafter` protocol (`ignis.runtime.drafters.base`) over `DFlash2Network`.

    Every lane drafts `draft_tokens` (not row-budgeted); the engine requests the target's outputs at
    `tap_layers` = target_layer_ids for every committed column. One `propose` runs one block per
    asking lane (all lanes in one batched forward), then the head and the selector walk per lane.

    Args:
        config: the drafter config.
        weights: public name -> tensor (see `dflash2_tensor_shapes`).
        embed_tokens: the target's embedding [V_embed, H] (shared; moved only if device/dtype differ).
        lm_head: the target's output head [V, H] (shared likewise; pass embed_tokens when tied).
        target_config: the target's family config; when given the fit checks run
            (`check_dflash2_fits`).
        draft_head: "full" (lm_head, default) or "shortlist".
        shortlist_weight: for "shortlist": [S, H] float tensor, a `Q4Weight` (kept as such when a
            `linear` hook is given, else dequantized) or a q4_g32 tensor
            (`ignis.formats.q4.Q4G32Tensor`, dequantized here).
        shortlist_token_ids: for "shortlist": int [S] full-vocabulary id of each shortlist row (unique).
        device, dtype: where and in which dtype the drafter runs.
        linear: the linear hook ``linear(x, weight, bias)`` the network and the proposal head run
            through (an artifact's `LinearBackend`; weights, lm_head and the shortlist head may then
            be `Q4Weight`s); `F.linear` when None.

    Raises:
        DrafterFitError (and subclasses): the drafter does not fit the target.
        TensorSetError / TensorShapeError: weights do not match the config.
        ConfigError: a bad draft_head or shortlist.
    """

    name = "dflash2"
    is_row_budgeted = False
    needs_hidden_states = False
    #: The compiled top-k (`ignis.runtime.kernels.topk.load_topk_module`) the selector walk uses on CUDA;
    #: None: torch, with the same tie rule (ties to the smaller id).
    topk_module: TopKModule | None = None

    def __init__(
        self,
        config: DFlash2Config,
        weights: Mapping[str, _Weight],
        *,
        embed_tokens: torch.Tensor,
        lm_head: _Weight,
        target_config: Any | None = None,
        draft_head: DraftHead = "full",
        shortlist_weight: Any | None = None,
        shortlist_token_ids: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        linear: LinearFn | None = None,
    ) -> None:
        c = config
        if embed_tokens.dim() != 2 or embed_tokens.shape[1] != c.hidden_size:
            raise HiddenSizeMismatchError(
                f"target embedding has shape {tuple(embed_tokens.shape)}; the drafter needs "
                f"[vocab, {c.hidden_size}]"
            )
        if len(lm_head.shape) != 2 or lm_head.shape[1] != c.hidden_size:
            raise HiddenSizeMismatchError(
                f"target lm_head has shape {tuple(lm_head.shape)}; the drafter needs [vocab, {c.hidden_size}]"
            )
        if target_config is not None:
            check_dflash2_fits(c, target_config, embed_rows=embed_tokens.shape[0])
        if not 0 <= c.mask_token_id < embed_tokens.shape[0]:
            raise MaskTokenOutOfRangeError(
                f"DFlash2 mask_token_id {c.mask_token_id} is outside the embedding rows "
                f"0..{embed_tokens.shape[0] - 1}"
            )
        if lm_head.shape[0] != c.vocab_size:
            raise VocabSizeMismatchError(
                f"target lm_head has {lm_head.shape[0]} rows; the drafter's vocabulary is {c.vocab_size}"
            )
        self.config = c
        self.tap_layers = tuple(c.target_layer_ids)
        self.network = DFlash2Network(c, weights, device=device, dtype=dtype, linear=linear)
        self.linear: LinearFn = self.network.linear
        self._takes_q4 = linear is not None
        self.device, self.dtype = self.network.device, dtype
        self.embed_tokens = embed_tokens.detach().to(device=self.device, dtype=dtype)
        self.vocab_size = c.vocab_size
        self.head_weight: _Weight
        if draft_head == "full":
            self.head_weight = self._head(lm_head)
            self.head_token_ids: torch.Tensor | None = None
        elif draft_head == "shortlist":
            self.head_weight, self.head_token_ids = self._shortlist(shortlist_weight, shortlist_token_ids)
        else:
            raise ConfigError(f"draft_head must be 'full' or 'shortlist', got {draft_head!r}")
        self.draft_head: DraftHead = draft_head
        self._lanes: dict[int, LaneContext] = {}
        #: the static route (`use_static`); None: the eager path
        self.static: StaticDFlash2 | None = None
        rows = self.head_weight.shape[0]
        logger.info(
            "dflash2 proposal head: %s (%s, %d tokens)",
            draft_head,
            "target lm_head" if draft_head == "full" else "shortlist head",
            rows,
        )

    def _head(self, weight: _Weight) -> _Weight:
        """A proposal head weight on the drafter's device: a `Q4Weight` stays one when the linear
        hook takes it, else it is dequantized to the drafter's dtype."""
        if isinstance(weight, Q4Weight):
            if self._takes_q4:  # placed for the hook (tiled on CUDA when a tiled function serves it)
                return place_weight(self.linear, weight.to(self.device))
            return weight.dequantize(self.dtype).to(self.device)
        return weight.detach().to(device=self.device, dtype=self.dtype)

    def _shortlist(self, weight: Any, token_ids: torch.Tensor | None) -> tuple[_Weight, torch.Tensor]:
        c = self.config
        if weight is None or token_ids is None:
            raise ConfigError("draft_head 'shortlist' needs shortlist_weight and shortlist_token_ids")
        if not isinstance(weight, torch.Tensor | Q4Weight):
            from ignis.formats.q4 import Q4G32Tensor

            if not isinstance(weight, Q4G32Tensor):
                raise ConfigError(
                    "shortlist_weight must be a torch.Tensor, a Q4Weight or a Q4G32Tensor, got "
                    f"{type(weight).__name__}"
                )
            weight = torch.from_numpy(weight.dequantize())
        ids = torch.as_tensor(token_ids).detach().to(torch.int64).reshape(-1)
        if len(weight.shape) != 2 or weight.shape[1] != c.hidden_size or weight.shape[0] != ids.numel():
            raise TensorShapeError(
                f"shortlist head weight has shape {tuple(weight.shape)}; expected "
                f"[{ids.numel()}, {c.hidden_size}] "
                "(one row per shortlist token id)"
            )
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise ConfigError(f"shortlist token ids must lie in 0..{c.vocab_size - 1}")
        if torch.unique(ids).numel() != ids.numel():
            raise ConfigError("shortlist token ids must be unique")
        return self._head(weight), ids.to(self.device)

    # ---- the static route ----

    def use_static(
        self,
        *,
        max_lanes: int,
        max_context: int | None = None,
        cuda_graphs: bool | None = None,
        **kwargs: Any,
    ) -> None:
        """Switch to the static route (`ignis.runtime.drafters.dflash2_graphs.StaticDFlash2`): lane
        windows pooled in `max_lanes` slots, proposals as one fixed-shape forward, replayed from CUDA
        graphs (on CUDA with `cuda_graphs`, None: on CUDA) that `warm_up` captures at load. Call
        before any lane starts.

        Args:
            max_lanes: lanes at once (the engine's max_lanes).
            max_context: ring rows of full-attention layers (the engine's context limit).
            kwargs: `StaticDFlash2`'s `buckets` / `widths`.

        Raises:
            StateError: a lane has started already.
            ConfigError: from `StaticDFlash2`.
        """
        if self._lanes or (self.static is not None and self.static._slot):
            raise StateError("dflash2: use_static must come before any lane starts")
        self.static = StaticDFlash2(
            self,
            max_lanes=max_lanes,
            max_context=max_context,
            cuda_graphs=self.device.type == "cuda" if cuda_graphs is None else cuda_graphs,
            **kwargs,
        )

    def warm_up(self, *, columns: Sequence[int] = (), context: int | None = None) -> int:
        """Capture, at load, the static route's graphs (`StaticDFlash2.warm_up`): every proposal width
        x the context buckets lanes holding up to `context` tokens meet (None: every bucket), and
        every commit row bucket; the server calls it through `warm_up_static`. `columns` (the verify
        width) changes nothing: a proposal always runs the whole block.

        Returns:
            graphs captured now (0 on the eager path or without CUDA graphs).

        Raises:
            ValueError: context < 1.
            StateError: a lane has started.
        """
        if context is not None and context < 1:
            raise ValueError(f"warm_up: context must be >= 1 tokens, got {context}")
        return 0 if self.static is None else self.static.warm_up(context)

    # ---- lanes ----

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        """Open an empty context for the lane (its prompt span's `commit` fills it)."""
        if self.static is not None:
            self.static.start_lane(lane_id)
            return
        c, net = self.config, self.network
        self._lanes[lane_id] = LaneContext(
            num_positions=0,
            windows=[
                _Window(c.context_retention(i), c.num_key_value_heads, c.head_dim, net.device, net.dtype)
                for i in range(c.num_hidden_layers)
            ],
        )

    def end_lane(self, lane_id: int) -> None:
        """Drop the lane's context."""
        if self.static is not None:
            self.static.end_lane(lane_id)
            return
        self._lanes.pop(lane_id, None)

    supports_checkpoints = True

    def snapshot_lane(self, lane_id: int, num_tokens: int) -> DrafterSnapshot:
        """The lane's context windows: ``layer.{i}.keys`` / ``layer.{i}.values`` [n_i, nkv, hd] (the
        last n_i <= sliding_window - 1 committed positions' keys and values, copies).

        Raises:
            StateError: unknown lane, or its context does not end at num_tokens.
        """
        if self.static is not None:
            return self.static.snapshot_lane(lane_id, num_tokens)
        lane = self._lane(lane_id)
        if lane.num_positions != num_tokens:
            raise StateError(
                f"dflash2: lane {lane_id} context ends at {lane.num_positions}, not at the checkpoint's "
                f"{num_tokens}"
            )
        tensors = {}
        for i, window in enumerate(lane.windows):
            k, v = window.view()
            tensors[f"layer.{i}.keys"], tensors[f"layer.{i}.values"] = k.clone(), v.clone()
        return DrafterSnapshot(num_tokens=int(num_tokens), tensors=tensors)

    def restore_lane(self, lane_id: int, prompt_token_ids: Sequence[int], snapshot: DrafterSnapshot) -> None:
        """Open the lane's context as `snapshot` holds it (the windows as they stood at its position).

        Raises:
            CheckpointError: the snapshot's layers or shapes do not fit this drafter.
        """
        from ignis.runtime.checkpoints import CheckpointError

        if self.static is not None:
            self.static.restore_lane(lane_id, snapshot)
            return
        c = self.config
        self.start_lane(lane_id, prompt_token_ids)
        lane = self._lanes[lane_id]
        try:
            for i, window in enumerate(lane.windows):
                k, v = snapshot.tensors[f"layer.{i}.keys"], snapshot.tensors[f"layer.{i}.values"]
                check_snapshot_layer(c, i, k, v)
                if k.shape[0]:
                    window.append(k.to(window.keys), v.to(window.values))
            extra = sorted(
                set(snapshot.tensors)
                - {f"layer.{i}.{w}" for i in range(c.num_hidden_layers) for w in ("keys", "values")}
            )
            if extra:
                raise CheckpointError(f"dflash2: snapshot holds unknown tensors {extra}")
        except KeyError as exc:
            self._lanes.pop(lane_id, None)
            raise CheckpointError(f"dflash2: snapshot lacks tensor {exc.args[0]!r}") from None
        except CheckpointError:
            self._lanes.pop(lane_id, None)
            raise
        lane.num_positions = int(snapshot.num_tokens)

    def context(self, lane_id: int) -> LaneContext:
        """The lane's context (for tests and tools; copies on the static route). Raises StateError for
        an unknown lane."""
        if self.static is not None:
            return self.static.lane_context(lane_id)
        return self._lane(lane_id)

    def _lane(self, lane_id: int) -> LaneContext:
        try:
            return self._lanes[lane_id]
        except KeyError:
            raise StateError(f"dflash2: lane {lane_id} was not started (start_lane)") from None

    def commit(self, spans: Sequence[CommittedSpan]) -> None:
        """Advance each span's lane by its committed columns: their tapped hidden states become context.

        Only the rows some layer keeps are projected (the last sliding_window - 1 of a long prompt).

        Raises:
            StateError: unknown lane, or a span that does not start where the lane's context ends.
            DrafterError: a span without taps, or taps of the wrong width / length.
        """
        if self.static is not None:
            self.static.commit(spans)
            return
        if not spans:
            return
        c, net = self.config, self.network
        retains = [c.context_retention(i) for i in range(c.num_hidden_layers)]
        need = None if any(r is None for r in retains) else max(r for r in retains if r is not None)
        width = c.num_taps * c.hidden_size
        lanes, rows, positions = [], [], []
        for s in spans:
            lane = self._lane(s.lane_id)
            if s.start != lane.num_positions:
                raise StateError(
                    f"dflash2: lane {s.lane_id} span starts at position {s.start}, its context ends at "
                    f"{lane.num_positions}"
                )
            check_span_taps(s, width, self.tap_layers)
            m = len(s.input_token_ids)
            r = m if need is None else min(m, need)
            lanes.append(lane)
            rows.append(s.taps[m - r :])
            positions.append(torch.arange(s.start + m - r, s.start + m))
        counts = [r.shape[0] for r in rows]
        features = net.context_features(torch.cat([r.to(net.device) for r in rows]))
        pos = torch.cat(positions).to(net.device)
        for li in range(c.num_hidden_layers):
            k, v = net.context_keys_values(features, pos, li)
            for lane, ks, vs in zip(lanes, k.split(counts), v.split(counts), strict=True):
                lane.windows[li].append(ks, vs)
        for lane, s in zip(lanes, spans, strict=True):
            lane.num_positions += len(s.input_token_ids)

    # ---- proposals ----

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """One block forward for all requests; per lane min(num_drafts, block_size - 1) drafts.

        Greedy lanes (temperature 0) get the selector's chain-argmax path and draft_probs None;
        sampled lanes a path drawn with their own generator and q (float32 [k, vocab]).

        Raises:
            StateError: unknown lane, or a request whose anchor position is not where the lane's
                context ends (a commit was missed).
        """
        if self.static is not None:
            return self.static.propose(requests)
        if not requests:
            return []
        c, net = self.config, self.network
        lanes = []
        for r in requests:
            lane = self._lane(r.lane_id)
            if r.position != lane.num_positions:
                raise StateError(
                    f"dflash2: lane {r.lane_id} asks to draft after position {r.position}, its context "
                    f"ends at {lane.num_positions} (a commit was missed)"
                )
            lanes.append(lane)
        ks = [max(0, min(r.num_drafts, c.max_drafts)) for r in requests]
        kmax = max(ks)
        if kmax == 0:
            return [DraftProposal(torch.empty(0, dtype=torch.int64, device=net.device)) for _ in requests]
        with torch.inference_mode():
            anchors = torch.tensor([r.anchor_token_id for r in requests], dtype=torch.long, device=net.device)
            x = net.embed_block(anchors, self.embed_tokens)
            contexts = [[lane.keys_values(li) for li in range(c.num_hidden_layers)] for lane in lanes]
            pos = torch.tensor([r.position for r in requests], dtype=torch.long)
            hidden = net.block_hidden(x, pos, contexts)[:, 1 : 1 + kmax]  # [N, kmax, H]
            logits = net.head_logits(self.linear(hidden, self.head_weight, None).float())  # [N, kmax, V or S]
            if c.has_selector:
                return self._walk(requests, ks, hidden, logits, anchors)
            return self._argmax_or_sample(requests, ks, logits)

    def _to_vocab(self, idx: torch.Tensor) -> torch.Tensor:
        """Head row indices -> full-vocabulary ids (identity for the full head)."""
        return idx if self.head_token_ids is None else self.head_token_ids[idx]

    def _scatter_q(self, q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """q [K] over candidate ids [K] -> float32 [vocab] with zeros elsewhere."""
        out = torch.zeros(self.vocab_size, dtype=torch.float32, device=q.device)
        return out.scatter_(0, ids.to(q.device), q.float())

    def _walk(
        self,
        requests: Sequence[DraftRequest],
        ks: list[int],
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchors: torch.Tensor,
    ) -> list[DraftProposal]:
        net = self.network
        top_k = min(self.config.selector_top_k, logits.shape[-1])
        # [N, kmax, K], descending, ties to the smaller id; the compiled kernel when one is attached
        unary, idx = topk(logits, top_k, module=self.topk_module)
        cand = self._to_vocab(idx)
        prev = anchors.clone()
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # sampled lanes: Exp(1) noise per slot and candidate, drawn up front (the exponential race,
        # `dflash2_graphs.draw_race_noise`: the static route draws the same)
        noise = {
            i: draw_race_noise(r.generator, ks[i], top_k).to(logits.device)
            for i, r in enumerate(requests)
            if ks[i] and not r.params.is_greedy
        }
        for s in range(max(ks)):
            scores = net.selector_scores(hidden[:, s], cand[:, s], unary[:, s], prev)  # [N, K]
            choice = scores.argmax(dim=-1)
            for i, r in enumerate(requests):
                if s >= ks[i] or r.params.is_greedy:
                    continue
                q = torch.softmax(scores[i] / r.params.temperature, dim=-1)
                choice[i] = (q / noise[i][s]).argmax()
                probs[i].append(self._scatter_q(q, cand[i, s]))
            prev = cand[:, s].gather(1, choice[:, None])[:, 0]
            for i in range(len(requests)):
                if s < ks[i]:
                    drafts[i].append(int(prev[i]))
        return self._proposals(drafts, probs)

    def _argmax_or_sample(
        self, requests: Sequence[DraftRequest], ks: list[int], logits: torch.Tensor
    ) -> list[DraftProposal]:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for i, r in enumerate(requests):
            for s in range(ks[i]):
                row = logits[i, s]
                if r.params.is_greedy:
                    drafts[i].append(int(self._to_vocab(row.argmax())))
                    continue
                q = logits_to_probs(row, r.params)
                j = int(torch.multinomial(q.to(r.generator.device), 1, generator=r.generator).item())
                ids = self._to_vocab(torch.arange(row.numel(), device=row.device))
                drafts[i].append(int(ids[j]))
                probs[i].append(self._scatter_q(q, ids))
        return self._proposals(drafts, probs)

    def _proposals(self, drafts: list[list[int]], probs: list[list[torch.Tensor]]) -> list[DraftProposal]:
        dev = self.device
        return [
            DraftProposal(
                torch.tensor(d, dtype=torch.int64, device=dev),
                torch.stack(p) if p else None,
            )
            for d, p in zip(drafts, probs, strict=True)
        ]


# ------------------------------------------------------------------------------------ factory


def _target_head(target_config: Any, target_weights: Mapping[str, Any]) -> tuple[torch.Tensor, _Weight]:
    """(embed_tokens, lm_head) from a target's canonical weights (`model.embed_tokens.weight`,
    `lm_head.weight`, tied when the config says so or lm_head is absent)."""
    try:
        embed = target_weights["model.embed_tokens.weight"]
    except KeyError:
        raise ConfigError("target weights lack model.embed_tokens.weight (the drafter shares it)") from None
    tied = getattr(target_config, "tie_word_embeddings", False) or "lm_head.weight" not in target_weights
    return embed, embed if tied else target_weights["lm_head.weight"]


def build_dflash2_drafter(
    *,
    target_config: Any,
    target_weights: Mapping[str, Any],
    checkpoint: str | Path | None = None,
    config: DFlash2Config | None = None,
    weights: Mapping[str, Any] | None = None,
    draft_head: DraftHead = "full",
    shortlist_weight: Any | None = None,
    shortlist_token_ids: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    linear: LinearFn | None = None,
    static: bool | None = None,
    max_lanes: int | None = None,
    max_context: int | None = None,
    cuda_graphs: bool | None = None,
) -> DFlash2Drafter:
    """The registered `dflash2` factory: a drafter for a target from a checkpoint folder or tensors.

    Args:
        target_config: the target's family config.
        target_weights: the target's canonical tensors (the embedding and head are taken from here).
        checkpoint: a drafter folder as published; or give `config` and `weights`.
        draft_head, shortlist_weight, shortlist_token_ids, device, dtype, linear: see `DFlash2Drafter`.
        static: the static route (`DFlash2Drafter.use_static`; None: on CUDA) with `max_lanes` lane
            slots (None: 8), full-attention rings of `max_context` rows (the engine's context limit)
            and `cuda_graphs` (None: on CUDA); its graphs are captured by `warm_up`. False: eager.

    Raises:
        ConfigError: neither a checkpoint nor config+weights; plus everything `DFlash2Drafter` raises.
    """
    if checkpoint is not None:
        config, weights = load_dflash2_checkpoint(checkpoint)
    if config is None or weights is None:
        raise ConfigError("build_dflash2_drafter needs a checkpoint folder or config and weights")
    embed, head = _target_head(target_config, target_weights)
    drafter = DFlash2Drafter(
        config,
        weights,
        embed_tokens=embed,
        lm_head=head,
        target_config=target_config,
        draft_head=draft_head,
        shortlist_weight=shortlist_weight,
        shortlist_token_ids=shortlist_token_ids,
        device=device,
        dtype=dtype,
        linear=linear,
    )
    if static if static is not None else torch.device(device).type == "cuda":
        drafter.use_static(
            max_lanes=8 if max_lanes is None else max_lanes, max_context=max_context, cuda_graphs=cuda_graphs
        )
    return drafter


if "dflash2" not in DRAFTERS:
    register_drafter("dflash2", build_dflash2_drafter)
