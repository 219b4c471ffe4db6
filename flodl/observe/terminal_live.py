"""The live terminal view: a table of the ranks at the bottom, the run's output scrolling above.

:class:`LiveView` draws :func:`flodl.observe.terminal_table.render` with ``rich.live.Live``,
redrawn on news (a record from the observer, a line to print) and at least every
:data:`REFRESH_S`, at most every :data:`MIN_GAP_S`. Lines the launcher prints with
:func:`~flodl.host.console.say` (the ranks' output, its ``flodl:`` notices) are handed to
the view while it is up (:func:`~flodl.host.console.printing_through`) and printed above the
table, batched per redraw: a chatty rank costs one redraw per batch of its lines, not one per
line, so the coordinator's event loop it shares stays free. Anything else written to
``sys.stdout``/``sys.stderr`` meanwhile goes through rich's redirection, so the table is never
torn. There is no refresh thread (``auto_refresh=False``) and rich installs no signal handler:
Ctrl-C stays the launcher's.

Should drawing ever fail, the view says so in one line and goes on as plain lines: a view
never takes a run down.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Mapping
from typing import Any, TextIO

import trio
from rich.ansi import AnsiDecoder
from rich.console import Console
from rich.live import Live
from rich.text import Text

from flodl.host.console import printing_through, say
from flodl.observe.hub import Observer
from flodl.observe.terminal_lines import EventLines
from flodl.observe.terminal_plain import PlainLines
from flodl.observe.terminal_table import render

__all__ = ["LINES_PER_DRAW", "MIN_GAP_S", "RECENT_EVENTS", "REFRESH_S", "LiveView"]

REFRESH_S = 0.25
"""Longest time between redraws (heartbeat ages and the ETA move on without news)."""
MIN_GAP_S = 0.1
"""Shortest time between redraws, however much news arrives."""
LINES_PER_DRAW = 1000
"""Lines printed per redraw at most (about 0.1 s of the event loop): a burst of output is
printed over several redraws, the coordinator's tasks running in between."""
RECENT_EVENTS = 4
"""Event lines shown under the table (all of them also scroll by above it)."""


class LiveView:
    """The live view of one run (module docstring)."""

    def __init__(self, observer: Observer, *, force: bool = False) -> None:
        self.observer = observer
        self.console = Console(
            file=sys.stdout, force_terminal=True if force else None, highlight=False
        )
        self._stderr_too = sys.stderr.isatty()
        """stderr is the same kind of place as stdout (a terminal): its lines go above the
        table too. Otherwise (say ``2>errors.log``) they go where they were sent."""
        self.live = Live(
            console=self.console,
            auto_refresh=False,
            redirect_stdout=True,
            redirect_stderr=self._stderr_too,
        )
        self.lines = EventLines()
        self.events: deque[str] = deque(maxlen=RECENT_EVENTS)
        self.up = False
        """The table is on screen and takes the lines (else they are printed plainly)."""
        self.failure: Exception | None = None
        self.plain: PlainLines | None = None
        """The plain lines it went on with, after drawing failed."""
        self._pending: list[Text] = []
        self._wake = trio.Event()
        self._decoder = AnsiDecoder()

    # --- what arrives (from the launcher's and the coordinator's tasks; never waits) --------

    def take(self, record: Mapping[str, Any]) -> None:
        """The observer's listener."""
        if self.plain is not None:
            self.plain.take(record)
            return
        lines = self.lines.take(record, trio.current_time())
        if not self.up:  # gone, or not yet drawn: nothing would print what is held back
            lines += self.lines.flush()
        self._emit(lines)
        self._wake.set()

    def print_line(self, text: str, stream: TextIO | None) -> None:
        """:func:`say`'s printer while the view is up: the line goes above the table, its
        colours kept and other control sequences (cursor moves) dropped."""
        if stream is not None and stream is not sys.stdout:
            if stream is not sys.stderr or not self._stderr_too:
                print(text, file=stream, flush=True)
                return
        self._pending.append(self._decoder.decode_line(text))
        self._wake.set()

    def _emit(self, lines: list[str]) -> None:
        for line in lines:
            self.events.append(line)
            if self.up:
                self._pending.append(Text(line))
            else:
                say(line)

    # --- drawing ----------------------------------------------------------------------------

    def paint(self, *, every_line: bool = False) -> None:
        """Draw the current state below the lines that arrived since the last redraw (at most
        :data:`LINES_PER_DRAW` of them unless ``every_line``)."""
        due = self.lines.due
        if due is not None and due <= trio.current_time():
            self._emit(self.lines.flush())
        width, height = self.console.size
        view = render(self.observer.state(), list(self.events), width=width, height=height)
        # Live draws what it was last refreshed with, also below printed lines: refresh first.
        self.live.update(view, refresh=True)
        count = len(self._pending) if every_line else LINES_PER_DRAW
        pending = self._pending[:count]
        del self._pending[:count]
        if self._pending:
            self._wake.set()  # the rest at the next redraw
        if pending:  # printed above the table (redrawn below them): once for the whole batch
            self.console.print(Text("\n").join(pending), soft_wrap=True)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Show the live view until cancelled (started once it is on screen).

        However it ends (cancelled, or failing), the table is drawn a last time with the final
        state, below every line that arrived, and rich stops (cursor shown, stdout and stderr
        given back) before this returns or raises; the ``say`` printer is removed. Lines that
        could not be drawn are printed plainly then. Painting failures are not raised: the
        view says so and goes on as plain lines.
        """
        self.observer.on_record(self.take)
        try:
            with printing_through(self.print_line):
                self.live.start()
                self.up = True
                try:
                    self.failure = self._try_paint()
                    task_status.started()
                    if self.failure is None:
                        self.failure = await self._paint_loop()
                finally:
                    self._stop()
        finally:
            self._print_leftovers()
        # Drawing failed: plain lines from here on, held-back save results included.
        self.plain = PlainLines(self.observer, self.lines)
        await self.plain.print_held()

    def _try_paint(self) -> Exception | None:
        try:
            self.paint()
        except Exception as err:  # a view must not end the run it shows
            return err
        return None

    async def _paint_loop(self) -> Exception:
        """Redraw on news and at least every :data:`REFRESH_S` until cancelled; returns the
        error if drawing fails."""
        while True:
            next_at = trio.current_time() + REFRESH_S
            await trio.sleep(MIN_GAP_S)  # a rate limit, not a poll: news waits for the gap
            with trio.move_on_at(next_at):
                await self._wake.wait()
            self._wake = trio.Event()
            failure = self._try_paint()
            if failure is not None:
                return failure

    def _stop(self) -> None:
        """The last redraw (unless drawing has failed), then rich stops; never raises."""
        try:
            if self.failure is None:
                self._emit(self.lines.flush())
                self.paint(every_line=True)
        except Exception as err:
            self.failure = err
        finally:
            self.up = False
            try:
                self.live.stop()  # shows the cursor and gives stdout back even if it raises
            except Exception as err:  # e.g. the terminal is gone: say() handles the next line
                self.failure = self.failure or err

    def _print_leftovers(self) -> None:
        """Once rich has stopped: the lines it did not draw, and why, as plain lines."""
        pending, self._pending = self._pending, []
        for line in pending:
            say(line.plain)
        if self.failure is not None:
            say(f"flodl: live view stopped ({self.failure!r}); plain lines from here")
