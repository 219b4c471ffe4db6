"""Spawn and supervise local ranks around an in-process coordinator (``flodl run``).

``flodl run`` is the coordinator plus the node agent's supervision in one process: the ranks
are run by :class:`~flodl.agent.host_ranks.HostRanks`, as under ``flodl agent``, with the
coordinator itself as their link (no agent between: they connect to it directly).

:func:`launch` opens the coordinator, starts ``nproc`` copies of the training script with the
environment a rank needs (torchrun-style RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT plus flodl's own ``FLODL_*``), relays their output with a ``[rank N]`` prefix, feeds
each process exit into the coordinator's death detection, turns the first Ctrl-C (SIGINT or
SIGTERM) into a graceful save-and-shutdown and the second into a kill
(:mod:`flodl.host.console`: ranks run in sessions of their own, out of reach of a terminal's
Ctrl-C), checks on disk what was saved (:mod:`flodl.launch.saves`), and finally writes
``run-dir/summary.json``. Every process it started is gone when it returns, whatever happened.

The session key is generated here and handed to the ranks in a 0600 file named by
``FLODL_SESSION_KEY_FILE``; it never appears on a command line.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

import trio

from flodl.agent.host_ranks import HostRanks, silenced_ranks
from flodl.checkpoint.resume import ResumePlan, plan_resume, save_coordinator_meta
from flodl.coordinator.server import open_coordinator
from flodl.core.coordinator.timeline import EventKind
from flodl.host.console import say
from flodl.host.environment import RankEnv, rank_process_environment, write_session_key
from flodl.host.rundir import claim_run_dir, set_aside
from flodl.host.torchrun_env import OMP_NOTE, TorchrunLayout, free_port
from flodl.launch.config import LaunchConfig
from flodl.launch.failure_report import write_summary
from flodl.launch.summary import SUMMARY_NAME, build_summary
from flodl.observe.events import EVENTS_NAME
from flodl.observe.hub import open_observer
from flodl.observe.views import run_views
from flodl.supervise.ranks import RankStarter, Supervision
from flodl.supervise.warm import warm_starter_if


def rank_environment(
    config: LaunchConfig,
    rank: int,
    url: str,
    key_file: Path,
    master_port: int,
    resume: Path | None = None,
    restart_count: int = 0,
) -> dict[str, str]:
    """The environment of rank ``rank``: the parent's, plus what a flodl rank reads (the key
    by file only: a key inherited in the environment would be the wrong one) and torchrun's
    variables (:mod:`flodl.host.torchrun_env`; ``MASTER_PORT`` is ``master_port``, free for the
    script's own rendezvous)."""
    layout = TorchrunLayout(
        rank=rank,
        world_size=config.nproc,
        local_rank=rank,
        local_world_size=config.nproc,
        master_port=master_port,
        restart_count=restart_count,
        max_restarts=config.restarts,
        run_id=config.run_dir.name,
    )
    coordinator = config.coordinator
    rank_env = RankEnv(
        coordinator=url,
        rank=rank,
        world_size=config.nproc,
        local_rank=rank,
        local_world_size=config.nproc,
        session_key_file=key_file.resolve(),
        backend=config.backend,
        policy=coordinator.policy,
        heartbeat_timeout=coordinator.heartbeat_timeout,
        heartbeat_interval=coordinator.heartbeat_interval,
        run_dir=config.run_dir.resolve(),
        seed=config.seed,
        host="127.0.0.1",
        resume=None if resume is None else resume.resolve(),
        keep_checkpoints=config.keep_checkpoints,
    )
    return rank_process_environment(layout, rank_env)


async def launch(
    config: LaunchConfig, *, key: bytes | None = None, owns_process: bool = False
) -> dict[str, Any]:
    """Run the job to its end and return the summary (also written to run-dir/summary.json).

    ``owns_process``: this process exists to run the job (``flodl run``), so the coordinator
    freezes its heap once training starts (:mod:`flodl.coordinator`). Left False in a process
    with other work (a notebook, a test session): there the full collection before the freeze
    walks that work's heap too, and stalls every heartbeat while it does.

    Guarantees: every rank process started here has exited (killed if need be) when this
    returns or raises, including on cancellation. Raises ConfigError, before any rank starts,
    for what this host cannot run and for a run dir that is in use or holds an earlier run
    (see :func:`flodl.host.rundir.claim_run_dir`).
    """
    config.check_host()
    plan = None if config.resume is None else plan_resume(config.resume)
    with claim_run_dir(config.run_dir, resume=config.resume, overwrite=config.overwrite):
        if config.echo:
            say(f"flodl: run folder {config.run_dir}")
        return await _launch(config, key, plan, owns_process)


async def _launch(
    config: LaunchConfig, key: bytes | None, plan: ResumePlan | None, owns_process: bool
) -> dict[str, Any]:
    run_dir = config.run_dir
    if plan is not None:  # each rank log holds one run; a restart within it appends
        for log in sorted(run_dir.glob("rank*.log")):
            if log.name.removeprefix("rank").removesuffix(".log").isdigit():
                set_aside(log)
    key = key or secrets.token_bytes(32)
    key_file = write_session_key(run_dir, key)
    if config.transport == "unix":
        url = f"unix://{(run_dir / 'coordinator.sock').resolve()}"
    else:
        url = "tcp://127.0.0.1:0"
    started_unix = time.time()
    supervision = Supervision(
        run_dir, config.restarts, echo=config.echo, show_ranks=config.show_ranks
    )
    async with open_coordinator(
        url,
        config.nproc,
        key,
        config.coordinator,
        seed=config.seed,
        linger=config.exit_grace,
        resume=None if plan is None else plan.state,
        freeze_heap=owns_process,
    ) as coordinator:
        # The run's clock starts when the coordinator's did (its join timeout counts from
        # there); the unix time of that instant is read off both clocks read together.
        trio_start = coordinator.started_at
        clock_unix = time.time() - (trio.current_time() - trio_start)
        master_port = free_port()
        if config.nproc > 1 and "OMP_NUM_THREADS" not in os.environ and config.echo:
            say(OMP_NOTE.format(n=config.nproc))

        def environment(rank: int, restart_count: int) -> dict[str, str]:
            resume = None if plan is None else plan.bundle
            url = coordinator.url
            return rank_environment(config, rank, url, key_file, master_port, resume, restart_count)

        starter = RankStarter([config.python, config.script, *config.script_args], environment)
        # The host's ranks, run by the node agent's own code with the coordinator in this
        # process as its link: one supervision for one host and for many.
        host = HostRanks(
            range(config.nproc),
            starter,
            supervision,
            exit_grace=config.exit_grace,
            kill_says=("kill them", "killing the ranks"),
        )
        observing = open_observer(coordinator, run_dir, (trio_start, clock_unix))
        # Every rank's environment but for its number: what the warm-start helper imports in.
        warming = warm_starter_if(
            config.warm_start, config.python, environment(0, 0), say if config.echo else None
        )
        async with observing as observer, warming as helper, trio.open_nursery() as nursery:
            starter.warm = helper
            view = observer.view
            dashboard = await nursery.start(run_views, observer, config.views)
            if dashboard is not None and config.echo:
                say(f"flodl: dashboard at {dashboard}")
            coordinator.add_event_sink(silenced_ranks(host.kill_silenced))
            await host.run(coordinator)
            nursery.cancel_scope.cancel()
        spawned, stops = host.spawned, host.stops
        summary = build_summary(
            config, coordinator.record, spawned, (clock_unix, trio_start), stops, view
        )
        summary["wall_s"] = time.time() - started_unix
        summary["run_dir"] = str(run_dir)
        summary["events"] = str(run_dir / EVENTS_NAME)
        record = coordinator.record
        try:
            # Only a run that trained has state of its own: one that never started (refused,
            # every rank dead before joining) must leave a resumed run's state as it was.
            if record.timeline.of_kind(EventKind.TRAINING_STARTED):
                save_coordinator_meta(run_dir, record.checkpoint_meta())
        except OSError as err:  # a full disk: the ranks' bundles are what --resume needs most
            say(f"flodl: the coordinator's state for --resume not written ({err})")
        if plan is not None:
            summary["resumed_from"] = str(plan.bundle)
    write_summary(run_dir / SUMMARY_NAME, summary)
    return summary
