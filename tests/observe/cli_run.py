"""Run ``flodl`` as a subprocess with its stdout and stderr on a pseudo-terminal or a pipe, and
collect everything it printed (test helper)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import attrs

from tests.worker.procs import pid_alive

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
"""A CSI escape sequence: colours, cursor moves, erasing, cursor shown/hidden."""
ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits.py"
CHAOS_RANK = ROOT / "tests" / "e2e" / "chaos_rank.py"
LIMIT_S = 90.0


@attrs.frozen
class Finished:
    """What a ``flodl`` process printed and how it ended."""

    code: int
    output: str
    """stdout and stderr together (on a terminal: as the terminal received them)."""
    run_dir: Path

    @property
    def plain(self) -> str:
        """The output without escape sequences."""
        return ANSI.sub("", self.output)

    def summary(self) -> dict[str, object]:
        data: dict[str, object] = json.loads((self.run_dir / "summary.json").read_text())
        return data


def flodl_command(run_dir: Path, *args: str) -> list[str]:
    """``python -m flodl.cli run --run-dir RUN_DIR ARGS...``."""
    return [sys.executable, "-m", "flodl.cli", "run", "--run-dir", str(run_dir), *args]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["TERM"] = "xterm-256color"
    for name in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "FLODL_OP_TIMEOUT"):
        env.pop(name, None)
    return env


def run_on_terminal(
    run_dir: Path,
    *args: str,
    columns: int = 120,
    rows: int = 40,
    interrupt_at: re.Pattern[str] | None = None,
) -> Finished:
    """Run ``flodl run`` with stdout and stderr on a new pseudo-terminal of this size;
    ``interrupt_at``: send it SIGINT (as Ctrl-C would) once its output matches this."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    chunks: list[bytes] = []
    try:
        process = subprocess.Popen(
            flodl_command(run_dir, *args),
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
            env=environment(),
            cwd=ROOT,
        )
    finally:
        os.close(slave)

    def read() -> None:
        # Until every writer has closed the terminal: EIO on Linux, b"" elsewhere.
        waiting = interrupt_at
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            chunks.append(chunk)
            if waiting is not None:
                tail = ANSI.sub("", b"".join(chunks)[-16384:].decode(errors="replace"))
                if waiting.search(tail):
                    process.send_signal(signal.SIGINT)
                    waiting = None

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=LIMIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(timeout=10)
        os.close(master)
    return Finished(code, b"".join(chunks).decode(errors="replace"), run_dir)


def run_on_pipe(run_dir: Path, *args: str) -> Finished:
    """Run ``flodl run`` with stdout and stderr on one pipe."""
    done = subprocess.run(
        flodl_command(run_dir, *args),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=environment(),
        cwd=ROOT,
        timeout=LIMIT_S,
        check=False,
    )
    return Finished(done.returncode, done.stdout.decode(errors="replace"), run_dir)


def assert_no_rank_left(run: Finished) -> None:
    """Every rank process the run started has gone."""
    summary = run.summary()
    ranks = summary["ranks"]
    assert isinstance(ranks, list)
    pids = [int(rank["pid"]) for rank in ranks]
    assert pids and [pid for pid in pids if pid_alive(pid)] == []
