"""``flodl run --nnodes N --node-rank K --coordinator HOST:PORT``: torchrun's shape for a run
across hosts.

Every host runs the same command but its ``--node-rank``. Node 0 serves the coordinator at
``HOST:PORT`` (an address of node 0) for ``N x --nproc`` ranks, in the same process as the
agent that runs its own ranks; every other node runs an agent only (:mod:`flodl.agent`). So
it is the coordinator plus one agent per host, as ``flodl coordinator`` and ``flodl agent``
would be, started the way torchrun users start a job. Hosts of unequal size use those two
commands instead (``--nproc`` is per host there).
"""

from __future__ import annotations

import sys
import time
from functools import partial
from typing import Any

import trio

from flodl.agent.agent import AgentResult, run_agent
from flodl.agent.config import AgentConfig
from flodl.checkpoint.resume import plan_resume
from flodl.config import CoordinatorConfig, check_at_least
from flodl.coordinator.server import open_coordinator
from flodl.coordinator.signals import StopSignals
from flodl.core.coordinator.machine import ResumeState
from flodl.errors import ConfigError
from flodl.host.console import say
from flodl.host.environment import session_key_from_env
from flodl.host.layout import ranks_of
from flodl.host.rundir import fresh_run_dir
from flodl.launch.exit_status import describe_losses, strict_failure, with_losses
from flodl.launch.failure_report import (
    coordinator_succeeded,
    coordinator_summary,
    print_root_cause,
    write_summary,
)
from flodl.observe.hub import open_observer
from flodl.observe.view_config import ViewConfig
from flodl.observe.views import run_views
from flodl.transports import parse_url

__all__ = ["coordinator_url", "run_first_node", "run_nodes_command"]


def coordinator_url(text: str) -> str:
    """``--coordinator``'s value as a URL: ``HOST:PORT`` (torchrun's form) or ``tcp://HOST:PORT``;
    ConfigError naming the flag otherwise."""
    url = text if "://" in text else f"tcp://{text}"
    try:
        parsed = parse_url(url)
    except ConfigError as err:
        raise ConfigError(f"--coordinator: {err}") from None
    if parsed.scheme != "tcp" or not parsed.host or not parsed.port:
        raise ConfigError(f"--coordinator must be HOST:PORT (an address of node 0), got {text!r}")
    return url


async def run_first_node(
    agent: AgentConfig,
    coordinator: CoordinatorConfig,
    key: bytes,
    *,
    world_size: int,
    seed: int,
    views: ViewConfig,
    resume: ResumeState | None = None,
) -> tuple[AgentResult, dict[str, Any]]:
    """Serve the run's coordinator at ``agent.coordinator`` and run node 0's ranks beside it
    until the run ends; the agent's result and the coordinator's summary (also written to
    ``agent.run_dir/summary.json``, with the run's ``events.jsonl``).

    The agent owns the signals: a first Ctrl-C, SIGTERM or SIGHUP asks the coordinator to end
    the run with a save, as on any other node. ``resume``: the coordinator's state from the
    bundle the ranks resume from (each node's ranks read it on their own host). Every rank
    process started here has exited when this returns.
    """
    run_dir = agent.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {}
    async with open_coordinator(
        agent.coordinator,
        world_size,
        key,
        coordinator,
        local_ranks=frozenset(),
        seed=seed,
        resume=resume,
    ) as served:
        started = served.started_at
        clocks = (time.time() - (trio.current_time() - started), started)
        try:
            async with open_observer(served, run_dir, (started, clocks[0])) as observer:
                async with trio.open_nursery() as nursery:
                    await nursery.start(run_views, observer, views)
                    result = await run_agent(agent, key)
                    nursery.cancel_scope.cancel()
        finally:
            summary.update(
                coordinator_summary(
                    served.record,
                    StopSignals(),
                    clocks,
                    world_size=world_size,
                    policy=coordinator.policy.value,
                    run_dir=run_dir,
                    exits=served.agents.exits if served.agents else (),
                )
            )
            summary["wall_s"] = time.time() - clocks[0]
            describe_losses(summary, world_size)
    write_summary(run_dir / "summary.json", summary)
    return result, summary


def run_nodes_command(args: Any, config: CoordinatorConfig, views: ViewConfig) -> int:
    """``flodl run`` with ``--nnodes``: every flag checked by its name first (a usage error is
    one ConfigError, before anything starts), then this node's part of the run. The exit
    status is the agent's (0 when the coordinator ended the run, else 1; ``--strict``: also 1
    when one of its ranks failed); node 0's is also 1 when the run did not complete or stop
    on request, and with ``--strict`` when it lost any rank."""
    check_at_least("--nnodes", args.nnodes, 1)
    check_at_least("--node-rank", args.node_rank, 0)
    if args.node_rank >= args.nnodes:
        raise ConfigError(
            f"--node-rank must be below --nnodes ({args.nnodes}), got {args.node_rank}"
        )
    if args.coordinator is None:
        raise ConfigError("--nnodes needs --coordinator HOST:PORT, where node 0 serves it")
    agent = AgentConfig(
        coordinator=coordinator_url(args.coordinator),
        node_rank=args.node_rank,
        nproc=args.nproc,
        script=args.script,
        script_args=tuple(args.script_args),
        run_dir=args.run_dir or fresh_run_dir(),
        restarts=args.restarts,
        warm_start=not args.cold_start,
        join_timeout=config.join_timeout,
        resume=args.resume,
        echo=not args.quiet,
        show_ranks=ranks_of("--show-ranks", args.show_ranks),
    )
    key = session_key_from_env()
    summary: dict[str, Any] | None = None  # node 0's: the run's
    if args.node_rank > 0:
        result = trio.run(run_agent, agent, key)
    else:
        plan = None if args.resume is None else plan_resume(args.resume)
        first = partial(
            run_first_node,
            agent,
            config,
            key,
            world_size=args.nnodes * args.nproc,
            seed=args.seed,
            views=views,
            resume=None if plan is None else plan.state,
        )
        result, summary = trio.run(first)
        line = f"flodl: run {summary['status']} ({summary['message']})"
        say(with_losses(line, summary, args.nnodes * args.nproc))
        print_root_cause(summary, sys.stdout)
        say(f"  summary: {agent.run_dir / 'summary.json'}")
    say(result.closing_line(f"flodl run: node {args.node_rank}"))
    status = result.exit_status(strict=args.strict)
    if summary is not None:  # node 0 speaks for the run too
        if not coordinator_succeeded(summary) or (args.strict and strict_failure(summary)):
            status = 1
    return status
