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

import trio

from flodl.observe.hub import Observer
from flodl.observe.terminal_plain import PlainLines
from flodl.observe.view_config import ViewConfig

__all__ = ["show", "wants_live"]


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
