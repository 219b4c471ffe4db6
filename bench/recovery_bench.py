"""Recovery benchmark: how long survivors take to average again after a rank is lost.

Writes bench/results/recovery.json and prints a short table. Each trial is one ``flodl run``
(:func:`flodl.launch.launcher.launch`) of N ranks (3, 8 and 16 by default, every N in the same run)
training the digits MLP (gloo, cadence policy), whose last rank (N - 1) faults itself while
computing a batch (``tests/e2e/chaos_rank.py``: the moment is written just before the
signal, with no fsync in between):

* **SIGKILL** (default heartbeat timeout, 10 s): the process is gone, its connection closes.
  Target: the survivors' next averaging round completes at most 0.5 s after the kill, at
  every N (torchft needs about 5 s with its defaults). Only the dead rank's ring neighbours
  see the closed connection in the collective; the others learn it from the coordinator.
* **SIGSTOP** with ``heartbeat_timeout = 2 s``: the process is alive, connected and silent,
  so only the heartbeat timeout can reveal it. Target: at most heartbeat timeout + 0.5 s.

Recovery time = the earliest moment a survivor finished an average on a group generation newer
than the one the faulty rank belonged to, minus the fault moment (both ``time.time()`` on this
machine). The fault point moves from trial to trial (after 20, 27, 34, ... batches at N = 3,
scaled by 3 / N, as each rank gets 1 / N of an epoch) so it lands at different places in a
window. Top-level keys ``sigkill_recovery_s_median`` and ``sigstop_recovery_s_median`` are
N = 3's (as before); ``by_nproc`` holds each N's medians, min/max, targets and per-trial
figures: the coordinator's own detection/recovery times from ``summary.json``, a breakdown of
the survivors' re-formation from ``chaos/rank<R>.events.jsonl``, and the 1-minute load average
around every trial. ``--quick`` runs one short trial of each at each N (figures mean little).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchenv
import trio
from benchenv import load

from flodl.config import CoordinatorConfig
from flodl.core.common.policy import Policy
from flodl.launch.config import LaunchConfig
from flodl.launch.launcher import launch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "recovery.json"
CHAOS_RANK = HERE.parent / "tests" / "e2e" / "chaos_rank.py"
NPROCS = (3, 8, 16)
REFERENCE_NPROC = 3
"""The N whose figures are also the top-level keys (the bench measured only N = 3 before)."""
TRIALS_16 = 5
"""Trials per fault at N >= 16 by default (as at smaller N): each 16-rank run takes about
50 s on 2 cores, most of it the ranks' start-up, so the whole default run takes ~15 min."""
EXTRA_EPOCHS = 2
HIDDEN = 64
SIGKILL_TARGET_S = 0.5
SIGSTOP_HEARTBEAT_TIMEOUT_S = 2.0
SIGSTOP_HEARTBEAT_TIMEOUT_LARGE_S = 5.0
"""The SIGSTOP trials' heartbeat timeout above 8 ranks. With 16 ranks on 2 cores every rank's
event loop stalls 2.3 - 2.7 s in its first group join (automatic full garbage collections while
numba loads in ``warm_up``, each ~0.15 s of one core with the GIL held, times 16 processes), so
a 2 s timeout declares healthy ranks dead before the fault (measured; see docs/benchmarks.md)."""
LARGE_NPROC = 8
SIGSTOP_HEARTBEAT_INTERVAL_S = 0.5
SIGSTOP_MARGIN_S = 0.5
TORCHFT_DEFAULT_S = 5.0
"""torchft's recovery time with its default timeouts, as quoted in the issue (reference only)."""
KINDS = (("sigkill", "kill-compute"), ("sigstop", "stop-compute"))


def environment() -> dict[str, object]:
    return benchenv.environment(("torch", "trio", "flodl"))


def epochs_at(nproc: int, epochs: int) -> int:
    """Epochs of a run of ``nproc`` ranks: 2 more above 3 ranks, so the last rank still reaches
    its fault point (its share of an epoch varies with the cadence) with rounds left after it."""
    return epochs if nproc <= REFERENCE_NPROC else epochs + EXTRA_EPOCHS


def sigstop_timeout(nproc: int) -> float:
    """The SIGSTOP trials' heartbeat timeout at ``nproc`` ranks."""
    return (
        SIGSTOP_HEARTBEAT_TIMEOUT_S if nproc <= LARGE_NPROC else SIGSTOP_HEARTBEAT_TIMEOUT_LARGE_S
    )


def source_state() -> dict[str, object]:
    """The commit measured, and which files under flodl/ differed from it (others edit too)."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=HERE.parent, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip()

    # Each line is "XY path"; the output's first line lost its leading space to strip().
    lines = git("status", "--porcelain", "--", "flodl").splitlines()
    dirty = [line.split(maxsplit=1)[-1] for line in lines if line.strip()]
    return {"commit": git("rev-parse", "HEAD"), "flodl_uncommitted": dirty}


def faulty_rank(nproc: int) -> int:
    return nproc - 1


QUICK_FAULT_BATCH = 5
"""``--quick``'s fault point: its 2 epochs can leave the last rank under 20 batches of its own
(the cadence gives a rank that a busy machine slows fewer), and then the run ends unfaulted."""


def fault_batch(nproc: int, trial_index: int) -> int:
    """After how many batches the faulty rank faults: 20, 27, 34, ... at N = 3, scaled by 3 / N."""
    return max(2, round((20 + 7 * trial_index) * REFERENCE_NPROC / nproc))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def recovery_after(run_dir: Path, survivors: list[int], fault: dict[str, Any]) -> float | None:
    """Seconds from the fault to the survivors' first average on a newer group (None: never)."""
    generation = fault["generation"]
    done = [
        float(r["unix"])
        for rank in survivors
        for r in read_jsonl(run_dir / "chaos" / f"rank{rank}.rounds.jsonl")
        if r["unix"] > fault["unix"] and (generation is None or r["generation"] > generation)
    ]
    return min(done) - float(fault["unix"]) if done else None


def reformation(run_dir: Path, survivors: list[int], fault: dict[str, Any]) -> dict[str, Any]:
    """Where the survivors' time went, from their ``events.jsonl`` (seconds after the fault).

    The first generation after the fault's: when the first and the last survivor began to join
    it, had joined it, began its first average on it and completed that average (each survivor's
    first such event counts).
    """
    origin = float(fault["unix"])
    old = fault["generation"]
    events = {
        rank: [e for e in read_jsonl(run_dir / "chaos" / f"rank{rank}.events.jsonl")]
        for rank in survivors
    }
    newer = [
        e["generation"]
        for evs in events.values()
        for e in evs
        if e["event"] == "joined" and e["unix"] > origin and (old is None or e["generation"] > old)
    ]
    if not newer:
        return {"generation": None}
    target = min(newer)

    def moments(what: str) -> list[float]:
        """Each survivor's first ``what`` event on the target generation."""
        firsts = [
            min(
                (float(e["unix"]) for e in evs if e["event"] == what and e["generation"] == target),
                default=None,
            )
            for evs in events.values()
        ]
        return [t - origin for t in firsts if t is not None]

    joins, joined, averages = moments("join"), moments("joined"), moments("average")
    first_done = [
        min(
            (
                float(r["unix"])
                for r in read_jsonl(run_dir / "chaos" / f"rank{rank}.rounds.jsonl")
                if r["generation"] == target
            ),
            default=None,
        )
        for rank in survivors
    ]
    done = [t - origin for t in first_done if t is not None]

    def span(values: list[float]) -> list[float] | None:
        return [round(min(values), 4), round(max(values), 4)] if values else None

    return {
        "generation": target,
        "join_started_s": span(joins),
        "joined_s": span(joined),
        "average_started_s": span(averages),
        "first_average_done_s": span(done),
        "survivors_joined": len(joined),
    }


async def trial(nproc: int, kind: str, at_batch: int, epochs: int, run_dir: Path) -> dict[str, Any]:
    """One run of ``nproc`` ranks whose last rank faults (``kill-compute`` / ``stop-compute``)."""
    sigstop = kind == "stop-compute"
    faulty = faulty_rank(nproc)
    coordinator = (
        CoordinatorConfig(
            policy=Policy.CADENCE,
            heartbeat_timeout=sigstop_timeout(nproc),
            heartbeat_interval=SIGSTOP_HEARTBEAT_INTERVAL_S,
        )
        if sigstop
        else CoordinatorConfig(policy=Policy.CADENCE)
    )
    config = LaunchConfig(
        script=str(CHAOS_RANK),
        script_args=(
            f"--epochs={epochs_at(nproc, epochs)}",
            f"--hidden={HIDDEN}",
            f"--fault={faulty}:{kind}:{at_batch}",
        ),
        nproc=nproc,
        backend="gloo",
        run_dir=run_dir,
        coordinator=coordinator,
        echo=False,
        exit_grace=3.0 if sigstop else 10.0,
    )
    load_before = load()
    with trio.fail_after(300):
        summary = await launch(config)
    survivors = [r for r in range(nproc) if r != faulty]
    others_dead = sorted(d["rank"] for d in summary["deaths"] if d["rank"] != faulty)
    fault_file = run_dir / "chaos" / f"rank{faulty}.fault.json"
    if not fault_file.exists():  # the run ended before the fault (say, ranks declared dead)
        return {
            "kind": kind,
            "at_batch": at_batch,
            "status": summary["status"],
            "fault_happened": False,
            "message": summary["message"],
            "other_ranks_declared_dead": others_dead,
            "recovery_s": None,
            "load_before": load_before,
            "load_after": load(),
            "wall_s": round(summary["wall_s"], 2),
        }
    fault = json.loads(fault_file.read_text())
    deaths = [d for d in summary["deaths"] if d["rank"] == faulty]
    death = deaths[0] if deaths else {}
    detected = death.get("detected_unix")
    accuracy = [summary["ranks"][r]["final_metrics"].get("test_accuracy") for r in survivors]
    known = [a for a in accuracy if a is not None]
    return {
        "kind": kind,
        "at_batch": at_batch,
        "status": summary["status"],
        "fault_happened": True,
        "other_ranks_declared_dead": others_dead,
        "recovery_s": recovery_after(run_dir, survivors, fault),
        "detection_s": None if detected is None else detected - float(fault["unix"]),
        "cause": death.get("cause"),
        "coordinator_recovery_s": death.get("recovery_s"),
        "fault_generation": fault["generation"],
        "reformation": reformation(run_dir, survivors, fault),
        "survivor_accuracy_min": min(known) if known else None,
        "survivor_accuracy_max": max(known) if known else None,
        "load_before": load_before,
        "load_after": load(),
        "wall_s": round(summary["wall_s"], 2),
    }


def recoveries(trials: list[dict[str, Any]]) -> list[float]:
    return [t["recovery_s"] for t in trials if t["recovery_s"] is not None]


def median_of(trials: list[dict[str, Any]]) -> float | None:
    values = recoveries(trials)
    return statistics.median(values) if values else None


def trials_at(nproc: int, trials: int, trials_16: int) -> int:
    return trials_16 if nproc >= 16 else trials


async def run_all(
    nprocs: list[int],
    faults: list[str],
    trials: int,
    trials_16: int,
    epochs: int,
    keep: Path | None,
    quick: bool = False,
) -> dict[int, dict[str, list[dict[str, Any]]]]:
    results: dict[int, dict[str, list[dict[str, Any]]]] = {
        n: {name: [] for name, _ in KINDS} for n in nprocs
    }
    with tempfile.TemporaryDirectory(prefix="flodl-recovery-") as scratch:
        base = keep or Path(scratch)
        for nproc in nprocs:
            count = trials_at(nproc, trials, trials_16)
            for i in range(count):
                for name, kind in KINDS:
                    if name not in faults:
                        continue
                    at_batch = QUICK_FAULT_BATCH if quick else fault_batch(nproc, i)
                    run_dir = base / f"n{nproc}-{name}-{i}"
                    outcome = await trial(nproc, kind, at_batch, epochs, run_dir)
                    results[nproc][name].append(outcome)
                    shown = outcome["recovery_s"]
                    print(
                        f"  N={nproc} {name} trial {i + 1}/{count} (after {at_batch} batches): "
                        f"recovery {'-' if shown is None else f'{shown:.3f} s'}, "
                        f"load {outcome['load_before']}, wall {outcome['wall_s']} s",
                        flush=True,
                    )
    return results


def summarize(nproc: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One N's medians, ranges and targets, with its trials."""
    sigkill, sigstop = median_of(runs["sigkill"]), median_of(runs["sigstop"])
    sigstop_max = sigstop_timeout(nproc) + SIGSTOP_MARGIN_S
    out: dict[str, Any] = {
        "sigkill_recovery_s_median": sigkill,
        "sigstop_recovery_s_median": sigstop,
    }
    for name, _ in KINDS:
        values = recoveries(runs[name])
        out[f"{name}_recovery_s_min"] = min(values) if values else None
        out[f"{name}_recovery_s_max"] = max(values) if values else None
        out[f"{name}_trials"] = len(runs[name])
        out[f"{name}_recovered"] = len(values)
    out["sigstop_heartbeat_timeout_s"] = sigstop_timeout(nproc)
    out["targets"] = {
        "sigkill_recovery_s_max": SIGKILL_TARGET_S,
        "sigkill_ok": sigkill is not None and sigkill <= SIGKILL_TARGET_S,
        "sigstop_recovery_s_max": sigstop_max,
        "sigstop_ok": sigstop is not None and sigstop <= sigstop_max,
        "torchft_default_recovery_s": TORCHFT_DEFAULT_S,
    }
    out["trials"] = runs
    return out


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_table(by_nproc: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'N':>3} {'fault':<8} {'median s':>9} {'min s':>7} {'max s':>7} {'target s':>9}  ok")
    for n, result in by_nproc.items():
        for name, key in (("SIGKILL", "sigkill"), ("SIGSTOP", "sigstop")):
            target = result["targets"][f"{key}_recovery_s_max"]
            print(
                f"{n:>3} {name:<8} {fmt(result[f'{key}_recovery_s_median']):>9} "
                f"{fmt(result[f'{key}_recovery_s_min']):>7} "
                f"{fmt(result[f'{key}_recovery_s_max']):>7} "
                f"{target:>9.2f}  {'yes' if result['targets'][f'{key}_ok'] else 'NO'}"
            )


def parse_nprocs(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 3:
        raise argparse.ArgumentTypeError(f"--nproc wants a list of N >= 3, got {text!r}")
    return values


def parse_faults(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    known = [name for name, _ in KINDS]
    if not names or any(n not in known for n in names):
        raise argparse.ArgumentTypeError(f"--faults wants some of {known}, got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="flodl recovery benchmark")
    parser.add_argument("--quick", action="store_true", help="one short trial of each per N")
    parser.add_argument(
        "--nproc", type=parse_nprocs, default=list(NPROCS), help="ranks per run, e.g. 3,8,16"
    )
    parser.add_argument("--trials", type=int, default=5, help="trials per fault and N (>= 5)")
    parser.add_argument(
        "--trials-16",
        type=int,
        default=TRIALS_16,
        help=f"trials per fault at N >= 16 (default {TRIALS_16}: a 16-rank run takes ~50 s)",
    )
    parser.add_argument(
        "--faults",
        type=parse_faults,
        default=[name for name, _ in KINDS],
        help="which faults to run: sigkill,sigstop (both by default)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run dirs here")
    args = parser.parse_args(argv)
    if args.quick:
        trials = trials_16 = 1
        epochs = 2
    else:
        trials = max(args.trials, 5)
        trials_16 = max(args.trials_16, 1)
        epochs = args.epochs
    nprocs: list[int] = args.nproc

    started = time.perf_counter()
    print(
        f"recovery bench: N = {', '.join(map(str, nprocs))} ranks, rank N-1 faults; "
        f"{trials} trial(s) of each ({trials_16} at N >= 16)",
        flush=True,
    )
    load_start = load()
    source_start = source_state()
    runs = trio.run(run_all, nprocs, args.faults, trials, trials_16, epochs, args.keep, args.quick)
    by_nproc = {str(n): summarize(n, runs[n]) for n in nprocs}
    reference = by_nproc.get(str(REFERENCE_NPROC)) or by_nproc[str(nprocs[0])]
    result: dict[str, Any] = {
        "sigkill_recovery_s_median": reference["sigkill_recovery_s_median"],
        "sigstop_recovery_s_median": reference["sigstop_recovery_s_median"],
        "targets": {
            **reference["targets"],
            "every_n_ok": all(
                r["targets"]["sigkill_ok"] and r["targets"]["sigstop_ok"] for r in by_nproc.values()
            ),
        },
        "quick": args.quick,
        "nprocs": nprocs,
        "by_nproc": by_nproc,
        "settings": {
            "processes": nprocs,
            "top_level_keys_nproc": REFERENCE_NPROC
            if str(REFERENCE_NPROC) in by_nproc
            else nprocs[0],
            "faulty_rank": "N - 1",
            "trials_per_fault": {str(n): trials_at(n, trials, trials_16) for n in nprocs},
            "backend": "gloo",
            "policy": "cadence",
            "task": f"digits MLP 64-{HIDDEN}-10, Adam lr 0.01, batch 16",
            "epochs": {str(n): epochs_at(n, epochs) for n in nprocs},
            "fault_after_batches": "round((20 + 7 i) * 3 / N) for trial i = 0, 1, ...",
            "sigkill_heartbeat_timeout_s": CoordinatorConfig().heartbeat_timeout,
            "sigstop_heartbeat_timeout_s": {str(n): sigstop_timeout(n) for n in nprocs},
            "sigstop_heartbeat_interval_s": SIGSTOP_HEARTBEAT_INTERVAL_S,
            "measure": "fault moment (written by the rank before the signal) to the first "
            "average a survivor completed on a newer group generation",
        },
        "load_average": {"start": load_start, "end": load()},
        "total_bench_s": round(time.perf_counter() - started, 1),
        "environment": environment(),
        "source": {"start": source_start, "end": source_state()},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print_table(by_nproc)
    print(f"load average {load()} on {os.cpu_count()} cpus; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
