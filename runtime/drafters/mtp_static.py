"""The MTP head with pooled lane state and static rounds, replayed from CUDA graphs (issue 22).

`StaticMTPDrafter` is `ignis.runtime.drafters.mtp.MTPDrafter` (same weights, same head maths, same
protocol) with every lane's head state in buffers allocated once, so that a decode round's head work
is a fixed sequence of kernels over fixed addresses: on CUDA each shape is captured once and replayed;
on the CPU (and with ``cuda_graphs=False``) the very same code runs eagerly, which is how the CPU tests
prove it.

State (allocated at construction; grown only when every lane slot is taken):

* ``capacity = max_context + 2 * MAX_COLUMNS`` rows per lane, ``max_lanes`` lane slots (MAX_COLUMNS =
  MAX_DRAFT_TOKENS + 1 = 8). Keys and values ``[max_lanes, capacity, kv_heads, head_dim]`` (model
  dtype; keys after q/k norm and RoPE), the chained hidden ``[max_lanes, H]``: the head's output
  (after ``mtp.norm``) at each lane's last committed row, and the trunk's pre-norm hidden state there
  ``[max_lanes, H]`` (what a prompt checkpoint keeps). A lane takes a free slot at `start_lane`
  (or `restore_lane`) and gives it back at `end_lane`; with every slot taken the pools double (a
  logged warning; graphs are dropped and recaptured).
* Row i of a lane pairs the trunk's hidden state at position i with the token committed after it
  (`ignis.runtime.drafters.mtp`); ``length`` rows are committed. Rows past it are scratch: what a
  proposal or a padded commit column writes there is masked out and overwritten later, so a rejected
  draft leaves no trace.

Static shapes, each keyed by the lane count L and the KV bucket T (the smallest ``kv_bucket * 2**i``
holding the rows a shape reads; `ignis.runtime.families.static_rounds.kv_bucket`):

* commit (L, n, T): the committed columns of L lanes (m_i <= n each, padded to the smallest of
  `column_widths` >= max m_i with token 0 and zero hidden rows) through the head's layer in one batch;
  every column's key and value written at its position; the chained hidden of each lane taken from
  its last real column. Spans wider than MAX_COLUMNS (prompts) and lanes restored from a checkpoint
  run `MTPDrafter`'s eager code over the same pooled rows.
* chain (L, k, T): a whole greedy k-draft proposal: draft 1 = argmax lm_head(chained hidden); then
  k - 1 times: the row (previous output, previous draft) at the next position through the layer,
  argmax lm_head of its output. The argmax feeds the next step on the device; the [L, k] drafts come
  to the host in one copy at the end.
* step0 (L) and step (L, T): a proposal with sampled lanes runs per step (the lanes' own generators
  draw on the host side between steps, as `MTPDrafter` does: q is returned): step0 = the lm_head
  logits of the chained hidden, step = one layer row per lane and its logits.

Every data-dependent quantity of a shape (slots, positions, tokens, hidden rows, last-column indices)
is a device tensor in a static input buffer; attention gathers the lanes' rows up to T and masks each
query row to positions <= its own (one SDPA over [L, kv_heads, rep * n, T] with the query heads of a
KV head stacked, as `ignis.runtime.families.hybrid_graphs` does). Graphs are captured at load by
`warm_up` (lane counts 1..max_lanes x every commit width (a short prompt commits as a static shape
too) x draft counts 1..k x the KV buckets up to a context bound, in free lane slots) and lazily for
any other key, all sharing one memory pool (`ignis.runtime.families.static_rounds.capture_round`).
Graphs are off (the static code runs eagerly) off CUDA and for a MoE head whose routing syncs the
host (the reference expert loop: no compiled grouped kernels, or non-q4 experts); with resident
experts and the compiled grouped kernels (`ignis.runtime.families.moe_grouped.grouped_moe_block`)
the MoE layer is captured too.

Numerics equal `MTPDrafter`'s to float rounding: attention is one masked SDPA over the bucket instead
of one unmasked SDPA per lane over its exact length (float32 logits agree to ~1e-5; tests). Graphed and
eager static shapes run the same kernels and agree bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ignis.runtime.checkpoints import DrafterSnapshot
from ignis.runtime.drafters.base import CommittedSpan, DraftProposal, DraftRequest
from ignis.runtime.drafters.common import apply_rope, rope_cos_sin
from ignis.runtime.drafters.mtp import MTPDrafter, MTPLaneState, _Weight
from ignis.runtime.errors import StateError
from ignis.runtime.families.attention import sdpa
from ignis.runtime.families.hybrid_executor import rms_norm_one_plus
from ignis.runtime.families.llama_graphs import default_column_widths
from ignis.runtime.families.moe import SparseMoeWeights, sparse_moe_block, swiglu_mlp
from ignis.runtime.families.qwen3_5 import HybridConfig, Qwen3_5MoeConfig, Qwen3NextConfig
from ignis.runtime.families.static_rounds import CapturedRound, capture_round, kv_bucket
from ignis.runtime.linear import LinearFn
from ignis.runtime.sampling import logits_to_probs
from ignis.runtime.scheduler import MAX_DRAFT_TOKENS

__all__ = ["MAX_COLUMNS", "StaticMTPDrafter", "head_is_capturable"]

log = logging.getLogger("ignis.runtime.drafters.mtp_static")

MAX_COLUMNS = MAX_DRAFT_TOKENS + 1
"""Widest committed span a static commit takes (the anchor + every draft of a full acceptance)."""

DEFAULT_MAX_CONTEXT = 8192
"""Rows per lane when neither the caller nor a smaller model limit gives one (as the target's)."""


def head_is_capturable(drafter: MTPDrafter) -> bool:
    """Whether the head's layer runs without a host sync (a CUDA graph can hold it): on CUDA, with a
    dense MLP or a MoE MLP whose routed experts are resident and run by the compiled grouped kernels."""
    if drafter.device.type != "cuda":
        return False
    mlp = drafter.head.mlp
    if isinstance(mlp, SparseMoeWeights):
        return mlp.grouped is not None and bool(mlp.grouped.capturable)
    return True


def _params_key(params: Any) -> Any:
    """A dict key under which lanes share one `logits_to_probs` call: the params when hashable (equal
    params give equal distributions row by row), else their identity."""
    try:
        hash(params)
    except TypeError:
        return id(params)
    return params


class _SlotKV:
    """One lane's head KV as rows of the drafter's pools (the `_KV` interface `MTPHead.layer` uses):
    ``keys`` / ``values`` [capacity, kv_heads, head_dim] views of the lane's slot, ``length`` rows
    committed. Looked up on every access, so the views follow a pool that grew."""

    def __init__(self, owner: StaticMTPDrafter, slot: int) -> None:
        self._owner = owner
        self.slot = slot
        self.length = 0

    @property
    def keys(self) -> torch.Tensor:
        return self._owner._k[self.slot]

    @property
    def values(self) -> torch.Tensor:
        return self._owner._v[self.slot]

    def reserve(self, needed: int) -> None:
        """Raises StateError past the lane capacity (the pools are sized for max_context)."""
        if needed > self._owner.capacity:
            raise StateError(
                f"mtp: a lane needs {needed} head rows, the pooled capacity is {self._owner.capacity} "
                f"(max_context {self._owner.max_context})"
            )


class _PooledLane(MTPLaneState):
    """`MTPLaneState` over a lane slot: ``kv`` is a `_SlotKV`; ``last_hidden`` and ``last_trunk_hidden``
    read and write the slot's rows of the chained-hidden and trunk-hidden pools (None until the first
    commit)."""

    def __init__(self, owner: StaticMTPDrafter, slot: int) -> None:
        self._owner = owner
        self._has_hidden = False
        self._has_trunk = False
        super().__init__(_SlotKV(owner, slot))  # type: ignore[arg-type]

    @property  # type: ignore[override]
    def last_trunk_hidden(self) -> torch.Tensor | None:
        return self._owner._trunk[self.kv.slot] if self._has_trunk else None  # type: ignore[attr-defined]

    @last_trunk_hidden.setter
    def last_trunk_hidden(self, value: torch.Tensor | None) -> None:
        if value is None:
            self._has_trunk = False
            return
        self._owner._trunk[self.kv.slot].copy_(value)  # type: ignore[attr-defined]
        self._has_trunk = True

    @property  # type: ignore[override]
    def last_hidden(self) -> torch.Tensor | None:
        return self._owner._hid[self.kv.slot] if self._has_hidden else None  # type: ignore[attr-defined]

    @last_hidden.setter
    def last_hidden(self, value: torch.Tensor | None) -> None:
        if value is None:
            self._has_hidden = False
            return
        self._owner._hid[self.kv.slot].copy_(value)  # type: ignore[attr-defined]
        self._has_hidden = True

    @property
    def slot(self) -> int:
        return int(self.kv.slot)  # type: ignore[attr-defined]


class StaticMTPDrafter(MTPDrafter):
    """The `mtp` backend over pooled lane slots, its rounds CUDA-graphed on CUDA (module docstring).

    Args:
        config, weights, embed_tokens, lm_head, final_norm, device, dtype, linear, moe_module: as
            `MTPDrafter`.
        max_lanes: lane slots allocated at construction (>= 1; the engine's lanes).
        max_context: committed rows per lane (the target's context; None: the smaller of
            max_position_embeddings and 8,192).
        kv_bucket: the smallest KV bucket (a power of two); buckets double up to the capacity.
        cuda_graphs: capture and replay the static shapes (None: when the head is capturable,
            `head_is_capturable`).

    Raises:
        ValueError: max_lanes < 1, kv_bucket not a power of two, max_context outside
            1..max_position_embeddings; cuda_graphs=True off CUDA or with a head that syncs the host.
        plus `MTPDrafter`'s errors.
    """

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
        max_lanes: int = 8,
        max_context: int | None = None,
        kv_bucket: int = 256,
        cuda_graphs: bool | None = None,
    ) -> None:
        super().__init__(
            config,
            weights,
            embed_tokens=embed_tokens,
            lm_head=lm_head,
            final_norm=final_norm,
            device=device,
            dtype=dtype,
            linear=linear,
            moe_module=moe_module,
        )
        if max_lanes < 1:
            raise ValueError(f"max_lanes must be >= 1, got {max_lanes}")
        if kv_bucket < 1 or kv_bucket & (kv_bucket - 1):
            raise ValueError(f"kv_bucket must be a power of two, got {kv_bucket}")
        limit = config.max_position_embeddings
        if max_context is None:
            max_context = min(limit, DEFAULT_MAX_CONTEXT)
        if not 1 <= max_context <= limit:
            raise ValueError(f"max_context must be 1..{limit} (max_position_embeddings), got {max_context}")
        capturable = head_is_capturable(self)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got {self.device}")
        if cuda_graphs and not capturable:
            raise ValueError(
                "mtp: cuda_graphs=True with a MoE head whose routing syncs the host (no compiled grouped "
                "expert kernels, or experts that are not q4_g32)"
            )
        self.cuda_graphs = capturable if cuda_graphs is None else bool(cuda_graphs)
        self.max_lanes, self.max_context, self.kv_bucket = max_lanes, max_context, kv_bucket
        self.capacity = max_context + 2 * MAX_COLUMNS
        self.column_widths: tuple[int, ...] = default_column_widths(MAX_COLUMNS)
        self.num_captures = 0
        self.num_replays = 0
        self._graphs: dict[tuple[Any, ...], CapturedRound] = {}
        self._pool: Any = None
        self._side_stream: torch.cuda.Stream | None = None
        self._free: list[int] = []
        self._allocate(max_lanes)

    # ---- pools ----

    def _allocate(self, lanes: int) -> None:
        """(Re)allocate the pools for `lanes` slots, keeping the rows of slots below the old count."""
        c, dev, dt = self.config, self.device, self.dtype
        shape = (lanes, self.capacity, c.num_key_value_heads, c.head_dim)
        old = getattr(self, "_k", None)
        keys, values = torch.zeros(shape, device=dev, dtype=dt), torch.zeros(shape, device=dev, dtype=dt)
        hid = torch.zeros(lanes, c.hidden_size, device=dev, dtype=dt)
        trunk = torch.zeros(lanes, c.hidden_size, device=dev, dtype=dt)
        if old is not None:
            n = old.shape[0]
            keys[:n], values[:n], hid[:n], trunk[:n] = self._k, self._v, self._hid, self._trunk
        self._k, self._v, self._hid, self._trunk = keys, values, hid, trunk
        rows = lanes * MAX_COLUMNS
        # static inputs: commit ints (ids | positions | slots | last rows), commit hidden rows,
        # propose ints (slots | positions), step tokens / hidden; outputs: drafts, step logits
        self._commit_ints = torch.zeros(2 * rows + 2 * lanes, dtype=torch.long, device=dev)
        self._commit_hidden = torch.zeros(rows, c.hidden_size, device=dev, dtype=dt)
        self._zero_rows = torch.zeros(MAX_COLUMNS, c.hidden_size, device=dev, dtype=dt)
        self._propose_ints = torch.zeros(2 * lanes, dtype=torch.long, device=dev)
        self._step_tokens = torch.zeros(lanes, dtype=torch.long, device=dev)
        self._step_hidden = torch.zeros(lanes, c.hidden_size, device=dev, dtype=dt)
        self._step_out = torch.zeros(lanes, c.hidden_size, device=dev, dtype=dt)
        self._step_logits = torch.zeros(lanes, c.vocab_size, device=dev, dtype=torch.float32)
        self._drafts = torch.zeros(lanes, MAX_DRAFT_TOKENS, dtype=torch.long, device=dev)
        start = 0 if old is None else old.shape[0]
        self._free += list(range(start, lanes))
        self.max_lanes = lanes
        self._graphs.clear()

    def _take_slot(self) -> int:
        if not self._free:
            log.warning(
                "mtp: all %d lane slots are taken: growing the pooled head state to %d lanes "
                "(graphs recaptured)",
                self.max_lanes,
                2 * self.max_lanes,
            )
            self._allocate(2 * self.max_lanes)
        self._free.sort()
        return self._free.pop(0)

    def num_free_lanes(self) -> int:
        """Lane slots not taken."""
        return len(self._free)

    # ---- lanes ----

    def start_lane(self, lane_id: int, prompt_token_ids: Sequence[int]) -> None:
        """Take a lane slot for the lane (its prompt span's `commit` fills it)."""
        self.end_lane(lane_id)
        self._lanes[lane_id] = _PooledLane(self, self._take_slot())

    def restore_lane(self, lane_id: int, prompt_token_ids: Sequence[int], snapshot: DrafterSnapshot) -> None:
        """`MTPDrafter.restore_lane` into a lane slot (the snapshot's rows copied into the pools).

        Raises:
            CheckpointError: the snapshot's tensors do not fit this head.
            StateError: the snapshot is longer than the lane capacity.
        """
        self.end_lane(lane_id)
        super().restore_lane(lane_id, prompt_token_ids, snapshot)
        plain = self._lanes.pop(lane_id)
        rows = plain.kv.length
        lane = _PooledLane(self, self._take_slot())
        try:
            lane.kv.reserve(rows + 1)
        except StateError:
            self._free.append(lane.slot)
            raise
        lane.kv.keys[:rows] = plain.kv.keys[:rows]
        lane.kv.values[:rows] = plain.kv.values[:rows]
        lane.kv.length = rows
        lane.pending_hidden = plain.pending_hidden
        self._lanes[lane_id] = lane

    def end_lane(self, lane_id: int) -> None:
        """Drop the lane's head state and give its slot back."""
        lane = self._lanes.pop(lane_id, None)
        if isinstance(lane, _PooledLane):
            self._free.append(lane.slot)

    # ---- commit ----

    def commit(self, spans: Sequence[CommittedSpan]) -> None:
        """`MTPDrafter.commit`: spans of at most MAX_COLUMNS columns (a verify round's) as one static
        commit shape (graphed on CUDA); wider spans (prompts) by `MTPDrafter`'s eager code over the
        same pooled rows.

        Raises:
            StateError / DrafterError: as `MTPDrafter.commit`.
        """
        if not spans:
            return
        lanes = [self.state(s.lane_id) for s in spans]
        if any(len(s.next_token_ids) > MAX_COLUMNS for s in spans) or any(
            lane.pending_hidden is not None for lane in lanes
        ):
            super().commit(spans)
            return
        for s, lane in zip(spans, lanes, strict=True):
            self._check_span(s, lane)
        counts = [len(s.next_token_ids) for s in spans]
        L = len(spans)
        n = next(w for w in self.column_widths if w >= max(counts))
        rows = L * n
        bucket = self._bucket(max(lane.num_tokens for lane in lanes) + n)
        for lane in lanes:
            lane.kv.reserve(lane.num_tokens + n)
        ids: list[int] = []
        for s, m in zip(spans, counts, strict=True):
            ids += [*s.next_token_ids, *([0] * (n - m))]
        pos = [lane.num_tokens + j for lane in lanes for j in range(n)]
        slots = [lane.slot for lane in lanes]  # type: ignore[attr-defined]
        last = [i * n + m - 1 for i, m in enumerate(counts)]
        host = torch.tensor(ids + pos + slots + last, dtype=torch.long)
        self._commit_ints[: 2 * rows + 2 * L].copy_(host.to(self.device, non_blocking=True))
        parts: list[torch.Tensor] = []
        for s, m in zip(spans, counts, strict=True):
            parts.append(s.hidden_states)  # type: ignore[arg-type]
            if m < n:
                parts.append(self._zero_rows[: n - m])
        with torch.inference_mode():
            torch.cat(
                [p.to(device=self.device, dtype=self.dtype) for p in parts], out=self._commit_hidden[:rows]
            )
            self._run(("commit", L, n, bucket), lambda: self._commit_body(L, n, bucket))
        for lane, s, m in zip(lanes, spans, counts, strict=True):
            lane.kv.length += m
            lane._has_hidden = lane._has_trunk = True  # type: ignore[attr-defined]
            lane.last_token = int(s.next_token_ids[-1])

    def _commit_body(self, lanes: int, n: int, bucket: int) -> dict[str, torch.Tensor]:
        """Static commit over the input buffers (module docstring): no host syncs, capture-safe."""
        rows = lanes * n
        ints = self._commit_ints
        ids, pos = ints[:rows], ints[rows : 2 * rows].view(lanes, n)
        slots, last = ints[2 * rows : 2 * rows + lanes], ints[2 * rows + lanes : 2 * rows + 2 * lanes]
        g = rms_norm_one_plus(self._commit_hidden[:rows], self.final_norm, self.config.rms_norm_eps)
        x = self.head.input_rows(F.embedding(ids, self.embed_tokens), g)
        out = self._layer(x, pos, slots, bucket)
        self._hid.index_copy_(0, slots, out.index_select(0, last))
        self._trunk.index_copy_(0, slots, self._commit_hidden[:rows].index_select(0, last))
        return {}

    # ---- propose ----

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """`MTPDrafter.propose` as static shapes: greedy rounds as one chain shape (one replay and one
        device-to-host copy of the drafts), rounds with sampled lanes step by step (the lanes' draws
        on the host side between steps, q returned). Draft ids come back as host int64 tensors.

        Raises:
            StateError: as `MTPDrafter.propose`; a lane whose drafts would pass the lane capacity.
        """
        if not requests:
            return []
        lanes = self._check_requests(requests)
        ks = [max(0, r.num_drafts) for r in requests]
        k = min(max(ks), MAX_DRAFT_TOKENS)
        if k == 0:
            return [DraftProposal(torch.empty(0, dtype=torch.int64)) for _ in requests]
        L = len(requests)
        longest = max(lane.num_tokens for lane in lanes)
        bucket = self._bucket(longest + k - 1) if k > 1 else 0
        for lane in lanes:
            lane.kv.reserve(lane.num_tokens + k)
        host = torch.tensor(
            [lane.slot for lane in lanes] + [lane.num_tokens for lane in lanes],  # type: ignore[attr-defined]
            dtype=torch.long,
        )
        self._propose_ints[: 2 * L].copy_(host.to(self.device, non_blocking=True))
        with torch.inference_mode():
            if all(r.params.is_greedy for r in requests):
                self._run(("chain", L, k, bucket), lambda: self._chain_body(L, k, bucket))
                drafts = self._drafts[:L, :k].cpu()
                return [DraftProposal(drafts[i, : ks[i]].clone()) for i in range(L)]
            return self._propose_steps(requests, ks, k, bucket)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden, self.lm_head, None)

    def _chain_body(self, lanes: int, k: int, bucket: int) -> dict[str, torch.Tensor]:
        """A greedy k-draft proposal of `lanes` lanes over the input buffers, drafts into
        ``_drafts[:lanes, :k]`` (module docstring): no host syncs, capture-safe."""
        slots, pos0 = self._propose_ints[:lanes], self._propose_ints[lanes : 2 * lanes]
        out = self._drafts[:lanes]
        h = self._hid.index_select(0, slots)
        d = self._head_logits(h).argmax(-1)
        out[:, 0].copy_(d)
        for j in range(1, k):
            x = self.head.input_rows(F.embedding(d, self.embed_tokens), h)
            h = self._layer(x, (pos0 + (j - 1))[:, None], slots, bucket)
            d = self._head_logits(h).argmax(-1)
            out[:, j].copy_(d)
        return {}

    def _step0_body(self, lanes: int) -> dict[str, torch.Tensor]:
        """Step 0 of a stepped proposal: the chained hidden of each lane and its logits (float32)."""
        slots = self._propose_ints[:lanes]
        h = self._hid.index_select(0, slots)
        self._step_out[:lanes].copy_(h)
        self._step_logits[:lanes].copy_(self._head_logits(h))
        return {}

    def _step_body(self, lanes: int, bucket: int) -> dict[str, torch.Tensor]:
        """One step of a stepped proposal: the row (``_step_hidden``, ``_step_tokens``) of each lane at
        its position (``_propose_ints[lanes:]``) through the layer, into ``_step_out`` and logits."""
        slots, pos = self._propose_ints[:lanes], self._propose_ints[lanes : 2 * lanes]
        x = self.head.input_rows(
            F.embedding(self._step_tokens[:lanes], self.embed_tokens), self._step_hidden[:lanes]
        )
        h = self._layer(x, pos[:, None], slots, bucket)
        self._step_out[:lanes].copy_(h)
        self._step_logits[:lanes].copy_(self._head_logits(h))
        return {}

    def _propose_steps(
        self, requests: Sequence[DraftRequest], ks: list[int], k: int, bucket: int
    ) -> list[DraftProposal]:
        L = len(requests)
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        for j in range(k):
            if j == 0:
                self._run(("step0", L), lambda: self._step0_body(L))
            else:
                if j > 1:
                    self._propose_ints[L : 2 * L].add_(1)  # the next row's positions
                tokens = [drafts[i][-1] if drafts[i] else 0 for i in range(L)]
                self._step_tokens[:L].copy_(torch.tensor(tokens, dtype=torch.long).to(self.device))
                self._step_hidden[:L].copy_(self._step_out[:L])
                self._run(("step", L, bucket), lambda: self._step_body(L, bucket))
            logits = self._step_logits[:L]
            greedy = [i for i in range(L) if ks[i] > j and requests[i].params.is_greedy]
            if greedy:
                top = logits[greedy].argmax(-1).tolist()
                for i, t in zip(greedy, top, strict=True):
                    drafts[i].append(int(t))
            groups: dict[Any, list[int]] = {}  # sampled lanes by their params: one q per group
            for i, r in enumerate(requests):
                if ks[i] > j and not r.params.is_greedy:
                    groups.setdefault(_params_key(r.params), []).append(i)
            for members in groups.values():
                qs = logits_to_probs(logits[members], requests[members[0]].params)  # rows independent
                for q, i in zip(qs, members, strict=True):
                    r = requests[i]
                    drafts[i].append(
                        int(torch.multinomial(q.to(r.generator.device), 1, generator=r.generator))
                    )
                    probs[i].append(q)
        return [
            DraftProposal(torch.tensor(d, dtype=torch.int64), torch.stack(p) if p else None)
            for d, p in zip(drafts, probs, strict=True)
        ]

    # ---- the layer over pooled rows ----

    def _layer(self, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, bucket: int) -> torch.Tensor:
        """The head's decoder layer and `mtp.norm` over rows of lanes in slots, capture-safe.

        Args:
            x: [L * n, H] rows from `input_rows`, lane by lane (n rows a lane).
            pos: [L, n] int64 each row's position (its key and value are written there).
            slots: [L] int64 the lanes' slots.
            bucket: keys read per lane (every position in pos < bucket).

        Returns:
            [L * n, H] the head's output after `mtp.norm`.
        """
        head, c, a = self.head, self.config, self.head.attn
        lanes, n = pos.shape
        rows, hd, nh, nkv = x.shape[0], c.head_dim, c.num_attention_heads, c.num_key_value_heads
        rep, eps, linear = nh // nkv, c.rms_norm_eps, self.linear
        positions = pos.reshape(-1)
        cos, sin = rope_cos_sin(positions, head.inv_freq, self.dtype)
        hn = rms_norm_one_plus(x, head.input_norm, eps)
        qg = linear(hn, a.q_proj, a.q_bias).view(rows, nh, 2 * hd)
        gate = qg[..., hd:].reshape(rows, nh * hd)
        q = apply_rope(rms_norm_one_plus(qg[..., :hd], a.q_norm, eps), cos, sin)
        k = apply_rope(
            rms_norm_one_plus(linear(hn, a.k_proj, a.k_bias).view(rows, nkv, hd), a.k_norm, eps), cos, sin
        )
        v = linear(hn, a.v_proj, a.v_bias).view(rows, nkv, hd)
        lane_rows = slots[:, None].expand(lanes, n).reshape(-1)
        self._k.index_put_((lane_rows, positions), k)
        self._v.index_put_((lane_rows, positions), v)
        keys = self._k[:, :bucket].index_select(0, slots).transpose(1, 2)  # [L, nkv, T, hd]
        values = self._v[:, :bucket].index_select(0, slots).transpose(1, 2)
        # the rep query heads of each KV head stacked: [L, nkv, rep * n, hd]
        qh = q.view(lanes, n, nkv, rep, hd).permute(0, 2, 3, 1, 4).reshape(lanes, nkv, rep * n, hd)
        mask = torch.arange(bucket, device=x.device)[None, None, :] <= pos[:, :, None]  # [L, n, T]
        mask = mask[:, None].expand(lanes, rep, n, bucket).reshape(lanes, 1, rep * n, bucket)
        o = sdpa(qh, keys, values, attn_mask=mask, scale=hd**-0.5)
        o = o.view(lanes, nkv, rep, n, hd).permute(0, 3, 1, 2, 4).reshape(rows, nh * hd)
        h = x + linear(o * torch.sigmoid(gate), a.o_proj, a.o_bias)
        m = rms_norm_one_plus(h, head.post_norm, eps)
        if isinstance(head.mlp, SparseMoeWeights):
            assert isinstance(c, Qwen3_5MoeConfig | Qwen3NextConfig)
            h = h + sparse_moe_block(
                m, head.mlp, top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob, linear=linear
            )
        else:
            h = h + swiglu_mlp(m, head.mlp, linear=linear)
        return rms_norm_one_plus(h, head.norm, eps)

    # ---- graphs ----

    def _bucket(self, needed: int) -> int:
        return kv_bucket(needed, self.kv_bucket, self.capacity)

    def _run(self, key: tuple[Any, ...], body: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Run a static shape: eagerly, or replayed from its graph (captured first when new). A capture
        that fails (a kernel that syncs the host) turns graphs off with a logged warning and runs the
        shape eagerly."""
        if not self.cuda_graphs:
            body()
            return
        entry = self._graphs.get(key)
        if entry is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=self.device)
            try:
                entry = capture_round(body, device=self.device, pool=self._pool, stream=self._side_stream)
            except RuntimeError as exc:  # a kernel the capture cannot hold: the static code, eagerly
                log.warning("mtp: capturing the head's %s shape failed (%s); graphs off", key[0], exc)
                self.cuda_graphs = False
                self._graphs.clear()
                self._pool = None  # a failed capture's pool may stay refused (`tvm_runtime.capture`)
                torch.cuda.synchronize(self.device)
                body()
                return
            self._graphs[key] = entry
            self.num_captures += 1
        entry.graph.replay()
        self.num_replays += 1

    def warm_up(self, *, columns: Sequence[int] = (), context: int | None = None) -> int:
        """Capture, at load, the graph of every static shape the engine's rounds over lanes holding up
        to `context` tokens can meet: for lane counts 1..max_lanes, every commit width (verify spans
        and prompts of at most MAX_COLUMNS tokens), the greedy chains of 1..k drafts and the sampled
        steps, each at the KV buckets up to the one holding `context`. Runs in free lane slots (rows
        there are scratch): no lane's state changes.

        Args:
            columns: the verify width (draft_tokens + 1) the engine runs; k = max(columns) - 1
                (MAX_DRAFT_TOKENS when empty).
            context: tokens a lane holds up to which every KV bucket is captured (None: the
                capacity: every bucket).

        Returns:
            graphs captured now (0 without CUDA graphs, or with no free slot).

        Raises:
            ValueError: a column count outside 1..MAX_COLUMNS, context < 1.
        """
        for w in columns:
            if not 1 <= int(w) <= MAX_COLUMNS:
                raise ValueError(f"warm_up: column count {w} outside 1..{MAX_COLUMNS}")
        if context is not None and context < 1:
            raise ValueError(f"warm_up: context must be >= 1 tokens, got {context}")
        width = max((int(w) for w in columns), default=MAX_COLUMNS)
        self.column_widths = tuple(sorted(set(self.column_widths) | {width}))
        if not self.cuda_graphs or not self._free:
            return 0
        k = width - 1
        reach = self.capacity if context is None else min(context, self.capacity)
        base = [self._bucket(1)]
        while base[-1] < reach:
            base.append(self._bucket(2 * base[-1]))
        free = sorted(self._free)
        before = self.num_captures
        widths = self.column_widths
        with torch.inference_mode():
            for L in range(1, self.max_lanes + 1):
                if L > len(free):
                    break  # the shapes of more lanes than free slots capture on first use
                slots = free[:L]
                for b in base:
                    for n in widths:
                        bucket = self._bucket(max(b, n))
                        if ("commit", L, n, bucket) in self._graphs:
                            continue
                        host = [0] * (L * n) + [j for _ in slots for j in range(n)] + slots + [0] * L
                        self._commit_ints[: 2 * L * n + 2 * L].copy_(torch.tensor(host).to(self.device))
                        self._run(("commit", L, n, bucket), partial(self._commit_body, L, n, bucket))
                    self._propose_ints[: 2 * L].copy_(torch.tensor(slots + [0] * L).to(self.device))
                    for kk in range(1, k + 1):
                        bucket = self._bucket(max(b, kk)) if kk > 1 else 0
                        if ("chain", L, kk, bucket) not in self._graphs:
                            self._run(("chain", L, kk, bucket), partial(self._chain_body, L, kk, bucket))
                    bucket = self._bucket(max(b, 1))
                    if k > 1 and ("step", L, bucket) not in self._graphs:
                        self._run(("step", L, bucket), partial(self._step_body, L, bucket))
                if ("step0", L) not in self._graphs:
                    self._run(("step0", L), partial(self._step0_body, L))
        if self.num_captures > before and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        log.debug(
            "mtp warm_up: lanes 1..%d x widths %s x k 1..%d x KV buckets %s", self.max_lanes, widths, k, base
        )
        return self.num_captures - before
