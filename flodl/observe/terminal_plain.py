"""The plain output's event lines: one ``flodl: ...`` line per event that matters, for pipes, files
and CI."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from flodl.host.console import say
from flodl.observe.hub import Observer
from flodl.observe.terminal_lines import EventLines

__all__ = ["PlainLines"]


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
