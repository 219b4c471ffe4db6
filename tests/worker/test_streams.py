"""A rank's output falls back to its log when its reader is gone: the launcher's pipe breaks,
or the terminal it writes to closes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from flodl.worker.streams import FallbackStream


def test_a_write_to_a_broken_pipe_goes_to_the_log_from_then_on(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w", buffering=1)
    log = tmp_path / "rank1.log"
    out = FallbackStream(stream, log)
    out.write("before\n")
    assert os.read(read_end, 100) == b"before\n"
    os.close(read_end)  # the launcher died
    assert out.write("after\n") == len("after\n")  # no BrokenPipeError
    out.write("and again\n")
    out.flush()
    assert log.read_text() == "after\nand again\n"
    assert out.fileno() == write_end  # everything else is the wrapped stream's
    out.close()
    assert stream.closed


def test_a_write_to_a_terminal_that_hung_up_goes_to_the_log(tmp_path: Path) -> None:
    """A `flodl worker` rank writes to the terminal it was started from; once that closes
    every write fails with EIO, and the rank must go on to save."""
    master, slave = os.openpty()
    stream = os.fdopen(slave, "w", buffering=1)
    log = tmp_path / "rank0.log"
    out = FallbackStream(stream, log)
    out.write("on screen\n")
    assert os.read(master, 100) == b"on screen\r\n"
    os.close(master)  # the terminal closed
    with pytest.raises(OSError) as raised:
        os.write(slave, b"x")
    assert raised.value.errno == errno.EIO  # what every write meets now
    out.write("after the hangup\n")
    out.flush()
    assert log.read_text() == "after the hangup\n"
    out.close()


def test_other_write_errors_are_raised(tmp_path: Path) -> None:
    """Only a reader that is gone sends output to the log: a full disk is the user's to see."""
    full = open("/dev/full", "w", buffering=1)  # closed by the stream
    out = FallbackStream(full, tmp_path / "rank0.log")
    with pytest.raises(OSError) as raised:
        out.write("a line\n")
    assert raised.value.errno == errno.ENOSPC
    assert not (tmp_path / "rank0.log").exists()
    with pytest.raises(OSError):
        out.close()  # the buffered line meets the same full disk
