"""The agent's end of its ranks' connections: it answers their handshakes and speaks for them.

Each rank connects to a Unix socket of the agent (``FLODL_COORDINATOR`` points there) as it
would to a coordinator, and the agent answers as the coordinator would, with the run's key: a
rank this node does not run is refused (AgentRefused: no reply), one already connected is told
DuplicateRank. The agent then reads the rank's frames (authenticated and in order, as the
coordinator checks them) and queues each message to go up in its next
:class:`~flodl.wire.messages.RanksUp` (:mod:`flodl.agent.link`), beside its other ranks'. A
rank whose message names another rank id is let go, as the coordinator lets a lying rank go.
What comes down for a rank is framed for it here; each rank has a writer task of its own, so a
rank that reads slowly holds up no other.

Guarantees: messages keep their order each way; a rank's connection that ends is reported up
once (``RankClosed``), after its last message; a rank the coordinator ends is closed once what
was sent to it before is written; when the agent's connection ends every rank's connection is
closed, so each rank sees its coordinator gone at once.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import trio

from flodl.errors import AgentRefused, FlodlError, HandshakeTimeout, ProtocolError
from flodl.transports import open_listener
from flodl.transports.channel import Channel
from flodl.transports.errors import STREAM_ERRORS
from flodl.transports.greeting import SpentNonces, accept_rank
from flodl.wire.codec import EncodedMessage, encode_message
from flodl.wire.messages import Message, RankClosed, RankOpen

log = logging.getLogger("flodl.agent")

__all__ = ["HANDSHAKE_TIMEOUT", "OUTBOX_LIMIT", "RankSessions", "Said"]

REFUSALS: tuple[type[Exception], ...] = (FlodlError, *STREAM_ERRORS)
"""What ends one rank's connection attempt (a bad or slow handshake, a broken stream)."""

HANDSHAKE_TIMEOUT = 10.0
"""Seconds a rank has to complete its handshake with the agent."""

OUTBOX_LIMIT = 4096
"""Messages queued for one rank before it is judged too slow to keep up and let go."""


class Said:
    """One message a rank sent, queued to go up: its tag and its CBOR payload."""

    __slots__ = ("payload", "tag")

    def __init__(self, tag: int, payload: bytes) -> None:
        self.tag = tag
        self.payload = payload


Up = Callable[[Message | Said], None]
"""Queue something to go up to the coordinator (never waits)."""


class _Session:
    def __init__(self, rank: int, channel: Channel) -> None:
        self.rank = rank
        self.channel = channel
        self.pending: list[EncodedMessage] = []
        self.wake = trio.Event()
        self.ending = False
        """The coordinator ended it: close once what is pending is written."""
        self.scope = trio.CancelScope()


class RankSessions:
    """The node's ranks' connections to this agent, through a Unix socket of its own.

    ``ranks``: the ranks this node runs, of ``world_size``; ``key``: the run's key.
    """

    def __init__(self, up: Up, key: bytes, ranks: range, world_size: int) -> None:
        self._up = up
        self._key = key
        self._ranks = ranks
        self._world_size = world_size
        self._sessions: dict[int, _Session] = {}
        self._replayed = SpentNonces()
        self._held: set[int] = set()
        """Ranks with a connection from their handshake's verified hello to its end."""
        self._closed = False
        self._folder = Path(tempfile.mkdtemp(prefix="flodl-agent-"))
        self.url = f"unix://{self._folder / 'ranks.sock'}"
        """Where the ranks connect (their ``FLODL_COORDINATOR``)."""

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept the ranks' connections until cancelled; reports ``started`` once the socket
        listens (start the ranks after that). Closes every rank's connection and removes the
        socket when it ends, also when cancelled."""
        try:
            async with await open_listener(self.url) as listener, trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    stream = await listener.accept()
                    nursery.start_soon(self._serve, stream)
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)

    def down(self, rank: int, message: EncodedMessage) -> None:
        """Something the coordinator sent ``rank`` (dropped if its connection is gone)."""
        session = self._sessions.get(rank)
        if session is None or session.ending:
            return
        if len(session.pending) >= OUTBOX_LIMIT:
            log.warning("rank %d cannot keep up with its agent: letting it go", rank)
            session.scope.cancel()
            return
        session.pending.append(message)
        session.wake.set()

    def end(self, rank: int) -> None:
        """The coordinator ended ``rank``'s connection: close it once what is pending is
        written."""
        session = self._sessions.get(rank)
        if session is not None:
            session.ending = True
            session.wake.set()

    def close(self) -> None:
        """The agent's connection ended: close every rank's connection now (each sees its
        coordinator gone) and any that connects later."""
        self._closed = True
        for session in self._sessions.values():
            session.scope.cancel()

    def _claim(self, rank: int, claims: list[int]) -> bool:
        """True if ``rank`` is held already; else hold it for the connection whose ``claims``
        these are (called with nothing awaited before the decision: ids stay unique).
        AgentRefused if this node does not run it."""
        if rank not in self._ranks:
            raise AgentRefused(f"rank {rank} is not one of this node's ranks {self._ranks}")
        if rank in self._held:
            return True
        self._held.add(rank)
        claims.append(rank)
        return False

    async def _serve(self, stream: trio.abc.Stream) -> None:
        claims: list[int] = []
        try:
            await self._carry(stream, claims)
        finally:
            self._held.difference_update(claims)
            await trio.aclose_forcefully(stream)

    async def _carry(self, stream: trio.abc.Stream, claims: list[int]) -> None:
        try:
            with trio.move_on_after(HANDSHAKE_TIMEOUT) as deadline:
                rank, channel = await accept_rank(
                    stream,
                    self._key,
                    self._world_size,
                    taken=partial(self._claim, claims=claims),
                    replayed=self._replayed,
                )
            if deadline.cancelled_caught:
                raise HandshakeTimeout(
                    f"a rank did not complete its handshake within {HANDSHAKE_TIMEOUT} s"
                )
        except REFUSALS as err:
            log.warning("refused a rank's connection: %s: %s", type(err).__name__, err)
            return
        if self._closed:
            return
        session = self._sessions[rank] = _Session(rank, channel)
        self._up(RankOpen(rank))
        try:
            with session.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write, session, nursery.cancel_scope)
                    await self._read(session)
                    nursery.cancel_scope.cancel()
        finally:
            del self._sessions[rank]
            self._up(RankClosed(rank))

    async def _read(self, session: _Session) -> None:
        """Queue what the rank sends to go up, until its connection ends or it lies."""
        rank, up = session.rank, self._up
        while True:
            try:
                batch = await session.channel.receive_batch()
            except ProtocolError as err:
                log.warning("rank %d sent a bad frame: %s", rank, err)
                return
            except FlodlError:  # its connection ended (or broke)
                return
            for message in batch:
                claimed = getattr(message, "rank", rank)
                if claimed != rank:
                    log.warning(
                        "rank %d sent %s claiming to be rank %d: letting it go",
                        rank,
                        type(message).__name__,
                        claimed,
                    )
                    return
                up(Said(message.TAG, encode_message(message).payload))

    async def _write(self, session: _Session, carrying: trio.CancelScope) -> None:
        channel = session.channel
        try:
            while True:
                await session.wake.wait()
                session.wake = trio.Event()
                while session.pending:
                    pending: Sequence[EncodedMessage]
                    pending, session.pending = session.pending, []
                    await channel.send_many(pending)
                if session.ending:
                    break
        except FlodlError:
            pass  # its connection broke: it ends
        carrying.cancel()  # the rank's connection ends (read side too)
