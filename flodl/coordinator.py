"""The coordinator's trio shell: listener, one task per rank, heartbeat, deadlines, effects.

All decisions are made by :class:`flodl.core.machine.CoordinatorMachine`; this module only moves
bytes and time into it and carries its effects out. One nursery owns every task:

* the admission server (handshake under a deadline, unique ranks; :mod:`flodl.admission`);
* per rank: a reader (frames -> machine) and a writer (an outbox -> frames), so a slow rank
  never blocks a broadcast to the others;
* the heartbeat task, which beats every ``heartbeat_interval`` whatever else is waiting;
* the deadline task, which sleeps in a cancel scope until the machine's next deadline
  (silence deaths, the window-completion ceiling, the stall ceiling, rendezvous retries).

A rank that sends bad input is disconnected and handled as dead; it never takes the
coordinator down. Usage::

    async with open_coordinator("tcp://127.0.0.1:0", world_size=3, key=key) as coord:
        print(coord.url)           # give this to the ranks
        outcome = await coord.wait_finished()
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import attrs
import trio

from flodl.admission import serve_ranks
from flodl.config import CoordinatorConfig, check_session_key
from flodl.core.effects import Broadcast, Send
from flodl.core.machine import CoordinatorMachine, Disconnect, Effect, Outcome, ResumeState
from flodl.core.timeline import Timeline
from flodl.errors import (
    ChannelClosed,
    CoordinatorError,
    HandshakeError,
    ProtocolError,
    TransportError,
    WireError,
)
from flodl.transports import open_listener
from flodl.transports.channel import Channel
from flodl.wire.codec import EncodedMessage, encode_message
from flodl.wire.messages import CoordHeartbeat, Message

_Outgoing = Message | EncodedMessage
"""What an outbox holds: a message, or one whose payload a broadcast encoded once for all."""

log = logging.getLogger("flodl.coordinator")

# What ends one rank's connection. Anything else (a CoordinatorError from the machine, say)
# is a bug of ours: it propagates and stops the coordinator rather than blaming the rank.
_CONNECTION_ERRORS = (
    WireError,
    HandshakeError,
    TransportError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)

OUTBOX_LIMIT = 4096
"""Messages queued for one rank before it is judged too slow to keep up and disconnected."""

HEARTBEAT_SLOTS = 16
"""The heartbeat interval is cut into this many slots; each rank beats in one of them."""


@attrs.define
class _RankLink:
    rank: int
    outbox: trio.MemorySendChannel[_Outgoing]
    scope: trio.CancelScope


class Coordinator:
    """A running coordinator; obtained from :func:`open_coordinator`."""

    def __init__(self, machine: CoordinatorMachine, config: CoordinatorConfig, url: str) -> None:
        self._machine = machine
        self._config = config
        self.url = url
        """The address ranks connect to (port 0 resolved)."""
        self._links: dict[int, _RankLink] = {}
        self._finished = trio.Event()
        self._deadline_scope: trio.CancelScope | None = None
        self._link_closed = trio.Event()
        self.rank_errors: list[tuple[int | None, BaseException]] = []
        """Every connection that ended in an error, in order (rank None: before the handshake)."""

    # --- public ---------------------------------------------------------------------------

    @property
    def machine(self) -> CoordinatorMachine:
        return self._machine

    @property
    def timeline(self) -> Timeline:
        return self._machine.timeline

    @property
    def connected_ranks(self) -> frozenset[int]:
        return frozenset(self._links)

    async def wait_finished(self) -> Outcome:
        """Wait until the run has ended (finished, stopped, or saved) and return how."""
        await self._finished.wait()
        return self._machine.outcome

    def report_exit(self, rank: int, returncode: int) -> None:
        """The launcher saw ``rank``'s process exit with ``returncode`` (feeds death detection)."""
        self._perform(self._machine.on_exit_reported(rank, returncode, trio.current_time()))

    def request_stop(self, save: bool = True) -> None:
        """End the run: save first (ShutdownWithSave(GRACEFUL)) or just shut down."""
        self._perform(self._machine.request_stop(trio.current_time(), save=save))

    # --- tasks ----------------------------------------------------------------------------

    async def serve_rank(self, rank: int, channel: Channel) -> None:
        """Run one admitted rank's connection until it closes; errors end only this rank.

        A bad frame, a broken stream or a rank that cannot keep up ends this connection: the
        machine hears of the disconnect at once, and the error is re-raised (unwrapped) for
        the admission server to report.
        """
        outbox_send, outbox_receive = trio.open_memory_channel[_Outgoing](OUTBOX_LIMIT)
        scope = trio.CancelScope()
        link = _RankLink(rank, outbox_send, scope)
        self._links[rank] = link
        errors: list[BaseException] = []
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write_loop, channel, outbox_receive, link, errors)
                    self._perform(self._machine.on_connect(rank, trio.current_time()))
                    try:
                        await self._read_loop(rank, channel)
                    except _CONNECTION_ERRORS as err:
                        errors.append(err)
                    nursery.cancel_scope.cancel()
        finally:
            if self._links.get(rank) is link:
                del self._links[rank]
            outbox_send.close()
            self._link_closed.set()
            self._link_closed = trio.Event()
            reason = f"{type(errors[0]).__name__}: {errors[0]}" if errors else "connection closed"
            self._perform(self._machine.on_disconnect(rank, trio.current_time(), reason))
        if errors:
            raise errors[0]

    async def _read_loop(self, rank: int, channel: Channel) -> None:
        # Every message already buffered is handled in one go: one clock read and one
        # deadline check per wake-up rather than per message (they arrived together).
        machine = self._machine
        while True:
            try:
                batch = await channel.receive_batch()
            except ChannelClosed:
                return
            now = trio.current_time()
            for message in batch:
                claimed = getattr(message, "rank", rank)
                if claimed != rank:
                    raise ProtocolError(
                        f"rank {rank} sent {type(message).__name__} claiming to be rank {claimed}"
                    )
                self._apply(machine.on_message(rank, message, now))
            self._after_effects()

    async def _write_loop(
        self,
        channel: Channel,
        outbox: trio.MemoryReceiveChannel[_Outgoing],
        link: _RankLink,
        errors: list[BaseException],
    ) -> None:
        # Whatever queued up while the last write was under way (a window's SyncNow,
        # SetGlobalStep and ExtendPartition, say) goes out in one write.
        try:
            async for message in outbox:
                batch = [message]
                while True:
                    try:
                        batch.append(outbox.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await channel.send_many(batch)
        except _CONNECTION_ERRORS as err:
            errors.append(err)
            link.scope.cancel()

    async def heartbeat_loop(self) -> None:
        """Beat every ``heartbeat_interval`` until the run ends; nothing else can delay it.

        Each rank gets one beat per interval, at a phase of its own: the interval is cut into
        :data:`HEARTBEAT_SLOTS` slots and rank ``r`` beats in slot ``r % HEARTBEAT_SLOTS``, so
        a large world is not sent (and does not answer) a thousand frames at one instant.
        """
        interval = self._config.heartbeat_interval
        world_size = self._machine.world_size
        beat = encode_message(CoordHeartbeat())
        started = trio.current_time()
        slot = 0
        while not self._finished.is_set():
            for rank in range(slot % HEARTBEAT_SLOTS, world_size, HEARTBEAT_SLOTS):
                link = self._links.get(rank)
                if link is not None:
                    self._enqueue(link, beat)
            slot += 1
            await trio.sleep_until(started + slot * interval / HEARTBEAT_SLOTS)

    async def deadline_loop(self) -> None:
        """Sleep until the machine's next deadline (moved earlier as events arrive), then tick."""
        while not self._finished.is_set():
            with trio.CancelScope(deadline=self._machine.next_deadline()) as scope:
                self._deadline_scope = scope
                await trio.sleep_forever()
            self._deadline_scope = None
            now = trio.current_time()
            self._perform(self._machine.on_tick(now))
            if self._machine.next_deadline() <= now and not self._finished.is_set():
                # A deadline the machine did not act on would spin this loop forever.
                raise CoordinatorError(
                    f"coordinator bug: deadline {self._machine.next_deadline()} not handled "
                    f"at {now}"
                )

    async def wait_all_hung_up(self) -> None:
        """Wait until no rank connection is open."""
        while self._links:
            await self._link_closed.wait()

    def on_rank_error(self, rank: int | None, error: BaseException) -> None:
        log.warning("rank %s disconnected: %s: %s", rank, type(error).__name__, error)
        self.rank_errors.append((rank, error))

    # --- effects --------------------------------------------------------------------------

    def _perform(self, effects: Iterable[Effect]) -> None:
        self._apply(effects)
        self._after_effects()

    def _apply(self, effects: Iterable[Effect]) -> None:
        """Carry out ``effects`` in order; a broadcast's payload is encoded once for all."""
        for effect in effects:
            if isinstance(effect, Send):
                link = self._links.get(effect.rank)
                if link is not None:
                    self._enqueue(link, effect.message)
            elif isinstance(effect, Broadcast):
                targets = self._links.keys() if effect.ranks is None else effect.ranks
                encoded: EncodedMessage | None = None
                for rank in list(targets):
                    link = self._links.get(rank)
                    if link is not None:
                        if encoded is None:
                            encoded = encode_message(effect.message)
                        self._enqueue(link, encoded)
            elif isinstance(effect, Disconnect):
                link = self._links.get(effect.rank)
                if link is not None:
                    link.scope.cancel()

    def _after_effects(self) -> None:
        """Notice the end of the run, and pull the deadline loop's wake-up earlier if needed."""
        if self._machine.finished and not self._finished.is_set():
            self._finished.set()
        scope = self._deadline_scope
        if scope is not None:
            deadline = self._machine.next_deadline()
            if deadline < scope.deadline:
                scope.deadline = deadline

    def _enqueue(self, link: _RankLink, message: _Outgoing) -> None:
        try:
            link.outbox.send_nowait(message)
        except trio.WouldBlock:
            log.warning(
                "rank %d cannot keep up (%d messages queued): disconnecting",
                link.rank,
                OUTBOX_LIMIT,
            )
            link.scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


@asynccontextmanager
async def open_coordinator(
    url: str,
    world_size: int,
    key: bytes,
    config: CoordinatorConfig | None = None,
    *,
    signature: bytes | None = None,
    local_ranks: frozenset[int] | None = None,
    seed: int = 0,
    linger: float = 5.0,
    resume: ResumeState | None = None,
) -> AsyncIterator[Coordinator]:
    """Listen on ``url`` and coordinate ``world_size`` ranks until the block exits.

    On exit from the block the coordinator waits up to ``linger`` seconds for ranks to hang up
    after the run ended, then cancels every task and closes the listener. Cancellation of the
    enclosing scope closes everything at once.
    """
    config = config or CoordinatorConfig()
    check_session_key(key)
    listener = await open_listener(url)
    machine = CoordinatorMachine(
        world_size,
        config,
        now=trio.current_time(),
        local_ranks=frozenset(range(world_size)) if local_ranks is None else local_ranks,
        seed=seed,
        resume=resume,
    )
    coordinator = Coordinator(machine, config, listener.url)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(coordinator.deadline_loop)
            nursery.start_soon(coordinator.heartbeat_loop)
            await nursery.start(
                _serve,
                listener,
                key,
                world_size,
                coordinator,
                signature,
                config.handshake_timeout,
            )
            yield coordinator
            with trio.move_on_after(linger):
                await coordinator.wait_finished()
                await coordinator.wait_all_hung_up()
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await listener.aclose()


async def _serve(
    listener: object,
    key: bytes,
    world_size: int,
    coordinator: Coordinator,
    signature: bytes | None,
    handshake_timeout: float,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    await serve_ranks(
        listener,  # type: ignore[arg-type]
        key,
        world_size,
        coordinator.serve_rank,
        signature=signature,
        handshake_timeout=handshake_timeout,
        on_rank_error=coordinator.on_rank_error,
        task_status=task_status,
    )


__all__ = ["Coordinator", "open_coordinator"]
