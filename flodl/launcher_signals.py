"""How ``flodl run`` stops on a signal, and the teardown that leaves no process behind.

Signals belong to the launcher. Each rank is started in a session of its own
(``start_new_session``), so the SIGINT a terminal sends to its whole foreground process group on
Ctrl-C, and the SIGHUP it sends when it closes, reach the launcher only, never a rank. The
launcher turns the first SIGINT, SIGTERM or SIGHUP (unless SIGHUP was ignored when it started:
``nohup``; see :mod:`flodl.hangup`) into ``ShutdownWithSave(GRACEFUL)`` (every live rank writes
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
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

import attrs
import trio

from flodl.core.ending import listed_ranks
from flodl.hangup import reader_gone, stop_signals

if TYPE_CHECKING:
    from flodl.coordinator import Coordinator
    from flodl.launcher import RankProcess
    from flodl.wire.messages import CheckpointResult

SAVE_REPORTS_WAIT_S = 60.0
"""How long ``flodl coordinator`` waits, after a save went out, for every rank to report its
bundle and hang up (a second signal stops the wait)."""

__all__ = [
    "LinePrinter",
    "StopSignals",
    "kill_rank_groups",
    "printing_through",
    "say",
    "silence",
    "unread_is_fine",
    "watch_signals",
]


@attrs.define
class StopSignals:
    """The stop signals the launcher received, in order, and whether it killed the ranks."""

    received: list[str] = attrs.field(factory=list)
    killed: bool = False
    """A second signal killed every rank still running."""


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


def kill_rank_groups(spawned: Sequence[RankProcess], *, exited_too: bool = False) -> None:
    """SIGKILL each rank's process group (the rank leads its own session).

    ``exited_too``: also the groups of ranks that already exited, for children they left. A
    group id stays reserved while any member lives, so it never names another user's process.
    """
    for item in spawned:
        process = item.process
        if process.returncode is not None and not exited_too:
            continue
        item.exit_log.killing(process)  # a no-op for a process that has exited
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()


async def watch_signals(
    coordinator: Coordinator,
    stops: StopSignals,
    again: Callable[[], None],
    again_says: tuple[str, str],
    *,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """First SIGINT/SIGTERM/SIGHUP (:func:`flodl.hangup.stop_signals`): every rank saves and
    stops. Any later SIGINT or SIGTERM: ``again()`` (the launcher kills every rank; ``flodl
    coordinator`` stops at once); a later SIGHUP is recorded and changes nothing. ``again_says``:
    what ``again()`` does, as offered after the first ("kill the ranks") and as done ("killing
    the ranks").

    Reports ``started`` once the handlers are in place: start it before the first rank.
    """
    handled = stop_signals()
    if signal.SIGHUP in handled:
        # What the receiver puts back when it closes, and re-raises a late SIGHUP into: after
        # the run the process has a summary to write, and must not die of a hangup.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with trio.open_signal_receiver(*handled) as signals:
        task_status.started()
        await _take_signals(signals, coordinator, stops, again, again_says)


async def _take_signals(
    signals: Any,
    coordinator: Coordinator,
    stops: StopSignals,
    again: Callable[[], None],
    again_says: tuple[str, str],
) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        stops.received.append(name)
        if signum == signal.SIGHUP and len(stops.received) > 1:
            continue  # the terminal closing again (module docstring): the save goes on
        if len(stops.received) == 1:
            if coordinator.machine.finished:
                text = f"flodl: {name}: the run has ended; waiting for the ranks to exit"
            else:
                text = f"flodl: {name}: every rank saves its bundle, then stops"
                coordinator.request_stop(save=True)
            say(f"{text} (again to {again_says[0]})", sys.stderr)
        else:
            stops.killed = True
            say(f"flodl: {name}: {again_says[1]}", sys.stderr)
            again()


async def coordinate(coordinator: Coordinator, stops: StopSignals | None = None) -> tuple[str, int]:
    """``flodl coordinator``: serve until the run ends, SIGINT/SIGTERM handled as by ``flodl
    run`` except that a second one stops the coordinator at once (its ranks, on other hosts,
    then see it gone). Returns the line to print and the exit status: 0 when the run completed
    or was stopped on request (save_reason GRACEFUL), 1 when it did not complete; ``stops``
    receives the signals."""
    stops = StopSignals() if stops is None else stops
    async with trio.open_nursery() as nursery:
        says = ("stop at once", "stopping at once; ranks still saving lose their work")
        await nursery.start(watch_signals, coordinator, stops, nursery.cancel_scope.cancel, says)
        await coordinator.wait_finished()
        if coordinator.machine.outcome.save_reason is not None:
            # Each rank reports its bundle before it hangs up: wait for the reports.
            with trio.move_on_after(SAVE_REPORTS_WAIT_S):
                await coordinator.wait_all_hung_up()
        nursery.cancel_scope.cancel()
    outcome = coordinator.machine.outcome
    why = outcome.message + (f" ({stops.received[0]})" if stops.received else "")
    if stops.killed:
        return f"flodl: run stopped at once by a second {stops.received[-1]}: {why}", 1
    if outcome.save_reason is not None:
        # The bundles are on the ranks' hosts: what each rank reported (its output says more).
        return (
            f"flodl: run stopped, every rank asked to save (save_reason "
            f"{outcome.save_reason.name}): {why}; {_reported(coordinator.machine.stop_saves)}",
            0 if outcome.save_reason.name == "GRACEFUL" else 1,
        )
    return (
        f"flodl: run {outcome.status.value} {why}",
        0 if outcome.status.value == "completed" else 1,
    )


def _reported(reports: Mapping[int, CheckpointResult | None]) -> str:
    """What the ranks asked to save reported, in words."""
    saved = [rank for rank, report in reports.items() if report and report.error is None]
    failed = [rank for rank, report in reports.items() if report and report.error]
    silent = [rank for rank, report in reports.items() if report is None]
    parts = [f"ranks {listed_ranks(saved)} saved on their own hosts"] if saved else []
    parts += [f"ranks {listed_ranks(failed)} could not save (see their output)"] if failed else []
    parts += [f"ranks {listed_ranks(silent)} did not report a save"] if silent else []
    return "; ".join(parts) or "no rank was connected to save"
