"""Ranks that reach the coordinator through their node agent, which speaks for them.

A node agent (:mod:`flodl.agent`) ends each of its ranks' handshakes and frames itself and
carries their messages over its one connection (:class:`~flodl.wire.messages.RanksUp`,
:class:`~flodl.wire.messages.RanksDown`). Here each rank it carries is a :class:`CarriedRank`,
which the admission serves and the server reads and writes as it does a rank's own channel:
the agents' desk hands it the rank's messages as they arrive (:meth:`CarriedRank.deliver`),
and what the coordinator sends the rank is queued on the agent's :class:`Downlink`, which
leaves as one ``RanksDown`` frame per wake-up with a broadcast's payload in it once, however
many of the host's ranks it goes to. So the coordinator computes one MAC per host frame, not
one per rank message, both ways.

Guarantees: messages reach each side in order; a rank's end (its connection closed at the
agent, the agent gone, or the coordinator ending it) reaches the other side once. A downlink
whose agent cannot keep up (:data:`DOWNLINK_LIMIT` messages queued) breaks: every rank of that
agent fails as one with a broken socket would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import trio

from flodl.errors import BrokenChannel, FrameTooLarge
from flodl.transports.channel import Channel
from flodl.wire.codec import EncodedMessage, encode_message
from flodl.wire.fields import MAX_BLOB, MAX_ITEMS
from flodl.wire.messages import KillRank, Message, RankEnd, RanksDown

__all__ = ["DOWNLINK_LIMIT", "FRAME_BYTES", "CarriedRank", "Downlink", "DownlinkHub"]

DOWNLINK_LIMIT = 1 << 16
"""Messages queued for one agent's ranks before the agent is judged unable to keep up."""

FRAME_BYTES = 1 << 20
"""Payload bytes gathered into one ``RanksDown`` before the next frame is started."""

MessagesHandler = Callable[[list[Message], float], None]
EndHandler = Callable[[Exception | None], None]


class DownlinkHub:
    """Writes every agent's downlink from one task (:meth:`run`), once per scheduler step in
    which something was queued: a broadcast to thousands of ranks behind hundreds of agents
    costs one wake-up, not one per agent, and leaves as one frame per agent. A downlink whose
    connection cannot take its bytes at once is left to its own task (:meth:`Downlink.run`)."""

    def __init__(self) -> None:
        self._dirty: dict[Downlink, None] = {}
        self._wake = trio.Event()

    def mark(self, downlink: Downlink) -> None:
        """``downlink`` queued something: it is written at this task's next wake-up."""
        self._dirty[downlink] = None
        self._wake.set()

    async def run(self) -> None:
        """Write the marked downlinks without waiting, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            dirty, self._dirty = self._dirty, {}
            for downlink in dirty:
                downlink.write_nowait()


class _Queued:
    """One message queued for one rank: its tag and payload, and the object it came from (a
    broadcast's ``EncodedMessage`` is one object for every rank it goes to)."""

    __slots__ = ("payload", "rank", "source", "tag")

    def __init__(self, rank: int, source: object, tag: int, payload: bytes) -> None:
        self.rank = rank
        self.source = source
        self.tag = tag
        self.payload = payload


class Downlink:
    """What the coordinator sends one agent's ranks, queued and written as ``RanksDown``
    frames: by the :class:`DownlinkHub` when given one (at once, everything queued in a step),
    else, and whenever the connection cannot take the bytes at once, by its own task
    (:meth:`run`). Either way in order: the ranks' messages first, then the ends queued, then the
    kills."""

    def __init__(self, channel: Channel, hub: DownlinkHub | None = None) -> None:
        self._channel = channel
        self._hub = hub
        self._queue: deque[_Queued] = deque()
        self._ended: list[int] = []
        self._killed: list[int] = []
        self._wake = trio.Event()
        self._own_task_writes = hub is None
        """The hub leaves this downlink to :meth:`run` (no hub, or its writes must wait)."""
        self.broken: BaseException | None = None
        """Why the downlink failed (its ranks then fail too), or None."""

    def push(self, rank: int, messages: Sequence[Message | EncodedMessage]) -> None:
        """Queue ``messages`` for ``rank``; never waits. BrokenChannel once broken (or once the
        agent cannot keep up), FrameTooLarge for a message too large to carry (those before
        it are queued)."""
        if self.broken is not None:
            raise BrokenChannel(f"the agent's connection failed: {self.broken!r}")
        if len(self._queue) + len(messages) > DOWNLINK_LIMIT:
            self.broken = BrokenChannel(
                f"the agent cannot keep up ({DOWNLINK_LIMIT} messages queued for its ranks)"
            )
            raise self.broken
        try:
            for message in messages:
                encoded = (
                    message if isinstance(message, EncodedMessage) else encode_message(message)
                )
                tag, payload = encoded.message.TAG, encoded.payload
                if len(payload) > MAX_BLOB:
                    raise FrameTooLarge(
                        f"a {len(payload)}-byte message cannot travel through an agent (at most "
                        f"{MAX_BLOB} bytes)"
                    )
                self._queue.append(_Queued(rank, message, tag, payload))
        finally:
            self._queued()

    def end(self, rank: int) -> None:
        """Tell the agent the coordinator ended ``rank``'s connection (after what was queued)."""
        self._ended.append(rank)
        self._queued()

    def kill(self, rank: int) -> None:
        """Tell the agent to SIGKILL ``rank``'s process (the run declared it dead for silence),
        after what was queued."""
        self._killed.append(rank)
        self._queued()

    def _queued(self) -> None:
        if self._own_task_writes or self._hub is None:
            self._wake.set()
        else:
            self._hub.mark(self)

    def write_nowait(self) -> None:
        """Write what is queued if the connection takes it at once; what it does not take, and
        everything queued after it, is left to :meth:`run`. Never waits."""
        if self._own_task_writes or self.broken is not None:
            return
        if not self._queue and not self._ended and not self._killed:
            return
        if not self._channel.writes_now:  # an async send holds the channel: leave it queued
            written = False
        else:
            try:
                written = self._channel.send_nowait(self._take())
            except Exception as err:  # the channel's typed errors; the ranks report it
                self.broken = err
                written = False
        if not written:
            self._own_task_writes = True  # it flushes the rest (or returns, broken)
            self._wake.set()

    async def run(self) -> None:
        """Write what is left to this task until cancelled (all of it without a hub); on a
        failure record it in :attr:`broken` and return (the caller ends the agent's
        connection)."""
        try:
            while self.broken is None:
                await self._wake.wait()
                self._wake = trio.Event()
                await self._channel.flush()  # what a write without waiting left over
                while self._queue or self._ended or self._killed:
                    await self._channel.send_many(self._take())
                self._own_task_writes = self._hub is None
        except Exception as err:  # the channel's typed errors; the ranks report it
            self.broken = err

    def _take(self) -> list[Message]:
        """Everything queued, as frames: ``RanksDown`` within :data:`FRAME_BYTES`, then the
        ends, then the kills. A message queued for several ranks travels once, as long as no
        rank's order changes: a rank joins an earlier entry only if it has nothing queued after
        it."""
        out: list[Message] = []
        queue = self._queue
        while queue:
            entries: list[tuple[int, bytes, list[int]]] = []
            index_of: dict[int, int] = {}
            last_of: dict[int, int] = {}
            size = 0
            while queue and len(entries) < MAX_ITEMS:
                item = queue[0]
                at = index_of.get(id(item.source))
                if at is not None and last_of.get(item.rank, -1) < at:
                    entries[at][2].append(item.rank)
                else:
                    if entries and size + len(item.payload) > FRAME_BYTES:
                        break
                    at = len(entries)
                    entries.append((item.tag, item.payload, [item.rank]))
                    if isinstance(item.source, EncodedMessage):
                        index_of.setdefault(id(item.source), at)
                    size += len(item.payload)
                last_of[item.rank] = at
                queue.popleft()
            out.append(
                RanksDown(
                    tuple(tag for tag, _, _ in entries),
                    tuple(payload for _, payload, _ in entries),
                    tuple(len(ranks) for _, _, ranks in entries),
                    tuple(rank for _, _, ranks in entries for rank in ranks),
                )
            )
        ended, self._ended = self._ended, []
        out.extend(RankEnd(rank) for rank in ended)
        killed, self._killed = self._killed, []
        out.extend(KillRank(rank) for rank in killed)
        return out


class CarriedRank:
    """One rank its agent carries, as the server sees a rank's channel: it writes to it
    (:meth:`send_nowait`, :meth:`send_many`, :meth:`flush`, all through the agent's
    :class:`Downlink`) and is handed its messages (:meth:`attach`), never reads.

    What arrives before the server attaches is held and handed over on attaching; an end
    that comes first is handed over then too.
    """

    def __init__(self, rank: int, downlink: Downlink) -> None:
        self.rank = rank
        self._downlink = downlink
        self._on_messages: MessagesHandler | None = None
        self._on_end: EndHandler | None = None
        self._held: list[Message] = []
        self._end: tuple[Exception | None] | None = None
        """Why the rank's connection ended at the agent's side (set once), or None."""
        self._closed = False

    # --- what the agents' desk does -------------------------------------------------------

    def deliver(self, messages: list[Message], now: float) -> None:
        """``messages`` came from the rank (in order): hand them over, or hold them."""
        if self._end is not None:
            return
        if self._on_messages is not None:
            self._on_messages(messages, now)
        else:
            self._held.extend(messages)

    def ended(self, error: Exception | None) -> None:
        """The rank's connection ended at the agent, or the agent is gone (``error``)."""
        if self._end is not None:
            return
        self._end = (error,)
        if self._on_end is not None:
            self._on_end(error)

    # --- what the server does -------------------------------------------------------------

    def attach(self, on_messages: MessagesHandler, on_end: EndHandler) -> None:
        """Hand the rank's messages to ``on_messages`` from now on (what was held first) and
        its end to ``on_end``."""
        self._on_messages, self._on_end = on_messages, on_end
        held, self._held = self._held, []
        if held:
            on_messages(held, trio.current_time())
        if self._end is not None:
            on_end(self._end[0])

    def detach(self) -> None:
        """Hand nothing more over (the server is done with the rank)."""
        self._on_messages = self._on_end = None

    def send_nowait(self, messages: Sequence[Message | EncodedMessage]) -> bool:
        """Queue ``messages`` for the rank (always all of them: True). BrokenChannel once the
        rank's connection ended or its agent's failed."""
        self._check_open()
        self._downlink.push(self.rank, messages)
        return True

    async def send_many(self, messages: Sequence[Message | EncodedMessage]) -> None:
        """As :meth:`send_nowait` (a checkpoint)."""
        self.send_nowait(messages)
        await trio.lowlevel.checkpoint()

    async def flush(self) -> None:
        """Nothing is ever left unsent here (a checkpoint)."""
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        """End the rank's connection: the agent closes it once what was queued is written."""
        if not self._closed:
            self._closed = True
            if self._end is None and self._downlink.broken is None:
                self._downlink.end(self.rank)

    def _check_open(self) -> None:
        if self._closed:
            raise BrokenChannel(f"rank {self.rank}'s connection was closed")
        if self._end is not None:
            raise BrokenChannel(f"rank {self.rank}'s connection through its agent ended")
