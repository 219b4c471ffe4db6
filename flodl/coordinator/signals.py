"""How the coordinator's process stops on a signal.

The first SIGINT, SIGTERM or SIGHUP (unless SIGHUP was ignored when the process started:
``nohup``; see :mod:`flodl.host.hangup`) becomes ``ShutdownWithSave(GRACEFUL)``: every live rank
writes its bundle at its next batch boundary and exits. A later SIGINT or SIGTERM runs what the
caller gave for it (``flodl run`` kills every rank; ``flodl coordinator`` stops at once). A later
SIGHUP changes nothing: a closing terminal may send it twice (the kernel to its foreground
group, the shell to its jobs), and the save must go on. A terminal's Ctrl-Z (SIGTSTP) is
declined with a word (:data:`NOT_PAUSED`), unless SIGTSTP was ignored when the process started.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import trio

from flodl.host.console import say
from flodl.host.hangup import stop_signals

NOT_PAUSED = (
    "flodl: Ctrl-Z (SIGTSTP) ignored: the ranks would give up on a paused coordinator or agent "
    "once it is silent for the heartbeat timeout; Ctrl-C saves every rank and stops"
)
"""What a terminal's Ctrl-Z gets: the ranks run in sessions of their own, so only this process
would stop, and the run would fall apart around it."""


class Stoppable(Protocol):
    """What a stop signal acts on: the coordinator, or a node agent that asks it to stop."""

    @property
    def run_ended(self) -> bool: ...

    def request_stop(self, save: bool = True) -> None: ...


@attrs.define
class StopSignals:
    """The stop signals the launcher received, in order, and whether it killed the ranks."""

    received: list[str] = attrs.field(factory=list)
    killed: bool = False
    """A second signal killed every rank still running."""


async def watch_signals(
    coordinator: Stoppable,
    stops: StopSignals,
    again: Callable[[], None],
    again_says: tuple[str, str],
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """First SIGINT/SIGTERM/SIGHUP (:func:`flodl.host.hangup.stop_signals`): every rank saves and
    stops. Any later SIGINT or SIGTERM: ``again()`` (the launcher kills every rank; ``flodl
    coordinator`` stops at once); a later SIGHUP is recorded and changes nothing; SIGTSTP only
    gets :data:`NOT_PAUSED` said. ``again_says``:
    what ``again()`` does, as offered after the first ("kill the ranks") and as done ("killing
    the ranks").

    Reports ``started`` once the handlers are in place: start it before the first rank.
    """
    handled = stop_signals()
    if signal.SIGHUP in handled:
        # What the receiver puts back when it closes, and re-raises a late SIGHUP into: after
        # the run the process has a summary to write, and must not die of a hangup.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if signal.getsignal(signal.SIGTSTP) != signal.SIG_IGN:
        handled = (*handled, signal.SIGTSTP)
    with trio.open_signal_receiver(*handled) as signals:
        task_status.started()
        await _take_signals(signals, coordinator, stops, again, again_says)


async def _take_signals(
    signals: Any,
    coordinator: Stoppable,
    stops: StopSignals,
    again: Callable[[], None],
    again_says: tuple[str, str],
) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        if signum == signal.SIGTSTP:
            say(NOT_PAUSED, sys.stderr)
            continue
        stops.received.append(name)
        if signum == signal.SIGHUP and len(stops.received) > 1:
            continue  # the terminal closing again (module docstring): the save goes on
        if len(stops.received) == 1:
            if coordinator.run_ended:
                text = f"flodl: {name}: the run has ended; waiting for the ranks to exit"
            else:
                text = f"flodl: {name}: every rank saves its bundle, then stops"
                coordinator.request_stop(save=True)
            say(f"{text} (again to {again_says[0]})", sys.stderr)
        else:
            stops.killed = True
            say(f"flodl: {name}: {again_says[1]}", sys.stderr)
            again()
