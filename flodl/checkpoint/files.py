"""Durable, all-or-nothing file writes (temp file in the same directory, fsync, rename)."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = ["TEMP_MARKER", "fsync_directory", "write_atomically"]

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


def write_atomically(path: Path, data: bytes, *, sync_directory: bool = True) -> None:
    """Replace ``path`` by a file holding exactly ``data``.

    Guarantees that ``path`` holds either its previous content (or does not exist) or all of
    ``data``, never a part, even if the process is killed at any moment: the bytes go to a
    temporary file in the same directory, are flushed and fsynced, and only then renamed over
    ``path``. With ``sync_directory`` the directory is fsynced too, so the rename itself survives
    a power loss; pass False to batch several renames before one :func:`fsync_directory`.
    On an exception the temporary file is removed; a kill may leave it behind (hidden name
    containing :data:`TEMP_MARKER`), never under ``path``.
    """
    temp = temp_name_for(path)
    try:
        with open(temp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    if sync_directory:
        fsync_directory(path.parent)
