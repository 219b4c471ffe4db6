"""Which node agent speaks for which ranks: the coordinator's table of hosts.

A node agent (:mod:`flodl.agent`) joins with its node rank and the number of ranks its host
runs (hosts may run different numbers). Ranks are numbered node by node, as torchrun numbers
them: node ``k`` runs ranks ``first .. first + nproc - 1`` with ``first`` the sum of the
``nproc`` of nodes ``0 .. k - 1``. So node ``k``'s ranks are known once nodes ``0 .. k`` have
joined, whatever order they joined in; an agent that joins early waits for its numbers.

An agent that comes back (restarted, or reconnecting) for a node that had joined must bring the
same ``nproc``: its ranks were numbered and may be running. Every refusal is a
:class:`~flodl.errors.AgentRefused` that says why; it changes nothing in the table. Pure: no
clocks, no I/O.
"""

from __future__ import annotations

import attrs

from flodl.errors import AgentRefused

__all__ = ["HostTable", "NodeRanks"]


@attrs.frozen
class NodeRanks:
    """The ranks node ``node_rank`` runs: ``first_rank`` to ``first_rank + nproc - 1``."""

    node_rank: int
    first_rank: int
    nproc: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)


class HostTable:
    """The nodes that joined, their ranks once numbered, and which agents are connected."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._nproc: dict[int, int] = {}
        """node rank -> nproc, for every node that ever joined."""
        self._numbered: dict[int, NodeRanks] = {}
        self._owner: dict[int, int] = {}
        """rank -> node rank, for every numbered rank."""
        self.connected: set[int] = set()
        """Node ranks whose agent is connected now."""

    def join(self, node_rank: int, nproc: int) -> list[NodeRanks]:
        """Node ``node_rank``'s agent joined with ``nproc`` ranks (it is connected from now on).

        Returns every node numbered by this join, in node order (this one among them once the
        nodes before it have joined; a node that was numbered earlier is returned again, for
        its returning agent). Raises AgentRefused, changing nothing, for an ``nproc`` below 1,
        a node that joined before with another ``nproc``, or ranks past the world size.
        """
        if node_rank in self.connected:
            raise AgentRefused(f"node {node_rank} already has a connected agent")
        if nproc < 1:
            raise AgentRefused(f"node {node_rank}'s agent runs {nproc} ranks; at least 1 is needed")
        earlier = self._nproc.get(node_rank)
        if earlier is not None and earlier != nproc:
            raise AgentRefused(
                f"node {node_rank} joined before with {earlier} ranks; its agent now says {nproc}"
            )
        if node_rank >= self.world_size or sum(self._nproc.values()) - (earlier or 0) + nproc > (
            self.world_size
        ):
            raise AgentRefused(
                f"node {node_rank}'s {nproc} ranks would take the run past its world size "
                f"{self.world_size} (nodes so far: {self._describe()})"
            )
        self._nproc[node_rank] = nproc
        self.connected.add(node_rank)
        fresh = self._number()
        if node_rank in self._numbered and all(n.node_rank != node_rank for n in fresh):
            fresh.append(self._numbered[node_rank])
        return fresh

    def leave(self, node_rank: int) -> range:
        """Node ``node_rank``'s agent is gone; the ranks it spoke for (empty if unnumbered)."""
        self.connected.discard(node_rank)
        numbered = self._numbered.get(node_rank)
        return numbered.ranks if numbered is not None else range(0)

    def owner(self, rank: int) -> int | None:
        """The node whose agent speaks for ``rank`` (None: no agent's)."""
        return self._owner.get(rank)

    def ranks_of(self, node_rank: int) -> NodeRanks | None:
        """Node ``node_rank``'s ranks, once numbered."""
        return self._numbered.get(node_rank)

    def _number(self) -> list[NodeRanks]:
        """Number every node whose predecessors have all joined; the newly numbered."""
        fresh: list[NodeRanks] = []
        first = 0
        for node in range(self.world_size):
            nproc = self._nproc.get(node)
            if nproc is None:
                break
            if node not in self._numbered:
                numbered = NodeRanks(node, first, nproc)
                self._numbered[node] = numbered
                self._owner.update({rank: node for rank in numbered.ranks})
                fresh.append(numbered)
            first += nproc
        return fresh

    def _describe(self) -> str:
        if not self._nproc:
            return "none"
        return ", ".join(f"node {node}: {n}" for node, n in sorted(self._nproc.items()))
