"""llama and qwen2 families: configs, tensor tables and the torch executor.

Both are pre-norm decoder-only transformers (RMSNorm, rotary position embeddings, grouped-query
attention, SwiGLU MLP); they differ only in which projections carry biases (qwen2: q/k/v always;
llama: all four attention projections when `attention_bias`, the MLP when `mlp_bias`). The maths
follows HF transformers' `modeling_llama.py` / `modeling_qwen2.py` (5.24), which is the oracle the
tests hold this executor to: RMSNorm in float32 then cast back, RoPE tables computed in float32 from
`inv_freq` (`modeling_rope_utils.py`, incl. the `linear` and `llama3` rope types), attention scale
head_dim ** -0.5, softmax in float32.

Executor layout (DESIGN.md, "The verify round"): one `forward` takes every lane's columns, runs the
embedding, norms and all linear layers on the R rows concatenated (so a compiled width-R module can
replace them later), and runs attention per lane against that lane's KV cache with a causal mask
over its committed prefix plus its new columns. New keys/values are written into the cache at
positions committed..committed+n-1; `commit` moves each lane's committed length forward by
`num_keep`, which logically trims the rejected columns (they are overwritten by the next forward).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ignis.runtime.errors import StateError
from ignis.runtime.families.attention import sdpa
from ignis.runtime.families.base import (
    Family,
    FamilyConfig,
    ForwardOutput,
    check_tensor_set,
    register_family,
)
from ignis.runtime.linear import LinearFn, Q4Weight, cat_rows, place_weight, to_device

_ROPE_TYPES = ("default", "linear", "llama3")


def _normalize_rope(raw: Mapping[str, Any], *, default_theta: float) -> dict[str, Any]:
    """HF v5's `rope_parameters` from either a v5 config.json or a v4 one (`rope_theta` + `rope_scaling`).

    Mirrors `PreTrainedConfig.standardize_rope_params`: `type` is an old spelling of `rope_type`;
    llama3 without `original_max_position_embeddings` takes `max_position_embeddings`.
    """
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    params = dict(params)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    params["rope_theta"] = float(default_theta if theta is None else theta)
    if params["rope_type"] == "llama3" and "max_position_embeddings" in raw:
        params.setdefault("original_max_position_embeddings", raw["max_position_embeddings"])
    return params


@dataclass(frozen=True)
class _DecoderConfig(FamilyConfig):
    """Fields shared by llama and qwen2 (HF names; see the subclasses for defaults that differ)."""

    vocab_size: int  # rows of the embedding and of the LM head
    hidden_size: int  # model width H
    intermediate_size: int  # MLP width I (gate/up output)
    num_hidden_layers: int  # decoder layers L
    num_attention_heads: int  # query heads
    num_key_value_heads: int | None = None  # KV heads (GQA); None means num_attention_heads
    head_dim: int | None = None  # per-head width; None means hidden_size // num_attention_heads
    hidden_act: str = "silu"  # MLP activation (only "silu" is supported)
    max_position_embeddings: int = 2048  # longest sequence a lane may reach
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_parameters: dict[str, Any] | None = None  # {"rope_type", "rope_theta", ...}; see _normalize_rope
    tie_word_embeddings: bool = False  # LM head reuses model.embed_tokens.weight
    bos_token_id: int | None = None  # beginning-of-sequence id (informational)
    eos_token_id: int | list[int] | None = None  # end-of-sequence id(s) generation stops on

    default_theta: ClassVar[float] = 10000.0

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> FamilyConfig:
        """Build from an HF `config.json` dict (v4 `rope_theta`/`rope_scaling` or v5 `rope_parameters`).

        Raises:
            ConfigError: a required field is missing or a value is invalid.
        """
        raw = dict(raw)
        raw["rope_parameters"] = _normalize_rope(raw, default_theta=cls.default_theta)
        return super().from_hf(raw)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.rope_parameters is None or "rope_theta" not in self.rope_parameters:
            rp = dict(self.rope_parameters or {})
            rp.setdefault("rope_type", "default")
            rp.setdefault("rope_theta", self.default_theta)
            object.__setattr__(self, "rope_parameters", rp)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            self._require(
                isinstance(value, int) and value > 0, f"{name} must be a positive int, got {value!r}"
            )
        if self.head_dim is None:
            self._require(
                self.hidden_size % self.num_attention_heads == 0,
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}; set head_dim",
            )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self._require(
            isinstance(self.head_dim, int) and self.head_dim > 0 and self.head_dim % 2 == 0,
            f"head_dim must be a positive even int, got {self.head_dim!r}",
        )
        kv = self.num_key_value_heads
        self._require(
            isinstance(kv, int) and kv > 0 and self.num_attention_heads % kv == 0,
            f"num_key_value_heads {kv!r} must divide num_attention_heads {self.num_attention_heads}",
        )
        self._require(
            self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported (only 'silu')"
        )
        self._require(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        rp = self.rope_parameters
        assert rp is not None
        rope_type = rp.get("rope_type", "default")
        self._require(
            rope_type in _ROPE_TYPES,
            f"rope_type {rope_type!r} is not supported; supported: {list(_ROPE_TYPES)}",
        )
        self._require(float(rp["rope_theta"]) > 0, f"rope_theta must be > 0, got {rp['rope_theta']}")
        self._require(
            rp.get("partial_rotary_factor", 1.0) == 1.0,
            "partial_rotary_factor != 1 is not supported for this family",
        )
        if rope_type == "linear":
            self._require(float(rp.get("factor", 0)) > 0, "rope_type 'linear' needs a positive 'factor'")
        if rope_type == "llama3":
            missing = [
                k
                for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                if k not in rp
            ]
            self._require(not missing, f"rope_type 'llama3' lacks {missing}")
            self._require(
                float(rp["high_freq_factor"]) > float(rp["low_freq_factor"]),
                "llama3 rope: high_freq_factor must exceed low_freq_factor",
            )

    # Which projections carry a bias (family-specific).
    @property
    def has_qkv_bias(self) -> bool:
        """q/k/v projections have biases."""
        raise NotImplementedError

    @property
    def has_o_bias(self) -> bool:
        """o_proj has a bias."""
        raise NotImplementedError

    @property
    def has_mlp_bias(self) -> bool:
        """gate/up/down projections have biases."""
        raise NotImplementedError

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """`eos_token_id` as a tuple (empty when unset)."""
        e = self.eos_token_id
        if e is None:
            return ()
        return (e,) if isinstance(e, int) else tuple(e)


@dataclass(frozen=True)
class LlamaConfig(_DecoderConfig):
    """HF `LlamaConfig` (model_type "llama"): SmolLM2, Llama 2/3.x, Mistral-style checkpoints."""

    model_type: ClassVar[str] = "llama"

    attention_bias: bool = False  # q/k/v/o projections have biases
    mlp_bias: bool = False  # gate/up/down projections have biases

    @property
    def has_qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def has_o_bias(self) -> bool:
        return self.attention_bias

    @property
    def has_mlp_bias(self) -> bool:
        return self.mlp_bias


@dataclass(frozen=True)
class Qwen2Config(_DecoderConfig):
    """HF `Qwen2Config` (model_type "qwen2"): Qwen2 / Qwen2.5 (-Coder) checkpoints.

    q/k/v projections always carry biases, o_proj and the MLP never do. Sliding-window attention
    (`use_sliding_window`) is not supported and refused.
    """

    model_type: ClassVar[str] = "qwen2"

    max_position_embeddings: int = 32768  # longest sequence a lane may reach
    use_sliding_window: bool = False  # sliding-window attention on upper layers (refused when true)
    sliding_window: int | None = None  # window size when use_sliding_window (unused)
    max_window_layers: int | None = None  # first layer index that would use the window (unused)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._require(
            not self.use_sliding_window,
            "use_sliding_window=True is not supported (Qwen2.5 checkpoints ship it false)",
        )

    @property
    def has_qkv_bias(self) -> bool:
        return True

    @property
    def has_o_bias(self) -> bool:
        return False

    @property
    def has_mlp_bias(self) -> bool:
        return False


def tensor_shapes(config: _DecoderConfig) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of every tensor the executor uses (lm_head only when untied)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    assert config.head_dim is not None and config.num_key_value_heads is not None
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (q_out, h)
        out[p + "self_attn.k_proj.weight"] = (kv_out, h)
        out[p + "self_attn.v_proj.weight"] = (kv_out, h)
        out[p + "self_attn.o_proj.weight"] = (h, q_out)
        if config.has_qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (q_out,)
            out[p + "self_attn.k_proj.bias"] = (kv_out,)
            out[p + "self_attn.v_proj.bias"] = (kv_out,)
        if config.has_o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (i, h)
        out[p + "mlp.up_proj.weight"] = (i, h)
        out[p + "mlp.down_proj.weight"] = (h, i)
        if config.has_mlp_bias:
            out[p + "mlp.gate_proj.bias"] = (i,)
            out[p + "mlp.up_proj.bias"] = (i,)
            out[p + "mlp.down_proj.bias"] = (h,)
    return out


def map_hf_name(name: str) -> str | None:
    """HF checkpoint name -> canonical name; drops the rotary `inv_freq` buffers old checkpoints saved."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    return name


def rope_inv_freq(config: _DecoderConfig) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies, as HF's `ROPE_INIT_FUNCTIONS` compute them.

    Source: transformers `modeling_rope_utils.py` (`compute_default_rope_parameters`,
    `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`, the latter after Meta's
    Llama 3.1 reference). The attention scaling factor of these three types is 1.
    """
    rp = config.rope_parameters
    assert rp is not None and config.head_dim is not None
    dim = config.head_dim
    base = float(rp["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    rope_type = rp.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(rp["factor"])
    elif rope_type == "llama3":
        factor = float(rp["factor"])
        low, high = float(rp["low_freq_factor"]), float(rp["high_freq_factor"])
        old_len = float(rp["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq


class LlamaLaneState:
    """One lane's KV cache: keys and values of every layer in one tensor.

    Attributes:
        kv: [num_hidden_layers, 2, num_key_value_heads, capacity, head_dim] in the executor's dtype;
            positions >= num_tokens (+ pending columns) hold stale data.
    """

    __slots__ = ("_num_tokens", "_owner", "_pending", "kv")

    def __init__(self, owner: LlamaExecutor, kv: torch.Tensor) -> None:
        self._owner = owner
        self.kv = kv
        self._num_tokens = 0
        self._pending: tuple[int, bool] | None = None  # (columns of the uncommitted forward, record)

    @property
    def num_tokens(self) -> int:
        """Committed tokens whose keys/values the cache holds."""
        return self._num_tokens

    @property
    def capacity(self) -> int:
        """Positions the cache can hold before it grows."""
        return int(self.kv.shape[3])

    @property
    def num_pending(self) -> int:
        """Columns of the last forward not yet committed (0 when none)."""
        return 0 if self._pending is None else self._pending[0]


@dataclass
class _Layer:
    w_qkv: torch.Tensor | Q4Weight  # [(nh + 2 nkv) * hd, H]
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor | Q4Weight  # [H, nh * hd]
    b_o: torch.Tensor | None
    w_gate_up: torch.Tensor | Q4Weight  # [2 I, H]
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor | Q4Weight  # [H, I]
    b_down: torch.Tensor | None
    norm_in: torch.Tensor  # [H]
    norm_post: torch.Tensor  # [H]


class LlamaExecutor:
    """Torch executor of the llama / qwen2 families (CPU or CUDA, float32 or bfloat16).

    Implements the `Executor` protocol of `ignis.runtime.families.base`: `new_lane`, `forward` over
    several lanes' columns, `commit` of the first n columns of each lane.

    Args:
        config: a `LlamaConfig` or `Qwen2Config`.
        weights: HF tensor name -> tensor, exactly the set `tensor_shapes(config)` names (any float
            dtype, any device; converted to `dtype` on `device`; q/k/v and gate/up are fused).
            Linear weights may be `Q4Weight`s (kept as such, for the `linear` hook).
        device: torch device for weights, caches and activations.
        dtype: torch.float32 or torch.bfloat16 (activations, weights, KV cache); logits are float32.
        linear: the linear hook ``linear(x, weight, bias)`` every projection and the LM head run
            through (`ignis.runtime.linear.LinearBackend` for an artifact); `F.linear` when None.

    Raises:
        TensorSetError / TensorShapeError: the weights do not match the config.
        ConfigError: unsupported dtype.
    """

    def __init__(
        self,
        config: _DecoderConfig,
        weights: Mapping[str, torch.Tensor],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        linear: LinearFn | None = None,
    ) -> None:
        config._require(
            dtype in (torch.float32, torch.bfloat16, torch.float16),
            f"executor dtype {dtype} is not supported (float32, bfloat16, float16)",
        )
        check_tensor_set(config, {k: tuple(t.shape) for k, t in weights.items()}, source="weights")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.linear: LinearFn = linear or F.linear
        assert config.head_dim is not None and config.num_key_value_heads is not None
        self._nh = config.num_attention_heads
        self._nkv = config.num_key_value_heads
        self._hd = config.head_dim
        self._scale = self._hd**-0.5

        def get(name: str) -> torch.Tensor:
            t = weights[name]
            if isinstance(t, Q4Weight):
                raise TypeError(f"{name} is q4_g32; only linear weights may be Q4Weight")
            return t.to(device=self.device, dtype=dtype)

        def lin(name: str) -> torch.Tensor | Q4Weight:
            return place_weight(self.linear, to_device(weights[name], self.device, dtype).contiguous())

        def cat(*names: str) -> torch.Tensor | Q4Weight:
            # fuse in the stored row-major layout (a member the caller tiled is untiled: tiled parts
            # fuse only at 16-row multiples), then place the fused weight for the hook (tiled on CUDA
            # when a tiled function serves its shape)
            parts = [to_device(weights[n], self.device, dtype) for n in names]
            parts = [p.to_row_major() if isinstance(p, Q4Weight) else p for p in parts]
            return place_weight(self.linear, cat_rows(parts).contiguous())

        def cat_bias(*names: str) -> torch.Tensor:
            return torch.cat([get(n) for n in names], 0).contiguous()

        self.embed = get("model.embed_tokens.weight").contiguous()
        self.lm_head: torch.Tensor | Q4Weight = (
            self.embed if config.tie_word_embeddings else lin("lm_head.weight")
        )
        self.norm = get("model.norm.weight")
        self.layers: list[_Layer] = []
        for n in range(config.num_hidden_layers):
            p = f"model.layers.{n}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(
                _Layer(
                    w_qkv=cat(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                    b_qkv=cat_bias(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
                    if config.has_qkv_bias
                    else None,
                    w_o=lin(a + "o_proj.weight"),
                    b_o=get(a + "o_proj.bias") if config.has_o_bias else None,
                    w_gate_up=cat(m + "gate_proj.weight", m + "up_proj.weight"),
                    b_gate_up=cat_bias(m + "gate_proj.bias", m + "up_proj.bias")
                    if config.has_mlp_bias
                    else None,
                    w_down=lin(m + "down_proj.weight"),
                    b_down=get(m + "down_proj.bias") if config.has_mlp_bias else None,
                    norm_in=get(p + "input_layernorm.weight"),
                    norm_post=get(p + "post_attention_layernorm.weight"),
                )
            )
        self._inv_freq = rope_inv_freq(config).to(self.device)

    # ---- lanes -------------------------------------------------------------------------------

    def new_lane(self, capacity: int = 0) -> LlamaLaneState:
        """A fresh lane with an empty KV cache preallocated for `capacity` positions (grows on demand)."""
        cap = min(max(int(capacity), 0), self.config.max_position_embeddings)
        return LlamaLaneState(self, self._alloc_kv(cap))

    def _alloc_kv(self, capacity: int) -> torch.Tensor:
        c = self.config
        return torch.empty(
            (c.num_hidden_layers, 2, self._nkv, capacity, self._hd), device=self.device, dtype=self.dtype
        )

    def _ensure_capacity(self, state: LlamaLaneState, needed: int) -> None:
        if needed <= state.capacity:
            return
        new_cap = min(max(needed, 2 * state.capacity, 64), self.config.max_position_embeddings)
        new_cap = max(new_cap, needed)
        kv = self._alloc_kv(new_cap)
        used = state.num_tokens
        if used:
            kv[:, :, :, :used].copy_(state.kv[:, :, :, :used])
        state.kv = kv

    # ---- numerics ----------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # HF LlamaRMSNorm: float32 statistics, cast back before the weight multiply.
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * h.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # HF LlamaRotaryEmbedding.forward: float32 angles, cos/sin cast to the activation dtype.
        freqs = positions[:, None].float() * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    # ---- protocol ----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self,
        states: Sequence[LlamaLaneState],
        columns: Sequence[torch.Tensor],
        *,
        logits: str = "all",
        record: bool = True,
        output_hidden_states: bool = False,
        tap_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """Run every lane's next columns through the model; leaves them pending until `commit`.

        Args:
            states: lanes of this executor, each without a pending forward, no lane twice.
            columns: columns[i] int64 [n_i] (n_i >= 1), lane i's next token ids.
            logits: "all" -> float32 [n_i, vocab] per lane; "last" -> float32 [1, vocab].
            record: False promises the forward is committed whole or not at all (num_keep in {0, n_i}).
            output_hidden_states: also return per lane [n_i, H] (last layer output before the norm).
            tap_layers: also return per lane [n_i, len(tap_layers) * H], the outputs of these decoder
                layers (0-based) concatenated in request order.

        Raises:
            StateError: mismatched lists, a foreign/duplicate/pending lane, empty or out-of-vocabulary
                columns, or a lane that would pass `max_position_embeddings`.
        """
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        if len(states) != len(columns) or not states:
            raise StateError(
                f"forward needs one column tensor per lane, got {len(states)} lanes and "
                f"{len(columns)} column tensors"
            )
        cfg = self.config
        taps = list(tap_layers)
        for t in taps:
            if not 0 <= t < cfg.num_hidden_layers:
                raise StateError(f"tap layer {t} outside 0..{cfg.num_hidden_layers - 1}")
        seen: set[int] = set()
        counts: list[int] = []
        for i, (s, col) in enumerate(zip(states, columns, strict=True)):
            if getattr(s, "_owner", None) is not self:
                raise StateError(f"lane {i} was not created by this executor")
            if id(s) in seen:
                raise StateError(f"lane {i} appears twice in one forward")
            seen.add(id(s))
            if s._pending is not None:
                raise StateError(f"lane {i} has {s._pending[0]} uncommitted columns; commit before forward")
            if col.dim() != 1 or col.numel() == 0:
                raise StateError(
                    f"lane {i}: columns must be a non-empty 1-D tensor, got shape {tuple(col.shape)}"
                )
            n = int(col.numel())
            if s.num_tokens + n > cfg.max_position_embeddings:
                raise StateError(
                    f"lane {i}: {s.num_tokens} + {n} tokens exceed max_position_embeddings "
                    f"{cfg.max_position_embeddings}"
                )
            if col.device.type == "cpu":
                lo, hi = int(col.min()), int(col.max())
                if lo < 0 or hi >= cfg.vocab_size:
                    raise StateError(
                        f"lane {i}: token id {lo if lo < 0 else hi} outside 0..{cfg.vocab_size - 1}"
                    )
            counts.append(n)

        starts = [s.num_tokens for s in states]
        for s, p, n in zip(states, starts, counts, strict=True):
            self._ensure_capacity(s, p + n)
        ids = torch.cat([c.reshape(-1) for c in columns]).to(device=self.device, dtype=torch.long)
        positions = torch.cat(
            [torch.arange(p, p + n, dtype=torch.long) for p, n in zip(starts, counts, strict=True)]
        )
        positions = positions.to(self.device, non_blocking=True)
        cos, sin = self._rope(positions)  # [R, 1, hd]
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        masks = [self._causal_mask(p, n) for p, n in zip(starts, counts, strict=True)]

        nh, nkv, hd = self._nh, self._nkv, self._hd
        linear = self.linear
        x = F.embedding(ids, self.embed)  # [R, H]
        tapped: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.norm_in)
            qkv = linear(h, layer.w_qkv, layer.b_qkv)  # [R, (nh + 2 nkv) hd]
            q = qkv[:, : nh * hd].view(-1, nh, hd)
            k = qkv[:, nh * hd : (nh + nkv) * hd].view(-1, nkv, hd)
            v = qkv[:, (nh + nkv) * hd :].view(-1, nkv, hd)
            q = self._apply_rope(q, cos, sin)
            k = self._apply_rope(k, cos, sin)
            attn = torch.empty((x.shape[0], nh * hd), device=self.device, dtype=self.dtype)
            for lane, s in enumerate(states):
                a, b = offsets[lane], offsets[lane + 1]
                p, n = starts[lane], counts[lane]
                cache = s.kv[li]  # [2, nkv, cap, hd]
                cache[0, :, p : p + n].copy_(k[a:b].transpose(0, 1))
                cache[1, :, p : p + n].copy_(v[a:b].transpose(0, 1))
                out = sdpa(
                    q[a:b].transpose(0, 1).unsqueeze(0),  # [1, nh, n, hd]
                    cache[0, :, : p + n].unsqueeze(0),  # [1, nkv, p + n, hd]
                    cache[1, :, : p + n].unsqueeze(0),
                    attn_mask=masks[lane],
                    scale=self._scale,
                    enable_gqa=nh != nkv,
                )
                attn[a:b] = out[0].transpose(0, 1).reshape(n, nh * hd)
            x = x + linear(attn, layer.w_o, layer.b_o)
            h = self._rms_norm(x, layer.norm_post)
            gu = linear(h, layer.w_gate_up, layer.b_gate_up)
            gate, up = gu.chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.w_down, layer.b_down)
            if li in taps:
                tapped[li] = x

        if logits == "last":
            rows = torch.tensor([offsets[i + 1] - 1 for i in range(len(states))], device=self.device)
            head_in = x.index_select(0, rows)
            out_logits = linear(self._rms_norm(head_in, self.norm), self.lm_head, None).float()
            per_lane = [out_logits[i : i + 1] for i in range(len(states))]
        else:
            out_logits = linear(self._rms_norm(x, self.norm), self.lm_head, None).float()
            per_lane = [out_logits[offsets[i] : offsets[i + 1]] for i in range(len(states))]

        for s, n in zip(states, counts, strict=True):
            s._pending = (n, record)

        hidden = (
            [x[offsets[i] : offsets[i + 1]] for i in range(len(states))] if output_hidden_states else None
        )
        tap_out = None
        if taps:
            cat_taps = torch.cat([tapped[t] for t in taps], dim=-1)
            tap_out = [cat_taps[offsets[i] : offsets[i + 1]] for i in range(len(states))]
        return ForwardOutput(logits=per_lane, hidden_states=hidden, taps=tap_out)

    def _causal_mask(self, past: int, n: int) -> torch.Tensor | None:
        """bool [n, past + n]: column j of the new block sees cache positions 0..past + j."""
        if n == 1:
            return None
        rows = torch.arange(n, device=self.device)[:, None]
        cols = torch.arange(past + n, device=self.device)[None, :]
        return cols <= rows + past

    def commit(self, states: Sequence[LlamaLaneState], num_keep: Sequence[int]) -> None:
        """Keep the first num_keep[i] columns of lane i's pending forward (0 discards them all).

        Raises:
            StateError: mismatched lists, a lane without a pending forward, num_keep outside 0..n_i,
                or a partial commit of a forward run with `record=False`. Nothing is changed then.
        """
        if len(states) != len(num_keep):
            raise StateError(f"commit got {len(states)} lanes and {len(num_keep)} num_keep values")
        for i, (s, k) in enumerate(zip(states, num_keep, strict=True)):
            if getattr(s, "_owner", None) is not self:
                raise StateError(f"lane {i} was not created by this executor")
            if s._pending is None:
                raise StateError(f"lane {i} has no pending forward to commit")
            n, record = s._pending
            if not 0 <= int(k) <= n:
                raise StateError(f"lane {i}: num_keep {k} outside 0..{n}")
            if not record and int(k) not in (0, n):
                raise StateError(f"lane {i}: forward ran with record=False; commit all {n} columns or none")
        for s, k in zip(states, num_keep, strict=True):
            s._num_tokens += int(k)
            s._pending = None

    def rewind(self, states: Sequence[LlamaLaneState], num_tokens: Sequence[int]) -> None:
        """Drop the committed tokens of lane i past its first num_tokens[i] (a draft model's rejected drafts).

        A lane's keys and values sit at positions 0 .. num_tokens - 1 of its cache and every forward
        writes its columns from num_tokens on before attending, so lowering the committed count is an
        exact rewind: afterwards the lane equals one fed its first num_tokens[i] tokens alone (the
        stale positions past it are overwritten by the next forward). All lanes are checked first.

        Raises:
            StateError: mismatched lists, a lane of another executor, a lane with a pending forward,
                or num_tokens[i] outside 0..lane.num_tokens. Nothing is changed then.
        """
        if len(states) != len(num_tokens):
            raise StateError(f"rewind got {len(states)} lanes and {len(num_tokens)} counts")
        for i, (s, n) in enumerate(zip(states, num_tokens, strict=True)):
            if getattr(s, "_owner", None) is not self:
                raise StateError(f"lane {i} was not created by this executor")
            if s._pending is not None:
                raise StateError(
                    f"lane {i} has a pending forward ({s._pending[0]} columns); commit before rewind"
                )
            if not 0 <= int(n) <= s._num_tokens:
                raise StateError(f"lane {i}: rewind to {n} outside 0..{s._num_tokens}")
        for s, n in zip(states, num_tokens, strict=True):
            s._num_tokens = int(n)


def _make_executor(
    config: _DecoderConfig,
    weights: Mapping[str, torch.Tensor],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    linear: LinearFn | None = None,
) -> LlamaExecutor:
    return LlamaExecutor(config, weights, device=device, dtype=dtype, linear=linear)


#: `LlamaExecutor`'s fusions (q|k|v and gate|up of every layer), as `Family.fused_linears`.
FUSED_LINEARS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("self_attn", ("q_proj", "k_proj", "v_proj")),
    ("mlp", ("gate_proj", "up_proj")),
)

LLAMA = register_family(
    Family("llama", LlamaConfig, tensor_shapes, _make_executor, map_hf_name, fused_linears=FUSED_LINEARS)
)
QWEN2 = register_family(
    Family("qwen2", Qwen2Config, tensor_shapes, _make_executor, map_hf_name, fused_linears=FUSED_LINEARS)
)

__all__ = [
    "FUSED_LINEARS",
    "LLAMA",
    "QWEN2",
    "LlamaConfig",
    "LlamaExecutor",
    "LlamaLaneState",
    "Qwen2Config",
    "map_hf_name",
    "rope_inv_freq",
    "tensor_shapes",
]
