"""Machinery the static executors share: pooled lane slots, KV length buckets, CUDA graph capture of a
static round, the chunk loop of chunked prefill and the one host copy of a forward's columns.

Used by `ignis.runtime.families.hybrid_graphs.StaticHybridExecutor` (qwen3_5 / qwen3_next / ...) and
`ignis.runtime.families.llama_graphs.StaticLlamaExecutor` (llama / qwen2). What is family-specific
(the pools' tensors, the round's body, what commit keeps) stays in those modules.

CUDA graphs follow the torch.cuda.graphs recipe: the body runs once on a side stream before the capture
(which also runs every compiled module once: they are capture-safe after a first run, ADR 0001), then
it is captured into a `torch.cuda.CUDAGraph` whose memory comes from one pool the executor's graphs
share (they never run concurrently). Compiled q4 modules launch on torch's stream during the capture
(`ignis.runtime.kernels.tvm_runtime.capture`).
"""

from __future__ import annotations

import inspect
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = [
    "CapturedRound",
    "PooledLaneState",
    "capture_round",
    "host_columns",
    "kv_bucket",
    "run_chunks",
    "warm_up_static",
]


log = logging.getLogger("ignis.runtime.static_rounds")


class _SlotOwner(Protocol):
    def _lane_gone(self, slot: int, lane_id: int) -> None: ...


class PooledLaneState:
    """One lane of a static executor: a slot in the executor's pooled buffers plus the committed length.

    The slot goes back to the executor (``owner._lane_gone(slot, id(lane))``) once: on
    ``owner.release_lane(lane)`` or when the lane object is garbage-collected.

    Attributes:
        _pending: the executor's record of the uncommitted forward (None when there is none).
    """

    def __init__(self, owner: _SlotOwner, slot: int) -> None:
        self._owner = owner
        self._slot = slot
        self._num_tokens = 0
        self._pending: Any = None
        self._released = False
        self._finalizer = weakref.finalize(self, owner._lane_gone, slot, id(self))

    @property
    def num_tokens(self) -> int:
        """Committed tokens whose effect the state holds."""
        return self._num_tokens

    @property
    def slot(self) -> int:
        """The lane slot this lane occupies in the pooled buffers."""
        return self._slot

    @property
    def is_pending(self) -> bool:
        """True between a forward and its commit."""
        return self._pending is not None


@dataclass
class CapturedRound:
    """A static round captured as a CUDA graph: replay it, then read `outputs` (the tensors the body
    returned during the capture; overwritten by every replay)."""

    graph: Any  # torch.cuda.CUDAGraph
    outputs: dict[str, torch.Tensor]


def kv_bucket(needed: int, smallest: int, capacity: int) -> int:
    """The KV length a static round reads: the smallest ``smallest * 2**i`` >= needed, at most capacity."""
    t = smallest
    while t < needed:
        t *= 2
    return min(t, capacity)


def capture_round(
    body: Callable[[], dict[str, torch.Tensor]],
    *,
    device: torch.device,
    pool: Any,
    stream: torch.cuda.Stream | None = None,
) -> CapturedRound:
    """Run `body` once on a side stream (warm-up), then capture it into a CUDA graph drawing from
    `pool` (a ``torch.cuda.graph_pool_handle()``). `body` must be capture-safe: no host syncs, no
    host->device copies, fixed input and state addresses.

    `stream`: the side stream (None: a new one from torch's pool). An executor capturing many shapes
    passes one of its own: the caching allocator keeps freed blocks per stream, so the warm-up runs of
    many captures on torch's round-robin streams would each keep a round's intermediates cached."""
    from ignis.runtime.kernels.tvm_runtime import capture

    side = torch.cuda.Stream(device=device) if stream is None else stream
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body()  # warm-up: loads every module and kernel once, outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with capture(graph, pool=pool):
        outputs = body()
    return CapturedRound(graph, outputs)


def host_columns(columns: list[torch.Tensor]) -> list[torch.Tensor]:
    """The columns' values on the host, for a forward's token-id checks, with at most one device->host
    copy (instead of one sync per lane, or two for a min and a max on the device):

    * columns that carry their host values (`ignis.runtime.round_batch.HostKnownColumns`: the engine's
      round built from host ids): those values as int64 CPU tensors, with no copy and no sync;
    * integer 1-D tensors on one device and dtype, several of them or one off the CPU: one copy of
      their concatenation, split per lane;
    * columns in range by construction (`ignis.runtime.round_batch.InRangeColumns`): unchanged, with
      no copy (the caller skips their range check);
    * otherwise the list unchanged (the caller's checks reject what is malformed).
    """
    if getattr(columns, "in_range", False):
        return columns
    host = getattr(columns, "host", None)
    if host is not None:
        return [torch.tensor(ids, dtype=torch.int64) for ids in host]
    if (
        columns
        and all(isinstance(c, torch.Tensor) and c.dim() == 1 and not c.is_floating_point() for c in columns)
        and len({(c.device, c.dtype) for c in columns}) == 1
        and (len(columns) > 1 or columns[0].device.type != "cpu")
    ):
        return list(torch.cat(columns).cpu().split([c.numel() for c in columns]))
    return columns


def run_chunks(
    executor: Any,
    states: Sequence[Any],
    columns: Sequence[torch.Tensor],
    lens: Sequence[int],
    chunk: int,
    *,
    logits: str,
    want_hidden: bool,
    taps: tuple[int, ...],
) -> dict[str, list[list[torch.Tensor]]]:
    """Feed every lane's columns as consecutive forwards of at most `chunk` columns (a forward holds
    the lanes that still have columns), each committed whole through ``executor.forward`` /
    ``executor.commit`` (``record=False``). The caller saves and restores whatever the lanes need
    around it (an exception propagates with the chunks so far committed).

    Returns:
        {"l": logits, "h": hidden states, "t": taps}: per lane, the chunks' outputs in order.
    """
    parts: dict[str, list[list[torch.Tensor]]] = {k: [[] for _ in states] for k in ("l", "h", "t")}
    for start in range(0, max(lens), chunk):
        idx = [i for i, n_i in enumerate(lens) if n_i > start]
        sub = [states[i] for i in idx]
        cols = [columns[i][start : start + chunk] for i in idx]
        out = executor.forward(
            sub, cols, logits=logits, record=False, output_hidden_states=want_hidden, tap_layers=taps
        )
        executor.commit(sub, [int(c.numel()) for c in cols])
        for j, i in enumerate(idx):
            parts["l"][i].append(out.logits[j])
            if out.hidden_states is not None:
                parts["h"][i].append(out.hidden_states[j])
            if out.taps is not None:
                parts["t"][i].append(out.taps[j])
    return parts


def warm_up_static(
    *executors: Any,
    columns: Sequence[int] = (),
    context: int | None = None,
    hidden: bool = False,
    taps: Sequence[int] = (),
) -> int:
    """Load-time capture: call ``warm_up(columns=columns, ...)`` on every executor that has one (the
    static executors with CUDA graphs capture their round shapes then, so that no request pays for a
    capture); None and executors without it are skipped.

    Args:
        columns: the verify width, draft_tokens + 1, when speculating.
        context, hidden, taps: passed on to the ``warm_up`` methods that take them (the hybrid's:
            the KV length up to which buckets are captured, and the output set the engine's
            forwards ask for); None / False / () are not passed.

    Returns:
        the graphs captured in all; each executor's count is logged with the time taken.
    """
    total = 0
    extra: dict[str, Any] = {}
    if context is not None:
        extra["context"] = context
    if hidden:
        extra["hidden"] = True
    if taps:
        extra["taps"] = tuple(taps)
    for ex in executors:
        warm = getattr(ex, "warm_up", None)
        if ex is None or not callable(warm):
            continue
        params = inspect.signature(warm).parameters
        t0 = time.perf_counter()
        n = int(warm(columns=tuple(columns), **{k: v for k, v in extra.items() if k in params}))
        total += n
        if n:
            log.info(
                "%s: %d round shapes captured at load in %.2f s",
                type(ex).__name__,
                n,
                time.perf_counter() - t0,
            )
    return total
