"""`flodl run` with real processes (gloo): a completed run leaves its trained model on disk.

The final bundle of every rank loads into the script's model and reproduces the test accuracy
the rank reported; with ``--checkpoint-every 1`` each rank keeps only its ``--keep-checkpoints``
newest bundles; ``--resume`` of the run finds the final bundle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flodl.checkpoint import find_latest, load_bundle
from flodl.checkpoint.resume import plan_resume
from tests.worker.procs import DIGITS, digits_module


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_completed_run_saves_the_trained_model_and_keeps_the_newest_bundles(
    tmp_path: Path,
) -> None:
    pytest.importorskip("sklearn")
    run_dir = tmp_path / "run"
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
            "--run-dir",
            str(run_dir),
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "2",
            # The anchor stays at 10, so two epochs take about seven rounds: with its default
            # ceiling a loaded machine grew it until two rounds covered them, and two saves
            # never reach the pruning this test is about.
            "--max-anchor",
            "10",
            str(DIGITS),
            "--epochs",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert not any(_alive(r["pid"]) for r in summary["ranks"] if r.get("pid"))

    digits = digits_module()
    torch.set_num_threads(1)
    _, _, x_test, y_test = digits.load_data(0)
    stems = {}
    for rank in (0, 1):
        directory = run_dir / "checkpoints" / f"rank{rank}"
        stems[rank] = sorted(p.name for p in directory.glob("*.meta.json"))
        latest = find_latest(directory)
        assert latest is not None
        bundle = load_bundle(latest)
        assert bundle.meta.save_reason == "CHECKPOINT"
        assert bundle.meta.global_step == summary["global_step"]
        model = digits.build_model(64, 0)
        model.load_state_dict(bundle.model_state)
        reported = json.loads((run_dir / f"rank{rank}.json").read_text())
        assert digits.accuracy(model, x_test, y_test) == reported["final_metrics"]["test_accuracy"]
        assert reported["checkpoint_ms"]  # every rank saved at least its final bundle
    # Rank 0 saved after every round, and kept only its two newest bundles; rank 1 saved
    # once, at the end.
    assert len(stems[0]) == 2 and len(stems[1]) == 1
    rounds_saved = len(json.loads((run_dir / "rank0.json").read_text())["checkpoint_ms"])
    assert rounds_saved > 2

    plan = plan_resume(run_dir)
    assert plan.bundle.parent.name in ("rank0", "rank1")
    assert load_bundle(plan.bundle).meta.global_step == summary["global_step"]


def test_checkpoint_flags_are_checked_by_name_before_any_rank_starts(tmp_path: Path) -> None:
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit(5)\n")
    for flag in ("--checkpoint-every", "--checkpoint-every-epochs", "--keep-checkpoints"):
        result = subprocess.run(
            [sys.executable, "-m", "flodl.cli", "run", "--nproc", "1", flag, "0", str(script)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert f"{flag} must be an integer >= 1, got 0" in result.stderr
        assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
