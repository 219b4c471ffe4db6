"""`flodl run` with real processes (gloo): a run the script or a time budget ends.

``examples/digits.py --target-accuracy`` makes rank 0 call ``rank.stop(reason)`` once the test
accuracy is reached; ``--max-time`` ends the training after that many seconds. Either way the
run completes (exit 0), the reason is in the summary, and every rank's final bundle holds the
same weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl.checkpoint import find_latest, load_bundle
from flodl.observe.events import read_events
from flodl.observe.state import RunView
from tests.worker.procs import DIGITS, pid_alive

pytestmark = pytest.mark.slow


def flodl_run(run_dir: Path, *flags: str, script_args: tuple[str, ...] = ()) -> dict[str, Any]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flodl.cli",
            "run",
            "--nproc",
            "2",
            "--backend",
            "gloo",
            "--no-live",
            "--run-dir",
            str(run_dir),
            *flags,
            str(DIGITS),
            "--epochs",
            "500",
            "--slow",
            "1:2.5",
            *script_args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert not any(pid_alive(r["pid"]) for r in summary["ranks"] if r.get("pid"))
    return summary


def assert_one_model(run_dir: Path) -> None:
    states = []
    for rank in (0, 1):
        latest = find_latest(run_dir / "checkpoints" / f"rank{rank}")
        assert latest is not None
        states.append(load_bundle(latest).model_state)
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    reported = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    accuracies = {r["final_metrics"]["test_accuracy"] for r in reported}
    assert len(accuracies) == 1, reported  # the same model evaluated on the same data


def test_a_script_that_reaches_its_target_stops_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    run_dir = tmp_path / "run"
    summary = flodl_run(run_dir, script_args=("--target-accuracy", "0.9"))
    assert summary["message"].startswith("rank 0 stopped the training: test accuracy 0.9")
    assert_one_model(run_dir)
    reported = json.loads((run_dir / "rank0.json").read_text())
    # The shared model after the last round (rank 0 checked its own at the epoch's start).
    assert reported["final_metrics"]["test_accuracy"] >= 0.8


def test_max_time_ends_the_training_after_its_budget(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    run_dir = tmp_path / "run"
    summary = flodl_run(run_dir, "--max-time", "3")
    assert summary["message"] == "the time budget (3 s of training) is spent"
    assert_one_model(run_dir)
    # Lock-step DDP's estimate: the same batches at the slowest rank's pace (whether it comes
    # out above 1 here depends on how busy the machine is: a figure for the benchmarks).
    estimate = summary["versus_ddp"]
    assert estimate["batches"] == sum(r["batches"] for r in summary["ranks"])
    ddp_s = estimate["batches"] / 2 * estimate["slowest_step_s"]
    assert estimate["ddp_estimated_s"] == pytest.approx(ddp_s, rel=1e-3, abs=1e-3)
    assert estimate["speedup_vs_ddp"] == pytest.approx(ddp_s / estimate["flodl_s"], rel=1e-2)
    # The summary's idle and averaging shares are the live table's: the run's events folded
    # the same way give the same figures.
    view = RunView(2)
    for record in read_events(run_dir / "events.jsonl"):
        view.apply(record)
    for rank in (0, 1):
        row = view.ranks[rank].to_json()
        entry = summary["ranks"][rank]
        assert row["idle_share"] is not None and row["averaging_share"] is not None
        assert (entry["idle_share"], entry["averaging_share"]) == (
            row["idle_share"],
            row["averaging_share"],
        )
