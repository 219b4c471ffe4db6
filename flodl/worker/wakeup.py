"""Waking every task that waits for "something changed" in a rank's trio thread."""

from __future__ import annotations

from collections.abc import Callable

import trio

__all__ = ["Wakeup"]


class Wakeup:
    """Take :meth:`event` before checking conditions, then wait on it: a change in between
    is never missed."""

    def __init__(self, on_boundary_change: Callable[[], None] | None = None) -> None:
        """``on_boundary_change`` runs first on every change that needs a batch boundary."""
        self._event = trio.Event()
        self._on_boundary_change = on_boundary_change

    def event(self) -> trio.Event:
        return self._event

    def notify(self, *, boundary_needed: bool = True) -> None:
        """Wake the waiters (after ``on_boundary_change`` when ``boundary_needed``)."""
        if boundary_needed and self._on_boundary_change is not None:
            self._on_boundary_change()
        self._event.set()
        self._event = trio.Event()
