"""Torch executor of the hybrid families (`qwen3_5`, `qwen3_5_moe`, `qwen3_next`) for verify rounds.

One `forward` runs every lane's columns (a prompt in prefill, anchor + drafts in a verify round)
through the model at once: embeddings, norms, projections and MLP/MoE run on all R rows of the call
concatenated; the token mixers run per lane (attention against the lane's KV cache; the Gated
DeltaNet conv and recurrence from the lane's state). `commit` then keeps the first n columns of each
lane (DESIGN.md, "The verify round"):

* full-attention layers write every column's key/value into the lane's cache buffer past its
  committed length; commit only moves the length, so rejected columns are overwritten later;
* Gated DeltaNet layers keep the conv window (state + the call's inputs, from which the conv state
  after any column is a slice) and, with `record=True`, the float32 recurrent state after every
  column; commit(n) takes the state after column n-1, so a rejected column leaves no trace. With
  `record=False` (prefill) the chunked algorithm (chunk 64) runs and only the final state exists:
  such a forward may only be committed whole (or discarded with 0).

Per-layer math follows HF transformers (`models/qwen3_5/modeling_qwen3_5.py`,
`models/qwen3_next/modeling_qwen3_next.py`), dtype casts included, so bf16 runs round where HF rounds:

* RMSNorm with (1 + weight) in float32, cast back (Qwen3-Next / Gemma style), for the layer norms,
  the final norm and the per-head q/k norms;
* gated full attention: q_proj yields [query | gate] per head, q/k RMSNorm, RoPE on the first
  `rotary_dim` dims (rotate-half), GQA softmax attention (scale head_dim ** -0.5), output times
  sigmoid(gate), o_proj;
* Gated DeltaNet (Yang et al. 2024, arXiv:2412.06464): projections -> causal depthwise conv + SiLU
  over q|k|v -> q, k l2-normalized (float32), q scaled by k_dim ** -0.5, q/k heads repeated to the
  value heads -> beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) -> gated delta rule
  (`gated_deltanet.py`) -> gated RMSNorm ``weight * norm(o) * silu(z)`` -> out_proj;
* MLP: SwiGLU, or the sparse MoE block with its sigmoid-gated shared expert (`moe.py`).

Every linear layer (projections, MoE experts, router and gates, the LM head) runs through the
executor's `linear` hook (base.py's `Executor`; `F.linear` by default), so its weights may be
`ignis.runtime.linear.Q4Weight`s; embedding, norms, conv kernels and the GDN decay parameters stay
plain tensors.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ignis.runtime.errors import StateError, TensorSetError, TensorShapeError
from ignis.runtime.expert_cache import ExpertCache, host_experts
from ignis.runtime.families.base import ForwardOutput
from ignis.runtime.families.gated_deltanet import (
    causal_conv1d_silu,
    gated_delta_prefill,
    gated_delta_rule_recurrent,
    l2_normalize,
)
from ignis.runtime.families.moe import SparseMoeWeights, SwiGLUWeights, sparse_moe_block, swiglu_mlp
from ignis.runtime.families.moe_grouped import GroupedExperts, load_expert_stacks, use_grouped
from ignis.runtime.families.qwen3_5 import HybridConfig, Qwen3_5MoeConfig, Qwen3NextConfig, tensor_shapes
from ignis.runtime.kernels.moe_experts import MoeExpertsKernel
from ignis.runtime.linear import LinearFn, Q4Weight, WeightLoader, cat_rows, place_weight, to_device

_Weight = torch.Tensor | Q4Weight


def _out_rows(w: Any) -> int:
    """Output features of a 2-d linear weight (dense [N, K] or `Q4Weight`)."""
    return int(w.out_features) if isinstance(w, Q4Weight) else int(w.shape[0])


__all__ = ["HybridExecutor", "HybridLaneState", "gated_rms_norm", "rms_norm_one_plus"]


def rms_norm_one_plus(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * (1 + weight)`` over the last dim, computed in float32 and cast to x's dtype.

    HF: `Qwen3_5RMSNorm` / `Qwen3NextRMSNorm` (weights stored zero-centred).
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: ``weight * rmsnorm(x) * silu(gate)`` over the last dim (x's dtype out).

    The norm is taken in float32 and cast back before the (plain, not 1 +) weight, the SiLU gate in
    float32 (HF: `Qwen3_5RMSNormGated`).
    """
    dtype = x.dtype
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * y) * F.silu(gate.float())).to(dtype)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims of x [R, heads, head_dim]; cos/sin [R, rot]."""
    rot = cos.shape[-1]
    half = rot // 2
    xr, xp = x[..., :rot], x[..., rot:]
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
    return torch.cat((xr * cos[:, None, :] + rotated * sin[:, None, :], xp), dim=-1)


@dataclass(frozen=True)
class _AttentionWeights:
    q_proj: _Weight | None  # [2 * heads * head_dim, hidden]: per head [query | gate]; None when fused
    k_proj: _Weight | None  # [kv_heads * head_dim, hidden]; None when fused
    v_proj: _Weight | None  # [kv_heads * head_dim, hidden]; None when fused
    o_proj: _Weight  # [hidden, heads * head_dim]
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    # [q_proj rows + 2 * kv_heads * head_dim, hidden]: q_proj over k_proj over v_proj (one GEMM), or
    # None; its bias the members' biases stacked (None when they have none)
    qkv_proj: _Weight | None = None
    qkv_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class _GdnWeights:
    in_proj_qkv: _Weight | None  # [conv_dim, hidden] (split projections; None when fused)
    in_proj_z: _Weight | None  # [value_dim, hidden] (None when fused)
    in_proj_b: _Weight | None  # [v_heads, hidden]
    in_proj_a: _Weight | None  # [v_heads, hidden]
    in_proj_qkvz: _Weight | None  # [2 key_dim + 2 value_dim, hidden] (qwen3_next, grouped per k-head)
    in_proj_ba: _Weight | None  # [2 v_heads, hidden] (qwen3_next, grouped per k-head)
    # [2 v_heads, hidden]: in_proj_b over in_proj_a (one GEMM; `_fuse`'s rule: the build keeps them
    # precise and compiles neither shape for CUDA, so torch runs the stack), or None
    in_proj_b_a: _Weight | None
    # [conv_dim + value_dim, hidden]: in_proj_qkv over in_proj_z (one GEMM), or None
    in_proj_qkv_z: _Weight | None
    conv: torch.Tensor  # [conv_dim, kernel]
    dt_bias: torch.Tensor  # [v_heads]
    a_log: torch.Tensor  # [v_heads]
    norm: torch.Tensor  # [v_head_dim]
    out_proj: _Weight  # [hidden, value_dim]


@dataclass(frozen=True)
class _Layer:
    index: int  # decoder layer index
    slot: int  # index among the layers of the same mixer kind (KV slot or GDN slot)
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: _AttentionWeights | None
    gdn: _GdnWeights | None
    mlp: SwiGLUWeights | SparseMoeWeights


@dataclass
class _Pending:
    num_columns: int
    record: bool
    # per GDN slot, model dtype: [conv_dim, kernel - 1 + n] (record) or [conv_dim, kernel - 1], the
    # conv state after the last column (record=False)
    conv_windows: list[torch.Tensor]
    rec_states: list[torch.Tensor]  # per GDN slot: [n, hv, dk, dv] (record) or [hv, dk, dv], float32


class HybridLaneState:
    """One lane's state: KV caches of the attention layers, conv and recurrent state of the GDN layers.

    Created by `HybridExecutor.new_lane`; opaque to the scheduler apart from `num_tokens` and the
    read-only inspectors below (used by tests and debugging tools).
    """

    def __init__(
        self,
        owner: HybridExecutor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        conv: list[torch.Tensor],
        recurrent: list[torch.Tensor],
    ) -> None:
        self._owner = owner
        self._num_tokens = 0
        self._keys = keys  # per attention slot: [kv_heads, capacity, head_dim]
        self._values = values
        self._conv = conv  # per GDN slot: [conv_dim, kernel - 1], model dtype
        self._rec = recurrent  # per GDN slot: [v_heads, k_head_dim, v_head_dim], float32
        self._pending: _Pending | None = None

    @property
    def num_tokens(self) -> int:
        """Committed tokens whose effect the state holds."""
        return self._num_tokens

    @property
    def is_pending(self) -> bool:
        """True between a forward and its commit."""
        return self._pending is not None

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed (keys, values) of full-attention decoder layer `layer`, each [kv_heads, num_tokens,
        head_dim] in the executor's dtype (keys after q/k norm and RoPE). Views: do not modify.

        Raises:
            ValueError: `layer` is not a full-attention layer.
        """
        slot = self._owner._slot(layer, attention=True)
        return self._keys[slot][:, : self._num_tokens], self._values[slot][:, : self._num_tokens]

    def conv_state(self, layer: int) -> torch.Tensor:
        """Conv state of GDN layer `layer`: the last kernel-1 conv inputs, [conv_dim, kernel - 1].

        Raises:
            ValueError: `layer` is not a linear-attention layer.
        """
        return self._conv[self._owner._slot(layer, attention=False)]

    def recurrent_state(self, layer: int) -> torch.Tensor:
        """Recurrent state of GDN layer `layer`: float32 [v_heads, k_head_dim, v_head_dim].

        Raises:
            ValueError: `layer` is not a linear-attention layer.
        """
        return self._rec[self._owner._slot(layer, attention=False)]

    def _reserve_kv(self, slot: int, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._keys[slot], self._values[slot]
        if keys.shape[1] < needed:
            capacity = max(needed, 2 * keys.shape[1], 16)
            n = self._num_tokens
            new_k = keys.new_zeros(keys.shape[0], capacity, keys.shape[2])
            new_v = values.new_zeros(values.shape[0], capacity, values.shape[2])
            new_k[:, :n] = keys[:, :n]
            new_v[:, :n] = values[:, :n]
            self._keys[slot], self._values[slot] = new_k, new_v
        return self._keys[slot], self._values[slot]

    def _apply_commit(self, keep: int, conv_len: int) -> None:
        pending = self._pending
        assert pending is not None
        if keep > 0:
            for slot, window in enumerate(pending.conv_windows):
                # record=False: already the conv state after the last column (whole commits only)
                self._conv[slot] = window[:, keep : keep + conv_len].clone() if pending.record else window
            for slot, states in enumerate(pending.rec_states):
                self._rec[slot] = states[keep - 1].clone() if pending.record else states
            self._num_tokens += keep
        self._pending = None


class HybridExecutor:
    """The `Executor` protocol (`ignis.runtime.families.base`) for the hybrid families.

    Args:
        config: a `HybridConfig` (Qwen3_5Config, Qwen3_5MoeConfig, Qwen3NextConfig or a text alias).
        weights: canonical name -> tensor (after the family's `map_hf_name`). `mtp.*` tensors may be
            present and are ignored; routed experts may be fused or per expert (see `qwen3_5.py`).
        device: where weights, states and outputs live (CPU or CUDA).
        dtype: compute/weight dtype (torch.float32 or torch.bfloat16; float16 untested). Recurrent
            state and the delta-rule math are float32 whatever this is.
        linear: the linear hook ``linear(x, weight, bias)`` every linear layer runs through
            (`ignis.runtime.linear.LinearBackend` for an artifact; linear weights may then be
            `Q4Weight`s); `F.linear` when None.
        expert_cache: keep the routed experts in host memory (where `weights` has them: e.g. the
            artifact's memory map) and run them from this cache's device slots
            (`ignis.runtime.expert_cache`); None: every expert is moved to `device`.
        moe_module: the compiled grouped expert kernels (`MoeExpertsKernel`, a loaded module or a
            ``.so`` path from ``ignis.compiler.kernels.moe_experts.build_moe_experts``). MoE layers
            run their routed experts as weight stacks through `grouped_moe_block`
            (`ignis.runtime.families.moe_grouped`) on CUDA when this is given and the experts are
            q4_g32 (held row-major), and off CUDA (its torch path) unless `linear` runs compiled
            functions; otherwise the reference loop of `sparse_moe_block`, one linear per routed
            expert (`moe_grouped.use_grouped`).

    Raises:
        TensorSetError: missing or unexpected trunk tensors, all listed at once.
        TensorShapeError: a tensor whose shape differs from the config's table.
        ValueError: a non-floating weight or a non-floating dtype.
    """

    def __init__(
        self,
        config: HybridConfig,
        weights: Mapping[str, _Weight],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        linear: LinearFn | None = None,
        expert_cache: ExpertCache | None = None,
        moe_module: Any = None,
    ) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.linear: LinearFn = linear or F.linear
        self.expert_cache = expert_cache
        self.moe_kernel = MoeExpertsKernel(moe_module) if moe_module is not None else None
        c = config
        trunk = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        _check_weights(c, trunk)

        load = WeightLoader(trunk, self.device, dtype, source=f"{c.model_type} weights", linear=linear)
        get, lin, opt, opt_lin = load.plain, load.linear, load.optional, load.optional_linear

        self._embed = get("model.embed_tokens.weight")
        self._final_norm = get("model.norm.weight")
        self._lm_head: _Weight = self._embed if c.tie_word_embeddings else lin("lm_head.weight")
        self._layers: list[_Layer] = []
        self._attn_slot: dict[int, int] = {}
        self._gdn_slot: dict[int, int] = {}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}"
            attn = gdn = None
            if c.is_full_attention(i):
                slot = self._attn_slot[i] = len(self._attn_slot)
                a = f"{p}.self_attn"
                qkv = self._fuse(trunk, [f"{a}.{m}_proj.weight" for m in "qkv"])
                biases = [opt(f"{a}.{m}_proj.bias") for m in "qkv"]
                qkv_bias = None
                if qkv is not None and any(b is not None for b in biases):
                    sizes = [_out_rows(trunk[f"{a}.{m}_proj.weight"]) for m in "qkv"]
                    qkv_bias = torch.cat(
                        [
                            b if b is not None else torch.zeros(n, device=self.device, dtype=dtype)
                            for b, n in zip(biases, sizes, strict=True)
                        ]
                    )
                attn = _AttentionWeights(
                    q_proj=None if qkv is not None else lin(f"{a}.q_proj.weight"),
                    k_proj=None if qkv is not None else lin(f"{a}.k_proj.weight"),
                    v_proj=None if qkv is not None else lin(f"{a}.v_proj.weight"),
                    o_proj=lin(f"{a}.o_proj.weight"),
                    q_norm=get(f"{a}.q_norm.weight"),
                    k_norm=get(f"{a}.k_norm.weight"),
                    q_bias=biases[0],
                    k_bias=biases[1],
                    v_bias=biases[2],
                    o_bias=opt(f"{a}.o_proj.bias"),
                    qkv_proj=qkv,
                    qkv_bias=qkv_bias,
                )
            else:
                slot = self._gdn_slot[i] = len(self._gdn_slot)
                g = f"{p}.linear_attn"
                b_a = self._fuse(trunk, [f"{g}.in_proj_b.weight", f"{g}.in_proj_a.weight"])
                qkv_z = self._fuse(trunk, [f"{g}.in_proj_qkv.weight", f"{g}.in_proj_z.weight"])
                gdn = _GdnWeights(
                    in_proj_qkv=None if qkv_z is not None else opt_lin(f"{g}.in_proj_qkv.weight"),
                    in_proj_z=None if qkv_z is not None else opt_lin(f"{g}.in_proj_z.weight"),
                    in_proj_qkv_z=qkv_z,
                    in_proj_b=None if b_a is not None else opt_lin(f"{g}.in_proj_b.weight"),
                    in_proj_a=None if b_a is not None else opt_lin(f"{g}.in_proj_a.weight"),
                    in_proj_b_a=b_a,
                    in_proj_qkvz=opt_lin(f"{g}.in_proj_qkvz.weight"),
                    in_proj_ba=opt_lin(f"{g}.in_proj_ba.weight"),
                    conv=get(f"{g}.conv1d.weight").squeeze(1),
                    dt_bias=get(f"{g}.dt_bias"),
                    a_log=get(f"{g}.A_log"),
                    norm=get(f"{g}.norm.weight"),
                    out_proj=lin(f"{g}.out_proj.weight"),
                )
            mlp: SwiGLUWeights | SparseMoeWeights
            if c.is_moe_layer(i):
                mlp = self._moe_weights(f"{p}.mlp", lin, trunk)
            else:
                gate_up = self._fuse(trunk, [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"])
                mlp = SwiGLUWeights(
                    None if gate_up is not None else lin(f"{p}.mlp.gate_proj.weight"),
                    None if gate_up is not None else lin(f"{p}.mlp.up_proj.weight"),
                    lin(f"{p}.mlp.down_proj.weight"),
                    gate_up,
                )
            self._layers.append(
                _Layer(
                    i,
                    slot,
                    get(f"{p}.input_layernorm.weight"),
                    get(f"{p}.post_attention_layernorm.weight"),
                    attn,
                    gdn,
                    mlp,
                )
            )
        rot = c.rotary_dim
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
        self._inv_freq = inv_freq.to(self.device)

    def _moe_weights(
        self, p: str, get: Callable[[str], _Weight], trunk: Mapping[str, _Weight]
    ) -> SparseMoeWeights:
        c = self.config
        assert isinstance(c, Qwen3_5MoeConfig | Qwen3NextConfig)
        inter = c.moe_intermediate_size
        experts: Sequence[SwiGLUWeights]
        # the grouped block (moe_grouped.py): off CUDA, or with the compiled kernels and q4 experts
        grouped_on = use_grouped(self.device, self.moe_kernel, trunk, p, self.linear)
        grouped = None
        if self.expert_cache is not None:  # routed experts stay on the host; device slots cache them
            slots = self.expert_cache.make_layer(
                host_experts(c, trunk, p, dtype=self.dtype),
                linear=self.linear,
                dtype=self.dtype,
                stacked=grouped_on,
            )
            experts = slots
            if grouped_on:
                grouped = GroupedExperts(*slots.stacks(), kernel=self.moe_kernel, slots=slots)
        elif grouped_on:
            gate_up, down = load_expert_stacks(trunk, p, c.num_experts, device=self.device, dtype=self.dtype)
            experts = [
                SwiGLUWeights(gate_up[e, :inter], gate_up[e, inter:], down[e]) for e in range(c.num_experts)
            ]
            grouped = GroupedExperts(gate_up, down, kernel=self.moe_kernel)
        elif f"{p}.experts.gate_up_proj" in trunk:
            gate_up, down = get(f"{p}.experts.gate_up_proj"), get(f"{p}.experts.down_proj")
            experts = [
                SwiGLUWeights(gate_up[e, :inter], gate_up[e, inter:], down[e]) for e in range(c.num_experts)
            ]
        else:
            experts = [
                SwiGLUWeights(
                    get(f"{p}.experts.{e}.gate_proj.weight"),
                    get(f"{p}.experts.{e}.up_proj.weight"),
                    get(f"{p}.experts.{e}.down_proj.weight"),
                )
                for e in range(c.num_experts)
            ]
        shared = SwiGLUWeights(
            get(f"{p}.shared_expert.gate_proj.weight"),
            get(f"{p}.shared_expert.up_proj.weight"),
            get(f"{p}.shared_expert.down_proj.weight"),
        )
        return SparseMoeWeights(
            get(f"{p}.gate.weight"), experts, shared, get(f"{p}.shared_expert_gate.weight"), grouped
        )

    # ---- protocol ----

    def new_lane(self) -> HybridLaneState:
        """A fresh lane: empty KV caches, zero conv states, zero float32 recurrent states."""
        c, dev = self.config, self.device
        keys = [
            torch.zeros(c.num_key_value_heads, 0, c.head_dim, dtype=self.dtype, device=dev)
            for _ in self._attn_slot
        ]
        values = [k.clone() for k in keys]
        conv = [
            torch.zeros(c.linear_conv_dim, c.linear_conv_kernel_dim - 1, dtype=self.dtype, device=dev)
            for _ in self._gdn_slot
        ]
        rec = [
            torch.zeros(
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
                dtype=torch.float32,
                device=dev,
            )
            for _ in self._gdn_slot
        ]
        return HybridLaneState(self, keys, values, conv, rec)

    @torch.no_grad()
    def forward(
        self,
        states: Sequence[HybridLaneState],
        columns: Sequence[torch.Tensor],
        *,
        logits: str = "all",
        record: bool = True,
        output_hidden_states: bool = False,
        tap_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """Run every lane's columns through the model once (see the module docstring).

        Args:
            states: the lanes (from `new_lane`), none with a pending forward, each at most once.
            columns: columns[i] int64 [n_i] (n_i >= 1), the tokens after lane i's committed prefix;
                their positions are num_tokens .. num_tokens + n_i - 1.
            logits: "all" (every column) or "last" (each lane's last column only).
            record: keep the GDN state after every column (verify rounds, any partial commit): the
                token-by-token recurrence runs and n_i float32 states per GDN layer
                ([n_i, v_heads, k_head_dim, v_head_dim]) are held until commit. False (prompts) runs
                the chunked algorithm and allows only a whole (or zero) commit.
            output_hidden_states: also return the last decoder layer's output (pre final norm).
            tap_layers: decoder layer indices whose outputs to return concatenated (DFlash2 taps).

        Returns:
            ForwardOutput with float32 logits per lane [n_i, vocab] (or [1, vocab]); hidden states
            [n_i, hidden] and taps [n_i, len(tap_layers) * hidden] in the executor's dtype.

        Raises:
            StateError: a lane already has a pending forward, appears twice, belongs to another
                executor, or would pass max_position_embeddings.
            ValueError: malformed columns (not 1-D integer, empty, token id outside the vocabulary),
                an unknown `logits` mode, or a tap layer outside 0..num_hidden_layers-1.
        """
        states, columns = list(states), columns if isinstance(columns, list) else list(columns)
        taps_wanted = self._check_forward(states, columns, logits, tap_layers)
        c = self.config
        lens = [int(col.numel()) for col in columns]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        ids = torch.cat([col.reshape(-1) for col in columns]).to(device=self.device, dtype=torch.long)
        positions = torch.cat(
            [torch.arange(s.num_tokens, s.num_tokens + n) for s, n in zip(states, lens, strict=True)]
        )
        freqs = positions.to(self.device).float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

        windows: list[list[torch.Tensor]] = [[] for _ in states]
        recs: list[list[torch.Tensor]] = [[] for _ in states]
        tapped: dict[int, torch.Tensor] = {}
        h = F.embedding(ids, self._embed)
        for layer in self._layers:
            x = rms_norm_one_plus(h, layer.input_norm, c.rms_norm_eps)
            if layer.attn is not None:
                mixed = self._attention(layer, x, states, lens, starts, cos, sin)
            else:
                mixed = self._gated_deltanet(layer, x, states, lens, starts, record, windows, recs)
            h = h + mixed
            x = rms_norm_one_plus(h, layer.post_norm, c.rms_norm_eps)
            if isinstance(layer.mlp, SparseMoeWeights):
                assert isinstance(c, Qwen3_5MoeConfig | Qwen3NextConfig)
                h = h + sparse_moe_block(
                    x,
                    layer.mlp,
                    top_k=c.num_experts_per_tok,
                    norm_topk_prob=c.norm_topk_prob,
                    linear=self.linear,
                )
            else:
                h = h + swiglu_mlp(x, layer.mlp, linear=self.linear)
            if layer.index in taps_wanted:
                tapped[layer.index] = h

        if logits == "last":
            rows = torch.tensor([s + n - 1 for s, n in zip(starts, lens, strict=True)], device=self.device)
            normed = rms_norm_one_plus(h[rows], self._final_norm, c.rms_norm_eps)
            out_logits = list(self.linear(normed, self._lm_head, None).float().split(1))
        else:
            normed = rms_norm_one_plus(h, self._final_norm, c.rms_norm_eps)
            out_logits = list(self.linear(normed, self._lm_head, None).float().split(lens))
        for i, state in enumerate(states):
            state._pending = _Pending(lens[i], record, windows[i], recs[i])
        hidden = list(h.split(lens)) if output_hidden_states else None
        taps = None
        if tap_layers:
            taps = list(torch.cat([tapped[t] for t in tap_layers], dim=-1).split(lens))
        return ForwardOutput(logits=out_logits, hidden_states=hidden, taps=taps)

    def commit(self, states: Sequence[HybridLaneState], num_keep: Sequence[int]) -> None:
        """Keep the first num_keep[i] columns of lane i's pending forward (0 discards them all).

        Afterwards the lane's state equals the state reached by feeding its committed tokens alone.
        All lanes are checked before any is changed.

        Raises:
            StateError: lengths differ, a lane has no pending forward or appears twice, num_keep[i]
                is outside 0..n_i, or a `record=False` forward is committed partially.
        """
        states, keeps = self._check_commit(states, num_keep)
        conv_len = self.config.linear_conv_kernel_dim - 1
        for state, keep in zip(states, keeps, strict=True):
            state._apply_commit(keep, conv_len)

    # ---- internals ----

    def _check_commit(
        self, states: Sequence[HybridLaneState], num_keep: Sequence[int]
    ) -> tuple[list[HybridLaneState], list[int]]:
        """The checks of `commit`, all lanes before any is changed: (states, keeps) as lists.

        Raises:
            StateError: as `commit`.
        """
        states = list(states)
        keeps = [operator.index(k) for k in num_keep]
        if len(states) != len(keeps):
            raise StateError(f"commit got {len(states)} lanes but {len(keeps)} num_keep values")
        if len({id(s) for s in states}) != len(states):
            raise StateError("commit got the same lane more than once")
        for i, (state, keep) in enumerate(zip(states, keeps, strict=True)):
            self._check_owner(state, i)
            pending = state._pending
            if pending is None:
                raise StateError(f"lane {i}: commit without a pending forward")
            if not 0 <= keep <= pending.num_columns:
                raise StateError(f"lane {i}: num_keep {keep} is outside 0..{pending.num_columns}")
            if not pending.record and keep not in (0, pending.num_columns):
                raise StateError(
                    f"lane {i}: the forward ran with record=False (prefill), so it can only be committed "
                    f"whole ({pending.num_columns}) or discarded (0), not {keep}; "
                    "use record=True for verify rounds"
                )
        return states, keeps

    def _slot(self, layer: int, *, attention: bool) -> int:
        table = self._attn_slot if attention else self._gdn_slot
        if layer not in table:
            kind = "full-attention" if attention else "linear-attention"
            raise ValueError(f"layer {layer} is not a {kind} layer (layer_types: {self.config.layer_types})")
        return table[layer]

    def _check_owner(self, state: object, lane: int) -> None:
        if not isinstance(state, HybridLaneState) or state._owner is not self:
            raise StateError(f"lane {lane}: state was not created by this executor's new_lane()")

    def _check_forward(
        self,
        states: list[HybridLaneState],
        columns: list[torch.Tensor],
        logits: str,
        tap_layers: Sequence[int],
    ) -> set[int]:
        c = self.config
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        if not states or len(states) != len(columns):
            raise ValueError(
                f"forward needs one column tensor per lane (got {len(states)} lanes, "
                f"{len(columns)} column tensors)"
            )
        if len({id(s) for s in states}) != len(states):
            raise StateError("forward got the same lane more than once")
        in_range = getattr(columns, "in_range", False)  # `round_batch.InRangeColumns`: no device read
        for i, (state, col) in enumerate(zip(states, columns, strict=True)):
            self._check_owner(state, i)
            if state._pending is not None:
                raise StateError(f"lane {i}: forward while the previous forward is not committed")
            if (
                not isinstance(col, torch.Tensor)
                or col.dim() != 1
                or col.numel() == 0
                or col.is_floating_point()
            ):
                raise ValueError(f"lane {i}: columns must be a non-empty 1-D integer tensor")
            if not in_range:
                lo, hi = int(col.min()), int(col.max())
                if lo < 0 or hi >= c.vocab_size:
                    raise ValueError(f"lane {i}: token id outside 0..{c.vocab_size - 1} (min {lo}, max {hi})")
            if state.num_tokens + col.numel() > c.max_position_embeddings:
                raise StateError(
                    f"lane {i}: {state.num_tokens} + {col.numel()} tokens would pass "
                    f"max_position_embeddings {c.max_position_embeddings}"
                )
        bad = [t for t in tap_layers if not (isinstance(t, int) and 0 <= t < c.num_hidden_layers)]
        if bad:
            raise ValueError(f"tap_layers {bad} outside 0..{c.num_hidden_layers - 1}")
        return set(tap_layers)

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        states: list[HybridLaneState],
        lens: list[int],
        starts: list[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        c, a = self.config, layer.attn
        assert a is not None
        rows, hd, nh, nkv = x.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads
        q_lin, k_lin, v_lin = self._attn_projections(a, x)
        qg = q_lin.view(rows, nh, 2 * hd)
        gate = qg[..., hd:].reshape(rows, nh * hd)
        q = rms_norm_one_plus(qg[..., :hd], a.q_norm, c.rms_norm_eps)
        k = rms_norm_one_plus(k_lin.view(rows, nkv, hd), a.k_norm, c.rms_norm_eps)
        v = v_lin.view(rows, nkv, hd)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        out = x.new_empty(rows, nh, hd)
        for state, start, n in zip(states, starts, lens, strict=True):
            past = state.num_tokens
            total = past + n
            keys, values = state._reserve_kv(layer.slot, total)
            keys[:, past:total] = k[start : start + n].transpose(0, 1)
            values[:, past:total] = v[start : start + n].transpose(0, 1)
            mask = None
            if n > 1:
                mask = (
                    torch.arange(total, device=self.device)[None, :]
                    <= torch.arange(past, total, device=self.device)[:, None]
                )
            o = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1).unsqueeze(0),
                keys[:, :total].unsqueeze(0),
                values[:, :total].unsqueeze(0),
                attn_mask=mask,
                scale=hd**-0.5,
                enable_gqa=nh != nkv,
            )
            out[start : start + n] = o[0].transpose(0, 1)
        return self.linear(out.reshape(rows, nh * hd) * torch.sigmoid(gate), a.o_proj, a.o_bias)

    def _fuse(self, trunk: Mapping[str, Any], names: Sequence[str]) -> _Weight | None:
        """The linear weights `names` stacked along their output rows (`qwen3_5.HYBRID_FUSED_LINEARS`) and
        placed for the linear hook, or None to keep them apart: a member is missing, the members mix
        dense and q4 weights, dtypes or in_features, or the hook's compiled functions serve every
        member's shape but not the stacked one (an artifact built before the fusion)."""
        if not all(n in trunk for n in names):
            return None
        raw = [trunk[n] for n in names]
        if len({isinstance(w, Q4Weight) for w in raw}) != 1:
            return None
        q4 = isinstance(raw[0], Q4Weight)
        if not q4 and len({w.dtype for w in raw}) != 1:
            return None
        ks = {int(w.in_features) if isinstance(w, Q4Weight) else int(w.shape[-1]) for w in raw}
        if len(ks) != 1 or any((w.ndim if isinstance(w, torch.Tensor) else 2) != 2 for w in raw):
            return None
        k = ks.pop()
        compiled = getattr(self.linear, "compiled", None)
        if compiled is not None and len(compiled):
            kinds = ("q4_g32", "q4_g32_tiled") if q4 else ("dense",)

            def served(n: int) -> bool:
                return any(compiled.functions_for(kind, n, k) for kind in kinds)

            if not served(sum(_out_rows(w) for w in raw)) and any(served(_out_rows(w)) for w in raw):
                return None
        dev, dt = self.device, self.dtype
        parts = [to_device(w if isinstance(w, Q4Weight) else w.detach(), dev, dt) for w in raw]
        parts = [w.to_row_major() if isinstance(w, Q4Weight) else w for w in parts]
        return place_weight(self.linear, cat_rows(parts).contiguous())

    def _attn_projections(
        self, a: _AttentionWeights, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_proj's output [R, 2 heads head_dim] (per head [query | gate]), k [R, kv_heads head_dim],
        v [R, kv_heads head_dim]) in the model dtype: views of one GEMM's output when fused."""
        c, linear = self.config, self.linear
        if a.qkv_proj is not None:
            kv = c.num_key_value_heads * c.head_dim
            q_rows = 2 * c.num_attention_heads * c.head_dim
            q, k, v = linear(x, a.qkv_proj, a.qkv_bias).split([q_rows, kv, kv], -1)
            return q, k, v
        assert a.q_proj is not None and a.k_proj is not None and a.v_proj is not None
        return linear(x, a.q_proj, a.q_bias), linear(x, a.k_proj, a.k_bias), linear(x, a.v_proj, a.v_bias)

    def _gdn_projections(
        self, g: _GdnWeights, x: torch.Tensor, *, narrow: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv [R, conv_dim], z [R, v_heads, v_dim], b [R, v_heads], a [R, v_heads]) in the model dtype.

        narrow: a `ignis.runtime.kernels.fused_norms.FusedNormsKernel` whose ``narrow_linear``
        runs the b|a projection when it takes the weight (`FusedNormsKernel.takes_narrow`: one launch
        instead of cuBLAS's split-K pair); None: `linear` for every projection."""
        c = self.config
        rows = x.shape[0]
        linear = self.linear

        def linear_ba(w: _Weight) -> torch.Tensor:
            if narrow is not None and narrow.takes_narrow(x, w):
                return narrow.narrow_linear(x, w)
            return linear(x, w, None)

        nk, nv, dk, dv = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        if g.in_proj_qkvz is None:
            # fused weights: views of one GEMM's output (their consumers take strides)
            if g.in_proj_b_a is not None:
                b, a = linear_ba(g.in_proj_b_a).split([nv, nv], -1)
            else:
                assert g.in_proj_b is not None and g.in_proj_a is not None
                b, a = linear_ba(g.in_proj_b), linear_ba(g.in_proj_a)
            if g.in_proj_qkv_z is not None:
                qkv, z = linear(x, g.in_proj_qkv_z, None).split([2 * nk * dk + nv * dv, nv * dv], -1)
            else:
                assert g.in_proj_qkv is not None and g.in_proj_z is not None
                qkv, z = linear(x, g.in_proj_qkv, None), linear(x, g.in_proj_z, None)
            return qkv, z.view(rows, nv, dv), b, a
        # qwen3_next: outputs grouped per key head:
        # [q (dk) | k (dk) | v (r*dv) | z (r*dv)] and [b (r) | a (r)].
        assert g.in_proj_ba is not None
        r = nv // nk
        q, k, v, z = (
            linear(x, g.in_proj_qkvz, None)
            .view(rows, nk, 2 * dk + 2 * r * dv)
            .split([dk, dk, r * dv, r * dv], -1)
        )
        b, a = linear_ba(g.in_proj_ba).view(rows, nk, 2 * r).split([r, r], -1)
        qkv = torch.cat([q.reshape(rows, -1), k.reshape(rows, -1), v.reshape(rows, -1)], dim=-1)
        return qkv, z.reshape(rows, nv, dv), b.reshape(rows, nv), a.reshape(rows, nv)

    def _gated_deltanet(
        self,
        layer: _Layer,
        x: torch.Tensor,
        states: list[HybridLaneState],
        lens: list[int],
        starts: list[int],
        record: bool,
        windows: list[list[torch.Tensor]],
        recs: list[list[torch.Tensor]],
    ) -> torch.Tensor:
        c, g = self.config, layer.gdn
        assert g is not None
        nk, nv, dk, dv = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        rep = nv // nk
        qkv, z, b, a = self._gdn_projections(g, x)
        beta = torch.sigmoid(b).float()  # sigmoid in the model dtype, as HF
        decay = -torch.exp(g.a_log.float()) * F.softplus(a.float() + g.dt_bias.float())
        core = x.new_empty(x.shape[0], nv, dv)
        for lane, (state, start, n) in enumerate(zip(states, starts, lens, strict=True)):
            rows = slice(start, start + n)
            window = torch.cat([state._conv[layer.slot], qkv[rows].transpose(0, 1)], dim=1)
            conv = causal_conv1d_silu(window, g.conv).transpose(0, 1)  # [n, conv_dim]
            prev = state._rec[layer.slot]
            if not record:  # a prompt: norms + chunked rule from the conv output, into core
                _, new_state = gated_delta_prefill(
                    conv[:, : 2 * nk * dk].unflatten(-1, (2, nk, dk)),
                    conv[:, 2 * nk * dk :].unflatten(-1, (nv, dv)),
                    decay[rows],
                    beta[rows],
                    prev,
                    out=core[rows],
                )
                windows[lane].append(window[:, n:].clone())  # the conv state after the last column
                recs[lane].append(new_state)
                continue
            q, k, v = conv.split([nk * dk, nk * dk, nv * dv], dim=-1)
            q = l2_normalize(q.float().reshape(n, nk, dk))
            k = l2_normalize(k.float().reshape(n, nk, dk))
            if rep > 1:
                q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
            q = q * dk**-0.5
            v = v.float().reshape(n, nv, dv)
            o, new_state = gated_delta_rule_recurrent(q, k, v, decay[rows], beta[rows], prev, record=True)
            core[rows] = o.to(x.dtype)
            windows[lane].append(window)
            recs[lane].append(new_state)
        out = gated_rms_norm(core, z, g.norm, c.rms_norm_eps)
        return self.linear(out.reshape(x.shape[0], nv * dv), g.out_proj, None)


def _check_weights(config: HybridConfig, trunk: Mapping[str, _Weight]) -> None:
    """Refuse a weight set that does not match the config (all missing / unexpected names at once)."""
    layout = "fused" if any(k.endswith(".mlp.experts.gate_up_proj") for k in trunk) else "per_expert"
    expected = tensor_shapes(config, expert_layout=layout)
    missing = sorted(set(expected) - set(trunk))
    unexpected = sorted(set(trunk) - set(expected))
    if missing or unexpected:
        raise TensorSetError(
            f"{config.model_type} weights: {len(missing)} missing tensor(s) {missing}; "
            f"{len(unexpected)} unexpected {unexpected}",
            missing=missing,
            unexpected=unexpected,
        )
    for name, shape in expected.items():
        tensor = trunk[name]
        if tuple(tensor.shape) != shape:
            raise TensorShapeError(
                f"{config.model_type} weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {shape}"
            )
        if not isinstance(tensor, Q4Weight) and not tensor.is_floating_point():
            raise ValueError(
                f"{config.model_type} weights: tensor {name!r} has non-floating dtype {tensor.dtype}"
            )
