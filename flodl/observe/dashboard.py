"""The live web dashboard: hypercorn serving :class:`~flodl.observe.dashboard_app.DashboardApp`
from the coordinator's own trio run.

The server is hypercorn's (HTTP/1.1 parsing, keep-alive, limits), never a hand-written one.
Its limits cut off slow or hostile clients: a request line plus headers over
:data:`MAX_HEAD_BYTES` is answered 431 and the connection closed; a connection that has not
sent a whole request within :data:`IDLE_TIMEOUT_S` of opening (or of its last answer) is
closed, however slowly it trickles bytes; a receive that waits over :data:`READ_TIMEOUT_S`
closes it too; when the dashboard stops, every connection is closed at once. Each connection
is its own task, reading only observer state, so clients cost the coordinator CPU time only,
and bounded amounts of it (see dashboard_app).
"""

from __future__ import annotations

import logging
import socket
import weakref
from functools import partial
from typing import Any, cast

import trio

from flodl.errors import ConfigError
from flodl.observe.hub import Observer

__all__ = ["IDLE_TIMEOUT_S", "MAX_HEAD_BYTES", "READ_TIMEOUT_S", "serve"]

MAX_HEAD_BYTES = 16 * 1024
MAX_CONNECTIONS = 64
"""Connections served at once; more wait to be accepted (they cost nothing meanwhile)."""
"""Request line and headers together (HTTP/1.1; the HTTP/2 header list has the same cap)."""
IDLE_TIMEOUT_S = 5.0
"""A connection with no whole request in this long is closed (hypercorn's keep-alive timer,
which runs from the connection's start and from each answer, until a request is complete)."""
READ_TIMEOUT_S = 10.0
"""A single receive waiting this long closes the connection."""

_log = logging.getLogger("flodl.dashboard")
"""hypercorn's error log: warnings and worse reach stderr through logging's defaults; its
"Running on" line does not (the launcher prints the URL)."""


class _Connections(trio.abc.Listener[trio.SocketStream]):
    """A listener that remembers the connections it accepted, so that they can all be closed
    at once: hypercorn shields its sends, so a client that asks and never reads would
    otherwise hold its connection's task, and so the end of the run, forever."""

    def __init__(self, inner: trio.SocketListener) -> None:
        self._inner = inner
        self._open: weakref.WeakSet[trio.SocketStream] = weakref.WeakSet()
        self.slots = trio.Semaphore(MAX_CONNECTIONS)
        """One per open connection: beyond, new ones wait in the listen backlog."""

    async def accept(self) -> trio.SocketStream:
        await self.slots.acquire()
        try:
            stream = await self._inner.accept()
        except BaseException:
            self.slots.release()
            raise
        self._open.add(stream)
        return stream

    async def aclose(self) -> None:
        await self._inner.aclose()

    def close_all(self) -> None:
        """Close the listening socket and every connection now (no checkpoint): a task
        blocked sending on one gets ClosedResourceError, which hypercorn takes as the client
        gone."""
        self._inner.socket.close()
        for stream in list(self._open):
            stream.socket.close()


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on ``host:port`` (as hypercorn would make it); ConfigError naming
    the address if it cannot be had (the socket is closed then)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        raise ConfigError(f"--dashboard {host}:{port}: cannot listen there: {err}") from None
    sock.setblocking(False)
    return sock


async def serve(
    observer: Observer,
    host: str,
    port: int,
    token: str | None,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the dashboard on ``host:port`` (port 0: any free one) until cancelled.

    Started (``nursery.start``) once it listens, with its URL (``http://HOST:PORT/``, the real
    port). ``token``: None, or the token every request must present. Cancellation closes the
    listener and every connection at once, answers in progress included, so no client can
    hold up the end of the run. An address it cannot listen on raises ConfigError (naming
    it) before it is started.
    """
    from hypercorn.config import Config
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import repr_socket_addr, wrap_app

    from flodl.observe.dashboard_app import DashboardApp
    from flodl.observe.metrics import RunMetrics

    config = Config()
    config.h11_max_incomplete_size = MAX_HEAD_BYTES
    config.h2_max_header_list_size = MAX_HEAD_BYTES
    config.keep_alive_timeout = IDLE_TIMEOUT_S
    config.read_timeout = int(READ_TIMEOUT_S)
    config.accesslog = None
    config.errorlog = _log
    config.include_server_header = False
    # hypercorn types its scopes as TypedDicts; the app reads them as plain mappings.
    app: Any = DashboardApp(observer, token, RunMetrics(observer))
    # hypercorn.trio.serve, less its lifespan (the app has nothing to start) and with a
    # listener of our own (_Connections), so that the end can close every connection.
    sock = _listen(host, port, config.backlog)
    listener = _Connections(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
    url = f"http://{repr_socket_addr(sock.family, sock.getsockname())}/"
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    context, state = WorkerContext(None), ConnectionState({})

    async def connection(stream: trio.SocketStream) -> None:
        # One connection's failure is logged, never the run's: it would cancel the views'
        # nursery and, through it, the coordinator's.
        try:
            # hypercorn types the stream as TLS; a plain one is what its own serve passes too.
            await TCPServer(wrapped, config, context, state, cast(Any, stream))
        except Exception:
            _log.exception("dashboard connection failed")
        finally:
            listener.slots.release()

    async with trio.open_nursery() as handlers:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(
                        trio.serve_listeners,
                        connection,
                        [listener],
                        handler_nursery=handlers,
                    )
                )
                task_status.started(url)
        finally:
            listener.close_all()
