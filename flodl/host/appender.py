"""A file that a run appends to and must never be stopped by: a rank's log, the event log.

A disk that fills, or a folder that goes away, makes every write fail. The run must go on
regardless: a rank whose output is not read blocks on its pipe, and a coordinator that raises
on a write stops every rank. So :class:`Appender` never raises. A write that fails is said once
(until one succeeds again), the file is cut back to where the write began, so a reader never
meets half of it, and the next write tries again.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO

from flodl.host.console import say

__all__ = ["Appender"]


class Appender:
    """Appends bytes to ``path`` (module docstring); ``what`` names it when a write fails
    (``flodl: <what> cannot be written (<error>)<then>``). Not thread-safe: one writer."""

    def __init__(self, path: Path, what: str, then: str = "") -> None:
        self.path = path
        self._what, self._then = what, then
        self._file: BinaryIO | None = None
        self._failing = False

    def open(self) -> bool:
        """Open the file now, rather than at the first write; False when it cannot be."""
        if self._file is not None:
            return True
        try:
            self._file = self.path.open("ab")
        except OSError as err:
            self._refused(err, None)
            return False
        return True

    def append(self, data: bytes | bytearray) -> bool:
        """Write and flush ``data``; False when the disk refused it (none of it is then in
        the file)."""
        if not self.open():
            return False
        assert self._file is not None
        start = None
        try:
            start = self._file.tell()
            self._file.write(data)
            self._file.flush()
        except OSError as err:
            self._refused(err, start)
            return False
        self._failing = False
        return True

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # what it still buffered was refused
                self._file.close()
            self._file = None

    def _refused(self, err: OSError, start: int | None) -> None:
        if not self._failing:
            say(f"flodl: {self._what} cannot be written ({err}){self._then}")
        self._failing = True
        self.close()
        if start is not None:
            with contextlib.suppress(OSError):
                os.truncate(self.path, start)
