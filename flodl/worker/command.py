"""``flodl worker``: one rank of a coordinator on another host, started without a launcher.

The flags are checked here, by their names, before the script runs (a rank would only find a
bad value after importing torch); then this process becomes the training script, with the
environment a rank reads (:class:`~flodl.host.environment.RankEnv`).
"""

from __future__ import annotations

import argparse
import os
import sys

from flodl.backends import check_backend_on_host
from flodl.config import (
    Policy,
    check_at_least,
    check_host,
    check_port,
    check_script,
    check_seconds,
    check_url,
)
from flodl.errors import ConfigError
from flodl.host.environment import RankEnv, session_key_from_env
from flodl.host.layout import layout_from
from flodl.transports.reach import host_of

__all__ = ["run_worker_command"]


def run_worker_command(args: argparse.Namespace) -> int:
    """``flodl worker``: check what a rank would refuse after importing torch, by the flags'
    names, then replace this process with the training script, started as one rank."""
    from flodl.worker.config import WorkerConfig
    from flodl.worker.signals import ENV_VAR as STOP_ON_SIGNALS

    # The checks a rank would make after importing torch, made here by the flags' names.
    check_url("--coordinator", args.coordinator)
    if args.world_size is not None:
        check_at_least("--world-size", args.world_size, 1)
    if args.rank is not None:
        check_at_least("--rank", args.rank, 0)
    if args.rank is not None and args.world_size is not None and args.rank >= args.world_size:
        raise ConfigError(f"--rank must be below --world-size ({args.world_size}), got {args.rank}")
    if args.local_rank is not None:
        check_at_least("--local-rank", args.local_rank, 0)
    if args.local_world_size is not None:
        check_at_least("--local-world-size", args.local_world_size, 1)
    layout = layout_from(
        os.environ,
        rank=args.rank,
        world_size=args.world_size,
        local_rank=args.local_rank,
        local_world_size=args.local_world_size,
    )
    if args.heartbeat_timeout is not None:
        check_seconds("--heartbeat-timeout", args.heartbeat_timeout)
    check_seconds("--join-timeout", args.join_timeout)
    check_port("--master-port", args.master_port)
    check_host("--host", args.host)
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
        master_addr=args.master_addr or host_of(args.coordinator),
        master_port=args.master_port,
        run_dir=args.run_dir.resolve(),
    )
    env = {**os.environ, **rank_env.variables()}
    env.setdefault("GROUP_RANK", str(layout.node))
    env[STOP_ON_SIGNALS] = "1"  # no launcher here: SIGTERM/SIGINT ask the coordinator to save
    WorkerConfig.from_env(env)  # what the rank will read, refused here rather than after torch
    args.run_dir.mkdir(parents=True, exist_ok=True)
    os.execvpe(sys.executable, [sys.executable, args.script, *args.script_args], env)
