"""The coordinator's heartbeat loop under a mock clock: one beat per interval for each rank, a
wake long after its time reported as a pause of the coordinator's process, and the beats then
going on from that moment rather than all the missed ones at once."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import pytest
import trio
from trio.testing import MockClock

from flodl.coordinator.beats import beat_ranks
from flodl.coordinator.links import Links, Outgoing


class Wire:
    """A rank's connection that takes every write at once and keeps what was written."""

    def __init__(self) -> None:
        self.written: list[Outgoing] = []

    def send_nowait(self, messages: Sequence[Outgoing]) -> bool:
        self.written.extend(messages)
        return True

    async def send_many(self, messages: Sequence[Outgoing]) -> None:
        self.written.extend(messages)

    async def flush(self) -> None:
        return None


async def test_a_late_wake_is_a_pause_and_the_beats_go_on_from_then(
    autojump_clock: MockClock,
) -> None:
    links, wire, paused = Links(), Wire(), list[float]()
    links.open(0, wire, trio.CancelScope())
    beats = partial(beat_ranks, links, lambda _rank: None, 1.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(beats, pause_after=5.0, on_paused=paused.append))
        await trio.sleep(3.5)
        assert len(wire.written) == 4 and paused == []  # at 0, 1, 2 and 3 s: nothing late
        autojump_clock.jump(20.0)  # the process does not run for 20 s
        await trio.sleep(0.5)
        assert paused == [pytest.approx(20.0, abs=1 / 16)]
        assert len(wire.written) == 5  # one beat on waking, not the 20 it missed
        await trio.sleep(2.0)
        assert len(wire.written) == 7 and len(paused) == 1
        nursery.cancel_scope.cancel()


async def test_a_pause_shorter_than_the_threshold_is_not_reported(
    autojump_clock: MockClock,
) -> None:
    links, paused = Links(), list[float]()
    beats = partial(beat_ranks, links, lambda _rank: None, 1.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(beats, pause_after=5.0, on_paused=paused.append))
        await trio.sleep(1.0)
        autojump_clock.jump(4.0)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    assert paused == []
