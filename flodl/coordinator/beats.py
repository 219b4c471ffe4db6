"""The coordinator's heartbeats to its ranks, and what their clock says of the coordinator.

Each rank gets one ``CoordHeartbeat`` per interval, at a phase of its own: the interval is cut
into :data:`HEARTBEAT_SLOTS` slots and rank ``r`` beats in slot ``r % HEARTBEAT_SLOTS``, so a
large world is not sent (and does not answer) a thousand frames at one instant. The ranks a
node agent carries beat in their node's slot, together: one frame per host.

The loop is also the coordinator's own pulse. When it wakes a long time after it was due, the
coordinator's process did not run meanwhile (SIGSTOP, a suspended machine, heavy swapping),
and every rank heard nothing from it for that long: once that reaches the heartbeat timeout,
the ranks have given up on it. The loop reports such a pause (``on_paused``) so that the run's
record can say why its ranks left, and starts its beats again from now rather than sending
every missed one at once.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from flodl.coordinator.links import Links
from flodl.wire.codec import encode_message
from flodl.wire.messages import CoordHeartbeat

__all__ = ["HEARTBEAT_SLOTS", "beat_ranks"]

HEARTBEAT_SLOTS = 16
"""The heartbeat interval is cut into this many slots; each rank beats in one of them."""


async def beat_ranks(
    links: Links,
    node_of: Callable[[int], int | None],
    interval: float,
    *,
    pause_after: float,
    on_paused: Callable[[float], None],
) -> None:
    """Beat every open link every ``interval`` (module docstring) until cancelled; nothing
    else can delay it. ``node_of(rank)``: the node whose agent carries ``rank``, or None.
    ``on_paused(seconds)`` is called, from this task, each time the loop woke at least
    ``pause_after`` seconds late."""
    beat = encode_message(CoordHeartbeat())
    started = trio.current_time()
    slot = 0
    by_slot: list[list[int]] = []
    placed = -1  # the links' version by_slot was built for
    while True:
        if links.version != placed:  # someone came or went: place the ranks again
            by_slot = [[] for _ in range(HEARTBEAT_SLOTS)]
            for rank in links.by_rank:
                node = node_of(rank)
                by_slot[(rank if node is None else node) % HEARTBEAT_SLOTS].append(rank)
            placed = links.version
        for rank in by_slot[slot % HEARTBEAT_SLOTS]:
            link = links.by_rank.get(rank)
            if link is not None:
                links.enqueue(link, beat)
        links.flush()
        slot += 1
        due = started + slot * interval / HEARTBEAT_SLOTS
        await trio.sleep_until(due)
        late = trio.current_time() - due
        if late >= pause_after:
            on_paused(late)
        if late >= interval:  # start again from now: no burst of the beats missed
            started, slot = trio.current_time(), 0
