"""The coordinator's table of node agents (:mod:`flodl.core.coordinator.hosts`)."""

from __future__ import annotations

import pytest

from flodl.core.coordinator.hosts import HostTable, NodeRanks
from flodl.errors import AgentRefused


def test_nodes_are_numbered_in_node_order_whatever_order_they_join() -> None:
    table = HostTable(world_size=11)
    assert table.join(2, 1) == []  # nodes 0 and 1 are not known yet
    assert table.join(1, 8) == []
    assert table.join(0, 2) == [NodeRanks(0, 0, 2), NodeRanks(1, 2, 8), NodeRanks(2, 10, 1)]
    assert [table.owner(rank) for rank in range(11)] == [0, 0] + [1] * 8 + [2]
    assert table.owner(11) is None
    assert table.ranks_of(1) == NodeRanks(1, 2, 8)
    assert list(NodeRanks(1, 2, 8).ranks) == list(range(2, 10))


def test_a_node_that_comes_back_keeps_its_ranks() -> None:
    table = HostTable(world_size=4)
    table.join(0, 2)
    table.join(1, 2)
    assert table.leave(1) == range(2, 4)
    assert table.connected == {0}
    assert table.join(1, 2) == [NodeRanks(1, 2, 2)]  # told its ranks again
    assert table.owner(3) == 1


@pytest.mark.parametrize(
    ("joins", "node", "nproc", "message"),
    [
        ([(0, 2)], 0, 2, "node 0 already has a connected agent"),
        ([], 0, 0, "node 0's agent runs 0 ranks; at least 1 is needed"),
        ([(0, 3)], 1, 2, r"node 1's 2 ranks would take the run past its world size 4 \(nodes so "),
        ([], 4, 1, "node 4's 1 ranks would take the run past its world size 4"),
    ],
)
def test_refusals_name_the_reason_and_change_nothing(
    joins: list[tuple[int, int]], node: int, nproc: int, message: str
) -> None:
    table = HostTable(world_size=4)
    for joined, count in joins:
        table.join(joined, count)
    before = (set(table.connected), [table.owner(r) for r in range(4)])
    with pytest.raises(AgentRefused, match=message):
        table.join(node, nproc)
    assert (table.connected, [table.owner(r) for r in range(4)]) == before


def test_a_returning_node_must_bring_the_same_rank_count() -> None:
    table = HostTable(world_size=4)
    table.join(0, 2)
    table.leave(0)
    with pytest.raises(AgentRefused, match="joined before with 2 ranks; its agent now says 3"):
        table.join(0, 3)
    assert table.connected == set()
    assert table.join(0, 2) == [NodeRanks(0, 0, 2)]
