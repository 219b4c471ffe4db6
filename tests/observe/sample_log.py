"""Hand-written event logs for the report and TensorBoard tests: small, with known values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

UNIX0 = 1_800_000_000.0


def _rank(batches: int, ms: float, idle_ms: float, averaging_ms: float, div: float | None) -> Any:
    return {
        "batches": batches,
        "ms_per_batch": ms if batches else None,
        "samples_per_s": 16 * 1000.0 / ms if batches else None,
        "idle_ms": idle_ms,
        "loss": 3.0 / (1 + batches) if batches else None,
        "averaging_ms": averaging_ms,
        "divergence": div,
        "pre_norm": 1.0,
        "post_norm": 1.0,
    }


def records(*, death: bool, divergence: bool = True) -> list[dict[str, Any]]:
    """A 3-rank run: rounds 1, 2, then (``death``) rank 2 dies in round 3, the group
    re-forms as generation 1 of ranks 0 and 1, round 4 redoes it, rank 2 rejoins, a save is
    asked and made; round 5 ends the run. Without ``death``: rounds 1, 2, 3 of all three."""
    out: list[dict[str, Any]] = []

    def add(t: float, kind: str, **detail: Any) -> None:
        out.append({"v": 1, "seq": len(out), "t": t, "unix": UNIX0 + t, "kind": kind, **detail})

    def div(value: float) -> float | None:
        return value if divergence else None

    members = [0, 1, 2]
    for rank in members:
        add(1.0, "RankJoined", rank=rank)
    add(1.0, "TrainingStarted", batch_size=16, epochs=2, members=members, generation=0)
    add(1.0, "SyncStart", round=1, steps=[0, 0, 0])
    zero = {str(r): _rank(0, 0.0, 0.0, 500.0, div(0.0)) for r in members}
    add(1.5, "SyncEnd", round=1, generation=0, redo=False, global_step=0, window_s=0.0,
        duration_s=0.5, ranks=zero)  # fmt: skip
    add(2.0, "SyncStart", round=2, steps=[10, 20, 5])
    second = {
        "0": _rank(10, 4.0, 100.0, 20.0, div(0.5)),
        "1": _rank(20, 2.0, 50.0, 30.0, div(0.25)),
        "2": _rank(5, 8.0, 0.0, 40.0, div(0.75)),
    }
    add(2.04, "SyncEnd", round=2, generation=0, redo=False, global_step=35, window_s=0.5,
        duration_s=0.04, ranks=second)  # fmt: skip
    add(2.1, "EpochAggregated", epoch=0, avg_loss=1.5, samples=1440)
    add(2.5, "SyncStart", round=3, steps=[10, 20, 5])
    if death:
        add(2.7, "RankDead", rank=2, cause="disconnected", why="process exited with code -9")
        add(2.8, "GroupReformed", generation=1, members=[0, 1], took_s=0.1)
        add(2.8, "SyncStart", round=4, redo=True, redoes=3)
        redo = {"0": _rank(10, 4.0, 10.0, 60.0, div(0.2)), "1": _rank(20, 2.0, 5.0, 60.0, div(0.1))}
        add(2.86, "SyncEnd", round=4, generation=1, redo=True, global_step=70, window_s=0.5,
            duration_s=0.06, ranks=redo)  # fmt: skip
        add(3.0, "RankJoined", rank=2, rejoin=True)
        add(3.1, "SaveRequested", reason="PERIODIC", why="every 2 rounds")
        add(3.2, "CheckpointSaved", rank=0, version=1, elapsed_ms=40.0, error=None)
        add(3.3, "SyncStart", round=5, steps=[12, 24, 0])
        last = {"0": _rank(12, 4.0, 1.0, 9.0, div(0.1)), "1": _rank(24, 2.0, 2.0, 10.0, div(0.05))}
        add(3.31, "SyncEnd", round=5, generation=1, redo=False, global_step=106, window_s=0.5,
            duration_s=0.01, ranks=last)  # fmt: skip
    else:
        third = {str(r): _rank(10, 4.0, 5.0, 10.0, div(0.1)) for r in members}
        add(2.52, "SyncEnd", round=3, generation=0, redo=False, global_step=65, window_s=0.5,
            duration_s=0.02, ranks=third)  # fmt: skip
    add(out[-1]["t"] + 0.05, "EpochAggregated", epoch=1, avg_loss=0.5, samples=1440)
    add(out[-1]["t"] + 0.01, "Shutdown", why="all epochs done")
    return out


def write_log(run_dir: Path, log: list[dict[str, Any]]) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "events.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in log), encoding="utf-8")
    return path
