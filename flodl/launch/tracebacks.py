"""Python tracebacks in a rank's log: the exception a process died of, and the lines that led
to it, read from the end of the log (which goes on across a rank's restarts: one traceback per
life that raised)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LOG_READ_BYTES", "TAIL_LINES", "read_tail", "traceback_tail", "tracebacks"]

TAIL_LINES = 15
"""Lines of a rank's last traceback kept in ``root_cause.traceback_tail``."""
LOG_READ_BYTES = 256 * 1024
"""Only the end of a rank's log is read for its traceback."""
_HEADER = "Traceback (most recent call last):"
_PIPE = re.compile(r"^(?:\s*[|+][ -]*)+")
"""The ``  | `` and ``  +-+---`` margins of an exception group's traceback."""


def read_tail(path: Path) -> str:
    """The last :data:`LOG_READ_BYTES` of the log at ``path`` (empty when it cannot be read)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(size - LOG_READ_BYTES, 0))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def traceback_tail(text: str, lines: int = TAIL_LINES) -> tuple[str, list[str]] | None:
    """The last Python traceback in ``text``: its exception line and its last ``lines`` lines
    (header to exception line). None when ``text`` holds no traceback.

    A chained traceback ("During handling of the above exception ...") is one block: its
    exception line is the last one, the exception the process died of. Exception groups'
    ``|`` margins are ignored when looking for the exception line.
    """
    rows = text.splitlines()
    found = _last_traceback(rows)
    if found is None:
        return None
    first, end = found
    return _PIPE.sub("", rows[end]).strip(), rows[first : end + 1][-lines:]


def tracebacks(text: str, lines: int = TAIL_LINES) -> list[tuple[str, list[str]]]:
    """Every Python traceback in ``text``, oldest first, each as :func:`traceback_tail` gives
    the last (a rank's log holds one per life that raised: it goes on across restarts)."""
    rows = text.splitlines()
    found: list[tuple[str, list[str]]] = []
    while (block := _last_traceback(rows)) is not None:
        first, end = block
        found.append((_PIPE.sub("", rows[end]).strip(), rows[first : end + 1][-lines:]))
        rows = rows[:first]
    return found[::-1]


def _last_traceback(rows: Sequence[str]) -> tuple[int, int] | None:
    """The first and last row of the last traceback in ``rows`` (:func:`traceback_tail`)."""
    starts = [i for i, row in enumerate(rows) if _PIPE.sub("", row).strip() == _HEADER]
    if not starts:
        return None
    # The block the last header belongs to starts at the first header of its chain.
    first = starts[-1]
    for start in reversed(starts[:-1]):
        between = rows[start:first]
        if not any(_is_chain_line(row) for row in between):
            break
        first = start
    end = None
    for i in range(starts[-1] + 1, len(rows)):
        bare = _PIPE.sub("", rows[i])
        if bare and not bare[0].isspace() and not _is_chain_line(rows[i]):
            end = i
            if not rows[i].lstrip().startswith(("|", "+")):
                break
    return None if end is None else (first, end)


def _is_chain_line(row: str) -> bool:
    bare = _PIPE.sub("", row).strip()
    return bare.startswith(
        (
            "During handling of the above exception",
            "The above exception was the direct cause",
        )
    )
