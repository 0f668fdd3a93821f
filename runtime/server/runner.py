"""Run the server: bind the sockets, serve the app with uvicorn (HTTP/1.1, h11), shut down cleanly.

`IgnisServer(model, options)` wires a `ServedModel` to a `LaneLoop`, its metrics and the app.
`run()` serves in the main thread until SIGTERM or SIGINT; `serve()` is the coroutine behind it (tests
run it in a thread and stop it with `request_exit()`).

Shutdown (SIGTERM, SIGINT, `request_exit`): the listening sockets close at once (new connections are
refused), requests in flight finish for up to `shutdown_timeout` seconds, then the ones left are
aborted (a stream ends with finish_reason "abort" and [DONE], a plain request returns what it has),
uvicorn cancels anything still running 2 s later, the lane loop stops, the Unix socket file is
removed (only if it is still the one this server created) and the model is closed. A SIGTERM ends
`run()` normally.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn

from ignis.runtime.metrics import SpeculativeMetrics
from ignis.runtime.server.app import create_app
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

    def __post_init__(self) -> None:
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
    """uvicorn's server, telling us when its shutdown begins (to abort lanes after the grace period)."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_shutdown()
        await super().shutdown(sockets=sockets)


class _Terminated(BaseException):
    """Raised by our SIGTERM/SIGINT handler outside uvicorn's own handling (load, cleanup)."""


class IgnisServer:
    """The server over one model (module docstring).

    Args:
        model: the loaded model.
        options: listeners, lanes and queue.

    Raises:
        IgnisRuntimeError: the model's engine cannot be built.
    """

    def __init__(self, model: ServedModel, options: ServerOptions) -> None:
        self.model = model
        self.options = options
        self.lanes = LaneLoop(
            model.make_engine,
            max_lanes=options.lanes,
            queue_size=options.queue_size,
            retry_after=options.retry_after,
            spec_metrics=SpeculativeMetrics(),
        )
        self.metrics = ServerMetrics(lambda: self.lanes.snapshot, options.lanes)
        for collector in model.collectors:  # the model's own series (e.g. the expert cache's)
            self.metrics.registry.register(collector)
        self.lanes.metrics = self.metrics
        self.app = create_app(model, self.lanes, self.metrics)
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
            logger.info("listening on http://%s:%d", host, port)

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
            server = _Uvicorn(config, on_shutdown=self._cancel_after_grace)
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

    def run(self) -> None:
        """Serve in the main thread until SIGTERM or SIGINT (then shut down gracefully and return)."""

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
