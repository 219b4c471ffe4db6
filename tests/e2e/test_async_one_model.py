"""`flodl run --policy async` with real processes (gloo): the run ends with one model.

Async rounds are blended into local progress, so the ranks differ during the run; its last
round lands with nothing trained since its snapshot and is taken exactly. Every rank then
holds bitwise identical parameters: the same digest after the last round, the same tensors
in its final bundle, the same test accuracy. No process is left.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flodl.checkpoint import find_latest, load_bundle
from tests.worker.procs import DIGITS, ROOT, pid_alive

RANKS = (0, 1, 2)


def _digest(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def test_an_async_run_ends_with_the_same_weights_and_metrics_on_every_rank(
    tmp_path: Path,
) -> None:
    pytest.importorskip("sklearn")
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    env.update({"FLODL_DEBUG_PARAM_HASHES": "1", "PYTHONPATH": str(ROOT)})
    command = [sys.executable, "-m", "flodl.cli", "run", "--nproc", str(len(RANKS))]
    command += ["--policy", "async", "--backend", "gloo", "--run-dir", str(run_dir)]
    command += [str(DIGITS), "--epochs", "2", "--slow", "2:3"]  # ranks of unequal speed
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert not any(pid_alive(r["pid"]) for r in summary["ranks"] if r.get("pid"))

    reports = [json.loads((run_dir / f"rank{rank}.json").read_text()) for rank in RANKS]
    assert len({report["batches"] for report in reports}) > 1  # they did train apart
    last_rounds = [report["param_hashes"][-1] for report in reports]
    assert len({(h["round"], h["sha256"]) for h in last_rounds}) == 1, last_rounds
    accuracies = [report["final_metrics"]["test_accuracy"] for report in reports]
    assert len(set(accuracies)) == 1, accuracies

    states = []
    for rank in RANKS:
        latest = find_latest(run_dir / "checkpoints" / f"rank{rank}")
        assert latest is not None
        bundle = load_bundle(latest)
        assert bundle.meta.global_step == summary["global_step"]
        states.append(bundle.model_state)
    assert len({_digest(state) for state in states}) == 1
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        assert all(torch.equal(state[name], states[0][name]) for name in state)
