"""Reaching a coordinator: connecting while it may not be up yet, and the addresses involved.

Ranks (:mod:`flodl.worker.link`) and node agents (:mod:`flodl.agent.link`) both start in any
order with their coordinator, so both connect through :func:`reach_patiently`.
"""

from __future__ import annotations

import logging
import socket

import trio

from flodl.errors import CoordinatorError, FlodlError, TransportError
from flodl.transports import connect, parse_url

__all__ = ["host_of", "local_address", "reach_patiently"]

log = logging.getLogger(__name__)


def host_of(url: str) -> str:
    """The host of a ``tcp://`` URL; 127.0.0.1 for a unix socket (same host)."""
    parsed = parse_url(url)
    return parsed.host if parsed.scheme == "tcp" and parsed.host else "127.0.0.1"


def local_address(stream: trio.abc.Stream) -> str:
    """This host's address on the connection ``stream`` (the interface that reaches the
    coordinator, so its peers can reach this rank there too); 127.0.0.1 for a stream that is
    not an IP socket (unix://, memory://)."""
    sock = getattr(stream, "socket", None)
    if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
        address: str = sock.getsockname()[0]
        return address
    return "127.0.0.1"


FIRST_RETRY_S = 0.1
LAST_RETRY_S = 2.0
"""Waits between attempts to reach a coordinator that is not up yet: doubling, at most this."""


async def reach_patiently(url: str, timeout: float, who: str) -> trio.abc.Stream:
    """A stream to the coordinator at ``url``, trying again (waits doubling from 0.1 s to 2 s)
    while nothing listens there yet, for up to ``timeout`` seconds: ranks, agents and their
    coordinator may start in any order. The first failed attempt is logged (a warning: who
    waits for what, and for how long). CoordinatorError naming ``who`` and the last error
    after that. Cancellable at any point (nothing is left open)."""
    wait = FIRST_RETRY_S
    last: FlodlError | None = None
    with trio.move_on_after(timeout):
        while True:
            try:
                return await connect(url)
            except TransportError as err:
                if last is None:
                    log.warning(
                        "%s: no coordinator at %s yet; trying again for up to %g s",
                        who,
                        url,
                        timeout,
                    )
                last = err
            await trio.sleep(wait)
            wait = min(wait * 2, LAST_RETRY_S)
    raise CoordinatorError(
        f"{who}: no coordinator at {url} within the join timeout ({timeout:g} s): {last}"
    )
