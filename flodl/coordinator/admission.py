"""Rank admission: accept connections, run each handshake under a deadline, hand ranks over.

:func:`serve_ranks` is the coordinator's front door. Every connection is its own task, so a
slow, silent or hostile peer delays nobody: it is dropped when its handshake deadline passes
or its first bad byte arrives, the reason is reported, and the accept loop and the other
ranks carry on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol

import trio

from flodl.coordinator.carried import CarriedRank
from flodl.errors import ConfigError, DuplicateRank, FlodlError, HandshakeTimeout
from flodl.transports.channel import Channel
from flodl.transports.errors import STREAM_ERRORS
from flodl.transports.greeting import SpentNonces, accept_peer
from flodl.wire.codec import DEFAULT_MAX_PAYLOAD
from flodl.wire.fields import MAX_TEXT
from flodl.wire.handshake import check_session_key, check_signature
from flodl.wire.messages import Abort

logger = logging.getLogger("flodl.coordinator.admission")

RankHandler = Callable[[int, Channel], Awaitable[None]]
"""``await handler(rank, channel)`` serves one admitted rank until it returns."""

CarriedHandler = Callable[[int, CarriedRank], Awaitable[None]]
"""``await carried_handler(rank, carried)`` serves one rank its node agent carries."""

AgentHandler = Callable[[int, Channel], Awaitable[None]]
"""``await agent_handler(node_rank, channel)`` serves one node agent until it returns."""

Carried = tuple[int, CarriedRank]
"""A rank its node agent carries (the agent checked its handshake and that it runs it)."""

RankErrorHandler = Callable[[int | None, BaseException], None]
"""``on_rank_error(rank or None, error)``: one connection failed (rank None: before it had one)."""

_CONNECTION_ERRORS: tuple[type[Exception], ...] = (FlodlError, *STREAM_ERRORS)


class AcceptsStreams(Protocol):
    """Anything with ``await accept() -> trio.abc.Stream`` (flodl listeners, trio listeners)."""

    async def accept(self) -> trio.abc.Stream: ...


def _sole_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception inside nested groups, or the group itself if there are several."""
    leaves: list[BaseException] = []

    def collect(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                collect(inner)
        else:
            leaves.append(error)

    collect(group)
    return leaves[0] if len(leaves) == 1 else group


def _log_rank_error(rank: int | None, error: BaseException) -> None:
    who = "a connection" if rank is None else f"rank {rank}"
    logger.warning("dropped %s: %s: %s", who, type(error).__name__, error)


async def serve_ranks(
    listener: AcceptsStreams,
    key: bytes,
    world_size: int,
    handler: RankHandler,
    *,
    signature: bytes | None = None,
    handshake_timeout: float = 10.0,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    on_rank_error: RankErrorHandler | None = None,
    agent_handler: AgentHandler | None = None,
    carried: trio.MemoryReceiveChannel[Carried] | None = None,
    carried_handler: CarriedHandler | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Admit ranks from ``listener`` and run ``await handler(rank, channel)`` for each.

    With ``agent_handler``, node agents are admitted too (their own hello flag), each node
    rank held by one connection at a time as ranks are, and served by
    ``await agent_handler(node_rank, channel)``; their errors are reported as a rank's, with
    the rank None. Without it an agent's hello is refused (ProtocolError).

    ``carried`` brings the ranks that reach the coordinator through their node agent
    (:mod:`flodl.coordinator.carried`), whose handshakes the agent checked: each holds its rank
    id as a connection does (a rank held already is told why, Abort, and ended:
    DuplicateRank), then is served by ``await carried_handler(rank, carried_rank)``.

    Each connection runs in its own task: the handshake must finish within
    ``handshake_timeout`` seconds (else HandshakeTimeout); a rank id is held from the moment
    its hello verifies until its handler returns, so a second connection claiming it is
    refused with DuplicateRank. A hello whose nonce was already accepted (a recorded hello
    sent again) is refused unanswered with ReplayedHello, so it cannot hold a rank id. Any
    FlodlError or broken-stream error of one connection (handshake or handler; also an
    exception group holding only such errors, reported unwrapped when it holds just one)
    closes that connection and is reported as
    ``on_rank_error(rank or None, error)`` (default: logged as a warning); it never disturbs
    the accept loop or the other ranks. Any other exception from a handler is a bug: it
    propagates and cancels everything.

    Streams are always closed, also when cancelled. Signals ``task_status.started()`` once the
    accept loop runs. Runs until cancelled; if the listener is closed (``ClosedResourceError``
    from ``accept``) it stops accepting and returns once the admitted ranks' handlers return.
    """
    check_session_key(key)
    signature = check_signature(signature)
    if handshake_timeout <= 0:
        raise ConfigError(f"handshake_timeout must be > 0, got {handshake_timeout}")
    if carried is not None and carried_handler is None:
        raise ConfigError("carried ranks need a carried_handler")
    report = on_rank_error or _log_rank_error
    held: set[int] = set()
    held_nodes: set[int] = set()
    replayed = SpentNonces()
    """Nonces of every hello that verified: a second use is a replay."""

    async def serve_connection(stream: trio.abc.Stream) -> None:
        claims: list[tuple[set[int], int]] = []
        """What this connection holds (the set and the id in it), released when it ends."""

        def claim(ids: set[int], wanted: int) -> bool:
            """True if ``wanted`` is held already; else hold it for this connection."""
            if wanted in ids:
                return True
            ids.add(wanted)
            claims.append((ids, wanted))
            return False

        def claimed_rank() -> int | None:
            """The rank this connection holds (None: none, or it is an agent's)."""
            return next((wanted for ids, wanted in claims if ids is held), None)

        try:
            with trio.move_on_after(handshake_timeout) as deadline:
                hello, channel = await accept_peer(
                    stream,
                    key,
                    world_size,
                    signature,
                    taken=partial(claim, held),
                    agent_taken=None if agent_handler is None else partial(claim, held_nodes),
                    replayed=replayed,
                    max_payload=max_payload,
                )
            if deadline.cancelled_caught:
                raise HandshakeTimeout(
                    f"peer did not complete the handshake within {handshake_timeout} s"
                )
            if hello.agent and agent_handler is not None:
                await agent_handler(hello.rank, channel)
            else:
                await handler(hello.rank, channel)
        except _CONNECTION_ERRORS as err:
            report(claimed_rank(), err)
        except BaseExceptionGroup as group:
            # A handler with its own nursery raises groups: one made only of connection
            # errors is still this connection's failure; anything else in it propagates.
            if group.split(_CONNECTION_ERRORS)[1] is not None:
                raise
            report(claimed_rank(), _sole_leaf(group))
        finally:
            for ids, wanted in claims:
                ids.discard(wanted)
            await trio.aclose_forcefully(stream)

    async def serve_carried(rank: int, channel: CarriedRank) -> None:
        try:
            if rank in held:
                raise DuplicateRank(f"rank {rank} is already connected")
            held.add(rank)
            try:
                assert carried_handler is not None  # checked on entry
                await carried_handler(rank, channel)
            finally:
                held.discard(rank)
        except DuplicateRank as err:
            report(None, err)
            with contextlib.suppress(FlodlError):
                channel.send_nowait([Abort(reason=str(err)[:MAX_TEXT])])
        except _CONNECTION_ERRORS as err:
            report(rank, err)
        except BaseExceptionGroup as group:
            if group.split(_CONNECTION_ERRORS)[1] is not None:
                raise
            report(rank, _sole_leaf(group))
        finally:
            await channel.aclose()

    taking_carried = trio.CancelScope()

    async def take_carried(arriving: trio.MemoryReceiveChannel[Carried]) -> None:
        with taking_carried:
            async for rank, channel in arriving:
                nursery.start_soon(serve_carried, rank, channel)

    async with trio.open_nursery() as nursery:
        if carried is not None:
            nursery.start_soon(take_carried, carried)
        task_status.started()
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                taking_carried.cancel()  # no new rank from anywhere; the admitted go on
                return
            nursery.start_soon(serve_connection, stream)
