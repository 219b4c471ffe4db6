"""Closing the terminal `flodl run` runs in (a tmux pane, an ssh session that drops) saves every
rank's bundle and writes the summary, as Ctrl-C does, whether the live table or plain lines
were on it; a second hangup does not turn the save into a kill; under nohup the run goes on.

The launcher runs on a real pseudo-terminal as its controlling terminal (its own session), so
closing the terminal's master side is what closing a terminal window does: the kernel sends
SIGHUP, and every later write to the terminal fails with EIO."""

from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.worker.procs import DIGITS, live_in_groups

pytestmark = pytest.mark.slow


class OnTerminal:
    """``flodl run`` with a pseudo-terminal as its controlling terminal; SIGKILLed (with its
    ranks' groups) at :meth:`close` if still running."""

    def __init__(self, run_dir: Path, *args: str, ignore_hangup: bool = False) -> None:
        self.run_dir = run_dir
        self.master, slave = os.openpty()

        def become_terminal_session() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            # As a terminal's shell starts a command; nohup ignores SIGHUP first. (The test
            # runner itself may run with SIGHUP ignored, which its children would inherit.)
            signal.signal(signal.SIGHUP, signal.SIG_IGN if ignore_hangup else signal.SIG_DFL)

        argv = [sys.executable, "-m", "flodl.cli", "run", "--nproc", "2"]
        argv += ["--run-dir", str(run_dir), *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FLODL_", "OMP_"))}
        env.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
        self.process = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            preexec_fn=become_terminal_session,
            env=env,
        )
        os.close(slave)
        self.screen = b""
        self.closed = False

    def read_until(self, needle: str, limit: float = 90) -> None:
        """What the terminal shows, until ``needle`` is on it."""
        deadline = time.monotonic() + limit
        while needle.encode() not in self.screen:
            left = deadline - time.monotonic()
            assert left > 0, f"{needle!r} never shown:\n{self.screen.decode(errors='replace')}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    self.screen += os.read(self.master, 65536)
                except OSError:  # the launcher exited: nothing more will come
                    pass

    def hang_up(self) -> None:
        """Close the terminal."""
        os.close(self.master)
        self.closed = True

    def wait(self) -> int:
        return self.process.wait(timeout=120)

    def summary(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.run_dir / "summary.json").read_text())
        return data

    def close(self) -> None:
        if not self.closed:
            self.hang_up()
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def on_terminal() -> Any:
    started: list[OnTerminal] = []

    def start(*args: Any, **kwargs: Any) -> OnTerminal:
        started.append(OnTerminal(*args, **kwargs))
        return started[-1]

    yield start
    groups: list[int] = []
    for launcher in started:
        launcher.close()
        groups.append(launcher.process.pid)
        if (launcher.run_dir / "summary.json").exists():
            groups += [rank["pid"] for rank in launcher.summary()["ranks"]]
    assert live_in_groups(groups) == []  # no process outlives its test


def assert_every_rank_saved(launcher: OnTerminal) -> dict[str, Any]:
    rc = launcher.wait()
    summary = launcher.summary()
    assert rc == 0, summary
    assert (summary["status"], summary["save_reason"]) == ("saved", "GRACEFUL")
    assert summary["saved"] == {"ranks": [0, 1], "missing": []}
    for rank in summary["ranks"]:
        assert rank["exit_code"] == 0 and rank["exit_reason"] == "shutdown_with_save:GRACEFUL"
        assert Path(rank["bundle"] + ".meta.json").is_file()
    assert "stop requested (SIGHUP)" in summary["message"]
    return summary


@pytest.mark.parametrize("view", ["live", "plain"])
def test_closing_the_terminal_saves_every_rank(
    tmp_path: Path, on_terminal: Callable[..., OnTerminal], view: str
) -> None:
    args = ["--no-live"] if view == "plain" else []
    launcher = on_terminal(tmp_path / "run", *args, str(DIGITS), "--epochs", "400")
    launcher.read_until("epoch 1 started")
    launcher.hang_up()
    summary = assert_every_rank_saved(launcher)
    assert set(summary["signals"]) == {"SIGHUP"}
    for rank in range(2):  # each rank's output after the hangup is still in its log
        log = (tmp_path / "run" / f"rank{rank}.log").read_text()
        assert "coordinator asked to save and stop: GRACEFUL (saved to" in log


def test_a_second_hangup_does_not_kill_the_ranks(
    tmp_path: Path, on_terminal: Callable[..., OnTerminal]
) -> None:
    """A closing terminal may send SIGHUP twice (the kernel to its foreground group, the
    shell to its jobs): the second must not be taken as a second Ctrl-C."""
    launcher = on_terminal(tmp_path / "run", "--no-live", str(DIGITS), "--epochs", "400")
    launcher.read_until("epoch 1 started")
    os.kill(launcher.process.pid, signal.SIGHUP)
    launcher.read_until("flodl: SIGHUP: every rank saves its bundle, then stops")
    os.kill(launcher.process.pid, signal.SIGHUP)
    launcher.hang_up()
    summary = assert_every_rank_saved(launcher)
    assert summary["signals"][:2] == ["SIGHUP", "SIGHUP"]
    assert not any(rank["killed_by_launcher"] for rank in summary["ranks"])


def test_under_nohup_the_run_outlives_its_terminal(
    tmp_path: Path, on_terminal: Callable[..., OnTerminal]
) -> None:
    launcher = on_terminal(
        tmp_path / "run", "--no-live", str(DIGITS), "--epochs", "40", ignore_hangup=True
    )
    launcher.read_until("epoch 1 started")
    launcher.hang_up()
    assert launcher.process.poll() is None  # 38 epochs to go, a few seconds
    assert launcher.wait() == 0
    summary = launcher.summary()
    assert summary["status"] == "completed" and summary["signals"] == []
    assert summary["final_metrics"]["test_accuracy"] >= 0.9
