"""The ``flodl`` command: ``flodl run`` (local ranks), ``flodl coordinator`` and ``flodl worker``
(one coordinator and ranks on other hosts)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import trio

from flodl.backends import check_backend_on_host
from flodl.config import CoordinatorConfig, Policy, check_at_least, check_script, check_seconds
from flodl.errors import ConfigError, FlodlError
from flodl.host.environment import RankEnv, session_key_from_env
from flodl.host.layout import layout_from
from flodl.observe.view_config import ViewConfig, parse_bind
from flodl.transports import parse_url


def _add_coordinator_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", choices=[p.value for p in Policy], default="cadence")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0, metavar="S")
    parser.add_argument(
        "--stall-ceiling",
        type=float,
        default=None,
        metavar="S",
        help="reduce-stall ceiling (default: max(10 x heartbeat timeout, 300 s))",
    )
    parser.add_argument("--anchor", type=int, default=10)
    parser.add_argument("--max-batch-diff", type=int, default=None)
    parser.add_argument(
        "--relax-up",
        action="store_true",
        help="cadence/async: grow the anchor by one after every round the guard finds stable",
    )
    parser.add_argument(
        "--window-cap-epochs",
        type=float,
        default=1.0,
        help="a window holds at most this many epochs' batches (default 1, as floDl)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="N",
        help="rank 0 (the lowest live rank) saves a bundle every N averaging rounds",
    )
    parser.add_argument(
        "--checkpoint-every-epochs",
        type=int,
        default=None,
        metavar="N",
        help="rank 0 (the lowest live rank) saves a bundle every N epochs",
    )
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="wait this long for every rank to join; then start with those that did while "
        "--min-ranks allows, else fail naming the missing ranks (default 300)",
    )
    parser.add_argument(
        "--min-ranks",
        type=int,
        default=None,
        metavar="N",
        help="ranks that die before joining (not restarted): start without them while N remain "
        "(default: 2 with a collective group, the SingleSurvivor rule)",
    )


def _check_coordinator_flags(args: argparse.Namespace) -> None:
    """Refuse bad coordinator flags by the flag's name, before CoordinatorConfig would refuse
    them by a setting's name (or one derived from it) the user never typed."""
    check_seconds("--heartbeat-timeout", args.heartbeat_timeout)
    check_seconds("--join-timeout", args.join_timeout)
    if args.keep_checkpoints is not None:
        check_at_least("--keep-checkpoints", args.keep_checkpoints, 1)
    if args.stall_ceiling is not None:
        check_seconds("--stall-ceiling", args.stall_ceiling)
    check_at_least("--anchor", args.anchor, 1)
    if args.max_batch_diff is not None:
        check_at_least("--max-batch-diff", args.max_batch_diff, 0)
    cap = args.window_cap_epochs
    if not (cap > 0 and math.isfinite(cap)):
        raise ConfigError(f"--window-cap-epochs must be a number > 0, got {cap!r}")
    if args.relax_up and args.policy == Policy.SYNC.value:
        raise ConfigError("--relax-up grows cadence windows; --policy sync has none")
    check_at_least("--seed", args.seed, 0)
    for flag, value in (
        ("--checkpoint-every", args.checkpoint_every),
        ("--checkpoint-every-epochs", args.checkpoint_every_epochs),
    ):
        if value is not None:
            check_at_least(flag, value, 1)
    if args.min_ranks is not None:
        check_at_least("--min-ranks", args.min_ranks, 1)
        world = getattr(args, "nproc", None) or getattr(args, "world_size", None)
        if isinstance(world, int) and 1 <= world < args.min_ranks:
            raise ConfigError(
                f"--min-ranks must be at most the world size ({world}), got {args.min_ranks}"
            )


def _coordinator_config(args: argparse.Namespace) -> CoordinatorConfig:
    _check_coordinator_flags(args)
    return CoordinatorConfig(
        policy=Policy(args.policy),
        heartbeat_timeout=args.heartbeat_timeout,
        heartbeat_interval=min(1.0, args.heartbeat_timeout / 4),
        reduce_stall_ceiling=args.stall_ceiling,
        anchor=args.anchor,
        max_anchor=max(1000, args.anchor),
        max_batch_diff=args.max_batch_diff,
        relax_up=args.relax_up,
        window_cap_epochs=args.window_cap_epochs,
        checkpoint_every=args.checkpoint_every,
        checkpoint_every_epochs=args.checkpoint_every_epochs,
        min_ranks=args.min_ranks,
        join_timeout=args.join_timeout,
        # What flodl run also tells its ranks itself; sent to flodl worker's.
        backend=args.backend,
        keep_checkpoints=args.keep_checkpoints,
    )


def _host_of(url: str) -> str:
    """The host of a ``tcp://`` URL; 127.0.0.1 for a unix socket (same host)."""
    parsed = parse_url(url)
    return parsed.host if parsed.scheme == "tcp" and parsed.host else "127.0.0.1"


def _ranks_of(flag: str, text: str | None) -> frozenset[int] | None:
    """``0,2,5`` (or ``0-3``) -> the set of ranks; None stays None. ConfigError if bad."""
    if text is None:
        return None
    ranks: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            ranks.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ConfigError(f"{flag} must list ranks like 0,2 or 0-3, got {text!r}") from None
    return frozenset(ranks)


def nproc_of(text: str) -> int:
    """``--nproc``'s value as torchrun reads ``--nproc-per-node``: a number, ``gpu`` (the
    visible GPUs; ConfigError when there are none), ``cpu`` (the CPU cores) or ``auto``
    (``gpu`` where CUDA is usable, else ``cpu``). Imports torch only for ``gpu``/``auto``."""
    if text in ("gpu", "auto"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus:
            return gpus
        if text == "gpu":
            raise ConfigError("--nproc gpu: torch sees no usable GPU on this host")
        text = "cpu"
    if text == "cpu":
        return os.cpu_count() or 1
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--nproc must be a number, auto, gpu or cpu, got {text!r}") from None


def _add_view_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-live",
        action="store_true",
        help="no live table even on a terminal: plain lines (rank output and events) instead",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="print only the end-of-run summary (rank output is still in run_dir/rank<N>.log)",
    )
    parser.add_argument(
        "--dashboard",
        default=None,
        metavar="[HOST:]PORT",
        help="serve a live web dashboard, /api/state, /api/events and /metrics "
        "(host default 127.0.0.1; any other host needs --dashboard-token-file)",
    )
    parser.add_argument(
        "--dashboard-token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="every dashboard request must present this file's token (Bearer or ?token=)",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="write run_dir/report/index.html (plots of the event log) when the run ends",
    )


def _view_config(args: argparse.Namespace) -> ViewConfig:
    return ViewConfig(
        live=False if args.no_live or args.quiet else None,
        quiet=args.quiet,
        dashboard=None if args.dashboard is None else parse_bind(args.dashboard),
        dashboard_token_file=args.dashboard_token_file,
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flodl", description="Data-parallel training for machines of unequal speed."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run SCRIPT on N local ranks with a coordinator")
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
    run.add_argument(
        "--keep-checkpoints",
        type=int,
        default=2,
        metavar="K",
        help="each rank keeps its K newest bundles and removes older ones (default 2)",
    )
    _add_coordinator_options(run)
    _add_view_options(run)
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)

    coord = commands.add_parser("coordinator", help="coordinate ranks that join from other hosts")
    coord.add_argument("--listen", required=True, metavar="URL", help="e.g. tcp://0.0.0.0:29400")
    coord.add_argument("--world-size", type=int, required=True)
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
    _add_view_options(coord)

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

    worker = commands.add_parser("worker", help="run SCRIPT as one rank of a remote coordinator")
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
    from flodl.launch.launcher import launch
    from flodl.launch.summary import print_summary, run_succeeded

    # Every check here runs before any rank starts: a usage error is one message, exit 2.
    args.nproc = nproc_of(args.nproc)  # a number from here on (--min-ranks is checked by it)
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
        overwrite=args.overwrite,
        keep_checkpoints=args.keep_checkpoints,
        echo=not args.quiet,
        show_ranks=_ranks_of("--show-ranks", args.show_ranks),
        views=_view_config(args),
    )
    config.check_host()
    if args.resume is not None:
        plan_resume(args.resume)
    if args.run_dir is None:
        point_latest(config.run_dir)
    summary = trio.run(launch, config)
    # `| tee` may have died of the same Ctrl-C, or the terminal closed: summary.json is
    # written, and only the echo is lost.
    with unread_is_fine():
        print_summary(summary)
        print(f"  summary: {config.run_dir / 'summary.json'}", flush=True)
    if args.report:
        with unread_is_fine():
            _write_report(config.run_dir)
    return 0 if run_succeeded(summary) else 1


def _check_url(flag: str, url: str) -> None:
    try:
        parse_url(url)
    except FlodlError as err:
        raise ConfigError(f"{flag}: {err}") from None


def _coordinator(args: argparse.Namespace) -> int:
    from flodl.coordinator.process import coordinate
    from flodl.coordinator.server import open_coordinator
    from flodl.coordinator.signals import StopSignals
    from flodl.host.console import say, unread_is_fine
    from flodl.launch.failure_report import coordinator_summary, print_root_cause, write_summary
    from flodl.observe.hub import open_observer
    from flodl.observe.views import run_views

    _check_url("--listen", args.listen)
    check_at_least("--world-size", args.world_size, 1)
    config = _coordinator_config(args)
    views = _view_config(args)
    key = session_key_from_env()
    stops = StopSignals()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, object] = {}

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
                        coordinator.machine,
                        stops,
                        clocks,
                        world_size=args.world_size,
                        policy=config.policy.value,
                        run_dir=args.run_dir,
                    )
                )
                summary["wall_s"] = time.time() - clocks[0]

    line, status = trio.run(serve)
    write_summary(args.run_dir / "summary.json", summary)
    with unread_is_fine():  # the terminal may have closed (that may be what stopped the run)
        print(line, flush=True)
        print_root_cause(summary, sys.stdout)
        print(f"  summary: {args.run_dir / 'summary.json'}", flush=True)
    if args.report:
        with unread_is_fine():
            _write_report(args.run_dir)
    return status


def _worker(args: argparse.Namespace) -> int:
    from flodl.worker.config import WorkerConfig
    from flodl.worker.signals import ENV_VAR as STOP_ON_SIGNALS

    # The checks a rank would make after importing torch, made here by the flags' names.
    _check_url("--coordinator", args.coordinator)
    if args.world_size is not None:
        check_at_least("--world-size", args.world_size, 1)
    if args.rank is not None:
        check_at_least("--rank", args.rank, 0)
    if args.rank is not None and args.world_size is not None and args.rank >= args.world_size:
        raise ConfigError(f"--rank must be below --world-size ({args.world_size}), got {args.rank}")
    layout = layout_from(os.environ, rank=args.rank, world_size=args.world_size)
    if args.heartbeat_timeout is not None:
        check_seconds("--heartbeat-timeout", args.heartbeat_timeout)
    check_seconds("--join-timeout", args.join_timeout)
    if not 1 <= args.master_port <= 65535:
        raise ConfigError(f"--master-port must be 1..65535, got {args.master_port}")
    if args.host is not None and not args.host.strip():
        raise ConfigError("--host must not be empty")
    check_script(args.script)
    if args.backend is not None:
        check_backend_on_host(args.backend, layout.local_world_size)
    session_key_from_env()  # fail early, here, if the key is missing
    rank_env = RankEnv(
        coordinator=args.coordinator,
        rank=layout.rank,
        world_size=layout.world_size,
        local_rank=layout.local_rank,
        local_world_size=layout.local_world_size,
        backend=args.backend,
        policy=None if args.policy is None else Policy(args.policy),
        heartbeat_timeout=args.heartbeat_timeout,
        # As `flodl run` and `flodl coordinator` derive it: the rank beacons at the
        # coordinator's pace, and a timeout under 1 s stays above the interval.
        heartbeat_interval=(
            None if args.heartbeat_timeout is None else min(1.0, args.heartbeat_timeout / 4)
        ),
        host=args.host,
        join_timeout=args.join_timeout,
        master_addr=args.master_addr or _host_of(args.coordinator),
        master_port=args.master_port,
        run_dir=args.run_dir.resolve(),
    )
    env = {**os.environ, **rank_env.variables()}
    env.setdefault("GROUP_RANK", str(layout.node))
    env[STOP_ON_SIGNALS] = "1"  # no launcher here: SIGTERM/SIGINT ask the coordinator to save
    WorkerConfig.from_env(env)  # what the rank will read, refused here rather than after torch
    args.run_dir.mkdir(parents=True, exist_ok=True)
    os.execvpe(sys.executable, [sys.executable, args.script, *args.script_args], env)


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
        return _worker(args)
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
