"""The ``flodl`` command: ``flodl run`` (local ranks), ``flodl coordinator`` and ``flodl worker``
(one coordinator and ranks on other hosts)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio

from flodl.agent.command import add_agent_parser, run_agent_command
from flodl.config import (
    CoordinatorConfig,
    Policy,
    check_at_least,
    check_url,
    coordinator_config_from,
    flagged_settings,
)
from flodl.errors import ConfigError, FlodlError
from flodl.host.environment import session_key_from_env
from flodl.host.layout import nproc_of, ranks_of
from flodl.observe.view_config import add_view_flags, view_config_from
from flodl.supervise.warm import COLD_START_HELP
from flodl.worker.command import run_worker_command


def _add_coordinator_options(parser: argparse.ArgumentParser) -> None:
    """Every setting of :class:`CoordinatorConfig` that has a flag, as declared there."""
    for field, flag in flagged_settings():
        if flag.parse is None:
            parser.add_argument(flag.name, dest=field.name, action="store_true", help=flag.help)
            continue
        default = field.default.value if isinstance(field.default, Policy) else field.default
        parser.add_argument(
            flag.name,
            dest=field.name,
            type=flag.parse,
            default=default,
            metavar=flag.metavar,
            help=flag.help,
            choices=flag.choices,
        )
    parser.add_argument("--seed", type=int, default=0)


def _coordinator_config(args: argparse.Namespace) -> CoordinatorConfig:
    """The coordinator's settings from the flags; a bad value is refused by the flag's name,
    before CoordinatorConfig would refuse it by a setting's name the user never typed."""
    if args.keep_checkpoints is not None:
        check_at_least("--keep-checkpoints", args.keep_checkpoints, 1)
    if args.relax_up and args.policy == Policy.SYNC.value:
        raise ConfigError("--relax-up grows cadence windows; --policy sync has none")
    if args.average_dtype != "fp32" and args.policy == Policy.ASYNC.value:
        raise ConfigError(
            f"--average-dtype {args.average_dtype} needs --policy sync or cadence (async "
            "rounds blend a snapshot, which compressed rounds do not take)"
        )
    check_at_least("--seed", args.seed, 0)
    if args.min_ranks is not None:
        check_at_least("--min-ranks", args.min_ranks, 1)
        world = getattr(args, "nproc", None) or getattr(args, "world_size", None)
        if isinstance(world, int) and 1 <= world < args.min_ranks:
            raise ConfigError(
                f"--min-ranks must be at most the world size ({world}), got {args.min_ranks}"
            )
    # What flodl run also tells its ranks itself; sent to flodl worker's.
    return coordinator_config_from(
        vars(args), backend=args.backend, keep_checkpoints=args.keep_checkpoints
    )


def _write_report(run_dir: Path) -> None:
    from flodl.observe.report import write_report

    try:
        index = write_report(run_dir)
    except FlodlError as err:
        print(f"flodl: no report: {err}", file=sys.stderr, flush=True)
        return
    print(f"  report: {index}", flush=True)


def _report(args: argparse.Namespace) -> int:
    from flodl.observe.report import write_report

    index = write_report(args.run_dir)
    print(f"report: {index}", flush=True)
    if args.tensorboard is not None:
        from flodl.observe.tensorboard import export_tensorboard

        written = export_tensorboard(args.run_dir, args.tensorboard)
        print(f"tensorboard: {written} scalars in {args.tensorboard}", flush=True)
    return 0


STRICT_HELP = (
    "exit 1 when any rank was lost, even if the run recovered and completed (default: a run "
    "that completed exits 0 whatever ranks it lost; the summary names them)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flodl", description="Data-parallel training for machines of unequal speed."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    # allow_abbrev=False: a script's own option (``--out``) must not be taken for an
    # abbreviation of one of ours (``--outer``), so what follows SCRIPT reaches it unchanged.
    run = commands.add_parser(
        "run", help="run SCRIPT on N local ranks with a coordinator", allow_abbrev=False
    )
    run.add_argument(
        "--nproc",
        required=True,
        metavar="N|auto|gpu|cpu",
        help="ranks to start, as torchrun's --nproc-per-node: a number; gpu: one per visible "
        "GPU; cpu: one per CPU core; auto: gpu where CUDA is usable, else cpu",
    )
    run.add_argument(
        "--show-ranks",
        default=None,
        metavar="R,R,...",
        help="relay only these ranks' output (as torchrun's --local-ranks-filter); every "
        "rank's output is in run_dir/rank<N>.log whatever this says",
    )
    run.add_argument(
        "--nnodes",
        type=int,
        default=1,
        metavar="N",
        help="hosts in the run, each running this command with its own --node-rank (torchrun's "
        "flag); node 0 also serves the coordinator at --coordinator",
    )
    run.add_argument(
        "--node-rank", type=int, default=0, metavar="K", help="this host's index, 0 .. N - 1"
    )
    run.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="with --nnodes: where node 0 serves the coordinator (an address of node 0)",
    )
    run.add_argument("--transport", choices=["tcp", "unix"], default="tcp")
    run.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    run.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="where the run writes (default: a new runs/<time>-<id>/, runs/latest points at it)",
    )
    run.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="PATH",
        help="continue from the newest checkpoint of this run folder (as --run-dir: go on there)",
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="--run-dir holds an earlier run: remove its files (flodl's own only) first",
    )
    run.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="start a failed rank again up to this many times; it rejoins the running group",
    )
    run.add_argument("--strict", action="store_true", help=STRICT_HELP)
    run.add_argument("--cold-start", action="store_true", help=COLD_START_HELP)
    run.add_argument(
        "--keep-checkpoints",
        type=int,
        default=2,
        metavar="K",
        help="each rank keeps its K newest bundles and removes older ones (default 2)",
    )
    _add_coordinator_options(run)
    add_view_flags(run)
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)

    coord = commands.add_parser("coordinator", help="coordinate ranks that join from other hosts")
    coord.add_argument("--listen", required=True, metavar="URL", help="e.g. tcp://0.0.0.0:29400")
    coord.add_argument("--world-size", type=int, required=True)
    coord.add_argument("--strict", action="store_true", help=STRICT_HELP)
    coord.add_argument(
        "--run-dir",
        type=Path,
        default=Path("runs/coordinator"),
        help="where the coordinator writes summary.json (default: runs/coordinator)",
    )
    coord.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default=None,
        help="the ranks' backend, sent to each worker (default: each rank's own, auto)",
    )
    coord.add_argument(
        "--keep-checkpoints",
        type=int,
        default=None,
        metavar="K",
        help="bundles each rank keeps, sent to each worker (default: each rank's own, 2)",
    )
    _add_coordinator_options(coord)
    add_view_flags(coord)

    report = commands.add_parser(
        "report", help="write RUN_DIR/report/index.html: plots of a run's event log"
    )
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    report.add_argument(
        "--tensorboard",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write the event log as TensorBoard scalars to DIR (needs flodl[tensorboard])",
    )

    add_agent_parser(commands)

    helper = commands.add_parser(
        "warm-helper",
        help="import torch and flodl once and fork the ranks of every later `flodl run` and "
        "`flodl agent` of this user that names SOCKET in FLODL_WARM_HELPER, until Ctrl-C",
    )
    helper.add_argument("socket", metavar="SOCKET", help="the Unix socket to create")

    worker = commands.add_parser(
        "worker", help="run SCRIPT as one rank of a remote coordinator", allow_abbrev=False
    )
    worker.add_argument("--coordinator", required=True, metavar="URL")
    worker.add_argument(
        "--rank", type=int, default=None, help="default: from Slurm's or torchrun's variables"
    )
    worker.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="default: from Slurm's or torchrun's variables",
    )
    worker.add_argument(
        "--local-rank",
        type=int,
        default=None,
        help="this worker's index on its host: nccl trains on GPU LOCAL_RANK (with --rank; "
        "default: LOCAL_RANK, else 0)",
    )
    worker.add_argument(
        "--local-world-size",
        type=int,
        default=None,
        help="the workers on this host (with --rank; default: LOCAL_WORLD_SIZE, else "
        "--local-rank + 1)",
    )
    # Unset, these are the coordinator's (RunSettings); set, they must agree with it.
    worker.add_argument(
        "--backend",
        choices=["auto", "gloo", "nccl"],
        default=None,
        help="default: the coordinator's",
    )
    worker.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        default=None,
        help="default: the coordinator's",
    )
    worker.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=None,
        metavar="S",
        help="default: the coordinator's",
    )
    worker.add_argument(
        "--master-addr",
        default=None,
        help="MASTER_ADDR for a script's own init_process_group (torchrun's flag; where rank 0 "
        "runs; default: the coordinator's host)",
    )
    worker.add_argument(
        "--master-port",
        type=int,
        default=29500,
        help="MASTER_PORT for a script's own init_process_group (default 29500, as torchrun)",
    )
    worker.add_argument(
        "--host",
        default=None,
        help="this host's address for its peers (default: the address this host reaches the "
        "coordinator from)",
    )
    worker.add_argument(
        "--join-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="keep trying to reach the coordinator this long: it may start after the workers "
        "(default 300)",
    )
    worker.add_argument(
        "--run-dir",
        type=Path,
        default=Path("runs/worker"),
        help="where this rank writes (default: runs/worker; the ranks of a host may share it)",
    )
    worker.add_argument("script")
    worker.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def _run(args: argparse.Namespace) -> int:
    from flodl.checkpoint.resume import plan_resume
    from flodl.host.console import unread_is_fine
    from flodl.host.rundir import fresh_run_dir, point_latest
    from flodl.launch.config import LaunchConfig
    from flodl.launch.exit_status import run_succeeded
    from flodl.launch.launcher import launch
    from flodl.launch.summary import print_summary

    # Every check here runs before any rank starts: a usage error is one message, exit 2.
    args.nproc = nproc_of(args.nproc)  # a number from here on (--min-ranks is checked by it)
    if args.nnodes != 1 or args.coordinator is not None:
        return _run_nodes(args)
    config = LaunchConfig(
        script=args.script,
        script_args=tuple(args.script_args),
        nproc=args.nproc,
        transport=args.transport,
        backend=args.backend,
        run_dir=args.run_dir or fresh_run_dir(),
        seed=args.seed,
        coordinator=_coordinator_config(args),
        resume=args.resume,
        restarts=args.restarts,
        warm_start=not args.cold_start,
        overwrite=args.overwrite,
        keep_checkpoints=args.keep_checkpoints,
        echo=not args.quiet,
        show_ranks=ranks_of("--show-ranks", args.show_ranks),
        views=view_config_from(args),
    )
    config.check_host()
    if args.resume is not None:
        plan_resume(args.resume)
    if args.run_dir is None:
        point_latest(config.run_dir)
    summary = trio.run(partial(launch, config, owns_process=True))
    # `| tee` may have died of the same Ctrl-C, or the terminal closed: summary.json is
    # written, and only the echo is lost.
    with unread_is_fine():
        print_summary(summary)
        print(f"  summary: {config.run_dir / 'summary.json'}", flush=True)
    if args.report:
        with unread_is_fine():
            _write_report(config.run_dir)
    return 0 if run_succeeded(summary, strict=args.strict) else 1


def _run_nodes(args: argparse.Namespace) -> int:
    """``flodl run --nnodes N --node-rank K --coordinator HOST:PORT``: :mod:`flodl.launch.nodes`."""
    from flodl.launch.nodes import run_nodes_command

    world = args.nnodes * args.nproc if isinstance(args.nnodes, int) and args.nnodes > 0 else 0
    config = _coordinator_config(argparse.Namespace(**{**vars(args), "nproc": world}))
    return run_nodes_command(args, config, view_config_from(args))


def _coordinator(args: argparse.Namespace) -> int:
    from flodl.coordinator.process import coordinate
    from flodl.coordinator.server import open_coordinator
    from flodl.coordinator.signals import StopSignals
    from flodl.host.console import say, unread_is_fine
    from flodl.launch.exit_status import describe_losses, strict_failure, with_losses
    from flodl.launch.failure_report import coordinator_summary, print_root_cause, write_summary
    from flodl.observe.hub import open_observer
    from flodl.observe.views import run_views

    check_url("--listen", args.listen)
    check_at_least("--world-size", args.world_size, 1)
    config = _coordinator_config(args)
    views = view_config_from(args)
    key = session_key_from_env()
    stops = StopSignals()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}

    async def serve() -> tuple[str, int]:
        async with open_coordinator(
            args.listen,
            args.world_size,
            key,
            config,
            local_ranks=frozenset(),
            seed=args.seed,
            freeze_heap=True,  # this process exists to coordinate (see flodl.coordinator)
        ) as coordinator:
            # From when the coordinator started (its join timeout counts from there).
            started = coordinator.started_at
            clocks = (time.time() - (trio.current_time() - started), started)
            say(f"flodl coordinator listening on {coordinator.url}")
            try:
                observing = open_observer(coordinator, args.run_dir, (clocks[1], clocks[0]))
                async with observing as observer, trio.open_nursery() as nursery:
                    dashboard = await nursery.start(run_views, observer, views)
                    if dashboard is not None:
                        say(f"flodl: dashboard at {dashboard}")
                    # SIGINT/SIGTERM/SIGHUP: every rank saves
                    outcome = await coordinate(coordinator, stops)
                    nursery.cancel_scope.cancel()
                    return outcome
            finally:  # what it knows, even when stopped at once
                summary.update(
                    coordinator_summary(
                        coordinator.record,
                        stops,
                        clocks,
                        world_size=args.world_size,
                        policy=config.policy.value,
                        run_dir=args.run_dir,
                        exits=coordinator.agents.exits if coordinator.agents else (),
                    )
                )
                summary["wall_s"] = time.time() - clocks[0]

    line, status = trio.run(serve)
    describe_losses(summary, args.world_size)
    line = with_losses(line, summary, args.world_size)
    if args.strict and strict_failure(summary):
        status = 1
    write_summary(args.run_dir / "summary.json", summary)
    with unread_is_fine():  # the terminal may have closed (that may be what stopped the run)
        print(line, flush=True)
        print_root_cause(summary, sys.stdout)
        print(f"  summary: {args.run_dir / 'summary.json'}", flush=True)
    if args.report:
        with unread_is_fine():
            _write_report(args.run_dir)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``flodl`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "coordinator":
            return _coordinator(args)
        if args.command == "report":
            return _report(args)
        if args.command == "agent":
            return run_agent_command(args)
        if args.command == "warm-helper":
            # The helper's own process image: a rank it forks leaves through its frames only.
            command = [sys.executable, "-m", "flodl.supervise.zygote", "--listen", args.socket]
            os.execv(sys.executable, command)
        return run_worker_command(args)
    except FlodlError as err:
        print(f"flodl: error: {err}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:  # raised in a nursery: say it as plainly
        only = _only_error(group)
        if not isinstance(only, FlodlError):
            raise
        print(f"flodl: error: {only}", file=sys.stderr)
        return 2


def _only_error(error: BaseException) -> BaseException:
    """The one exception nested groups of one each hold (the group itself otherwise)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


if __name__ == "__main__":
    raise SystemExit(main())
