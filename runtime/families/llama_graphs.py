"""Static-shape verify rounds for the llama / qwen2 families, replayed from CUDA graphs.

`StaticLlamaExecutor` is the `LlamaExecutor` (same weights, same fused q|k|v and gate|up, same linear
hook, same commit / rewind) with every lane's keys and values in one pooled buffer allocated once, so
that a verify round is a fixed sequence of kernels over fixed addresses: on CUDA it is captured once
per shape and replayed; on the CPU (and with ``cuda_graphs=False``) the very same code runs eagerly,
which is how the CPU tests prove it. `ignis.runtime.families.hybrid_graphs` does the same for the
hybrid families; the generic pieces (lane slots, KV buckets, the capture, the chunk loop) live in
`ignis.runtime.families.static_rounds`.

State (allocated at construction; grown only by `new_lane` when every slot is taken):

* ``capacity = max_context + max_columns`` token slots per lane and ``max_lanes`` lane slots, plus one
  scratch slot that the padding lanes of a round write into. A lane (`new_lane`) takes a free slot;
  `release_lane` (or dropping the state object) gives it back. With every slot taken, `new_lane`
  doubles the pools (copying them; the graphs are recaptured).
* KV: one pool ``[layers, max_lanes + 1, capacity, 2 x kv_heads, head_dim]`` in the executor's dtype,
  a position's keys (after RoPE) then its values; ``_keys`` and ``_values`` are its two halves (views
  ``[layers, max_lanes + 1, capacity, kv_heads, head_dim]``), so a round gathers both with one
  `index_select` a layer. Positions past a lane's committed length hold stale data that the next
  forward overwrites; attention never reads them (the causal mask is built from the positions).

A *static round* is a forward whose lanes have n_i <= max_columns columns. Its shape is padded to a key
(lanes L', columns n', KV bucket T, hidden states wanted, tap layers): n' is the smallest of
`column_widths` >= max n_i (by default the powers of two below max_columns and max_columns; `warm_up`
adds the verify width draft_tokens + 1, so verify rounds run unpadded), L' the number of lanes up to
`EXACT_LANES` (8) and the next multiple of 8 above it, T the smallest ``kv_bucket * 2**i`` holding
every lane's past + n' (at most the capacity). Short lanes get dummy columns (token 0) whose outputs
are discarded and which commit never keeps (their keys land past the lane's committed length);
padding lanes run dummy columns in the scratch slot. Padding costs rows (a q4 linear's time grows
with its rows past ~8), so lanes, the costlier dimension, stay exact where it matters most; 8 lanes
decoding with k drafts meet 8 x 5 shapes per KV bucket, which `warm_up` captures at load. Every
data-dependent quantity is a device tensor in one static input buffer (token ids, positions, slot
ids) filled by one host->device copy; attention gathers the lanes' caches up to T, folds each KV
head's query heads into rows (GQA) and runs one masked scaled-dot-product attention over the bucket;
logits of every row (and hidden states, taps) are the outputs. `commit` and `rewind` move host-side
lengths only (`LlamaExecutor.commit` / `rewind`: keys past the committed length are never read).

Attention route: fixed at construction, never chosen per shape on the request path. Torch's SDPA
runs with one backend pinned (the ``sdpa_backend`` attribute, from `pick_sdpa_backend`): on CUDA the
memory-efficient kernel (any mask, any length, fp32/fp16/bf16, no per-shape plan, capture-safe) once
a probe shaped like a round, in the executor's dtype and head_dim, ran with it and agreed with the
math kernel, else the math kernel; on the CPU the math kernel. cuDNN's attention is left out: it
builds an execution plan per new shape (`ignis.runtime.families.attention`). The
project's fused ``gated_attention`` (`ignis.runtime.kernels.fused_mixers`) multiplies by the output
gate of the hybrid families and is compiled into hybrid artifacts only, so it does not serve here.

CUDA graphs: captured per key (lazily, and by `warm_up` at load), all graphs sharing one memory pool;
the logits are written into one static output buffer shared by every graph (so a graph holds no
logits of its own), and a replay's outputs are copied out, so returned logits survive the next round.

Chunked prefill (``chunked_prefill``): a forward whose longest lane has more than max_columns but at
most ``chunked_prefill`` columns runs as consecutive static rounds of max_columns columns (graphed on
CUDA), each committed whole; afterwards the lanes' lengths are put back, so the forward stays pending
as the protocol says (a commit of k keeps the first k columns: their keys were written by the chunks;
``record=False`` forwards may only be committed whole or discarded, as always). Default:
``4 x max_columns`` with CUDA graphs, else 0 (off). Longer forwards (long prompts) run eagerly over the
same pooled buffers: attention batched over lanes over their exact longest length, only the real
columns' keys written.

Kernels of a layer (each a node of the graph a round replays): the input norm with the residual add
before it (one ``add_rms_norm_llama`` launch with ``norms_module``, else an add and torch's norm: 2
kernels in float32, 4 in 16-bit dtypes), the q|k|v linear, RoPE of q and k together written back into
the linear's output (4 kernels, `rope_qk`), so that a position's keys and values, adjacent there, go
into the pool in one write (with ``mixers_module``: RoPE and the write in one ``rope_kv`` launch,
bit-identical; and, in bf16 / f16, the gather, SDPA and the heads' permute in one
``grouped_attention`` launch reading the pool through the slots, FlashAttention-2's online softmax
with P rounded to the dtype before P.V); else one gather of the lanes' keys and values and SDPA; the
o linear, the post-attention norm with its add, the gate|up linear, ``silu_mul`` (or torch's silu and
product) and the down linear. `tests/runtime/test_llama_round_cost.py` counts them.

Padded q4 linears: a tiled q4 weight whose K is not a multiple of 128 is padded with zero columns to
K' (a build's ``q4_pad_k``; `Q4Weight.cols`), and its function takes activations of K' columns. For
each such (K, K') the executor keeps one zero buffer [rows of the widest round, K'] (allocated with the
pools); in static rounds the op before the linear (the first norm and the fused add + norms, the copy
of the attention output into row order, ``silu_mul``) writes its [rows, K] result into the buffer's
first K columns and the linear reads all K' columns, with no padding copy. Columns past K are never
written, so they stay zero. Long (eager) forwards leave the padding to `LinearBackend`.

Numerics follow `LlamaExecutor`'s (HF's casts: RMSNorm statistics in float32, RoPE tables in float32
cast to the activation dtype, softmax in float32) with two differences of rounding only: RMSNorm
uses torch's fused `F.rms_norm` (or, with ``norms_module``, the fused kernel: HF's rounding points,
float32 sums in another order), and attention is one masked SDPA over the bucket instead of one per
lane over its exact length. Float32 logits agree to ~1e-5 (tests: 1e-4).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ignis.runtime.errors import StateError
from ignis.runtime.families.base import ForwardOutput
from ignis.runtime.families.llama import LlamaExecutor, _DecoderConfig
from ignis.runtime.families.static_rounds import (
    CapturedRound,
    PooledLaneState,
    capture_round,
    kv_bucket,
    run_chunks,
)
from ignis.runtime.kernels.fused_mixers import FusedMixersKernel
from ignis.runtime.kernels.fused_norms import SILU_MUL_MAX_ROWS, FusedNormsKernel
from ignis.runtime.linear import LinearFn, Q4Weight

__all__ = [
    "CHUNKED_PREFILL_ROUNDS",
    "DEFAULT_MAX_CONTEXT",
    "StaticLlamaExecutor",
    "StaticLlamaLaneState",
    "default_column_widths",
    "grouped_attention",
    "lane_width",
    "pick_sdpa_backend",
    "rope_qk",
    "round_mask",
    "signed_sin",
]

log = logging.getLogger("ignis.runtime.llama_graphs")

DEFAULT_MAX_CONTEXT = 8192
"""Token capacity per lane when neither the caller nor a smaller model limit gives one."""

CHUNKED_PREFILL_ROUNDS = 4
"""Default `StaticLlamaExecutor.chunked_prefill` (with CUDA graphs): prompts of up to this many
max_columns chunks run as static rounds."""


EXACT_LANES = 8
"""Rounds of up to this many lanes run at their exact lane count; more lanes are padded to a multiple of
it (padding lanes run in the scratch slot)."""


def lane_width(lanes: int) -> int:
    """The lane count a static round of `lanes` lanes runs at (`EXACT_LANES`)."""
    return lanes if lanes <= EXACT_LANES else -(-lanes // EXACT_LANES) * EXACT_LANES


def default_column_widths(max_columns: int) -> tuple[int, ...]:
    """The column counts static rounds are padded to by default: the powers of two below
    max_columns, and max_columns."""
    return tuple(
        sorted({1 << i for i in range(max_columns.bit_length()) if 1 << i < max_columns} | {max_columns})
    )


def round_mask(pos: torch.Tensor, bucket: int, rep: int) -> torch.Tensor:
    """bool [L, 1, rep * n, T]: row (g, j) of lane i (query head g of a KV head's group, column j) sees
    key positions 0 .. pos[i, j] of the T = bucket read. pos: int64 [L, n] (past + column)."""
    lanes, n = pos.shape
    mask = torch.arange(bucket, device=pos.device)[None, None, :] <= pos[:, :, None]  # [L, n, T]
    return mask[:, None].expand(lanes, rep, n, bucket).reshape(lanes, 1, rep * n, bucket)


def grouped_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """GQA as one SDPA call: q [L, n, kv_heads, rep, hd] (query head h = kv head h // rep), keys and
    values [L, kv_heads, T, hd] (last dim contiguous), mask from `round_mask`. Returns [L * n,
    kv_heads * rep * hd] in q's dtype. The backend is the caller's (`sdpa_kernel`). out: [L * n, >= D]
    (D = kv_heads * rep * hd; the last dim contiguous) whose first D columns receive the result, which
    is then `out` itself (e.g. a zero-padded activation buffer), or None (a new tensor, or a view of
    SDPA's output when it is already in row order)."""
    lanes, n, nkv, rep, hd = q.shape
    qq = q.permute(0, 2, 3, 1, 4).reshape(lanes, nkv, rep * n, hd)  # the group's query heads as rows
    o = F.scaled_dot_product_attention(qq, keys, values, attn_mask=mask, scale=scale)
    rows = o.view(lanes, nkv, rep, n, hd).permute(0, 3, 1, 2, 4)
    if out is None:
        return rows.reshape(lanes * n, nkv * rep * hd)
    out[:, : nkv * rep * hd].view(lanes, n, nkv, rep, hd).copy_(rows)
    return out


def _host_ids(columns: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Integer 1-D columns (any device, any integer dtype) on the host: per lane an int64 CPU tensor
    (views of one tensor) and all their ids lane after lane as one list, from one device->host copy,
    or from no copy when the columns carry their host values (`round_batch.HostKnownColumns`)."""
    known = getattr(columns, "host", None)
    if known is not None:
        ids = [i for lane in known for i in lane]
        t = torch.tensor(ids, dtype=torch.int64)
        return ([t] if len(known) == 1 else list(t.split([len(lane) for lane in known]))), ids
    if len({c.device for c in columns}) > 1:
        columns = [c.cpu() for c in columns]
    flat = (columns[0] if len(columns) == 1 else torch.cat(list(columns))).to("cpu", torch.int64)
    host = [flat] if len(columns) == 1 else list(flat.split([int(c.numel()) for c in columns]))
    return host, flat.tolist()


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The RoPE sine table [..., hd] with its first half negated, for `rope_qk`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rope_qk(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """HF's rotary embedding (``x * cos + rotate_half(x) * sin``, `LlamaExecutor._apply_rope`) of
    x [R, heads, hd] (any heads: q and k of a round side by side), with cos [R, 1, hd] and
    ``signed_sin(sin)``. rotate_half's negation is carried by the sine table instead of the
    activations: (-a) * s and a * (-s) are the same float in IEEE arithmetic, so the result is
    bit-identical to `_apply_rope`, in 4 kernels where rotating q and k apart takes 10 (the
    negation and the concatenation per tensor, then the two products and the sum per tensor).
    out: where the sum is written (x itself may be given: both products are computed before the
    sum writes), or None (a new tensor)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin_signed
    return torch.add(x * cos, rotated, out=out) if out is not None else x * cos + rotated


def pick_sdpa_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> SDPBackend:
    """The one SDPA backend a static executor runs (module docstring, "Attention route").

    CUDA: the memory-efficient kernel when a probe shaped like a round (`grouped_attention` of two
    lanes, two KV heads of two query heads each, three columns, 20 keys and values read through
    strided views of one gathered pool, the mask broadcast over the KV heads) runs with it alone and
    agrees with the math kernel, else the math kernel. CPU: the math kernel.
    """
    if device.type != "cuda":
        return SDPBackend.MATH
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(2, 3, 2, 2, head_dim, device=device, generator=gen).to(dtype)
    kv = torch.randn(2, 20, 4, head_dim, device=device, generator=gen).to(dtype)  # [L, T, 2 nkv, hd]
    keys, values = kv[:, :, :2].transpose(1, 2), kv[:, :, 2:].transpose(1, 2)
    mask = round_mask(torch.tensor([[4, 5, 6], [17, 18, 19]], device=device), 20, 2)
    try:
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            got = grouped_attention(q, keys, values, mask, head_dim**-0.5)
        with sdpa_kernel([SDPBackend.MATH]):
            want = grouped_attention(q, keys, values, mask, head_dim**-0.5)
        ok = bool(torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2))
    except RuntimeError as exc:
        log.warning(
            "memory-efficient SDPA does not take %s head_dim %d (%s): math kernel", dtype, head_dim, exc
        )
        return SDPBackend.MATH
    if not ok:
        log.warning(
            "memory-efficient SDPA disagrees with the math kernel for %s head_dim %d: math kernel",
            dtype,
            head_dim,
        )
        return SDPBackend.MATH
    return SDPBackend.EFFICIENT_ATTENTION


class StaticLlamaLaneState(PooledLaneState):
    """One lane of a `StaticLlamaExecutor` (`PooledLaneState`: a slot plus the committed length).

    Its pending forward is ``(columns, record)`` as `LlamaLaneState`'s, so `LlamaExecutor.commit` and
    `rewind` serve it.
    """

    _pending: tuple[int, bool] | None

    @property
    def num_pending(self) -> int:
        """Columns of the last forward not yet committed (0 when none)."""
        return 0 if self._pending is None else self._pending[0]

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed (keys, values) of decoder layer `layer`, each [kv_heads, num_tokens, head_dim] in
        the executor's dtype (keys after RoPE). Views into the pool: do not modify."""
        o = self._owner
        assert isinstance(o, StaticLlamaExecutor)
        n = self._num_tokens
        keys, values = o._keys[layer, self._slot, :n], o._values[layer, self._slot, :n]
        return keys.transpose(0, 1), values.transpose(0, 1)


class StaticLlamaExecutor(LlamaExecutor):
    """The `Executor` protocol of llama / qwen2 over pooled static buffers, CUDA-graphed on CUDA
    (module docstring).

    Args:
        config, weights, device, dtype, linear: as `LlamaExecutor`.
        max_lanes: lane slots allocated up front (>= 1); a lane past them doubles the pools.
        max_context: tokens a lane may hold (prompt + output); default min(the model's
            max_position_embeddings, `DEFAULT_MAX_CONTEXT`). `SpeculativeEngine` caps its context to it.
        max_columns: most columns per lane of a static (graphed) round, >= 1 (8 = anchor + 7 drafts).
        cuda_graphs: capture and replay static rounds (default: on CUDA). True on a CPU device raises.
        chunked_prefill: most columns per lane of a forward run as chunks of max_columns static rounds
            (module docstring); None: ``CHUNKED_PREFILL_ROUNDS x max_columns`` when cuda_graphs, else
            0 (off). Also settable later as the attribute.
        kv_bucket: the smallest KV length bucket (a power of two; buckets double up to the capacity).
        norms_module: the fused residual add + RMSNorm (``add_rms_norm_llama``) and SwiGLU activation
            (``silu_mul``) of a fused-norms library (`FusedNormsKernel`, a loaded module or a ``.so``
            path; CUDA only), or None: the torch ops (module docstring, "Kernels of a layer"). Also
            settable later as the attribute (captured graphs are dropped then).
        mixers_module: the fused RoPE + KV write (``rope_kv``) and, when the library has it and
            takes the dtype and head_dim, the attention over the pool (``grouped_attention``) of a
            fused-mixers library (`FusedMixersKernel`, a loaded module or a ``.so`` path; CUDA
            only), used by static rounds, or None: `rope_qk`, the pool write, the gather and SDPA in
            torch. Also settable later.

    Memory (bytes): KV 2 x layers x (max_lanes + 1) x capacity x kv_heads x head_dim x dtype size;
    with CUDA graphs a static logits buffer of 4 x L' x max_columns x vocab_size (L' =
    `lane_width(max_lanes)`).

    Raises:
        ValueError: max_lanes, max_columns, kv_bucket, max_context or chunked_prefill out of range;
            cuda_graphs=True off CUDA. Otherwise as `LlamaExecutor`.
    """

    def __init__(
        self,
        config: _DecoderConfig,
        weights: Mapping[str, torch.Tensor | Q4Weight],
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        linear: LinearFn | None = None,
        max_lanes: int = 8,
        max_context: int | None = None,
        max_columns: int = 8,
        cuda_graphs: bool | None = None,
        chunked_prefill: int | None = None,
        kv_bucket: int = 256,
        norms_module: Any = None,
        mixers_module: Any = None,
    ) -> None:
        super().__init__(config, weights, device=device, dtype=dtype, linear=linear)  # type: ignore[arg-type]
        self._norms_kernel: FusedNormsKernel | None = None
        self._mixers_kernel: FusedMixersKernel | None = None
        self._graphs: dict[tuple[Any, ...], CapturedRound] = {}
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
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got {self.device}")
        self.cuda_graphs = bool(on_cuda if cuda_graphs is None else cuda_graphs)
        self.max_lanes, self.max_columns, self.max_context = max_lanes, max_columns, max_context
        self.capacity = max_context + max_columns
        self.kv_bucket = kv_bucket
        if chunked_prefill is None:
            chunked_prefill = CHUNKED_PREFILL_ROUNDS * max_columns if self.cuda_graphs else 0
        if chunked_prefill < 0:
            raise ValueError(f"chunked_prefill must be >= 0, got {chunked_prefill}")
        self.chunked_prefill = chunked_prefill
        self.sdpa_backend = pick_sdpa_backend(self.device, dtype, self._hd)
        self.column_widths = default_column_widths(max_columns)
        self._free: list[int] = list(range(max_lanes))
        self._pool: Any = None
        self.norms_module = norms_module
        self.mixers_module = mixers_module
        self.num_captures = 0
        self.num_replays = 0
        self._allocate(max_lanes)

    @property
    def norms_module(self) -> FusedNormsKernel | None:
        """The fused residual add + RMSNorm and SwiGLU activation (`FusedNormsKernel` with
        ``add_rms_norm_llama``) the rounds run, or None (the torch ops)."""
        return self._norms_kernel

    @norms_module.setter
    def norms_module(self, source: Any) -> None:
        """Set from a loaded module, a ``.so`` path or a `FusedNormsKernel` (None: the torch ops);
        captured graphs are dropped (recaptured on demand).

        Raises:
            ValueError: a module on a device other than CUDA, or one without ``add_rms_norm_llama``
                (a library built before it).
        """
        if source is not None:
            if self.device.type != "cuda":
                raise ValueError(f"norms_module needs a CUDA device, got {self.device}")
            source = FusedNormsKernel(source)
            if not source.has_add_rms_norm_llama:
                raise ValueError(
                    "norms_module: the fused norms library has no add_rms_norm_llama (built before it)"
                )
        self._norms_kernel = source
        if self._graphs:  # captured with the other norms: recaptured on demand, in a new pool
            self._graphs.clear()
            self._pool = None

    @property
    def mixers_module(self) -> FusedMixersKernel | None:
        """The fused RoPE + KV write (`FusedMixersKernel` with ``rope_kv``) static rounds run, or None
        (torch's `rope_qk` and the pool write)."""
        return self._mixers_kernel

    @mixers_module.setter
    def mixers_module(self, source: Any) -> None:
        """Set from a loaded module, a ``.so`` path or a `FusedMixersKernel` (None: torch); captured
        graphs are dropped.

        Raises:
            ValueError: a module on a device other than CUDA, or one without ``rope_kv``.
        """
        if source is not None:
            if self.device.type != "cuda":
                raise ValueError(f"mixers_module needs a CUDA device, got {self.device}")
            source = FusedMixersKernel(source)
            if not source.has_rope_kv:
                raise ValueError("mixers_module: the fused mixers library has no rope_kv (built before it)")
        self._mixers_kernel = source
        if self._graphs:
            self._graphs.clear()
            self._pool = None

    def _allocate(self, lanes: int, old: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Pools for `lanes` lane slots plus the scratch slot (the old pools' lanes copied over), the
        static input buffer and (with graphs) the static logits buffer; graphs dropped."""
        c, dev = self.config, self.device
        nkv = self._nkv
        shape = (c.num_hidden_layers, lanes + 1, self.capacity, 2 * nkv, self._hd)
        rows = lane_width(lanes) * self.max_columns
        # normal tensors even when built under inference mode (checkpoint restores write them outside it)
        with torch.inference_mode(False):
            # one pool: a position's keys then its values (one gather a layer reads both)
            kv = torch.zeros(shape, dtype=self.dtype, device=dev)
            keys, values = kv[..., :nkv, :], kv[..., nkv:, :]
            if old is not None:
                used = old[0].shape[1] - 1  # the old pools' lane slots (their scratch slot is not kept)
                keys[:, :used].copy_(old[0][:, :used])
                values[:, :used].copy_(old[1][:, :used])
            # static inputs: token ids [rows] | positions [rows] | slots [lanes'] (views per round shape)
            self._inputs = torch.zeros(2 * rows + lane_width(lanes), dtype=torch.long, device=dev)
            self._logits_out = (
                torch.zeros(rows, c.vocab_size, dtype=torch.float32, device=dev) if self.cuda_graphs else None
            )
            # the static rounds' activations of linears whose tiled weight is padded to K' columns:
            # one zero buffer [rows, K'] per (K, K'), its columns past K never written (zeros)
            first = self.layers[:1]
            padded = [w for layer in first for w in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down)]
            padded.append(self.lm_head)
            self._pad_bufs = {
                (w.in_features, w.padded_in_features): torch.zeros(
                    rows, w.padded_in_features, dtype=self.dtype, device=dev
                )
                for w in padded
                if isinstance(w, Q4Weight) and w.cols is not None
            }
            self._pad_rows = rows
        self._kv, self._keys, self._values = kv, keys, values
        self._scratch = lanes
        self._graphs.clear()
        self._pool = None

    # ---- lanes ----

    def new_lane(self, capacity: int = 0) -> StaticLlamaLaneState:  # type: ignore[override]
        """A fresh lane in the lowest free slot, empty. `capacity` is accepted for `LlamaExecutor`'s
        signature and ignored (every slot holds max_context tokens). With every slot taken the pools
        grow to twice max_lanes first (a logged warning; captured graphs are dropped and recaptured
        at the new addresses)."""
        if not self._free:
            self._grow()
        self._free.sort()
        return StaticLlamaLaneState(self, self._free.pop(0))

    def _grow(self) -> None:
        old, new = self.max_lanes, 2 * self.max_lanes
        log.warning(
            "all %d lane slots are taken: growing the pooled buffers to %d lanes (graphs recaptured)",
            old,
            new,
        )
        self._allocate(new, (self._keys, self._values))
        self._free += list(range(old, new))
        self.max_lanes = new

    def release_lane(self, state: StaticLlamaLaneState) -> None:
        """Give the lane's slot back (its state is gone; a pending forward is dropped). Idempotent.

        Raises:
            StateError: the state belongs to another executor.
        """
        if not isinstance(state, StaticLlamaLaneState) or state._owner is not self:
            raise StateError("release_lane: the state was not created by this executor's new_lane()")
        if state._released:
            return
        state._released = True
        state._pending = None
        state._finalizer()

    def _lane_gone(self, slot: int, lane_id: int) -> None:
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
        states: Sequence[StaticLlamaLaneState],
        columns: Sequence[torch.Tensor],
        *,
        logits: str = "all",
        record: bool = True,
        output_hidden_states: bool = False,
        tap_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """Run every lane's next columns through the model; leaves them pending until `commit`
        (`LlamaExecutor.forward`'s contract and returns).

        A forward whose lanes all have <= max_columns columns is a static round (graphed on CUDA); one
        of more than max_columns but at most `chunked_prefill` columns runs as chunks of static rounds;
        longer ones run eagerly over the pools (module docstring).

        Raises:
            StateError: as `LlamaExecutor.forward`; also a released lane or a lane past max_context.
            ValueError: logits not "all" / "last".
        """
        # a list subclass stays as it is: `HostKnownColumns` / `InRangeColumns` tell the checks what
        # they need not read from the device
        states, columns = list(states), columns if isinstance(columns, list) else list(columns)
        host, flat = self._check_forward(states, columns, logits, tap_layers)
        lens = [int(c.numel()) for c in host]
        taps = tuple(int(t) for t in tap_layers)
        n = max(lens)
        if flat is None and n > self.max_columns:  # `InRangeColumns` past a static round: host paths
            host, flat = _host_ids(list(host))
        if self.max_columns < n <= self.chunked_prefill:
            return self._chunked_forward(states, host, lens, record, logits, output_hidden_states, taps)
        if n <= self.max_columns:
            out = self._static_forward(states, flat, lens, output_hidden_states, taps, device_ids=host)
        else:
            out = self._eager_forward(states, host, lens, logits, output_hidden_states, taps)
        for s, n_i in zip(states, lens, strict=True):
            s._pending = (n_i, record)
        return self._split(out, lens, logits)

    def _check_forward(
        self,
        states: list[StaticLlamaLaneState],
        columns: list[torch.Tensor],
        logits: str,
        tap_layers: Sequence[int],
    ) -> tuple[list[torch.Tensor], list[int] | None]:
        """`LlamaExecutor.forward`'s checks (same errors) plus released lanes and max_context, on one
        host copy of the columns. Returns the columns on the host (int64 views of one CPU tensor, lane
        by lane) and every lane's ids in one flat list (lane after lane). The torch calls do not
        grow with the lanes: one concatenation, one copy to the host, one split (`_host_ids`).
        Columns in range by construction (`ignis.runtime.round_batch.InRangeColumns`, the argmax rows
        of this executor's logits) are neither copied nor range-checked: returned as they are (int64
        on the executor's device), with None for the flat list."""
        if logits not in ("all", "last"):
            raise ValueError(f"logits must be 'all' or 'last', got {logits!r}")
        if len(states) != len(columns) or not states:
            raise StateError(
                f"forward needs one column tensor per lane, got {len(states)} lanes and "
                f"{len(columns)} column tensors"
            )
        cfg = self.config
        for t in tap_layers:
            if not 0 <= int(t) < cfg.num_hidden_layers:
                raise StateError(f"tap layer {t} outside 0..{cfg.num_hidden_layers - 1}")
        seen: set[int] = set()
        for i, (s, col) in enumerate(zip(states, columns, strict=True)):
            if not isinstance(s, StaticLlamaLaneState) or s._owner is not self:
                raise StateError(f"lane {i} was not created by this executor")
            if s._released:
                raise StateError(f"lane {i}: the lane was released")
            if id(s) in seen:
                raise StateError(f"lane {i} appears twice in one forward")
            seen.add(id(s))
            if s._pending is not None:
                raise StateError(f"lane {i} has {s._pending[0]} uncommitted columns; commit before forward")
            if not isinstance(col, torch.Tensor) or col.dim() != 1 or col.numel() == 0:
                shape = tuple(col.shape) if isinstance(col, torch.Tensor) else type(col).__name__
                raise StateError(f"lane {i}: columns must be a non-empty 1-D tensor, got shape {shape}")
            if col.is_floating_point():
                raise StateError(f"lane {i}: columns must be integer token ids, got {col.dtype}")
            n = int(col.numel())
            if s.num_tokens + n > self.max_context:
                raise StateError(
                    f"lane {i}: {s.num_tokens} + {n} tokens would pass this executor's max_context "
                    f"{self.max_context}"
                )
        if getattr(columns, "in_range", False):
            return [c.to(device=self.device, dtype=torch.int64) for c in columns], None
        host, flat = _host_ids(columns)
        if min(flat) < 0 or max(flat) >= cfg.vocab_size:  # name the first lane holding a bad id
            at = 0
            for i, col in enumerate(host):
                ids = flat[at : at + int(col.numel())]
                at += len(ids)
                lo, hi = min(ids), max(ids)
                if lo < 0 or hi >= cfg.vocab_size:
                    bad = lo if lo < 0 else hi
                    raise StateError(f"lane {i}: token id {bad} outside 0..{cfg.vocab_size - 1}")
        return host, flat

    def _split(self, out: dict[str, torch.Tensor], lens: list[int], logits: str) -> ForwardOutput:
        """Per-lane views of a round's outputs ([lanes, n', ...] rows, or [lanes, vocab] for "last")."""
        if out["logits"].dim() == 2:  # "last": one row per lane
            per = list(out["logits"].split(1))
        else:
            n = int(out["logits"].shape[1])
            per = [p if n_i == n else p[:n_i] for p, n_i in zip(out["logits"].unbind(0), lens, strict=True)]
            if logits == "last":
                per = [p[-1:] for p in per]
        hidden = [out["hidden"][i, :n_i] for i, n_i in enumerate(lens)] if "hidden" in out else None
        taps = [out["taps"][i, :n_i] for i, n_i in enumerate(lens)] if "taps" in out else None
        return ForwardOutput(logits=per, hidden_states=hidden, taps=taps)

    # ---- rounds ----

    def _round_shape(self, lanes: int, n: int) -> tuple[int, int]:
        """(L', n'): the padded lanes and columns of a static round (module docstring)."""
        return lane_width(lanes), next(w for w in self.column_widths if w >= n)

    def _static_forward(
        self,
        states: list[StaticLlamaLaneState],
        flat: list[int] | None,
        lens: list[int],
        want_hidden: bool,
        taps: tuple[int, ...],
        device_ids: list[torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """A static round: its inputs (token ids [L' * n'] with dummy columns 0, positions [L', n']:
        past + column, a padding lane's 0..n'-1, slots [L']: the padding lanes' the scratch slot)
        laid out in one host list and copied into the static input buffer at once
        (`_copy_inputs`), the round run, the real lanes' rows copied out: [lanes, n', ...]. With
        `flat` None the ids are `device_ids` (per lane int64 [n_i] on the device, `InRangeColumns`),
        copied into the input buffer on the device after the host inputs: no host read."""
        lanes = len(states)
        lp, n = self._round_shape(lanes, max(lens))
        if flat is None:
            flat = [0] * sum(lens)  # placeholders, overwritten on the device below
        else:
            device_ids = None
        ids: list[int] = []
        pos: list[int] = []
        at = 0
        for s, n_i in zip(states, lens, strict=True):
            ids += flat[at : at + n_i]
            at += n_i
            if n_i < n:
                ids += [0] * (n - n_i)
            past = s.num_tokens
            pos += range(past, past + n)
        pad = lp - lanes
        if pad:
            ids += [0] * (pad * n)
            pos += list(range(n)) * pad
        slots = [s.slot for s in states] + [self._scratch] * pad
        bucket = kv_bucket(max(s.num_tokens for s in states) + n, self.kv_bucket, self.capacity)
        self._copy_inputs(ids + pos + slots)
        if device_ids is not None:  # device to device, ordered after the host copy on the stream
            d_ids = self._inputs[: lp * n].view(lp, n)
            if all(n_i == n for n_i in lens):
                d_ids[:lanes].copy_(torch.cat([c.reshape(-1) for c in device_ids]).view(lanes, n))
            else:
                for i, c in enumerate(device_ids):
                    d_ids[i, : lens[i]].copy_(c)
        out = self._run_round(lp, n, bucket, want_hidden, taps)
        # the real lanes' rows, copied out of the round's (static) buffers: [lanes, n', ...]
        return {k: v.view(lp, n, -1)[:lanes].clone() for k, v in out.items()}

    def _copy_inputs(self, values: list[int]) -> None:
        """Write `values` into the front of the static input buffer: one host->device copy, from
        page-locked memory without waiting for it on CUDA (the replay that reads the buffer is ordered
        after it on the stream; torch's caching host allocator keeps the page-locked block until the
        copy is done), a plain copy on the CPU."""
        host = torch.frombuffer(array("q", values), dtype=torch.int64)
        dst = self._inputs[: len(values)]
        if dst.device.type == "cuda":
            dst.copy_(host.pin_memory(), non_blocking=True)
        else:
            dst.copy_(host)

    def _run_round(
        self, lp: int, n: int, bucket: int, want_hidden: bool, taps: tuple[int, ...]
    ) -> dict[str, torch.Tensor]:
        """The static round of shape (lp, n, bucket) over the inputs in the static input buffer: run
        eagerly, or replayed from its graph (captured first when new). Returns the round's outputs
        (with graphs: the graph's static buffers, overwritten by the next replay)."""
        rows = lp * n
        buf = self._inputs[: 2 * rows + lp]
        d_ids, d_pos, d_slots = buf[:rows], buf[rows : 2 * rows].view(lp, n), buf[2 * rows :]

        def body() -> dict[str, torch.Tensor]:
            out = self._body(d_ids, d_pos, d_slots, bucket, want_hidden=want_hidden, taps=taps)
            if self._logits_out is not None:  # graphs: one static logits buffer for every shape
                dst = self._logits_out[:rows]
                dst.copy_(out["logits"])
                out["logits"] = dst
            return out

        if not self.cuda_graphs:
            return body()
        key = (lp, n, bucket, want_hidden, taps)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(body)
            self._graphs[key] = entry
        entry.graph.replay()
        self.num_replays += 1
        return entry.outputs

    def _capture(self, body: Callable[[], dict[str, torch.Tensor]]) -> CapturedRound:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            entry = capture_round(body, device=self.device, pool=self._pool)
        except BaseException:
            self._pool = None  # a failed capture's pool may stay refused (`tvm_runtime.capture`)
            raise
        self.num_captures += 1
        return entry

    def _chunked_forward(
        self,
        states: list[StaticLlamaLaneState],
        host: list[torch.Tensor],
        lens: list[int],
        record: bool,
        logits: str,
        want_hidden: bool,
        taps: tuple[int, ...],
    ) -> ForwardOutput:
        """The forward as consecutive static rounds of max_columns columns, each committed whole, then
        the lanes' lengths put back and the whole forward left pending (module docstring)."""
        starts = [s.num_tokens for s in states]
        try:
            parts = run_chunks(
                self, states, host, lens, self.max_columns, logits=logits, want_hidden=want_hidden, taps=taps
            )
        finally:
            for s, p in zip(states, starts, strict=True):  # back to before the forward
                s._pending = None
                s._num_tokens = p
        for s, n_i in zip(states, lens, strict=True):
            s._pending = (n_i, record)
        last = logits == "last"
        return ForwardOutput(
            logits=[p[-1] if last else torch.cat(p) for p in parts["l"]],
            hidden_states=[torch.cat(p) for p in parts["h"]] if want_hidden else None,
            taps=[torch.cat(p) for p in parts["t"]] if taps else None,
        )

    def _eager_forward(
        self,
        states: list[StaticLlamaLaneState],
        host: list[torch.Tensor],
        lens: list[int],
        logits: str,
        want_hidden: bool,
        taps: tuple[int, ...],
    ) -> dict[str, torch.Tensor]:
        """A long forward over the pools without padding to a round shape: [lanes, n = max n_i] rows,
        only the real columns' keys written, attention over the longest lane's exact length."""
        lanes, n = len(states), max(lens)
        dev = self.device
        ids = torch.zeros(lanes, n, dtype=torch.long)
        for i, col in enumerate(host):
            ids[i, : lens[i]] = col
        starts = torch.tensor([s.num_tokens for s in states], dtype=torch.long)
        pos = torch.arange(n, dtype=torch.long)[None, :] + starts[:, None]
        slots = torch.tensor([s.slot for s in states], dtype=torch.long)
        valid = torch.tensor([i * n + j for i, n_i in enumerate(lens) for j in range(n_i)], dtype=torch.long)
        last = None
        if logits == "last":
            last = torch.tensor([i * n + n_i - 1 for i, n_i in enumerate(lens)], device=dev)
        out = self._body(
            ids.view(-1).to(dev),
            pos.to(dev),
            slots.to(dev),
            max(s.num_tokens + n_i for s, n_i in zip(states, lens, strict=True)),
            want_hidden=want_hidden,
            taps=taps,
            valid=valid.to(dev),
            logit_rows=last,
        )
        shaped = {k: v.view(lanes, n, -1) for k, v in out.items() if k != "logits" or last is None}
        if last is not None:
            shaped["logits"] = out["logits"]  # [lanes, vocab]
        return shaped

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """HF LlamaRMSNorm (float32 statistics, cast back before the weight multiply), torch's fused op.
        out: a zero-padded activation buffer [rows, K'] (`_padded_input`) whose first H columns
        receive the result, which is then `out` itself; None: a new tensor [rows, H]."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps).to(x.dtype)
        if out is None:
            return weight * normed
        torch.mul(weight, normed, out=out[:, : x.shape[-1]])
        return out

    def _add_norm(
        self, x: torch.Tensor, d: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the RMSNorm after it: (x + d, `_norm`(x + d, weight)), [rows, H] each
        (the norm written into `out` as `_norm` says when given). With `norms_module`: one
        ``add_rms_norm_llama`` launch (HF's two roundings, float32 math; only the sum of squares'
        order differs from torch's), else the torch ops (an add, then the norm's 2-4 kernels)."""
        fused = self._norms_kernel
        if fused is not None:
            target = None if out is None else out[:, : x.shape[-1]]
            x, h = fused.add_rms_norm_llama(x, d, weight, self.config.rms_norm_eps, x_out=target)
            return x, h if out is None else out
        x = x + d
        return x, self._norm(x, weight, out)

    def _padded_input(self, weight: Any, rows: int, pad: bool) -> torch.Tensor | None:
        """The zero-padded activation buffer [rows, K'] that a tiled q4 weight padded to K' input
        columns (`Q4Weight.cols`: its K % 128 != 0) reads, when `pad` (a static round): the op
        before the linear writes its [rows, K] result into the front columns, and the linear takes
        the whole buffer with no padding copy (`LinearBackend`'s pre-padded activations). None for
        any other weight, or outside static rounds (the linear then pads itself)."""
        if not pad or not isinstance(weight, Q4Weight) or weight.cols is None:
            return None
        buf = self._pad_bufs.get((weight.in_features, weight.padded_in_features))
        return None if buf is None else buf[:rows]

    def _silu_mul(self, gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """SwiGLU's ``silu(gate) * up`` of the fused gate|up output gu [rows, 2 I]: one ``silu_mul``
        launch with `norms_module` (bit-identical to torch's two kernels), else torch. out: a
        zero-padded activation buffer [rows, K'] whose first I columns receive it (then returned),
        or None (a new tensor)."""
        fused = self._norms_kernel
        inter = gu.shape[-1] // 2
        target = None if out is None else out[:, :inter]
        if fused is not None and fused.has_silu_mul and gu.shape[0] <= SILU_MUL_MAX_ROWS:
            if target is None:
                return fused.silu_mul(gu)
            fused.silu_mul(gu, out=target)
            return out  # type: ignore[return-value]
        gate, up = gu.chunk(2, dim=-1)
        if target is None:
            return F.silu(gate) * up
        torch.mul(F.silu(gate), up, out=target)
        return out  # type: ignore[return-value]

    def _body(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        slots: torch.Tensor,
        bucket: int,
        *,
        want_hidden: bool,
        taps: tuple[int, ...],
        valid: torch.Tensor | None = None,
        logit_rows: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """One forward over fixed shapes: ids [L*n] int64, pos [L, n] int64 (past + column), slots [L]
        int64, bucket = KV length read. valid: the rows whose keys are written (None: all, a static
        round); logit_rows: the rows whose logits are computed (None: all). No host syncs and no
        host->device copies (capture-safe). Returns logits float32 [rows, vocab], and hidden [rows,
        H] / taps [rows, len(taps) * H] when asked."""
        lanes, n = pos.shape
        nh, nkv, hd = self._nh, self._nkv, self._hd
        rep = nh // nkv
        rows = lanes * n
        linear = self.linear
        x = F.embedding(ids, self.embed)  # [R, H]
        pos_rows = pos.reshape(-1)
        cos, sin = self._rope(pos_rows)  # [R, 1, hd]
        mixers = self._mixers_kernel if valid is None else None  # static rounds: one fused kernel
        sin_signed = signed_sin(sin) if mixers is None else sin
        # attention straight from the pool (no gather, no mask): static rounds with rope_kv's q
        attend = mixers is not None and mixers.grouped_attention_takes(self.dtype, hd, self.device)
        mask = None if attend else round_mask(pos, bucket, rep)
        slot_rows = slots[:, None].expand(lanes, n).reshape(-1)
        if valid is not None:
            slot_rows, key_rows = slot_rows[valid], pos_rows[valid]
        else:
            key_rows = pos_rows
        tapped: dict[int, torch.Tensor] = {}
        layers = self.layers
        # the first input norm alone; every later norm runs with the residual add before it
        pad = valid is None and rows <= self._pad_rows  # a static round: the padded buffers serve
        first = layers[0] if layers else None
        h = self._norm(
            x,
            first.norm_in if first else self.norm,
            out=self._padded_input(first.w_qkv if first else self.lm_head, rows, pad),
        )
        for li, layer in enumerate(layers):
            qkv = linear(h, layer.w_qkv, layer.b_qkv)  # [R, (nh + 2 nkv) hd]
            heads = qkv.view(rows, nh + 2 * nkv, hd)
            if mixers is not None:  # RoPE of q and k and the keys' and values' write: one kernel
                q = mixers.rope_kv(
                    heads[:, :nh],
                    heads[:, nh : nh + nkv],
                    heads[:, nh + nkv :],
                    cos.view(rows, hd),
                    sin.view(rows, hd),
                    pos_rows,
                    slots,
                    self._keys[li],
                    self._values[li],
                )
            else:
                # q and k rotated together, in place (`rope_qk`): qkv then holds [q | k | v] with k
                # beside v, as a pool position holds them (keys then values)
                rope_qk(heads[:, : nh + nkv], cos, sin_signed, out=heads[:, : nh + nkv])
                q, kv_new = heads[:, :nh], heads[:, nh:]  # kv_new [R, 2 nkv, hd]
                if valid is not None:
                    kv_new = kv_new[valid]
                self._kv[li][slot_rows, key_rows] = kv_new  # keys and values: one write
            o_buf = self._padded_input(layer.w_o, rows, pad)
            if attend:
                assert mixers is not None
                o = mixers.grouped_attention(
                    q,
                    self._keys[li],
                    self._values[li],
                    pos_rows,
                    slots,
                    bucket,
                    self._scale,
                    out=None if o_buf is None else o_buf[:, : nh * hd],
                )
                o = o if o_buf is None else o_buf
            else:
                assert mask is not None
                lanes_kv = self._kv[li, :, :bucket].index_select(0, slots)  # [L, T, 2 nkv, hd]: one gather
                keys = lanes_kv[:, :, :nkv].transpose(1, 2)  # [L, nkv, T, hd]
                values = lanes_kv[:, :, nkv:].transpose(1, 2)
                with sdpa_kernel([self.sdpa_backend]):
                    o = grouped_attention(
                        q.view(lanes, n, nkv, rep, hd), keys, values, mask, self._scale, out=o_buf
                    )
            post = self._padded_input(layer.w_gate_up, rows, pad)
            x, h = self._add_norm(x, linear(o, layer.w_o, layer.b_o), layer.norm_post, out=post)
            act = self._silu_mul(
                linear(h, layer.w_gate_up, layer.b_gate_up), out=self._padded_input(layer.w_down, rows, pad)
            )
            nxt = layers[li + 1] if li + 1 < len(layers) else None
            after = self._padded_input(nxt.w_qkv if nxt else self.lm_head, rows, pad)
            x, h = self._add_norm(
                x, linear(act, layer.w_down, layer.b_down), nxt.norm_in if nxt else self.norm, out=after
            )
            if li in taps:
                tapped[li] = x
        head_in = h if logit_rows is None else h.index_select(0, logit_rows)  # the final norm's rows
        out = {"logits": linear(head_in, self.lm_head, None).float()}
        if want_hidden:
            out["hidden"] = x
        if taps:
            out["taps"] = torch.cat([tapped[t] for t in taps], dim=-1)
        return out

    # ---- load ----

    def warm_up(self, *, columns: Sequence[int] = (), context: int | None = None) -> int:
        """Capture, at load, the graphs of every round shape that rounds over lanes holding up to
        `context` tokens can meet: lane counts 1 .. max_lanes (as `lane_width` pads them) x
        `column_widths` x the KV buckets up to the one holding `context` (the hybrid's
        `StaticHybridExecutor.warm_up` rule; the server passes ``--graph-warmup-context`` to both). The
        rounds run in the scratch slot (no lane is touched).

        Args:
            columns: column counts to add to `column_widths` first (e.g. draft_tokens + 1: verify
                rounds of that many columns then run unpadded), each 1..max_columns; they apply with
                or without CUDA graphs.
            context: tokens a round reads (a lane's past + the round's columns) up to which every KV
                bucket is captured, >= 1; None: the capacity (every bucket). Longer rounds capture
                their bucket on first use.

        Returns:
            graphs captured now (0 without CUDA graphs; shapes captured before are kept).

        Raises:
            ValueError: a column count outside 1..max_columns, or context < 1.
        """
        for n in columns:
            if not 1 <= int(n) <= self.max_columns:
                raise ValueError(f"warm_up: column count {n} outside 1..max_columns {self.max_columns}")
        if context is not None and context < 1:
            raise ValueError(f"warm_up: context must be >= 1 tokens, got {context}")
        self.column_widths = tuple(sorted(set(self.column_widths) | {int(n) for n in columns}))
        if not self.cuda_graphs:
            return 0
        reach = self.capacity if context is None else min(context, self.capacity)
        base = [kv_bucket(1, self.kv_bucket, self.capacity)]
        while base[-1] < reach:
            base.append(kv_bucket(2 * base[-1], self.kv_bucket, self.capacity))
        lane_widths = sorted({lane_width(n) for n in range(1, self.max_lanes + 1)})
        before = self.num_captures
        with torch.no_grad():
            for lp in lane_widths:
                for n in self.column_widths:
                    for bucket in sorted({kv_bucket(max(b, n), self.kv_bucket, self.capacity) for b in base}):
                        if (lp, n, bucket, False, ()) in self._graphs:
                            continue
                        rows = lp * n
                        buf = self._inputs[: 2 * rows + lp]
                        buf.zero_()
                        buf[rows : 2 * rows].copy_(torch.arange(n, device=self.device).repeat(lp))
                        buf[2 * rows :].fill_(self._scratch)
                        self._run_round(lp, n, bucket, False, ())
        log.debug("warm_up: lanes %s x columns %s x KV buckets %s", lane_widths, self.column_widths, base)
        return self.num_captures - before
