"""SIGTERM, SIGINT and SIGHUP for a rank started by ``flodl worker``
(``FLODL_STOP_ON_SIGNALS=1``).

A scheduler stops a job with SIGTERM (Slurm, Kubernetes), a terminal with SIGINT, and a
terminal that closes (an ssh session that drops) sends SIGHUP. Such a rank does not die of the
first one: it asks its coordinator to end the run with a save (``Intent(SAVE_AND_STOP)``), so
every rank of the run, this one included, writes its bundle (``ShutdownWithSave(GRACEFUL)``) and
``rank.batches()`` raises ``ShutdownRequested``. A second SIGINT or SIGTERM is not caught: the
rank dies of it as it would have without flodl (SIGINT as ``KeyboardInterrupt``). SIGHUP is
ignored from then on, for the rest of the process: a closing terminal may send it twice, and
the save must go on. A rank started with SIGHUP ignored (``nohup``) keeps it ignored
(:mod:`flodl.host.hangup`). Under ``flodl run`` the launcher owns the signals (ranks run in sessions
of their own) and none of this is installed.

The handlers live in the script's main thread (Python runs signal handlers there only, and the
rank's trio loop runs in a thread of its own); each hands the request to that loop.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import trio

from flodl.core.rank.effects import Send
from flodl.errors import ShutdownRequested
from flodl.host.hangup import stop_signals
from flodl.wire.messages import Intent, IntentKind

__all__ = ["ENV_VAR", "StopOnSignals", "say_stopped"]

ENV_VAR = "FLODL_STOP_ON_SIGNALS"

Handler = Callable[[int, FrameType | None], Any] | int | None


class StopOnSignals:
    """Installs the handlers for one rank (:meth:`install`), puts the old ones back
    (:meth:`restore`)."""

    def __init__(self, worker: Any, token: trio.lowlevel.TrioToken) -> None:
        self._worker = worker
        self._token = token
        self._previous: dict[int, Handler] = {}

    def install(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        if env.get(ENV_VAR) != "1" or threading.current_thread() is not threading.main_thread():
            return
        for signum in stop_signals():
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        handles_hangup = signal.SIGHUP in self._previous  # not started under nohup
        self.restore()  # the next SIGINT or SIGTERM is not caught
        if handles_hangup:
            # For the rest of the process, join() over or not: a late hangup must not kill a
            # rank that is saving, or has saved and is on its way out.
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        print(
            f"flodl: {name}: asking the coordinator to save every rank and stop "
            "(again to stop this rank at once, unsaved)",
            file=sys.stderr,
            flush=True,
        )
        try:
            self._token.run_sync_soon(self._ask)
        except trio.RunFinishedError:
            pass

    def _ask(self) -> None:
        worker = self._worker
        life = worker.machine.life
        if life.ending or life.done:
            return
        intent = Intent(rank=worker.rank, kind=IntentKind.SAVE_AND_STOP)
        # Worker._post performs the send and flushes it from a task of the rank's own loop.
        worker._post([Send(intent)])


def say_stopped(rank: int, error: BaseException | None) -> None:
    """When ``error`` is a :class:`~flodl.errors.ShutdownRequested`, say on stderr why the rank
    stops: left uncaught, it ends the process as the ``SystemExit`` it also is, which Python
    does without a word."""
    if isinstance(error, ShutdownRequested):
        print(f"flodl: rank {rank}: {error}", file=sys.stderr, flush=True)
