"""What a run prints while it trains: plain lines (stdout not a terminal) or a live table.

Plain output: rank output lines as ``[rank N] ...`` (the launcher relays them) and one line
per notable event (``flodl: 12.3s rank 2 dead: ...``), so logs stay greppable.
"""

from __future__ import annotations

from typing import Any

import trio

from flodl.launcher_signals import say
from flodl.observe.hub import Observer
from flodl.observe.state import describe, is_notable
from flodl.observe.views import ViewConfig

__all__ = ["show"]


async def show(
    observer: Observer,
    views: ViewConfig,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Print the run's notable events as plain lines until cancelled."""

    def line(record: dict[str, Any]) -> None:
        if is_notable(record) and not views.quiet:
            say(f"flodl: {describe(record)}")

    observer.on_record(line)
    task_status.started()
    await trio.sleep_forever()
