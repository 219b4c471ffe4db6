"""memory:// read by one task: MemoryStream's non-waiting reads and writes and its readable
hook, and MemoryReader (in order per channel, one wake-up for what lands in one step, the
fault plan's latency and partition honoured without polling, bad input and ends typed as for
sockets, passes capped, closing unhooks every stream).

Raw frames are written by the real encoder onto the far end of real memory streams; every
timed test runs under MockClock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import pytest
import trio
from trio.testing import MockClock

from flodl.errors import (
    AuthenticationError,
    BrokenChannel,
    ProtocolError,
    SequenceError,
    TruncatedFrame,
    WireError,
)
from flodl.transports.channel import Channel
from flodl.transports.channel_reader import PASS_MESSAGES, READ_BYTES
from flodl.transports.memory_reader import MemoryReader
from flodl.transports.memory_stream import FaultPlan, Link, MemoryStream, memory_stream_pair
from flodl.wire.codec import FrameEncoder, encode_message
from flodl.wire.messages import FROM_AGENT_TAGS, TO_COORDINATOR_TAGS, Heartbeat, Message, RanksUp

from .reader_log import ReaderLog

UP = b"memory-reader-test-key-upward-00"


def beat(rank: int, step: int) -> Heartbeat:
    return Heartbeat(rank=rank, step_count=step)


@attrs.define(eq=False)
class Far:
    """The sending end of one watched channel and the encoder of its frames."""

    stream: MemoryStream
    channel: Channel
    encoder: FrameEncoder = attrs.field(factory=lambda: FrameEncoder(UP))

    def send(
        self, messages: Sequence[Message], extra: Callable[[Far], bytes] | None = None
    ) -> None:
        """Queue the frames of ``messages`` (then ``extra(self)``) now, in one write."""
        data = b"".join(self.encoder.encode(m) for m in messages)
        if extra is not None:
            data += extra(self)
        assert self.stream.send_nowait(data) == len(data)


def far_end(link: Link | None = None, tags: frozenset[int] = TO_COORDINATOR_TAGS) -> Far:
    far, near = memory_stream_pair(link)
    channel = Channel(near, send_key=b"x" * 32, receive_key=UP, receive_tags=tags)
    return Far(far, channel)


@asynccontextmanager
async def reading(fars: list[Far]) -> AsyncIterator[tuple[MemoryReader, ReaderLog]]:
    reader = MemoryReader()
    seen = ReaderLog()
    for index, far in enumerate(fars):
        reader.add(far.channel, *seen.handlers(index))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader.run, seen.after_pass)
        await trio.testing.wait_all_tasks_blocked()
        yield reader, seen
        nursery.cancel_scope.cancel()


# --- the stream ------------------------------------------------------------------------------


async def test_receive_nowait_takes_what_is_due_and_never_waits(autojump_clock: MockClock) -> None:
    link = Link(FaultPlan(latency=0.5))
    far, near = memory_stream_pair(link)
    with pytest.raises(trio.WouldBlock):
        near.receive_nowait()
    assert near.receivable_at() == float("inf")
    sent_at = trio.current_time()
    assert far.send_nowait(b"abc") == 3
    with pytest.raises(trio.WouldBlock):  # in flight for 0.5 s
        near.receive_nowait()
    assert near.receivable_at() == sent_at + 0.5
    await trio.sleep_until(sent_at + 0.5)
    assert near.receivable_at() == sent_at + 0.5 <= trio.current_time()
    assert near.receive_nowait(2) == b"ab"
    assert near.receive_nowait() == b"c"
    link.set_plan(FaultPlan(partitioned=True))
    far.send_nowait(b"held")
    await trio.sleep(1.0)
    with pytest.raises(trio.WouldBlock):
        near.receive_nowait()
    assert near.receivable_at() == float("inf")
    link.set_plan(FaultPlan())
    assert near.receive_nowait() == b"held"
    await far.aclose()
    assert near.receive_nowait() == b""
    assert near.receive_nowait() == b""  # the end stays the end
    await near.aclose()
    with pytest.raises(trio.ClosedResourceError):
        near.receive_nowait()


async def test_a_cut_is_read_after_what_came_before_it() -> None:
    link = Link(FaultPlan(cut_after_bytes=5))
    far, near = memory_stream_pair(link)
    with pytest.raises(trio.BrokenResourceError):
        far.send_nowait(b"1234567")  # queues 5 bytes, then cuts
    assert near.receive_nowait() == b"12345"
    with pytest.raises(trio.BrokenResourceError):
        near.receive_nowait()
    with pytest.raises(trio.BrokenResourceError):
        far.send_nowait(b"x")


async def test_send_nowait_takes_all_or_nothing_and_refuses_after_closing() -> None:
    far, near = memory_stream_pair(capacity=8)
    assert far.send_nowait(b"0123456789") == 10  # one write may pass the capacity
    assert far.send_nowait(b"more") == 0  # full: nothing taken
    assert near.receive_nowait() == b"0123456789"
    assert far.send_nowait(b"more") == 4
    await far.send_eof()
    with pytest.raises(trio.ClosedResourceError):
        far.send_nowait(b"x")
    other_far, other_near = memory_stream_pair()
    await other_near.aclose()
    with pytest.raises(trio.BrokenResourceError):  # the peer closed
        other_far.send_nowait(b"x")


async def test_the_readable_hook_hears_every_landing_and_plan_change() -> None:
    link = Link()
    far, near = memory_stream_pair(link)
    calls: list[str] = []
    near.set_readable_hook(lambda: calls.append("ready"))
    far.send_nowait(b"a")
    await far.send_all(b"b")
    assert calls == ["ready", "ready"]
    link.set_plan(FaultPlan(latency=0.1))
    assert calls == ["ready"] * 3
    await far.send_eof()
    assert calls == ["ready"] * 4
    near.set_readable_hook(None)
    link.set_plan(FaultPlan())
    assert calls == ["ready"] * 4  # unhooked: not told any more


# --- the reader ------------------------------------------------------------------------------


async def test_what_lands_in_one_step_is_read_in_one_pass_in_order(
    autojump_clock: MockClock,
) -> None:
    fars = [far_end() for _ in range(50)]
    async with reading(fars) as (_, seen):
        assert seen.passes == 0  # nothing landed: the reader is parked, not polling
        await trio.sleep(1.0)
        assert seen.passes == 0
        for index, far in enumerate(fars):  # fifty peers write in one step, no checkpoint
            far.send([beat(index, 0), beat(index, 1)])
        await trio.testing.wait_all_tasks_blocked()
        assert seen.passes == 1  # one wake-up for all of them
        for index, far in enumerate(fars):
            far.send([beat(index, 2)])
            await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked()
    assert seen.messages == {i: [beat(i, 0), beat(i, 1), beat(i, 2)] for i in range(50)}
    assert [index for index, *_ in seen.batches[:50]] == list(range(50))  # marked order
    assert seen.ends == {}


async def test_latency_is_honoured_at_the_exact_time_without_polling(
    autojump_clock: MockClock,
) -> None:
    link = Link(FaultPlan(latency=0.25))
    slow, fast = far_end(link), far_end()
    async with reading([slow, fast]) as (_, seen):
        start = trio.current_time()
        slow.send([beat(0, 0)])
        await trio.sleep(0.1)
        slow.send([beat(0, 1)])
        fast.send([beat(1, 0)])
        await trio.sleep(1.0)
        passes_before_quiet = seen.passes
        await trio.sleep(10.0)
        assert seen.passes == passes_before_quiet  # idle: no pass at all
    times = {(i, m): now for i, _, _, now in seen.batches for m in seen.messages[i]}
    assert [now - start for i, _, _, now in seen.batches if i == 0] == pytest.approx([0.25, 0.35])
    assert times[(1, beat(1, 0))] - start == pytest.approx(0.1)
    assert seen.messages == {0: [beat(0, 0), beat(0, 1)], 1: [beat(1, 0)]}


async def test_a_partition_holds_messages_until_it_heals(autojump_clock: MockClock) -> None:
    link = Link(FaultPlan(partitioned=True))
    far = far_end(link)
    async with reading([far]) as (_, seen):
        far.send([beat(0, 0)])
        await trio.sleep(5.0)
        assert seen.messages == {}
        healed_at = trio.current_time()
        link.set_plan(FaultPlan())
        await trio.testing.wait_all_tasks_blocked()
    assert seen.messages == {0: [beat(0, 0)]}
    assert seen.batches[0][3] == healed_at


async def test_a_channel_added_to_a_parked_reader_is_read_for_what_had_landed(
    autojump_clock: MockClock,
) -> None:
    early, late = far_end(), far_end(Link(FaultPlan(latency=0.5)))
    async with reading([]) as (reader, seen):
        early.send([beat(0, 0)])
        late.send([beat(1, 0)])
        sent_at = trio.current_time()
        await trio.sleep(0.1)
        reader.add(early.channel, *seen.handlers(0))
        reader.add(late.channel, *seen.handlers(1))
        await trio.sleep(1.0)
    assert seen.messages == {0: [beat(0, 0)], 1: [beat(1, 0)]}
    assert [i for i, *_ in seen.batches] == [0, 1]
    assert [now - sent_at for *_, now in seen.batches] == pytest.approx([0.1, 0.5])


def _forged(far: Far) -> bytes:
    frame = bytearray(far.encoder.encode(beat(0, 99)))
    frame[-1] ^= 1
    return bytes(frame)


BAD_INPUT: dict[str, tuple[Callable[[Far], bytes], type[WireError]]] = {
    "garbage": (lambda far: b"\x00" * 64, ProtocolError),
    "forged": (_forged, AuthenticationError),
    "replayed": (lambda far: FrameEncoder(UP).encode(beat(0, 0)), SequenceError),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
async def test_bad_input_ends_that_channel_after_its_good_frames(case: str) -> None:
    make_bad, expected = BAD_INPUT[case]
    honest, bad = far_end(), far_end()
    good = [beat(1, step) for step in range(3)]
    async with reading([honest, bad]) as (reader, seen):
        bad.send(good, extra=make_bad)
        await trio.testing.wait_all_tasks_blocked()
        assert seen.messages[1] == good
        assert [type(e) for e in seen.ends[1]] == [expected]
        assert reader.channels == 1
        bad.send([beat(1, 7)])
        honest.send([beat(0, 0)])
        await trio.testing.wait_all_tasks_blocked()
    assert seen.messages == {0: [beat(0, 0)], 1: good}
    assert list(seen.ends) == [1]


async def test_end_of_stream_mid_frame_and_a_cut_end_each_channel_at_once(
    autojump_clock: MockClock,
) -> None:
    clean, truncated, cut = far_end(), far_end(), far_end(Link())
    async with reading([clean, truncated, cut]) as (reader, seen):
        clean.send([beat(0, 0)])
        await clean.stream.aclose()
        frame = truncated.encoder.encode(beat(1, 0))
        truncated.stream.send_nowait(frame[:-3])
        await truncated.stream.send_eof()
        cut.send([beat(2, 0)])
        cut_at = trio.current_time()
        cut.stream._outgoing.reset()  # what a cut_after_bytes plan does to a connection
        await trio.testing.wait_all_tasks_blocked()
        assert reader.channels == 0
    assert seen.messages == {0: [beat(0, 0)], 2: [beat(2, 0)]}
    assert seen.ends[0] == [None]
    assert [type(e) for e in seen.ends[1]] == [TruncatedFrame]
    assert [type(e) for e in seen.ends[2]] == [BrokenChannel]
    assert seen.batches[-1][3] == cut_at


async def test_flooding_channels_cannot_starve_a_quiet_one_and_passes_are_capped() -> None:
    floods = [far_end() for _ in range(4)]
    quiet = far_end()
    frame_size = len(FrameEncoder(UP).encode(beat(0, 0)))
    per_read = READ_BYTES // frame_size
    flooded = {i: [beat(i, step) for step in range(1000)] for i in range(4)}
    async with reading([*floods, quiet]) as (_, seen):
        for i, far in enumerate(floods):
            far.send(flooded[i])  # far more than one read's worth each
        quiet.send([beat(9, 0)])
        await trio.testing.wait_all_tasks_blocked()
    assert {i: seen.messages[i] for i in range(4)} == flooded
    order = [index for index, *_ in seen.batches]
    first_repeat = next(n for n, index in enumerate(order) if index in order[:n])
    assert order.index(4) < first_repeat  # every ready channel read once before any twice
    per_pass: dict[int, int] = {}
    for _, size, done, _ in seen.batches:
        assert size <= per_read
        per_pass[done] = per_pass.get(done, 0) + size
    assert max(per_pass.values()) <= PASS_MESSAGES + per_read
    assert len(per_pass) >= 4 * 1000 // (PASS_MESSAGES + per_read)


async def test_a_pass_counts_the_ranks_messages_an_agents_frame_carries() -> None:
    """An agent's frame stands for its ranks' messages: a pass stops at PASS_MESSAGES of those,
    not of frames, so the timers run between agents as often as between ranks."""
    agents = [far_end(tags=FROM_AGENT_TAGS) for _ in range(4)]
    beats = [encode_message(beat(rank, 0)) for rank in range(32)]
    frame = RanksUp(tuple(b.message.TAG for b in beats), tuple(b.payload for b in beats))
    frames_per_read = READ_BYTES // len(FrameEncoder(UP).encode(frame))
    async with reading(agents) as (_, seen):
        for agent in agents:
            agent.send([frame] * 100)
        await trio.testing.wait_all_tasks_blocked()
    assert all(len(seen.messages[i]) == 100 for i in range(4))
    carried_per_pass: dict[int, int] = {}
    for _, size, done, _ in seen.batches:
        carried_per_pass[done] = carried_per_pass.get(done, 0) + size * frame.carried
    # One channel's read may finish past the cap, never a second one.
    assert max(carried_per_pass.values()) <= PASS_MESSAGES + frames_per_read * frame.carried
    assert len(carried_per_pass) >= 4 * 100 * 32 // (PASS_MESSAGES + frames_per_read * 32)


async def test_closing_while_running_stops_it_and_unhooks_every_stream() -> None:
    fars = [far_end() for _ in range(3)]
    reader = MemoryReader()
    seen = ReaderLog()
    for index, far in enumerate(fars):
        reader.add(far.channel, *seen.handlers(index))
    with pytest.raises(ValueError, match="already watched"):
        reader.add(fars[0].channel, *seen.handlers(0))

    async def run() -> None:
        with pytest.raises(trio.ClosedResourceError):
            await reader.run(seen.after_pass)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        reader.close()
    assert reader.closed and reader.channels == 0
    for index, far in enumerate(fars):
        assert far.channel.stream._incoming.readable.hook is None  # type: ignore[attr-defined]
        far.send([beat(index, 0)])  # the channels are their owners' and still work
        assert await far.channel.receive() == beat(index, 0)
    with pytest.raises(trio.ClosedResourceError):
        reader.add(far_end().channel, *seen.handlers(9))


async def test_it_watches_only_memory_channels() -> None:
    reader = MemoryReader()
    left, _ = trio.testing.memory_stream_pair()
    other = Channel(left, send_key=b"x" * 32, receive_key=UP, receive_tags=TO_COORDINATOR_TAGS)
    assert not MemoryReader.serves(other) and not reader.serves(other)
    with pytest.raises(ValueError, match="not a memory stream"):
        reader.add(other, *ReaderLog().handlers(0))
    assert MemoryReader.serves(far_end().channel)
