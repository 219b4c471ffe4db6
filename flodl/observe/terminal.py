"""What a run prints while it trains: a live table on a terminal, plain lines otherwise.

:func:`show` picks one. On a terminal (and without ``--no-live``) it is the live view of
:mod:`flodl.observe.terminal_live`: a table of the ranks redrawn a few times a second, with
the ranks' output and the event lines scrolling above it. Otherwise (a pipe, a file, CI,
``--no-live``) it prints plain lines: the ranks' output as ``[rank N] ...`` (the launcher
relays it) and one ``flodl: ...`` line per event that matters
(:mod:`flodl.observe.terminal_lines`), so logs stay greppable. ``--quiet`` prints neither;
only the summary at the end.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import trio

from flodl.launcher_signals import say
from flodl.observe.hub import Observer
from flodl.observe.terminal_lines import EventLines
from flodl.observe.views import ViewConfig

__all__ = ["PlainLines", "show", "wants_live"]


def wants_live(views: ViewConfig) -> bool:
    """The live table: asked for (``live=True``), or not refused and stdout is a terminal
    that can move its cursor (not ``TERM=dumb`` or ``unknown``, as rich sees it)."""
    if views.quiet or views.live is False:
        return False
    if views.live:
        return True
    return sys.stdout.isatty() and os.environ.get("TERM", "") not in ("dumb", "unknown")


async def show(
    observer: Observer,
    views: ViewConfig,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Show the run as ``views`` asks until cancelled; started once it watches ``observer``.

    Only cancellation ends it. However it ends, the live view is stopped first and the
    terminal left as it was (cursor shown, the table's last state drawn once, below the
    lines printed above it), and event lines held back are printed.
    """
    if views.quiet:
        task_status.started()
        await trio.sleep_forever()
    if wants_live(views):
        from flodl.observe.terminal_live import LiveView

        await LiveView(observer, force=bool(views.live)).run(task_status=task_status)
    else:
        await PlainLines(observer).run(task_status=task_status)


class PlainLines:
    """The plain output's event lines, printed with :func:`say` (so they share its handling of
    a reader that went away)."""

    def __init__(self, observer: Observer, lines: EventLines | None = None) -> None:
        self.observer = observer
        self.lines = EventLines() if lines is None else lines
        self.closed = False
        """Past :meth:`run`: nothing is held back any more (no task would print it)."""
        self._held = trio.Event()

    def take(self, record: Mapping[str, Any]) -> None:
        """The observer's listener: print the lines ``record`` makes; never waits."""
        for line in self.lines.take(record, trio.current_time()):
            say(line)
        if self.closed:
            self.flush()
        elif self.lines.due is not None:
            self._held.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Print event lines until cancelled; on the way out, the held-back ones too."""
        self.observer.on_record(self.take)
        task_status.started()
        await self.print_held()

    async def print_held(self) -> None:
        """Print held-back save results when they are due (they wait for the other ranks' of
        the same save) until cancelled, and what is still held back when cancelled."""
        try:
            await self._print_held()
        finally:
            self.closed = True
            self.flush()

    async def _print_held(self) -> None:
        while True:
            due = self.lines.due
            if due is None:
                await self._held.wait()
                self._held = trio.Event()
                continue
            await trio.sleep_until(due)
            now_due = self.lines.due  # a later event may have printed them meanwhile
            if now_due is not None and now_due <= trio.current_time():
                self.flush()

    def flush(self) -> None:
        for line in self.lines.flush():
            say(line)
