"""Static rounds of a MoE hybrid with an expert cache, CUDA-graphed in pieces between the MoE syncs.

With an expert cache a verify round must come back to the host once a MoE layer: the layer's routing
decides which experts are copied into which slots. A round cannot then be one CUDA graph, and run
eagerly it pays the launch and bookkeeping cost of every op of every layer. `PiecewiseMoe` splits a
static round (`ignis.runtime.families.hybrid_graphs.StaticHybridExecutor._body`) at its MoE layers:

    piece 0:  embedding, layer 0's norms and mixer (GDN / attention), the MoE layer's gated shared
              expert, then its router, top-k and renormalized weights; x, the routing weights and
              the routed ids copied into fixed buffers (the ids last: nothing after them delays
              their copy to the host)
    host:     the ids to the host (one sync), the experts looked up / copied into slots (misses as
              one batched copy), the slot-id table uploaded, the two grouped expert launches into the
              fixed output buffer y [R, k, H] float32
    piece i:  layer i-1's MoE output (y summed over k + the shared expert) added to the residual
              stream, then layer i as in piece 0
    last:     the last MoE output added, the final norm, the head, the round's outputs

Each piece is one CUDA graph per round shape (lanes, columns, KV bucket, outputs wanted), captured
from one pass of the body (`capture`): a capture ends where the body reaches a MoE layer and the next
begins at once, so a round is 1 + (MoE layers) graphs replayed in order with the host work between
them (`replay`). The pieces of every shape share the executor's graph pool: tensors that cross from
one piece into the next (the residual stream, the shared expert's output, RoPE tables, the mask) lie
in the pool, which is safe because a round's pieces always replay in capture order with nothing
else replayed in between (torch's rule for graphs sharing a pool); what the host part reads and
writes lies in fixed buffers (`MoeRoundBuffers`) outside the pool.

vLLM's piecewise CUDA graphs split a model around attention the same way (there the piece between
graphs is attention with its variable shapes; here it is the expert lookup).

Off CUDA, and on CUDA without graphs, the same split runs eagerly (`PiecewiseMoe.split`): the CPU
tests prove the pieces' maths against the fused block (`grouped_moe_block`) that way. Values equal
the eager cached round's bit for bit: the same ops on the same inputs; only the shared expert runs
before the routed ones instead of after them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ignis.runtime.families.moe import SparseMoeWeights, route_top_k, shared_expert_output
from ignis.runtime.families.moe_grouped import combine_moe_output, run_cached_experts

__all__ = ["MoeRoundBuffers", "PiecewiseMoe", "PiecewiseRound", "piecewise_layers"]

MoeFn = Callable[[torch.Tensor, SparseMoeWeights], torch.Tensor]


def piecewise_layers(mlps: list[Any]) -> bool:
    """Whether a model's MLPs (`_Layer.mlp` of every layer) run as pieces: at least one MoE layer and
    every MoE layer on the grouped block with an expert cache (`GroupedExperts.slots` set)."""
    moe = [m for m in mlps if isinstance(m, SparseMoeWeights)]
    return bool(moe) and all(m.grouped is not None and m.grouped.slots is not None for m in moe)


class MoeRoundBuffers:
    """The fixed buffers between a piece and its host part, for rounds of up to `rows` rows: x [rows,
    H] (model dtype), the routing weights [rows, k] float32, the routed ids [rows, k] int64 and the
    expert outputs y [rows, k, H] float32, on `device`."""

    def __init__(
        self,
        rows: int,
        hidden: int,
        top_k: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        lookahead: bool = False,
    ):
        self.rows = rows
        self.top_k = top_k
        self.x = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.weights = torch.zeros(rows, top_k, dtype=torch.float32, device=device)
        #: [rows, k] routed ids; with lookahead [rows, 2 k]: then the next MoE layer's predicted ids
        self.ids = torch.zeros(rows, 2 * top_k if lookahead else top_k, dtype=torch.int64, device=device)
        self.y = torch.zeros(rows, top_k, hidden, dtype=torch.float32, device=device)


@dataclass
class PiecewiseRound:
    """One round shape captured in pieces: graphs[i] runs up to the i-th MoE layer's routing
    (`layers[i]`), the last graph to the outputs; `outputs` as the body returned them."""

    graphs: list[Any]
    layers: list[SparseMoeWeights]
    rows: int
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


class PiecewiseMoe:
    """The MoE layers of a static round split into device pieces and host parts (module docstring).

    Router lookahead (`next_layer` given, buffers built with ``lookahead``): a MoE layer's device
    part also runs the next MoE layer's router on this layer's input x (the residual stream changes
    little from one layer to the next) and its top-k ids come to the host with this layer's; once
    this layer's experts are issued, the next layer's slots prefetch the predicted experts
    (`ExpertSlots.prefetch`) on the copy stream, overlapping this layer's experts and the next
    piece. Values do not change (a slot's bytes are its expert's whoever copied them).

    Args:
        top_k, norm_topk_prob: the config's routing.
        linear: the executor's linear hook (router, shared expert; the torch path of the experts).
        buffers: fixed buffers for the largest round.
        stats: the expert cache's counters (a warm-up run before a capture is not counted), or None.
        next_layer: {id(a MoE layer's weights): the next MoE layer's weights} for router lookahead;
            None: no lookahead.
    """

    def __init__(
        self,
        *,
        top_k: int,
        norm_topk_prob: bool,
        linear: Any,
        buffers: MoeRoundBuffers,
        stats: Any = None,
        next_layer: dict[int, SparseMoeWeights] | None = None,
    ) -> None:
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.linear = linear
        self.buffers = buffers
        self.stats = stats
        if next_layer is not None and buffers.ids.shape[1] != 2 * top_k:
            raise ValueError("router lookahead needs MoeRoundBuffers built with lookahead=True")
        self.next_layer = next_layer

    # ---- the pieces ----
    def route(self, x: torch.Tensor, w: SparseMoeWeights) -> torch.Tensor:
        """Device part before the sync: the routing of x [R, H] written into the fixed buffers (x, the
        float32 weights, the ids); returns the gated shared expert's output [R, H] (x's dtype).

        The shared expert runs first, the routing last: the piece ends with the ids written, so the
        ids' copy to the host (queued after the piece) waits for nothing else of the layer. (Its
        value does not depend on the order: the same ops on the same x.)"""
        rows = x.shape[0]
        b = self.buffers
        shared = shared_expert_output(x, w, linear=self.linear)
        top_w, top_i = route_top_k(
            x, w.router, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob, linear=self.linear
        )
        k = self.top_k
        b.x[:rows].copy_(x)
        b.weights[:rows].copy_(top_w.float())
        b.ids[:rows, :k].copy_(top_i)
        nxt = self.next_layer.get(id(w)) if self.next_layer is not None else None
        if nxt is not None:  # lookahead: the next MoE layer's router on this layer's input
            _, next_i = route_top_k(
                x, nxt.router, top_k=k, norm_topk_prob=self.norm_topk_prob, linear=self.linear
            )
            b.ids[:rows, k:].copy_(next_i)
        return shared

    def experts(self, w: SparseMoeWeights, rows: int) -> None:
        """Host part: the routed ids to the host (the sync), the experts made resident and run into
        the fixed y [rows, k, H]; with lookahead, the next MoE layer's predicted experts prefetched
        into its slots once this layer's copies are issued, before its expert kernels are launched
        (`run_cached_experts`' `issued`). Marks the cache's host breakdown when one is attached
        (`ignis.runtime.host_breakdown`)."""
        b = self.buffers
        g = w.grouped
        k = self.top_k
        host = g.slots.routing.to_host(b.ids[:rows])  # (marks the breakdown's layer and piece)
        nxt = self.next_layer.get(id(w)) if self.next_layer is not None else None
        issued = None
        if nxt is not None:  # the prefetch queued behind this layer's copies, before its kernels

            def issued() -> None:
                nxt.grouped.slots.prefetch(np.unique(host[:, k:]).tolist())

        run_cached_experts(
            b.x[:rows], host[:, :k], b.weights[:rows], g, b.y[:rows], self.linear, issued=issued
        )

    def combine(self, shared: torch.Tensor) -> torch.Tensor:
        """Device part after the experts: y summed over k (cast to x's dtype) plus the shared
        expert's output."""
        b = self.buffers
        return combine_moe_output(b.y[: shared.shape[0]], shared, b.x.dtype)

    def split(self, x: torch.Tensor, w: SparseMoeWeights) -> torch.Tensor:
        """The MoE block (`grouped_moe_block`'s value) run as route -> experts -> combine, eagerly."""
        shared = self.route(x, w)
        self.experts(w, x.shape[0])
        return self.combine(shared)

    # ---- graphs ----
    def capture(
        self,
        body: Callable[[MoeFn], dict[str, torch.Tensor]],
        *,
        rows: int,
        device: torch.device,
        pool: Any,
        stream: Any,
    ) -> PiecewiseRound:
        """Capture `body` (a static round taking the MoE callback) in pieces on `stream`, drawing from
        `pool`. The pieces first run once eagerly on `stream` (warm-up: every module they launch
        loaded once, outside a capture) without the host parts: no expert lookups or copies, so the
        cache's state and counters are as before (the grouped expert kernels are never captured).

        Raises:
            ValueError: rows beyond the fixed buffers.
        """
        if rows > self.buffers.rows:
            raise ValueError(f"a round of {rows} rows: the MoE buffers hold {self.buffers.rows}")
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with self.quiet(), _on_stream(stream):
            body(lambda x, w: self.combine(self.route(x, w)))  # the pieces only (y as it is)
        current.wait_stream(stream)
        graphs: list[Any] = []
        layers: list[SparseMoeWeights] = []
        graph = torch.cuda.CUDAGraph()

        def cut(x: torch.Tensor, w: SparseMoeWeights) -> torch.Tensor:
            nonlocal graph
            shared = self.route(x, w)
            graph.capture_end()
            graphs.append(graph)
            layers.append(w)
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            return self.combine(shared)

        with _on_stream(stream):
            graph.capture_begin(pool=pool)
            try:
                outputs = body(cut)
            except BaseException:
                with contextlib.suppress(RuntimeError):
                    graph.capture_end()
                raise
            graph.capture_end()
            graphs.append(graph)
        current.wait_stream(stream)
        return PiecewiseRound(graphs, layers, rows, outputs)

    def replay(self, entry: PiecewiseRound) -> dict[str, torch.Tensor]:
        """Replay a captured round: each piece, then its MoE layer's host part; the last piece.
        Returns the round's outputs (overwritten by the next replay)."""
        timer = getattr(self.stats, "breakdown", None)  # the cache's host breakdown, when attached
        if timer is not None:
            timer.lap("engine")
        for graph, w in zip(entry.graphs, entry.layers, strict=False):
            graph.replay()
            self.experts(w, entry.rows)
        entry.graphs[-1].replay()
        if timer is not None:
            timer.lap("piece")
        return entry.outputs

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Run a warm-up without counting it: the cache's counters (and routing trace) are put back
        after it (the slots' contents and LRU order stay as it left them: always valid)."""
        st = self.stats
        if st is None:
            yield
            return
        keys = ("hits", "misses", "bytes_copied", "forwards", "rows", "direct_copies", "staged_copies",
                "prefetches", "lookahead_right", "lookahead_needed")  # fmt: skip
        saved = {k: getattr(st, k) for k in keys}
        trace = len(st.trace) if st.trace is not None else None
        fetched = len(st.prefetch_trace)
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(st, k, v)
            if trace is not None and st.trace is not None:
                del st.trace[trace:]
            del st.prefetch_trace[fetched:]
            for w in (self.next_layer or {}).values():  # a warm-up's predictions are not scored
                w.grouped.slots._predicted = None


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    """torch's (and tvm-ffi's, when installed: compiled modules launch there) current stream set to
    `stream`."""
    ctx = torch.cuda.stream(stream)
    try:
        import tvm_ffi
    except ImportError:
        with ctx:
            yield
        return
    with tvm_ffi.use_torch_stream(ctx):
        yield
