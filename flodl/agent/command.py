"""``flodl agent``: its flags, checked by their names before anything starts, and its run."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["add_agent_parser", "run_agent_command"]


def add_agent_parser(commands: Any) -> None:
    """Add ``flodl agent`` to the CLI's subcommands."""
    from flodl.supervise.warm import COLD_START_HELP

    agent = commands.add_parser(
        "agent",
        help="start and supervise this host's ranks for a coordinator elsewhere",
        allow_abbrev=False,
    )
    agent.add_argument("--coordinator", required=True, metavar="URL", help="tcp://HOST:PORT")
    agent.add_argument(
        "--node-rank",
        type=int,
        required=True,
        metavar="K",
        help="this host's index, 0 .. nodes - 1: node K runs the ranks after nodes 0 .. K - 1's",
    )
    agent.add_argument(
        "--nproc",
        required=True,
        metavar="N|auto|gpu|cpu",
        help="ranks this host runs (hosts may differ): a number; gpu: one per visible GPU; "
        "cpu: one per CPU core; auto: gpu where CUDA is usable, else cpu",
    )
    agent.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="start a failed rank again, this many times in all for this host; it rejoins "
        "the running group",
    )
    agent.add_argument("--cold-start", action="store_true", help=COLD_START_HELP)
    agent.add_argument(
        "--run-dir",
        type=Path,
        default=Path("runs/agent"),
        help="where this host's ranks write: rank<N>.log, checkpoints (default: runs/agent)",
    )
    agent.add_argument(
        "--join-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="keep trying to reach the coordinator this long: it may start after the agents "
        "(default 300)",
    )
    agent.add_argument(
        "--host",
        default=None,
        help="this host's address for its ranks' peers (default: the address this host "
        "reaches the coordinator from)",
    )
    agent.add_argument(
        "--master-addr",
        default=None,
        help="MASTER_ADDR for a script's own init_process_group (default: the coordinator's host)",
    )
    agent.add_argument("--master-port", type=int, default=29500, help="default 29500")
    agent.add_argument(
        "--show-ranks",
        default=None,
        metavar="R,R,...",
        help="relay only these ranks' output; all of it is in run_dir/rank<N>.log",
    )
    agent.add_argument("--quiet", action="store_true", help="relay no rank's output")
    agent.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 when any of this host's ranks failed, even if a restart replaced it or "
        "the run went on without it (default: 0 whenever the coordinator ended the run)",
    )
    agent.add_argument("script")
    agent.add_argument("script_args", nargs=argparse.REMAINDER)


def run_agent_command(args: argparse.Namespace) -> int:
    """``flodl agent``: check every flag by its name, then run this host's ranks until the run
    ends. Exit status 0 when the coordinator ended the run, 1 when it was lost or the ranks
    had to be killed, or with ``--strict`` when a rank failed (usage errors and refusals are
    the caller's exit 2)."""
    import trio

    from flodl.agent.agent import run_agent
    from flodl.agent.config import AgentConfig
    from flodl.host.console import say
    from flodl.host.environment import session_key_from_env
    from flodl.host.layout import nproc_of, ranks_of

    config = AgentConfig(
        coordinator=args.coordinator,
        node_rank=args.node_rank,
        nproc=nproc_of(args.nproc),
        script=args.script,
        script_args=tuple(args.script_args),
        run_dir=args.run_dir,
        restarts=args.restarts,
        warm_start=not args.cold_start,
        join_timeout=args.join_timeout,
        host=args.host,
        master_addr=args.master_addr,
        master_port=args.master_port,
        echo=not args.quiet,
        show_ranks=ranks_of("--show-ranks", args.show_ranks),
    )
    key = session_key_from_env()
    result = trio.run(run_agent, config, key)
    say(result.closing_line("flodl agent"))
    return result.exit_status(strict=args.strict)
