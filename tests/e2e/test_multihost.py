"""`flodl coordinator` + `flodl worker`: the multi-host commands, run here on one host."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from flodl.observe.events import read_events

pytestmark = pytest.mark.slow

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits.py"


def test_coordinator_and_two_workers_train_digits(tmp_path: Path) -> None:
    env = dict(os.environ, FLODL_SESSION_KEY=secrets.token_hex(32))
    flodl = [sys.executable, "-m", "flodl.cli"]
    procs: list[subprocess.Popen[str]] = []
    try:
        coordinator = subprocess.Popen(
            [
                *flodl,
                "coordinator",
                "--listen",
                "tcp://127.0.0.1:0",
                "--world-size",
                "2",
                "--run-dir",
                str(tmp_path / "coordinator"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs.append(coordinator)
        assert coordinator.stdout is not None
        first = coordinator.stdout.readline()
        match = re.search(r"tcp://127\.0\.0\.1:\d+", first)
        assert match, first
        for rank in range(2):
            procs.append(
                subprocess.Popen(
                    [
                        *flodl,
                        "worker",
                        "--coordinator",
                        match.group(0),
                        "--rank",
                        str(rank),
                        "--world-size",
                        "2",
                        "--run-dir",
                        str(tmp_path / f"host{rank}"),
                        str(DIGITS),
                        "--epochs",
                        "5",  # after 2, a loaded run drew 0.8496 against the 0.85 floor
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = [p.communicate(timeout=120)[0] for p in procs[1:]]
        rest, _ = coordinator.communicate(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert "flodl: run completed" in rest
    accuracies = {re.search(r"test accuracy (\d\.\d+)", out).group(1) for out in outputs}  # type: ignore[union-attr]
    assert len(accuracies) == 1  # identical parameters after the final round
    assert float(accuracies.pop()) > 0.85
    for rank in range(2):
        assert (tmp_path / f"host{rank}" / f"rank{rank}.json").exists()
    # The coordinator keeps the run's history: every round, each with both ranks.
    records = read_events(tmp_path / "coordinator" / "events.jsonl")
    rounds = [r for r in records if r["kind"] == "SyncEnd"]
    assert len(rounds) >= 3
    assert all(list(r["ranks"]) == ["0", "1"] for r in rounds)
    assert [r["kind"] for r in records][-1] == "Shutdown"


def test_a_worker_without_a_session_key_refuses_to_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_SESSION_KEY")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flodl.cli",
            "worker",
            "--coordinator",
            "tcp://127.0.0.1:9",
            "--rank",
            "0",
            "--world-size",
            "2",
            str(DIGITS),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "no session key" in result.stderr
