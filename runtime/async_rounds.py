"""Async rounds: the next verify round is issued from the device's argmax before the host reads the last.

With speculation off, one step of `ignis.runtime.engine.SpeculativeEngine` is: forward, argmax, a
device->host copy of the tokens (a host sync), then the host's work: acceptance, stop checks, the
commit, the next round's columns and its launch. The device idles during that host work. Here (the
engine's `async_rounds=True`) round N+1 is launched with columns = the device argmax of round N, before
the host has read round N's tokens, and the host reads and checks round N while round N+1 runs
(vLLM's async scheduling, SGLang's overlap scheduler). ADR 0015.

**Scope** (`AsyncRounds.takes_round`): no drafter, every active lane greedy with no logits processing
(no penalties or min_tokens, no logprobs, no grammar). Anything else, and any step with prefill work
(a lane joining or being prefilled), first *drains* the round in flight (`drain`): the engine is then
in its ordinary state and runs its ordinary step. Nothing is wrong outside the scope, only not
overlapped.

**A step with round N in flight** (forward N issued and not committed; its argmax computed on the
device and copied to page-locked host memory, an event recorded):

a. commit N: keep 1 for every lane still running, keep 0 for the lanes found finished (or aborted)
   after round N-1 (their column at N was their last token, which the ordinary path never feeds);
   those lanes' reply checkpoints are recorded now (the state is exactly their committed tokens) and
   their states released;
b. forward N+1 for the running lanes, columns = the argmax of N gathered on the device
   (`ignis.runtime.round_batch.InRangeColumns`: in range by construction, so the executor's token-id
   check reads nothing from the device). A lane whose N-th token is its last by length (max_tokens or
   the context end, known on the host before the token) is left out, as the ordinary path leaves it;
c. argmax of N+1 on the device, its copy to page-locked memory, an event;
d. wait for N's event and read N's tokens (the round's only host sync, after N+1 is launched);
e. stop checks (EOS, max_tokens, stop strings) and emission; a lane finished at N is reported finished
   now, with the `LaneUpdate`/`LaneResult` the ordinary path gives; its column in N+1 is committed with
   keep 0 at the next step (or at once when every lane of N+1 is finished), and only then its state is
   released. The protocol's "commit before the next forward" holds: (a) comes before (b).

Tokens equal the ordinary engine's: each lane's N+1 column is its N-th argmax, exactly the token the
ordinary path feeds. What differs is when a lane leaves the batch: a lane stopped by EOS or a stop
string rides one more forward (committed with keep 0), so the other lanes' round holds one more lane
than in the ordinary path: the same math over a differently padded batch (float rounding, on families
whose batched math is not per-lane exact). Updates come one step later than in the ordinary path; the
results are the same.

On the CPU every "device" op runs in the host's own thread, so there is no overlap to gain there; the
point is the GPU (docs/perf/log/2026-12-01-session-15-async-rounds.md).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ignis.runtime.round_batch import InRangeColumns, RoundColumns, device_ids, shared_row_span

if TYPE_CHECKING:
    from ignis.runtime.engine import SpeculativeEngine, _Lane

__all__ = ["AsyncRounds", "make_async_rounds"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _InFlight:
    """One issued, uncommitted round: its lanes in forward order, their states, the device argmax
    (int64 [lanes]), its page-locked host copy and the event after the copy (None on the CPU)."""

    lanes: list[_Lane]
    states: list[Any]
    argmax: torch.Tensor
    host: torch.Tensor
    event: Any
    dead: set[int] = field(default_factory=set)  # id(lane): finished or aborted before this round's token
    aborted: set[int] = field(default_factory=set)  # id(lane): aborted (no reply checkpoint)

    def is_live(self, lane: _Lane) -> bool:
        return id(lane) not in self.dead

    def read(self) -> list[int]:
        """The round's tokens on the host (waits for the copy: the host sync)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()  # type: ignore[no-any-return]


def lane_argmax(logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """The argmax of each lane's last row, int64 [lanes] on the logits' device, with no host sync.

    `logits`: per lane float [n_i, vocab]. When the last rows are rows of one row-major buffer at a
    fixed, increasing row step (the static executors' round buffer; `round_batch.shared_row_span`) it
    is one argmax over the rows they span, sliced; otherwise one argmax per lane, concatenated."""
    last = [t[-1:] for t in logits]
    span = shared_row_span(last) if len(last) > 1 else None
    if span is not None:
        view, starts = span
        step = starts[1] - starts[0]
        if step > 0 and all(b - a == step for a, b in itertools.pairwise(starts)):
            return view.argmax(dim=-1)[::step].to(torch.int64)  # starts[0] == 0: the lowest row
    return torch.cat([t.argmax(dim=-1) for t in last]).to(torch.int64)


def make_async_rounds(engine: SpeculativeEngine, requested: bool) -> AsyncRounds | None:
    """The engine's `AsyncRounds` when asked for and possible (no drafter: speculation's drafts depend on
    the host's acceptance of the previous round); None otherwise, with a warning when asked for."""
    if not requested:
        return None
    if engine.drafter is not None:
        log.warning(
            "async rounds are off: they run with speculation off only (drafter %r)", engine.drafter.name
        )
        return None
    log.info("async rounds on: decode rounds issued from the previous round's device argmax (ADR 0015)")
    return AsyncRounds(engine)


class AsyncRounds:
    """The engine's round in flight (module docstring). Made by the engine with `async_rounds=True`.

    Attributes:
        num_issued: rounds issued ahead of the host's read (a lane's tokens overlap the next round).
        num_drained: rounds in flight settled by a step that needed the ordinary path (prefill work, a
            lane outside the scope), which then ran the ordinary round.
    """

    def __init__(self, engine: SpeculativeEngine) -> None:
        self._engine = engine
        self._flight: _InFlight | None = None
        self.num_issued = 0
        self.num_drained = 0

    @property
    def is_busy(self) -> bool:
        """True while a round is in flight (the engine must be stepped until it is settled)."""
        return self._flight is not None

    def holds(self, lane: _Lane) -> bool:
        """Whether the lane has a column in the round in flight (its state is released later)."""
        f = self._flight
        return f is not None and any(x is lane for x in f.lanes)

    # ---- scope ----

    def takes_round(self) -> bool:
        """Whether this step's round over the engine's active lanes runs async (module docstring)."""
        eng = self._engine
        if eng.drafter is not None or not eng._active:
            return False
        for lane in eng._active:
            p = lane.params
            if not p.is_greedy or p.processes_logits or p.logprobs is not None or lane.grammar is not None:
                return False
        return True

    def _needs_ordinary_step(self) -> bool:
        eng = self._engine
        if eng._prefilling:
            return True
        if eng._waiting:
            busy = len(eng._active) + len(eng._prefilling)
            if eng.scheduler.num_to_admit(busy, len(eng._waiting)) > 0:
                return True
        return not self.takes_round()

    # ---- hooks ----

    def before_step(self, emitted: dict[int, list[int]]) -> list[_Lane]:
        """At a step's start: drain the round in flight when this step has prefill work or a lane out of
        the scope. Returns the lanes the drain finished (for the engine's step to finish)."""
        if self._flight is None or not self._needs_ordinary_step():
            return []
        return self.drain(emitted)

    def drain(self, emitted: dict[int, list[int]]) -> list[_Lane]:
        """Settle the round in flight as the ordinary path would: read its tokens, commit it (keep 1 for
        running lanes, 0 for finished ones), stop-check and emit. Returns the lanes finished by its
        tokens (their reply checkpoints recorded; the engine's step releases them)."""
        f = self._flight
        if f is None:
            return []
        self._flight = None
        self.num_drained += 1
        tokens = f.read()
        self._commit(f)
        live = [(i, lane) for i, lane in enumerate(f.lanes) if f.is_live(lane)]
        finished = self._emit([(lane, tokens[i]) for i, lane in live], emitted)
        if finished and self._engine.checkpoints.records_replies:
            self._engine.checkpoints.record_replies(finished)
        return finished

    def round(self, emitted: dict[int, list[int]]) -> list[_Lane]:
        """One async round over the engine's active lanes (module docstring, a-e). Returns the lanes
        finished this step; those still holding a column in the new round in flight must not be
        released by the caller (`holds`)."""
        eng = self._engine
        prev = self._flight
        if prev is None:  # start: the columns are the host anchors; nothing to read this step
            lanes = list(eng._active)
            columns = self._host_anchor_columns(lanes)
            self._flight = self._issue(lanes, columns)
            return []
        # (a) commit N; lanes finished after N-1 leave for good
        self._commit(prev)
        # (b) forward N+1 from N's argmax, for the running lanes with tokens left after N's
        live = [(i, lane) for i, lane in enumerate(prev.lanes) if prev.is_live(lane)]
        nxt = [(i, lane) for i, lane in live if _has_tokens_after_next(lane)]
        flight = None
        if nxt:
            idx = [i for i, _ in nxt]
            ids = prev.argmax if len(idx) == len(prev.lanes) else prev.argmax[device_ids(idx, eng.device)]
            cols = [ids] if len(idx) == 1 else list(ids.split(1))
            flight = self._issue([lane for _, lane in nxt], InRangeColumns(cols))  # (c) inside
        self._flight = flight
        # (d) read N, (e) emit and stop-check
        tokens = prev.read()
        finished = self._emit([(lane, tokens[i]) for i, lane in live], emitted)
        if flight is not None:
            for lane in finished:
                if self.holds(lane):
                    flight.dead.add(id(lane))
        settled = [lane for lane in finished if not self.holds(lane)]
        if settled and eng.checkpoints.records_replies:
            eng.checkpoints.record_replies(settled)
        if flight is not None and len(flight.dead) == len(flight.lanes):
            self._settle(flight)  # every lane of N+1 finished: nothing would ever commit it
        return finished

    def lane_aborted(self, lane: _Lane) -> None:
        """`SpeculativeEngine.abort` of a lane holding a column in the round in flight (its result is
        made; its state stays until the column is committed with keep 0)."""
        f = self._flight
        assert f is not None and self.holds(lane)
        f.dead.add(id(lane))
        f.aborted.add(id(lane))
        if len(f.dead) == len(f.lanes):
            self._settle(f)

    # ---- internals ----

    def _host_anchor_columns(self, lanes: list[_Lane]) -> list[torch.Tensor]:
        """The lanes' anchors as one column each, laid out as the ordinary round lays out a round with
        no drafts (`RoundColumns.build`: one copy, their host values carried)."""
        eng = self._engine
        return RoundColumns.build(
            [lane.output[-1] for lane in lanes],
            [eng._no_drafts] * len(lanes),
            eng.device,
            eng.vocab_size,
            lane_ids=[lane.lane_id for lane in lanes],
            drafter_name="none",
        ).columns

    def _issue(self, lanes: list[_Lane], columns: list[torch.Tensor]) -> _InFlight:
        """Forward one column per lane, argmax on the device, its async copy to the host (b, c)."""
        eng = self._engine
        states = [lane.state for lane in lanes]
        out = eng.executor.forward(states, columns, logits="all", record=False, **eng._fwd_kwargs)
        self.num_issued += 1
        am = lane_argmax(out.logits)
        if am.device.type == "cuda":
            host = torch.empty(am.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(am, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = am.to("cpu"), None
        return _InFlight(lanes, states, am, host, event)

    def _commit(self, f: _InFlight) -> None:
        """Commit a round (keep 1 running, 0 dead) and let its dead lanes go: reply checkpoint (lanes
        finished by a stop), then their states."""
        eng = self._engine
        eng.executor.commit(f.states, [0 if id(lane) in f.dead else 1 for lane in f.lanes])
        dead = [lane for lane in f.lanes if id(lane) in f.dead]
        if not dead:
            return
        if eng.checkpoints.records_replies:
            eng.checkpoints.record_replies([x for x in dead if id(x) not in f.aborted])
        for lane in dead:
            eng._release_state(lane)

    def _settle(self, f: _InFlight) -> None:
        """Commit a round whose lanes are all finished (keep 0 each) and release them."""
        self._flight = None
        self._commit(f)

    def _emit(self, read: list[tuple[_Lane, int]], emitted: dict[int, list[int]]) -> list[_Lane]:
        """Stop-check and emit each lane's token; the finished lanes leave the engine's active list."""
        eng = self._engine
        finished = []
        for lane, token in read:
            n = lane.stops.extend([token])
            lane.num_rounds += 1
            emitted.setdefault(lane.lane_id, []).extend([token][:n])
            if lane.stops.is_finished:
                finished.append(lane)
                eng._active.remove(lane)
        return finished


def _has_tokens_after_next(lane: _Lane) -> bool:
    """Whether the lane may emit more tokens after the one its round in flight gives (length limits)."""
    left = lane.stops.num_tokens_left
    return left is None or left > 1
