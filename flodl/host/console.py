"""How ``flodl run`` stops on a signal, and the teardown that leaves no process behind.

Signals belong to the launcher. Each rank is started in a session of its own
(``start_new_session``), so the SIGINT a terminal sends to its whole foreground process group on
Ctrl-C, and the SIGHUP it sends when it closes, reach the launcher only, never a rank. The
launcher turns the first SIGINT, SIGTERM or SIGHUP (unless SIGHUP was ignored when it started:
``nohup``; see :mod:`flodl.host.hangup`) into ``ShutdownWithSave(GRACEFUL)`` (every live rank writes
its bundle at its next batch boundary and exits), and a later SIGINT or SIGTERM into SIGKILL of
every rank's process group. A later SIGHUP changes nothing: a closing terminal may send it twice
(the kernel to its foreground group, the shell to its jobs), and the save must go on. Its
output lost, the launcher goes on silently (:func:`say`). A rank whose launcher
is gone (even SIGKILLed) sees its coordinator's connection close and gives up on its own, so a
rank in its own session never outlives its launcher for long; the launcher's own teardown kills
each rank's whole process group (a rank's children included).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TextIO

from flodl.host.hangup import reader_gone

if TYPE_CHECKING:
    pass


__all__ = ["LinePrinter", "printing_through", "say", "silence", "unread_is_fine"]


def silence(*streams: TextIO) -> None:
    """Send the rest of each stream nowhere: its reader is gone (``| tee`` died of the same
    Ctrl-C, or the terminal closed). The run must still save and write its summary; only the
    echo is lost. Streams without a file descriptor are left as they are."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for stream in streams:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                os.dup2(devnull, stream.fileno())
    finally:
        os.close(devnull)


@contextlib.contextmanager
def unread_is_fine() -> Iterator[None]:
    """For the block: a write whose reader is gone (a broken pipe, a terminal that hung up)
    ends the block quietly and silences stdout and stderr from then on. Other errors are
    raised. Put only printing in it: what follows the failed write is skipped."""
    try:
        yield
    except OSError as err:
        if not reader_gone(err):
            raise
        silence(sys.stdout, sys.stderr)


LinePrinter = Callable[[str, TextIO | None], None]
"""Takes over :func:`say`'s lines (the text, and the stream it was asked to print on)."""

_printer: LinePrinter | None = None


@contextlib.contextmanager
def printing_through(printer: LinePrinter) -> Iterator[None]:
    """For the block, :func:`say` hands its lines to ``printer`` instead of printing them (the
    live terminal view prints them above its table). The previous printer is back on exit,
    however the block ends."""
    global _printer
    previous, _printer = _printer, printer
    try:
        yield
    finally:
        _printer = previous


def say(text: str, stream: TextIO | None = None) -> bool:
    """Print one line and flush; False when its reader has gone (a broken pipe, a terminal that
    hung up), and that stream is silenced from then on. Other write errors are raised."""
    out = stream if stream is not None else sys.stdout
    try:
        if _printer is not None:
            _printer(text, stream)
            return True
        print(text, file=out, flush=True)
    except OSError as err:
        if not reader_gone(err):
            raise
        silence(out)
        return False
    return True
