"""Where the host time of a cached MoE round goes: a lap timer over the expert cache's host path.

A verify round with an expert cache (`ignis.runtime.expert_cache`, split into pieces by
`ignis.runtime.families.moe_piecewise`) comes back to the host once a MoE layer. `HostBreakdown`
splits the engine thread's wall time of a round into named sections, each the time from the
previous mark to the next (`lap`), so the sections of a round add up to its wall time with no gap:

    engine      everything between the round's start and its first MoE piece, and after its last
                host part up to the round's end (the engine's scheduling, sampling, the final
                outputs' device-to-host copy and its wait, the last piece's replay)
    piece       a piece's CUDA graph replay (graphed rounds) or the eager layer's launches and
                compute (the CPU, `cuda_graphs=False`, prefill chunks): from the previous MoE host
                part to this one (a layer's host part starts at its routed ids' copy)
    ids_copy    the routed ids' non-blocking device-to-host copy and its event record
    ids_wait    the host's wait for those ids (the layer's one sync)
    lookup      `np.unique` of the ids, the LRU lookups and bookkeeping of `ExpertSlots`
    miss_gather the batched misses' address arrays gathered (`PartTable.gather_into`)
    miss_deps   the copy stream's waits for the last-use events of the slots taken
    miss_issue  the batched copy call (``cuMemcpyBatchAsync`` / ``memmove`` on the CPU)
    miss_event  the event after the batch recorded
    miss_torch  misses copied one torch copy each (layout conversions, staging ring, CPU copy_)
    copy_wait   the compute stream's wait for the group's copies
    table       the group's slot-id table built on the host and uploaded
    launch      the grouped expert kernels' launches (or the torch path's expert linears)
    last_use    the event marking the group's slots used, recorded on the compute stream
    prefetch    router lookahead's prefetch of the next layer's predicted experts

Each mark is one ``time.perf_counter_ns()`` call and a dict update (~0.2 us); the hooks cost one
attribute test when no timer is attached (the default: `ExpertCache.set_breakdown`). Wall time, not
CPU time: a CUDA call that spin-waits shows as the section it waits in.

Only rounds between `begin_round` and `end_round` are counted (the benchmark leaves out the rounds
that capture CUDA graphs); marks outside a round are dropped.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["SECTIONS", "HostBreakdown"]

#: The sections in the order a layer's host part meets them (module docstring).
SECTIONS = (
    "engine", "piece", "ids_copy", "ids_wait", "lookup", "miss_gather", "miss_deps", "miss_issue",
    "miss_event", "miss_torch", "copy_wait", "table", "launch", "last_use", "prefetch",
)  # fmt: skip


class HostBreakdown:
    """Lap timer of the cached round's host path (module docstring). Not thread-safe: the engine
    thread marks it."""

    def __init__(self) -> None:
        self.totals_ns: dict[str, int] = dict.fromkeys(SECTIONS, 0)
        self.counts: dict[str, int] = dict.fromkeys(SECTIONS, 0)
        #: rounds counted, and MoE layer host parts run in them
        self.rounds = 0
        self.layers = 0
        self.wall_ns = 0
        self._t: int | None = None
        self._start = 0
        self._ns: dict[str, int] = {}  # the open round's sections
        self._n: dict[str, int] = {}
        self._layers = 0

    def begin_round(self) -> None:
        """Start a counted round now (a round left open is dropped)."""
        self._ns, self._n, self._layers = {}, {}, 0
        self._t = self._start = time.perf_counter_ns()

    def end_round(self) -> None:
        """End the open round and count it: the time since the last mark goes to "engine"."""
        if self._t is None:
            return
        self.lap("engine")
        for k, v in self._ns.items():
            self.totals_ns[k] = self.totals_ns.get(k, 0) + v
            self.counts[k] = self.counts.get(k, 0) + self._n[k]
        self.wall_ns += self._t - self._start
        self.layers += self._layers
        self.rounds += 1
        self._t = None

    def drop_round(self) -> None:
        """Forget the open round without counting it (e.g. one that captured CUDA graphs)."""
        self._t = None

    def lap(self, section: str) -> None:
        """The time since the previous mark goes to `section` (one more call of it counted); a no-op
        outside a round."""
        t0 = self._t
        if t0 is None:
            return
        now = time.perf_counter_ns()
        ns = self._ns
        ns[section] = ns.get(section, 0) + now - t0
        self._n[section] = self._n.get(section, 0) + 1
        self._t = now

    def layer(self) -> None:
        """Count one MoE layer's host part (the per-layer means divide by these)."""
        if self._t is not None:
            self._layers += 1

    def reset(self) -> None:
        """Forget every counted round."""
        self.__init__()  # type: ignore[misc]

    def report(self) -> dict[str, Any]:
        """The breakdown so far: {"rounds", "moe_layers_per_round", "round_ms" (mean wall),
        "ms_per_round": {section: mean ms a round}, "us_per_layer": {section: mean us per MoE layer
        host part}, "calls_per_round": {section: mean marks a round}}; sections never marked are left
        out. Empty dict before a counted round."""
        if not self.rounds:
            return {}
        r, n = self.rounds, max(self.layers, 1)
        seen = [s for s in self.totals_ns if self.counts.get(s)]
        return {
            "rounds": r,
            "moe_layers_per_round": round(self.layers / r, 2),
            "round_ms": round(self.wall_ns / r / 1e6, 3),
            "ms_per_round": {s: round(self.totals_ns[s] / r / 1e6, 3) for s in seen},
            "us_per_layer": {s: round(self.totals_ns[s] / n / 1e3, 1) for s in seen if s != "engine"},
            "calls_per_round": {s: round(self.counts[s] / r, 2) for s in seen},
        }

    @staticmethod
    def format(report: dict[str, Any]) -> str:
        """A report as text lines: section, ms a round, us a MoE layer, share of the round."""
        if not report:
            return "(no rounds counted)"
        wall = report["round_ms"] or 1.0
        lines = [
            f"host breakdown: {report['rounds']} rounds, {report['moe_layers_per_round']} MoE layers a "
            f"round, {report['round_ms']:.2f} ms a round",
            f"{'section':<12} {'ms/round':>9} {'us/layer':>9} {'share':>6}",
        ]
        for s, ms in report["ms_per_round"].items():
            us = report["us_per_layer"].get(s)
            lines.append(f"{s:<12} {ms:>9.3f} {'' if us is None else f'{us:.1f}':>9} {ms / wall:>6.1%}")
        return "\n".join(lines)
