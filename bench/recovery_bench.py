"""Recovery benchmark: how long survivors take to average again after a rank is lost.

Writes bench/results/recovery.json and prints a short table. Each trial is one ``flodl run``
(:func:`flodl.launcher.launch`) of 3 ranks training the digits MLP (gloo, cadence policy),
whose rank 2 faults itself while computing a batch (``tests/e2e/chaos_rank.py``: the moment
is written, fsync'ed, just before the signal):

* **SIGKILL** (default heartbeat timeout, 10 s): the process is gone, its connection closes.
  Target: the survivors' next averaging round completes at most 0.5 s after the kill
  (torchft needs about 5 s with its defaults).
* **SIGSTOP** with ``heartbeat_timeout = 2 s``: the process is alive, connected and silent,
  so only the heartbeat timeout can reveal it. Target: at most heartbeat timeout + 0.5 s.

Recovery time = the earliest moment a survivor finished an average on a group generation newer
than the one the faulty rank belonged to, minus the fault moment (both ``time.time()`` on this
machine). The kill point moves from trial to trial (after 20, 27, 34, ... batches) so it lands
at different places in a window. Keys ``sigkill_recovery_s_median`` and
``sigstop_recovery_s_median`` (median of >= 5 trials); per-trial figures, the coordinator's
own detection/recovery times from ``summary.json``, and the 1-minute load average around every
trial are kept too. ``--quick`` runs one short trial of each (figures mean little).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchenv
import trio
from benchenv import load

from flodl.config import CoordinatorConfig
from flodl.core.cycle import Policy
from flodl.launcher import LaunchConfig, launch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "recovery.json"
CHAOS_RANK = HERE.parent / "tests" / "e2e" / "chaos_rank.py"
NPROC = 3
FAULTY_RANK = 2
SIGKILL_TARGET_S = 0.5
SIGSTOP_HEARTBEAT_TIMEOUT_S = 2.0
SIGSTOP_MARGIN_S = 0.5
TORCHFT_DEFAULT_S = 5.0
"""torchft's recovery time with its default timeouts, as quoted in the issue (reference only)."""


def environment() -> dict[str, object]:
    return benchenv.environment(("torch", "trio", "flodl"))


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


async def trial(kind: str, at_batch: int, epochs: int, run_dir: Path) -> dict[str, Any]:
    """One run of 3 ranks whose rank 2 faults (``kill-compute`` / ``stop-compute``)."""
    sigstop = kind == "stop-compute"
    coordinator = (
        CoordinatorConfig(
            policy=Policy.CADENCE,
            heartbeat_timeout=SIGSTOP_HEARTBEAT_TIMEOUT_S,
            heartbeat_interval=0.5,
        )
        if sigstop
        else CoordinatorConfig(policy=Policy.CADENCE)
    )
    config = LaunchConfig(
        script=str(CHAOS_RANK),
        script_args=(f"--epochs={epochs}", f"--fault={FAULTY_RANK}:{kind}:{at_batch}"),
        nproc=NPROC,
        backend="gloo",
        run_dir=run_dir,
        coordinator=coordinator,
        echo=False,
        exit_grace=3.0 if sigstop else 10.0,  # the stopped rank is killed after the grace
    )
    load_before = load()
    with trio.fail_after(180):
        summary = await launch(config)
    fault = json.loads((run_dir / "chaos" / f"rank{FAULTY_RANK}.fault.json").read_text())
    survivors = [r for r in range(NPROC) if r != FAULTY_RANK]
    deaths = [d for d in summary["deaths"] if d["rank"] == FAULTY_RANK]
    death = deaths[0] if deaths else {}
    detected = death.get("detected_unix")
    return {
        "kind": kind,
        "at_batch": at_batch,
        "status": summary["status"],
        "recovery_s": recovery_after(run_dir, survivors, fault),
        "detection_s": None if detected is None else detected - float(fault["unix"]),
        "cause": death.get("cause"),
        "coordinator_recovery_s": death.get("recovery_s"),
        "survivor_accuracy": [
            summary["ranks"][r]["final_metrics"].get("test_accuracy") for r in survivors
        ],
        "load_before": load_before,
        "load_after": load(),
        "wall_s": round(summary["wall_s"], 2),
    }


def median_of(trials: list[dict[str, Any]]) -> float | None:
    values = [t["recovery_s"] for t in trials if t["recovery_s"] is not None]
    return statistics.median(values) if values else None


async def run_all(trials: int, epochs: int, keep: Path | None) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {"sigkill": [], "sigstop": []}
    with tempfile.TemporaryDirectory(prefix="flodl-recovery-") as scratch:
        base = keep or Path(scratch)
        for i in range(trials):
            for name, kind in (("sigkill", "kill-compute"), ("sigstop", "stop-compute")):
                at_batch = 20 + 7 * i
                outcome = await trial(kind, at_batch, epochs, base / f"{name}-{i}")
                results[name].append(outcome)
                shown = outcome["recovery_s"]
                print(
                    f"  {name} trial {i + 1}/{trials} (after {at_batch} batches): "
                    f"recovery {'-' if shown is None else f'{shown:.3f} s'}, "
                    f"load {outcome['load_before']}",
                    flush=True,
                )
    return results


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'fault':<8} {'median s':>9} {'min s':>7} {'max s':>7} {'target s':>9}  ok")
    for name, key in (("SIGKILL", "sigkill"), ("SIGSTOP", "sigstop")):
        values = [t["recovery_s"] for t in result["trials"][key] if t["recovery_s"] is not None]
        target = result["targets"][f"{key}_recovery_s_max"]
        print(
            f"{name:<8} {fmt(result[f'{key}_recovery_s_median']):>9} "
            f"{fmt(min(values) if values else None):>7} {fmt(max(values) if values else None):>7} "
            f"{target:>9.2f}  {'yes' if result['targets'][f'{key}_ok'] else 'NO'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="flodl recovery benchmark")
    parser.add_argument("--quick", action="store_true", help="one short trial of each")
    parser.add_argument("--trials", type=int, default=5, help="trials per fault (>= 5)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run dirs here")
    args = parser.parse_args(argv)
    trials, epochs = (1, 2) if args.quick else (max(args.trials, 5), args.epochs)

    started = time.perf_counter()
    print(
        f"recovery bench: {NPROC} ranks, rank {FAULTY_RANK} faults; {trials} trial(s) each",
        flush=True,
    )
    load_start = load()
    runs = trio.run(run_all, trials, epochs, args.keep)
    sigkill, sigstop = median_of(runs["sigkill"]), median_of(runs["sigstop"])
    sigstop_max = SIGSTOP_HEARTBEAT_TIMEOUT_S + SIGSTOP_MARGIN_S
    result: dict[str, Any] = {
        "sigkill_recovery_s_median": sigkill,
        "sigstop_recovery_s_median": sigstop,
        "targets": {
            "sigkill_recovery_s_max": SIGKILL_TARGET_S,
            "sigkill_ok": sigkill is not None and sigkill <= SIGKILL_TARGET_S,
            "sigstop_recovery_s_max": sigstop_max,
            "sigstop_ok": sigstop is not None and sigstop <= sigstop_max,
            "torchft_default_recovery_s": TORCHFT_DEFAULT_S,
        },
        "quick": args.quick,
        "trials": runs,
        "settings": {
            "processes": NPROC,
            "faulty_rank": FAULTY_RANK,
            "backend": "gloo",
            "policy": "cadence",
            "task": f"digits MLP 64-64-10, Adam lr 0.01, batch 16, {epochs} epochs",
            "sigkill_heartbeat_timeout_s": CoordinatorConfig().heartbeat_timeout,
            "sigstop_heartbeat_timeout_s": SIGSTOP_HEARTBEAT_TIMEOUT_S,
            "sigstop_heartbeat_interval_s": 0.5,
            "measure": "fault moment (written by the rank before the signal) to the first "
            "average a survivor completed on a newer group generation",
        },
        "load_average": {"start": load_start, "end": load()},
        "total_bench_s": round(time.perf_counter() - started, 1),
        "environment": environment(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"load average {load()} on {os.cpu_count()} cpus; wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
