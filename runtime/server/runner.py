"""Run the server: bind the sockets, serve the app with uvicorn (HTTP/1.1, h11), shut down cleanly.

`IgnisServer(model, options)` wires a `ServedModel` to a `LaneLoop`, its metrics and the app; with
`engine=EngineSpec(...)` the engine runs in a child process instead (`ProcessLaneLoop`,
`ignis.runtime.server.engine_process`), which exits non-zero if that process cannot be kept running.
`run()` serves in the main thread until SIGTERM or SIGINT; `serve()` is the coroutine behind it (tests
run it in a thread and stop it with `request_exit()`).

Shutdown (SIGTERM, SIGINT, `request_exit`): the listening sockets close at once (new connections are
refused), requests in flight finish for up to `shutdown_timeout` seconds, then the ones left are
aborted (a stream ends with finish_reason "abort" and [DONE], a plain request returns what it has),
uvicorn cancels anything still running 2 s later, the lane loop stops, the Unix socket file is
removed (only if it is still the one this server created), the prompt checkpoints are written to
their snapshot directory (`--checkpoint-dir`) and the model is closed. A second SIGINT
or SIGTERM cancels the requests in flight at once (their streams still end with finish_reason
"abort" and [DONE]); a third stops waiting for connections. `run()` returns the exit status: 0 when
every request in flight finished, 1 when some were cut.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.server.app import create_app
from ignis.runtime.server.auth import check_api_key
from ignis.runtime.server.checkpoints import PromptCheckpointCollector
from ignis.runtime.server.lanes import LaneLoop
from ignis.runtime.server.metrics import ServerMetrics
from ignis.runtime.server.model import ServedModel
from ignis.runtime.server.sockets import (
    BoundUnixSocket,
    SocketError,
    bind_tcp_socket,
    bind_unix_socket,
    remove_unix_socket,
)

if TYPE_CHECKING:
    from ignis.runtime.server.engine_process import EngineSpec, ProcessLaneLoop

__all__ = ["IgnisServer", "ServerOptions"]

logger = logging.getLogger("ignis.runtime.server")


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and queues.

    Attributes:
        socket: Unix socket path, or None.
        socket_group: group of the socket (mode 0660), or None (mode 0600).
        host: TCP host, or None (with a port: 127.0.0.1).
        port: TCP port, or None for no TCP listener (0 picks a free port).
        lanes: lanes decoding at once (>= 1).
        queue_size: requests that may wait for a lane beyond `lanes` (>= 0); past it, 503.
        retry_after: seconds in the Retry-After header of a 503 (>= 0).
        shutdown_timeout: seconds requests in flight may take to finish at shutdown before they are
            cancelled (>= 0).
        log_level: uvicorn's log level name.
        access_log: log one line per HTTP request.
        api_key: the key every endpoint but /health requires (`Authorization: Bearer KEY`), or None.
        max_request_bytes: request bodies over this many bytes get 413 (>= 1024); None: room for a
            prompt that fills the context (`ignis.runtime.server.app.default_max_body_bytes`).
    """

    socket: str | None = None
    socket_group: str | None = None
    host: str | None = None
    port: int | None = None
    lanes: int = 8
    queue_size: int = 64
    retry_after: int = 1
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    access_log: bool = True
    api_key: str | None = field(default=None, repr=False)
    max_request_bytes: int | None = None

    def __post_init__(self) -> None:
        check_api_key(self.api_key)
        if self.max_request_bytes is not None and self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.socket is None and self.port is None:
            raise ValueError("give a Unix socket path or a TCP port to listen on")
        if self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")
        if self.queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {self.queue_size}")
        if self.retry_after < 0 or self.shutdown_timeout < 0:
            raise ValueError("retry_after and shutdown_timeout must be >= 0")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0..65535, got {self.port}")


_CANCEL_GRACE = 2.0  # seconds uvicorn waits after the lanes were aborted before it cancels tasks


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, telling us when its shutdown begins (to abort lanes after the grace period),
    with our own handling of repeated signals (`handle_exit`)."""

    def __init__(
        self, config: uvicorn.Config, on_shutdown: Callable[[], None], on_cut: Callable[[], None]
    ) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown
        self._on_cut = on_cut
        self.num_signals = 0

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGINT / SIGTERM. The first starts the graceful shutdown; the second cancels the requests in
        flight now (each stream still ends with finish_reason "abort" and [DONE]); a third stops
        waiting for connections. The signal is not re-raised after serving (uvicorn's default would
        raise it into our cleanup, logging tracebacks)."""
        self.num_signals += 1
        if self.num_signals == 1:
            logger.info("signal %d: shutting down (send it again to cancel the requests in flight)", sig)
            self.should_exit = True
        elif self.num_signals == 2:
            logger.warning("signal %d again: cancelling the requests in flight", sig)
            self.should_exit = True
            self._on_cut()
        else:
            logger.warning("signal %d a third time: closing every connection now", sig)
            self.force_exit = True


class _ShutdownHint(logging.Filter):
    """Rewrites uvicorn's "(CTRL+C to force quit)" shutdown lines: here a second signal cancels the
    requests in flight cleanly (`_Uvicorn.handle_exit`) rather than forcing an exit."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.endswith("(CTRL+C to force quit)"):
            record.msg = record.msg.replace(
                "(CTRL+C to force quit)", "(Ctrl+C or SIGTERM again cancels the requests in flight)"
            )
        return True


logging.getLogger("uvicorn.error").addFilter(_ShutdownHint())


class _Terminated(BaseException):
    """Raised by our SIGTERM/SIGINT handler outside uvicorn's own handling (load, cleanup)."""


class IgnisServer:
    """The server over one model (module docstring).

    Args:
        model: the loaded model (in engine-process mode its text side: `load_text_model`).
        options: listeners, lanes and queue.
        engine: run the engine in a child process that loads this (`ignis-run --engine-process`,
            `ignis.runtime.server.engine_process`); None: in a thread of this process.

    Raises:
        IgnisRuntimeError: the model's engine cannot be built.
    """

    def __init__(
        self, model: ServedModel, options: ServerOptions, *, engine: EngineSpec | None = None
    ) -> None:
        self.model = model
        self.options = options
        self.lanes: LaneLoop | ProcessLaneLoop
        if engine is not None:  # the engine in its own process (engine_process.py)
            from ignis.runtime.server.engine_process import ProcessLaneLoop

            self.lanes = ProcessLaneLoop(
                engine,
                max_lanes=options.lanes,
                queue_size=options.queue_size,
                retry_after=options.retry_after,
                on_fatal=self.request_exit,
            )
        else:
            self.lanes = LaneLoop(
                model.make_engine,
                max_lanes=options.lanes,
                queue_size=options.queue_size,
                retry_after=options.retry_after,
                spec_metrics=SpeculativeMetrics(),
            )
        self.metrics = ServerMetrics(lambda: self.lanes.snapshot, options.lanes)
        if engine is not None:  # the engine process's series (prompt checkpoints, expert cache)
            self.metrics.registry.register(self.lanes.collector())  # type: ignore[union-attr]
        elif model.prefix_cache is not None:  # the prompt checkpoint pool's counters and gauges
            self.metrics.registry.register(PromptCheckpointCollector(model.prefix_cache))
        for collector in model.collectors if engine is None else ():  # the model's own (expert cache)
            self.metrics.registry.register(collector)
        self.lanes.metrics = self.metrics
        self.app = create_app(
            model,
            self.lanes,
            self.metrics,
            api_key=options.api_key,
            max_body_bytes=options.max_request_bytes,
        )
        self.unix_socket: BoundUnixSocket | None = None
        self.tcp_socket: socket.socket | None = None
        self.started = threading.Event()
        self._uvicorn: uvicorn.Server | None = None
        self._cancel_task: asyncio.Future[None] | None = None
        self._exit_requested = False

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        """(host, port) of the TCP listener once bound, else None."""
        if self.tcp_socket is None:
            return None
        addr = self.tcp_socket.getsockname()
        return str(addr[0]), int(addr[1])

    def bind(self) -> None:
        """Create the listening sockets (idempotent).

        Raises:
            SocketError: see `bind_unix_socket` and `bind_tcp_socket`.
        """
        o = self.options
        if o.socket is not None and self.unix_socket is None:
            self.unix_socket = bind_unix_socket(o.socket, group=o.socket_group)
            logger.info("listening on unix socket %s", self.unix_socket.path)
        if o.port is not None and self.tcp_socket is None:
            try:
                self.tcp_socket = bind_tcp_socket(o.host or "127.0.0.1", o.port)
            except SocketError:
                self._release_sockets()
                raise
            host, port = self.tcp_socket.getsockname()[:2]
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            logger.info("listening on %s (the Playground: %s/playground/)", url, url)

    def request_exit(self) -> None:
        """Start a graceful shutdown (thread-safe)."""
        self._exit_requested = True
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    async def serve(self) -> None:
        """Bind (if not yet), serve until asked to exit, then clean up (module docstring)."""
        try:
            self.bind()
            config = uvicorn.Config(
                self.app,
                http="h11",
                ws="none",
                lifespan="on",
                log_config=None,
                log_level=self.options.log_level,
                access_log=self.options.access_log,
                # Past shutdown_timeout the lanes are aborted (each stream then ends with finish_reason
                # "abort" and [DONE]); uvicorn cancels whatever is still running a little later.
                timeout_graceful_shutdown=math.ceil(self.options.shutdown_timeout + _CANCEL_GRACE),
                server_header=False,
            )
            loop = asyncio.get_running_loop()
            server = _Uvicorn(
                config,
                on_shutdown=self._cancel_after_grace,
                on_cut=lambda: loop.call_soon_threadsafe(self.lanes.abort_all),
            )
            self._uvicorn = server
            if self._exit_requested:
                server.should_exit = True
            sockets = [s for s in (self.unix_socket.sock if self.unix_socket else None, self.tcp_socket) if s]
            watcher = asyncio.ensure_future(self._watch_started(server))
            try:
                await server.serve(sockets=sockets)
            finally:
                watcher.cancel()
                if self._cancel_task is not None:
                    self._cancel_task.cancel()
        finally:
            self.lanes.stop()
            self._release_sockets()
            in_process = not hasattr(self.lanes, "child_pid")  # else the engine process saved them
            if in_process and self.model.save_checkpoints is not None:  # the snapshot dir, for a warm restart
                try:
                    self.model.save_checkpoints()
                except Exception:
                    logger.exception("shutdown: the prompt checkpoints could not be saved")
            if self.model.close is not None:
                self.model.close()
            self.started.clear()

    def _cancel_after_grace(self) -> None:
        async def cancel() -> None:
            await asyncio.sleep(self.options.shutdown_timeout)
            if self.lanes.num_inflight:
                logger.info("shutdown: cancelling %d request(s) still in flight", self.lanes.num_inflight)
            self.lanes.abort_all()

        self._cancel_task = asyncio.ensure_future(cancel())

    async def _watch_started(self, server: uvicorn.Server) -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        self.started.set()

    def _release_sockets(self) -> None:
        if self.unix_socket is not None:
            remove_unix_socket(self.unix_socket)
            self.unix_socket = None
        if self.tcp_socket is not None:
            self.tcp_socket.close()
            self.tcp_socket = None

    def run(self) -> int:
        """Serve in the main thread until SIGTERM or SIGINT, shut down (module docstring) and return the
        process exit status: 0 when every request in flight finished, 1 when some were cut (past
        the shutdown timeout, or by a second signal)."""

        def on_signal(signum: int, frame: FrameType | None) -> None:
            raise _Terminated(signum)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            asyncio.run(self.serve())
        except _Terminated as exc:
            logger.info("stopped by signal %d", exc.args[0])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        fatal = getattr(self.lanes, "fatal_status", None)
        if fatal:  # the engine process could not be kept running (engine_process.py)
            logger.error("exiting with status %d: %s", fatal, getattr(self.lanes, "fatal_error", ""))
            return int(fatal)
        if self.lanes.num_cut:
            logger.warning("exiting with status 1: %d request(s) were cut at shutdown", self.lanes.num_cut)
            return 1
        return 0
