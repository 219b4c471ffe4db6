"""The coordinator's links to its ranks, and the writing of what its machine sends them.

A :class:`RankLink` is one admitted rank's connection as the shell sees it: its channel, the
cancel scope of the task that owns it, and what is queued for it. :class:`Links` holds the
open links by rank and carries out the machine's writing effects (``Send``, ``Broadcast``,
``Disconnect``):

* what the machine sends is queued per rank (:meth:`Links.enqueue`) and, once the effects of
  an event are carried out (:meth:`Links.flush`), written straight to each stream that takes it
  without waiting: one step for a whole broadcast rather than a task wake-up per rank. The
  rank's writer task (:meth:`Links.write_loop`) only sends what a stream could not take at
  once, so a slow rank never blocks a broadcast to the others;
* beyond :data:`FLUSH_CHUNK` ranks the rest is written by the flush task
  (:meth:`Links.flush_loop`), a chunk per scheduler step, so that what ranks send meanwhile (a
  round start's acks) is read between chunks rather than behind thousands of writes.

Guarantees: messages reach each rank in the order the machine decided them, whichever path
writes them; nothing but the two tasks ever waits (queueing, flushing and carrying out effects
return at once, so they are safe inside the machine's effect loop). A rank whose queue reaches
:data:`OUTBOX_LIMIT` or whose stream fails has its link's scope cancelled: its task ends it,
it never takes the coordinator down. A link closed (:meth:`Links.close`) drops what was still
queued for it. Cancellation: a writer task is cancelled with its link's scope (the connection
is ending, so a write cut short loses nothing that would have been read); the flush task only
with the coordinator, at a checkpoint between chunks.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import attrs
import trio

from flodl.core.coordinator.effects import Broadcast, Send
from flodl.core.coordinator.machine import Disconnect, Effect
from flodl.errors import HandshakeError, ProtocolError, TransportError, WireError
from flodl.transports.errors import STREAM_ERRORS
from flodl.wire.codec import EncodedMessage, encode_message
from flodl.wire.fields import MAX_TEXT
from flodl.wire.messages import Abort, Message

Outgoing = Message | EncodedMessage
"""What a rank's queue holds: a message, or one whose payload a broadcast encoded once."""

log = logging.getLogger("flodl.coordinator")

# What ends one rank's connection. Anything else (a CoordinatorError from the machine, say)
# is a bug of ours: it propagates and stops the coordinator rather than blaming the rank.
# A Channel maps stream errors to TransportError itself; a stream error that reaches here
# all the same still only ends the rank it came from.
CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    WireError,
    HandshakeError,
    TransportError,
    *STREAM_ERRORS,
)

OUTBOX_LIMIT = 4096
"""Messages queued for one rank before it is judged too slow to keep up and disconnected."""

ABORT_GRACE = 1.0
"""Seconds a rank being let go (Disconnect) has to take its Abort before its connection ends."""

FLUSH_CHUNK = 256
"""Links written in one scheduler step (a few ms of writes); a round start's writes to more
ranks are spread over steps (:meth:`Links.flush_loop`)."""


class RankWire(Protocol):
    """What a link writes to: a rank's :class:`~flodl.transports.channel.Channel`, or a
    :class:`~flodl.coordinator.carried.CarriedRank` its node agent carries."""

    def send_nowait(self, messages: Sequence[Outgoing]) -> bool: ...

    async def send_many(self, messages: Sequence[Outgoing]) -> None: ...

    async def flush(self) -> None: ...


@attrs.define(eq=False)
class RankLink:
    rank: int
    channel: RankWire
    scope: trio.CancelScope
    errors: list[BaseException] = attrs.field(factory=list)
    pending: list[Outgoing] = attrs.field(factory=list)
    """Messages for the rank not yet handed to its channel, in order."""
    writer_busy: bool = False
    """The writer task owns the channel's sending side (nothing is written around it)."""
    wake: trio.Event = attrs.field(factory=trio.Event)
    """Set when the writer has something to send."""
    closed: bool = False
    aborting: bool = False
    """Being let go: its Abort is queued, nothing more is sent or read, it ends once sent."""


def link_handlers(
    link: RankLink,
    handle_batch: Callable[[int, list[Message], float], None],
    stop_reading: Callable[[], None],
) -> tuple[Callable[[list[Message], float], None], Callable[[Exception | None], None]]:
    """What a shared reader or the agents' desk calls for ``link``'s messages (``handle_batch``
    feeds them to the machine) and for the end of its channel: a ProtocolError or the end
    cancels the link's scope, with the error on the link; ``stop_reading()`` makes them be
    called no more."""

    def ended(error: Exception | None) -> None:
        if error is not None:
            link.errors.append(error)
        link.scope.cancel()

    def on_messages(batch: list[Message], now: float) -> None:
        if link.scope.cancel_called:
            # Ended (disconnected, too slow) but its task has not run yet: a read loop would
            # read nothing more either.
            stop_reading()
            return
        try:
            handle_batch(link.rank, batch, now)
        except ProtocolError as err:
            stop_reading()
            ended(err)

    return on_messages, ended


class Links:
    """The open links by rank, and the writes to them (module docstring)."""

    def __init__(self) -> None:
        self.by_rank: dict[int, RankLink] = {}
        """The open links (read it; :meth:`open` and :meth:`close` change it)."""
        self._closed = trio.Event()
        """Set (and replaced) each time a link closes."""
        self._dirty: list[RankLink] = []
        """Links with pending messages, to be written once the current effects are done."""
        self._backlog: deque[RankLink] = deque()
        """Links left for the flush task (:meth:`flush_loop`), in the order they were dirty."""
        self._backlog_wake = trio.Event()
        self.version = 0
        """Counts the links opened and closed (tells a reader of :attr:`by_rank` it changed)."""

    def open(self, rank: int, channel: RankWire, scope: trio.CancelScope) -> RankLink:
        """The link of ``rank``'s new connection, served by the task that owns ``scope``; it
        replaces any link the rank had."""
        link = RankLink(rank, channel, scope)
        self.by_rank[rank] = link
        self.version += 1
        return link

    def close(self, link: RankLink) -> None:
        """``link``'s connection ended: nothing more is written to it, what was queued is
        dropped, and :meth:`wait_all_closed` hears of it."""
        if self.by_rank.get(link.rank) is link:
            del self.by_rank[link.rank]
            self.version += 1
        link.closed = True
        link.pending.clear()
        self._closed.set()
        self._closed = trio.Event()

    async def wait_all_closed(self) -> None:
        """Wait until no link is open."""
        while self.by_rank:
            await self._closed.wait()

    def apply(self, effects: Iterable[Effect]) -> None:
        """Carry out the writing ``effects`` in order (the others are left to the caller); a
        broadcast's payload is encoded once for all. Queues only: :meth:`flush` writes."""
        links = self.by_rank
        for effect in effects:
            if isinstance(effect, Send):
                link = links.get(effect.rank)
                if link is not None:
                    self.enqueue(link, effect.message)
            elif isinstance(effect, Broadcast):
                targets = links.keys() if effect.ranks is None else effect.ranks
                encoded: EncodedMessage | None = None
                for rank in list(targets):
                    link = links.get(rank)
                    if link is not None:
                        if encoded is None:
                            encoded = encode_message(effect.message)
                        self.enqueue(link, encoded)
            elif isinstance(effect, Disconnect):
                link = links.get(effect.rank)
                if link is not None:
                    self.let_go(link, effect.reason)

    def let_go(self, link: RankLink, reason: str) -> None:
        """Tell ``link``'s rank why it is let go (``Abort``, best effort), then end its
        connection: once the Abort is written, or after :data:`ABORT_GRACE` seconds."""
        if link.closed or link.aborting or link.scope.cancel_called:
            return
        self.enqueue(link, Abort(reason=reason[:MAX_TEXT]))
        link.aborting = True
        # Written by flush or the writer, which then end the link; this bounds the wait.
        link.scope.deadline = min(link.scope.deadline, trio.current_time() + ABORT_GRACE)

    def enqueue(self, link: RankLink, message: Outgoing) -> None:
        """Queue ``message`` for ``link``'s rank (written by :meth:`flush` or the writer)."""
        if link.closed or link.aborting or link.scope.cancel_called:
            return  # (cancelled: ending, so nothing more is queued and the warning is said once)
        pending = link.pending
        if len(pending) >= OUTBOX_LIMIT:
            log.warning(
                "rank %d cannot keep up (%d messages queued): disconnecting",
                link.rank,
                OUTBOX_LIMIT,
            )
            link.scope.cancel()
            return
        if not pending and not link.writer_busy:
            self._dirty.append(link)
        pending.append(message)

    def flush(self) -> None:
        """Write each queued link's messages now where its stream takes them without waiting
        (the first :data:`FLUSH_CHUNK` links; the flush task writes the others), and hand the
        rest to the link's writer task. Never waits."""
        if not self._dirty:
            return
        dirty, self._dirty = self._dirty, []
        if self._backlog:
            # The flush task is still writing: these go behind, so ranks are written in the
            # order their messages were decided.
            self._backlog.extend(dirty)
            return
        if len(dirty) > FLUSH_CHUNK:
            self._backlog.extend(dirty[FLUSH_CHUNK:])
            self._backlog_wake.set()
            dirty = dirty[:FLUSH_CHUNK]
        self._write_now(dirty)

    async def flush_loop(self) -> None:
        """Write the links :meth:`flush` left, :data:`FLUSH_CHUNK` per scheduler step; runs
        until cancelled."""
        while True:
            await self._backlog_wake.wait()
            self._backlog_wake = trio.Event()
            while self._backlog:
                await trio.lowlevel.checkpoint()  # what was read meanwhile goes first
                backlog = self._backlog
                chunk = [backlog.popleft() for _ in range(min(FLUSH_CHUNK, len(backlog)))]
                self._write_now(chunk)

    def _write_now(self, dirty: Iterable[RankLink]) -> None:
        for link in dirty:
            if link.closed or link.writer_busy or not link.pending:
                continue  # the writer sends what is pending once it is done
            batch, link.pending = link.pending, []
            try:
                if link.channel.send_nowait(batch):
                    if link.aborting:
                        link.scope.cancel()  # its Abort is sent
                    continue
            except trio.WouldBlock:
                link.pending[:0] = batch  # not sent: the writer sends it, in order
            except CONNECTION_ERRORS as err:
                link.errors.append(err)
                link.scope.cancel()
                continue
            link.wake.set()

    async def write_loop(self, link: RankLink) -> None:
        """``link``'s writer task: runs until cancelled, or until its stream fails (the error
        is recorded on the link and its scope cancelled)."""
        # Sends what the direct writes of flush could not: the rest of a partly written
        # write, and whatever queued meanwhile, in one write per wake-up.
        channel = link.channel
        try:
            while True:
                await link.wake.wait()
                link.wake = trio.Event()
                link.writer_busy = True
                try:
                    await channel.flush()
                    while link.pending:
                        batch, link.pending = link.pending, []
                        await channel.send_many(batch)
                    if link.aborting:
                        link.scope.cancel()  # its Abort is sent
                finally:
                    link.writer_busy = False
        except CONNECTION_ERRORS as err:
            link.errors.append(err)
            link.scope.cancel()


__all__ = [
    "ABORT_GRACE",
    "CONNECTION_ERRORS",
    "FLUSH_CHUNK",
    "OUTBOX_LIMIT",
    "Links",
    "Outgoing",
    "RankLink",
    "RankWire",
    "link_handlers",
]
