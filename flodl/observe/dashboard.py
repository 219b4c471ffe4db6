"""The live web dashboard: hypercorn serving :class:`~flodl.observe.dashboard_app.DashboardApp`
from the coordinator's own trio run.

The server is hypercorn's (HTTP/1.1 parsing, keep-alive, limits), never a hand-written one.
Its limits cut off slow or hostile clients: a request line plus headers over
:data:`MAX_HEAD_BYTES` is answered 431 and the connection closed; a connection that has not
sent a whole request within :data:`IDLE_TIMEOUT_S` of opening (or of its last answer) is
closed, however slowly it trickles bytes; a receive that waits over :data:`READ_TIMEOUT_S`
closes it too. Each connection is its own task, reading only observer state, so clients cost
the coordinator CPU time only, and bounded amounts of it (see dashboard_app).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import trio

from flodl.observe.hub import Observer

__all__ = ["IDLE_TIMEOUT_S", "MAX_HEAD_BYTES", "READ_TIMEOUT_S", "serve"]

MAX_HEAD_BYTES = 16 * 1024
"""Request line and headers together (HTTP/1.1; the HTTP/2 header list has the same cap)."""
IDLE_TIMEOUT_S = 5.0
"""A connection with no whole request in this long is closed (hypercorn's keep-alive timer,
which runs from the connection's start and from each answer, until a request is complete)."""
READ_TIMEOUT_S = 10.0
"""A single receive waiting this long closes the connection."""

_log = logging.getLogger("flodl.dashboard")
"""hypercorn's error log: warnings and worse reach stderr through logging's defaults; its
"Running on" line does not (the launcher prints the URL)."""


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
    listener and every connection (hypercorn gives open ones up to 3 s to finish an answer in
    progress). An address that cannot be bound raises OSError before it is started.
    """
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    from flodl.observe.dashboard_app import DashboardApp
    from flodl.observe.metrics import RunMetrics

    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.h11_max_incomplete_size = MAX_HEAD_BYTES
    config.h2_max_header_list_size = MAX_HEAD_BYTES
    config.keep_alive_timeout = IDLE_TIMEOUT_S
    config.read_timeout = int(READ_TIMEOUT_S)
    config.graceful_timeout = 3.0
    config.accesslog = None
    config.errorlog = _log
    config.include_server_header = False
    # hypercorn types its scopes as TypedDicts; the app reads them as plain mappings.
    app: Any = DashboardApp(observer, token, RunMetrics(observer))
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn_serve, app, config, mode="asgi"))
        task_status.started(f"{binds[0]}/")
