"""Training benchmark: flodl against plain torch.distributed on the same model, data and ranks.

Writes bench/results/training.json and prints a short account. Two measurements, each side by
side in one run (gloo, CPU, ``torch.set_num_threads(1)`` in every rank):

(a) **Averaging overhead** (:mod:`averaging_overhead`): flodl's averaging round
    (``GlooBackend.average``: what a rank does between SyncNow and SyncAck) over a bare
    ``allreduce`` of one flat float32 buffer of the same size on a plain gloo group, for a
    10.5M-parameter model, 2 ranks (fairer than 4 on a 2-core machine), interleaved, median
    of the slowest rank's time. Key ``overhead_ratio`` (target <= 1.15).
(b) **Heterogeneous throughput** (:mod:`training_task`): 4 ranks, rank 3 made 2.5x slower,
    the digits MLP trained for the same epochs by ``flodl run --policy cadence``
    (:mod:`flodl_rank`, via :func:`flodl.launch.launcher.launch`) and by torch
    DistributedDataParallel (:mod:`ddp_baseline`). samples/s = samples trained by all ranks /
    training window (first batch handed out on any rank to the end of the last rank's loop;
    process start-up excluded on both sides). Keys ``speedup_vs_ddp`` (target >= 1.5),
    ``fast_rank_idle_share`` (max over the fast ranks of idle_s / wall_s from flodl's
    summary.json: time a rank waited with nothing to do, for work or for the round to start;
    target < 0.05) and ``accuracy_gap_points`` (DDP - flodl test accuracy, in points; target
    <= 0.5). Time spent averaging is reported beside it (``fast_rank_averaging_share``) and
    with it (``fast_rank_not_training_share``), the figure to set against DDP's all-reduce
    wait share (``ddp_fast_rank_allreduce_wait_share``, which holds both its waiting and its
    communication).

(c) **Goodput against the ceiling** (:mod:`ceiling`): the ceiling is the same ranks (same
    processes, model, batch size and per-rank slowdown) training with no communication at
    all, all at once on this machine. Its processes start and get ready first, train
    ``--ceiling-s / 2`` seconds, wait (blocked, no CPU) while flodl runs, then train another
    ``--ceiling-s / 2``: a change of the machine's load during the row weighs on both sides.
    Its samples/s is the sum over its ranks over the same kind of window as flodl's (first
    batch on any rank to the end of the last rank's loop, summed over the two segments;
    start-up and group forming excluded on both sides). ``goodput_vs_ceiling`` = flodl
    samples/s / ceiling samples/s, for (b)'s configuration (target >= 0.90, with the
    accuracy gap of (b)) and in ``goodput_table`` for every rank count of ``--nprocs`` and
    skew of ``--skews`` (the last rank that much slower; the (b) row is (b)'s run, with DDP).

The machine may be shared: the 1-minute load average is recorded before and after each part
and row (``load_average_1m``: before the bench). ``--quick`` shrinks everything (2 ranks, tiny
models, one epoch, skews 1 and 2.5) for the smoke test; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import benchenv
import trio
from averaging_overhead import run_overhead
from benchenv import load
from ceiling import Ceiling
from ddp_baseline import run_ddp
from training_task import TaskConfig

from flodl.config import CoordinatorConfig
from flodl.core.common.policy import Policy
from flodl.launch.config import LaunchConfig
from flodl.launch.launcher import launch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "training.json"
FLODL_RANK = HERE / "flodl_rank.py"
OVERHEAD_TARGET = 1.15
SPEEDUP_TARGET = 1.5
IDLE_TARGET = 0.05
ACCURACY_GAP_TARGET = 0.5
GOODPUT_TARGET = 0.90


def environment() -> dict[str, object]:
    return benchenv.environment(("torch", "trio", "flodl"))


def window(reports: list[dict[str, Any]]) -> float:
    """Seconds from the first batch on any rank to the end of the last rank's loop."""
    return float(
        max(r["loop_end_unix"] for r in reports) - min(r["first_batch_unix"] for r in reports)
    )


def run_flodl(task: TaskConfig, nproc: int, coordinator: CoordinatorConfig) -> dict[str, Any]:
    """One ``flodl run`` of the task; throughput, idle shares and accuracy from summary.json."""
    with tempfile.TemporaryDirectory(prefix="flodl-train-bench-") as tmp:
        config = LaunchConfig(
            script=str(FLODL_RANK),
            script_args=tuple(task.args()),
            nproc=nproc,
            backend="gloo",
            run_dir=Path(tmp) / "run",
            coordinator=coordinator,
            echo=False,
            exit_grace=30.0,
        )
        summary = trio.run(launch, config)
        if summary["status"] != "completed" or any(r["exit_code"] != 0 for r in summary["ranks"]):
            logs = "\n".join((config.run_dir / f"rank{r}.log").read_text() for r in range(nproc))
            raise RuntimeError(f"flodl run did not complete: {summary['message']}\n{logs}")
    ranks = summary["ranks"]
    reports = [r["final_metrics"] for r in ranks]
    samples = sum(int(r["samples"]) for r in reports)
    wall = window(reports)
    fast = [r for r in ranks if r["rank"] != task.slow_rank]
    return {
        "samples": samples,
        "window_s": round(wall, 3),
        "samples_per_s": round(samples / wall, 1),
        "test_accuracy": statistics.mean(r["test_accuracy"] for r in reports),
        "fast_rank_idle_share": round(max(r["idle_share"] for r in fast), 4),
        "fast_rank_averaging_share": round(max(r["averaging_share"] for r in fast), 4),
        "fast_rank_not_training_share": round(
            max(r["idle_share"] + r["averaging_share"] for r in fast), 4
        ),
        "rounds": summary["rounds"],
        "final_anchor": summary["anchor"],
        "final_batch_counts": summary["batch_counts"],
        "per_rank": [
            {
                "rank": r["rank"],
                "batches": r["batches"],
                "syncs": r["syncs"],
                "idle_s": round(r["idle_s"], 3),
                "averaging_s": round(r["averaging_s"], 3),
                "wall_s": round(r["wall_s"], 3),
                "idle_share": round(r["idle_share"], 4),
                "averaging_share": round(r["averaging_share"], 4),
                "startup_wait_s": round(r["final_metrics"]["startup_wait_s"], 3),
            }
            for r in ranks
        ],
    }


def run_ddp_side(task: TaskConfig, nproc: int) -> dict[str, Any]:
    """One DDP run of the task; throughput, all-reduce wait shares and accuracy."""
    reports = run_ddp(task, nproc)
    samples = sum(int(r["samples"]) for r in reports)
    wall = window(reports)
    fast = [r for r in reports if r["rank"] != task.slow_rank]
    return {
        "samples": samples,
        "window_s": round(wall, 3),
        "samples_per_s": round(samples / wall, 1),
        "test_accuracy": reports[0]["test_accuracy"],
        "fast_rank_allreduce_wait_share": round(
            max(r["comm_s"] / (r["loop_end_unix"] - r["first_batch_unix"]) for r in fast), 4
        ),
    }


def ceiling_figures(
    segments: list[list[dict[str, Any]]], accuracies: list[float]
) -> dict[str, Any]:
    """The ceiling's samples/s over its segments (summed samples / summed segment windows)."""
    samples = [sum(int(r["samples"]) for r in reports) for reports in segments]
    windows = [window(reports) for reports in segments]
    return {
        "samples": sum(samples),
        "window_s": round(sum(windows), 3),
        "samples_per_s": round(sum(samples) / sum(windows), 1),
        "segment_samples_per_s": [round(n / w, 1) for n, w in zip(samples, windows, strict=True)],
        "segment_window_s": [round(w, 3) for w in windows],
        "per_rank_samples": [
            sum(int(reports[rank]["samples"]) for reports in segments)
            for rank in range(len(segments[0]))
        ],
        "test_accuracy_mean": statistics.mean(accuracies),
    }


def timed(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run(*args)``'s result with the seconds it took, processes and all (``process_wall_s``)."""
    started = time.perf_counter()
    result = run(*args)
    result["process_wall_s"] = round(time.perf_counter() - started, 1)
    return result


def flodl_within_ceiling(
    task: TaskConfig, nproc: int, coordinator: CoordinatorConfig, ceiling_s: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """flodl between two segments of the ceiling (each ``ceiling_s / 2`` of training, its
    processes started and ready before the first, idle while flodl runs): (flodl, ceiling)."""
    started = time.perf_counter()
    with Ceiling(task, nproc) as ceiling:
        before = ceiling.segment(ceiling_s / 2)
        flodl = timed(run_flodl, task, nproc, coordinator)
        after = ceiling.segment(ceiling_s / 2)
    figures = ceiling_figures([before, after], ceiling.test_accuracy)
    figures["process_wall_s"] = round(time.perf_counter() - started - flodl["process_wall_s"], 1)
    return flodl, figures


def goodput_row(
    task: TaskConfig, nproc: int, coordinator: CoordinatorConfig, ceiling_s: float
) -> dict[str, Any]:
    """flodl within the ceiling (:func:`flodl_within_ceiling`): one row of the goodput table."""
    row: dict[str, Any] = {"load_before": load()}
    row["flodl"], row["ceiling"] = flodl_within_ceiling(task, nproc, coordinator, ceiling_s)
    row["load_after"] = load()
    row["goodput_vs_ceiling"] = round(
        row["flodl"]["samples_per_s"] / row["ceiling"]["samples_per_s"], 3
    )
    return row


def throughput(
    task: TaskConfig, nproc: int, coordinator: CoordinatorConfig, repeats: int, ceiling_s: float
) -> dict[str, Any]:
    """``repeats`` runs of DDP and of flodl within the ceiling (DDP first every other time);
    medians over the repeats."""
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        pair: dict[str, Any] = {"load_before": load()}
        order = ("ddp", "flodl") if repeat % 2 == 0 else ("flodl", "ddp")
        for side in order:
            if side == "ddp":
                pair["ddp"] = timed(run_ddp_side, task, nproc)
            else:
                pair["flodl"], pair["ceiling"] = flodl_within_ceiling(
                    task, nproc, coordinator, ceiling_s
                )
        pair["load_after"] = load()
        pair["speedup"] = round(pair["flodl"]["samples_per_s"] / pair["ddp"]["samples_per_s"], 3)
        pair["goodput_vs_ceiling"] = round(
            pair["flodl"]["samples_per_s"] / pair["ceiling"]["samples_per_s"], 3
        )
        runs.append(pair)
        print(
            f"  run {repeat}: flodl {pair['flodl']['samples_per_s']:.0f} samples/s, "
            f"ceiling {pair['ceiling']['samples_per_s']:.0f}, "
            f"DDP {pair['ddp']['samples_per_s']:.0f}; goodput {pair['goodput_vs_ceiling']:.3f}, "
            f"speedup {pair['speedup']:.2f}x, "
            f"fast-rank idle {100 * pair['flodl']['fast_rank_idle_share']:.1f}%",
            flush=True,
        )

    def median(side: str, key: str) -> float:
        return float(statistics.median(r[side][key] for r in runs))

    flodl_acc, ddp_acc = median("flodl", "test_accuracy"), median("ddp", "test_accuracy")
    return {
        "speedup_vs_ddp": round(statistics.median(r["speedup"] for r in runs), 3),
        "fast_rank_idle_share": round(median("flodl", "fast_rank_idle_share"), 4),
        "fast_rank_averaging_share": round(median("flodl", "fast_rank_averaging_share"), 4),
        "fast_rank_not_training_share": round(median("flodl", "fast_rank_not_training_share"), 4),
        "flodl_samples_per_s": median("flodl", "samples_per_s"),
        "ddp_samples_per_s": median("ddp", "samples_per_s"),
        "flodl_test_accuracy": round(flodl_acc, 4),
        "ddp_test_accuracy": round(ddp_acc, 4),
        "accuracy_gap_points": round(100 * (ddp_acc - flodl_acc), 2),
        "ddp_fast_rank_allreduce_wait_share": round(
            median("ddp", "fast_rank_allreduce_wait_share"), 4
        ),
        "ceiling_samples_per_s": median("ceiling", "samples_per_s"),
        "goodput_vs_ceiling": round(statistics.median(r["goodput_vs_ceiling"] for r in runs), 3),
        "runs": runs,
    }


def table_row(nproc: int, skew: float, run: dict[str, Any]) -> dict[str, Any]:
    """One row of ``goodput_table`` from one :func:`goodput_row` (or throughput) run."""
    flodl, ceiling = run["flodl"], run["ceiling"]
    row: dict[str, Any] = {
        "nproc": nproc,
        "skew": skew,
        "flodl_samples_per_s": flodl["samples_per_s"],
        "ceiling_samples_per_s": ceiling["samples_per_s"],
        "goodput_vs_ceiling": run["goodput_vs_ceiling"],
        "flodl_test_accuracy": round(flodl["test_accuracy"], 4),
        "ceiling_test_accuracy_mean": round(ceiling["test_accuracy_mean"], 4),
        "flodl_window_s": flodl["window_s"],
        "ceiling_window_s": ceiling["window_s"],
        "fast_rank_idle_share": flodl["fast_rank_idle_share"],
        "fast_rank_averaging_share": flodl["fast_rank_averaging_share"],
        "rounds": flodl["rounds"],
        "load_before": run["load_before"],
        "load_after": run["load_after"],
    }
    if "ddp" in run:
        ddp = run["ddp"]
        row["ddp_samples_per_s"] = ddp["samples_per_s"]
        row["ddp_test_accuracy"] = round(ddp["test_accuracy"], 4)
        row["accuracy_gap_points"] = round(100 * (ddp["test_accuracy"] - flodl["test_accuracy"]), 2)
        row["speedup_vs_ddp"] = run["speedup"]
    return row


def goodput_table(
    base: TaskConfig,
    nprocs: Sequence[int],
    skews: Sequence[float],
    coordinator: CoordinatorConfig,
    ceiling_s: float,
    done: dict[tuple[int, float], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Goodput against the ceiling for every ``nproc`` x ``skew`` (the last rank slowed by
    ``skew``); a row in ``done`` (the throughput run, with DDP) is used as it is."""
    rows: list[dict[str, Any]] = []
    for nproc in nprocs:
        for skew in skews:
            run = done.get((nproc, skew))
            if run is None:
                task = attrs.evolve(base, slow_rank=nproc - 1, slow_factor=skew)
                run = goodput_row(task, nproc, coordinator, ceiling_s)
            row = table_row(nproc, skew, run)
            rows.append(row)
            print(
                f"  {nproc} ranks, skew {skew:g}x: flodl {row['flodl_samples_per_s']:.0f} "
                f"samples/s, ceiling {row['ceiling_samples_per_s']:.0f}, goodput "
                f"{row['goodput_vs_ceiling']:.3f}, accuracy {row['flodl_test_accuracy']:.4f} "
                f"(load {row['load_before']} - {row['load_after']})",
                flush=True,
            )
    return rows


def numbers(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """An argparse type: a comma-separated list of ``kind``."""

    def parse(text: str) -> tuple[Any, ...]:
        return tuple(kind(item) for item in text.split(",") if item.strip())

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="flodl training benchmark")
    parser.add_argument(
        "--quick", action="store_true", help="tiny smoke run (figures mean nothing)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=1, help="throughput run pairs")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--anchor", type=int, default=10, help="flodl ElChe initial anchor")
    parser.add_argument("--overhead-target", type=float, default=0.05, help="flodl ElChe")
    parser.add_argument(
        "--window-cap-epochs",
        type=float,
        default=1.0,
        help="flodl: a window holds at most this many epochs' batches",
    )
    parser.add_argument("--rounds", type=int, default=30, help="averaging repetitions")
    parser.add_argument(
        "--nprocs", type=numbers(int), default=(2, 4, 8), help="goodput table: rank counts"
    )
    parser.add_argument(
        "--skews",
        type=numbers(float),
        default=(1.0, 1.5, 2.5, 4.0),
        help="goodput table: how much slower the last rank is",
    )
    parser.add_argument(
        "--ceiling-s",
        type=float,
        default=10.0,
        help="seconds the ceiling trains per row (half before the flodl run, half after)",
    )
    args = parser.parse_args(argv)

    if args.quick:
        nproc, slow_rank, repeats = 2, 1, 1
        task = TaskConfig(hidden=64, batch_size=32, epochs=1, slow_rank=1)
        overhead_model = {"width": 256, "layers": 2, "reps": 3, "warmup": 1}
        nprocs, skews, ceiling_s = (2,), (1.0, 2.5), 1.0
    else:
        nproc, slow_rank, repeats = 4, 3, args.repeats
        task = TaskConfig(
            hidden=args.hidden, batch_size=args.batch_size, epochs=args.epochs, slow_rank=3
        )
        overhead_model = {"width": 1024, "layers": 10, "reps": args.rounds, "warmup": 2}
        nprocs, skews, ceiling_s = args.nprocs, args.skews, args.ceiling_s
    coordinator = CoordinatorConfig(
        policy=Policy.CADENCE,
        anchor=args.anchor,
        overhead_target=args.overhead_target,
        window_cap_epochs=args.window_cap_epochs,
    )
    started = time.perf_counter()

    print("(a) averaging overhead, 2 ranks", flush=True)
    load_before = load()
    overhead = run_overhead(world=2, **overhead_model)
    overhead["load_before"], overhead["load_after"] = load_before, load()
    print(
        f"  flodl round {overhead['flodl_round_ms']:.1f} ms vs bare all_reduce "
        f"{overhead['bare_allreduce_ms']:.1f} ms: {overhead['overhead_ratio']:.2f}x "
        f"(target <= {OVERHEAD_TARGET}); the scratch copy and all-reduce alone "
        f"{overhead['copy_floor_ms']:.1f} ms: {overhead['copy_floor_ratio']:.2f}x; "
        f"stages (ms) {overhead['stages_ms']}",
        flush=True,
    )

    print(
        f"(b) heterogeneous throughput, {nproc} ranks, rank {slow_rank} {task.slow_factor}x slower",
        flush=True,
    )
    hetero = throughput(task, nproc, coordinator, repeats, ceiling_s)
    main_run = hetero["runs"][len(hetero["runs"]) // 2]

    print(f"(c) goodput against the ceiling, ranks {list(nprocs)}, skews {list(skews)}")
    done = {(nproc, task.slow_factor): main_run}
    table = goodput_table(task, nprocs, skews, coordinator, ceiling_s, done)

    result: dict[str, Any] = {
        "overhead_ratio": overhead["overhead_ratio"],
        "copy_floor_ratio": overhead["copy_floor_ratio"],
        "speedup_vs_ddp": hetero["speedup_vs_ddp"],
        "fast_rank_idle_share": hetero["fast_rank_idle_share"],
        "fast_rank_averaging_share": hetero["fast_rank_averaging_share"],
        "fast_rank_not_training_share": hetero["fast_rank_not_training_share"],
        "accuracy_gap_points": hetero["accuracy_gap_points"],
        "goodput_vs_ceiling": hetero["goodput_vs_ceiling"],
        "flodl_samples_per_s": hetero["flodl_samples_per_s"],
        "ceiling_samples_per_s": hetero["ceiling_samples_per_s"],
        "ddp_samples_per_s": hetero["ddp_samples_per_s"],
        "load_average_1m": load_before,
        "targets": {
            "overhead_ratio_max": OVERHEAD_TARGET,
            "overhead_ok": overhead["overhead_ratio"] <= OVERHEAD_TARGET,
            "speedup_vs_ddp_min": SPEEDUP_TARGET,
            "speedup_ok": hetero["speedup_vs_ddp"] >= SPEEDUP_TARGET,
            "fast_rank_idle_share_max": IDLE_TARGET,
            "idle_ok": hetero["fast_rank_idle_share"] < IDLE_TARGET,
            "accuracy_gap_points_max": ACCURACY_GAP_TARGET,
            "accuracy_ok": hetero["accuracy_gap_points"] <= ACCURACY_GAP_TARGET,
            "goodput_vs_ceiling_min": GOODPUT_TARGET,
            "goodput_ok": hetero["goodput_vs_ceiling"] >= GOODPUT_TARGET,
        },
        "quick": args.quick,
        "averaging_overhead": overhead,
        "heterogeneous_throughput": hetero,
        "goodput_table": table,
        "settings": {
            "processes": nproc,
            "backend": "gloo",
            "torch_threads_per_rank": 1,
            "task": {
                "data": "scikit-learn digits, 80/20 split (1438 train / 359 test)",
                "model": f"MLP 64-{task.hidden}-{task.hidden}-10, Adam lr {task.lr}",
                "batch_size_per_rank": task.batch_size,
                "epochs": task.epochs,
                "slow_rank": task.slow_rank,
                "slow_factor": task.slow_factor,
            },
            "flodl": {
                "policy": "cadence",
                "anchor": coordinator.anchor,
                "max_anchor": coordinator.max_anchor,
                "overhead_target": coordinator.overhead_target,
                "window_cap_epochs": coordinator.window_cap_epochs,
                "fill_idle_ranks": coordinator.fill_idle_ranks,
                "guard": coordinator.guard.value,
            },
            "ddp": "DistributedDataParallel(gloo), default all-reduce hook (timed), "
            "DistributedSampler-style slices of each global batch",
            "ceiling": "the same processes, model, batch size and slowdown, no communication, "
            "all at once; started and ready before the row's flodl run, they train "
            "ceiling_s / 2 before it and ceiling_s / 2 after it",
            "ceiling_s": ceiling_s,
            "goodput_table": {
                "nprocs": list(nprocs),
                "skews": list(skews),
                "slow_rank": "the last rank (nproc - 1)",
            },
        },
        "total_bench_s": round(time.perf_counter() - started, 1),
        "environment": environment(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"speedup {hetero['speedup_vs_ddp']:.2f}x (target >= {SPEEDUP_TARGET}), fast-rank idle "
        f"{100 * hetero['fast_rank_idle_share']:.1f}% (target < {100 * IDLE_TARGET:g}%), "
        f"averaging {100 * hetero['fast_rank_averaging_share']:.1f}%, accuracy "
        f"flodl {hetero['flodl_test_accuracy']:.4f} / DDP {hetero['ddp_test_accuracy']:.4f}"
    )
    print(
        f"goodput vs ceiling {hetero['goodput_vs_ceiling']:.3f} (target >= {GOODPUT_TARGET}); "
        f"load average {load()} on {os.cpu_count()} cpus; wrote {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
