"""Where other libraries' errors become flodl's: one table per backend, one :func:`map_exceptions`.

A transport sits on two vocabularies that are not ours: trio's stream errors
(``BrokenResourceError``, ``ClosedResourceError``) and the operating system's ``OSError``.
Code that touches them says which table applies and what it was doing::

    with map_exceptions(STREAM_ERRORS, "cannot send SyncNow"):
        await stream.send_all(data)          # a broken stream raises BrokenChannel

    with map_exceptions(SOCKET_ERRORS, f"cannot connect to {url}"):
        sock = await trio.open_tcp_stream(host, port)   # OSError -> TransportError

The tables (modelled on httpcore's ``map_exceptions`` with one table per backend):

* :data:`STREAM_ERRORS`: any trio stream (sockets, ``memory://``, trio's own test streams).
  Broken or closed, the connection is unusable: :class:`~flodl.errors.BrokenChannel`.
* :data:`SOCKET_ERRORS`: opening, binding or accepting an OS socket (tcp://, unix://):
  :class:`~flodl.errors.TransportError`.

Guarantees of :func:`map_exceptions`: an exception that is an instance of a table's key (the
first matching key, in the table's order) is replaced by the key's value, raised ``from`` the
original so the cause stays in the traceback, with the message ``"<context>: <original>"``
(the original's repr where its text is empty). Any other exception, including a flodl error
raised inside the block, ``trio.Cancelled`` and every ``BaseException`` that is not an
``Exception``, passes through unchanged. Nothing happens on a clean exit. The object holds
no state between uses, so one built ahead (a constant context) may be entered again and by
several tasks at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import TracebackType

import trio

from flodl.errors import BrokenChannel, TransportError

__all__ = [
    "SOCKET_ERRORS",
    "STREAM_ERRORS",
    "ExceptionTable",
    "map_exceptions",
]

ExceptionTable = Mapping[type[Exception], Callable[[str], Exception]]
"""Library error type -> the flodl error (a constructor taking the message) that replaces it."""

STREAM_ERRORS: ExceptionTable = {
    trio.BrokenResourceError: BrokenChannel,
    trio.ClosedResourceError: BrokenChannel,
}
"""A trio stream that broke or was closed under the caller."""

SOCKET_ERRORS: ExceptionTable = {OSError: TransportError}
"""The OS refused to open, bind or accept a socket."""


class _ExceptionMap:
    """The context manager :func:`map_exceptions` returns."""

    __slots__ = ("_context", "_table")

    def __init__(self, table: ExceptionTable, context: str | Callable[[], str]) -> None:
        self._table = table
        self._context = context

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not isinstance(exc, Exception):
            return  # a clean exit, or a Cancelled/KeyboardInterrupt: never ours to map
        for source, target in self._table.items():
            if isinstance(exc, source):
                context = self._context if isinstance(self._context, str) else self._context()
                raise target(f"{context}: {str(exc) or repr(exc)}") from exc


def map_exceptions(table: ExceptionTable, context: str | Callable[[], str]) -> _ExceptionMap:
    """A context manager that re-raises the errors of ``table`` as flodl errors (module doc).

    ``context`` says what the block was doing ("cannot send SyncNow"); pass a function to
    build it only when an error is mapped (it costs nothing on the way through).
    """
    return _ExceptionMap(table, context)
