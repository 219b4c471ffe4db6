"""A closed terminal: SIGHUP asks for a save unless it was ignored at start (nohup), and the
launcher's echo to a terminal that hung up is dropped, never raised."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

from flodl.host.console import say

PRINT_STOP_SIGNALS = (
    "from flodl.host.hangup import stop_signals; print([s.name for s in stop_signals()])"
)


def stop_signals_in_child(preexec: Callable[[], object] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PRINT_STOP_SIGNALS],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=preexec,
        check=True,
    )
    return done.stdout.strip()


def test_sighup_stops_a_run_unless_it_was_ignored_at_start() -> None:
    # Explicitly, both ways: the test runner itself may run with SIGHUP ignored.
    default = stop_signals_in_child(lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    assert default == "['SIGINT', 'SIGTERM', 'SIGHUP']"
    ignored = stop_signals_in_child(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert ignored == "['SIGINT', 'SIGTERM']"  # as under nohup


def test_say_to_a_terminal_that_hung_up_is_dropped_from_then_on() -> None:
    master, slave = os.openpty()
    terminal = os.fdopen(slave, "w")
    try:
        assert say("before", terminal)
        assert os.read(master, 100) == b"before\r\n"
        os.close(master)  # the terminal closed
        assert not say("after", terminal)  # no OSError(EIO)
        assert os.path.samefile(f"/proc/self/fd/{slave}", os.devnull)  # silenced
        assert say("and again", terminal)  # written to nowhere
    finally:
        terminal.close()
