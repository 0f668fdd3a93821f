"""Expert residency for the sparse MoE families: routed experts in host memory, a per-layer cache of
expert slots on the device.

A model larger than its card (Flash-Next, ~65 GB of q4 experts, on a 32 GB card) keeps every
non-expert weight (attention, Gated DeltaNet, shared expert, router, norms, embedding, head) on the
device and its routed experts in host memory: zero-copy views of the memory-mapped artifact
(`Artifact.target_weights(experts_on_host=True)`). Each MoE layer owns `ExpertSlots`: a fixed number
of device slots, each able to hold one expert's weights (every part: gate, up and down, dense or
q4 codes + scales), allocated once at load.

A verify round (`ignis.runtime.families.moe.sparse_moe_block`) routes every column of every lane,
takes the union of the experts they chose (ascending expert index) and asks the layer's slots for
them (`ExpertSlots.resident_groups`): experts already in a slot are hits; the missing ones are copied
into slots (misses), evicting the least recently used experts that the round does not need. When the
round needs more experts than the layer has slots, they are served in consecutive groups of at most
`num_slots` experts, still in ascending index order, each group's experts resident while they run;
the block accumulates the experts' contributions in the same order as with every expert resident, so
the output is bit for bit the fully resident model's (the experts' weights are the same bytes and
run through the same `linear` calls with the same shapes).

Copies: on a CPU device a plain `copy_` (the CPU tests prove the slot mapping, eviction and refill
paths with it). On CUDA the routed experts' host memory is registered with CUDA at load
(`ignis.runtime.host_pin.HostPin`, `--expert-cache-pin`, default auto: the artifact's expert
ranges mapped again read-only and page-locked), and each part of a miss is one asynchronous DMA from
the host view straight into the slot on a side stream: no CPU memcpy, no wait on the engine thread.
Where registration is refused (the reason is logged once; `--expert-cache-pin off`) each part goes
host view -> a pinned staging buffer (a ring of them, allocated at the first such copy, each reused
only after the event of its last upload has completed: a synchronous CPU memcpy on the engine thread)
-> the slot, as an asynchronous copy on the side stream. With page-locked experts and slots that
take the stored bytes as they are (no tiling or dequantizing), a group's misses are not torch
copies at all: their raw host and device addresses, computed once at load
(`ignis.runtime.expert_transfer.PartTable`), go to the CUDA driver as one batch
(``cuMemcpyBatchAsync``, `ExpertCache`'s `copies`; ADR 0013), with one wait per distinct
last-use event and one event for the whole batch. Either way the side stream first waits
for the event recorded after the slot's previous occupant last ran (so an evicted expert is
never overwritten while a kernel reads it), and the compute stream waits for the event recorded
after an expert's own copy just before that expert runs.
All copies of a group are issued before its first expert runs, so within a layer an expert's compute
overlaps the copies of the experts after it (hits run at once). Copies cannot start before the
layer's router has run (the routing decides them), unless router lookahead is on (`ExpertCache`'s
`lookahead`, off by default until measured on a trained router): in static rounds split at the MoE
layers (`ignis.runtime.families.moe_piecewise`) each MoE layer's routing also runs the next MoE
layer's router on its input, and the predicted experts are copied into that layer's slots
(`ExpertSlots.prefetch`) while this layer computes; a lookup finding one counts a hit and waits for
its copy (counters `prefetches`, `lookahead_recall`).

Grouped kernels: for `ignis.runtime.families.moe_grouped.grouped_moe_block` (the executors' MoE
block off CUDA, and on CUDA with the compiled grouped expert kernels) the slots are built
``stacked``: q4 parts row-major, gate's and up's buffers the two halves of one [slots, 2 I, H] stack
(`ExpertSlots.stacks`), and the block asks for (expert, slot) pairs group by group
(`ExpertSlots.slot_groups`: the compute stream waits for all of a group's copies before its two
launches). Same lookups, same counters, same LRU.

Eviction is LRU over the layer's experts (the order of last use; ties within a round by expert index).
A frequency-based policy replays no better on the benchmark's traces (`simulate_policy`: LRU = LFU
there; Belady's optimum bounds any policy); tools/bench/expert_cache.py reports the hit rate and bytes
copied per token such comparisons need (and, with `--lookahead`, the lookahead's recall).

Layout: a q4 expert part whose shape the executor's linear hook places in the CUDA tiled layout
(`LinearBackend.place`: the artifact's tiled functions serve it) is held tiled in its slots, as the
resident executor holds it: a miss copies the stored row-major bytes into a device scratch and tiles
them into the slot on the copy stream, so the experts run through the same compiled kernels as when
resident. With a hook that takes no q4 weights (`F.linear`), the parts are dequantized into
dense slots the same way (the host keeps q4, so the copies move q4 bytes). Other parts stay
row-major (their linears run wherever the hook serves them).

Budget (`plan_expert_cache`): the slots of every MoE layer together take `cache_bytes`, either given
(`--expert-cache-bytes`, config key `expert_cache_bytes`) or, by default, what the card's memory
leaves after the resident weights, the lanes' KV and recurrent state, the verify rounds' workspace, a
headroom and the MTP reserve. With `--spec-backend mtp` the MTP head's weights and KV (`mtp_reserve`)
are always taken from the cache's share, whatever the number of drafts, and with an explicit budget
a row budget past 8 takes the wider round's extra workspace from it too. The split is logged at
load (`CacheBudget.describe`). The head itself stays resident (its experts are not cached).

Prefill: a prompt chunk routes nearly every expert of every layer, so with few slots each chunk
copies nearly all experts once (a larger `--max-prefill-tokens` amortizes that over more tokens).

Counters (`ExpertCacheStats.samples`, exported on /metrics): hits, misses, bytes copied, forwards
(verify rounds and prefill chunks) and rows (tokens) run through the MoE layers, bytes copied per
row and per forward, slots in use and slots in all, misses copied by direct DMA and through the
staging ring, and the bytes of routed experts page-locked in host memory (0: the staging path).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ignis.runtime.errors import ConfigError
from ignis.runtime.expert_transfer import (
    IDS_WAITS,
    AddressBuffers,
    HostMemmove,
    PartTable,
    RoutingBuffers,
    driver_batch_copy,
)
from ignis.runtime.families.moe import SwiGLUWeights
from ignis.runtime.host_pin import HostPin
from ignis.runtime.kernels.q4_tiled import tiled_shapes
from ignis.runtime.linear import ROW_MAJOR, TILED, Q4Weight, place_weight

__all__ = [
    "COPY_PATHS",
    "POLICIES",
    "CacheBudget",
    "ExpertCache",
    "ExpertCacheStats",
    "ExpertSlots",
    "expert_nbytes",
    "human_bytes",
    "is_routed_expert",
    "lane_state_bytes",
    "parse_bytes",
    "plan_expert_cache",
    "round_workspace_bytes",
    "simulate_policy",
]

log = logging.getLogger("ignis.runtime.expert_cache")

_FIELDS = ("gate", "up", "down", "gate_up")
_GIB = 1024**3

#: Bytes a card keeps free beyond the planned buffers (the CUDA context, allocator fragmentation,
#: cuBLAS workspaces, compiled modules' scratch): subtracted by the profile default.
DEFAULT_HEADROOM_BYTES = 2 * _GIB

#: `ExpertCache`'s `copies` values.
COPY_PATHS = ("auto", "torch", "memmove")

#: Pinned staging buffers of the CUDA copy path (each one expert's bytes).
STAGING_BUFFERS = 16


def is_routed_expert(name: str) -> bool:
    """Whether a canonical tensor name is a routed expert's weight of a trunk layer (fused
    ``model.layers.N.mlp.experts.gate_up_proj`` / ``down_proj`` or per expert
    ``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``); the shared expert is not."""
    return name.startswith("model.layers.") and ".mlp.experts." in name


def parse_bytes(value: str | int) -> int:
    """A byte count from an int or a string with an optional binary/decimal unit: "24GiB", "24G"
    (GiB), "1.5GB" (10**9), "512MiB", "4096". Whitespace and case are ignored.

    Raises:
        ConfigError: not a non-negative size.
    """
    if isinstance(value, bool):
        raise ConfigError(f"expert cache size must be a byte count, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"expert cache size must be >= 0 bytes, got {value}")
        return value
    text = str(value).strip().lower().replace(" ", "")
    units = {
        "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
        "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
        "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4, "b": 1,
    }  # fmt: skip
    scale = 1
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            text, scale = text[: -len(suffix)], units[suffix]
            break
    try:
        number = float(text)
    except ValueError:
        raise ConfigError(
            f"expert cache size {value!r} is not a byte count (e.g. 24GiB, 512MiB, 1.5GB, 4096)"
        ) from None
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"expert cache size must be >= 0 bytes, got {value!r}")
    return int(number * scale)


def human_bytes(n: float) -> str:
    """A byte count in GiB from 1 GiB on, else MiB (two decimals)."""
    return f"{n / _GIB:.2f} GiB" if abs(n) >= _GIB else f"{n / 2**20:.2f} MiB"


def _leaves(w: SwiGLUWeights) -> list[tuple[str, str, torch.Tensor]]:
    """(field, part, tensor) of every stored tensor of one expert: a dense weight is part "w", a
    `Q4Weight` parts "packed" and "scales"."""
    out: list[tuple[str, str, torch.Tensor]] = []
    for name in _FIELDS:
        value = getattr(w, name)
        if value is None:
            continue
        if isinstance(value, Q4Weight):
            if value.is_tiled:
                raise ValueError(f"expert {name} is in the tiled q4 layout; the cache takes row-major")
            out += [(name, "packed", value.packed), (name, "scales", value.scales)]
        else:
            out.append((name, "w", value))
    return out


def expert_nbytes(w: SwiGLUWeights) -> int:
    """Bytes one routed expert's weights take in a slot (every part, q4 codes and scales included)."""
    return sum(t.numel() * t.element_size() for _, _, t in _leaves(w))


class ExpertCacheStats:
    """Counters of every layer's expert slots (one object per served model; engines rebuilt after a
    failure keep counting into it). Not thread-safe: the engine thread updates it; a scrape reads
    ints.

    Attributes:
        hits: experts a forward needed that were already in a slot.
        misses: experts copied into a slot.
        bytes_copied: host-to-device bytes of those copies.
        forwards: forwards that ran the MoE layers (verify rounds, prefill chunks).
        rows: rows (tokens) those forwards ran.
    """

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.bytes_copied = 0
        self.forwards = 0
        self.rows = 0
        #: misses whose parts were copied by DMA from page-locked host memory, and through the ring
        self.direct_copies = 0
        self.staged_copies = 0
        #: experts copied ahead of their layer's lookup by router lookahead (`ExpertSlots.prefetch`;
        #: their bytes are in bytes_copied, a later lookup finding them counts a hit)
        self.prefetches = 0
        #: router lookahead's recall: experts a lookup needed that the prediction for it named, and
        #: experts those lookups needed
        self.lookahead_right = 0
        self.lookahead_needed = 0
        self._cache: ExpertCache | None = None
        #: when a list: every lookup is appended as (layer index among the MoE layers, experts), the
        #: routing trace `simulate_policy` replays (benchmarks; None: not recorded)
        self.trace: list[tuple[int, tuple[int, ...]]] | None = None
        #: with a trace: every router-lookahead prefetch as (trace position it precedes, layer index,
        #: predicted experts), which `simulate_policy` replays with the trace
        self.prefetch_trace: list[tuple[int, int, tuple[int, ...]]] = []

    def attach(self, cache: ExpertCache) -> None:
        """Report the slots of `cache` (the current engine's) from now on."""
        self._cache = cache

    @property
    def breakdown(self) -> Any:
        """The attached cache's host-time breakdown (`ExpertCache.set_breakdown`), or None."""
        return self._cache.breakdown if self._cache is not None else None

    @property
    def slots_total(self) -> int:
        """Slots of every layer together (0 before a cache is attached)."""
        return self._cache.slots_total if self._cache is not None else 0

    @property
    def slots_in_use(self) -> int:
        """Slots holding an expert, every layer together."""
        return self._cache.slots_in_use if self._cache is not None else 0

    @property
    def pinned_host_bytes(self) -> int:
        """Bytes of the current cache's routed experts page-locked in host memory (0: staged copies)."""
        return self._cache.pin.pinned_bytes if self._cache is not None and self._cache.pin.on else 0

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses); 0.0 before any lookup."""
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    @property
    def lookahead_recall(self) -> float:
        """lookahead_right / lookahead_needed: the share of the experts lookups needed that router
        lookahead had predicted (0.0 without lookahead)."""
        return self.lookahead_right / self.lookahead_needed if self.lookahead_needed else 0.0

    @property
    def bytes_per_row(self) -> float:
        """bytes_copied / rows (0.0 before any forward)."""
        return self.bytes_copied / self.rows if self.rows else 0.0

    @property
    def bytes_per_forward(self) -> float:
        """bytes_copied / forwards (0.0 before any forward)."""
        return self.bytes_copied / self.forwards if self.forwards else 0.0

    def snapshot(self) -> dict[str, float]:
        """Every counter and ratio as a dict (benchmarks, tests)."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "bytes_copied": self.bytes_copied,
            "forwards": self.forwards,
            "rows": self.rows,
            "bytes_per_row": self.bytes_per_row,
            "bytes_per_forward": self.bytes_per_forward,
            "slots_in_use": self.slots_in_use,
            "slots_total": self.slots_total,
            "direct_copies": self.direct_copies,
            "staged_copies": self.staged_copies,
            "prefetches": self.prefetches,
            "lookahead_recall": self.lookahead_recall,
            "pinned_host_bytes": self.pinned_host_bytes,
        }

    def samples(self) -> list[tuple[str, str, str, float]]:
        """(metric name, kind "counter" | "gauge", help, value) of every exported series."""
        return [
            ("ignis_expert_cache_hits_total", "counter", "Routed experts a forward found in a slot.",
             self.hits),
            ("ignis_expert_cache_misses_total", "counter", "Routed experts copied into a slot.",
             self.misses),
            ("ignis_expert_cache_copied_bytes_total", "counter",
             "Bytes of routed experts copied host to device.", self.bytes_copied),
            ("ignis_expert_cache_forwards_total", "counter",
             "Forwards (verify rounds, prefill chunks) through the MoE layers.", self.forwards),
            ("ignis_expert_cache_rows_total", "counter",
             "Rows (tokens) run through the MoE layers.", self.rows),
            ("ignis_expert_cache_copied_bytes_per_token", "gauge",
             "Expert bytes copied per row (token) run, since start.", self.bytes_per_row),
            ("ignis_expert_cache_copied_bytes_per_round", "gauge",
             "Expert bytes copied per forward (verify round or prefill chunk), since start.",
             self.bytes_per_forward),
            ("ignis_expert_cache_slots_in_use", "gauge", "Expert slots holding an expert.",
             self.slots_in_use),
            ("ignis_expert_cache_slots", "gauge", "Expert slots of every MoE layer.", self.slots_total),
            ("ignis_expert_cache_direct_copies_total", "counter",
             "Expert misses copied by DMA straight from page-locked host memory.", self.direct_copies),
            ("ignis_expert_cache_staged_copies_total", "counter",
             "Expert misses copied through the pinned staging ring (CPU memcpy first).",
             self.staged_copies),
            ("ignis_expert_cache_prefetches_total", "counter",
             "Routed experts copied ahead of their layer's lookup by router lookahead.", self.prefetches),
            ("ignis_expert_cache_pinned_host_bytes", "gauge",
             "Bytes of routed experts page-locked in host memory (0: misses use the staging ring).",
             self.pinned_host_bytes),
        ]  # fmt: skip


class _Copier:
    """Host-to-device copies of expert parts (module docstring, "Copies"); one per cache.

    Args:
        device: the slots' device.
        staging_bytes: one expert's bytes (a staging buffer's size).
        staging_buffers: buffers in the staging ring (allocated at the first staged copy).
        pin: the cache's page-locked host memory: a miss whose parts it all covers is copied by DMA
            straight into the slot (None: always staged).
        stats: counters of direct and staged copies (None: not counted).
    """

    def __init__(
        self,
        device: torch.device,
        staging_bytes: int,
        *,
        staging_buffers: int = STAGING_BUFFERS,
        pin: HostPin | None = None,
        stats: ExpertCacheStats | None = None,
        ids_wait: str = "spin",
    ):
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = pin
        self.stats = stats
        self._staging_bytes = staging_bytes
        self._staging_count = staging_buffers
        self._staging: list[torch.Tensor] = []
        self._staging_done: list[Any] = []
        self._scratch: dict[tuple[Any, ...], torch.Tensor] = {}
        self._next = 0
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
            self._stream_handle = self.stream.cuda_stream
        #: the batched copy of a group's misses by raw addresses (`ignis.runtime.expert_transfer`):
        #: the CUDA driver's on CUDA when the experts are page-locked (set by `ExpertCache`), a
        #: `HostMemmove` where a CPU caller asks for it; None: torch copies, one miss at a time
        self.dma: Any = None
        #: the MoE block's pinned routing buffers (one set per cache)
        self.routing = RoutingBuffers(device, ids_wait=ids_wait)
        self._addr = AddressBuffers()  # a batch's operand arrays, reused
        #: the cache's `ignis.runtime.host_breakdown.HostBreakdown`, or None (off)
        self.timer: Any = None

    def scratch(self, key: tuple[Any, ...], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A device buffer for one expert part in transit (row-major, before tiling), one per key:
        every use is ordered on the copy stream (or synchronous on the CPU), so one is enough."""
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    def copy(
        self,
        dst: Sequence[torch.Tensor],
        src: Sequence[torch.Tensor],
        after: Any = None,
        then: Callable[[], None] | None = None,
    ) -> Any:
        """Copy src[i] (host) into dst[i] (a slot's part or a scratch buffer), then run `then` (e.g.
        tile a scratch into the slot); on CUDA asynchronously on the side stream, after event `after`
        (the slot's last use). Returns the event that marks it all done (None on the CPU, where it is
        done on return)."""
        if not self.cuda:
            for d, s in zip(dst, src, strict=True):
                d.copy_(s)
            if then is not None:
                then()
            return None
        if self.pin is not None and all(self.pin.covers(s) for s in src):
            # page-locked host bytes: one DMA each, queued on the side stream; the engine thread
            # neither copies nor waits (the host bytes never change, so nothing to protect)
            with torch.cuda.stream(self.stream):
                if after is not None:
                    self.stream.wait_event(after)
                for d, s in zip(dst, src, strict=True):
                    d.reshape(-1).view(torch.uint8).copy_(s.reshape(-1).view(torch.uint8), non_blocking=True)
                if then is not None:
                    then()
                done = self.stream.record_event()
            if self.stats is not None:
                self.stats.direct_copies += 1
            return done
        if not self._staging:
            self._staging = [
                torch.empty(self._staging_bytes, dtype=torch.uint8, pin_memory=True)
                for _ in range(self._staging_count)
            ]
            self._staging_done = [None] * self._staging_count
        if self.stats is not None:
            self.stats.staged_copies += 1
        staging = self._staging[self._next]
        done = self._staging_done[self._next]
        if done is not None:
            done.synchronize()  # its previous upload has been read out
        offset = 0
        views = []
        for s in src:
            n = s.numel() * s.element_size()
            part = staging[offset : offset + n]
            part.copy_(s.contiguous().reshape(-1).view(torch.uint8))
            views.append(part)
            offset += n
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            for d, part in zip(dst, views, strict=True):
                d.reshape(-1).view(torch.uint8).copy_(part, non_blocking=True)
            if then is not None:
                then()
            done = self._staging_done[self._next] = self.stream.record_event()
        self._next = (self._next + 1) % len(self._staging)
        return done

    def copy_batch(self, table: PartTable, misses: Sequence[tuple[int, int]], after: Sequence[Any]) -> Any:
        """Copy every (expert, slot) of `misses` with one batched call over `table`'s precomputed
        addresses (`self.dma`), after the events `after` (the slots' last uses; None entries
        skipped); on CUDA asynchronously on the side stream. Returns one event that marks the whole
        batch done (None on the CPU, where it is done on return)."""
        timer, buf = self.timer, self._addr
        n = table.gather_into([e for e, _ in misses], [s for _, s in misses], buf)
        if self.stats is not None:
            self.stats.direct_copies += len(misses)
        if timer is not None:
            timer.lap("miss_gather")
        if not self.cuda:
            self.dma.copy(buf.dst[:n], buf.src[:n], buf.sizes[:n], None)
            if timer is not None:
                timer.lap("miss_issue")
            return None
        seen: set[int] = set()
        for event in after:
            if event is not None and id(event) not in seen:
                seen.add(id(event))
                self.stream.wait_event(event)
        if timer is not None:
            timer.lap("miss_deps")
        ptrs = (buf.dst_ptr, buf.src_ptr, buf.sizes_ptr)
        self.dma.copy(buf.dst[:n], buf.src[:n], buf.sizes[:n], self._stream_handle, ptrs)
        if timer is not None:
            timer.lap("miss_issue")
        done = torch.cuda.Event()
        done.record(self.stream)
        if timer is not None:
            timer.lap("miss_event")
        return done

    def batches(self, table: PartTable | None) -> bool:
        """Whether misses over `table` go as one batch now: a table, a batched copier, and on CUDA
        the experts still page-locked (closing the pin sends later misses to the staging ring)."""
        if table is None or self.dma is None:
            return False
        return not self.cuda or (self.pin is not None and self.pin.on)

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for `event` (a copy's; no-op for None)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def used(self) -> Any:
        """An event on the compute stream after the work issued so far (None on the CPU)."""
        return torch.cuda.current_stream(self.device).record_event() if self.cuda else None


class ExpertSlots:
    """One MoE layer's routed experts: host weights and `num_slots` device slots (module docstring).

    Stands in for the block's expert list (`SparseMoeWeights.experts`): `len()` is the number of
    experts, indexing gives an expert's host weights, and `resident_groups` (what
    `sparse_moe_block` calls) makes the experts a forward needs resident and yields their slot
    weights.

    Args:
        host: every routed expert's weights on the host, in expert-index order; all experts must
            have the same parts (shapes and dtypes).
        num_slots: device slots (1..len(host)).
        device: where the slots live.
        copier: the cache's host-to-device copier.
        stats: counters to update.
        first: this is the first MoE layer a forward visits (it counts forwards and rows).
        index: the layer's index among the MoE layers (in the routing trace).
        layouts: per q4 field ("gate", "up", "down", "gate_up"), how its slots hold it: "row_major"
            (the default: the stored bytes), "tiled" (the CUDA tiled layout,
            `ignis.runtime.linear.Q4Weight.to_tiled`) or a torch dtype (dequantized, for a linear
            hook that takes no q4 weights). For the last two a miss copies the row-major parts into a
            device scratch and converts them into the slot on the copy stream; the bytes copied are
            the stored q4 ones either way.
        stacked: hold each part of gate and up in one buffer per part, gate's rows over up's
            ([num_slots, 2 I, ...]: the gate|up stack of every slot, `stacks`), for the grouped
            expert kernels (`ignis.runtime.families.moe_grouped`); no field may be "tiled".

    Raises:
        ValueError: no experts, num_slots outside 1..len(host), experts whose parts differ, a
            layout for a field that is not a q4 part, or a tiled layout with `stacked`.
    """

    def __init__(
        self,
        host: Sequence[SwiGLUWeights],
        num_slots: int,
        *,
        device: torch.device,
        copier: _Copier,
        stats: ExpertCacheStats,
        first: bool = False,
        layouts: Mapping[str, str | torch.dtype] | None = None,
        index: int = 0,
        stacked: bool = False,
    ) -> None:
        if not host:
            raise ValueError("an expert cache layer needs at least one expert")
        if not 1 <= num_slots <= len(host):
            raise ValueError(f"num_slots must be 1..{len(host)} (the layer's experts), got {num_slots}")
        self._host = list(host)
        self._host_leaves = [[t for _, _, t in _leaves(w)] for w in self._host]
        sig = [(f, p, tuple(t.shape), t.dtype) for f, p, t in _leaves(self._host[0])]
        for e, w in enumerate(self._host):
            if [(f, p, tuple(t.shape), t.dtype) for f, p, t in _leaves(w)] != sig:
                raise ValueError(f"expert {e}'s parts differ from expert 0's ({sig})")
        self._sig = sig
        self.num_slots = num_slots
        self.device = device
        self.expert_bytes = expert_nbytes(self._host[0])
        self._copier, self._stats, self._first = copier, stats, first
        self.index = index
        shapes = {f: shape for f, p, shape, _ in sig if p == "packed"}  # q4 field -> packed [N, K/8]
        layouts = {f: v for f, v in (layouts or {}).items() if v != ROW_MAJOR}
        if not set(layouts) <= set(shapes):
            raise ValueError(f"layouts for {sorted(set(layouts) - set(shapes))}: not q4 parts of the experts")
        if stacked and TILED in layouts.values():
            raise ValueError("stacked expert slots hold row-major or dense parts, not tiled ones")
        self._layouts = layouts
        self.stacked = stacked
        # stacked: gate's and up's buffers are the halves of one [num_slots, 2 I, ...] buffer per part
        gate_sig = [(p, shape, dt) for f, p, shape, dt in sig if f == "gate"]
        pair = stacked and bool(gate_sig) and gate_sig == [(p, sh, dt) for f, p, sh, dt in sig if f == "up"]
        pair = pair and layouts.get("gate") == layouts.get("up")
        self._gate_up: dict[str, torch.Tensor] = {}  # part -> the joint buffer (stacked)

        def alloc(f: str, p: str, shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            if not (pair and f in ("gate", "up")):
                return torch.empty((num_slots, *shape), dtype=dt, device=device)
            joint = self._gate_up.get(p)
            if joint is None:
                joint = self._gate_up[p] = torch.empty(
                    (num_slots, 2 * shape[0], *shape[1:]), dtype=dt, device=device
                )
            return joint[:, : shape[0]] if f == "gate" else joint[:, shape[0] :]

        # per field: the slot buffers, [num_slots, ...] each ("w" dense; "packed" + "scales" q4)
        self._slot_bufs: dict[str, dict[str, torch.Tensor]] = {}
        self._dst: list[Callable[[int], torch.Tensor]] = []  # leaf -> where a miss copies it
        self._scratch: dict[str, dict[str, torch.Tensor]] = {}
        for f, p, shape, dt in sig:
            bufs = self._slot_bufs.setdefault(f, {})
            layout = layouts.get(f)
            if layout is None:
                buf = bufs[p] = alloc(f, p, tuple(shape), dt)
                self._dst.append(lambda slot, buf=buf: buf[slot])
                continue
            n, k = shapes[f][-2], shapes[f][-1] * 8
            if layout == TILED:
                codes, scales = tiled_shapes(n, k)
                bufs[p] = torch.empty(
                    (num_slots, *(codes if p == "packed" else scales)), dtype=dt, device=device
                )
            elif p == "packed":
                assert isinstance(layout, torch.dtype)
                bufs["w"] = alloc(f, "w", (n, k), layout)
            scratch = self._scratch.setdefault(f, {})[p] = copier.scratch((f, p, shape, dt), shape, dt)
            self._dst.append(lambda _slot, scratch=scratch: scratch)
        self._slot_weights = [self._build(s) for s in range(num_slots)]
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recently used first
        self._free = list(range(num_slots))
        self._last_use: list[Any] = [None] * num_slots
        # per slot: the event of a prefetch copy not yet waited for by a lookup (`prefetch`)
        self._pending: list[Any] = [None] * num_slots
        self._predicted: set[int] | None = None  # the last prefetch's prediction (recall)
        self._table = self._part_table()

    def _part_table(self) -> PartTable | None:
        """The raw addresses of every expert's parts and every slot's (`PartTable`), for batched
        misses: only when a miss is plain bytes into the slot (no layout conversion), the host parts
        are contiguous CPU tensors and, on CUDA, all page-locked (a DMA reads them); else None."""
        if self._layouts:
            return None
        leaves = [t for parts in self._host_leaves for t in parts]
        if not all(t.device.type == "cpu" and t.is_contiguous() for t in leaves):
            return None
        if self.device.type == "cuda":
            pin = self._copier.pin
            if pin is None or not pin.on or not all(pin.covers(t) for t in leaves):
                return None
        dst = [[d(slot) for d in self._dst] for slot in range(self.num_slots)]
        if not all(t.device == self.device or t.device.type == self.device.type for p in dst for t in p):
            return None
        try:
            return PartTable(self._host_leaves, dst)
        except ValueError:  # a slot view that is not contiguous: torch copies
            return None

    def _build(self, slot: int) -> SwiGLUWeights:
        values: dict[str, Any] = {}
        for f, bufs in self._slot_bufs.items():
            if "w" in bufs:
                values[f] = bufs["w"][slot]
            elif self._layouts.get(f) == TILED:
                values[f] = Q4Weight(bufs["packed"][slot], bufs["scales"][slot], TILED, self._rows(f))
            else:
                values[f] = Q4Weight(bufs["packed"][slot], bufs["scales"][slot])
        return SwiGLUWeights(values.get("gate"), values.get("up"), values["down"], values.get("gate_up"))

    def _rows(self, field: str) -> int:
        return next(int(shape[-2]) for f, p, shape, _ in self._sig if f == field and p == "packed")

    def __len__(self) -> int:
        return len(self._host)

    def __getitem__(self, expert: int) -> SwiGLUWeights:
        """Expert `expert`'s host weights (not resident: run experts through `resident_groups`)."""
        return self._host[expert]

    @property
    def routing(self) -> RoutingBuffers:
        """The cache's preallocated routing buffers (the grouped MoE block's host round trip)."""
        return self._copier.routing

    @property
    def timer(self) -> Any:
        """The cache's host-time breakdown (`ignis.runtime.host_breakdown.HostBreakdown`), or None."""
        return self._copier.timer

    @property
    def batched(self) -> bool:
        """Whether this layer's misses go as one batched copy a group (`ignis.runtime.expert_transfer`)."""
        return self._copier.batches(self._table)

    @property
    def resident(self) -> dict[int, int]:
        """{expert: slot} of the experts in a slot now, least recently used first."""
        return dict(self._slot_of)

    @property
    def slots_in_use(self) -> int:
        """Slots holding an expert."""
        return len(self._slot_of)

    @property
    def slot_bytes(self) -> int:
        """Device bytes of this layer's slots."""
        return sum(b.numel() * b.element_size() for bufs in self._slot_bufs.values() for b in bufs.values())

    def resident_groups(
        self, experts: Sequence[int], *, rows: int
    ) -> Iterator[Iterator[tuple[int, SwiGLUWeights]]]:
        """Make `experts` (ascending, distinct) resident, in groups of at most `num_slots`, and yield
        for each group an iterator of its (expert, slot weights) in order; a group's slots are not
        reused before the caller asks for the next group (on CUDA: until the work issued by then has
        run). Every copy of a group is issued before its first expert is handed out, and on CUDA the
        compute stream waits for an expert's own copy just before it is handed out, so an expert
        runs while the copies of the experts after it are still in flight.

        Args:
            experts: the union of the experts the forward's rows were routed to.
            rows: the forward's rows (counted once per forward, at the first MoE layer).
        """
        with contextlib.closing(self._groups(experts, rows)) as groups:
            for entries in groups:
                yield self._in_turn([(e, self._slot_weights[slot], ready) for e, slot, ready in entries])

    def slot_groups(self, experts: Sequence[int], *, rows: int) -> Iterator[list[tuple[int, int]]]:
        """`resident_groups` for the grouped expert kernels: yields, per group, its (expert, slot)
        pairs, after the compute stream has waited for every copy of the group (the kernels read all
        of the group's slots at once). The group's slots are not reused before the caller asks for
        the next group (on CUDA: until the work issued by then has run); counters as
        `resident_groups`.

        Args:
            experts: the union of the experts the forward's rows were routed to (ascending, distinct).
            rows: the forward's rows (counted once per forward, at the first MoE layer).
        """
        with contextlib.closing(self._groups(experts, rows)) as groups:
            for entries in groups:
                waited: set[int] = set()
                for _expert, _slot, ready in entries:
                    if ready is not None and id(ready) not in waited:  # a batch: one event, one wait
                        waited.add(id(ready))
                        self._copier.wait(ready)
                if self._copier.timer is not None:
                    self._copier.timer.lap("copy_wait")
                yield [(expert, slot) for expert, slot, _ready in entries]

    def stacks(self) -> tuple[Any, Any]:
        """(gate_up, down): every slot's gate|up and down weights as stacks, [num_slots, 2 I, H] and
        [num_slots, H, I] (a row-major `Q4Weight` or a dense tensor; views of the slot buffers), for
        the grouped expert kernels: slot s of a stack holds the expert `slot_groups` mapped to s.

        Raises:
            ValueError: the slots are not `stacked` (or the experts have no separate gate and up
                parts of one shape, nor a gate_up part).
        """

        def weight(bufs: Mapping[str, torch.Tensor]) -> Any:
            return bufs["w"] if "w" in bufs else Q4Weight(bufs["packed"], bufs["scales"])

        if not self.stacked:
            raise ValueError("stacks() needs slots built with stacked=True")
        if "gate_up" in self._slot_bufs:
            gate_up = weight(self._slot_bufs["gate_up"])
        elif self._gate_up:
            gate_up = weight(self._gate_up)
        else:
            raise ValueError("the experts have no gate_up part nor gate and up parts of one shape")
        return gate_up, weight(self._slot_bufs["down"])

    def _groups(self, experts: Sequence[int], rows: int) -> Iterator[list[tuple[int, int, Any]]]:
        """The lookup behind `resident_groups` and `slot_groups`: per group of at most `num_slots`
        experts, (expert, slot, event of its copy or None) once every copy of the group is issued;
        the group's slots are marked used (their last-use event) when the caller moves on."""
        if self._first:
            self._stats.forwards += 1
            self._stats.rows += rows
        experts = list(experts)
        if self._stats.trace is not None:
            self._stats.trace.append((self.index, tuple(experts)))
        if self._predicted is not None:  # router lookahead's recall
            self._stats.lookahead_right += len(self._predicted.intersection(experts))
            self._stats.lookahead_needed += len(experts)
            self._predicted = None
        slot_of, pending, last_use = self._slot_of, self._pending, self._last_use
        for start in range(0, len(experts), self.num_slots):
            group = experts[start : start + self.num_slots]
            pinned = set(group)
            placed: list[tuple[int, int]] = []
            misses: list[tuple[int, int]] = []
            ready: dict[int, Any] = {}  # expert -> the event of its copy
            for expert in group:
                slot = slot_of.get(expert)
                if slot is not None:
                    slot_of.move_to_end(expert)
                    if pending[slot] is not None:  # prefetched: its copy may still run
                        ready[expert] = pending[slot]
                else:
                    slot = self._take_slot(pinned)
                    slot_of[expert] = slot
                    misses.append((expert, slot))
                placed.append((expert, slot))
            self._stats.hits += len(group) - len(misses)
            self._stats.misses += len(misses)
            self._stats.bytes_copied += len(misses) * self.expert_bytes
            timer = self._copier.timer
            if timer is not None:
                timer.lap("lookup")
            if misses:
                ready |= self._copy_in(misses)
            out = [(expert, slot, ready.get(expert)) for expert, slot in placed]
            try:
                yield out
            finally:  # also when the caller stops early: the group's kernels may have been issued
                used = self._copier.used()
                for _expert, slot in placed:
                    last_use[slot] = used
                    pending[slot] = None
                if timer is not None:
                    timer.lap("last_use")

    def _copy_in(self, misses: Sequence[tuple[int, int]]) -> dict[int, Any]:
        """Copy each (expert, slot) of `misses` into its slot, after the slot's last use: one batch
        (`PartTable`) where the copier batches, else one torch copy each (layout conversions, the
        staging ring, CPU). Returns {expert: the event of its copy (None: done)}."""
        if not misses:
            return {}
        for _, slot in misses:
            self._pending[slot] = None  # a prefetch into the slot is superseded (same copy stream)
        if self._copier.batches(self._table):
            assert self._table is not None
            done = self._copier.copy_batch(self._table, misses, [self._last_use[s] for _, s in misses])
            return {e: done for e, _ in misses}
        events = {
            expert: self._copier.copy(
                [dst(slot) for dst in self._dst],
                self._host_leaves[expert],
                self._last_use[slot],
                then=self._convert_into(slot) if self._layouts else None,
            )
            for expert, slot in misses
        }
        if self._copier.timer is not None:
            self._copier.timer.lap("miss_torch")
        return events

    def prefetch(self, experts: Sequence[int]) -> int:
        """Router lookahead: copy those of `experts` (distinct; predicted for this layer's next
        lookup) that no slot holds into slots now, at most `num_slots`, evicting the least recently
        used others, so that the copies overlap the work before that lookup. A later lookup finding
        one counts a hit and waits for its copy; the copies count as `prefetches` and their bytes in
        `bytes_copied`. Returns the experts copied."""
        self._predicted = set(experts)
        if self._stats.trace is not None:
            self._stats.prefetch_trace.append((len(self._stats.trace), self.index, tuple(experts)))
        want = [e for e in experts if e not in self._slot_of][: self.num_slots]
        pinned = set(want)
        misses = []
        for expert in want:
            slot = self._take_slot(pinned)
            self._slot_of[expert] = slot
            misses.append((expert, slot))
        for expert, event in self._copy_in(misses).items():
            self._pending[self._slot_of[expert]] = event
        self._stats.prefetches += len(misses)
        self._stats.bytes_copied += len(misses) * self.expert_bytes
        return len(misses)

    def _convert_into(self, slot: int) -> Callable[[], None]:
        """Convert every scratch (row-major q4 parts just copied) into `slot`: tiled or dequantized."""

        def run() -> None:
            for f, layout in self._layouts.items():
                w = Q4Weight(self._scratch[f]["packed"], self._scratch[f]["scales"])
                bufs = self._slot_bufs[f]
                if layout == TILED:
                    t = w.to_tiled()
                    bufs["packed"][slot].copy_(t.packed)
                    bufs["scales"][slot].copy_(t.scales)
                else:
                    assert isinstance(layout, torch.dtype)
                    bufs["w"][slot].copy_(w.dequantize(layout))

        return run

    def _in_turn(self, entries: list[tuple[int, SwiGLUWeights, Any]]) -> Iterator[tuple[int, SwiGLUWeights]]:
        waited: set[int] = set()
        for expert, weights, ready in entries:
            if ready is None or id(ready) not in waited:  # a batch's event is waited for once
                if ready is not None:
                    waited.add(id(ready))
                self._copier.wait(ready)
            yield expert, weights

    def flush(self) -> None:
        """Forget every resident expert (the slots stay allocated; the next lookups are misses). The
        no-cache baseline of the benchmark: every expert copied on demand."""
        self._slot_of.clear()
        self._free = list(range(self.num_slots))
        self._predicted = None

    def _take_slot(self, pinned: set[int]) -> int:
        if self._free:
            return self._free.pop(0)
        for expert, slot in self._slot_of.items():  # least recently used first
            if expert not in pinned:
                del self._slot_of[expert]
                return slot
        raise AssertionError("a group larger than the slots")  # groups have <= num_slots experts


class ExpertCache:
    """Every MoE layer's `ExpertSlots` of one executor, sharing one copier and one stats object.

    Args:
        slots_per_layer: device slots of each MoE layer (clamped to the layer's experts).
        device: where the slots live.
        stats: counters (a fresh `ExpertCacheStats` when None).
        budget: the plan the slots came from (reported; may be None in tests).
        pin: page-lock the layers' host experts on CUDA (`ignis.runtime.host_pin`): "auto" (fall
            back to the staging ring when refused), "on" (refuse to load instead) or "off".
        lookahead: router lookahead prefetch in static rounds split at the MoE layers
            (`ignis.runtime.families.moe_piecewise`): each MoE layer's routing also runs the next
            MoE layer's router on its input and the predicted experts are copied into that layer's
            slots while the layer computes (`ExpertSlots.prefetch`).
        copies: how misses are copied: "auto" (on CUDA with page-locked experts one batched driver
            call a group of misses, `ignis.runtime.expert_transfer.DriverBatchCopy`; else torch
            copies, one miss at a time), "torch" (always torch copies) or "memmove" (CPU only: the
            batched path's address plan run by ``memmove``, `HostMemmove`).
        ids_wait: how the host waits for each MoE layer's routed ids on CUDA: "spin" (the default),
            "block" or "hybrid" (`ignis.runtime.expert_transfer.RoutingBuffers`).

    The host path can be timed section by section (`set_breakdown`, off by default).

    Raises:
        ValueError: slots_per_layer < 1, an unknown `copies` or `ids_wait`, or "memmove" off the CPU.
        ConfigError: a bad `pin`, or "on" off CUDA (and later, from `make_layer`, refused).
    """

    def __init__(
        self,
        slots_per_layer: int,
        *,
        device: torch.device | str,
        stats: ExpertCacheStats | None = None,
        budget: CacheBudget | None = None,
        pin: str = "auto",
        copies: str = "auto",
        lookahead: bool = False,
        ids_wait: str = "spin",
    ) -> None:
        if slots_per_layer < 1:
            raise ValueError(f"slots_per_layer must be >= 1, got {slots_per_layer}")
        if copies not in COPY_PATHS:
            raise ValueError(f"copies must be one of {COPY_PATHS}, got {copies!r}")
        if copies == "memmove" and torch.device(device).type != "cpu":
            raise ValueError(f"copies='memmove' runs on host memory only, got device {device}")
        if ids_wait not in IDS_WAITS:
            raise ValueError(f"ids_wait must be one of {IDS_WAITS}, got {ids_wait!r}")
        self.ids_wait = ids_wait
        self.breakdown: Any = None
        self.copies = copies
        self.lookahead = bool(lookahead)
        self.slots_per_layer = slots_per_layer
        self.device = torch.device(device)
        self.stats = stats if stats is not None else ExpertCacheStats()
        self.budget = budget
        self.layers: list[ExpertSlots] = []
        self._copier: _Copier | None = None
        self.pin = HostPin(self.device, pin)
        self.stats.attach(self)

    def make_layer(
        self,
        host: Sequence[SwiGLUWeights],
        *,
        linear: Any,
        dtype: torch.dtype = torch.float32,
        stacked: bool = False,
    ) -> ExpertSlots:
        """The slots of the next MoE layer (layers in forward order) over its host experts.

        Args:
            host: the layer's experts in host memory (`host_experts`).
            linear: the executor's linear hook. A q4 expert part is held in the layout the resident
                executor would hold it in: tiled when the hook places its shape in the tiled layout
                (`ignis.runtime.linear.place_weight`: CUDA tiled functions serve it), row-major when
                the hook takes q4 weights as they are, and dequantized to `dtype` when the hook is
                None or `F.linear` (no q4 weights).
            dtype: the executor's dtype.
            stacked: slots for the grouped expert kernels (`ExpertSlots`' `stacked`): q4 parts stay
                row-major (never tiled) when the hook takes q4 weights, dequantized to `dtype` when
                it does not.
        """
        host = self.pin.adopt_experts(host)  # page-locked views where registration works (or as given)
        if self._copier is None:
            self._copier = _Copier(
                self.device, expert_nbytes(host[0]), pin=self.pin, stats=self.stats, ids_wait=self.ids_wait
            )
            self._copier.timer = self._copier.routing.timer = self.breakdown
            if self.copies == "memmove":
                self._copier.dma = HostMemmove()
            elif self.copies == "auto" and self.device.type == "cuda" and self.pin.on:
                self._copier.dma = driver_batch_copy()
        layouts: dict[str, str | torch.dtype] = {}
        for name in _FIELDS:
            part = getattr(host[0], name)
            if not isinstance(part, Q4Weight):
                continue
            if linear is None or linear is F.linear:
                layouts[name] = dtype
                continue
            if stacked:
                layouts[name] = ROW_MAJOR
                continue
            placed = place_weight(linear, part.to(self.device).contiguous())
            layouts[name] = TILED if isinstance(placed, Q4Weight) and placed.is_tiled else ROW_MAJOR
        layer = ExpertSlots(
            host,
            min(self.slots_per_layer, len(host)),
            device=self.device,
            copier=self._copier,
            stats=self.stats,
            first=not self.layers,
            index=len(self.layers),
            layouts=layouts,
            stacked=stacked,
        )
        self.layers.append(layer)
        return layer

    def set_breakdown(self, timer: Any) -> None:
        """Time the host path of every layer's lookups, copies and launches into `timer` (an
        `ignis.runtime.host_breakdown.HostBreakdown`; None: off, the default)."""
        self.breakdown = timer
        if self._copier is not None:
            self._copier.timer = self._copier.routing.timer = timer

    def flush(self) -> None:
        """`ExpertSlots.flush` on every layer."""
        for layer in self.layers:
            layer.flush()

    def describe_host(self) -> str:
        """One log line: the copy path of the misses (direct DMA from page-locked experts or the
        staging ring, with the reason) and what registration cost at load."""
        return self.pin.describe()

    def close(self) -> None:
        """Undo the host registrations (after the queued copies; later misses use the staging ring).
        Call it once the engine no longer runs forwards: a miss issued while it runs may read pages
        being unpinned."""
        self.pin.close()

    @property
    def slots_total(self) -> int:
        """Slots of every layer together."""
        return sum(layer.num_slots for layer in self.layers)

    @property
    def slots_in_use(self) -> int:
        """Slots holding an expert, every layer together."""
        return sum(layer.slots_in_use for layer in self.layers)

    @property
    def device_bytes(self) -> int:
        """Device bytes of every layer's slots (as laid out: tiled or dequantized parts included)."""
        return sum(layer.slot_bytes for layer in self.layers)


# ---------------------------------------------------------------------------------------------
# budget
# ---------------------------------------------------------------------------------------------


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def lane_state_bytes(config: Any, *, lanes: int, context: int, dtype: torch.dtype) -> int:
    """Device bytes of `lanes` lanes' state at `context` tokens for a hybrid config: the attention
    layers' keys and values (model dtype) and the GDN layers' recurrent (float32) and conv (model
    dtype) states."""
    b = _dtype_bytes(dtype)
    attn = sum(1 for i in range(config.num_hidden_layers) if config.is_full_attention(i))
    gdn = config.num_hidden_layers - attn
    kv = attn * 2 * context * config.num_key_value_heads * config.head_dim * b
    rec = gdn * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    conv = gdn * config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * b
    return lanes * (kv + rec + conv)


def round_workspace_bytes(config: Any, *, rows: int, dtype: torch.dtype) -> int:
    """Device bytes a verify round of `rows` rows needs beyond the weights and lane state (an upper
    estimate): float32 logits and their softmax ([rows, vocab] x 2), the GDN per-column recurrent
    states kept until commit ([gdn layers, rows, v_heads, k_dim, v_dim] float32) and ~16 hidden-wide
    and ~4 (expert-intermediate x top_k)-wide activations per row."""
    b = _dtype_bytes(dtype)
    gdn = sum(1 for i in range(config.num_hidden_layers) if not config.is_full_attention(i))
    record = (
        gdn * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    )
    inter = getattr(config, "moe_intermediate_size", 0) * getattr(config, "num_experts_per_tok", 0)
    act = 16 * config.hidden_size * b + 4 * inter * b + 2 * config.vocab_size * 4
    return rows * (record + act)


@dataclass(frozen=True)
class CacheBudget:
    """How the device memory is split when routed experts are cached (all sizes in bytes).

    Attributes:
        source: "flag" (an explicit budget) or "profile:NAME" (the card profile's default).
        card_bytes: the card's memory (0 with an explicit budget and no card).
        resident_bytes: non-expert weights on the device.
        lane_bytes: the lanes' KV and recurrent state.
        workspace_bytes: the verify rounds' workspace at the row budget.
        headroom_bytes: kept free (CUDA context, allocator).
        mtp_reserve_bytes: the MTP head's weights and KV, taken from the cache's share.
        wide_round_bytes: with an explicit budget, the workspace a verify round wider than 8 rows
            needs beyond an 8-row one, taken from the cache's share (a card plan's workspace holds
            it already).
        cache_bytes: the expert slots' share after the reserves.
        expert_bytes: one routed expert.
        moe_layers: layers with routed experts.
        num_experts: routed experts per layer.
        slots_per_layer: cache_bytes // (moe_layers * expert_bytes), at most num_experts.
    """

    source: str
    card_bytes: int
    resident_bytes: int
    lane_bytes: int
    workspace_bytes: int
    headroom_bytes: int
    mtp_reserve_bytes: int
    cache_bytes: int
    expert_bytes: int
    moe_layers: int
    num_experts: int
    slots_per_layer: int
    wide_round_bytes: int = 0

    @property
    def experts_bytes(self) -> int:
        """Every routed expert of every layer (what the host holds)."""
        return self.expert_bytes * self.num_experts * self.moe_layers

    @property
    def fraction_cached(self) -> float:
        """Share of each layer's experts the slots hold at once."""
        return self.slots_per_layer / self.num_experts

    def describe(self) -> str:
        """One log line with the split (GiB, MiB below 1 GiB)."""
        g = human_bytes
        slots = (
            f"expert slots {g(self.slots_per_layer * self.expert_bytes * self.moe_layers)} "
            f"({self.slots_per_layer} of {self.num_experts} experts a layer x {self.moe_layers} layers, "
            f"{self.expert_bytes / 2**20:.2f} MiB each; {self.fraction_cached:.0%} of "
            f"{g(self.experts_bytes)} of experts in host memory)"
        )
        rest = (
            f"resident weights {g(self.resident_bytes)} + lane state {g(self.lane_bytes)} + round "
            f"workspace {g(self.workspace_bytes)}"
        )
        if self.source == "flag":
            wide = f" + wide-round reserve {g(self.wide_round_bytes)}" if self.wide_round_bytes else ""
            return (
                f"expert cache (flag): budget = MTP reserve {g(self.mtp_reserve_bytes)}{wide} + {slots}; "
                f"besides it on the device: {rest}"
            )
        return (
            f"expert cache ({self.source}): card {g(self.card_bytes)} = {rest} + headroom "
            f"{g(self.headroom_bytes)} + MTP reserve {g(self.mtp_reserve_bytes)} + {slots}"
        )


def plan_expert_cache(
    *,
    expert_bytes: int,
    moe_layers: int,
    num_experts: int,
    resident_bytes: int,
    lane_bytes: int,
    workspace_bytes: int,
    mtp_reserve_bytes: int = 0,
    budget_bytes: int | None = None,
    card_bytes: int = 0,
    card_name: str = "",
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
    wide_round_bytes: int = 0,
) -> CacheBudget:
    """The slots per layer for an explicit budget or the card's memory.

    With `budget_bytes` (the flag / config key): the MTP reserve and `wide_round_bytes` (what a
    verify round wider than 8 rows needs beyond an 8-row one) are taken from it and the rest is the
    slots' share. Without: the card's memory minus resident weights, lane state, round workspace (at
    the row budget, so wide rounds included), headroom and the MTP reserve.

    Raises:
        ConfigError: the share left holds less than one expert slot per layer (the message gives the
            split and the smallest budget that works), or no budget and no card size.
    """
    if expert_bytes <= 0 or moe_layers <= 0 or num_experts <= 0:
        raise ConfigError("the expert cache needs a model with routed experts")
    if budget_bytes is not None:
        source = "flag"
        share = budget_bytes - mtp_reserve_bytes - wide_round_bytes
    elif card_bytes > 0:
        source = f"profile:{card_name}" if card_name else "card"
        share = (
            card_bytes - resident_bytes - lane_bytes - workspace_bytes - headroom_bytes - mtp_reserve_bytes
        )
    else:
        raise ConfigError("the expert cache needs a budget (--expert-cache-bytes) or a card size")
    per_slot = moe_layers * expert_bytes
    slots = min(num_experts, max(share, 0) // per_slot)
    if slots < 1:
        need = per_slot + mtp_reserve_bytes + wide_round_bytes
        h = human_bytes
        wide = f" and the wide-round reserve ({h(wide_round_bytes)})" if wide_round_bytes else ""
        raise ConfigError(
            f"expert cache: {h(max(share, 0))} left for expert slots after the MTP reserve "
            f"({h(mtp_reserve_bytes)}){wide}; one slot a layer needs {h(per_slot)} "
            f"({moe_layers} layers x {h(expert_bytes)})"
            + (f": give --expert-cache-bytes >= {need}" if budget_bytes is not None else
               f"; the card's {h(card_bytes)} do not fit resident weights {h(resident_bytes)} + lane "
               f"state {h(lane_bytes)} + workspace {h(workspace_bytes)} + headroom {h(headroom_bytes)} "
               "with it: lower --lanes or --model-max-context")
        )  # fmt: skip
    return CacheBudget(
        source=source,
        card_bytes=card_bytes if budget_bytes is None else 0,
        resident_bytes=resident_bytes,
        lane_bytes=lane_bytes,
        workspace_bytes=workspace_bytes,
        headroom_bytes=headroom_bytes if budget_bytes is None else 0,
        mtp_reserve_bytes=mtp_reserve_bytes,
        cache_bytes=max(share, 0),
        expert_bytes=expert_bytes,
        moe_layers=moe_layers,
        num_experts=num_experts,
        slots_per_layer=int(slots),
        wide_round_bytes=wide_round_bytes if budget_bytes is not None else 0,
    )


def host_experts(
    config: Any, weights: Mapping[str, Any], prefix: str, *, dtype: torch.dtype
) -> list[SwiGLUWeights]:
    """One MoE layer's routed experts as host `SwiGLUWeights` (gate, up, down apart, as the resident
    executor holds them): views of the fused stacks (``{prefix}.experts.gate_up_proj[e, :I]`` /
    ``[e, I:]``, ``down_proj[e]``) or the per-expert tensors; dense weights cast to `dtype` (a copy
    only when the stored dtype differs), q4 weights as stored (row-major)."""

    def host(t: Any) -> Any:
        if isinstance(t, Q4Weight):
            return t.to_row_major() if t.is_tiled else t
        return t.detach().to(dtype=dtype)

    inter = config.moe_intermediate_size
    if f"{prefix}.experts.gate_up_proj" in weights:
        gate_up = host(weights[f"{prefix}.experts.gate_up_proj"])
        down = host(weights[f"{prefix}.experts.down_proj"])
        return [
            SwiGLUWeights(gate_up[e, :inter], gate_up[e, inter:], down[e]) for e in range(config.num_experts)
        ]
    return [
        SwiGLUWeights(
            host(weights[f"{prefix}.experts.{e}.gate_proj.weight"]),
            host(weights[f"{prefix}.experts.{e}.up_proj.weight"]),
            host(weights[f"{prefix}.experts.{e}.down_proj.weight"]),
        )
        for e in range(config.num_experts)
    ]


# ---------------------------------------------------------------------------------------------
# artifacts and serving
# ---------------------------------------------------------------------------------------------


def _held_bytes(info: Any, dtype: torch.dtype, keep_q4: bool) -> int:
    """Bytes a stored tensor takes once loaded: q4_g32 as stored with `keep_q4` (codes + scales),
    else dequantized / cast to `dtype`; integer tensors as stored."""
    numel = math.prod(info.shape)
    if info.dtype == "q4_g32":
        return int(info.length) if keep_q4 else numel * _dtype_bytes(dtype)
    if info.dtype in ("f32", "f16", "bf16"):
        return numel * _dtype_bytes(dtype)
    return int(info.length)


def plan_for_artifact(
    art: Any,
    *,
    dtype: torch.dtype,
    keep_q4: bool,
    lanes: int,
    context: int,
    rows: int,
    mtp: bool,
    budget_bytes: int | None,
    headroom_bytes: int = DEFAULT_HEADROOM_BYTES,
) -> CacheBudget:
    """`plan_expert_cache` with the sizes read from an artifact (`ignis.runtime.artifact.Artifact`):
    resident and expert bytes from its tensor table (as they will be held: `keep_q4`, `dtype`), the
    lanes' state for `lanes` x `context` tokens, the workspace of a `rows`-row verify round, the MTP
    reserve (the head's weights and its KV for `lanes` x `context`) when `mtp`, and the card's memory
    from the artifact's profile when `budget_bytes` is None.

    Raises:
        ConfigError: the model has no routed experts, or `plan_expert_cache`'s refusals.
    """
    config = art.config
    if not getattr(config, "is_moe", False) or not getattr(config, "num_experts", 0):
        raise ConfigError(f"{config.model_type}: the expert cache needs a model with routed experts")
    moe = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    names = list(art.family.tensor_shapes(config))
    reader = art.weights
    first = f"model.layers.{moe[0]}.mlp.experts."
    resident = experts = 0
    for name in names:
        held = _held_bytes(reader.info(name), dtype, keep_q4)
        if is_routed_expert(name):
            experts += held if name.startswith(first) else 0
        else:
            resident += held
    reserve = 0
    if mtp and art.mtp is not None:
        reserve = sum(_held_bytes(art.mtp.info(n), dtype, keep_q4) for n in art.mtp)
        kv = 2 * config.num_key_value_heads * config.head_dim * _dtype_bytes(dtype)
        reserve += lanes * context * kv * config.mtp_num_hidden_layers
    return plan_expert_cache(
        expert_bytes=experts // config.num_experts,
        moe_layers=len(moe),
        num_experts=config.num_experts,
        resident_bytes=resident,
        lane_bytes=lane_state_bytes(config, lanes=lanes, context=context, dtype=dtype),
        workspace_bytes=round_workspace_bytes(config, rows=rows, dtype=dtype),
        wide_round_bytes=max(
            0,
            round_workspace_bytes(config, rows=rows, dtype=dtype)
            - round_workspace_bytes(config, rows=min(rows, 8), dtype=dtype),
        ),
        mtp_reserve_bytes=reserve,
        budget_bytes=budget_bytes,
        card_bytes=int(art.profile.vram_bytes),
        card_name=str(art.profile.name),
        headroom_bytes=headroom_bytes,
    )


def cache_for_artifact(
    art: Any,
    setting: str | int | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    keep_q4: bool,
    lanes: int,
    context: int,
    rows: int,
    mtp: bool,
    stats: ExpertCacheStats | None = None,
    pin: str = "auto",
    lookahead: bool = False,
) -> ExpertCache | None:
    """The expert cache a served artifact runs with, or None (every expert resident); logs the split.

    Args:
        setting: "off" (every expert resident), None or "auto" (the card profile's default: a cache
            only on CUDA and only when the experts do not fit beside everything else), or a budget
            (bytes, or a size string for `parse_bytes`).
        pin: `--expert-cache-pin` (`ExpertCache`'s `pin`).
        lookahead: `--expert-cache-lookahead` (`ExpertCache`'s `lookahead`).
        the rest: as `plan_for_artifact`.

    Raises:
        ConfigError: a budget for a model without routed experts, a bad size, too small a budget, or
            `pin` "on" where the experts cannot be page-locked.
    """
    if setting == "off":
        return None
    auto = setting is None or setting == "auto"
    is_moe = bool(getattr(art.config, "is_moe", False) and getattr(art.config, "num_experts", 0))
    if auto and (device.type != "cuda" or not is_moe or not art.profile.vram_bytes):
        return None
    budget = None if auto else parse_bytes(setting)  # type: ignore[arg-type]
    plan = plan_for_artifact(
        art,
        dtype=dtype,
        keep_q4=keep_q4,
        lanes=lanes,
        context=context,
        rows=rows,
        mtp=mtp,
        budget_bytes=budget,
    )
    if auto and plan.slots_per_layer >= plan.num_experts:
        log.info(
            "expert cache off: every routed expert fits on the card beside the rest (%s)", plan.describe()
        )
        return None
    log.info("%s", plan.describe())
    if mtp and plan.mtp_reserve_bytes:
        log.info(
            "--spec-backend mtp: %s reserved from the expert cache for the MTP head",
            human_bytes(plan.mtp_reserve_bytes),
        )
    cache = ExpertCache(
        plan.slots_per_layer, device=device, stats=stats, budget=plan, pin=pin, lookahead=lookahead
    )
    # the host's memory checked for the stored expert bytes before any layer is registered
    names = art.family.tensor_shapes(art.config)
    cache.pin.expect(sum(int(art.weights.info(n).length) for n in names if is_routed_expert(n)))
    return cache


def prometheus_collector(stats: ExpertCacheStats) -> Any:
    """A `prometheus_client` collector of `stats.samples()` (for the server's registry)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.registry import Collector

    class _ExpertCacheCollector(Collector):
        def collect(self) -> Iterator[Any]:
            for name, kind, doc, value in stats.samples():
                if kind == "counter":
                    yield CounterMetricFamily(name.removesuffix("_total"), doc, value=value)
                else:
                    yield GaugeMetricFamily(name, doc, value=value)

    return _ExpertCacheCollector()


# ---------------------------------------------------------------------------------------------
# eviction policies, replayed on a routing trace
# ---------------------------------------------------------------------------------------------

POLICIES = ("lru", "lfu", "belady")


def simulate_policy(
    trace: Sequence[tuple[int, Sequence[int]]],
    slots: int,
    policy: str = "lru",
    *,
    warmup: int = 0,
    prefetch: Sequence[tuple[int, int, Sequence[int]]] = (),
) -> dict[str, int]:
    """Replay a routing trace (`ExpertCacheStats.trace`) through `slots` slots a layer under an
    eviction policy, with the cache's grouping (a lookup of more experts than slots is served in
    groups of `slots`, ascending; a group's members are never evicted for each other).

    Policies: "lru" (what `ExpertSlots` does: the same hits and misses on the same trace), "lfu"
    (evict the expert used least often so far, ties least recently used) and "belady" (evict the
    expert whose next use in the trace is farthest: the offline optimum, an upper bound on what any
    policy, router lookahead included, can reach).

    The first `warmup` trace entries (e.g. a prefill's) are replayed through the policy but not
    counted, so that a decode's hits are compared from the cache state the real run had.

    `prefetch` (`ExpertCacheStats.prefetch_trace`): router-lookahead prefetches, each (trace position
    it precedes, layer, predicted experts), applied as `ExpertSlots.prefetch` does (the predicted
    experts not resident, at most `slots`, put in, evicting by the policy others than them): a run
    with lookahead replays to its own hits and misses under "lru", and without `prefetch` the same
    routing gives what LRU alone would have got.

    Returns:
        {"hits": ..., "misses": ...} over trace[warmup:], and with `prefetch` "prefetches": the
        experts the prefetches put in.

    Raises:
        ValueError: an unknown policy or slots < 1.
    """
    if policy not in POLICIES or slots < 1:
        raise ValueError(f"policy must be one of {POLICIES} and slots >= 1, got {policy!r}, {slots}")
    # position of every use of (layer, expert), for belady's next-use lookups
    uses: dict[tuple[int, int], list[int]] = {}
    flat: list[tuple[int, list[list[int]]]] = []
    t = 0
    for layer, experts in trace:
        groups = [list(experts[i : i + slots]) for i in range(0, len(experts), slots)]
        flat.append((layer, groups))
        for group in groups:
            for e in group:
                uses.setdefault((layer, e), []).append(t)
            t += 1
    resident: dict[int, OrderedDict[int, None]] = {}
    counts: dict[tuple[int, int], int] = {}
    cursor: dict[tuple[int, int], int] = {}
    hits = misses = fetched = 0
    ahead: dict[int, list[tuple[int, Sequence[int]]]] = {}
    for pos, layer, experts in prefetch:
        ahead.setdefault(pos, []).append((layer, experts))

    def evict(cache: OrderedDict[int, None], layer: int, pinned: set[int]) -> None:
        candidates = [x for x in cache if x not in pinned]
        if policy == "lru":
            victim = candidates[0]
        elif policy == "lfu":  # the first minimum: least recently used on ties
            scores = [counts.get((layer, x), 0) for x in candidates]
            victim = candidates[scores.index(min(scores))]
        else:  # the first maximum of the next use
            later = [_next_use(uses, cursor, (layer, x)) for x in candidates]
            victim = candidates[later.index(max(later))]
        del cache[victim]

    for i, (layer, groups) in enumerate(flat):
        for p_layer, predicted in ahead.get(i, ()):
            cache = resident.setdefault(p_layer, OrderedDict())
            want = [e for e in predicted if e not in cache][:slots]
            for e in want:
                if len(cache) >= slots:
                    evict(cache, p_layer, set(want))
                cache[e] = None
            fetched += len(want) if i >= warmup else 0
        cache = resident.setdefault(layer, OrderedDict())
        counted = i >= warmup
        for group in groups:
            pinned = set(group)
            for e in group:
                key = (layer, e)
                cursor[key] = cursor.get(key, 0) + 1  # uses of key consumed so far (this one included)
                counts[key] = counts.get(key, 0) + 1
                if e in cache:
                    hits += counted
                    cache.move_to_end(e)
                    continue
                misses += counted
                if len(cache) >= slots:
                    evict(cache, layer, pinned)
                cache[e] = None
    out = {"hits": hits, "misses": misses}
    if prefetch:
        out["prefetches"] = fetched
    return out


def _next_use(
    uses: Mapping[tuple[int, int], list[int]], cursor: Mapping[tuple[int, int], int], key: tuple[int, int]
) -> float:
    """The trace position of `key`'s next use after those consumed (`cursor`), or inf."""
    times = uses[key]
    i = cursor.get(key, 0)
    return times[i] if i < len(times) else math.inf
