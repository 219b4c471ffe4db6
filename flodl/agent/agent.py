"""``flodl agent``: start this host's ranks for a coordinator elsewhere, supervise them, and
speak for them.

:func:`run_agent` joins the coordinator (:mod:`flodl.agent.link`), learns which ranks this node
runs, and starts them with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` and ``NODE_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and
flodl's own, each in a session of its own with its output in ``run_dir/rank<N>.log``. It
supervises them as ``flodl run`` does (:mod:`flodl.supervise.ranks`): every exit is reported
to the coordinator at once, a rank that fails is started again while the host's
``--restarts`` last (it rejoins the running group), and the first Ctrl-C, SIGTERM or SIGHUP
asks the coordinator to end the run with a save (a second SIGINT or SIGTERM kills the ranks).
Every process it started is gone when it returns, whatever happened. Should the agent die
first (SIGKILL), its ranks' connections, which end at it (:mod:`flodl.agent.sessions`), end
with it: each rank saves its bundle as a rank that lost its coordinator does, and exits; the
coordinator sees them go and the ranks on other hosts re-form without them.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import trio

from flodl.agent.config import AgentConfig
from flodl.agent.host_ranks import HostRanks
from flodl.agent.link import NodeAssignment, open_agent_link
from flodl.host.console import say
from flodl.host.environment import RankEnv, rank_process_environment, write_session_key
from flodl.host.torchrun_env import TorchrunLayout
from flodl.supervise.exits import exit_text
from flodl.supervise.ranks import RankStarter, RestartBudget, Supervision
from flodl.supervise.warm import warm_starter_if
from flodl.transports.reach import host_of

__all__ = ["AgentResult", "agent_rank_environment", "run_agent"]


@attrs.frozen
class AgentResult:
    """How an agent's run ended."""

    assignment: NodeAssignment
    exits: dict[int, list[str]]
    """Each rank's exits in order (``0``, ``SIGKILL``, ...)."""
    restarts: int
    """Ranks this host started again."""
    coordinator_lost: str | None
    """Why the coordinator was lost (None: it ended the run)."""
    killed: bool
    """A second stop signal, or the end of the exit grace, killed ranks still running."""

    def exit_status(self, *, strict: bool = False) -> int:
        """The agent's exit status: 0 when the coordinator ended the run, else 1; with
        ``strict``, also 1 when any of this host's rank processes failed on the way (even one
        a restart replaced)."""
        if self.coordinator_lost is not None or self.killed:
            return 1
        failed = any(code != "0" for codes in self.exits.values() for code in codes)
        return 1 if strict and failed else 0

    def closing_line(self, who: str) -> str:
        """What ``who`` (``flodl agent``) says when it ends: how the run ended for this node,
        each rank's exits in order, the restarts."""
        exits = ", ".join(f"rank {rank}: {' '.join(codes)}" for rank, codes in self.exits.items())
        how = (
            "the run ended"
            if self.coordinator_lost is None
            else f"lost the coordinator ({self.coordinator_lost})"
        )
        return f"{who}: {how}; exits: {exits}; restarts: {self.restarts}"


def agent_rank_environment(
    config: AgentConfig,
    assignment: NodeAssignment,
    local_rank: int,
    key_file: Path,
    restart_count: int,
    coordinator: str | None = None,
) -> dict[str, str]:
    """The environment of this node's ``local_rank``: the agent's, plus torchrun's variables and
    what a flodl rank reads (the key by file only; ``coordinator``: where the rank connects, the
    agent's own socket, default the coordinator's address)."""
    coordinator = coordinator or config.coordinator
    rank = assignment.first_rank + local_rank
    master_addr = config.master_addr or host_of(config.coordinator)
    layout = TorchrunLayout(
        rank=rank,
        world_size=assignment.world_size,
        local_rank=local_rank,
        local_world_size=assignment.nproc,
        group_rank=config.node_rank,
        master_addr=master_addr,
        master_port=config.master_port,
        restart_count=restart_count,
        max_restarts=config.restarts,
        run_id=config.run_dir.name,
    )
    rank_env = RankEnv(
        coordinator=coordinator,
        rank=rank,
        world_size=assignment.world_size,
        local_rank=local_rank,
        local_world_size=assignment.nproc,
        session_key_file=key_file.resolve(),
        run_dir=config.run_dir.resolve(),
        host=assignment.host,
        join_timeout=config.join_timeout,
        master_addr=master_addr,
        master_port=config.master_port,
        resume=None if config.resume is None else config.resume.resolve(),
    )
    env = rank_process_environment(layout, rank_env)
    del env["GROUP_WORLD_SIZE"]  # the number of nodes is not known to an agent
    env["NODE_RANK"] = str(config.node_rank)
    return env


async def run_agent(config: AgentConfig, key: bytes) -> AgentResult:
    """Join the coordinator, run this node's ranks until the run ends, and return how it went.

    Raises CoordinatorError when no coordinator answers within the join timeout, AgentRefused
    or the handshake's typed error when it refuses this agent; no rank has started then.
    Guarantees: every rank process started here has exited (killed if need be) when this
    returns or raises, including on cancellation.
    """
    config.run_dir.mkdir(parents=True, exist_ok=True)
    link, assignment = await open_agent_link(config, key)
    if config.echo:
        last = assignment.first_rank + assignment.nproc - 1
        say(
            f"flodl agent: node {config.node_rank} runs ranks {assignment.first_rank}-{last} of "
            f"{assignment.world_size}"
        )
    key_file = write_session_key(config.run_dir, key)
    supervision = Supervision(
        config.run_dir,
        config.restarts,
        echo=config.echo,
        show_ranks=config.show_ranks,
        shared=RestartBudget(config.restarts),  # --restarts counts for the host
    )

    def environment(rank: int, restart_count: int) -> dict[str, str]:
        local_rank = rank - assignment.first_rank
        url = link.ranks.url
        return agent_rank_environment(config, assignment, local_rank, key_file, restart_count, url)

    starter = RankStarter([config.python, config.script, *config.script_args], environment)
    host = HostRanks(
        assignment.ranks,
        starter,
        supervision,
        exit_grace=config.exit_grace,
        kill_says=("kill this host's ranks", "killing this host's ranks"),
    )
    link.kill_rank = host.kill_silenced  # a rank the run declared dead for silence
    sessions = trio.CancelScope()

    async def carry_ranks(task_status: trio.TaskStatus[None]) -> None:
        with sessions:
            await link.ranks.serve(task_status=task_status)

    async def carry_link() -> None:
        try:
            await link.run()
        finally:
            sessions.cancel()  # the coordinator is gone: so is every rank's connection

    common = environment(assignment.first_rank, 0)  # what the warm-start helper imports in
    try:
        async with warm_starter_if(config.warm_start, config.python, common, say) as helper:
            starter.warm = helper
            async with trio.open_nursery() as nursery:
                await nursery.start(carry_ranks)
                nursery.start_soon(carry_link)
                await host.run(link)
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await link.aclose()
    lost = link.lost
    return AgentResult(
        assignment=assignment,
        exits={item.rank: [exit_text(code) for code, _ in item.exits] for item in host.spawned},
        restarts=sum(item.restarts for item in host.spawned),
        coordinator_lost=None if lost is None else f"{type(lost).__name__}: {lost}",
        killed=host.stops.killed or any(item.exit_log.killed for item in host.spawned),
    )
