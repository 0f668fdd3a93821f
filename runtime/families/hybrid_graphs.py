"""Static-shape verify rounds for the hybrid families, replayed from CUDA graphs.

`StaticHybridExecutor` is the `HybridExecutor` (same weights, same per-layer math, same linear hook)
with every lane's state in fixed buffers allocated once, so that a verify round is a fixed sequence of
kernels over fixed addresses: on CUDA it is captured once per shape and replayed; on the CPU (and with
``cuda_graphs=False``) the very same code runs eagerly, which is how the CPU tests prove it.

State (allocated at construction; grown only by `new_lane` when every slot is taken):

* ``capacity = max_context + max_columns`` token slots per lane; ``max_lanes`` lane slots. A lane
  (`new_lane`) takes a free slot; `release_lane` (or dropping the state object) gives it back. With
  every slot taken, `new_lane` doubles the pools (copying them; the graphs are recaptured).
* KV: per full-attention layer ``[max_lanes, capacity, kv_heads, head_dim]`` (model dtype) keys and
  values; conv state ``[gdn_layers, max_lanes, conv_dim, kernel - 1]`` (model dtype); recurrent state
  ``[gdn_layers, max_lanes, v_heads, k_head_dim, v_head_dim]`` float32.
* The round's record: ``[gdn_layers, max_columns, max_lanes, v_heads, k_head_dim, v_head_dim]``
  float32, the recurrent state after every column of the current round (by round position, not
  slot), and the conv windows ``[gdn_layers, max_lanes, conv_dim, kernel - 1 + max_columns]``.
  SGLang and vLLM keep such intermediate SSM states for speculative decoding too. For the 27B shape
  (48 GDN layers, 48 x 128 x 128 heads) at 8 lanes x 8 columns the record is 9.7 GB. With a fused
  GDN module that has the stash round and the replay (`GdnRecurrentKernel.has_replay`) there is no
  record: the round writes a stash ``[gdn_layers, max_columns, max_lanes, W]`` float32 of what each
  column fed the recurrence (W = k_heads k_dim + v_heads v_dim + 2 v_heads: 33 KB a column for the
  27B, 101 MB at 8 x 8) and `commit` replays the kept columns from it, every layer and lane in one
  launch, to the same state bit for bit. The stash path exists because the record's writes bound
  the round's recurrence at 8 columns and more.

A *static round* is a forward whose lanes have n_i <= max_columns columns. It runs as one shape keyed
by (lanes L, padded columns n, KV bucket T, hidden states wanted, tap layers), n the smallest of
`column_widths` >= max n_i (by default the powers of two below max_columns and max_columns; `warm_up`
adds the verify width draft_tokens + 1, so verify rounds run unpadded): the lanes' columns are padded
with dummy columns (token 0) whose outputs are discarded and which commit never keeps.
Every data-dependent quantity is a device tensor in one static input buffer (token ids, positions,
slot ids); attention gathers the lanes' caches up to T (the smallest power-of-two bucket, from
`kv_bucket`, holding every lane's past + n) with a causal mask built from the positions; keys and
values of every column (dummy ones too, past the lane's committed length, where they are overwritten
later) are written into the cache; the Gated DeltaNet runs the token-by-token recurrence batched over
lanes and heads, writing each column's state into the record; logits of every row (and hidden states,
taps) are the outputs. `commit` then costs a handful of device ops: the kept state is copied out of
the record (one copy per lane, no temporary) or replayed from the stash (one launch), the kept conv
window gathered out of the windows (all lanes together), and KV commits by moving the host-side
length. The record belongs to the round: a
static round must be committed before the next one starts (`StateError` otherwise).

CUDA graphs: captured per key, at load by `warm_up` (every lane count 1..max_lanes x `column_widths`
x the KV buckets up to a context bound, in free lane slots) and lazily for any other key (warm-up on a
side stream first, as the torch.cuda.graphs docs say, which also loads every compiled module once:
they are capture-safe after a first run, ADR 0001), all graphs sharing one memory pool; compiled q4
modules launch on torch's stream (`ignis.runtime.kernels.tvm_runtime.capture`). Every graph writes
its outputs into one set of static buffers of max_lanes x max_columns rows (logits float32, hidden
states, taps), sliced per key, so a captured shape keeps no outputs of its own and the pool holds
only the largest shape's intermediates (for the 27B's vocabulary of 248,320 at 8 x 8: 64 MB of logits
in all, instead of 4 bytes x vocab x rows of every captured shape: 536 MB per KV bucket over lanes 1..8
x widths 1, 2, 4, 8). A replay's outputs are copied out (one clone per output), so returned logits
survive the next round. Graphs are off (the static path runs eagerly, still batched
over lanes) for configs with MoE layers whose routing syncs the host through `sparse_moe_block`'s
reference loop (``torch.unique`` + ``.tolist()``), which a capture cannot contain. With every expert
resident and the compiled grouped expert kernels (``moe_module``; `ignis.runtime.families.moe_grouped`)
a MoE layer stays on the device and rounds are graphed as for the dense families. With an expert
cache on the grouped block (one copy of the routed ids to the host a layer) a static round is split
at its MoE layers (`ignis.runtime.families.moe_piecewise`): on CUDA each piece between two host
syncs is its own graph (`piecewise_graphs`: 1 + MoE layers graphs a round shape, captured at load
by `warm_up` as the whole-round graphs are), the expert lookups, copies and grouped launches run on
the host between them; elsewhere the same split runs eagerly.

Chunked prefill (``chunked_prefill``): a ``record=False`` forward (a prompt) whose longest lane has
more than max_columns but at most ``chunked_prefill`` columns runs as consecutive static rounds of
max_columns columns (graphed on CUDA; a chunk holds the lanes that still have columns), each committed
whole before the next. The protocol lets a ``record=False`` forward only be committed whole or
discarded (0): before the first chunk the lanes' conv and recurrent states are copied aside
(``4 x gdn_layers x v_heads x k_dim x v_dim`` bytes plus the conv state per lane, 151 MB for the
27B shape) and the lanes' lengths put back after the last chunk, so commit(whole) only moves the
lengths and commit(0) copies the states back (the chunks' keys and values lie past the committed
length, where they are masked and later overwritten); an error in a chunk restores the lanes the same
way. Default: ``4 x max_columns`` with CUDA graphs, else 0 (off: the CPU and MoE configs keep the
eager path below unless asked). Numerics: a static round's, i.e. the token-by-token recurrence
instead of the chunked one (float32 ~1e-5).

Other forwards with more than max_columns columns in some lane (prompts) run eagerly over the same pooled
buffers: attention batched over lanes (only the real columns' keys are written), the GDN per lane
with its true length (``record=False``: `gated_delta_prefill`, the chunked rule from the conv output;
``record=True``: token by token); their final (or per-column) states wait in the lane until commit,
as in `HybridExecutor` (a ``record=False`` forward keeps only the conv state after its last column
and the final recurrent state, each its own tensor: it can only be committed whole).

Numerics follow `HybridExecutor`'s per lane, casts included (RoPE, the conv, the recurrence; a static
round runs the token-by-token recurrence also for ``record=False``), with three differences of
float32 rounding only: attention is one masked SDPA over the bucket instead of an unmasked one over
the lane's exact length, RMSNorms use torch's `F.rms_norm` (fused on CUDA) with (1 + w) precomputed,
and the recurrence's state update is one fused ``baddbmm``. Float32 results agree to ~1e-5
(tests: 1e-4), bf16 logits to bf16 rounding (argmax equal on the 27B-shaped benchmark).

The compiled kernels below are bound in `ignis.runtime.kernels` (their ABI, limits and loaders);
this module only decides where a round uses them.

Fused GDN recurrence (``gdn_module``, `GdnRecurrentKernel`): a library built by
``ignis.compiler.kernels.gdn_recurrent.build_gdn_recurrent`` replaces, in static rounds on CUDA, the
preparation (q/k l2 norms, q scale, GQA repeat, sigmoid(b), the decay) and the per-column loop by one
launch per GDN layer that keeps the state on chip across the round's columns and writes the record
in the layout `commit` reads (same float32 math; outputs rounded to the model dtype once, as here).
Long (eager) forwards keep the torch path.

Fused row norms (``norms_module``, `FusedNormsKernel`): a module built by
``ignis.compiler.kernels.fused_norms.build_fused_norms`` runs, in static rounds on CUDA, each residual
add together with the (1 + w) RMSNorm after it (``add_rms_norm``; the MLP's output is added by the
next layer's input norm, or the final norm, unless the layer is tapped) and the GDN gated RMSNorm
(``gated_rms_norm``, when the norm weight has the model dtype), one launch each instead of 5 and 8
torch kernels; same rounding points (float32 math, model-dtype casts where the torch path casts).
Long (eager) forwards keep the torch ops.

Fused mixer pieces (``mixers_module``, `FusedMixersKernel`): a module built by
``ignis.compiler.kernels.fused_mixers.build_fused_mixers`` runs, in static rounds on CUDA, the GDN
conv state gather + causal conv1d + SiLU together with the window write commit reads
(``gdn_conv_silu``, one launch per GDN layer instead of ~6; when the conv weight has the model dtype)
and attention's q/k (1 + w) RMSNorm + partial RoPE + KV scatter into the lanes' caches
(``qk_norm_rope_kv``, one launch per attention layer instead of ~20; cos/sin stay computed once per
round by torch); same rounding points. Long (eager) forwards keep the torch ops.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ignis.runtime.errors import StateError
from ignis.runtime.families.base import ForwardOutput
from ignis.runtime.families.gated_deltanet import (
    gated_delta_prefill,
    gated_delta_rule_recurrent,
    gated_rms_norm_lean,
    l2_normalize,
)
from ignis.runtime.families.hybrid_executor import (
    HybridExecutor,
    _apply_rope,
    _Layer,
)
from ignis.runtime.families.llama_graphs import default_column_widths
from ignis.runtime.families.moe import SparseMoeWeights, SwiGLUWeights, sparse_moe_block, swiglu_mlp
from ignis.runtime.families.moe_piecewise import MoeRoundBuffers, PiecewiseMoe, piecewise_layers
from ignis.runtime.families.qwen3_5 import HybridConfig, Qwen3_5MoeConfig, Qwen3NextConfig
from ignis.runtime.families.static_rounds import (
    CapturedRound,
    PooledLaneState,
    capture_round,
    host_columns,
    kv_bucket,
    run_chunks,
)
from ignis.runtime.kernels.fused_mixers import FusedMixersKernel
from ignis.runtime.kernels.fused_norms import SILU_MUL_MAX_ROWS, FusedNormsKernel
from ignis.runtime.kernels.gdn_recurrent import MAX_KEY_DIM as GDN_MAX_KEY_DIM
from ignis.runtime.kernels.gdn_recurrent import GdnRecurrentKernel, gdn_stash_width
from ignis.runtime.linear import LinearFn, Q4Weight

__all__ = [
    "CHUNKED_PREFILL_ROUNDS",
    "DEFAULT_MAX_CONTEXT",
    "StaticHybridExecutor",
    "StaticLaneState",
]

log = logging.getLogger("ignis.runtime.hybrid_graphs")

DEFAULT_MAX_CONTEXT = 8192
"""Token capacity per lane when neither the caller nor a smaller model limit gives one."""

CHUNKED_PREFILL_ROUNDS = 4
"""Default `StaticHybridExecutor.chunked_prefill` (with CUDA graphs): prompts of up to this many
max_columns chunks run as static rounds."""


@dataclass
class _StaticPending:
    num_columns: int
    record: bool
    position: int  # the lane's index in its forward (its rows in the round buffer)
    static: bool  # True: the state after column t is record[:, t, position]
    # eager: per GDN slot [conv_dim, kernel - 1 + n] (record) or [conv_dim, kernel - 1], the conv state
    # after the last column (record=False)
    conv_windows: list[torch.Tensor] | None = None
    rec_states: list[torch.Tensor] | None = None  # eager: per GDN slot [n, hv, dk, dv] or [hv, dk, dv]
    # chunked prefill: the lane's (conv [G, C, kd], recurrent [G, hv, dk, dv]) before the forward; its
    # chunks are committed already, so commit(whole) moves the length and commit(0) restores these
    saved: tuple[torch.Tensor, torch.Tensor] | None = None
    # static: the kernel whose stash path the round ran, so commit replays the kept columns with it
    # (None: commit copies the kept state out of the record)
    replay: GdnRecurrentKernel | None = None


class StaticLaneState(PooledLaneState):
    """One lane of a `StaticHybridExecutor`: a slot in its pooled buffers plus the committed length
    (`PooledLaneState`). Created by `StaticHybridExecutor.new_lane`; the inspectors below mirror
    `HybridLaneState`'s."""

    _pending: _StaticPending | None

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed (keys, values) of full-attention layer `layer`, each [kv_heads, num_tokens,
        head_dim] in the executor's dtype. Views into the pool: do not modify.

        Raises:
            ValueError: `layer` is not a full-attention layer.
        """
        o = self._owner
        a = o._slot(layer, attention=True)
        n = self._num_tokens
        return o._keys[a][self._slot, :n].transpose(0, 1), o._values[a][self._slot, :n].transpose(0, 1)

    def conv_state(self, layer: int) -> torch.Tensor:
        """Conv state of GDN layer `layer`, [conv_dim, kernel - 1] (a view into the pool).

        Raises:
            ValueError: `layer` is not a linear-attention layer.
        """
        o = self._owner
        return o._conv[o._slot(layer, attention=False), self._slot]

    def recurrent_state(self, layer: int) -> torch.Tensor:
        """Recurrent state of GDN layer `layer`, float32 [v_heads, k_head_dim, v_head_dim] (a view).

        Raises:
            ValueError: `layer` is not a linear-attention layer.
        """
        o = self._owner
        return o._rec[o._slot(layer, attention=False), self._slot]


class StaticHybridExecutor(HybridExecutor):
    """The `Executor` protocol over pooled static buffers, CUDA-graphed on CUDA (module docstring).

    Args:
        config, weights, device, dtype, linear: as `HybridExecutor`.
        max_lanes: lane slots allocated up front (>= 1); a lane past them doubles the pools.
        max_context: tokens a lane may hold (prompt + output); default min(the model's
            max_position_embeddings, `DEFAULT_MAX_CONTEXT`). `SpeculativeEngine` caps its context to it.
        max_columns: most columns per lane of a static (graphed) round, >= 1 (8 = anchor + 7 drafts).
        cuda_graphs: capture and replay static rounds (default: on CUDA, unless the config has MoE
            layers that sync the host, see the module docstring; with an expert cache on the grouped
            block: in pieces, `piecewise_graphs`). True on a CPU device raises ValueError; False
            turns piecewise graphs off too.
        chunked_prefill: most columns per lane of a ``record=False`` forward run as chunks of
            max_columns static rounds (module docstring); None: ``CHUNKED_PREFILL_ROUNDS x
            max_columns`` when cuda_graphs, else 0 (off). Also settable later as the attribute.
        kv_bucket: the smallest KV length bucket (a power of two; buckets double up to the capacity).
        gdn_module: the fused GDN recurrence (`GdnRecurrentKernel`, its function, a loaded module or
            a ``.so`` path) for static rounds on CUDA; None: the torch loop. Also settable later as
            the ``gdn_module`` attribute (captured graphs are dropped then).
        norms_module: the fused row norms (`FusedNormsKernel`, a loaded module or a ``.so`` path
            from ``ignis.compiler.kernels.fused_norms.build_fused_norms``) for static rounds on
            CUDA: the residual adds fused with the following (1 + w) RMSNorm, the GDN gated RMSNorm;
            None: the torch ops. Also settable later as the ``norms_module`` attribute (captured
            graphs are dropped then).
        mixers_module: the fused mixer pieces (`FusedMixersKernel`, a loaded module or a ``.so`` path
            from ``ignis.compiler.kernels.fused_mixers.build_fused_mixers``) for static rounds on
            CUDA: the GDN conv1d + SiLU (reading the pooled conv states, writing the windows commit
            reads) and attention's q/k RMSNorm + RoPE + KV write; None: the torch ops. Also
            settable later as the ``mixers_module`` attribute (captured graphs are dropped then).
        expert_cache: routed experts in host memory behind device slots (`HybridExecutor`).
        moe_module: the compiled grouped expert kernels (`HybridExecutor`); with them and no
            expert cache the MoE layers need no host sync and rounds are graphed.
        column_widths: the column counts static rounds are padded to (each 1..max_columns; max_columns
            is always one); None: the powers of two below max_columns, and max_columns. `warm_up`
            adds to them.

    Memory (bytes): KV 2 x attn_layers x max_lanes x capacity x kv_heads x head_dim x dtype size;
    recurrent state 4 x gdn_layers x max_lanes x v_heads x k_dim x v_dim, and max_columns times that
    for the record (the torch recurrence and GDN modules without replay), or 4 x gdn_layers x
    max_columns x max_lanes x `gdn_stash_width` for the stash (modules with replay).

    Raises:
        ValueError: max_lanes, max_columns, kv_bucket, max_context or a column width out of range;
            cuda_graphs=True off CUDA or with MoE layers on the reference loop; a gdn_module off CUDA
            or for GDN shapes it does not take; a norms_module or mixers_module off CUDA.
            Otherwise as `HybridExecutor`.
        TvmRuntimeError: a gdn_module, norms_module or mixers_module path that cannot be loaded.
    """

    def __init__(
        self,
        config: HybridConfig,
        weights: Mapping[str, torch.Tensor | Q4Weight],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        linear: LinearFn | None = None,
        max_lanes: int = 8,
        max_context: int | None = None,
        max_columns: int = 8,
        cuda_graphs: bool | None = None,
        kv_bucket: int = 256,
        gdn_module: Any = None,
        norms_module: Any = None,
        mixers_module: Any = None,
        chunked_prefill: int | None = None,
        expert_cache: Any = None,
        moe_module: Any = None,
        column_widths: Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            config,
            weights,
            device=device,
            dtype=dtype,
            linear=linear,
            expert_cache=expert_cache,
            moe_module=moe_module,
        )
        c = config
        if max_lanes < 1 or max_columns < 1:
            raise ValueError(f"max_lanes and max_columns must be >= 1, got {max_lanes}, {max_columns}")
        if kv_bucket < 1 or kv_bucket & (kv_bucket - 1):
            raise ValueError(f"kv_bucket must be a power of two, got {kv_bucket}")
        if max_context is None:
            max_context = min(c.max_position_embeddings, DEFAULT_MAX_CONTEXT)
        if not 1 <= max_context <= c.max_position_embeddings:
            raise ValueError(
                f"max_context must be 1..{c.max_position_embeddings} (max_position_embeddings), "
                f"got {max_context}"
            )
        # MoE layers that sync the host (the reference expert loop, an expert cache) keep graphs off;
        # resident experts run by the compiled grouped kernels do not (moe_grouped.py)
        has_moe = any(
            isinstance(layer.mlp, SparseMoeWeights)
            and not (layer.mlp.grouped is not None and layer.mlp.grouped.capturable)
            for layer in self._layers
        )
        on_cuda = self.device.type == "cuda"
        # an expert cache on the grouped block: static rounds split at the MoE syncs (moe_piecewise.py),
        # graphed in pieces on CUDA
        pieces = piecewise_layers([layer.mlp for layer in self._layers])
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got {self.device}")
        if cuda_graphs and has_moe and not pieces:
            raise ValueError(
                f"{c.model_type}: cuda_graphs=True with MoE layers whose routing syncs the host (no "
                "compiled grouped expert kernels)"
            )
        #: static rounds replayed from whole-round CUDA graphs
        whole = on_cuda and not has_moe if cuda_graphs is None else cuda_graphs and not pieces
        self.cuda_graphs = bool(whole)
        #: static rounds replayed in pieces between the MoE layers' host syncs (an expert cache)
        self.piecewise_graphs = bool(on_cuda and pieces and cuda_graphs is not False)
        self.max_lanes, self.max_columns, self.max_context = max_lanes, max_columns, max_context
        self.capacity = max_context + max_columns
        widths = default_column_widths(max_columns) if column_widths is None else tuple(column_widths)
        for w in widths:
            if not 1 <= int(w) <= max_columns:
                raise ValueError(f"column_widths: {w} outside 1..max_columns {max_columns}")
        self.column_widths: tuple[int, ...] = tuple(sorted({int(w) for w in widths} | {max_columns}))
        self.kv_bucket = kv_bucket
        if chunked_prefill is None:
            chunked_prefill = CHUNKED_PREFILL_ROUNDS * max_columns if self.cuda_graphs else 0
        if chunked_prefill < 0:
            raise ValueError(f"chunked_prefill must be >= 0, got {chunked_prefill}")
        self.chunked_prefill = chunked_prefill
        dev, kd = self.device, c.linear_conv_kernel_dim - 1
        nkv, hd = c.num_key_value_heads, c.head_dim
        hv, dk, dv = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        n_gdn = len(self._gdn_slot)
        self._keys = [
            torch.zeros(max_lanes, self.capacity, nkv, hd, dtype=dtype, device=dev) for _ in self._attn_slot
        ]
        self._values = [torch.zeros_like(k) for k in self._keys]
        self._conv = torch.zeros(n_gdn, max_lanes, c.linear_conv_dim, kd, dtype=dtype, device=dev)
        self._rec = torch.zeros(n_gdn, max_lanes, hv, dk, dv, dtype=torch.float32, device=dev)
        # the round's per-column GDN states (record path) or what it consumed per column (stash path,
        # kernels with replay): allocated for the recurrence in use by `_gdn_buffers`
        self._record: torch.Tensor | None = None
        self._stash: torch.Tensor | None = None
        self._windows = torch.zeros(
            n_gdn, max_lanes, c.linear_conv_dim, kd + max_columns, dtype=dtype, device=dev
        )
        rows = max_lanes * max_columns
        # static inputs: token ids [rows] | positions [rows] | slots [max_lanes]
        self._inputs = torch.zeros(2 * rows + max_lanes, dtype=torch.long, device=dev)
        self._free: list[int] = list(range(max_lanes))
        self._round_open: set[int] = set()  # id() of lanes whose pending forward lives in the round buffer
        self._graphs: dict[tuple[Any, ...], Any] = {}  # CapturedRound, or PiecewiseRound (pieces)
        self._pool: Any = None
        # graphs: the static buffers every captured round writes its outputs into (sliced per shape),
        # and the side stream of the captures' warm-up runs
        self._outputs: dict[str, torch.Tensor] = {}
        self._side_stream: Any = None
        self.num_captures = 0
        self.num_replays = 0
        # per-layer constants computed once (fewer kernels per round): 1 + w of the (1 + w) RMSNorms,
        # float32; -exp(A_log) and dt_bias of the GDN layers, float32
        self._one_plus: dict[int, torch.Tensor] = {}
        norms = [self._final_norm]
        for layer in self._layers:
            norms += [layer.input_norm, layer.post_norm]
            if layer.attn is not None:
                norms += [layer.attn.q_norm, layer.attn.k_norm]
        for w in norms:
            self._one_plus[id(w)] = 1.0 + w.float()
        self._gdn_consts = [
            (-torch.exp(layer.gdn.a_log.float()), layer.gdn.dt_bias.float())
            for layer in self._layers
            if layer.gdn is not None
        ]
        self._gdn_kernel: GdnRecurrentKernel | None = None
        self.gdn_module = gdn_module
        self._norms_kernel: FusedNormsKernel | None = None
        self.norms_module = norms_module
        self._mixers_kernel: FusedMixersKernel | None = None
        self.mixers_module = mixers_module
        self._moe_pieces: PiecewiseMoe | None = None
        if pieces:
            self._moe_pieces = self._make_moe_pieces()

    def _make_moe_pieces(self) -> PiecewiseMoe:
        c = self.config
        assert isinstance(c, Qwen3_5MoeConfig | Qwen3NextConfig)
        lookahead = bool(self.expert_cache is not None and self.expert_cache.lookahead)
        buffers = MoeRoundBuffers(
            self.max_lanes * self.max_columns,
            c.hidden_size,
            c.num_experts_per_tok,
            device=self.device,
            dtype=self.dtype,
            lookahead=lookahead,
        )
        moe = [layer.mlp for layer in self._layers if isinstance(layer.mlp, SparseMoeWeights)]
        return PiecewiseMoe(
            top_k=c.num_experts_per_tok,
            norm_topk_prob=c.norm_topk_prob,
            linear=self.linear,
            buffers=buffers,
            stats=self.expert_cache.stats if self.expert_cache is not None else None,
            next_layer={id(a): b for a, b in itertools.pairwise(moe)} if lookahead else None,
        )

    @property
    def gdn_module(self) -> GdnRecurrentKernel | None:
        """The fused GDN recurrence used by static rounds (None: the torch loop)."""
        return self._gdn_kernel

    @gdn_module.setter
    def gdn_module(self, source: Any) -> None:
        if source is not None:
            if self.device.type != "cuda":
                raise ValueError(f"gdn_module needs a CUDA device, got {self.device}")
            if not GdnRecurrentKernel.supports(self.config):
                c = self.config
                raise ValueError(
                    f"gdn_module: the kernel takes k_dim <= {GDN_MAX_KEY_DIM} and v_heads a multiple of "
                    f"k_heads, got k_dim {c.linear_key_head_dim}, {c.linear_num_value_heads} v_heads, "
                    f"{c.linear_num_key_heads} k_heads"
                )
            source = GdnRecurrentKernel(source)
        self._gdn_kernel = source
        self._gdn_buffers()
        if self._graphs:  # captured with the other recurrence: recaptured on demand, in a new pool
            self._graphs.clear()
            self._pool = None

    @property
    def norms_module(self) -> FusedNormsKernel | None:
        """The fused row norms used by static rounds (None: the torch ops)."""
        return self._norms_kernel

    @norms_module.setter
    def norms_module(self, source: Any) -> None:
        if source is not None:
            if self.device.type != "cuda":
                raise ValueError(f"norms_module needs a CUDA device, got {self.device}")
            source = FusedNormsKernel(source)
        self._norms_kernel = source
        if self._graphs:  # captured with the torch norms: recaptured on demand, in a new pool
            self._graphs.clear()
            self._pool = None

    @property
    def mixers_module(self) -> FusedMixersKernel | None:
        """The fused mixer pieces used by static rounds (None: the torch ops)."""
        return self._mixers_kernel

    @mixers_module.setter
    def mixers_module(self, source: Any) -> None:
        if source is not None:
            if self.device.type != "cuda":
                raise ValueError(f"mixers_module needs a CUDA device, got {self.device}")
            source = FusedMixersKernel(source)
        self._mixers_kernel = source
        if self._graphs:  # captured with the torch ops: recaptured on demand, in a new pool
            self._graphs.clear()
            self._pool = None

    # ---- lanes ----

    def new_lane(self) -> StaticLaneState:  # type: ignore[override]
        """A fresh lane in the lowest free slot: zero conv and recurrent state, empty KV. With every
        slot taken the pools grow to twice max_lanes first (a logged warning; captured graphs are
        dropped and recaptured at the new addresses)."""
        if not self._free:
            self._grow()
        self._free.sort()
        slot = self._free.pop(0)
        self._conv[:, slot].zero_()
        self._rec[:, slot].zero_()
        return StaticLaneState(self, slot)

    @property
    def _replays(self) -> bool:
        """Whether static rounds run the stash path (a fused GDN kernel with replay)."""
        return self._gdn_kernel is not None and self._gdn_kernel.has_replay

    def _gdn_buffers(self) -> None:
        """Allocate the round buffer the GDN recurrence in use needs -- the record [G, max_columns,
        max_lanes, hv, dk, dv] or, with replay, the stash [G, max_columns, max_lanes, W] float32 --
        and free the other one when no round is open (an open round commits from the buffer it ran
        with; the setter, every static forward and every commit call this, so a buffer kept for a
        round open during a swap goes once that round is settled)."""
        c = self.config
        g, dev = len(self._gdn_slot), self.device
        hk, hv, dk, dv = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        mc, ml = self.max_columns, self.max_lanes
        if self._replays:
            if self._stash is None:
                w = gdn_stash_width(hk, hv, dk, dv)
                self._stash = torch.zeros(g, mc, ml, w, dtype=torch.float32, device=dev)
            if not self._round_open:
                self._record = None
        else:
            if self._record is None:
                self._record = torch.zeros(g, mc, ml, hv, dk, dv, dtype=torch.float32, device=dev)
            if not self._round_open:
                self._stash = None

    def _grow(self) -> None:
        """Double the lane slots (every slot taken): new pools with the old contents, graphs dropped
        (recaptured on demand, at the new addresses)."""
        old, new = self.max_lanes, 2 * self.max_lanes
        log.warning(
            "all %d lane slots are taken: growing the pooled buffers to %d lanes (graphs recaptured)",
            old,
            new,
        )

        def widen(t: torch.Tensor, dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = new
            out = t.new_zeros(shape)
            out.narrow(dim, 0, old).copy_(t)
            return out

        self._keys = [widen(k, 0) for k in self._keys]
        self._values = [widen(v, 0) for v in self._values]
        self._conv, self._rec = widen(self._conv, 1), widen(self._rec, 1)
        self._windows = widen(self._windows, 1)
        if self._record is not None:
            self._record = widen(self._record, 2)
        if self._stash is not None:
            self._stash = widen(self._stash, 2)
        self._inputs = self._inputs.new_zeros(2 * new * self.max_columns + new)
        self._outputs = {}  # sized for max_lanes rows: reallocated at the next capture
        self._graphs.clear()
        self._pool = None
        self._free += list(range(old, new))
        self.max_lanes = new
        if self._moe_pieces is not None:  # the MoE buffers for the wider rounds
            self._moe_pieces = self._make_moe_pieces()

    def release_lane(self, state: StaticLaneState) -> None:
        """Give the lane's slot back (its state is gone; a pending forward is dropped). Idempotent.

        Raises:
            StateError: the state belongs to another executor.
        """
        self._check_owner(state, 0)
        if state._released:
            return
        state._released = True
        state._pending = None
        state._finalizer()  # returns the slot (and drops its pending round) once

    def _lane_gone(self, slot: int, lane_id: int) -> None:
        # the lane was released or garbage-collected: its slot is free, its round (if any) dropped
        self._round_open.discard(lane_id)
        if slot not in self._free:
            self._free.append(slot)

    @property
    def num_free_lanes(self) -> int:
        """Lane slots not taken."""
        return len(self._free)

    # ---- protocol ----

    @torch.no_grad()
    def forward(  # type: ignore[override]
        self,
        states: Sequence[StaticLaneState],
        columns: Sequence[torch.Tensor],
        *,
        logits: str = "all",
        record: bool = True,
        output_hidden_states: bool = False,
        tap_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """Run every lane's columns once (`HybridExecutor.forward`'s contract and returns).

        A forward whose lanes all have <= max_columns columns is a static round (graphed on CUDA);
        its per-column states are kept whatever `record` says (a `record=False` forward still may
        only be committed whole or discarded, as the protocol says). A `record=False` forward of
        more than max_columns but at most `chunked_prefill` columns runs as chunks of static rounds
        (module docstring).

        Raises:
            StateError: as `HybridExecutor.forward`; also a lane past max_context, a released lane,
                or a static round while the previous static round is not committed.
            ValueError: as `HybridExecutor.forward`.
        """
        # a list subclass stays as it is: `HostKnownColumns` / `InRangeColumns` tell the checks what
        # they need not read from the device
        states, columns = list(states), columns if isinstance(columns, list) else list(columns)
        self._check_forward(states, columns, logits, tap_layers)  # type: ignore[arg-type]
        lens = [int(col.numel()) for col in columns]
        for i, (state, n_i) in enumerate(zip(states, lens, strict=True)):
            if state._released:
                raise StateError(f"lane {i}: the lane was released")
            if state.num_tokens + n_i > self.max_context:
                raise StateError(
                    f"lane {i}: {state.num_tokens} + {n_i} tokens would pass this executor's "
                    f"max_context {self.max_context}"
                )
        n, lanes = max(lens), len(states)
        if not record and self.max_columns < n <= self.chunked_prefill:
            if self._round_open:
                raise StateError(
                    "a static round is pending: commit it before the next forward (its per-column "
                    "states live in one round buffer)"
                )
            self._gdn_buffers()  # a buffer left from a swapped recurrence goes now
            return self._chunked_forward(
                states, columns, lens, logits, output_hidden_states, tuple(int(t) for t in tap_layers)
            )
        if n <= self.max_columns:
            if self._round_open:
                raise StateError(
                    "a static round is pending: commit it before the next forward (its per-column "
                    "states live in one round buffer)"
                )
            self._gdn_buffers()  # a buffer left from a swapped recurrence goes now
            tap_ids = tuple(int(t) for t in tap_layers)
            out = self._static_forward(states, columns, lens, output_hidden_states, tap_ids)
            for i, state in enumerate(states):
                state._pending = _StaticPending(
                    lens[i], record, i, True, replay=self._gdn_kernel if self._replays else None
                )
                self._round_open.add(id(state))
        else:
            out = self._eager_forward(states, columns, lens, record, logits, output_hidden_states, tap_layers)
        n = out.get("width", n)  # a static round's columns: padded to a column width
        if logits == "last" and out["rows"] == "all":
            rows = torch.tensor([i * n + n_i - 1 for i, n_i in enumerate(lens)], device=self.device)
            out_logits = list(out["logits"][rows].split(1))
        elif out["rows"] == "all":
            per = out["logits"].view(lanes, n, -1)
            out_logits = [per[i, :n_i] for i, n_i in enumerate(lens)]
        else:
            out_logits = list(out["logits"].split(1))
        hidden = taps = None
        if output_hidden_states:
            hh = out["hidden"].view(lanes, n, -1)
            hidden = [hh[i, :n_i] for i, n_i in enumerate(lens)]
        if tap_layers:
            tt = out["taps"].view(lanes, n, -1)
            taps = [tt[i, :n_i] for i, n_i in enumerate(lens)]
        return ForwardOutput(logits=out_logits, hidden_states=hidden, taps=taps)

    def commit(self, states: Sequence[StaticLaneState], num_keep: Sequence[int]) -> None:  # type: ignore[override]
        """Keep the first num_keep[i] columns of lane i's pending forward (`HybridExecutor.commit`).

        Static rounds: one copy per lane (the kept recurrent state out of the record) or one replay
        launch for all lanes and layers (the stash path), and a few device ops for all lanes (the
        kept conv windows); no host sync. Chunked prefills: whole
        moves the lengths, 0 copies the saved states back.

        Raises:
            StateError: as `HybridExecutor.commit`.
        """
        states, keeps = self._check_commit(states, num_keep)  # type: ignore[arg-type, assignment]
        kd = self.config.linear_conv_kernel_dim - 1
        static = [(s, k) for s, k in zip(states, keeps, strict=True) if s._pending.static and k > 0]  # type: ignore[union-attr]
        if static and self._gdn_slot:
            m = len(static)
            positions = [s._pending.position for s, _ in static]  # type: ignore[union-attr]
            host = torch.tensor(
                [positions, [k for _, k in static], [s.slot for s, _ in static]], dtype=torch.long
            )
            idx = host.to(self.device, non_blocking=True)
            pos, keep_t, slots = idx[0], idx[1], idx[2]
            kernel = static[0][0]._pending.replay  # type: ignore[union-attr]
            if kernel is not None:
                # every GDN layer and lane in one launch: the kept columns replayed from the stash
                assert self._stash is not None
                kernel.replay(self._stash, self._rec, slots, keep_t, pos, self.config.linear_num_key_heads)
            else:
                # one copy per lane, record -> state: an indexed assignment would gather into a
                # temporary first, twice the traffic (4 x lanes x 151 MB for the 27B shape;
                # graphs-lanes.md)
                assert self._record is not None
                for (state, keep), p in zip(static, positions, strict=True):
                    self._rec[:, state.slot].copy_(self._record[:, keep - 1, p])
            gi = keep_t[:, None] + torch.arange(kd, device=self.device)[None, :]  # [m, kd]
            win = self._windows[:, pos]  # [G, m, C, kd + max_columns]
            g, _, ch, _ = win.shape
            self._conv[:, slots] = win.gather(3, gi[None, :, None, :].expand(g, m, ch, kd))
        for state, keep in zip(states, keeps, strict=True):
            pending = state._pending
            assert pending is not None
            if pending.saved is not None:  # chunked prefill: already in the pool; undo on 0
                if keep == 0:
                    self._conv[:, state.slot] = pending.saved[0]
                    self._rec[:, state.slot] = pending.saved[1]
            elif keep > 0 and not pending.static:
                assert pending.conv_windows is not None and pending.rec_states is not None
                for gs, window in enumerate(pending.conv_windows):
                    # record=False: the conv state after the last column already (whole commits only)
                    self._conv[gs, state.slot] = window[:, keep : keep + kd] if pending.record else window
                for gs, rec in enumerate(pending.rec_states):
                    self._rec[gs, state.slot] = rec[keep - 1] if pending.record else rec
            state._num_tokens += keep
            state._pending = None
            self._round_open.discard(id(state))
        if not self._round_open:  # the round buffer of a recurrence swapped mid-round goes now
            self._gdn_buffers()

    # ---- internals ----

    def _check_forward(  # type: ignore[override]
        self,
        states: list[StaticLaneState],
        columns: list[torch.Tensor],
        logits: str,
        tap_layers: Sequence[int],
    ) -> set[int]:
        """`HybridExecutor._check_forward` (same errors), its per-lane token-id range checks run on
        one host copy of every lane's columns: one device sync per forward instead of two per lane."""
        return super()._check_forward(states, host_columns(columns), logits, tap_layers)  # type: ignore[arg-type]

    def _check_owner(self, state: object, lane: int) -> None:
        if not isinstance(state, StaticLaneState) or state._owner is not self:
            raise StateError(f"lane {lane}: state was not created by this executor's new_lane()")

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`rms_norm_one_plus` with the precomputed float32 (1 + weight) applied by torch's fused RMSNorm
        (float32 inside, one rounding to x's dtype after)."""
        y = F.rms_norm(x.float(), (x.shape[-1],), self._one_plus[id(weight)], self.config.rms_norm_eps)
        return y.to(x.dtype)

    def _bucket(self, needed: int) -> int:
        return kv_bucket(needed, self.kv_bucket, self.capacity)

    def _static_forward(
        self,
        states: list[StaticLaneState],
        columns: list[torch.Tensor],
        lens: list[int],
        want_hidden: bool,
        taps: tuple[int, ...],
    ) -> dict[str, Any]:
        """A static round: the lanes' columns padded to the smallest of `column_widths` holding the
        longest (dummy token 0 after a lane's own columns). Returns the round's outputs ([lanes * n',
        ...] rows, copies), "rows": "all" and "width": n'."""
        lanes = len(states)
        n = next(w for w in self.column_widths if w >= max(lens))
        rows = lanes * n
        dev = self.device
        bucket = self._bucket(max(s.num_tokens for s in states) + n)
        # inputs: ids (device, padded with token 0) and positions + slots (host, one copy)
        ids = self._inputs[:rows]
        if all(n_i == n for n_i in lens):
            ids.copy_(torch.cat([c.reshape(-1) for c in columns]).to(dev))
        else:
            padded = torch.zeros(lanes, n, dtype=torch.long, device=dev)
            for i, c in enumerate(columns):
                padded[i, : lens[i]] = c.to(dev)
            ids.copy_(padded.view(-1))
        host = torch.tensor(
            [s.num_tokens + j for s in states for j in range(n)] + [s.slot for s in states], dtype=torch.long
        )
        self._inputs[rows : 2 * rows + lanes].copy_(host.to(dev, non_blocking=True))
        round_out = self._run_round(lanes, n, bucket, want_hidden, taps)
        out: dict[str, Any] = dict(round_out)
        if self.cuda_graphs or self.piecewise_graphs:  # the graphs' shared output buffers: copied out
            out = {k: v.clone() for k, v in round_out.items()}
        out["rows"] = "all"
        out["width"] = n
        return out

    def _run_round(
        self, lanes: int, n: int, bucket: int, want_hidden: bool, taps: tuple[int, ...]
    ) -> dict[str, torch.Tensor]:
        """The static round of `lanes` lanes x n columns reading KV bucket `bucket`, over the static
        input buffer (ids [lanes * n] | positions [lanes * n] | slots [lanes]): run eagerly, or
        replayed from its graph (captured first when new). With graphs the outputs are slices of the
        shared output buffers (`_round_outputs`), overwritten by the next replay."""
        rows = lanes * n
        ids = self._inputs[:rows]
        pos = self._inputs[rows : 2 * rows].view(lanes, n)
        slots = self._inputs[2 * rows : 2 * rows + lanes]
        pieces = self._moe_pieces
        if self.piecewise_graphs and pieces is not None:
            return self._run_pieces(pieces, lanes, n, bucket, want_hidden, taps)
        if not self.cuda_graphs:
            moe = pieces.split if pieces is not None else None
            return self._body(ids, pos, slots, bucket, want_hidden=want_hidden, taps=taps, moe=moe)
        key = (lanes, n, bucket, bool(want_hidden), taps)
        entry = self._graphs.get(key)
        if entry is None:
            dst = self._round_outputs(rows, want_hidden, len(taps))
            entry = self._capture(
                lambda: self._body(ids, pos, slots, bucket, want_hidden=want_hidden, taps=taps, out=dst)
            )
            self._graphs[key] = entry
        entry.graph.replay()
        self.num_replays += 1
        return entry.outputs

    def _run_pieces(
        self, pieces: PiecewiseMoe, lanes: int, n: int, bucket: int, want_hidden: bool, taps: tuple[int, ...]
    ) -> dict[str, torch.Tensor]:
        """`_run_round` with an expert cache on CUDA: the round replayed in pieces between its MoE
        layers' host parts (`ignis.runtime.families.moe_piecewise`), captured first when new."""
        rows = lanes * n
        key = ("pieces", lanes, n, bucket, bool(want_hidden), taps)
        entry = self._graphs.get(key)
        if entry is None:
            ids = self._inputs[:rows]
            pos = self._inputs[rows : 2 * rows].view(lanes, n)
            slots = self._inputs[2 * rows : 2 * rows + lanes]
            dst = self._round_outputs(rows, want_hidden, len(taps))
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=self.device)
            try:
                entry = pieces.capture(
                    lambda moe: self._body(
                        ids, pos, slots, bucket, want_hidden=want_hidden, taps=taps, out=dst, moe=moe
                    ),
                    rows=rows,
                    device=self.device,
                    pool=self._pool,
                    stream=self._side_stream,
                )
            except RuntimeError:  # a capture the driver refused: the same pieces run eagerly from now on
                log.warning("capturing a cached MoE round in pieces failed: static rounds run eagerly",
                            exc_info=True)  # fmt: skip
                self.piecewise_graphs = False
                torch.cuda.synchronize(self.device)
                moe = pieces.split
                return self._body(ids, pos, slots, bucket, want_hidden=want_hidden, taps=taps, moe=moe)
            self._graphs[key] = entry
            self.num_captures += len(entry.graphs)
        out = pieces.replay(entry)
        self.num_replays += 1
        return out

    def _round_outputs(self, rows: int, want_hidden: bool, num_taps: int) -> dict[str, torch.Tensor]:
        """The first `rows` rows of the static output buffers a captured round writes into: logits
        float32 [rows, vocab], hidden [rows, H] and taps [rows, num_taps * H] in the model dtype
        (when asked). One set of buffers of max_lanes x max_columns rows serves every shape (allocated
        on first use, outside the graphs' pool), so a captured shape holds no outputs of its own."""
        c, dev = self.config, self.device
        cap = self.max_lanes * self.max_columns
        need = {"logits": (c.vocab_size, torch.float32)}
        if want_hidden:
            need["hidden"] = (c.hidden_size, self.dtype)
        if num_taps:
            need[f"taps{num_taps}"] = (num_taps * c.hidden_size, self.dtype)
        out = {}
        for name, (width, dtype) in need.items():
            buf = self._outputs.get(name)
            if buf is None:
                buf = self._outputs[name] = torch.empty(cap, width, dtype=dtype, device=dev)
            out[name.rstrip("0123456789")] = buf[:rows]
        return out

    def _chunked_forward(
        self,
        states: list[StaticLaneState],
        columns: list[torch.Tensor],
        lens: list[int],
        logits: str,
        want_hidden: bool,
        taps: tuple[int, ...],
    ) -> ForwardOutput:
        """A record=False forward as consecutive static rounds of max_columns columns, each committed
        whole; the lanes' prior states are kept in their pendings (module docstring)."""
        mc = self.max_columns
        slots = torch.tensor([s.slot for s in states], dtype=torch.long, device=self.device)
        saved_conv, saved_rec = self._conv[:, slots], self._rec[:, slots]  # copies (indexed): [G, L, ...]
        starts = [s.num_tokens for s in states]
        try:
            parts = run_chunks(
                self, states, columns, lens, mc, logits=logits, want_hidden=want_hidden, taps=taps
            )
        except BaseException:
            for i, state in enumerate(states):  # back to before the forward
                self._round_open.discard(id(state))
                state._pending = None
                state._num_tokens = starts[i]
                self._conv[:, state.slot] = saved_conv[:, i]
                self._rec[:, state.slot] = saved_rec[:, i]
            raise
        for i, state in enumerate(states):
            state._num_tokens = starts[i]
            state._pending = _StaticPending(
                lens[i], False, i, False, saved=(saved_conv[:, i], saved_rec[:, i])
            )
        last = logits == "last"
        return ForwardOutput(
            logits=[p[-1] if last else torch.cat(p) for p in parts["l"]],
            hidden_states=[torch.cat(p) for p in parts["h"]] if want_hidden else None,
            taps=[torch.cat(p) for p in parts["t"]] if taps else None,
        )

    def _capture(self, body: Callable[[], dict[str, torch.Tensor]]) -> CapturedRound:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._side_stream is None and self.device.type == "cuda":
            # one for every capture: their warm-up runs share the allocator's cached blocks
            self._side_stream = torch.cuda.Stream(device=self.device)
        try:
            entry = capture_round(body, device=self.device, pool=self._pool, stream=self._side_stream)
        except BaseException:
            self._pool = None  # a failed capture's pool may stay refused (`tvm_runtime.capture`)
            raise
        self.num_captures += 1
        return entry

    # ---- load ----

    def warm_up(
        self,
        *,
        columns: Sequence[int] = (),
        context: int | None = None,
        hidden: bool = False,
        taps: Sequence[int] = (),
    ) -> int:
        """Capture, at load, the graph of every static round shape that rounds over lanes holding up to
        `context` tokens can meet: lane counts 1 .. max_lanes x `column_widths` x the KV buckets up to
        the one holding `context`, for one output set (`hidden`, `taps`: what the engine's drafter
        asks every forward for). The rounds run in free lane slots (their keys land past any lane's
        committed length; conv and recurrent states are only read, and `new_lane` zeroes them):
        no lane's state changes, and shapes captured before are kept.

        Args:
            columns: column counts to add to `column_widths` first (e.g. draft_tokens + 1: verify
                rounds of that many columns then run unpadded), each 1..max_columns; they apply with
                or without CUDA graphs.
            context: tokens a round reads (a lane's past + the round's columns) up to which every KV
                bucket is captured, >= 1; None: the capacity (every bucket, so no round of these
                output sets ever captures). Longer rounds capture their bucket on first use.
            hidden: capture the shapes that return hidden states (the MTP drafter's rounds).
            taps: tap layers of the captured shapes (the DFlash2 drafter's rounds).

        Returns:
            graphs captured now (0 without CUDA graphs).

        Raises:
            ValueError: a column count outside 1..max_columns, context < 1, a tap layer outside
                0..num_hidden_layers - 1.
            StateError: a static round is pending, or every lane slot is taken (with CUDA graphs).
        """
        for n in columns:
            if not 1 <= int(n) <= self.max_columns:
                raise ValueError(f"warm_up: column count {n} outside 1..max_columns {self.max_columns}")
        if context is not None and context < 1:
            raise ValueError(f"warm_up: context must be >= 1 tokens, got {context}")
        layers = self.config.num_hidden_layers
        hidden, taps = bool(hidden), tuple(int(t) for t in taps)
        for t in taps:
            if not 0 <= t < layers:
                raise ValueError(f"warm_up: tap layer {t} outside 0..{layers - 1}")
        self.column_widths = tuple(sorted(set(self.column_widths) | {int(n) for n in columns}))
        if not (self.cuda_graphs or self.piecewise_graphs):
            return 0
        if self._round_open:
            raise StateError("warm_up: a static round is pending; commit it first")
        if not self._free:
            raise StateError("warm_up: every lane slot is taken (the warm-up rounds run in free slots)")
        reach = self.capacity if context is None else min(context, self.capacity)
        base = [self._bucket(1)]
        while base[-1] < reach:
            base.append(self._bucket(2 * base[-1]))
        free = sorted(self._free)
        self._gdn_buffers()
        before = self.num_captures
        quiet = self._moe_pieces.quiet() if self._moe_pieces is not None else contextlib.nullcontext()
        with torch.no_grad(), quiet:  # warm-up rounds' expert lookups are not counted
            for lanes in range(1, self.max_lanes + 1):
                slots = torch.tensor([free[i % len(free)] for i in range(lanes)], dtype=torch.long)
                for n in self.column_widths:
                    rows = lanes * n
                    for bucket in sorted({self._bucket(max(b, n)) for b in base}):
                        if (lanes, n, bucket, hidden, taps) in self._graphs or (
                            "pieces", lanes, n, bucket, hidden, taps
                        ) in self._graphs:
                            continue
                        pos = torch.arange(n, dtype=torch.long).repeat(lanes)
                        host = torch.cat([torch.zeros(rows, dtype=torch.long), pos, slots])
                        self._inputs[: 2 * rows + lanes].copy_(host.to(self.device))
                        self._run_round(lanes, n, bucket, hidden, taps)
        log.debug(
            "warm_up: lanes 1..%d x columns %s x KV buckets %s", self.max_lanes, self.column_widths, base
        )
        if self.num_captures > before and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the warm-up runs' cached blocks (the graphs' pool stays)
        return self.num_captures - before

    def _eager_forward(
        self,
        states: list[StaticLaneState],
        columns: list[torch.Tensor],
        lens: list[int],
        record: bool,
        logits: str,
        want_hidden: bool,
        taps: Sequence[int],
    ) -> dict[str, Any]:
        lanes, n = len(states), max(lens)
        dev = self.device
        padded = torch.zeros(lanes, n, dtype=torch.long, device=dev)
        for i, c in enumerate(columns):
            padded[i, : lens[i]] = c.to(dev)
        pos = torch.tensor([[s.num_tokens + j for j in range(n)] for s in states], dtype=torch.long).to(dev)
        slots = torch.tensor([s.slot for s in states], dtype=torch.long).to(dev)
        valid = [i * n + j for i, n_i in enumerate(lens) for j in range(n_i)]
        pending = [_StaticPending(n_i, record, i, False, [], []) for i, n_i in enumerate(lens)]
        last = None
        if logits == "last":
            last = torch.tensor([i * n + n_i - 1 for i, n_i in enumerate(lens)], device=dev)
        out = self._body(
            padded.view(-1),
            pos,
            slots,
            # the keys the real columns read: a lane far into its prompt with a short last chunk
            # beside a fresh lane with a long one (chunked prefill) must not read past the capacity
            max(s.num_tokens + n_i for s, n_i in zip(states, lens, strict=True)),
            want_hidden=want_hidden,
            taps=tuple(taps),
            eager=(lens, record, torch.tensor(valid, device=dev), pending),
            logit_rows=last,
        )
        for state, p in zip(states, pending, strict=True):
            state._pending = p
        out["rows"] = "last" if last is not None else "all"
        return out

    def _body(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        bucket: int,
        *,
        want_hidden: bool,
        taps: tuple[int, ...],
        eager: tuple[list[int], bool, torch.Tensor, list[_StaticPending]] | None = None,
        logit_rows: torch.Tensor | None = None,
        out: dict[str, torch.Tensor] | None = None,
        moe: Callable[[torch.Tensor, SparseMoeWeights], torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """One forward over static shapes: ids [L*n] int64, pos [L, n] int64 (past + column), slots
        [L] int64, bucket = KV length read. `eager` = (lens, record, valid rows, pendings) for a long
        (non-static) forward. No host syncs, no host->device copies (capture-safe) except what `moe`
        does. Returns logits float32 [rows, vocab], and hidden [rows, H] / taps [rows, len(taps) * H]
        (model dtype) when asked; `out`: tensors of those shapes to write them into (and return)
        instead of new ones. `moe`: runs the MoE layers' blocks instead of `sparse_moe_block` (the
        pieces of `ignis.runtime.families.moe_piecewise`)."""
        c = self.config
        lanes, n = pos.shape
        h = F.embedding(ids, self._embed)
        freqs = pos.reshape(-1).float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        rep = c.num_attention_heads // c.num_key_value_heads
        mask = torch.arange(bucket, device=self.device)[None, None, :] <= pos[:, :, None]  # [L, n, T]
        mask = mask[:, None].expand(lanes, rep, n, bucket).reshape(lanes, 1, rep * n, bucket)
        tapped: dict[int, torch.Tensor] = {}
        # fused norms (static rounds): each residual add runs with the RMSNorm after it; the MLP's
        # output waits in `pending` for the next layer's input norm (or the final norm)
        fused = self._norms_kernel if eager is None else None
        eps = c.rms_norm_eps
        pending: torch.Tensor | None = None
        for layer in self._layers:
            if pending is None:
                x = self._norm(h, layer.input_norm)
            else:
                assert fused is not None
                h, x = fused.add_rms_norm(h, pending, self._one_plus[id(layer.input_norm)], eps)
                pending = None
            if layer.attn is not None:
                mixed = self._static_attention(layer, x, pos, slots, bucket, cos, sin, mask, eager)
            else:
                mixed = self._static_gdn(layer, x, lanes, n, slots, eager)
            if fused is not None:
                h, x = fused.add_rms_norm(h, mixed, self._one_plus[id(layer.post_norm)], eps)
            else:
                h = h + mixed
                x = self._norm(h, layer.post_norm)
            if isinstance(layer.mlp, SparseMoeWeights) and moe is not None:
                h = h + moe(x, layer.mlp)
            elif isinstance(layer.mlp, SparseMoeWeights):
                assert isinstance(c, Qwen3_5MoeConfig | Qwen3NextConfig)
                h = h + sparse_moe_block(
                    x,
                    layer.mlp,
                    top_k=c.num_experts_per_tok,
                    norm_topk_prob=c.norm_topk_prob,
                    linear=self.linear,
                )
            elif fused is not None and layer.index not in taps:
                pending = self._mlp(x, layer.mlp, fused)
            else:
                h = h + self._mlp(x, layer.mlp, fused)
            if layer.index in taps:
                tapped[layer.index] = h
        if pending is not None:  # fused: logit_rows is None (static rounds)
            assert fused is not None and logit_rows is None
            h, normed = fused.add_rms_norm(h, pending, self._one_plus[id(self._final_norm)], eps)
        else:
            hl = h if logit_rows is None else h[logit_rows]
            normed = self._norm(hl, self._final_norm)
        logits = self.linear(normed, self._lm_head, None)
        if out is None:
            result = {"logits": logits.float()}
            if want_hidden:
                result["hidden"] = h
            if taps:
                result["taps"] = torch.cat([tapped[t] for t in taps], dim=-1)
            return result
        out["logits"].copy_(logits)  # the float32 cast, into the static buffer
        if want_hidden:
            out["hidden"].copy_(h)
        if taps:
            torch.cat([tapped[t] for t in taps], dim=-1, out=out["taps"])
        return out

    def _mlp(self, x: torch.Tensor, mlp: SwiGLUWeights, fused: FusedNormsKernel | None) -> torch.Tensor:
        """`swiglu_mlp`; in a static round whose norms module has ``silu_mul`` (fused), the stacked
        gate|up GEMM's activation ``F.silu(gate) * up`` in one launch (bit-identical)."""
        if (
            fused is not None
            and fused.has_silu_mul
            and mlp.gate_up is not None
            and x.shape[0] <= SILU_MUL_MAX_ROWS
        ):
            return self.linear(fused.silu_mul(self.linear(x, mlp.gate_up, None)), mlp.down, None)
        return swiglu_mlp(x, mlp, linear=self.linear)

    def _static_attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        bucket: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        eager: Any,
    ) -> torch.Tensor:
        c, a = self.config, layer.attn
        assert a is not None
        lanes, n = pos.shape
        rows, hd, nh, nkv = x.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads
        rep = nh // nkv
        linear = self.linear
        q_lin, k_flat, v_flat = self._attn_projections(a, x)
        qg = q_lin.view(rows, nh, 2 * hd)
        gate = qg[..., hd:].reshape(rows, nh * hd)
        kc, vc = self._keys[layer.slot], self._values[layer.slot]  # [S, cap, nkv, hd]
        k_lin = k_flat.view(rows, nkv, hd)
        v = v_flat.view(rows, nkv, hd)
        pos_rows = pos.reshape(-1)
        mixers = self._mixers_kernel if eager is None else None
        if mixers is not None:  # q/k norms + RoPE + the KV write, one launch
            q = mixers.qk_norm_rope_kv(
                qg[..., :hd],
                k_lin,
                v,
                self._one_plus[id(a.q_norm)],
                self._one_plus[id(a.k_norm)],
                cos,
                sin,
                pos_rows,
                slots,
                kc,
                vc,
                c.rms_norm_eps,
            )
        else:
            q, k = self._norm(qg[..., :hd], a.q_norm), self._norm(k_lin, a.k_norm)
            q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
            slot_rows = slots[:, None].expand(lanes, n).reshape(-1)
            if eager is None or min(eager[0]) == n:  # every column real (one prompt): no gathers
                kc[slot_rows, pos_rows] = k
                vc[slot_rows, pos_rows] = v
            else:  # only the real columns (a padded column of a long forward could pass the capacity)
                valid = eager[2]
                kc[slot_rows[valid], pos_rows[valid]] = k[valid]
                vc[slot_rows[valid], pos_rows[valid]] = v[valid]
        if mixers is not None and mixers.gated_attention_takes(x.dtype, hd, x.device):  # no gathers
            gate3 = qg[..., hd:]  # [rows, nh, hd], hd contiguous
            o = mixers.gated_attention(q, kc, vc, gate3, pos_rows, slots, bucket, hd**-0.5)
            return linear(o, a.o_proj, a.o_bias)
        keys = kc[:, :bucket].index_select(0, slots).transpose(1, 2)  # [L, nkv, T, hd]
        values = vc[:, :bucket].index_select(0, slots).transpose(1, 2)
        # query head h uses kv head h // rep: group the rep query heads of a kv head as extra rows
        qq = q.view(lanes, n, nkv, rep, hd).permute(0, 2, 3, 1, 4).reshape(lanes, nkv, rep * n, hd)
        o = F.scaled_dot_product_attention(qq, keys, values, attn_mask=mask, scale=hd**-0.5)
        o = o.view(lanes, nkv, rep, n, hd).permute(0, 3, 1, 2, 4).reshape(rows, nh * hd)
        return linear(o * torch.sigmoid(gate), a.o_proj, a.o_bias)

    def _static_gdn(
        self, layer: _Layer, x: torch.Tensor, lanes: int, n: int, slots: torch.Tensor, eager: Any
    ) -> torch.Tensor:
        c, g = self.config, layer.gdn
        assert g is not None
        nk, nv, dk, dv = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        kd, gs, rep = c.linear_conv_kernel_dim - 1, layer.slot, nv // nk
        qkv, z, b, a = self._gdn_projections(g, x, narrow=self._norms_kernel if eager is None else None)
        neg_a, dt_bias = self._gdn_consts[gs]
        ch = qkv.shape[-1]
        mixers = self._mixers_kernel if eager is None else None
        window: torch.Tensor | None = None
        if mixers is not None and g.conv.dtype == qkv.dtype == self._conv.dtype:
            # gather + cat + conv1d + SiLU, and the window commit reads, in one launch
            conv = mixers.gdn_conv_silu(qkv, self._conv[gs], slots, g.conv, self._windows[gs], lanes, n)
        else:
            window = torch.cat(
                [self._conv[gs].index_select(0, slots), qkv.view(lanes, n, ch).transpose(1, 2)], dim=2
            )  # [L, C, kd + n]
            conv = F.silu(F.conv1d(window, g.conv.unsqueeze(1), None, padding=0, groups=ch)).transpose(1, 2)
        if eager is None and self._gdn_kernel is not None:  # the fused recurrence, one launch
            if window is not None:
                self._windows[gs, :lanes, :, : kd + n] = window
            out_core = x.new_empty(lanes, n, nv, dv)  # rounded to the model dtype once, as below
            kern = self._gdn_kernel
            args = (
                conv,
                b.reshape(lanes, n, nv),
                a.reshape(lanes, n, nv),
                neg_a,
                dt_bias,
                self._rec[gs],
                slots,
            )
            if kern.has_replay:  # no per-column states: what the columns fed it, for commit's replay
                assert self._stash is not None
                kern.round_stash(*args, self._stash[gs], out_core, nk, dk**-0.5)
            else:
                assert self._record is not None
                kern(*args, self._record[gs], out_core, nk, dk**-0.5)
            if self._norms_kernel is not None:  # the fused gated norm reads the kernel's output as is
                return self._gdn_output(layer, out_core.view(lanes * n, nv, dv), z, x.dtype, fused=True)
            return self._gdn_output(layer, out_core.view(lanes * n, nv, dv).float(), z, x.dtype)
        beta = torch.sigmoid(b).float().view(lanes, n, nv)
        decay = (neg_a * F.softplus(a.float() + dt_bias)).view(lanes, n, nv)
        if eager is not None and not eager[1]:  # a prompt (record=False): the chunked rule
            assert window is not None  # eager forwards keep the torch conv
            return self._gdn_prefill(layer, conv, window, beta, decay, z, slots, eager, x.dtype)
        q, k, v = conv.split([nk * dk, nk * dk, nv * dv], dim=-1)  # [L, n, *]
        q = l2_normalize(q.float().reshape(lanes, n, nk, dk))
        k = l2_normalize(k.float().reshape(lanes, n, nk, dk))
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        q = q * dk**-0.5
        v = v.float().reshape(lanes, n, nv, dv)
        prev = self._rec[gs].index_select(0, slots)  # [L, hv, dk, dv]
        if eager is None:
            if window is not None:
                self._windows[gs, :lanes, :, : kd + n] = window
            assert self._record is not None
            core = self._recurrence(q, k, v, decay, beta, prev, self._record[gs, :n, :lanes])
        else:
            lens, _, _, pendings = eager  # record=True here (record=False: `_gdn_prefill`)
            core = q.new_zeros(lanes, n, nv, dv)
            for i, n_i in enumerate(lens):
                args = (q[i, :n_i], k[i, :n_i], v[i, :n_i], decay[i, :n_i], beta[i, :n_i], prev[i])
                o, new_state = gated_delta_rule_recurrent(*args, record=True)
                core[i, :n_i] = o
                assert window is not None  # eager forwards keep the torch conv
                pendings[i].conv_windows.append(window[i, :, : kd + n_i])
                pendings[i].rec_states.append(new_state)
        core = core.view(lanes * n, nv, dv).to(x.dtype).float()  # rounded as HF's
        return self._gdn_output(layer, core, z, x.dtype, fused=eager is None)

    def _gdn_prefill(
        self,
        layer: _Layer,
        conv: torch.Tensor,
        window: torch.Tensor,
        beta: torch.Tensor,
        decay: torch.Tensor,
        z: torch.Tensor,
        slots: torch.Tensor,
        eager: Any,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """A GDN layer's mixer for a record=False eager forward (a prompt), from the conv output on:
        `gated_delta_prefill` per lane (l2 norms, chunked rule) writing its output in the model dtype
        (rounded as HF's), the gated RMSNorm in few passes, out_proj. conv [L, n, conv_dim] (model
        dtype, any strides), window [L, conv_dim, kd + n], beta / decay [L, n, v_heads] float32,
        z [L * n, v_heads, v_dim]. Pending per lane: the conv state after its last column (the
        window's last kd columns, copied: a record=False forward commits whole or nothing) and the
        final recurrent state (its own tensor): nothing of the size of the prompt outlives the layer.
        """
        c, g = self.config, layer.gdn
        assert g is not None
        nk, nv, dk, dv = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        )
        kd, gs = c.linear_conv_kernel_dim - 1, layer.slot
        lanes, n = conv.shape[0], conv.shape[1]
        lens, _, _, pendings = eager
        prev = self._rec[gs].index_select(0, slots)  # [L, hv, dk, dv]
        core = conv.new_empty(lanes, n, nv, dv) if min(lens) == n else conv.new_zeros(lanes, n, nv, dv)
        for i, n_i in enumerate(lens):
            qk = conv[i, :n_i, : 2 * nk * dk].unflatten(-1, (2, nk, dk))
            v = conv[i, :n_i, 2 * nk * dk :].unflatten(-1, (nv, dv))
            _, new_state = gated_delta_prefill(
                qk, v, decay[i, :n_i], beta[i, :n_i], prev[i], out=core[i, :n_i]
            )
            pendings[i].conv_windows.append(window[i, :, n_i : n_i + kd].clone())
            pendings[i].rec_states.append(new_state)
        out = gated_rms_norm_lean(core.view(lanes * n, nv, dv), z, g.norm, c.rms_norm_eps)
        return self.linear(out.view(lanes * n, nv * dv), g.out_proj, None)

    def _gdn_output(
        self, layer: _Layer, core: torch.Tensor, z: torch.Tensor, dtype: torch.dtype, *, fused: bool = False
    ) -> torch.Tensor:
        """Gated RMSNorm and out_proj of the recurrence output core [rows, v_heads, v_dim] (float32
        holding model-dtype values, or the model dtype), z [rows, v_heads, v_dim]. fused: a static
        round, where the norms kernel (when given) runs the gated norm."""
        g = layer.gdn
        assert g is not None
        rows, nv, dv = core.shape
        eps = self.config.rms_norm_eps
        if fused and self._norms_kernel is not None and g.norm.dtype == z.dtype == dtype:
            out = self._norms_kernel.gated_rms_norm(core, z, g.norm, eps)
            return self.linear(out, g.out_proj, None)
        core = F.rms_norm(core.float(), (dv,), eps=eps).to(dtype)
        out = ((g.norm * core) * F.silu(z.float())).to(dtype)  # as `gated_rms_norm`
        return self.linear(out.reshape(rows, nv * dv), g.out_proj, None)

    @staticmethod
    def _recurrence(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        record: torch.Tensor,
    ) -> torch.Tensor:
        """`gated_delta_rule_recurrent` batched over lanes, writing the state after column t into
        record[t] ([n, L, hv, dk, dv] view, contiguous per t). q, k [L, n, hv, dk], v [L, n, hv, dv],
        g, beta [L, n, hv], state [L, hv, dk, dv]; all float32. Returns out [L, n, hv, dv]."""
        lanes, n, hv, dk = k.shape
        dv = v.shape[-1]
        bh = lanes * hv
        s = state.reshape(bh, dk, dv)
        if lanes > 1:  # time-major once, so that every per-column slice below is a view
            q, k, v = (x.transpose(0, 1).contiguous() for x in (q, k, v))
            g, beta = g.transpose(0, 1).contiguous(), beta.transpose(0, 1).contiguous()
        else:
            q, k, v, g, beta = (x.squeeze(0).unsqueeze(1) for x in (q, k, v, g, beta))
        alpha = g.exp()  # [n, L, hv]
        outs = []
        for t in range(n):
            s = s * alpha[t].reshape(bh, 1, 1)
            kt = k[t].reshape(bh, dk)
            read = torch.bmm(kt.unsqueeze(1), s).squeeze(1)  # [bh, dv]
            delta = (v[t].reshape(bh, dv) - read) * beta[t].reshape(bh, 1)
            dst = record[t].view(bh, dk, dv)
            torch.baddbmm(s, kt.unsqueeze(2), delta.unsqueeze(1), out=dst)  # s + k delta^T, fused
            s = dst
            outs.append(torch.bmm(q[t].reshape(bh, 1, dk), s).view(lanes, hv, dv))
        return torch.stack(outs, dim=1)
