"""Deaths before joining are deaths like any other (`flodl run`, real processes, gloo).

A rank killed (SIGKILL) before it joins is restarted with ``--restarts``; without, the run
starts with the ranks that remain, or, below ``--min-ranks``, ends with a clear reason and
every surviving script gets RunAborted (exit 1, ``exit_reason`` "aborted: ..."). A rank the
coordinator refuses hears why (Abort) and raises RunAborted with that reason. No process is
left after any of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flodl.config import CoordinatorConfig
from flodl.launch.config import LaunchConfig
from flodl.launch.launcher import launch

pytestmark = pytest.mark.slow

# argv: a marker file, then "die" (rank 1 SIGKILLs itself before joining, once: the marker
# stays behind, so a restarted rank 1 lives) or "refuse" (rank 1 describes another job).
SCRIPT = """\
import os, signal, sys
from pathlib import Path

marker, mode = Path(sys.argv[1]), sys.argv[2]
rank = int(os.environ["RANK"])
if mode == "die" and rank == 1 and not marker.exists():
    marker.write_text("died once")
    os.kill(os.getpid(), signal.SIGKILL)

import torch
import flodl.worker
from flodl.errors import RunAborted

torch.set_num_threads(1)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
batch_size = 4 if mode == "refuse" and rank == 1 else 8
with flodl.worker.join(model, optimizer) as joined:
    try:
        for batch in joined.batches(dataset_size=128, batch_size=batch_size, epochs=2):
            loss = model(torch.ones(batch_size, 4)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            batch.done(loss)
    except RunAborted as err:
        print(f"aborted: {err}", flush=True)
        raise
print("training finished", flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)  # each rank runs in a session (process group) of its own
    except ProcessLookupError:
        return False
    return True


async def _run(
    tmp_path: Path, nproc: int, mode: str, *, restarts: int = 0, min_ranks: int | None = None
) -> dict[str, Any]:
    script = tmp_path / "early.py"
    script.write_text(SCRIPT)
    config = LaunchConfig(
        script=str(script),
        script_args=(str(tmp_path / "died"), mode),
        nproc=nproc,
        backend="gloo",
        run_dir=tmp_path / "run",
        echo=False,
        restarts=restarts,
        exit_grace=60.0,  # ranks still importing torch when a run fails at once get to exit
        coordinator=CoordinatorConfig(min_ranks=min_ranks),
    )
    summary = await launch(config)
    assert not any(_alive(r["pid"]) for r in summary["ranks"]), summary
    return summary


def _report(tmp_path: Path, rank: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tmp_path / "run" / f"rank{rank}.json").read_text())
    return data


def _log(tmp_path: Path, rank: int) -> str:
    return (tmp_path / "run" / f"rank{rank}.log").read_text()


async def test_a_rank_killed_before_joining_is_restarted_and_the_run_completes(
    tmp_path: Path,
) -> None:
    summary = await _run(tmp_path, 2, "die", restarts=1)
    assert summary["status"] == "completed", summary
    ranks = summary["ranks"]
    assert [r["exit_code"] for r in ranks] == [0, 0], summary
    assert [r["restarts"] for r in ranks] == [0, 1]
    assert [r["exit_reason"] for r in ranks] == ["completed", "completed"]
    assert all(r["syncs"] for r in ranks), ranks
    (death,) = summary["deaths"]
    assert (death["rank"], death["cause"]) == (1, "exited")
    assert "training finished" in _log(tmp_path, 1)


async def test_without_restarts_the_run_goes_on_with_the_ranks_that_joined(
    tmp_path: Path,
) -> None:
    summary = await _run(tmp_path, 3, "die")
    assert summary["status"] == "completed", summary
    ranks = summary["ranks"]
    assert [r["exit_code"] for r in ranks] == [0, -9, 0], summary
    assert ranks[1]["batches"] == 0 and ranks[1]["exit_reason"] is None
    for rank in (0, 2):
        assert ranks[rank]["exit_reason"] == "completed"
        assert ranks[rank]["syncs"], ranks
        assert "training finished" in _log(tmp_path, rank)
    # Every epoch was trained by the two that remain.
    assert [e["epoch"] for e in summary["epochs"]] == [0, 1], summary["epochs"]


async def test_below_min_ranks_the_run_ends_and_the_survivors_are_aborted(
    tmp_path: Path,
) -> None:
    summary = await _run(tmp_path, 3, "die", min_ranks=3)
    assert summary["status"] == "failed", summary
    why = "rank 1 exited with code -9 before joining; 2 ranks remain, fewer than min_ranks 3"
    assert why in summary["message"]
    ranks = summary["ranks"]
    assert [r["exit_code"] for r in ranks] == [1, -9, 1], summary
    for rank in (0, 2):
        reason = _report(tmp_path, rank)["exit_reason"]
        assert reason.startswith("aborted: ") and why in reason, reason
        log = _log(tmp_path, rank)
        assert "RunAborted" in log and "the coordinator ended this rank's run" in log
        assert "training finished" not in log


async def test_a_refused_rank_hears_why_and_raises_run_aborted(tmp_path: Path) -> None:
    summary = await _run(tmp_path, 2, "refuse")
    assert summary["status"] == "failed", summary
    assert [r["exit_code"] for r in summary["ranks"]] == [1, 1], summary
    # Whichever rank said Ready second describes another job than the run's.
    reasons = {rank: _report(tmp_path, rank)["exit_reason"] for rank in (0, 1)}
    (refused,) = [r for r, why in reasons.items() if why.startswith(f"aborted: rank {r} describes")]
    other = 1 - refused
    assert "describes job Job(" in reasons[refused] and ", others Job(" in reasons[refused]
    assert f"the coordinator ended this rank's run: rank {refused} describes" in _log(
        tmp_path, refused
    )
    # Its exit leaves one rank: the run cannot start, and the other rank is told so.
    assert f"rank {refused} exited with code 1 before joining" in reasons[other]
    assert "RunAborted" in _log(tmp_path, other)


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (("--min-ranks", "0"), "--min-ranks must be an integer >= 1, got 0"),
        (("--min-ranks", "3"), "--min-ranks must be at most the world size (2), got 3"),
    ],
)
def test_a_bad_min_ranks_is_refused_before_any_rank_starts(
    tmp_path: Path, flags: tuple[str, ...], error: str
) -> None:
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a rank started')\n")
    result = subprocess.run(
        [sys.executable, "-m", "flodl.cli", "run", "--nproc", "2", *flags, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert error in result.stderr
    assert "[rank" not in result.stdout and not (tmp_path / "runs").exists()
