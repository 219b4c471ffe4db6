"""What a closed terminal means to flodl's processes.

Closing a terminal (a tmux pane, an ssh session that drops) sends SIGHUP to the processes it
ran, and from then on every write to it fails with EIO, as a write to a pipe whose reader
exited fails with EPIPE (``| tee`` killed by the same Ctrl-C). flodl treats the hangup as a
request to stop, as SIGTERM: the run saves. A process started with SIGHUP ignored
(``nohup``, ``setsid``-style wrappers that ignore it) asked to outlive its terminal, so SIGHUP
stays ignored there and the run goes on.
"""

from __future__ import annotations

import errno
import signal

__all__ = ["reader_gone", "stop_signals"]

_READER_GONE = frozenset({errno.EPIPE, errno.EIO})
"""A pipe whose reader exited; a terminal that hung up."""


def reader_gone(err: OSError) -> bool:
    """True when a write failed because nobody reads the stream any more."""
    return isinstance(err, BrokenPipeError) or err.errno in _READER_GONE


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that ask a run to save and stop: SIGINT, SIGTERM, and SIGHUP unless this
    process was started with SIGHUP ignored. Read the disposition before installing any
    handler for SIGHUP (installing one replaces the ignore)."""
    asked = (signal.SIGINT, signal.SIGTERM)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
        return asked
    return (*asked, signal.SIGHUP)
