"""``python -m bench.scale``: the command line of the coordinator scale benchmark (the
bench itself: :mod:`bench.scale`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio
import trio.lowlevel

from .generator import GENERATOR_FLAG, cpu_plan, generator_main
from .modes import measure, profile, run_inprocess, run_split
from .record import CpuSplit
from .report import (
    RESULTS,
    failed_row,
    mode_section,
    previous_modes,
    print_table,
    report,
)

DEFAULT_COUNTS = (64, 128, 256, 512, 1024, 1536, 2048, 4096)
QUICK_COUNTS = (16, 64)
AGENT_COUNTS = (4096, 16384)
"""The agents layout's rank counts: 512 and 2,048 hosts of 8."""
QUICK_AGENT_COUNTS = (16, 64)
MODES = {
    "both": ("split", "inprocess"),
    "split": ("split",),
    "inprocess": ("inprocess",),
    "agents": ("agents",),
    "split+agents": ("split", "agents"),
    "all": ("split", "agents", "inprocess"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [GENERATOR_FLAG]:
        return generator_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale", description="flodl coordinator scale benchmark"
    )
    parser.add_argument(
        "--mode",
        choices=tuple(MODES),
        default="both",
        help="split: coordinator alone in this process, ranks in generator processes; "
        "agents: as split, the ranks reaching it through simulated node agents (one "
        "connection per host); inprocess: both in one trio run over memory://; both: split "
        "and inprocess (the default); all: the three",
    )
    parser.add_argument("--ranks", type=int, nargs="+", help="rank counts to sweep")
    parser.add_argument(
        "--agent-ranks",
        type=int,
        nargs="+",
        help=f"rank counts of the agents layout (default: {AGENT_COUNTS})",
    )
    parser.add_argument("--per-host", type=int, default=8, help="agents layout: ranks per host")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per count")
    parser.add_argument("--quick", action="store_true", help=f"counts {QUICK_COUNTS}, 2 s each")
    parser.add_argument("--seed", type=int, default=0, help="phases of the simulated ranks")
    parser.add_argument("--transport", choices=("unix", "tcp"), default="unix", help="split mode")
    parser.add_argument(
        "--generators", type=int, default=1, help="split mode: load-generator processes"
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="split mode: leave core placement to the OS"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--profile",
        type=int,
        metavar="RANKS",
        help="cProfile one count instead (split mode unless --mode inprocess or agents)",
    )
    parser.add_argument("--top", type=int, default=30, help="functions to print with --profile")
    args = parser.parse_args(argv)
    seconds = 2.0 if args.quick and args.seconds == 10.0 else args.seconds
    plan = cpu_plan(pin=not args.no_pin)
    if args.profile:
        if args.mode == "inprocess":
            profile(
                lambda: trio.run(measure, args.profile, seconds, args.seed, CpuSplit()), args.top
            )
        else:
            per_host = args.per_host if args.mode == "agents" else 0
            split_args = (args.seed, args.transport, args.generators, plan, per_host)
            profile(lambda: run_split(args.profile, seconds, *split_args), args.top)
        return 0
    counts = args.ranks or (QUICK_COUNTS if args.quick else DEFAULT_COUNTS)
    modes = previous_modes(args.output)
    chosen = MODES[args.mode]

    def sweep(
        mode: str, sweep_counts: Sequence[int], one: Callable[[int], Any], **how: Any
    ) -> None:
        """Measure each count of ``mode``; the results file is written after every count, and a
        count that fails (no warm-up: the load generator could not bring its ranks in) is a
        row saying so, not the end of the run."""
        rows: list[dict[str, Any]] = []
        for ranks in sweep_counts:
            try:
                rows.append(one(ranks))
            except (RuntimeError, ExceptionGroup) as err:
                rows.append(failed_row(ranks, err))
            print_table(mode, rows[-1:], header=len(rows) == 1)
            modes[mode] = mode_section(mode, rows, seconds, args.seed, **how)
            write_results(args.output, modes)

    pinning = plan.describe()
    if "split" in chosen:
        sweep(
            "split",
            counts,
            lambda n: run_split(n, seconds, args.seed, args.transport, args.generators, plan),
            transport=f"{args.transport}://" + (" (127.0.0.1)" if args.transport == "tcp" else ""),
            generators=args.generators,
            pinning=pinning,
        )
    if "agents" in chosen:
        agent_args = (args.seed, args.transport, args.generators, plan, args.per_host)
        sweep(
            "agents",
            args.agent_ranks or (QUICK_AGENT_COUNTS if args.quick else AGENT_COUNTS),
            lambda n: run_split(n, seconds, *agent_args),
            transport=f"{args.transport}://, one connection per simulated agent",
            per_host=args.per_host,
            generators=args.generators,
            pinning=pinning,
        )
    if "inprocess" in chosen:
        sweep(
            "inprocess",
            counts,
            lambda n: run_inprocess(n, seconds, args.seed),
            transport="memory://",
            pinning="not pinned (one thread: at most one core)",
            cpu="time.process_time over the measured window (coordinator and ranks together); "
            "cpu_split_share from a trio instrument timing task steps (time.thread_time)",
        )
    result = write_results(args.output, modes)
    print(
        f"split: max_ranks_meeting_target={result['max_ranks_meeting_target']}, "
        f"cpu_us_per_message={result['cpu_us_per_message']} "
        f"(at {result['cpu_us_per_message_at_ranks']} ranks); in-process: "
        f"{result['inprocess_max_ranks_meeting_target']} ranks, "
        f"{result['inprocess_cpu_us_per_message']} us/msg; "
        f"load average {os.getloadavg()[0]:.2f}; wrote {args.output}"
    )
    return 0


def write_results(path: Path, modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The results document of ``modes`` (split first), written to ``path``."""
    result = report(dict(sorted(modes.items(), key=lambda item: item[0] != "split")))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(main())
