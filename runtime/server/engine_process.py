"""The engine in its own process (`ignis-run --engine-process`): the API server and the engine no longer
share one GIL.

In the default mode the lane thread (`ignis.runtime.server.lanes.LaneLoop`) and the event loop share
one interpreter lock, so every microsecond the HTTP side spends (request parsing, chunk writes,
detokenization for stop strings and logprobs) is added to a host-bound engine's round. Here the model,
the engine, the artifact's memory map and the lane loop live in a child process started with
multiprocessing's "spawn" (CUDA cannot be forked); the server process keeps the tokenizer, the chat
template, tool parsers, grammar compilation (for the 4xx of a bad schema) and HTTP. vLLM V1 splits
the same way (its EngineCore process beside the API server).

`ProcessLaneLoop` has `LaneLoop`'s public surface (submit, abort, abort_all, stop, start, is_alive,
num_inflight, num_cut, num_engine_restarts, snapshot, max_context, vocab_size, max_prefill_tokens,
metrics), so the app does not know which it talks to.

**IPC.** Two one-way `multiprocessing` pipes carry msgpack messages in `Connection.send_bytes` frames.
Server -> engine: `add` (wire id, prompt ids, sampling parameters as plain fields, a grammar as its
llguidance source, compiled again in the child and cached by source; checkpoint positions), `abort`,
`abort_all`, `stop`. Engine -> server: `ready` (context, vocabulary, prefill budget), `load_failed`
(the pickled exception), one **step** message per `_publish` of the child's lane loop (every lane's
events of that step, the admitted requests, the lane gauges, the speculative counters when they
changed, the engine's other series when due), and `stopped`. The server process reads them on its
event loop (an asyncio reader on the pipe: one non-blocking read a wake-up drains every message
waiting, no thread hop; a thread reads instead where no loop runs), updates the request metrics
(time to first token, inter-token latency and the rest are computed from the engine's step time:
both processes read the same `CLOCK_MONOTONIC`), then queues the events for their requests: one
wake-up a step, fewer when the loop falls behind.

The engine's other Prometheus series (the prompt checkpoint pool's, the expert cache's, the async
rounds') are collected in the child and shipped with its ready message (their values at load), then
with a step message that finishes or admits a request, or every `EXTRAS_INTERVAL_S` seconds of steps
otherwise; `/metrics` renders the latest with their names, help and types unchanged. `/status`'s
`gpu` is the child's device memory, shipped with them.

**Failures.** A bad request is refused in the server process before it crosses (validation stays
there); a request the engine refuses (`LaneRequestError`) comes back as a typed error event (400). An
exception out of a step fails the requests in flight with 500 and the child rebuilds its engine, as
`LaneLoop` does. The child dying (killed, out of memory, a crash in native code) fails every request
in flight with 500 ("the engine process exited ...") and the server starts a new child (the model is
loaded again; `/health` answers 503 and new requests get 503 with Retry-After meanwhile). After
more than `MAX_RESTARTS` deaths within `RESTART_WINDOW_S` seconds, a failed reload, or a child that exits
because its artifact was modified in place (`ignis.runtime.artifact_guard`, status 75), the server
stops restarting and shuts down with a non-zero exit status (`fatal_status`: 75 for the artifact, else
1), for a supervisor to act on.

**Shutdown and orphans.** The child ignores SIGINT and SIGTERM (a terminal's Ctrl+C and systemd's
control-group SIGTERM reach it too): the server process owns shutdown and sends `stop` after its grace
period; the child aborts what is left, writes the prompt checkpoints to `--checkpoint-dir`, closes the
model and exits. A child whose server process is gone (killed, even by SIGKILL) sees end-of-file on
its command pipe and exits at once; a server process exiting without `stop` kills its child from a
`multiprocessing` finalizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import struct
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.util import Finalize
from typing import Any

import msgpack
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from ignis.runtime.errors import IgnisRuntimeError
from ignis.runtime.logits_processors import TokenLogprob
from ignis.runtime.sampling import SamplingParams, SamplingParamsError
from ignis.runtime.server.errors import (
    APIError,
    EngineFailedError,
    InvalidRequestError,
    ServerUnavailableError,
)
from ignis.runtime.server.lanes import (
    ErrorEvent,
    LaneLoop,
    LaneSnapshot,
    RequestHandle,
    TokenEvent,
    _deliver,
    busy_error,
)
from ignis.runtime.server.model import ModelSettings, ServedModel

__all__ = [
    "EXTRAS_INTERVAL_S",
    "MAX_RESTARTS",
    "RESTART_WINDOW_S",
    "EngineSpec",
    "FactorySource",
    "ProcessLaneLoop",
    "load_text_model",
]

logger = logging.getLogger("ignis.runtime.server")

EXTRAS_INTERVAL_S = 0.25  # the engine's other series are shipped at least this often while it steps
MAX_RESTARTS = 3  # engine process deaths tolerated within RESTART_WINDOW_S before the server gives up
RESTART_WINDOW_S = 300.0
_FRAME = struct.Struct("!i")  # multiprocessing.connection's frame header: the payload's length
_EXIT_ARTIFACT_CHANGED = 75  # ignis.runtime.artifact_guard.EXIT_ARTIFACT_CHANGED (not imported: no fcntl)
_LOAD_FAILED = 2  # the child's exit status when the model could not be loaded

# message kinds (the first element of every message)
_ADD, _ABORT, _ABORT_ALL, _STOP = "a", "b", "c", "q"
_READY, _LOAD_FAILED_MSG, _STEP, _STOPPED = "r", "f", "s", "x"
_ERRORS: dict[str, type[APIError]] = {
    "InvalidRequestError": InvalidRequestError,
    "EngineFailedError": EngineFailedError,
}


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process loads: a picklable `ModelSource` (it is loaded again in the child:
    `ArtifactSource` pickles as its path and options; `FactorySource` as its `--model-factory`) and the
    resolved settings.

    Attributes:
        source: the model source (`source.load(settings).make_engine` builds the engine there).
        settings: the resolved settings.
    """

    source: Any
    settings: ModelSettings


@dataclass(frozen=True)
class FactorySource:
    """A `--model-factory MODULE:CALLABLE` source that crosses to the engine process as its name: the
    child imports and calls it again (`ignis.runtime.cli`'s loader) and loads what it returns."""

    factory: str

    def load(self, settings: ModelSettings) -> ServedModel:
        from ignis.runtime.cli import _load_factory

        return _load_factory(self.factory).load(settings)  # type: ignore[no-any-return]


def load_text_model(source: Any, settings: ModelSettings) -> ServedModel:
    """The server process's side of a model in engine-process mode: tokenizer, names, speculative
    settings; no engine, weights or memory map. A source with `load_text(settings)`
    (`ArtifactSource`) provides it; any other source is loaded whole and its engine factory is never
    called here."""
    load_text = getattr(source, "load_text", None)
    if load_text is not None:
        return load_text(settings)  # type: ignore[no-any-return]
    return source.load(settings)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- wire encoding


def _pack(msg: Sequence[Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def _encode_params(params: SamplingParams) -> dict[str, Any]:
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "grammar"}
    if params.grammar is not None:
        out["grammar"] = [params.grammar.source, params.grammar.description]
    return out


def _encode_event(event: TokenEvent | ErrorEvent, release: str | None) -> list[Any]:
    if isinstance(event, ErrorEvent):
        err = event.error
        return [1, type(err).__name__, err.message, err.param, err.code, release]
    lps = None
    if event.logprobs is not None:
        lps = [[lp.token_id, lp.logprob, lp.top] for lp in event.logprobs]
    return [
        0,
        event.token_ids,
        event.finish_reason,
        event.stop_reason,
        event.stop_text,
        event.num_cached_tokens,
        lps,
    ]


def _decode_event(enc: list[Any]) -> tuple[TokenEvent | ErrorEvent, bool, str | None]:
    """(event, is it the request's last, the finish reason it is counted under or None)."""
    if enc[0] == 1:
        _, kind, message, param, code, release = enc
        cls = _ERRORS.get(kind, EngineFailedError)
        return ErrorEvent(cls(message, param=param, code=code)), True, release
    _, ids, finish, stop_reason, stop_text, cached, lps = enc
    logprobs = None
    if lps is not None:
        logprobs = tuple(TokenLogprob(t, lp, tuple((int(i), v) for i, v in top)) for t, lp, top in lps)
    event = TokenEvent(
        tuple(ids), finish, stop_reason, stop_text, num_cached_tokens=cached, logprobs=logprobs
    )
    return event, finish is not None, finish


def _collect(collectors: Sequence[Collector]) -> list[list[Any]]:
    """Every family the collectors yield, as plain lists (name, help, type, unit, samples)."""
    out: list[list[Any]] = []
    for collector in collectors:
        for fam in collector.collect():
            samples = [[s.name, s.labels, s.value] for s in fam.samples]
            out.append([fam.name, fam.documentation, fam.type, fam.unit, samples])
    return out


class _ShippedCollector(Collector):
    """The engine process's own series (prompt checkpoints, expert cache), as last shipped."""

    def __init__(self, lanes: ProcessLaneLoop) -> None:
        self._lanes = lanes

    def collect(self) -> Iterator[Metric]:
        for name, doc, typ, unit, samples in self._lanes._extras:
            fam = Metric(name, doc, typ, unit)
            for sname, labels, value in samples:
                fam.add_sample(sname, labels, value)
            yield fam


# --------------------------------------------------------------------------- the engine process


class _EngineSide(LaneLoop):
    """The child's lane loop: `LaneLoop` run on the child's main thread, fed by its command reader
    thread (`take`, `abort_wire`) and publishing each step as one message on the event pipe."""

    def __init__(
        self,
        model: ServedModel,
        max_lanes: int,
        send: Callable[[bytes], None],
    ) -> None:
        super().__init__(model.make_engine, max_lanes=max_lanes, queue_size=0)
        from ignis.runtime.server.checkpoints import PromptCheckpointCollector

        self._send_bytes = send
        self._model = model
        self._collectors: list[Collector] = list(model.collectors)
        if model.prefix_cache is not None:
            self._collectors.insert(0, PromptCheckpointCollector(model.prefix_cache))
        self._by_wire: dict[int, RequestHandle] = {}
        self._admitted: list[int] = []
        self._sent_spec: Any = None
        self._sent_state: tuple[int, int, int] | None = None
        self._extras_at = 0.0
        self.stop_requested = False
        self._dead_loop = asyncio.new_event_loop()  # the child's handles never reach an event loop
        self._dead_loop.close()
        self._grammars: OrderedDict[str, Any] = OrderedDict()
        torch = sys.modules.get("torch")  # the engine is built: CUDA is initialized if it runs there
        self._on_cuda = torch is not None and bool(torch.cuda.is_initialized())
        self._packer = msgpack.Packer(use_bin_type=True)  # one for every step (lane thread only)

    def start_extras(self) -> Any:
        """The engine's other series and the device memory as loaded (the ready message ships them, so
        `/metrics` lists them, at their start values, before the first step), or None when there are
        none. Called on the child's main thread before its lane loop runs."""
        if not (self._collectors or self._on_cuda):
            return None
        self._extras_at = time.monotonic()
        return [_collect(self._collectors), _gpu_memory()]

    # -- the command reader thread

    def take(
        self,
        wire_id: int,
        prompt: Sequence[int],
        params: SamplingParams,
        at: Sequence[int],
        refusal: APIError | None = None,
    ) -> None:
        """Queue a request for the lane thread (`refusal`: answer it with this error instead: only the
        lane thread writes to the event pipe, so this thread always drains the commands)."""
        handle = RequestHandle(prompt, params, self._dead_loop, at)
        handle.wire_id = wire_id  # type: ignore[attr-defined]
        handle.refusal = refusal  # type: ignore[attr-defined]
        self._by_wire[wire_id] = handle
        with self._cond:
            self._num_inflight += 1
            self._ops.append(("add", handle))
            self._cond.notify()

    def abort_wire(self, wire_id: int) -> None:
        handle = self._by_wire.get(wire_id)
        if handle is not None:
            self.abort(handle)

    def request_stop(self) -> None:
        self.stop_requested = True
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def grammar(self, source: str, description: str) -> Any:
        """The compiled grammar of an llguidance source (the last 64 are kept)."""
        got = self._grammars.get(source)
        if got is None:
            from ignis.runtime.grammar import Grammar
            from ignis.runtime.server.agents import grammar_tokenizer

            tok = grammar_tokenizer(self._model.tokenizer, self.vocab_size)
            got = Grammar.from_source(tok, source, description)
            self._grammars[source] = got
            while len(self._grammars) > 64:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(source)
        return got

    # -- the lane thread (the child's main thread)

    def _add(self, handle: RequestHandle) -> None:
        refusal = getattr(handle, "refusal", None)
        if refusal is not None:
            self._release(handle, None)
            self._send(handle, ErrorEvent(refusal))
            return
        super()._add(handle)
        if handle.lane_id is not None:
            self._admitted.append(handle.wire_id)  # type: ignore[attr-defined]

    def _release(self, handle: RequestHandle, finish_reason: str | None) -> None:
        handle.release_reason = finish_reason  # type: ignore[attr-defined]
        super()._release(handle, finish_reason)

    def _emit(self, outbox: list[tuple[RequestHandle, TokenEvent | ErrorEvent]]) -> None:
        snap = self.snapshot
        spec = None if snap.spec_samples is self._sent_spec else snap.spec_samples
        state = (snap.num_active, self.num_engine_restarts, self.num_cut)
        if not outbox and not self._admitted and spec is None and state == self._sent_state:
            return
        events = []
        finished = False
        for handle, event in outbox:
            final = isinstance(event, ErrorEvent) or event.finish_reason is not None
            wire = handle.wire_id  # type: ignore[attr-defined]
            if final:
                finished = True
                self._by_wire.pop(wire, None)
            enc = _encode_event(event, getattr(handle, "release_reason", None) if final else None)
            events.append([wire, enc])
        now = time.monotonic()
        extras = None
        if self._collectors or self._on_cuda:
            if finished or self._admitted or now - self._extras_at >= EXTRAS_INTERVAL_S:
                extras = [_collect(self._collectors), _gpu_memory()]
                self._extras_at = now
        msg = [_STEP, now, snap.num_active, spec, *state[1:], self._admitted, events, extras]
        self._admitted = []
        self._sent_spec, self._sent_state = snap.spec_samples, state
        self._send_bytes(self._packer.pack(msg))


def _gpu_memory() -> Any:
    from ignis.runtime.server.status import gpu_memory

    try:
        return gpu_memory()
    except RuntimeError:
        return None


#: set in an engine process whose load failed (its command pipe then ends with no server gone)
_load_failed = threading.Event()


def _read_commands(conn: Connection, ready: threading.Event, holder: list[_EngineSide]) -> None:
    """The child's command reader: applies the server's commands; end of file without `stop` means
    the server process is gone, and the child exits at once (no orphan)."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            if (holder and holder[0].stop_requested) or _load_failed.is_set():
                return  # a load that failed: the main thread exits with its status
            logger.warning("engine process: the server process is gone; exiting")
            os._exit(0)
        ready.wait()
        side = holder[0]
        msg = _unpack(data)
        kind = msg[0]
        if kind == _ADD:
            _, wire, prompt, fields, at = msg
            refusal = None
            try:
                grammar = fields.pop("grammar", None)
                if grammar is not None:
                    fields["grammar"] = side.grammar(grammar[0], grammar[1])
                params = SamplingParams(**fields)
            except (SamplingParamsError, IgnisRuntimeError, TypeError, ValueError) as exc:
                refusal, params = InvalidRequestError(str(exc)), SamplingParams()
            side.take(wire, prompt, params, at, refusal)
        elif kind == _ABORT:
            side.abort_wire(msg[1])
        elif kind == _ABORT_ALL:
            side.abort_all()
        elif kind == _STOP:
            side.request_stop()


def _child_main(
    spec: EngineSpec, max_lanes: int, commands: Connection, events: Connection, log_level: int, threads: int
) -> None:
    """The engine process: load the model, build the engine, serve commands until `stop`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process owns shutdown (module docstring)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    lock = threading.Lock()

    def send(data: bytes) -> None:
        with lock:
            events.send_bytes(data)

    ready = threading.Event()
    holder: list[_EngineSide] = []
    reader = threading.Thread(
        target=_read_commands, args=(commands, ready, holder), name="ignis-engine-commands", daemon=True
    )
    reader.start()  # before the load: a server process that dies meanwhile ends this one too
    try:
        model = spec.source.load(spec.settings)
        side = _EngineSide(model, max_lanes, send)
    except BaseException as exc:
        _load_failed.set()
        if isinstance(exc, IgnisRuntimeError):  # a typed refusal: its message says it all
            logger.error("engine process: the model could not be loaded: %s", exc)
        else:
            logger.exception("engine process: the model could not be loaded")
        try:
            blob = pickle.dumps(exc)
        except Exception:
            blob = b""
        with contextlib.suppress(OSError):
            send(_pack([_LOAD_FAILED_MSG, type(exc).__name__, str(exc), blob]))
        os._exit(_LOAD_FAILED)
    info = {
        "max_context": side.max_context,
        "vocab_size": side.vocab_size,
        "max_prefill_tokens": side.max_prefill_tokens,
        "pid": os.getpid(),
        "extras": side.start_extras(),
    }
    send(_pack([_READY, info]))
    holder.append(side)
    ready.set()
    side._run()  # returns at stop, or after the lane loop failed (its requests got their errors)
    if not side.stop_requested:
        logger.error("engine process: the lane loop failed; exiting for the server to start a new one")
        os._exit(3)
    if model.save_checkpoints is not None:
        try:
            model.save_checkpoints()
        except Exception:
            logger.exception("shutdown: the prompt checkpoints could not be saved")
    if model.close is not None:
        model.close()
    with contextlib.suppress(OSError):
        send(_pack([_STOPPED, side.num_cut]))
    events.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # everything is saved and closed: skip the interpreter's teardown (torch's takes seconds)


# --------------------------------------------------------------------------- the server process


def _grow_pipe(fd: int) -> None:
    """Ask for a 1 MiB pipe buffer (Linux `F_SETPIPE_SZ`; the default is 64 KiB): a long prompt's add,
    or the steps of an event loop busy for a moment, then fit without blocking the writer. Best effort."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass


@contextlib.contextmanager
def _child_environment() -> Iterator[None]:
    """The environment an engine process starts with: OMP_WAIT_POLICY=PASSIVE unless the environment
    sets an OpenMP wait policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT); the server's own is restored after.

    The engine process runs torch's CPU ops from its main thread (the OpenMP initial thread), whose
    team spins actively at every parallel region's barrier when the process has no more OpenMP
    threads than cores (GNU libgomp); on a host whose cores other processes share, each barrier then
    waits for a descheduled spinner, and a CPU engine ran ~5-10x slower than in the default mode's
    lane thread (whose extra team puts libgomp in its throttled spin). Passive waiting sleeps on a
    futex instead. libgomp reads the variable when it is loaded, so it must be in the child's
    environment at exec (multiprocessing's spawn passes this process's environment)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def _kill_child(proc: Any, conn: Connection | None) -> None:
    """Finalizer: close the command pipe (the child exits on end of file), then make sure."""
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.close()
    if proc.is_alive():
        proc.join(2.0)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)


class ProcessLaneLoop:
    """`LaneLoop`'s surface over an engine in a child process (module docstring).

    Args:
        spec: what the child loads.
        max_lanes: lanes decoding at once (`--lanes`, >= 1).
        queue_size: requests that may wait for a lane beyond max_lanes (`--queue-size`, >= 0).
        retry_after: seconds a refused client is told to wait (Retry-After).
        metrics: the Prometheus metrics to update, or None.
        on_fatal: called (from the reader thread) when the server gives up on its engine process.

    Raises:
        ValueError: max_lanes < 1 or queue_size < 0.
        IgnisRuntimeError (or the source's own exception type): the model could not be loaded in the
            engine process.
    """

    def __init__(
        self,
        spec: EngineSpec,
        *,
        max_lanes: int,
        queue_size: int,
        retry_after: int = 1,
        metrics: Any = None,
        on_fatal: Callable[[], None] | None = None,
    ) -> None:
        if max_lanes < 1:
            raise ValueError(f"max_lanes must be >= 1, got {max_lanes}")
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        self.spec = spec
        self.max_lanes = max_lanes
        self.queue_size = queue_size
        self.retry_after = retry_after
        self.metrics = metrics
        self.on_fatal = on_fatal
        self._ctx = get_context("spawn")
        self._lock = threading.Lock()  # handles, in-flight count, state flags
        self._send_lock = threading.Lock()
        self._handles: dict[int, RequestHandle] = {}
        self._next_wire = 0
        self._num_inflight = 0
        self._stopping = False
        self._restarting = False
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop reading the events pipe
        self._loop_thread: int | None = None
        self._stop_called = False
        self._exited = threading.Event()  # the last engine process ended and nothing restarts it
        self._clean_exit = False  # the current child said it stopped
        self._deaths: deque[float] = deque()
        self.fatal_status: int | None = None  # the exit status once the server gave up on its engine
        self.fatal_error: str | None = None
        self._restarts_base = 0  # engine rebuilds of earlier children, and the respawns themselves
        self._cut_base = 0
        self._child_restarts = 0
        self._child_cut = 0
        self._spec_base: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
        self._extras: list[list[Any]] = []
        self._gpu: Any = None
        self.snapshot = LaneSnapshot()
        self.child_pid: int | None = None
        self._proc: Any = None
        self._commands: Connection | None = None
        self._events: Connection | None = None
        self._finalizer: Finalize | None = None
        self._buf = bytearray()  # the events pipe's bytes not yet parsed (a partial frame)
        self._spawn()

    # ------------------------------------------------------------------ the child

    def _spawn(self) -> None:
        """Start a child and wait for it to be ready (the model loaded, the engine built).

        Raises:
            the child's load exception (rebuilt), or IgnisRuntimeError: it died while loading.
        """
        try:
            pickle.dumps(self.spec)
        except Exception as exc:
            raise IgnisRuntimeError(
                f"the model source {type(self.spec.source).__name__} cannot be sent to an engine process: "
                f"it does not pickle ({exc}); serve it without --engine-process"
            ) from exc
        cmd_r, cmd_w = self._ctx.Pipe(duplex=False)
        ev_r, ev_w = self._ctx.Pipe(duplex=False)
        for conn in (cmd_w, ev_r):
            _grow_pipe(conn.fileno())
        torch = sys.modules.get("torch")
        threads = int(torch.get_num_threads()) if torch is not None else 0
        level = logging.getLogger().getEffectiveLevel()
        proc = self._ctx.Process(
            target=_child_main,
            args=(self.spec, self.max_lanes, cmd_r, ev_w, level, threads),
            name="ignis-engine",
        )
        with _child_environment():
            proc.start()
        cmd_r.close()
        ev_w.close()
        finalizer = Finalize(self, _kill_child, args=(proc, cmd_w), exitpriority=10)
        try:
            while True:
                if ev_r.poll(0.2):
                    try:
                        msg = _unpack(ev_r.recv_bytes())
                    except (EOFError, OSError):
                        msg = None
                    if msg is not None and msg[0] == _READY:
                        info = msg[1]
                        break
                    if msg is not None and msg[0] == _LOAD_FAILED_MSG:
                        raise _rebuild(msg[1], msg[2], msg[3])
                    proc.join(10.0)
                    raise IgnisRuntimeError(_died_loading(proc.exitcode))
                if not proc.is_alive():
                    raise IgnisRuntimeError(_died_loading(proc.exitcode))
        except BaseException:
            finalizer()
            ev_r.close()
            raise
        if self._finalizer is not None:
            self._finalizer.cancel()
        self._finalizer = finalizer
        self._proc, self._commands, self._events = proc, cmd_w, ev_r
        self.child_pid = int(info["pid"])
        self.max_context: int | None = info["max_context"]
        self.vocab_size: int | None = info["vocab_size"]
        self._max_prefill_tokens: int | None = info["max_prefill_tokens"]
        self._child_restarts = self._child_cut = 0
        if info.get("extras") is not None:  # the child's series at load: listed before the first step
            self._extras, self._gpu = info["extras"]
        logger.info("engine process %d ready (%d lanes)", self.child_pid, self.max_lanes)

    # ------------------------------------------------------------------ any thread

    @property
    def is_alive(self) -> bool:
        """True while the engine process runs, its events are read and the loop is not stopping or
        restarting."""
        proc = self._proc
        return (
            self._started
            and not self._stopping
            and not self._restarting
            and self.fatal_status is None
            and proc is not None
            and proc.is_alive()
        )

    @property
    def unavailable_reason(self) -> str | None:
        """Why `is_alive` is false, in a client's words (`/health`'s 503), or None."""
        if self.fatal_status is not None:
            return f"the engine process could not be kept running: {self.fatal_error}"
        if self._restarting:
            return "the engine process is being restarted after a failure"
        if self._stopping:
            return "the server is shutting down"
        return None if self.is_alive else "the engine process is not running"

    @property
    def num_inflight(self) -> int:
        """Requests submitted and not finished (decoding or waiting)."""
        return self._num_inflight

    @property
    def num_engine_restarts(self) -> int:
        """Engines rebuilt after a failure: in the engine process, and engine processes started again."""
        return self._restarts_base + self._child_restarts

    @property
    def num_cut(self) -> int:
        """Requests in flight aborted by abort_all() or stop() (not by their client)."""
        return self._cut_base + self._child_cut

    @property
    def max_prefill_tokens(self) -> int | None:
        """The prefill budget of the engine the child runs."""
        return self._max_prefill_tokens

    def gpu_memory(self) -> Any:
        """The engine process's CUDA memory as last shipped (`ignis.runtime.server.status.gpu_memory`)."""
        return self._gpu

    def collector(self) -> Collector:
        """The engine process's own Prometheus series (register it in the server's registry)."""
        return _ShippedCollector(self)

    def start(self) -> None:
        """Start reading the engine's events (idempotent): on the running event loop when there is one
        (an asyncio reader on the pipe: the events are decoded and queued on the loop's own thread,
        one wake-up a step, no thread hop), else in a reader thread."""
        if self._started:
            return
        self._started = True
        try:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
        except RuntimeError:
            self._loop = None
        self._attach()

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        checkpoint_at: Sequence[int] = (),
    ) -> RequestHandle:
        """`LaneLoop.submit`, across the process boundary.

        Raises:
            ServerBusyError: max_lanes + queue_size requests are already in flight.
            ServerUnavailableError: stopping, not running, or the engine process is being restarted.
        """
        handle = RequestHandle(prompt_token_ids, params, loop or asyncio.get_running_loop(), checkpoint_at)
        fields = _encode_params(params)
        with self._lock:
            if self._restarting:
                raise ServerUnavailableError(
                    "the engine process is being restarted after a failure; retry in a moment",
                    headers={"Retry-After": str(max(self.retry_after, 1))},
                )
            if self._stopping or self.fatal_status is not None or not self._started:
                raise ServerUnavailableError("the server is shutting down; no new requests are taken")
            if self._num_inflight >= self.max_lanes + self.queue_size:
                raise busy_error(self.max_lanes, self.queue_size, self.retry_after)
            wire = self._next_wire
            self._next_wire += 1
            handle.wire_id = wire  # type: ignore[attr-defined]
            self._handles[wire] = handle
            self._num_inflight += 1
            snap = self.snapshot
            self.snapshot = LaneSnapshot(
                snap.num_active, self._num_inflight - snap.num_active, snap.spec_samples
            )
            conn = self._commands
        self._send(conn, [_ADD, wire, handle.prompt_token_ids, fields, handle.checkpoint_at])
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Cancel a request (frees its lane before the next round); no-op once it finished."""
        with self._lock:
            if handle.is_done or handle.is_abort_requested:
                return
            handle.is_abort_requested = True
            conn = self._commands
        self._send(conn, [_ABORT, handle.wire_id])  # type: ignore[attr-defined]

    def abort_all(self) -> None:
        """Cancel every request in flight (each gets its last event with finish reason "abort")."""
        self._send(self._commands, [_ABORT_ALL])

    def stop(self, timeout: float | None = 30.0) -> None:
        """Abort every request in flight, stop the engine process (it writes the prompt checkpoints
        and closes the model) and the reading of its events (idempotent; waits up to `timeout` s for
        the process, then kills it)."""
        with self._lock:
            first = not self._stop_called
            self._stop_called = self._stopping = True
            conn = self._commands
        if first:
            self._send(conn, [_STOP])
            if not self._started:  # nobody reads the events yet: a reader thread for the last ones
                self._started = True
                self._attach()
            elif self._on_loop_thread():  # the loop cannot run its reader while we wait: read here
                events = self._events
                if events is not None:
                    self._detach(events)
                    while self._on_readable(events, detach=False):
                        if not events.poll(timeout):
                            break
        if not self._exited.wait(timeout):
            proc = self._proc
            if proc is not None and proc.is_alive():
                logger.warning("the engine process did not stop within %s s; killing it", timeout)
                proc.kill()
                proc.join(5.0)
            self._exited.wait(5.0)
        if self._finalizer is not None:
            self._finalizer()
        left = self._take_all()  # anything the child did not answer (it was killed)
        self._cut_base += len(left)
        for handle in left:
            self._release(handle, "abort")
        if left:
            _deliver([(h, TokenEvent((), "abort")) for h in left])

    def _send(self, conn: Connection | None, msg: list[Any]) -> None:
        if conn is None:
            return
        data = _pack(msg)
        with self._send_lock:
            try:
                conn.send_bytes(data)
            except (OSError, ValueError):  # the child is gone: its end-of-file fails what it held
                pass

    # ------------------------------------------------------------------ reading the events

    def _on_loop_thread(self) -> bool:
        return self._loop is not None and threading.get_ident() == self._loop_thread

    def _attach(self) -> None:
        """Read the current child's events: an asyncio reader on the loop (the pipe non-blocking), or a
        thread."""
        events = self._events
        assert events is not None
        self._buf = bytearray()
        if self._loop is not None and not self._loop.is_closed():
            os.set_blocking(events.fileno(), False)
            self._loop.add_reader(events.fileno(), self._on_readable, events)
        else:
            os.set_blocking(events.fileno(), True)  # (non-blocking if an event loop read it before)
            threading.Thread(
                target=self._read_thread, args=(events,), name="ignis-engine-reader", daemon=True
            ).start()

    def _detach(self, events: Connection) -> None:
        if self._loop is not None and not self._loop.is_closed() and not events.closed:
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                self._loop.remove_reader(events.fileno())

    def _read_thread(self, events: Connection) -> None:
        while self._on_readable(events, detach=False):  # blocking reads
            pass

    def _on_readable(self, events: Connection, detach: bool = True) -> bool:
        """Read what the events pipe holds (one `read`), apply every whole message in it and deliver
        their events at once. Returns False at end of file (the child exited), after handing over to
        `_after_exit`.

        The pipe carries `Connection.send_bytes` frames (a 4-byte big-endian length, then the bytes);
        they are parsed here, so that one system call drains every step waiting (no `poll` per
        message)."""
        items: list[tuple[RequestHandle, TokenEvent | ErrorEvent]] = []
        eof = False
        try:
            chunk = os.read(events.fileno(), 1 << 20)
        except BlockingIOError:
            return True
        except (OSError, ValueError):
            chunk = b""
        if not chunk:
            eof = True
        buf = self._buf
        buf += chunk
        pos, end = 0, len(buf)
        while end - pos >= 4:
            (size,) = _FRAME.unpack_from(buf, pos)
            if end - pos - 4 < size:
                break
            self._on_message(_unpack(bytes(buf[pos + 4 : pos + 4 + size])), items)
            pos += 4 + size
        if pos:
            del buf[:pos]
        if items:
            if self._on_loop_thread():
                loop = self._loop
                for handle, event in items:
                    if isinstance(event, ErrorEvent) or event.finish_reason is not None:
                        handle.is_done = True
                    if handle._loop is loop:
                        handle._queue.put_nowait(event)
                    else:
                        _deliver([(handle, event)])
            else:
                _deliver(items)
        if eof:
            if detach:
                self._detach(events)
            threading.Thread(target=self._after_exit, name="ignis-engine-supervisor", daemon=True).start()
        return not eof

    def _on_message(self, msg: list[Any], items: list[tuple[RequestHandle, TokenEvent | ErrorEvent]]) -> None:
        kind = msg[0]
        if kind == _STEP:
            self._on_step(msg, items)
        elif kind == _STOPPED:
            self._child_cut = int(msg[1])
            self._clean_exit = True

    # ------------------------------------------------------------------ the supervisor

    def _release(self, handle: RequestHandle, finish_reason: str | None) -> None:
        if self.metrics is not None and finish_reason is not None:
            self.metrics.request_finished(handle, finish_reason, time.monotonic())

    def _take_all(self) -> list[RequestHandle]:
        with self._lock:
            handles = list(self._handles.values())
            self._handles.clear()
            self._num_inflight -= len(handles)
        return handles

    def _after_exit(self) -> None:
        """The child's events ended: wait for it; if it did not stop on request, fail its requests and
        start another (module docstring)."""
        proc = self._proc
        clean = self._clean_exit
        for conn in (self._commands, self._events):
            with contextlib.suppress(OSError):
                conn.close()  # type: ignore[union-attr]
        proc.join(5.0 if clean else 30.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
        if clean or self._stopping:
            self._exited.set()
            return
        code = proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited ({code})"
        logger.error("the engine process %s %s", self.child_pid, how)
        with self._lock:
            self._restarting = True
            handles = list(self._handles.values())
            self._handles.clear()
            self._num_inflight -= len(handles)
            # the dead child's lanes are free: its last step's gauges must not outlive it
            self.snapshot = LaneSnapshot(0, self._num_inflight, self.snapshot.spec_samples)
        err = EngineFailedError(
            f"the engine process {how} while serving this request; the server restarts it"
        )
        for handle in handles:
            self._release(handle, "error")
        _deliver([(h, ErrorEvent(err)) for h in handles])
        self._restarts_base += self._child_restarts + 1
        self._cut_base += self._child_cut
        self._spec_base = _spec_totals(self.snapshot.spec_samples)
        now = time.monotonic()
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > RESTART_WINDOW_S:
            self._deaths.popleft()
        if code == _EXIT_ARTIFACT_CHANGED:
            self._give_up(code, "the artifact was modified in place (see the engine process's log)")
            return
        if len(self._deaths) > MAX_RESTARTS:
            self._give_up(1, f"the engine process died {len(self._deaths)} times in {RESTART_WINDOW_S:.0f} s")
            return
        try:
            self._spawn()
        except BaseException as exc:
            self._give_up(1, f"the engine process could not be started again: {exc}")
            return
        self._clean_exit = False
        with self._lock:
            self._restarting = False
            stopping = self._stopping
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._attach)
            except RuntimeError:  # the loop closed meanwhile: read in a thread
                self._loop = None
                self._attach()
        else:
            self._attach()
        if stopping:  # stop() came while the new child loaded
            self._send(self._commands, [_STOP])

    def _give_up(self, status: int, why: str) -> None:
        logger.critical("giving up on the engine process: %s; the server shuts down", why)
        self.fatal_error = why
        self.fatal_status = status
        with self._lock:
            self._restarting = False
        self._exited.set()
        if self.on_fatal is not None:
            self.on_fatal()

    def _on_step(self, msg: list[Any], items: list[tuple[RequestHandle, TokenEvent | ErrorEvent]]) -> None:
        _, now, active, spec, restarts, cut, admitted, events, extras = msg
        if admitted and self.metrics is not None:
            for wire in admitted:
                handle = self._handles.get(wire)
                if handle is not None:
                    self.metrics.request_admitted(handle)
        self._on_events(now, events, items)
        self._child_restarts, self._child_cut = restarts, cut
        if extras is not None:
            self._extras, self._gpu = extras
        spec_samples = self.snapshot.spec_samples
        if spec is not None:
            spec_samples = _spec_samples(spec, self._spec_base)
        with self._lock:
            waiting = max(0, self._num_inflight - active)
        self.snapshot = LaneSnapshot(num_active=active, num_waiting=waiting, spec_samples=spec_samples)

    def _on_events(
        self, now: float, events: list[list[Any]], items: list[tuple[RequestHandle, TokenEvent | ErrorEvent]]
    ) -> None:
        emitted: list[tuple[RequestHandle, int]] = []
        finished: list[tuple[RequestHandle, str | None]] = []
        for wire, enc in events:
            handle = self._handles.get(wire)
            if handle is None:
                continue
            event, final, reason = _decode_event(enc)
            if isinstance(event, TokenEvent) and event.token_ids:
                emitted.append((handle, len(event.token_ids)))
                handle.num_emitted += len(event.token_ids)
            if final:
                finished.append((handle, reason))
            items.append((handle, event))
        if finished:
            with self._lock:
                for handle, _ in finished:
                    self._handles.pop(handle.wire_id, None)  # type: ignore[attr-defined]
                self._num_inflight -= len(finished)
        if self.metrics is not None:
            if emitted:
                self.metrics.step_emitted(emitted, now)
            for handle, reason in finished:
                if reason is not None:
                    self.metrics.request_finished(handle, reason, now)


def _spec_totals(samples: Sequence[tuple[str, dict[str, str], int]]) -> dict[Any, int]:
    return {(name, tuple(sorted(labels.items()))): int(value) for name, labels, value in samples}


def _spec_samples(spec: list[Any], base: dict[Any, int]) -> tuple[tuple[str, dict[str, str], int], ...]:
    """The shipped speculative counters, plus those of engine processes that died (counters never go
    back across a restart of the engine process, as across an engine rebuild)."""
    out = []
    seen = set()
    for name, labels, value in spec:
        key = (name, tuple(sorted(labels.items())))
        seen.add(key)
        out.append((name, dict(labels), int(value) + base.get(key, 0)))
    for key, value in base.items():
        if key not in seen:
            out.append((key[0], dict(key[1]), value))
    return tuple(out)


def _died_loading(code: int | None) -> str:
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"
    return (
        f"the engine process {how} before its model was loaded (its traceback, if any, is in the log "
        "above; a model source must be importable by name and unpickle in a new process)"
    )


def _rebuild(kind: str, message: str, blob: bytes) -> BaseException:
    """The child's load exception: itself when it unpickles, else an IgnisRuntimeError saying what it was."""
    if blob:
        try:
            exc = pickle.loads(blob)
            if isinstance(exc, BaseException):
                return exc
        except Exception:
            pass
    return IgnisRuntimeError(f"the engine process could not load the model: {kind}: {message}")
