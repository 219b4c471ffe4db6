"""A rank's output falls back to its log when the launcher's pipe breaks."""

from __future__ import annotations

import os
from pathlib import Path

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
