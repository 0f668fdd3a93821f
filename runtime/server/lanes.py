"""The lane loop: one background thread owns the engine, runs `engine.step()` and fans tokens out.

The engine is not thread-safe, so exactly one thread (`ignis-lanes`) touches it. HTTP handlers, on
the asyncio event loop, talk to that thread through two thread-safe doors:

- `LaneLoop.submit(prompt, params)` queues an "add" operation and returns a `RequestHandle` at once;
  past `max_lanes + queue_size` requests in flight it raises `ServerBusyError` (503, Retry-After).
- `LaneLoop.abort(handle)` queues an "abort" (a client that went away); `abort_all()` cancels every
  request in flight (a shutdown past its grace period, or a second signal); `num_cut` counts the
  requests cut that way or by `stop()`.

The thread applies queued operations between steps, so a new request joins at the next round and an
abort frees its lane before the next round runs. After each step it pushes one `TokenEvent` per lane
that emitted tokens (a whole committed run; the HTTP side sends one chunk per token) onto the
request's asyncio queue: the step's events for every lane go in one `loop.call_soon_threadsafe`, so the
event loop wakes once per step, not once per lane. A finished lane's last event carries its
finish reason and, for a request with stop strings, the engine's text cut before the stop string.

An exception out of `engine.step()` leaves the engine unusable (`ignis.runtime.engine`): the thread
fails every request in flight with `EngineFailedError` (500), builds a fresh engine with the model's
factory and goes on; the speculative counters carry over.

Timing (seconds, `time.monotonic`): time to first token runs from `submit` to the step that emitted
the request's first token; inter-token latency spreads the time between two steps of a request evenly
over the tokens the later step emitted (a committed run of n tokens gives n samples of dt / n), so the
samples of a request sum to its decode time.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ignis.runtime.engine import LaneRequestError, SpeculativeEngine
from ignis.runtime.logits_processors import TokenLogprob
from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.sampling import SamplingParams, SamplingParamsError
from ignis.runtime.server.errors import (
    APIError,
    EngineFailedError,
    InvalidRequestError,
    ServerBusyError,
    ServerUnavailableError,
)

if TYPE_CHECKING:
    from ignis.runtime.server.metrics import ServerMetrics

__all__ = ["ErrorEvent", "LaneLoop", "LaneSnapshot", "RequestHandle", "TokenEvent", "busy_error"]

logger = logging.getLogger("ignis.runtime.server")


@dataclass(frozen=True)
class TokenEvent:
    """Tokens one step emitted for a request.

    Attributes:
        token_ids: the tokens, in order (a committed run cut at a stop; empty for an abort).
        finish_reason: None while running; "stop", "length" or "abort" on the last event.
        stop_reason: the stop token id or stop string that finished it, else None.
        stop_text: on the last event of a request with stop strings, the engine's text of the whole
            output cut before the stop string; else None.
        num_cached_tokens: on the last event, the prompt tokens restored from a prompt checkpoint
            (`usage.prompt_tokens_details.cached_tokens`); else 0.
        logprobs: each token's logprob and top logprobs when the request asked, else None.
    """

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_text: str | None = None
    num_cached_tokens: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when the request asked


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed (`error` is what the client is told); no event follows."""

    error: APIError


@dataclass(frozen=True)
class LaneSnapshot:
    """The loop's state (read by /health and /metrics from other threads): published before a step that
    follows queued operations (requests taken or aborted), after every step (before its tokens are
    pushed to the clients, so a client that has its reply reads counters that include it) and when a
    request is taken.

    Attributes:
        num_active: lanes decoding or being prefilled, and requests admitted to a lane (up to
            max_lanes) whose prefill the step's budget has not reached yet.
        num_waiting: requests queued for a lane.
        spec_samples: the speculative counters as (name, labels, value) (`SpeculativeMetrics.samples`).
    """

    num_active: int = 0
    num_waiting: int = 0
    spec_samples: tuple[tuple[str, dict[str, str], int], ...] = ()


class RequestHandle:
    """One submitted request, read on the asyncio side with `next_event()`.

    Attributes:
        request_id: a unique hex id.
        prompt_token_ids: the prompt.
        params: the sampling parameters.
        arrival: `time.monotonic()` at submit.
    """

    def __init__(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        loop: asyncio.AbstractEventLoop,
        checkpoint_at: Sequence[int] = (),
    ) -> None:
        self.request_id = uuid.uuid4().hex
        self.prompt_token_ids = tuple(int(t) for t in prompt_token_ids)
        self.params = params
        self.checkpoint_at = tuple(int(p) for p in checkpoint_at)  # prompt checkpoint positions
        self.arrival = time.monotonic()
        self._loop = loop
        self._queue: asyncio.Queue[TokenEvent | ErrorEvent] = asyncio.Queue()
        # Written by the lane thread only:
        self.lane_id: int | None = None
        self.is_done = False  # the last event was pushed
        self.is_abort_requested = False
        self.num_emitted = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    async def next_event(self) -> TokenEvent | ErrorEvent:
        """Wait for the next event (never returns after the last one has been taken)."""
        return await self._queue.get()

    def _push(self, event: TokenEvent | ErrorEvent) -> None:
        _deliver([(self, event)])


def _put_all(items: list[tuple[RequestHandle, TokenEvent | ErrorEvent]]) -> None:
    """On the event loop: queue each event for its request, in order."""
    for handle, event in items:
        handle._queue.put_nowait(event)


def _deliver(items: Sequence[tuple[RequestHandle, TokenEvent | ErrorEvent]]) -> None:
    """From the lane thread: hand events to their requests' event loops with one `call_soon_threadsafe`
    per loop (one wake-up of the loop per step, whatever the number of lanes), in order. Marks a
    request done with its last event. Events for a closed loop are dropped (nobody listens any more)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, TokenEvent | ErrorEvent]]] = {}
    for handle, event in items:
        if isinstance(event, ErrorEvent) or event.finish_reason is not None:
            handle.is_done = True
        by_loop.setdefault(handle._loop, []).append((handle, event))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def busy_error(max_lanes: int, queue_size: int, retry_after: int) -> ServerBusyError:
    """The 503 of a request past max_lanes + queue_size in flight (with Retry-After)."""
    lanes = "the lane is" if max_lanes == 1 else f"all {max_lanes} lanes are"
    waiting = "1 request is" if queue_size == 1 else f"{queue_size} requests are"
    return ServerBusyError(
        f"{lanes} busy and {waiting} already waiting; retry after {retry_after} s",
        code="queue_full",
        headers={"Retry-After": str(retry_after)},
    )


class LaneLoop:
    """The engine thread (module docstring).

    Args:
        make_engine: (max_lanes, metrics) -> a fresh engine (`ServedModel.make_engine`).
        max_lanes: lanes decoding at once (`--lanes`, >= 1).
        queue_size: requests that may wait for a lane beyond max_lanes (`--queue-size`, >= 0).
        retry_after: seconds a refused client is told to wait (Retry-After).
        metrics: the Prometheus metrics to update, or None.
        spec_metrics: the speculative counters the engine updates (fresh by default).

    Raises:
        ValueError: max_lanes < 1 or queue_size < 0.
        IgnisRuntimeError: from make_engine.
    """

    def __init__(
        self,
        make_engine: Callable[[int, SpeculativeMetrics], SpeculativeEngine],
        *,
        max_lanes: int,
        queue_size: int,
        retry_after: int = 1,
        metrics: ServerMetrics | None = None,
        spec_metrics: SpeculativeMetrics | None = None,
    ) -> None:
        if max_lanes < 1:
            raise ValueError(f"max_lanes must be >= 1, got {max_lanes}")
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        self.max_lanes = max_lanes
        self.queue_size = queue_size
        self.retry_after = retry_after
        self.metrics = metrics
        self.spec_metrics = spec_metrics if spec_metrics is not None else SpeculativeMetrics()
        self._make_engine = make_engine
        self._engine = make_engine(max_lanes, self.spec_metrics)
        self.max_context: int | None = self._engine.max_context
        self.vocab_size: int | None = self._engine.vocab_size
        self._cond = threading.Condition()
        self._ops: deque[tuple[str, Any]] = deque()  # ("add" | "abort", handle) or ("abort_all", None)
        self._num_inflight = 0
        self._stopping = False
        self._handles: dict[int, RequestHandle] = {}  # lane id -> handle; lane thread only
        self._thread: threading.Thread | None = None
        self.num_engine_restarts = 0
        self.num_cut = 0  # requests in flight aborted by abort_all() or stop() (not by their client)
        # events the lane thread sends at its next `_publish`, after the snapshot (lane thread only)
        self._outbox: list[tuple[RequestHandle, TokenEvent | ErrorEvent]] = []
        self._spec_samples = tuple(self.spec_metrics.samples())
        m = self.spec_metrics
        self._spec_key = (m.rounds_total, m.drafted_tokens_total, m.accepted_tokens_total)
        self.snapshot = LaneSnapshot(spec_samples=self._spec_samples)

    # ------------------------------------------------------------------ any thread

    @property
    def is_alive(self) -> bool:
        """True while the thread runs and the loop is not stopping."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_inflight(self) -> int:
        """Requests submitted and not finished (decoding or waiting)."""
        return self._num_inflight

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ignis-lanes", daemon=True)
            self._thread.start()

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        checkpoint_at: Sequence[int] = (),
    ) -> RequestHandle:
        """Queue a request for a lane; it joins at the next round (or waits for a free lane).

        Args:
            prompt_token_ids: the prompt (validated by the caller; an invalid one ends as an ErrorEvent).
            params: its sampling parameters.
            loop: the event loop whose queue receives the events (the running loop by default).
            checkpoint_at: prompt positions to record a prompt checkpoint at (the chat template's
                opener; `SpeculativeEngine.add_lane`).

        Raises:
            ServerBusyError: max_lanes + queue_size requests are already in flight.
            ServerUnavailableError: the loop is stopping or not running.
        """
        handle = RequestHandle(prompt_token_ids, params, loop or asyncio.get_running_loop(), checkpoint_at)
        with self._cond:
            if self._stopping or self._thread is None or not self._thread.is_alive():
                raise ServerUnavailableError("the server is shutting down; no new requests are taken")
            if self._num_inflight >= self.max_lanes + self.queue_size:
                raise busy_error(self.max_lanes, self.queue_size, self.retry_after)
            self._num_inflight += 1
            self._ops.append(("add", handle))
            self._cond.notify()
            # counted as waiting now, not after the step the lane thread may be busy with
            snap = self.snapshot
            waiting = self._num_inflight - snap.num_active
            self.snapshot = LaneSnapshot(snap.num_active, waiting, snap.spec_samples)
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request (frees its lane before the next round); no-op once it finished."""
        with self._cond:
            if handle.is_done or handle.is_abort_requested:
                return
            handle.is_abort_requested = True
            self._ops.append(("abort", handle))
            self._cond.notify()

    def abort_all(self) -> None:
        """Cancel every request in flight, waiting or decoding (a shutdown past its grace period): each
        gets its last event with finish reason "abort" before the next round."""
        with self._cond:
            self._ops.append(("abort_all", None))
            self._cond.notify()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort every request in flight and stop the thread (idempotent)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the lane thread

    def _release(self, handle: RequestHandle, finish_reason: str | None) -> None:
        with self._cond:
            self._num_inflight -= 1
        if self.metrics is not None and finish_reason is not None:
            self.metrics.request_finished(handle, finish_reason, time.monotonic())

    def _run(self) -> None:
        try:
            while self._run_once():
                pass
        except BaseException:  # a bug or a failed engine restart: fail what is left and stop taking requests
            logger.exception("the lane loop failed; failing %d request(s) and stopping", len(self._handles))
            _deliver(self._outbox)
            self._outbox.clear()
            with self._cond:
                self._stopping = True
                pending = [h for kind, h in self._ops if kind == "add"]
                self._ops.clear()
            for handle in [*self._handles.values(), *pending]:
                if not handle.is_done:
                    self._release(handle, "error")
                    handle._push(ErrorEvent(EngineFailedError("the server's lane loop failed")))
            self._handles.clear()

    def _run_once(self) -> bool:
        """Apply queued operations and run one step. Returns False when the loop is to end."""
        with self._cond:
            while not self._ops and not self._engine.has_unfinished and not self._stopping:
                self._cond.wait()
            ops = list(self._ops)
            self._ops.clear()
            stopping = self._stopping
        for kind, handle in ops:
            if kind == "add":
                self._add(handle)
            elif kind == "abort":
                self._abort(handle)
            else:
                for each in list(self._handles.values()):
                    self.num_cut += self._abort(each)
        if stopping:
            for handle in list(self._handles.values()):
                self.num_cut += self._abort(handle)
            self._publish()
            return False
        if not self._engine.has_unfinished:
            self._publish()
            return True
        if ops:  # before the step (its prefills can take long); else nothing changed since the last
            self._publish()
        try:
            updates = self._engine.step()
        except Exception as exc:  # the engine is unusable now (engine docstring): restart it
            logger.exception(
                "engine step failed; failing %d request(s) and restarting the engine", len(self._handles)
            )
            self._fail_all(exc)
            return True
        now = time.monotonic()
        emitted: list[tuple[RequestHandle, int]] = []
        for update in updates:
            handle = self._handles.get(update.lane_id)
            if handle is None:
                continue
            stop_text, cached = None, 0
            if update.is_finished:
                result = self._engine.pop_result(update.lane_id)
                del self._handles[update.lane_id]
                stop_text = result.text if handle.params.stop else None
                cached = result.num_cached_tokens
            if update.new_token_ids:
                emitted.append((handle, len(update.new_token_ids)))
            handle.num_emitted += len(update.new_token_ids)
            if update.is_finished:  # released before the client can see its last token
                if self.metrics is not None and emitted and emitted[-1][0] is handle:
                    self.metrics.step_emitted([emitted.pop()], now)  # its tokens before its duration
                self._release(handle, update.finish_reason)
            event = TokenEvent(
                update.new_token_ids,
                update.finish_reason,
                update.stop_reason,
                stop_text,
                num_cached_tokens=cached,
                logprobs=update.logprobs,
            )
            self._send(handle, event)
        if self.metrics is not None and emitted:
            self.metrics.step_emitted(emitted, now)
        self._publish()  # then the tokens go out: a client that read its reply sees this step's counters
        return True

    @property
    def max_prefill_tokens(self) -> int | None:
        """The prefill budget of the engine the loop runs (None for an engine without one)."""
        return getattr(self._engine, "max_prefill_tokens", None)

    def _send(self, handle: RequestHandle, event: TokenEvent | ErrorEvent) -> None:
        """Queue an event for the request; the next `_publish` sends it after the new snapshot."""
        self._outbox.append((handle, event))

    def _publish(self) -> None:
        """Publish the snapshot, then send the queued events (so a client that has its last event
        reads counters and gauges that include it)."""
        # a lane being prefilled counts as active: the requests the engine holds, up to max_lanes
        # (its steps admit that many, as the prefill budget reaches them), so /health and /metrics see
        # a long prefill, chunked over several steps, while it runs
        eng = self._engine
        busy = eng.num_active + eng.num_prefilling
        held = busy + eng.num_waiting
        active = min(held, max(self.max_lanes, busy))
        m = self.spec_metrics
        key = (m.rounds_total, m.drafted_tokens_total, m.accepted_tokens_total)
        if key != self._spec_key:  # rebuilt only after speculative rounds were counted
            self._spec_key, self._spec_samples = key, tuple(m.samples())
        self.snapshot = LaneSnapshot(
            num_active=active, num_waiting=self._num_inflight - active, spec_samples=self._spec_samples
        )
        outbox, self._outbox = self._outbox, []
        self._emit(outbox)

    def _emit(self, outbox: list[tuple[RequestHandle, TokenEvent | ErrorEvent]]) -> None:
        """Send the events of one `_publish` (after `self.snapshot` was set) to their requests: here to
        their event loops; the engine process sends them over its pipe (`engine_process`)."""
        if outbox:
            _deliver(outbox)

    def _add(self, handle: RequestHandle) -> None:
        if handle.is_abort_requested:
            self._release(handle, "abort")
            self._send(handle, TokenEvent((), "abort"))
            return
        try:
            lane_id = self._engine.add_lane(
                handle.prompt_token_ids, handle.params, checkpoint_at=handle.checkpoint_at
            )
        except (LaneRequestError, SamplingParamsError) as exc:
            self._release(handle, None)
            self._send(handle, ErrorEvent(InvalidRequestError(str(exc), param="prompt")))
            return
        handle.lane_id = lane_id
        self._handles[lane_id] = handle
        if self.metrics is not None:
            self.metrics.request_admitted(handle)

    def _abort(self, handle: RequestHandle) -> bool:
        """Abort a request holding a lane; False when it holds none (not added yet: its add sees the
        flag; or already finished)."""
        lane_id = handle.lane_id
        if lane_id is None or self._handles.get(lane_id) is not handle:
            return False
        self._engine.abort(lane_id)
        self._engine.pop_result(lane_id)
        del self._handles[lane_id]
        self._release(handle, "abort")
        self._send(handle, TokenEvent((), "abort"))
        return True

    def _fail_all(self, exc: Exception) -> None:
        for handle in list(self._handles.values()):
            self._release(handle, "error")
            self._send(
                handle, ErrorEvent(EngineFailedError(f"the engine failed while serving this request: {exc}"))
            )
        self._handles.clear()
        del self._engine  # free its memory before the new one is built
        gc.collect()
        self._engine = self._make_engine(self.max_lanes, self.spec_metrics)
        self.num_engine_restarts += 1
        self._publish()
