"""DFlash2's static route: pooled lane windows and one proposal forward per (lanes, context bucket),
replayed from CUDA graphs captured at load (issue 25).

The eager `DFlash2Drafter` keeps each lane's context keys/values in its own growing buffers and runs
one attention call per lane over a context of that lane's length, the selector walk slot by slot with
the draft tokens read back one at a time. On a GPU that is hundreds of small launches and host syncs a
round. `StaticDFlash2` replaces the lane state and both hot calls with fixed shapes:

* **Pooled windows.** Layer l keeps every lane's context in one buffer ``keys[l]`` /
  ``values[l]`` [max_lanes, cap_l + block_size, nkv, hd] (dtype of the drafter): lane slot s, row
  ``p % cap_l`` holds position p's key/value (k_norm and RoPE applied), a ring of ``cap_l`` =
  ``context_retention(l)`` (sliding_window - 1) rows, or ``max_context`` rows for a full-attention
  layer. A lane at anchor position P keeps positions max(0, P - cap_l) .. P - 1, the rows the eager
  `_Window` keeps. The last `block_size` rows past a bucket take the block's own keys/values during a
  proposal (below). An engine that runs more lanes than max_lanes (one without a lane limit) makes
  the slots double, rings kept, graphs captured again on use (logged).
* **One forward per (width, bucket).** A proposal runs over lane slots 0 .. width - 1 (lanes get the
  lowest free slot; slots that are free or not drafting this round are computed and ignored) and
  reads the first ``C_l = min(bucket, cap_l)`` rows of each slot's ring, where `bucket` is the
  smallest captured context bucket holding every occupied slot's kept rows (so no live row sits at or
  past C_l: before a lane's ring wraps its rows are 0 .. P - 1). The block's keys/values are written
  to rows C_l .. C_l + block_size - 1 and attention reads rows 0 .. C_l + block_size - 1 in place
  (no gather, no concatenation) under a mask built on the device from each slot's position: ring row r
  holds position ``p_r = P - 1 - ((P - 1 - r) mod cap_l)``, visible to the query at P + j when
  ``p_r >= 0`` and, for a sliding layer, ``P + j - p_r < sliding_window``; block keys follow the
  eager mask (non-causal unless `is_causal`, the window inside the block). GQA groups are folded into
  query rows ([w, nkv, g * L, hd]) so one masked SDPA call serves a layer. Then the final norm, the
  proposal head (full or shortlist, any linear hook), the top-K and the selector walk over all slots
  at once: greedy slots take ``argmax(score)``, sampled slots ``argmax(q / E)`` with E ~ Exp(1) drawn
  from the lane's generator before the forward (the exponential race: an exact sample of q; the eager
  walk draws the same noise the same way, so both paths propose the same tokens). Outputs: the draft
  tokens [max_lanes, D], q over the K candidates [max_lanes, D, K] and the candidates' ids, in static
  buffers (D = block_size - 1). A drafter without a selector (DFlash v1) gets the head logits in a
  static buffer and chooses on them as the eager path does.
* **CUDA graphs** (`warm_up`): that forward captured per (width, bucket) at load, widths 1 .. 8
  then 16, 32, ... and max_lanes (`default_widths`), buckets 128, 256, ... up to the largest ring,
  and the commit per row bucket; buckets of full-attention layers past `warm_up`'s context are
  captured at first use (logged). The inputs
  (anchors, positions, temperatures, greedy flags, noise) are copied into static buffers before a
  replay; nothing syncs until the engine reads the drafts.
* **Commit batched over lanes.** A round's committed columns (every lane's span no longer than the
  smallest ring, all of them within max_lanes x block_size rows) are staged in static buffers
  (taps, then position / slot / valid per row) padded to a row bucket (block_size, 2 x, ... up to
  max_lanes x block_size) and replayed from that bucket's graph: one `fc` + `hidden_norm` over the
  rows, one k/v projection per layer and one indexed write per layer into the rings (padded rows
  write a scratch row past every ring). Longer spans (prompts) run the same ops unpadded, still one
  call per layer for all lanes; no per-lane loop of small tensor ops either way.

The pooled layout also runs on the CPU without graphs (tests hold it to the eager path there). Source
of the pattern (read, not copied): SGLang's `EAGLEDraftCudaGraphRunner` and vLLM's drafter CUDA graphs
(static input buffers per captured batch size, padded batches, replay then slice the outputs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ignis.runtime.checkpoints import DrafterSnapshot
from ignis.runtime.drafters.base import CommittedSpan, DrafterError, DraftProposal, DraftRequest
from ignis.runtime.drafters.common import rms_norm, rope_cos_sin
from ignis.runtime.errors import ConfigError, StateError
from ignis.runtime.families.attention import sdpa
from ignis.runtime.kernels.topk import topk

if TYPE_CHECKING:
    from ignis.runtime.drafters.dflash2 import DFlash2Drafter, LaneContext

__all__ = ["SMALLEST_BUCKET", "StaticDFlash2", "context_buckets", "default_widths", "draw_race_noise"]

logger = logging.getLogger("ignis.runtime.draft_head")

#: The smallest context bucket (rows of a lane's ring a proposal reads); buckets double up to the ring.
SMALLEST_BUCKET = 128


def context_buckets(capacity: int, smallest: int = SMALLEST_BUCKET) -> tuple[int, ...]:
    """Context buckets for rings of `capacity` rows: smallest, 2 x smallest, ... below capacity, then
    capacity itself (a capacity <= smallest gives one bucket)."""
    out, b = [], smallest
    while b < capacity:
        out.append(b)
        b *= 2
    out.append(capacity)
    return tuple(out)


def default_widths(max_lanes: int) -> tuple[int, ...]:
    """Lane-slot widths proposals run at: every width up to 8, then 16, 32, ... below max_lanes, then
    max_lanes (so many lanes do not multiply the graphs captured at load)."""
    out = list(range(1, min(8, max_lanes) + 1))
    w = 16
    while w < max_lanes:
        out.append(w)
        w *= 2
    if out[-1] != max_lanes:
        out.append(max_lanes)
    return tuple(out)


def draw_race_noise(generator: torch.Generator, num_drafts: int, num_candidates: int) -> torch.Tensor:
    """float32 [num_drafts, num_candidates] Exp(1) noise from a lane's generator, on its device: the
    sampled selector walk picks ``argmax(q / noise[s])`` at slot s (an exact draw from q). The eager
    and the static paths both draw it here, so one seed gives one path. Draws of 0 (a uniform of
    exactly 1) are raised to float32's smallest normal, so a candidate with q = 0 (0 / 0) can never
    win."""
    out = torch.empty(num_drafts, num_candidates, dtype=torch.float32, device=generator.device)
    return out.exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)


class StaticDFlash2:
    """The pooled, fixed-shape DFlash2 proposal and commit (module docstring) for one drafter.

    Args:
        drafter: the `DFlash2Drafter` whose network, head and shared tensors it runs.
        max_lanes: lane slots (the engine's max_lanes: lanes decoding or being prefilled at once).
        max_context: ring rows of a full-attention layer (the engine's context limit); needed only
            when the drafter has full-attention layers.
        cuda_graphs: replay proposals from CUDA graphs (CUDA only); False runs the same forward
            without graphs.
        buckets: context buckets to use instead of `context_buckets(largest ring)` (tests); those
            past the largest ring are dropped and the largest ring is appended.
        widths: lane-slot widths a proposal may run at (default `default_widths(max_lanes)`);
            max_lanes is appended when missing.

    Raises:
        ConfigError: max_lanes < 1, a full-attention layer without max_context, a bucket < 1, a width
            outside 1..max_lanes.
    """

    def __init__(
        self,
        drafter: DFlash2Drafter,
        *,
        max_lanes: int,
        max_context: int | None = None,
        cuda_graphs: bool = True,
        buckets: Sequence[int] | None = None,
        widths: Sequence[int] | None = None,
    ) -> None:
        c, net = drafter.config, drafter.network
        if not isinstance(max_lanes, int) or max_lanes < 1:
            raise ConfigError(f"dflash2 static route: max_lanes must be an int >= 1, got {max_lanes!r}")
        caps: list[int] = []
        for i in range(c.num_hidden_layers):
            r = c.context_retention(i)
            if r is None:
                if max_context is None or max_context < 1:
                    raise ConfigError(
                        f"dflash2 static route: layer {i} is full attention; its ring needs max_context"
                    )
                r = int(max_context)
            caps.append(int(r))
        self.drafter, self.config, self.network = drafter, c, net
        self.device, self.dtype = net.device, net.dtype
        self.caps = tuple(caps)
        self.max_cap = max(caps)
        #: positions a full-attention ring holds (None: sliding layers only)
        self.full_cap: int | None = None
        if any(c.context_retention(i) is None for i in range(c.num_hidden_layers)):
            self.full_cap = int(max_context)  # type: ignore[arg-type]  (checked above)
        self.sliding_cap = max(
            (cap for i, cap in enumerate(caps) if c.context_retention(i) is not None), default=0
        )
        if buckets and min(buckets) < 1:
            raise ConfigError(f"dflash2 static route: buckets {list(buckets)} must be >= 1")
        bl = (
            sorted({int(b) for b in buckets if b < self.max_cap} | {self.max_cap})
            if buckets
            else list(context_buckets(self.max_cap))
        )
        self.buckets = tuple(bl)
        wl = sorted({int(w) for w in widths} | {max_lanes}) if widths else list(default_widths(max_lanes))
        if wl[0] < 1 or wl[-1] > max_lanes:
            raise ConfigError(f"dflash2 static route: widths {wl} must lie in 1..{max_lanes}")
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"

        self._explicit_widths = tuple(wl) if widths else None
        self._offsets = torch.arange(c.block_size, device=self.device)
        self._mask_ids = torch.full(
            (1, c.block_size - 1), c.mask_token_id, dtype=torch.long, device=self.device
        )
        head_rows = int(drafter.head_weight.shape[0])
        self.top_k = min(c.selector_top_k, head_rows) if c.has_selector else 0
        self._head_rows = head_rows
        # host bookkeeping
        self._slot: dict[int, int] = {}
        self._free: list[int] = []
        self._positions: list[int] = []  # committed positions per slot (its anchor's position)
        self._graphs: dict[tuple[int, int], Any] = {}
        self._commit_graphs: dict[int, Any] = {}
        self._pool: Any = None
        self._side_stream: Any = None
        self.num_captures = 0
        self.max_lanes = 0
        self._allocate(max_lanes)

    def _allocate(self, max_lanes: int) -> None:
        """(Re)allocate every buffer for `max_lanes` slots, keeping the rings' rows of the slots there
        were; graphs captured for the old buffers are dropped."""
        c = self.config
        L, D = c.block_size, c.max_drafts
        nkv, hd = c.num_key_value_heads, c.head_dim
        dev, dt = self.device, self.dtype
        old = self.max_lanes
        keys = [torch.zeros(max_lanes, cap + L, nkv, hd, device=dev, dtype=dt) for cap in self.caps]
        values = [torch.zeros(max_lanes, cap + L, nkv, hd, device=dev, dtype=dt) for cap in self.caps]
        if old:
            for new, cur in zip(keys + values, self.keys + self.values, strict=True):
                new[:old].copy_(cur)
        self.keys, self.values = keys, values
        self._free += list(range(old, max_lanes))
        self._positions += [0] * (max_lanes - old)
        self.max_lanes = max_lanes
        if self._explicit_widths is not None:
            self.widths = tuple(sorted(set(self._explicit_widths) | {max_lanes}))
        else:
            self.widths = default_widths(max_lanes)
        # static inputs: per slot anchor id, anchor position, greedy flag (one host->device copy)
        self._inputs = torch.zeros(max_lanes, 3, dtype=torch.long, device=dev)
        self._anchor, self._position, self._greedy_flag = self._inputs.unbind(1)
        self._temperature = torch.ones(max_lanes, dtype=torch.float32, device=dev)
        # static outputs
        self._drafts = torch.zeros(max_lanes, D, dtype=torch.long, device=dev)
        if c.has_selector:
            self._noise = torch.ones(max_lanes, D, self.top_k, dtype=torch.float32, device=dev)
            self._q = torch.zeros(max_lanes, D, self.top_k, dtype=torch.float32, device=dev)
            self._cand = torch.zeros(max_lanes, D, self.top_k, dtype=torch.long, device=dev)
        else:
            self._logits = torch.zeros(max_lanes, D, self._head_rows, dtype=torch.float32, device=dev)
        # the fixed-shape commit: row buckets block_size, 2 x, ... up to max_lanes x block_size
        rows_cap, r = max_lanes * L, L
        commit_rows = []
        while r < rows_cap:
            commit_rows.append(r)
            r *= 2
        self.commit_rows = (*commit_rows, rows_cap)
        self._commit_taps = torch.zeros(rows_cap, c.num_taps * c.hidden_size, device=dev, dtype=dt)
        self._commit_meta = torch.zeros(rows_cap, 3, dtype=torch.long, device=dev)
        self._graphs.clear()
        self._commit_graphs.clear()

    # ------------------------------------------------------------------ lanes

    def start_lane(self, lane_id: int) -> None:
        """Give the lane the lowest free slot, empty (position 0). With every slot taken (an engine
        that runs more lanes than max_lanes) the slots double, keeping every lane's rings; the graphs
        are then captured again as shapes are met (logged)."""
        if lane_id in self._slot:
            self.end_lane(lane_id)
        if not self._free:  # more lanes than sized for (an engine without max_lanes): twice the slots
            logger.warning(
                "dflash2: all %d lane slots in use; growing to %d (the graphs are captured again on use)",
                self.max_lanes,
                2 * self.max_lanes,
            )
            self._allocate(2 * self.max_lanes)
        self._free.sort()
        slot = self._free.pop(0)
        self._slot[lane_id] = slot
        self._positions[slot] = 0

    def end_lane(self, lane_id: int) -> None:
        """Free the lane's slot (its rows are masked out until a new lane writes them)."""
        slot = self._slot.pop(lane_id, None)
        if slot is not None:
            self._positions[slot] = 0
            self._free.append(slot)

    def has_lane(self, lane_id: int) -> bool:
        """Whether the lane holds a slot."""
        return lane_id in self._slot

    def num_positions(self, lane_id: int) -> int:
        """Committed positions of the lane (StateError if it holds no slot)."""
        return self._positions[self._lane_slot(lane_id)]

    def _lane_slot(self, lane_id: int) -> int:
        try:
            return self._slot[lane_id]
        except KeyError:
            raise StateError(f"dflash2: lane {lane_id} was not started (start_lane)") from None

    def _ring_rows(self, layer: int, end: int, n: int) -> torch.Tensor:
        """int64 [n] ring rows of positions end - n .. end - 1 in layer `layer`."""
        cap = self.caps[layer]
        return torch.arange(end - n, end, device=self.device).remainder(cap)

    def kept(self, lane_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The lane's kept (keys, values) of `layer` in position order, each [n, nkv, hd] (copies),
        n = min(num_positions, ring)."""
        slot = self._lane_slot(lane_id)
        end = self._positions[slot]
        n = min(end, self.caps[layer])
        rows = self._ring_rows(layer, end, n)
        return self.keys[layer][slot, rows], self.values[layer][slot, rows]

    def lane_context(self, lane_id: int) -> LaneContext:
        """The lane's context as the eager `LaneContext` (windows filled with copies of the kept rows)."""
        from ignis.runtime.drafters.dflash2 import LaneContext, _Window

        c = self.config
        windows = []
        for i in range(c.num_hidden_layers):
            win = _Window(c.context_retention(i), c.num_key_value_heads, c.head_dim, self.device, self.dtype)
            k, v = self.kept(lane_id, i)
            if k.shape[0]:
                win.append(k, v)
            windows.append(win)
        return LaneContext(num_positions=self.num_positions(lane_id), windows=windows)

    def snapshot_lane(self, lane_id: int, num_tokens: int) -> DrafterSnapshot:
        """`DFlash2Drafter.snapshot_lane`'s tensors (same names, shapes and order) from the rings.

        Raises:
            StateError: unknown lane, or its context does not end at num_tokens.
        """
        if self.num_positions(lane_id) != num_tokens:
            raise StateError(
                f"dflash2: lane {lane_id} context ends at {self.num_positions(lane_id)}, not at the "
                f"checkpoint's {num_tokens}"
            )
        tensors = {}
        for i in range(self.config.num_hidden_layers):
            tensors[f"layer.{i}.keys"], tensors[f"layer.{i}.values"] = self.kept(lane_id, i)
        return DrafterSnapshot(num_tokens=int(num_tokens), tensors=tensors)

    def restore_lane(self, lane_id: int, snapshot: DrafterSnapshot) -> None:
        """Start the lane in a slot holding `snapshot`'s windows (DFlash2Drafter.restore_lane).

        Raises:
            CheckpointError: the snapshot's layers or shapes do not fit this drafter (the lane is not
                started then).
        """
        from ignis.runtime.checkpoints import CheckpointError
        from ignis.runtime.drafters.dflash2 import check_snapshot_layer

        c = self.config
        names = {f"layer.{i}.{w}" for i in range(c.num_hidden_layers) for w in ("keys", "values")}
        missing = sorted(names - set(snapshot.tensors))
        if missing:
            raise CheckpointError(f"dflash2: snapshot lacks tensor {missing[0]!r}")
        extra = sorted(set(snapshot.tensors) - names)
        if extra:
            raise CheckpointError(f"dflash2: snapshot holds unknown tensors {extra}")
        end = int(snapshot.num_tokens)
        for i in range(c.num_hidden_layers):
            k, v = snapshot.tensors[f"layer.{i}.keys"], snapshot.tensors[f"layer.{i}.values"]
            check_snapshot_layer(c, i, k, v)
            if k.shape[0] != min(end, self.caps[i]):  # a ring row the mask sees must hold its key
                raise CheckpointError(
                    f"dflash2: snapshot layer {i} holds {k.shape[0]} rows for {end} positions; this "
                    f"drafter keeps {min(end, self.caps[i])}"
                )
        self.start_lane(lane_id)
        slot = self._slot[lane_id]
        with torch.inference_mode():
            for i in range(c.num_hidden_layers):
                k, v = snapshot.tensors[f"layer.{i}.keys"], snapshot.tensors[f"layer.{i}.values"]
                if k.shape[0]:
                    rows = self._ring_rows(i, end, int(k.shape[0]))
                    self.keys[i][slot, rows] = k.to(self.keys[i])
                    self.values[i][slot, rows] = v.to(self.values[i])
        self._positions[slot] = end

    # ------------------------------------------------------------------ commit

    def commit(self, spans: Sequence[CommittedSpan]) -> None:
        """Advance each span's lane by its committed columns (DFlash2Drafter.commit), batched over lanes.

        Raises:
            StateError: unknown lane, or a span that does not start where the lane's context ends.
            DrafterError: a span without taps, or taps of the wrong width / length.
        """
        from ignis.runtime.drafters.dflash2 import check_span_taps

        if not spans:
            return
        c, net = self.config, self.network
        width = c.num_taps * c.hidden_size
        rows, slots, positions, counts = [], [], [], []
        seen: set[int] = set()
        for s in spans:
            slot = self._lane_slot(s.lane_id)
            if s.start != self._positions[slot] or slot in seen:
                raise StateError(
                    f"dflash2: lane {s.lane_id} span starts at position {s.start}, its context ends at "
                    f"{self._positions[slot]}"
                )
            seen.add(slot)
            check_span_taps(s, width, self.drafter.tap_layers)
            m = len(s.input_token_ids)
            if self.full_cap is not None and s.start + m > self.full_cap:
                raise DrafterError(
                    f"dflash2: lane {s.lane_id} reaches position {s.start + m}, past the {self.full_cap} "
                    "positions its full-attention rings hold (the engine's max_context)"
                )
            r = min(m, self.max_cap)
            rows.append(s.taps[m - r :])
            slots.append(slot)
            positions.append((s.start + m - r, s.start + m))
            counts.append(r)
        total = sum(counts)
        with torch.inference_mode():
            if total and max(counts) <= min(self.caps) and total <= self.commit_rows[-1]:
                self._commit_static(rows, slots, positions, total)
            elif total:
                feats = net.context_features(torch.cat([r.to(self.device) for r in rows]))
                pos_h = torch.cat([torch.arange(a, b) for a, b in positions])
                slot_h = torch.cat(
                    [torch.full((n,), s, dtype=torch.long) for s, n in zip(slots, counts, strict=True)]
                )
                pos, slot_idx = pos_h.to(self.device), slot_h.to(self.device)
                subsets: dict[int, torch.Tensor | None] = {}
                for li in range(c.num_hidden_layers):
                    cap = self.caps[li]
                    if cap not in subsets:  # rows this layer keeps (the last `cap` of each span)
                        if all(n <= cap for n in counts):
                            subsets[cap] = None
                        else:
                            keep, at = [], 0
                            for n in counts:
                                keep.extend(range(at + n - min(n, cap), at + n))
                                at += n
                            subsets[cap] = torch.tensor(keep, dtype=torch.long, device=self.device)
                    sel = subsets[cap]
                    f, p, si = (
                        (feats, pos, slot_idx) if sel is None else (feats[sel], pos[sel], slot_idx[sel])
                    )
                    k, v = net.context_keys_values(f, p, li)
                    ring = p.remainder(cap)
                    self.keys[li].index_put_((si, ring), k)
                    self.values[li].index_put_((si, ring), v)
        for s, slot in zip(spans, slots, strict=True):
            self._positions[slot] += len(s.input_token_ids)

    def _commit_static(
        self, rows: list[torch.Tensor], slots: list[int], positions: list[tuple[int, int]], total: int
    ) -> None:
        """The fixed-shape commit: rows padded to a row bucket (padded rows write the scratch row
        cap_l + block_size - 1 of slot 0, never a ring row), replayed from its graph with CUDA graphs."""
        n_rows = next(r for r in self.commit_rows if r >= total)
        meta = torch.zeros(n_rows, 3, dtype=torch.long)  # position, slot, valid
        at = 0
        for slot, (a, b) in zip(slots, positions, strict=True):
            meta[at : at + b - a, 0] = torch.arange(a, b)
            meta[at : at + b - a, 1] = slot
            meta[at : at + b - a, 2] = 1
            at += b - a
        self._commit_meta[:n_rows].copy_(meta)
        taps = rows[0] if len(rows) == 1 else torch.cat(rows)
        self._commit_taps[:total].copy_(taps)
        if not self.cuda_graphs:
            self._commit_forward(n_rows)
            return
        graph = self._commit_graphs.get(n_rows)
        if graph is None:
            logger.info("dflash2: capturing the commit graph for %d rows on first use", n_rows)
            graph = self._capture_commit(n_rows)
        if graph is None:  # the capture failed: graphs are off, this commit runs directly
            self._commit_forward(n_rows)
            return
        graph.replay()

    def _commit_forward(self, n_rows: int) -> None:
        """Context keys/values of the staged rows written into the rings (`_commit_static`)."""
        net, L = self.network, self.config.block_size
        feats = net.context_features(self._commit_taps[:n_rows])
        meta = self._commit_meta[:n_rows]
        pos, slot, valid = meta[:, 0], meta[:, 1], meta[:, 2].bool()
        cos, sin = rope_cos_sin(pos, net.inv_freq, self.dtype)  # once for every layer
        for cap, lw, keys, values in zip(self.caps, net.layers, self.keys, self.values, strict=True):
            k, v = net.context_key_value(feats, lw, cos, sin)
            ring = torch.where(valid, pos.remainder(cap), cap + L - 1)
            keys.index_put_((slot, ring), k)
            values.index_put_((slot, ring), v)

    # ------------------------------------------------------------------ proposals

    def width_for(self, needed: int) -> int:
        """The smallest captured width >= needed slots."""
        return next(w for w in self.widths if w >= needed)

    def bucket_for(self, needed: int) -> int:
        """The smallest bucket >= needed kept rows."""
        return next(b for b in self.buckets if b >= needed)

    def propose(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """DFlash2Drafter.propose on the static route: one forward (or graph replay) over slots
        0 .. width - 1; greedy lanes' drafts and sampled lanes' drafts and q as the eager path gives.

        Raises:
            StateError: unknown lane, or an anchor position that is not where the lane's context ends.
        """
        if not requests:
            return []
        c, d = self.config, self.drafter
        slots = []
        for r in requests:
            slot = self._lane_slot(r.lane_id)
            if r.position != self._positions[slot]:
                raise StateError(
                    f"dflash2: lane {r.lane_id} asks to draft after position {r.position}, its context "
                    f"ends at {self._positions[slot]} (a commit was missed)"
                )
            slots.append(slot)
        ks = [max(0, min(r.num_drafts, c.max_drafts)) for r in requests]
        if max(ks) == 0:
            return [DraftProposal(torch.empty(0, dtype=torch.int64, device=self.device)) for _ in requests]
        occupied = sorted(self._slot.values())
        w = self.width_for(max(max(slots), occupied[-1]) + 1)
        kept = max((min(self._positions[s], self.max_cap) for s in occupied if s < w), default=0)
        bucket = self.bucket_for(max(kept, 1))
        anchors = [0] * w
        positions = [self._positions[s] if s in occupied else 0 for s in range(w)]
        greedy = [1] * w
        temps = [1.0] * w
        sampled = []
        for i, (r, slot) in enumerate(zip(requests, slots, strict=True)):
            anchors[slot] = r.anchor_token_id
            if not r.params.is_greedy and ks[i]:
                greedy[slot] = 0
                temps[slot] = float(r.params.temperature)
                sampled.append(i)
        with torch.inference_mode():
            self._inputs[:w].copy_(torch.tensor([anchors, positions, greedy], dtype=torch.long).T)
            if c.has_selector and sampled:
                self._temperature[:w].copy_(torch.tensor(temps, dtype=torch.float32))
                for i in sampled:
                    noise = draw_race_noise(requests[i].generator, ks[i], self.top_k)
                    self._noise[slots[i], : ks[i]].copy_(noise)
            self.run(w, bucket)
            if not c.has_selector:
                logits = self._logits[torch.tensor(slots, device=self.device)]
                return d._argmax_or_sample(requests, ks, logits)
            drafts = self._drafts[:w].clone()
            probs: dict[int, torch.Tensor] = {}
            if sampled:
                sidx = torch.tensor([slots[i] for i in sampled], device=self.device)
                full = torch.zeros(
                    len(sampled), c.max_drafts, d.vocab_size, dtype=torch.float32, device=self.device
                )
                full.scatter_(2, self._cand[sidx], self._q[sidx])
                probs = {i: full[j, : ks[i]] for j, i in enumerate(sampled)}
        return [
            DraftProposal(drafts[slot, :k], probs.get(i))
            for i, (slot, k) in enumerate(zip(slots, ks, strict=True))
        ]

    def run(self, width: int, bucket: int) -> None:
        """The proposal forward over slots 0 .. width - 1 at `bucket`: replayed from its CUDA graph
        (captured now if missing, logged) or run directly without graphs."""
        if not self.cuda_graphs:
            self._forward(width, bucket)
            return
        graph = self._graphs.get((width, bucket))
        if graph is None:
            logger.info(
                "dflash2: capturing the proposal graph for %d slots, bucket %d on first use", width, bucket
            )
            graph = self._capture(width, bucket)
        if graph is None:  # the capture failed: graphs are off, this forward runs directly
            self._forward(width, bucket)
            return
        graph.replay()

    def _capture_body(self, run: Any) -> Any:
        from ignis.runtime.families.static_rounds import capture_round

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._side_stream = torch.cuda.Stream(device=self.device)

        def body() -> dict[str, torch.Tensor]:
            run()
            return {}

        try:
            with torch.inference_mode():
                entry = capture_round(body, device=self.device, pool=self._pool, stream=self._side_stream)
        except BaseException:
            self._pool = None  # a failed capture's pool may stay refused (`tvm_runtime.capture`)
            raise
        self.num_captures += 1
        return entry.graph

    def _capture(self, width: int, bucket: int) -> Any:
        graph = self._capture_guarded(
            f"proposal ({width} slots, bucket {bucket})", lambda: self._forward(width, bucket)
        )
        if graph is not None:
            self._graphs[(width, bucket)] = graph
        return graph

    def _capture_commit(self, n_rows: int) -> Any:
        # the warm-up run writes the staged rows again (the same values) or, at load, scratch rows only
        graph = self._capture_guarded(f"commit ({n_rows} rows)", lambda: self._commit_forward(n_rows))
        if graph is not None:
            self._commit_graphs[n_rows] = graph
        return graph

    def _capture_guarded(self, what: str, run: Any) -> Any:
        """`_capture_body(run)`, or None when the capture raises a RuntimeError (an op the capture
        cannot hold): CUDA graphs are then turned off for this drafter (logged) and every shape runs
        the same static code directly, as the MTP head's static route does."""
        try:
            return self._capture_body(run)
        except RuntimeError as exc:
            logger.warning(
                "dflash2: capturing the %s graph failed (%s); graphs off, the static route runs eagerly",
                what,
                exc,
            )
            self.cuda_graphs = False
            self._graphs.clear()
            self._commit_graphs.clear()
            return None

    def warm_up(self, context: int | None = None) -> int:
        """Capture, at load, every (width, bucket) graph a proposal over lanes holding up to `context`
        tokens can meet (every bucket of the sliding rings whatever the context; full-attention rings
        up to `context`, None: all). Lane slots must be free (at load). Returns the graphs captured
        now (0 without CUDA graphs).

        Raises:
            StateError: a lane holds a slot (the captures write the block rows of every slot).
        """
        if not self.cuda_graphs:
            return 0
        if self._slot:
            raise StateError("dflash2: warm_up runs before any lane starts")
        limit = self.max_cap if context is None else min(self.max_cap, max(int(context), self.sliding_cap, 1))
        top = self.bucket_for(limit)
        before = self.num_captures
        for w in self.widths:
            for b in self.buckets:
                if self.cuda_graphs and b <= top and (w, b) not in self._graphs:
                    self._capture(w, b)
        self._commit_meta.zero_()  # every staged row invalid: the captures' warm-up runs write scratch rows
        for n_rows in self.commit_rows:
            if self.cuda_graphs and n_rows not in self._commit_graphs:
                self._capture_commit(n_rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return self.num_captures - before

    # ------------------------------------------------------------------ the forward

    def _mask(self, width: int, ctx: int, cap: int, sliding: bool) -> torch.Tensor:
        """bool [width, 1, g * L, ctx + L]: which keys (ring rows 0 .. ctx - 1, then the block) each
        query row (GQA group-major: row gi * L + j is slot j) of every slot sees."""
        c = self.config
        L = c.block_size
        g = c.num_attention_heads // c.num_key_value_heads
        P = self._position[:width, None]  # [w, 1]
        r = torch.arange(ctx, device=self.device)[None, :]
        p_r = (P - 1) - torch.remainder(P - 1 - r, cap)  # [w, ctx] position each ring row holds
        j = self._offsets
        ctx_vis = (p_r >= 0)[:, None, :].expand(width, L, ctx)  # [w, L, ctx]
        qk = torch.arange(L, device=self.device)
        blk = torch.ones(L, L, dtype=torch.bool, device=self.device)
        if c.is_causal:
            blk = blk & (qk[None, :] <= qk[:, None])
        if sliding:
            assert c.sliding_window is not None
            ctx_vis = ctx_vis & ((P[:, :, None] + j[None, :, None] - p_r[:, None, :]) < c.sliding_window)
            blk = blk & ((qk[:, None] - qk[None, :]).abs() < c.sliding_window)
        vis = torch.cat([ctx_vis, blk[None].expand(width, L, L)], dim=-1)  # [w, L, ctx + L]
        return vis.repeat(1, g, 1)[:, None]

    def _forward(self, width: int, bucket: int) -> None:
        """The proposal over slots 0 .. width - 1 (module docstring); writes the static outputs."""
        from ignis.runtime.drafters.dflash2 import SLIDING_ATTENTION

        c, net, d = self.config, self.network, self.drafter
        L, D, w = c.block_size, c.max_drafts, width
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        g = nh // nkv
        eps = c.rms_norm_eps
        linear = net.linear
        anchors = self._anchor[:w]
        ids = torch.cat([anchors[:, None], self._mask_ids.expand(w, L - 1)], dim=1)
        x = net.embed_ids(ids, d.embed_tokens)
        pos = (self._position[:w, None] + self._offsets[None, :]).reshape(-1)
        cos, sin = rope_cos_sin(pos, net.inv_freq, self.dtype)
        masks: dict[tuple[int, int, bool], torch.Tensor] = {}
        for li, lw in enumerate(net.layers):
            cap = self.caps[li]
            ctx = min(bucket, cap)
            sliding = c.layer_types[li] == SLIDING_ATTENTION
            if (ctx, cap, sliding) not in masks:
                masks[(ctx, cap, sliding)] = self._mask(w, ctx, cap, sliding)
            q, k, v, att_dyn = net.attention_in(x, lw, cos, sin)
            kp, vp = self.keys[li], self.values[li]
            kp[:w, ctx : ctx + L] = k.view(w, L, nkv, hd)
            vp[:w, ctx : ctx + L] = v.view(w, L, nkv, hd)
            qg = q.view(w, L, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(w, nkv, g * L, hd)
            o = sdpa(
                qg,
                kp[:w, : ctx + L].transpose(1, 2),
                vp[:w, : ctx + L].transpose(1, 2),
                attn_mask=masks[(ctx, cap, sliding)],
                scale=hd**-0.5,
            )  # [w, nkv, g * L, hd]
            out = o.view(w, nkv, g, L, hd).permute(0, 3, 1, 2, 4).reshape(w, L, nh * hd)
            x = net.layer_out(x, out, lw, att_dyn)
        hidden = rms_norm(x, net.norm, eps)[:, 1 : 1 + D]  # [w, D, H]
        logits = net.head_logits(d.linear(hidden, d.head_weight, None).float())  # [w, D, rows]
        if not c.has_selector:
            self._logits[:w].copy_(logits)
            return
        assert net.selector_projection is not None
        assert net.predecessor_codebook is not None and net.successor_codebook is not None
        unary, idx = topk(logits, self.top_k, module=d.topk_module)  # [w, D, K]
        cand = d._to_vocab(idx)
        proj = linear(hidden, net.selector_projection, None).float()  # [w, D, R]
        succ = net.successor_codebook[cand].float()  # [w, D, K, R]
        greedy = self._greedy_flag[:w] != 0
        temperature = self._temperature[:w, None]
        prev = anchors
        for s in range(D):
            pre = net.predecessor_codebook[prev].float() * proj[:, s]  # [w, R]
            scores = unary[:, s] + torch.einsum("nr,nkr->nk", pre, succ[:, s])  # [w, K]
            q = torch.softmax(scores / temperature, dim=-1)
            pick = torch.where(greedy, scores.argmax(dim=-1), (q / self._noise[:w, s]).argmax(dim=-1))
            prev = cand[:, s].gather(1, pick[:, None])[:, 0]
            self._drafts[:w, s] = prev
            self._q[:w, s] = q
        self._cand[:w].copy_(cand)
