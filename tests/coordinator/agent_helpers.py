"""A node agent for coordinator tests: joined, its ranks' socket listening, its link running."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from flodl.agent.config import AgentConfig
from flodl.agent.link import AgentLink, open_agent_link
from flodl.coordinator.server import Coordinator


@asynccontextmanager
async def carrying_agent(
    coord: Coordinator, node: int, nproc: int, folder: Path, key: bytes
) -> AsyncIterator[AgentLink]:
    """Node ``node``'s agent as ``flodl agent`` runs it, without starting any rank: the ranks a
    test connects to ``link.ranks.url`` reach ``coord`` through it."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "train.py"
    script.write_text("")
    config = AgentConfig(
        coordinator=coord.url, node_rank=node, nproc=nproc, script=str(script), run_dir=folder
    )
    link, _ = await open_agent_link(config, key)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.ranks.serve)
        nursery.start_soon(link.run)
        try:
            yield link
        finally:
            nursery.cancel_scope.cancel()
            with trio.CancelScope(shield=True):
                await link.aclose()
