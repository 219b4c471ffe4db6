"""A rank's output outlives its launcher.

Under ``flodl run`` a rank's stdout and stderr are pipes to the launcher, which copies them
into ``rank<N>.log``. When the launcher dies (SIGKILL), the next ``print`` in the training
script would raise ``BrokenPipeError`` and end the script before its batch boundary saves the
rank's bundle; under ``flodl worker`` a rank writes to the terminal it was started from, and
once that closes every write raises ``OSError(EIO)``. :func:`keep_output` wraps both streams
so that a write whose reader is gone (:func:`flodl.host.hangup.reader_gone`) goes to the rank's log
file instead, from then on; nothing else changes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import IO, Any

from flodl.host.hangup import reader_gone

__all__ = ["FallbackStream", "keep_output"]


class FallbackStream:
    """``stream``, until a write or flush finds its pipe broken; then ``fallback`` (opened
    for appending at that moment). Never raises for a reader that is gone (a broken pipe, a
    terminal that hung up); other write errors are raised."""

    def __init__(self, stream: IO[str], fallback: Path) -> None:
        self._stream = stream
        self._fallback_path = fallback
        self._fallback: IO[str] | None = None

    def _switch(self) -> IO[str]:
        if self._fallback is None:
            self._fallback = self._fallback_path.open("a", encoding="utf-8")
        return self._fallback

    def write(self, text: str) -> int:
        if self._fallback is None:
            try:
                return self._stream.write(text)
            except OSError as err:
                if not reader_gone(err):
                    raise
        target = self._switch()
        written = target.write(text)
        target.flush()
        return written

    def flush(self) -> None:
        if self._fallback is not None:
            self._fallback.flush()
            return
        try:
            self._stream.flush()
        except OSError as err:
            if not reader_gone(err):
                raise
            self._switch()

    def close(self) -> None:
        """Close the log (if it was opened) and the wrapped stream; never raises for a reader
        that is gone."""
        if self._fallback is not None:
            self._fallback.close()
        try:
            self._stream.close()
        except OSError as err:
            if not reader_gone(err):
                raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def keep_output(log: Path) -> None:
    """Wrap ``sys.stdout`` and ``sys.stderr`` (once) so their output falls back to ``log``."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, FallbackStream):
            setattr(sys, name, FallbackStream(stream, log))
