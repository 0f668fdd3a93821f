"""MTP: the multi-token-prediction head of the hybrid families, as a drafter (Flash-Next; issue 4).

The head (`mtp.*` tensors, `ignis.runtime.families.qwen3_5.mtp_tensor_shapes`), for the row at
position t of a lane::

    x_t   = fc([pre_fc_norm_embedding(embed(token_{t+1})), pre_fc_norm_hidden(g_t)])   fc: [H, 2H]
    y_t   = DecoderLayer(x_t)            one full-attention layer of the family (gated attention,
                                         q/k norm, partial RoPE at position t; dense SwiGLU or sparse MoE)
    o_t   = norm(y_t)                    -> logits_t = lm_head(o_t) predict token_{t+2}

where g_t is the trunk's output at position t after the trunk's final norm, and every norm is the
family's (1 + weight) RMSNorm. Embedding, lm_head and the trunk's final norm are shared with the
target (passed in, not copied). Drafting chains the head k times, feeding its own o back as g:
draft 1 comes from the row at the last committed position P-1 (g = the trunk's, token = the anchor);
draft j+1 from a row at position P+j-1 with g = o of the previous row and token = draft j.

Lane state: the head's own KV cache over committed positions (one row per position: the trunk's g
at t with the embedding of the token committed at t+1), plus o of the last committed row. `commit`
appends exactly the committed columns' rows; the rows `propose` runs for draft 2..k are written past
the committed length and never counted, so a rejected draft leaves no trace.

On CUDA the factory (`build_mtp_drafter`) builds `ignis.runtime.drafters.mtp_static.StaticMTPDrafter`:
this head over pooled lane slots, its verify-round commits and whole greedy proposals replayed from
CUDA graphs; `MTPDrafter` stays the CPU head and the reference the static one is tested against.

Sources (read to learn, not copied): vLLM `model_executor/models/qwen3_next_mtp.py`
(`Qwen3NextMultiTokenPredictor.forward`: cat([pre_fc_norm_embedding(embeds),
pre_fc_norm_hidden(hidden)]) -> fc -> `Qwen3NextDecoderLayer(layer_type="full_attention")` -> norm;
`spec_step_idx % num_mtp_layers` picks the layer), vLLM `qwen3_next.py` (the target model returns its
hidden states after the final norm; the proposer feeds the MTP at position t the target's hidden at
t with the token at t+1, and chains the MTP's returned, normed hidden state), `qwen3_5_mtp.py` (same
head for Qwen3.5), the released configs (`mtp_num_hidden_layers: 1`, `mtp_use_dedicated_embeddings:
false`).

Assumptions:

1. The trunk hidden fed to the head is the trunk's output *after* its final norm (vLLM's target
   models return that, and Megatron's MTP reads the decoder output after `final_layernorm`); the
   engine hands over the pre-norm output (`CommittedSpan.hidden_states`), so the drafter applies
   the trunk's final norm (`model.norm.weight`) itself.
2. The chained hidden is the head's output after `mtp.norm` (what vLLM's MTP forward returns).
3. Only `mtp_num_hidden_layers == 1` is supported (every released Qwen3-Next / Qwen3.5 checkpoint);
   more layers raise ConfigError. Dedicated MTP embeddings (`mtp_use_dedicated_embeddings` true,
   an `mtp.embed_tokens.weight` tensor) are refused as an unexpected tensor.
4. Sampled drafting draws from the lane's own distribution (`logits_to_probs` with the lane's
   temperature, top-k, top-p) and returns it as q.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ignis.runtime.checkpoints import DrafterSnapshot
from ignis.runtime.drafters import DRAFTERS, register_drafter
from ignis.runtime.drafters.base import BaseDrafter, CommittedSpan, DrafterError, DraftProposal, DraftRequest
from ignis.runtime.drafters.common import (
    HiddenSizeMismatchError,
    MissingDrafterWeightsError,
    VocabSizeMismatchError,
    apply_rope,
    check_names,
    read_hf_folder,
    rope_cos_sin,
    rope_inv_freq,
)
from ignis.runtime.errors import ConfigError, StateError
from ignis.runtime.families.attention import sdpa
from ignis.runtime.families.base import get_family
from ignis.runtime.families.hybrid_executor import rms_norm_one_plus
from ignis.runtime.families.moe import SparseMoeWeights, SwiGLUWeights, sparse_moe_block, swiglu_mlp
from ignis.runtime.families.moe_grouped import GroupedExperts, load_expert_stacks, use_grouped
from ignis.runtime.families.qwen3_5 import (
    HybridConfig,
    Qwen3_5MoeConfig,
    Qwen3NextConfig,
    mtp_tensor_shapes,
)
from ignis.runtime.kernels.moe_experts import MoeExpertsKernel
from ignis.runtime.linear import LinearFn, Q4Weight, WeightLoader, place_weight
from ignis.runtime.sampling import logits_to_probs

_Weight = torch.Tensor | Q4Weight

__all__ = [
    "MTPDrafter",
    "MTPHead",
    "MTPLaneState",
    "build_mtp_drafter",
    "check_mtp_fits",
    "load_mtp_checkpoint",
    "mtp_expert_layout",
]


def mtp_expert_layout(weights: Mapping[str, torch.Tensor]) -> str:
    """ "fused" when the head's routed experts are stored fused (`mlp.experts.gate_up_proj`), else
    "per_expert" (also for dense heads)."""
    fused = any(k.startswith("mtp.") and k.endswith(".mlp.experts.gate_up_proj") for k in weights)
    return "fused" if fused else "per_expert"


def _is_moe_head(config: HybridConfig) -> bool:
    """Whether the head's layer has a sparse MoE MLP (as `mtp_tensor_shapes` decides)."""
    return config.is_moe and (not isinstance(config, Qwen3NextConfig) or config.is_moe_layer(0))


def check_mtp_fits(config: HybridConfig, weights: Mapping[str, torch.Tensor], *, source: str = "mtp") -> None:
    """The checks a build (and `--spec-backend mtp` at start) makes: the head exists and is complete.

    Args:
        config: the target's hybrid config (its `mtp_num_hidden_layers`).
        weights: tensors by canonical name; only `mtp.*` ones are looked at.

    Raises:
        MissingDrafterWeightsError: mtp_num_hidden_layers is 0 or no `mtp.*` tensor is present
            (the checkpoint has no MTP head), listing the expected names.
        ConfigError: more than one MTP layer, or dedicated MTP embeddings (unsupported).
        TensorSetError / TensorShapeError: the head's tensors are incomplete, unexpected or misshapen.
    """
    mtp = {k: v for k, v in weights.items() if k.startswith("mtp.")}
    if config.mtp_num_hidden_layers == 0 or not mtp:
        expected = sorted(mtp_tensor_shapes(config) if config.mtp_num_hidden_layers else [])
        raise MissingDrafterWeightsError(
            f"{source}: the checkpoint has no MTP head (mtp_num_hidden_layers="
            f"{config.mtp_num_hidden_layers}, {len(mtp)} mtp.* tensors); --spec-backend mtp needs one "
            "(the model's MTP companion container)",
            missing=expected,
        )
    if config.mtp_num_hidden_layers != 1:
        raise ConfigError(
            f"{source}: mtp_num_hidden_layers {config.mtp_num_hidden_layers} is not supported (only 1)"
        )
    layout = mtp_expert_layout(mtp)
    check_names(mtp_tensor_shapes(config, expert_layout=layout), mtp, source=source)


def load_mtp_checkpoint(folder: str | Path) -> tuple[HybridConfig, dict[str, torch.Tensor]]:
    """Read an HF checkpoint folder with an MTP head: (family config, canonical name -> tensor of
    every tensor, `mtp.*` included), names mapped with the family's `map_hf_name`.

    Raises:
        ConfigError: unreadable folder or config, or not a hybrid family.
        MissingDrafterWeightsError / TensorSetError / TensorShapeError: from `check_mtp_fits`.
    """
    raw, tensors = read_hf_folder(folder)
    if "model_type" not in raw:
        raise ConfigError(f"{folder}: config.json has no model_type")
    family = get_family(str(raw["model_type"]))
    config = family.config_cls.from_hf(raw)
    if not isinstance(config, HybridConfig):
        raise ConfigError(f"{folder}: model_type {raw['model_type']!r} has no MTP head family")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        mapped = family.map_hf_name(name)
        if mapped is not None:
            out[mapped] = t
    check_mtp_fits(config, out, source=str(folder))
    return config, out


# ------------------------------------------------------------------------------------ network


@dataclass(frozen=True)
class _Attention:
    q_proj: torch.Tensor  # [2 * heads * head_dim, H]: per head [query | gate]
    k_proj: torch.Tensor  # [kv_heads * head_dim, H]
    v_proj: torch.Tensor
    o_proj: torch.Tensor  # [H, heads * head_dim]
    q_norm: torch.Tensor  # [head_dim], (1 + w)
    k_norm: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None


class _KV:
    """A lane's head KV: rows [capacity, kv_heads, head_dim]; `length` committed rows at the front."""

    def __init__(self, nkv: int, hd: int, device: torch.device, dtype: torch.dtype) -> None:
        self.keys = torch.zeros(16, nkv, hd, device=device, dtype=dtype)
        self.values = torch.zeros(16, nkv, hd, device=device, dtype=dtype)
        self.length = 0

    def reserve(self, needed: int) -> None:
        if needed > self.keys.shape[0]:
            cap = max(needed, 2 * self.keys.shape[0])
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros(cap, *old.shape[1:])
                new[: self.length] = old[: self.length]
                setattr(self, name, new)


class MTPHead:
    """The head's forward in torch (CPU/CUDA, float32/bfloat16); per-lane KV lives in `_KV` objects.

    Args:
        config: the target's hybrid config (head_dim, heads, rotary, MoE sizes, eps).
        weights: canonical names; the `mtp.*` ones are used (fused or per-expert routed experts);
            linear weights may be `Q4Weight`s when `linear` takes them.
        device, dtype: where and in which dtype to compute.
        linear: the linear hook ``linear(x, weight, bias)`` every linear layer runs through (an
            artifact's `LinearBackend`); `F.linear` when None.
        moe_module: the compiled grouped expert kernels (as `HybridExecutor`'s): a MoE head's routed
            experts run as stacks through `grouped_moe_block` off CUDA, and on CUDA with them (q4
            experts); otherwise the reference loop.

    Raises:
        see `check_mtp_fits`.
    """

    def __init__(
        self,
        config: HybridConfig,
        weights: Mapping[str, _Weight],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        linear: LinearFn | None = None,
        moe_module: Any = None,
    ) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be floating, got {dtype}")
        check_mtp_fits(config, weights)  # type: ignore[arg-type]
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.linear: LinearFn = linear or F.linear
        w = {k: v for k, v in weights.items() if k.startswith("mtp.")}

        load = WeightLoader(w, self.device, dtype, source="mtp weights", linear=linear)
        get, lin, opt = load.plain, load.linear, load.optional

        self.fc = lin("mtp.fc.weight")
        self.norm_embedding = get("mtp.pre_fc_norm_embedding.weight")
        self.norm_hidden = get("mtp.pre_fc_norm_hidden.weight")
        self.norm = get("mtp.norm.weight")
        p = "mtp.layers.0"
        a = f"{p}.self_attn"
        self.input_norm = get(f"{p}.input_layernorm.weight")
        self.post_norm = get(f"{p}.post_attention_layernorm.weight")
        self.attn = _Attention(
            q_proj=lin(f"{a}.q_proj.weight"),
            k_proj=lin(f"{a}.k_proj.weight"),
            v_proj=lin(f"{a}.v_proj.weight"),
            o_proj=lin(f"{a}.o_proj.weight"),
            q_norm=get(f"{a}.q_norm.weight"),
            k_norm=get(f"{a}.k_norm.weight"),
            q_bias=opt(f"{a}.q_proj.bias"),
            k_bias=opt(f"{a}.k_proj.bias"),
            v_bias=opt(f"{a}.v_proj.bias"),
            o_bias=opt(f"{a}.o_proj.bias"),
        )
        self.mlp: SwiGLUWeights | SparseMoeWeights
        if _is_moe_head(config):
            assert isinstance(config, Qwen3_5MoeConfig | Qwen3NextConfig)
            m, inter = f"{p}.mlp", config.moe_intermediate_size
            kernel = MoeExpertsKernel(moe_module) if moe_module is not None else None
            grouped = None
            if use_grouped(self.device, kernel, w, m, self.linear):
                gate_up, down = load_expert_stacks(w, m, config.num_experts, device=self.device, dtype=dtype)
                experts = [
                    SwiGLUWeights(gate_up[e, :inter], gate_up[e, inter:], down[e])
                    for e in range(config.num_experts)
                ]
                grouped = GroupedExperts(gate_up, down, kernel=kernel)
            elif f"{m}.experts.gate_up_proj" in w:
                gate_up, down = lin(f"{m}.experts.gate_up_proj"), lin(f"{m}.experts.down_proj")
                experts = [
                    SwiGLUWeights(gate_up[e, :inter], gate_up[e, inter:], down[e])
                    for e in range(config.num_experts)
                ]
            else:
                experts = [
                    SwiGLUWeights(
                        lin(f"{m}.experts.{e}.gate_proj.weight"),
                        lin(f"{m}.experts.{e}.up_proj.weight"),
                        lin(f"{m}.experts.{e}.down_proj.weight"),
                    )
                    for e in range(config.num_experts)
                ]
            self.mlp = SparseMoeWeights(
                router=lin(f"{m}.gate.weight"),
                experts=experts,
                shared_expert=SwiGLUWeights(
                    lin(f"{m}.shared_expert.gate_proj.weight"),
                    lin(f"{m}.shared_expert.up_proj.weight"),
                    lin(f"{m}.shared_expert.down_proj.weight"),
                ),
                shared_expert_gate=lin(f"{m}.shared_expert_gate.weight"),
                grouped=grouped,
            )
        else:
            self.mlp = SwiGLUWeights(
                lin(f"{p}.mlp.gate_proj.weight"),
                lin(f"{p}.mlp.up_proj.weight"),
                lin(f"{p}.mlp.down_proj.weight"),
            )
        self.inv_freq = rope_inv_freq(config.rotary_dim, config.rope_theta, self.device)

    def new_kv(self) -> _KV:
        """An empty KV cache for one lane."""
        return _KV(self.config.num_key_value_heads, self.config.head_dim, self.device, self.dtype)

    def input_rows(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """fc([pre_fc_norm_embedding(embeds), pre_fc_norm_hidden(hidden)]): [R, H] x [R, H] -> [R, H]."""
        eps = self.config.rms_norm_eps
        e = rms_norm_one_plus(embeds.to(self.dtype), self.norm_embedding, eps)
        h = rms_norm_one_plus(hidden.to(self.dtype), self.norm_hidden, eps)
        return self.linear(torch.cat([e, h], dim=-1), self.fc, None)

    def layer(self, x: torch.Tensor, caches: Sequence[_KV], counts: Sequence[int]) -> torch.Tensor:
        """The decoder layer and `mtp.norm` over R rows of several lanes.

        Lane i owns `counts[i]` consecutive rows, at positions caches[i].length .. + counts[i] - 1;
        their keys/values are written there (past the committed length, which this does not move) and
        each row attends to the lane's committed rows and, causally, to its own rows before it.

        Args:
            x: [R, H] rows from `input_rows`, lane by lane.
            caches: per lane its KV.
            counts: per lane its number of rows (sum = R).

        Returns:
            [R, H] the head's output after `mtp.norm` (the chained hidden; logits = lm_head of it).
        """
        c, a = self.config, self.attn
        rows, hd, nh, nkv = x.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads
        eps = c.rms_norm_eps
        positions = torch.cat(
            [torch.arange(kv.length, kv.length + n) for kv, n in zip(caches, counts, strict=True)]
        )
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.dtype)
        hn = rms_norm_one_plus(x, self.input_norm, eps)
        linear = self.linear
        qg = linear(hn, a.q_proj, a.q_bias).view(rows, nh, 2 * hd)
        gate = qg[..., hd:].reshape(rows, nh * hd)
        q = apply_rope(rms_norm_one_plus(qg[..., :hd], a.q_norm, eps), cos, sin)
        k = apply_rope(
            rms_norm_one_plus(linear(hn, a.k_proj, a.k_bias).view(rows, nkv, hd), a.k_norm, eps), cos, sin
        )
        v = linear(hn, a.v_proj, a.v_bias).view(rows, nkv, hd)
        out = torch.empty_like(q)
        start = 0
        for kv, n in zip(caches, counts, strict=True):
            past, total = kv.length, kv.length + n
            kv.reserve(total)
            kv.keys[past:total] = k[start : start + n]
            kv.values[past:total] = v[start : start + n]
            mask = None
            if n > 1:
                mask = (
                    torch.arange(total, device=self.device)[None, :]
                    <= torch.arange(past, total, device=self.device)[:, None]
                )
            o = sdpa(
                q[start : start + n].transpose(0, 1).unsqueeze(0),
                kv.keys[:total].transpose(0, 1).unsqueeze(0),
                kv.values[:total].transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                scale=hd**-0.5,
                enable_gqa=nh != nkv,
            )
            out[start : start + n] = o[0].transpose(0, 1)
            start += n
        h = x + linear(out.reshape(rows, nh * hd) * torch.sigmoid(gate), a.o_proj, a.o_bias)
        m = rms_norm_one_plus(h, self.post_norm, eps)
        if isinstance(self.mlp, SparseMoeWeights):
            assert isinstance(c, Qwen3_5MoeConfig | Qwen3NextConfig)
            h = h + sparse_moe_block(
                m, self.mlp, top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob, linear=linear
            )
        else:
            h = h + swiglu_mlp(m, self.mlp, linear=linear)
        return rms_norm_one_plus(h, self.norm, eps)


# ------------------------------------------------------------------------------------ drafter


@dataclass
class MTPLaneState:
    """One lane's head state (read-only outside the drafter).

    Attributes:
        kv: the head's KV cache; `kv.length` committed rows (positions 0..num_tokens-1).
        last_hidden: [H] the head's output (after mtp.norm) at the last committed row, or None.
        last_token: the token embedded at that row: the lane's anchor.
        last_trunk_hidden: [H] the trunk's pre-norm hidden state at the last committed position.
        pending_hidden: [H] for a lane restored from a checkpoint, the trunk's hidden state at the
            checkpoint's last position, whose row waits for the token after it; else None.
    """

    kv: _KV
    last_hidden: torch.Tensor | None = None
    last_token: int | None = None
    # the trunk's (pre-norm) hidden state of the last committed position, [H]: what a checkpoint
    # keeps to compute that position's row once the token after it is known
    last_trunk_hidden: torch.Tensor | None = None
    # a lane restored from a checkpoint at N: its KV holds rows 0..N-2 and this is the trunk's hidden
    # at N - 1, whose row is run once the token at N is known (the next commit or propose)
    pending_hidden: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Committed positions the head's KV holds (a restored lane's pending row not counted)."""
        return self.kv.length

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed (keys, values), each [num_tokens, kv_heads, head_dim] (keys after q/k norm and RoPE)."""
        return self.kv.keys[: self.kv.length], self.kv.values[: self.kv.length]


class MTPDrafter(BaseDrafter):
    """The `mtp` backend: the `Drafter` protocol over `MTPHead` (row-budgeted; needs hidden states).

    Args:
        config: the target's hybrid config.
        weights: tensors by canonical name (the `mtp.*` ones are used).
        embed_tokens: the target's embedding [V, H] (shared; moved only if device/dtype differ).
        lm_head: the target's output head [V, H] (the embedding when tied).
        final_norm: the target's final norm weight [H] (`model.norm.weight`), (1 + w) RMSNorm.
        device, dtype: where and in which dtype the head runs.
        linear: the linear hook ``linear(x, weight, bias)`` the head and lm_head run through (an
            artifact's `LinearBackend`; the weights and lm_head may then be `Q4Weight`s); `F.linear`
            when None.
        moe_module: the compiled grouped expert kernels for a MoE head (`MTPHead`), or None.

    Raises:
        MissingDrafterWeightsError, ConfigError, TensorSetError, TensorShapeError: see `check_mtp_fits`.
        HiddenSizeMismatchError / VocabSizeMismatchError: shared tensors of the wrong shape.
    """

    name = "mtp"
    is_row_budgeted = True
    needs_hidden_states = True
    tap_layers: tuple[int, ...] = ()

    def __init__(
        self,
        config: HybridConfig,
        weights: Mapping[str, _Weight],
        *,
        embed_tokens: torch.Tensor,
        lm_head: _Weight,
        final_norm: torch.Tensor,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        linear: LinearFn | None = None,
        moe_module: Any = None,
    ) -> None:
        h, v = config.hidden_size, config.vocab_size
        for what, t in (("embedding", embed_tokens), ("lm_head", lm_head)):
            if len(t.shape) != 2 or t.shape[1] != h:
                raise HiddenSizeMismatchError(
                    f"mtp: target {what} has shape {tuple(t.shape)}, expected [{v}, {h}]"
                )
            if t.shape[0] != v:
                raise VocabSizeMismatchError(
                    f"mtp: target {what} has {t.shape[0]} rows, the vocabulary is {v}"
                )
        if tuple(final_norm.shape) != (h,):
            raise HiddenSizeMismatchError(
                f"mtp: target final norm has shape {tuple(final_norm.shape)}, expected [{h}]"
            )
        self.config = config
        self.head = MTPHead(config, weights, device=device, dtype=dtype, linear=linear, moe_module=moe_module)
        self.linear: LinearFn = self.head.linear
        self.device, self.dtype = self.head.device, dtype
        self.embed_tokens = embed_tokens.detach().to(device=self.device, dtype=dtype)
        self.lm_head: _Weight
        if isinstance(lm_head, Q4Weight):  # packed for the hook, else dequantized for F.linear
            q4 = lm_head.to(self.device)
            self.lm_head = place_weight(linear, q4) if linear is not None else q4.dequantize(dtype)
        else:
            self.lm_head = lm_head.detach().to(device=self.device, dtype=dtype)
        self.final_norm = final_norm.detach().to(device=self.device, dtype=dtype)
        self._lanes: dict[int, MTPLaneState] = {}

    # ---- lanes ----

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        """Open an empty head state for the lane (its prompt span's `commit` fills it)."""
        self._lanes[lane_id] = MTPLaneState(self.head.new_kv())

    supports_checkpoints = True

    def snapshot_lane(self, lane_id: int, num_tokens: int) -> DrafterSnapshot:
        """The lane's head state at N = num_tokens committed positions, independent of the token at N:
        ``keys`` / ``values`` [N - 1, kv_heads, head_dim] (rows 0..N-2, each pairing a position with
        the committed token after it) and ``hidden`` [H], the trunk's pre-norm hidden state at N - 1
        (its row is run by the restored lane once the token at N is known).

        Raises:
            StateError: unknown lane, or its head state does not end at num_tokens.
        """
        lane = self.state(lane_id)
        pending = lane.pending_hidden is not None
        rows = lane.kv.length if pending else lane.kv.length - 1
        hidden = lane.pending_hidden if pending else lane.last_trunk_hidden
        if rows + 1 != num_tokens or hidden is None:
            raise StateError(
                f"mtp: lane {lane_id} head state ends at {lane.kv.length}, "
                f"not at the checkpoint's {num_tokens}"
            )
        return DrafterSnapshot(
            num_tokens=int(num_tokens),
            tensors={
                "keys": lane.kv.keys[:rows].clone(),
                "values": lane.kv.values[:rows].clone(),
                "hidden": hidden.clone(),
            },
        )

    def restore_lane(self, lane_id: int, prompt_token_ids: Sequence[int], snapshot: DrafterSnapshot) -> None:
        """Start the lane from `snapshot` (`snapshot_lane`): rows 0..N-2 in its KV, the row of N - 1
        pending until the token at N is known.

        Raises:
            CheckpointError: the snapshot's tensors do not fit this head.
        """
        from ignis.runtime.checkpoints import CheckpointError

        c, n = self.config, int(snapshot.num_tokens)
        t = snapshot.tensors
        if set(t) != {"keys", "values", "hidden"}:
            raise CheckpointError(f"mtp: snapshot tensors {sorted(t)}, expected ['hidden', 'keys', 'values']")
        shape = (n - 1, c.num_key_value_heads, c.head_dim)
        if tuple(t["keys"].shape) != shape or tuple(t["values"].shape) != shape:
            raise CheckpointError(
                f"mtp: snapshot keys {tuple(t['keys'].shape)} / values {tuple(t['values'].shape)}, "
                f"expected {shape}"
            )
        if tuple(t["hidden"].shape) != (c.hidden_size,):
            raise CheckpointError(
                f"mtp: snapshot hidden {tuple(t['hidden'].shape)}, expected [{c.hidden_size}]"
            )
        kv = self.head.new_kv()
        kv.reserve(n - 1)
        kv.keys[: n - 1] = t["keys"].to(kv.keys)
        kv.values[: n - 1] = t["values"].to(kv.values)
        kv.length = n - 1
        self._lanes[lane_id] = MTPLaneState(
            kv, pending_hidden=t["hidden"].to(device=self.device, dtype=self.dtype)
        )

    def _run_pending(self, lanes: Sequence[MTPLaneState], tokens: Sequence[int]) -> None:
        """Run each restored lane's pending row (position kv.length) with the token committed after it."""
        with torch.inference_mode():
            g = rms_norm_one_plus(
                torch.stack([lane.pending_hidden for lane in lanes]),  # type: ignore[misc]
                self.final_norm,
                self.config.rms_norm_eps,
            )
            e = F.embedding(
                torch.tensor(list(tokens), dtype=torch.long, device=self.device), self.embed_tokens
            )
            out = self.head.layer(self.head.input_rows(e, g), [lane.kv for lane in lanes], [1] * len(lanes))
        for i, (lane, tok) in enumerate(zip(lanes, tokens, strict=True)):
            lane.kv.length += 1
            lane.last_hidden = out[i].clone()
            lane.last_token = int(tok)
            lane.last_trunk_hidden = lane.pending_hidden
            lane.pending_hidden = None

    def end_lane(self, lane_id: int) -> None:
        """Drop the lane's head state."""
        self._lanes.pop(lane_id, None)

    def state(self, lane_id: int) -> MTPLaneState:
        """The lane's head state (for tests and tools). Raises StateError for an unknown lane."""
        try:
            return self._lanes[lane_id]
        except KeyError:
            raise StateError(f"mtp: lane {lane_id} was not started (start_lane)") from None

    def commit(self, spans: Sequence[CommittedSpan]) -> None:
        """Run the head over each span's committed columns and keep their rows in the lane's KV.

        Column i of a span (position start + i) pairs the trunk's hidden state there with the token
        committed after it (`next_token_ids[i]`).

        Raises:
            StateError: unknown lane, or a span not starting where the lane's head state ends.
            DrafterError: a span without hidden states, or of the wrong shape.
        """
        if not spans:
            return
        lanes, hidden, tokens, counts = [], [], [], []
        restored = [
            (lane, int(s.input_token_ids[0]))
            for s in spans
            if (lane := self.state(s.lane_id)).pending_hidden is not None and s.start == lane.num_tokens + 1
        ]
        if restored:  # a lane restored from a checkpoint: its last position's row first
            self._run_pending([lane for lane, _ in restored], [tok for _, tok in restored])
        for s in spans:
            lane = self.state(s.lane_id)
            self._check_span(s, lane)
            m = len(s.next_token_ids)
            assert s.hidden_states is not None
            lanes.append(lane)
            hidden.append(s.hidden_states.to(device=self.device, dtype=self.dtype))
            tokens.append(torch.tensor(s.next_token_ids, dtype=torch.long))
            counts.append(m)
        with torch.inference_mode():
            g = rms_norm_one_plus(torch.cat(hidden), self.final_norm, self.config.rms_norm_eps)
            e = F.embedding(torch.cat(tokens).to(self.device), self.embed_tokens)
            out = self.head.layer(self.head.input_rows(e, g), [lane.kv for lane in lanes], counts)
        end = 0
        for lane, s, m in zip(lanes, spans, counts, strict=True):
            end += m
            lane.kv.length += m
            lane.last_hidden = out[end - 1].clone()
            lane.last_token = int(s.next_token_ids[-1])
            lane.last_trunk_hidden = s.hidden_states[-1].to(device=self.device, dtype=self.dtype).clone()  # type: ignore[index]

    def _check_span(self, s: CommittedSpan, lane: MTPLaneState) -> None:
        """Refuse a span that does not start where the lane's head state ends, or whose hidden states
        are missing or not [len(next_token_ids), hidden_size].

        Raises:
            StateError: the span's start is not the lane's `num_tokens`.
            DrafterError: no hidden states (the engine did not request them), or the wrong shape.
        """
        if s.start != lane.num_tokens:
            raise StateError(
                f"mtp: lane {s.lane_id} span starts at position {s.start}, its head state ends at "
                f"{lane.num_tokens}"
            )
        if s.hidden_states is None:
            raise DrafterError(
                f"mtp: lane {s.lane_id} committed without hidden states; the engine must request them "
                "(needs_hidden_states)"
            )
        m, h = len(s.next_token_ids), self.config.hidden_size
        if tuple(s.hidden_states.shape) != (m, h):
            raise DrafterError(
                f"mtp: lane {s.lane_id} hidden states have shape {tuple(s.hidden_states.shape)}, "
                f"expected [{m}, {h}]"
            )

    def _check_requests(self, requests: Sequence[DraftRequest]) -> list[MTPLaneState]:
        """The requests' lanes, in order (a lane restored from a checkpoint has its pending row run
        first: its anchor is the token after that row).

        Raises:
            StateError: unknown lane, or a request whose anchor is not the lane's last committed token
                or whose position is not where the head state ends.
        """
        restored = [
            (lane, r.anchor_token_id)
            for r in requests
            if (lane := self.state(r.lane_id)).pending_hidden is not None
            and r.position == lane.num_tokens + 1
        ]
        if restored:
            self._run_pending([lane for lane, _ in restored], [tok for _, tok in restored])
        lanes = []
        for r in requests:
            lane = self.state(r.lane_id)
            if (
                r.position != lane.num_tokens
                or lane.last_hidden is None
                or r.anchor_token_id != lane.last_token
            ):
                raise StateError(
                    f"mtp: lane {r.lane_id} asks to draft after position {r.position} "
                    f"(anchor {r.anchor_token_id}); its head state ends at {lane.num_tokens} "
                    f"(anchor {lane.last_token}): a commit was missed"
                )
            lanes.append(lane)
        return lanes

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """Chain the head num_drafts times per lane (all lanes stepped together).

        Greedy lanes draft the argmax (draft_probs None); sampled lanes draw from the lane's
        distribution of the head's logits with their own generator and return it (float32 [k, vocab]).

        Raises:
            StateError: unknown lane, or a request whose anchor is not the lane's last committed token
                or whose position is not where the head state ends (a commit was missed).
        """
        if not requests:
            return []
        lanes = self._check_requests(requests)
        ks = [max(0, r.num_drafts) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        hidden = torch.stack([lane.last_hidden for lane in lanes])  # type: ignore[misc]
        live = list(range(len(requests)))
        saved = [lane.kv.length for lane in lanes]
        try:
            with torch.inference_mode():
                for j in range(max(ks)):
                    live_now = [i for i in live if ks[i] > j]
                    if not live_now:
                        break
                    if j > 0:
                        # a row at position P + j - 1: (hidden of the previous row, draft j) -> draft j + 1
                        ids = torch.tensor(
                            [drafts[i][-1] for i in live_now], dtype=torch.long, device=self.device
                        )
                        x = self.head.input_rows(F.embedding(ids, self.embed_tokens), hidden[live_now])
                        caches = [lanes[i].kv for i in live_now]
                        out = self.head.layer(x, caches, [1] * len(live_now))
                        for kv in caches:
                            kv.length += 1  # speculative: undone below
                        hidden = hidden.clone()
                        hidden[live_now] = out
                    logits = self.linear(hidden[live_now], self.lm_head, None).float()  # [live, vocab]
                    for row, i in enumerate(live_now):
                        r = requests[i]
                        if r.params.is_greedy:
                            drafts[i].append(int(logits[row].argmax()))
                            continue
                        q = logits_to_probs(logits[row], r.params)
                        drafts[i].append(
                            int(torch.multinomial(q.to(r.generator.device), 1, generator=r.generator))
                        )
                        probs[i].append(q)
                    live = live_now
        finally:
            for lane, n in zip(lanes, saved, strict=True):
                lane.kv.length = n
        return [
            DraftProposal(
                torch.tensor(d, dtype=torch.int64, device=self.device), torch.stack(p) if p else None
            )
            for d, p in zip(drafts, probs, strict=True)
        ]


# ------------------------------------------------------------------------------------ factory


def build_mtp_drafter(
    *,
    target_config: HybridConfig,
    target_weights: Mapping[str, Any],
    mtp_weights: Mapping[str, Any] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    linear: LinearFn | None = None,
    moe_module: Any = None,
    static: bool | None = None,
    max_lanes: int | None = None,
    max_context: int | None = None,
    cuda_graphs: bool | None = None,
) -> MTPDrafter:
    """The registered `mtp` factory: the head from `mtp_weights` (default: the `mtp.*` tensors among
    `target_weights`), sharing the target's embedding, lm_head and final norm; `linear` is the
    head's linear hook, `moe_module` the grouped expert kernels of a MoE head (see `MTPDrafter`).

    `static` (None: on CUDA) builds the pooled, CUDA-graphed head
    (`ignis.runtime.drafters.mtp_static.StaticMTPDrafter`) with `max_lanes` lane slots (None: 8),
    `max_context` rows a lane (None: its default) and `cuda_graphs` (None: when capturable); else the
    eager `MTPDrafter` (those three are then ignored).

    Raises:
        ConfigError: target weights lack the embedding or the final norm; plus `MTPDrafter`'s errors.
    """
    tw = target_weights
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        if name not in tw:
            raise ConfigError(f"target weights lack {name} (the MTP head shares it)")
    embed = tw["model.embed_tokens.weight"]
    head = embed if target_config.tie_word_embeddings or "lm_head.weight" not in tw else tw["lm_head.weight"]
    weights: Mapping[str, Any] = mtp_weights if mtp_weights is not None else tw
    kw: dict[str, Any] = dict(
        embed_tokens=embed,
        lm_head=head,
        final_norm=tw["model.norm.weight"],
        device=device,
        dtype=dtype,
        linear=linear,
        moe_module=moe_module,
    )
    if static if static is not None else torch.device(device).type == "cuda":
        from ignis.runtime.drafters.mtp_static import StaticMTPDrafter

        return StaticMTPDrafter(
            target_config,
            weights,
            max_lanes=8 if max_lanes is None else max_lanes,
            max_context=max_context,
            cuda_graphs=cuda_graphs,
            **kw,
        )
    return MTPDrafter(target_config, weights, **kw)


if "mtp" not in DRAFTERS:
    register_drafter("mtp", build_mtp_drafter)
