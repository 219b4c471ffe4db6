"""Time-to-quality benchmark: how fast each way of training reaches a validation loss.

Writes bench/results/quality.json and docs/images/quality.png (validation loss against
training seconds, one line per run, :mod:`quality_plot`), and prints a table. Throughput
benches count samples; this one asks what a user cares about: given the same wall-clock
training budget, which run gets the lowest validation loss, and how soon does each reach the
loss the alternatives reach at the end of theirs?

**Workloads** (:mod:`quality_task`, ``--workloads``): ``gpt`` (a byte-level GPT on the standard
library's source text) and ``digits`` (the MLP of the throughput bench); ``gpt-b8``, the GPT at
batch 8, only when named. Every process builds
the same data, held-out set and initial parameters.

**Layouts** (``--layouts``): layout N is N ranks, the last one (N - 1) made ``--slow-factor``
(2.5) times slower: after each step it sleeps (factor - 1) x the step's measured compute (in
DDP the step less its gradient all-reduce), as ``examples/digits.py --slow`` does. One torch
thread per process, gloo on CPU, everything on 127.0.0.1.

**Variants** (:data:`VARIANTS`, ``--variants``), each run for every workload and layout:

* ``solo``: the fast rank alone, a plain single process (the user's alternative);
* ``solo+busy``: the same, with the layout's other ranks training beside it and discarded
  (:mod:`quality_baselines`): what the machine's contention alone costs the fast rank;
* ``ddp``: torch ``DistributedDataParallel`` (gloo), lock-step, the same layout
  (:mod:`quality_baselines`);
* flodl through the real CLI, ``flodl run --nproc N --backend gloo <flags>
  bench/quality_rank.py`` (:mod:`quality_rank`: ``flodl.worker.join`` and ``rank.batches``),
  with the flags of the table: ``sync``, ``cadence``, ``async`` (``--policy``, at flodl's
  defaults: the outer SGD step of 1.5), ``cadence+plain`` and the like (``--outer none``:
  plain averaging), ``cadence+nesterov`` (DiLoCo's ``--outer nesterov --outer-lr 0.7
  --outer-momentum 0.9``), ``cadence+bf16``, ``cadence+cap1s``; everything else at flodl's
  defaults;
* torchft ``LocalSGD`` and ``DiLoCo`` as peers (:mod:`quality_torchft`: a lighthouse and one
  replica group per rank in a loopback-only network namespace); where torchft (a bench extra,
  ``bench/requirements-peers.txt``) or namespaces are missing they are recorded as skipped,
  with the reason.

**Clock and budget.** Each run gets ``--budget-s`` seconds of *training* wall time (default:
the workload's, 40 s for ``gpt`` and 12 s for ``digits``, where the fast rank alone is still
improving at the end), on the :class:`~quality_task.BudgetClock` rank 0 (a fast rank) keeps:
from rank 0's first training batch (process start-up, joining and group forming are not on it),
paused while rank 0 evaluates. Rank 0 evaluates its current model on the fixed validation set
at t = 0 and every ``budget / points`` seconds (after a step: between two batches, where flodl
does not touch the parameters), and a last time when the budget is spent: ``loss_at_budget``.
While rank 0 evaluates, DDP's other ranks wait for it at the next all-reduce; flodl's go on
training (a small advantage to flodl's runs, at most the evaluations' share of the budget).

**Ending a run.** When its budget is spent, flodl's rank 0 writes its result and ends the run
with ``rank.stop()`` (``quality_rank.end_run``): the ranks train the rest of the window, a
last round averages it and the run completes (what follows the budget is not on the curve).
A run past its deadline is stopped with SIGTERM to ``flodl run``, then a second one. Solo and
DDP's rank 0 write their result and exit; the harness kills DDP's other ranks. Every process a run
starts leads a session of its own and is killed with its group when the run ends however it
ends (:mod:`quality_procs`); ``leftover_processes`` lists any still alive at the end (none).

**Figures**, per workload and layout, per variant, over ``--repeats`` repeats (median, min,
max, per repeat): ``loss_at_budget``; ``time_to_solo_loss``, the training seconds at which the
run's curve first reaches the solo runs' median loss at budget (linear between the two
evaluation points around the crossing; null if it never does); ``time_to_ddp_loss`` the same
for DDP's and for torchft's (the peer of the two with the lower median loss at budget,
``torchft_reference``); ``speedup_to_quality_vs_solo`` = budget / ``time_to_solo_loss``, and
``_vs_ddp``, ``_vs_torchft`` likewise (``_vs_torchft`` null where torchft is skipped), and
``_vs_busy_solo`` against ``solo+busy`` where it ran (what a run gains over the fast rank alone
once both pay the same contention: on ranks that share no compute, an estimate of the gain over
``solo``); ``pace_vs_solo`` and ``gain_at_same_steps`` take a run's time to quality apart
into rank 0's pace and what each of its steps is worth (:mod:`quality_steps`). Also the
1-minute load average before and after every run, each run's command lines, and for flodl its
rounds, windows, anchor and idle shares (from its ``summary.json`` and ``events.jsonl``). The
runs of a repeat go in a rotated order, so a drift of the machine's load does not always weigh
on the same variant.

``--quick``: digits only, 2 ranks, a 1 s budget, 1 repeat, the variants of :data:`QUICK`
(figures mean nothing), for the smoke test. Wrap measurement runs in ``flock /tmp/bench.lock``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs
import benchenv
from benchenv import load
from quality_baselines import deadline_s, run_busy_solo, run_ddp, run_solo
from quality_plot import plot
from quality_procs import Processes, alive, pids_in
from quality_steps import take_apart
from quality_task import WORKLOADS, RunSpec, corpus_info

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "quality.json"
PLOT = HERE.parent / "docs" / "images" / "quality.png"
QUALITY_RANK = HERE / "quality_rank.py"
SLOW_FACTOR = 2.5
NESTEROV = ("--outer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9")
PLAIN = ("--outer", "none")


@attrs.frozen
class Variant:
    """One way of training: a baseline (``solo``, ``ddp``), flodl with ``flodl run`` flags,
    or a torchft peer."""

    name: str
    kind: str
    """``solo``, ``busy-solo``, ``ddp``, ``flodl`` or ``torchft``."""
    flodl_args: tuple[str, ...] = ()
    description: str = ""
    peer: str = ""
    """torchft's algorithm (``localsgd``, ``diloco``) for a ``torchft`` variant."""


VARIANTS: tuple[Variant, ...] = (
    Variant("solo", "solo", description="the fast rank alone, one plain process"),
    Variant(
        "solo+busy",
        "busy-solo",
        description="the fast rank alone beside the layout's other ranks training (discarded)",
    ),
    Variant("ddp", "ddp", description="torch DistributedDataParallel (gloo), lock-step"),
    Variant("sync", "flodl", ("--policy", "sync"), "flodl, one batch per rank per round"),
    Variant("cadence", "flodl", ("--policy", "cadence"), "flodl, ElChe windows"),
    Variant("async", "flodl", ("--policy", "async"), "flodl, rounds overlap training"),
    Variant(
        "cadence+plain",
        "flodl",
        ("--policy", "cadence", *PLAIN),
        "flodl cadence, plain averaging (no outer step)",
    ),
    Variant("sync+plain", "flodl", ("--policy", "sync", *PLAIN), "flodl sync, plain averaging"),
    Variant("async+plain", "flodl", ("--policy", "async", *PLAIN), "flodl async, plain averaging"),
    Variant(
        "cadence+nesterov",
        "flodl",
        ("--policy", "cadence", *NESTEROV),
        "flodl cadence, DiLoCo's outer Nesterov step",
    ),
    Variant(
        "async+nesterov",
        "flodl",
        ("--policy", "async", *NESTEROV),
        "flodl async, DiLoCo's outer Nesterov step",
    ),
    Variant(
        "cadence+outer2",
        "flodl",
        ("--policy", "cadence", "--outer", "sgd", "--outer-lr", "2"),
        "flodl cadence, an outer SGD step of 2x the pseudo-gradient",
    ),
    Variant(
        "cadence+nesterov0.5",
        "flodl",
        (
            "--policy",
            "cadence",
            "--outer",
            "nesterov",
            "--outer-lr",
            "1",
            "--outer-momentum",
            "0.5",
        ),
        "flodl cadence, outer Nesterov lr 1, momentum 0.5",
    ),
    Variant(
        "cadence+bf16",
        "flodl",
        ("--policy", "cadence", "--average-dtype", "bf16"),
        "flodl cadence, rounds reduce 16-bit moves (half the bytes)",
    ),
    Variant(
        "cadence+cap1s",
        "flodl",
        ("--policy", "cadence", "--window-cap-s", "1"),
        "flodl cadence, no window longer than 1 s",
    ),
    Variant("torchft-localsgd", "torchft", description="torchft LocalSGD (peer)", peer="localsgd"),
    Variant(
        "torchft-diloco",
        "torchft",
        description="torchft DiLoCo (peer): outer Nesterov lr 0.7, momentum 0.9",
        peer="diloco",
    ),
)
BY_NAME = {variant.name: variant for variant in VARIANTS}
QUICK = ("solo", "ddp", "cadence+nesterov", "torchft-localsgd", "torchft-diloco")
"""``--quick``'s variants: each kind of run once (flodl with a policy and an outer optimizer)."""


# --------------------------------------------------------------------------- one run


def flodl_cli() -> str:
    """The ``flodl`` command of this interpreter's environment."""
    beside = Path(sys.executable).with_name("flodl")
    return str(beside) if beside.exists() else "flodl"


def flodl_command(variant: Variant, spec: RunSpec, nproc: int, run_dir: Path) -> list[str]:
    return [
        flodl_cli(),
        "run",
        "--nproc",
        str(nproc),
        "--backend",
        "gloo",
        "--run-dir",
        str(run_dir),
        "--no-live",
        "--quiet",
        *variant.flodl_args,
        str(QUALITY_RANK),
        *spec.args(),
    ]


def stop_launcher(launcher: subprocess.Popen[bytes]) -> None:
    """A run past its deadline: SIGTERM (save and stop), then a second (kill the ranks)."""
    for grace in (30.0, 15.0):
        if launcher.poll() is not None:
            return
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def flodl_facts(run_dir: Path, exit_code: int | None) -> dict[str, Any]:
    """How the flodl run went: its end, rounds, windows, anchor and idle shares."""
    path = run_dir / "summary.json"
    summary: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    ends = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("kind") == "SyncEnd"]
    windows = [float(e["window_s"]) for e in ends if e.get("window_s") is not None]
    anchors = [e["anchor"] for e in ends if e.get("anchor") is not None]
    return {
        "exit_code": exit_code,
        "status": summary.get("status"),
        "save_reason": summary.get("save_reason"),
        "rounds": summary.get("rounds"),
        "final_anchor": summary.get("anchor"),
        "final_batch_counts": summary.get("batch_counts"),
        "anchor_first_last_max": [anchors[0], anchors[-1], max(anchors)] if anchors else None,
        "window_s_median": round(statistics.median(windows), 3) if windows else None,
        "window_s_max": round(max(windows), 3) if windows else None,
        "round_ms_median": round(1000 * statistics.median(float(e["duration_s"]) for e in ends), 2)
        if ends
        else None,
        "per_rank": [
            {
                "rank": r["rank"],
                "batches": r.get("batches"),
                "syncs": r.get("syncs"),
                "idle_share": r.get("idle_share"),
                "averaging_share": r.get("averaging_share"),
                "exit_code": r.get("exit_code"),
            }
            for r in summary.get("ranks", [])
        ],
    }


def run_flodl(variant: Variant, spec: RunSpec, nproc: int, folder: Path) -> dict[str, Any]:
    """One ``flodl run``: rank 0 ends it when its budget is spent (``quality_rank.end_run``)."""
    run_dir = folder / "run"
    command = flodl_command(variant, spec, nproc, run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with Processes() as processes:
        launcher = processes.start(command, folder / "launcher.log", env)
        try:
            launcher.wait(timeout=deadline_s(spec))  # rank 0's rank.stop() ends the run
        except subprocess.TimeoutExpired:
            stop_launcher(launcher)
        processes.adopt(pids_in(Path(spec.result_dir)))
    if not spec.result_path.exists():
        logs = "\n".join(
            f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}"
            for log in [folder / "launcher.log", *sorted(run_dir.glob("rank*.log"))]
            if log.exists()
        )
        raise RuntimeError(f"flodl {variant.name}: rank 0 wrote no result\n{logs}")
    return {
        "result": json.loads(spec.result_path.read_text()),
        "commands": [command],
        "pids": processes.pids,
        "flodl": flodl_facts(run_dir, launcher.returncode),
    }


def torchft_unavailable() -> str | None:
    """Why the torchft peers cannot run here (None: they can)."""
    from quality_torchft import unavailable

    reason = unavailable()
    return None if reason is None else f"{reason}: LocalSGD and DiLoCo not run"


def run_peer(variant: Variant, spec: RunSpec, nproc: int, folder: Path) -> dict[str, Any]:
    from quality_torchft import run_torchft

    return run_torchft(variant.peer, spec, nproc, folder)


def run_one(
    variant: Variant, spec: RunSpec, nproc: int, folder: Path, repeat: int
) -> dict[str, Any]:
    """One run of ``variant``, with its load averages, date and wall time; errors recorded."""
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "solo": lambda: run_solo(spec, folder),
        "busy-solo": lambda: run_busy_solo(spec, nproc, folder),
        "ddp": lambda: run_ddp(spec, nproc, folder),
        "flodl": lambda: run_flodl(variant, spec, nproc, folder),
        "torchft": lambda: run_peer(variant, spec, nproc, folder),
    }
    record: dict[str, Any] = {
        "repeat": repeat,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_before": load(),
    }
    started = time.perf_counter()
    try:
        done = runners[variant.kind]()
    except RuntimeError as err:
        record.update(error=str(err)[-6000:], load_after=load())
        return record
    result = done["result"]
    curve = result.pop("curve")
    record.update(
        {
            "load_after": load(),
            "process_wall_s": round(time.perf_counter() - started, 1),
            "loss_at_budget": curve[-1]["loss"],
            "curve": curve,
            **result,
            "commands": [shlex.join(c) for c in done["commands"]],
            "pids": done["pids"],
        }
    )
    if "flodl" in done:
        record["flodl"] = done["flodl"]
    return record


# --------------------------------------------------------------------------- figures


def first_reach(curve: Sequence[dict[str, Any]], target: float) -> float | None:
    """Training seconds at which ``curve`` first gets to ``target`` or below: linear between
    the evaluation points around the crossing (None: never)."""
    before: dict[str, Any] | None = None
    for point in curve:
        if point["loss"] <= target:
            if before is None or before["loss"] == point["loss"]:
                return float(point["t"])
            share = (before["loss"] - target) / (before["loss"] - point["loss"])
            return round(float(before["t"] + share * (point["t"] - before["t"])), 3)
        before = point
    return None


def spread(values: Sequence[float | None], digits: int = 4) -> dict[str, Any]:
    """Median, min and max over repeats (None: never reached, counted as infinite time)."""
    reached = [v for v in values if v is not None]
    keyed = [math.inf if v is None else v for v in values]
    middle = statistics.median(keyed) if keyed else math.inf
    return {
        "median": None if math.isinf(middle) else round(middle, digits),
        "min": round(min(reached), digits) if reached else None,
        "max": round(max(reached), digits) if reached and len(reached) == len(values) else None,
        "per_repeat": list(values),
    }


def speedup(budget_s: float, times: dict[str, Any]) -> dict[str, Any]:
    """budget / time to the reference loss: from a :func:`spread` of times (null: never)."""

    def ratio(t: float | None) -> float | None:
        return None if t is None or t <= 0 else round(budget_s / t, 3)

    return {
        "median": ratio(times["median"]),
        "min": ratio(times["max"]),
        "max": ratio(times["min"]),
        "per_repeat": [ratio(t) for t in times["per_repeat"]],
    }


def reference_loss(cell: dict[str, Any], name: str) -> float | None:
    """The median loss at budget of variant ``name`` (None: it did not run)."""
    losses = [r["loss_at_budget"] for r in cell["variants"].get(name, {}).get("runs", [])]
    losses = [x for x in losses if x is not None]
    return round(statistics.median(losses), 5) if losses else None


def torchft_reference(cell: dict[str, Any]) -> tuple[str | None, float | None]:
    """The stronger torchft peer of ``cell`` (the lower median loss at budget) and that loss."""
    ran = [
        (loss, name)
        for name in ("torchft-localsgd", "torchft-diloco")
        if (loss := reference_loss(cell, name)) is not None
    ]
    if not ran:
        return None, None
    loss, name = min(ran)
    return name, loss


def summarize(cell: dict[str, Any], torchft_skipped: str | None) -> None:
    """Add the figures of every variant of ``cell`` (one workload and layout)."""
    budget = cell["budget_s"]
    solo, ddp = reference_loss(cell, "solo"), reference_loss(cell, "ddp")
    busy = reference_loss(cell, "solo+busy")
    peer, torchft = torchft_reference(cell)
    cell["solo_loss_at_budget"], cell["ddp_loss_at_budget"] = solo, ddp
    cell["busy_solo_loss_at_budget"] = busy
    cell["torchft_reference"], cell["torchft_loss_at_budget"] = peer, torchft
    cell["torchft_skipped"] = torchft_skipped
    solo_runs = [r for r in cell["variants"].get("solo", {}).get("runs", []) if "curve" in r]
    for variant in cell["variants"].values():
        runs = [r for r in variant.get("runs", []) if "curve" in r]
        if not runs:
            continue
        variant["loss_at_budget"] = spread([r["loss_at_budget"] for r in runs], 5)
        references = (("solo", solo), ("busy_solo", busy), ("ddp", ddp), ("torchft", torchft))
        for key, target in references:
            times = spread(
                [None if target is None else first_reach(r["curve"], target) for r in runs], 3
            )
            variant[f"time_to_{key}_loss"] = times
            variant[f"speedup_to_quality_vs_{key}"] = speedup(budget, times)
        apart = [take_apart(r, solo_runs) for r in runs]
        variant["pace_vs_solo"] = spread([pace for pace, _ in apart], 3)
        variant["gain_at_same_steps"] = spread([gain for _, gain in apart], 4)
        variant["load_before"] = spread([r["load_before"] for r in runs], 2)
        variant["load_after"] = spread([r["load_after"] for r in runs], 2)
        variant["steps_rank0"] = spread([r.get("steps") for r in runs], 1)


def table(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per workload, layout and variant that ran: the medians."""
    rows: list[dict[str, Any]] = []
    for key, cell in results.items():
        for name, variant in cell["variants"].items():
            if "loss_at_budget" not in variant:
                continue
            slow = cell["layout"]["slow_rank"]
            idle = [
                max(p["idle_share"] or 0.0 for p in r["flodl"]["per_rank"] if p["rank"] != slow)
                for r in variant["runs"]
                if "flodl" in r and r["flodl"]["per_rank"]
            ]
            rows.append(
                {
                    "cell": key,
                    "variant": name,
                    "loss_at_budget": variant["loss_at_budget"]["median"],
                    "time_to_solo_loss_s": variant["time_to_solo_loss"]["median"],
                    "speedup_to_quality_vs_solo": variant["speedup_to_quality_vs_solo"]["median"],
                    "speedup_to_quality_vs_busy_solo": variant["speedup_to_quality_vs_busy_solo"][
                        "median"
                    ],
                    "time_to_ddp_loss_s": variant["time_to_ddp_loss"]["median"],
                    "speedup_to_quality_vs_ddp": variant["speedup_to_quality_vs_ddp"]["median"],
                    "time_to_torchft_loss_s": variant["time_to_torchft_loss"]["median"],
                    "speedup_to_quality_vs_torchft": variant["speedup_to_quality_vs_torchft"][
                        "median"
                    ],
                    "steps_rank0": variant["steps_rank0"]["median"],
                    "pace_vs_solo": variant["pace_vs_solo"]["median"],
                    "gain_at_same_steps": variant["gain_at_same_steps"]["median"],
                    "fast_rank_idle_share": round(statistics.median(idle), 4) if idle else None,
                    "load_before": variant["load_before"]["median"],
                    "load_after": variant["load_after"]["median"],
                }
            )
    return rows


# --------------------------------------------------------------------------- the bench


def items(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    """An argparse type: a comma-separated list of ``kind``."""

    def parse(text: str) -> tuple[Any, ...]:
        return tuple(kind(item.strip()) for item in text.split(",") if item.strip())

    return parse


def variant_name(text: str) -> str:
    if text not in BY_NAME:
        raise argparse.ArgumentTypeError(f"unknown variant {text!r}; known: {', '.join(BY_NAME)}")
    return text


def workload_name(text: str) -> str:
    if text not in WORKLOADS:
        raise argparse.ArgumentTypeError(
            f"unknown workload {text!r}; known: {', '.join(WORKLOADS)}"
        )
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="flodl time-to-quality benchmark")
    parser.add_argument("--quick", action="store_true", help="smoke run (figures mean nothing)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="training seconds per run (default: the workload's, "
        + ", ".join(f"{w.name} {w.budget_s:g}" for w in WORKLOADS.values())
        + ")",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--points", type=int, default=20, help="evaluations per budget")
    parser.add_argument("--workloads", type=items(workload_name), default=("gpt", "digits"))
    parser.add_argument("--layouts", type=items(int), default=(2, 4), help="ranks per run")
    parser.add_argument(
        "--variants",
        type=items(variant_name),
        default=None,
        help=f"which to run (default all: {','.join(BY_NAME)}; --quick: {','.join(QUICK)})",
    )
    parser.add_argument("--slow-factor", type=float, default=SLOW_FACTOR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help=f"default {RESULTS}")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help=f"default {PLOT} (with --output: the output's name with .png)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs' folders here")
    parser.add_argument(
        "--refigure",
        type=Path,
        default=None,
        metavar="RESULTS",
        help="run nothing: recompute the figures and table of a results file from its runs, "
        "in place (after the figures' definitions change)",
    )
    return parser


def refigure(path: Path) -> None:
    """Recompute every cell's figures and the table of ``path`` from the runs it holds; the
    runs themselves are left as they are."""
    result = json.loads(path.read_text())
    for cell in result["results"].values():
        summarize(cell, cell.get("torchft_skipped"))
    result["table"] = table(result["results"])
    result["refigured"] = {"date": datetime.now(UTC).isoformat(timespec="seconds")}
    path.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)


def source_facts() -> dict[str, object]:
    """The commit measured, and whether flodl/ had changes not committed yet."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(HERE), *args],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--", "../flodl")
    return {
        "source_commit": git("rev-parse", "HEAD") or os.environ.get("FLODL_SOURCE_COMMIT"),
        "flodl_uncommitted_changes": None if status is None else bool(status),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.refigure is not None:
        refigure(args.refigure)
        return 0
    if args.quick:
        args.budget_s, args.repeats, args.points = 1.0, 1, 6
        args.workloads, args.layouts = ("digits",), (2,)
        args.variants = args.variants or QUICK
    args.variants = args.variants or tuple(BY_NAME)
    output = args.output or (
        Path(tempfile.gettempdir()) / "flodl-quality-quick.json" if args.quick else RESULTS
    )
    plot_path = args.plot or (PLOT if output == RESULTS else output.with_suffix(".png"))
    variants = [BY_NAME[name] for name in args.variants]
    skipped = torchft_unavailable() if any(v.kind == "torchft" for v in variants) else None
    runnable = [v for v in variants if not (skipped and v.kind == "torchft")]
    budgets = {w: args.budget_s or WORKLOADS[w].budget_s for w in args.workloads}
    started, load_start = time.perf_counter(), load()
    date = datetime.now(UTC).isoformat(timespec="seconds")
    print(
        f"quality bench: workloads {list(args.workloads)}, layouts {list(args.layouts)}, budget "
        f"{budgets} s, {args.repeats} repeat(s), variants {[v.name for v in variants]} "
        f"(load {load_start})",
        flush=True,
    )
    if skipped:
        print(f"quality bench: torchft peers skipped: {skipped}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    every_pid: list[int] = []
    with tempfile.TemporaryDirectory(prefix="flodl-quality-") as scratch:
        base = args.keep or Path(scratch)
        for workload in args.workloads:
            for nproc in args.layouts:
                key = f"{workload}/{nproc}"
                cell: dict[str, Any] = {
                    "workload": workload,
                    "description": WORKLOADS[workload].description,
                    "layout": {
                        "ranks": nproc,
                        "slow_rank": nproc - 1,
                        "slow_factor": args.slow_factor,
                    },
                    "budget_s": budgets[workload],
                    "repeats": args.repeats,
                    "points": args.points,
                    "variants": {
                        v.name: {"skipped": skipped}
                        if skipped and v.kind == "torchft"
                        else {"runs": []}
                        for v in variants
                    },
                }
                results[key] = cell
                for repeat in range(args.repeats):
                    shift = repeat % len(runnable) if runnable else 0
                    for variant in runnable[shift:] + runnable[:shift]:
                        folder = base / workload / str(nproc) / variant.name / str(repeat)
                        spec = RunSpec(
                            workload=workload,
                            budget_s=budgets[workload],
                            points=args.points,
                            seed=args.seed,
                            slow_rank=-1 if variant.kind == "solo" else nproc - 1,
                            slow_factor=args.slow_factor,
                            result_dir=str(folder / "out"),
                        )
                        record = run_one(variant, spec, nproc, folder, repeat)
                        cell["variants"][variant.name]["runs"].append(record)
                        every_pid += record.get("pids", [])
                        if "error" in record:
                            print(
                                f"  {key} {variant.name} #{repeat}: FAILED: "
                                f"{record['error'][:2000]}",
                                flush=True,
                            )
                            continue
                        print(
                            f"  {key} {variant.name:<17} #{repeat}: loss at budget "
                            f"{record['loss_at_budget']:.4f}, {record['steps']} steps on rank 0 "
                            f"(load {record['load_before']} -> {record['load_after']})",
                            flush=True,
                        )
                summarize(cell, skipped)
    leftover = [pid for pid in sorted(set(every_pid)) if alive(pid)]
    result: dict[str, Any] = {
        "date": date,
        "command": shlex.join([sys.executable, str(Path(__file__).resolve()), *argv]),
        "quick": args.quick,
        "load_average": {"start": load_start, "end": load()},
        "table": table(results),
        "results": results,
        "variants": {
            v.name: {"kind": v.kind, "flodl_args": list(v.flodl_args), "description": v.description}
            for v in variants
        },
        "settings": {
            "budget_s": budgets,
            "repeats": args.repeats,
            "points": args.points,
            "workloads": {w: WORKLOADS[w].description for w in args.workloads},
            "layouts": list(args.layouts),
            "slow_rank": "the last rank (N - 1)",
            "slow_factor": args.slow_factor,
            "slowdown": "the slow rank sleeps (factor - 1) x each step's compute after the step",
            "threads_per_process": 1,
            "backend": "gloo (CPU), 127.0.0.1",
            "seed": args.seed,
            "clock": "rank 0's training seconds: from its first batch, paused while it evaluates",
            "evaluation": "rank 0's current model on the fixed validation set, at t = 0, every "
            "budget / points seconds (after a step) and once the budget is spent",
            "flodl_end": "rank 0 calls rank.stop() once its budget is spent: the rest of the "
            "window is trained and averaged, then the run completes (not on the curve)",
            "time_to_loss": "first crossing of the reference (median loss at budget of solo / "
            "DDP), linear between evaluation points; null: never reached",
            "torchft": skipped,
        },
        "corpus": corpus_info() if "gpt" in args.workloads else None,
        "leftover_processes": leftover,
        "total_bench_s": round(time.perf_counter() - started, 1),
        "environment": benchenv.environment(
            ("torch", "trio", "flodl", "torchft", "matplotlib"), **source_facts()
        ),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, plot_path)
    print_table(result)
    print(f"wrote {output} and {plot_path}; leftover processes {leftover}")
    return 0


def print_table(result: dict[str, Any]) -> None:
    def show(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    print(
        f"\n{'cell':<10} {'variant':<18} {'loss@budget':>11} {'t->solo s':>9} {'x solo':>7} "
        f"{'x busy':>6} {'t->ddp s':>8} {'x ddp':>6} {'x tft':>6} {'steps0':>7} {'pace':>5} "
        f"{'gain/st':>7} {'load':>11}"
    )
    for row in result["table"]:
        print(
            f"{row['cell']:<10} {row['variant']:<18} {row['loss_at_budget']:>11.4f} "
            f"{show(row['time_to_solo_loss_s'], '.1f'):>9} "
            f"{show(row['speedup_to_quality_vs_solo'], '.2f'):>7} "
            f"{show(row['speedup_to_quality_vs_busy_solo'], '.2f'):>6} "
            f"{show(row['time_to_ddp_loss_s'], '.1f'):>8} "
            f"{show(row['speedup_to_quality_vs_ddp'], '.2f'):>6} "
            f"{show(row['speedup_to_quality_vs_torchft'], '.2f'):>6} "
            f"{show(row['steps_rank0'], '.0f'):>7} "
            f"{show(row['pace_vs_solo'], '.2f'):>5} "
            f"{show(row['gain_at_same_steps'], '+.3f'):>7} "
            f"{row['load_before']:>5}-{row['load_after']:<5}"
        )


if __name__ == "__main__":
    sys.exit(main())
