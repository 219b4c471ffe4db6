"""What the same run would have taken under lock-step DDP: an estimate from its own timings.

A run of ranks of unequal speed cannot measure its alternative without running it, so the
closing summary states an *estimate* and says so. Lock-step DDP trains one batch per rank per
step and every step waits for the slowest rank, so training the batches this run trained takes
DDP ``batches / nproc`` steps of the slowest rank's step time. Each rank's step time is measured
here: its training seconds less the time it sat idle or averaging, over its batches.

The estimate assumes DDP needs as many batches as flodl to reach the same quality, and leaves
out DDP's gradient all-reduce (so it flatters DDP). The time-to-quality bench measures how
well the assumption holds (``docs/benchmarks.md``, "Time to quality").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

METHOD = (
    "estimated: lock-step DDP trains the same batches at the slowest rank's measured step time "
    "(batches / ranks steps), assuming it needs as many batches for the same quality; its "
    "gradient all-reduce is left out"
)


def training_s(rank: Mapping[str, Any]) -> float | None:
    """Seconds from the rank's first batch to its exit (None: not reported)."""
    wall, startup = rank.get("wall_s"), rank.get("startup_s") or 0.0
    if not isinstance(wall, int | float) or not isinstance(startup, int | float):
        return None
    return float(wall) - float(startup)


def step_s(rank: Mapping[str, Any]) -> float | None:
    """The rank's mean seconds per batch, idle and averaging time left out (None: unknown)."""
    trained, batches = training_s(rank), rank.get("batches")
    idle, averaging = rank.get("idle_s"), rank.get("averaging_s")
    if trained is None or not isinstance(batches, int) or batches <= 0:
        return None
    if not isinstance(idle, int | float) or not isinstance(averaging, int | float):
        return None
    busy = trained - float(idle) - float(averaging)
    return busy / batches if busy > 0 else None


def versus_ddp(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The run's training seconds against lock-step DDP's estimated seconds for its batches.

    None when a rank's timings are missing (a rank that died or never reported): an estimate
    from part of the run would compare different amounts of training.
    """
    if len(ranks) < 2:
        return None
    steps = [step_s(rank) for rank in ranks]
    trained = [training_s(rank) for rank in ranks]
    known_steps = [s for s in steps if s is not None]
    known_trained = [t for t in trained if t is not None]
    if len(known_steps) < len(ranks) or len(known_trained) < len(ranks):
        return None
    run_s = max(known_trained)
    if run_s <= 0:
        return None
    batches = sum(int(rank["batches"]) for rank in ranks)
    ddp_s = batches / len(ranks) * max(known_steps)
    return {
        "flodl_s": round(run_s, 3),
        "ddp_estimated_s": round(ddp_s, 3),
        "speedup_vs_ddp": round(ddp_s / run_s, 3),
        "batches": batches,
        "slowest_step_s": round(max(known_steps), 6),
        "method": METHOD,
    }


def describe(estimate: Mapping[str, Any]) -> str:
    """One line for the closing summary."""
    return (
        f"time to quality vs lock-step DDP (estimated): {estimate['speedup_vs_ddp']:.2f}x "
        f"({estimate['flodl_s']:.1f} s here; DDP ~{estimate['ddp_estimated_s']:.1f} s for the "
        f"same {estimate['batches']} batches at the slowest rank's pace)"
    )
