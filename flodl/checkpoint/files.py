"""Durable, all-or-nothing file writes (temp file in the same directory, fsync, rename)."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = ["TEMP_MARKER", "fsync_directory", "stage", "write_atomically"]

TEMP_MARKER = ".tmp-"
"""Part of every temporary name: ``.<final name>.tmp-<pid>-<token>`` (hidden, never final)."""


def temp_name_for(path: Path) -> Path:
    """A fresh hidden temporary path next to ``path`` (same directory, so rename is atomic)."""
    return path.with_name(f".{path.name}{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}")


def fsync_directory(directory: Path) -> None:
    """Make the renames done in ``directory`` so far durable (Linux/macOS semantics)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stage(path: Path, data: bytes) -> Path:
    """Write ``data`` to a fresh temporary file next to ``path``, fsynced; return its path.

    ``os.replace(returned, path)`` then swaps it in atomically. On an exception the temporary
    file is removed; a kill may leave it behind (hidden name holding :data:`TEMP_MARKER`).
    """
    temp = temp_name_for(path)
    try:
        with open(temp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return temp


def write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` by a file holding exactly ``data``.

    Guarantees that ``path`` holds either its previous content (or does not exist) or all of
    ``data``, never a part, even if the process is killed at any moment: the bytes go to a
    temporary file in the same directory (:func:`stage`), and only then are renamed over
    ``path``; the directory is fsynced, so the rename survives a power loss too.
    """
    temp = stage(path, data)
    try:
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    fsync_directory(path.parent)
