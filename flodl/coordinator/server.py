"""The coordinator's trio shell: listener, one task per rank, heartbeat, deadlines, effects.

All decisions are made by :class:`flodl.core.coordinator.machine.CoordinatorMachine`; this module
only moves bytes and time into it and carries its effects out. One nursery owns every task:

* the admission server (handshake under a deadline, unique ranks;
  :mod:`flodl.coordinator.admission`);
* per rank: a task that owns the connection (its cancel scope ends it) with a writer, so a
  slow rank never blocks a broadcast to the others. What the machine sends is queued per
  rank and, once the effects of an event are carried out, written straight to each stream
  that takes it without waiting (one step for a whole broadcast rather than a task wake-up
  per rank); the writer only sends what a stream could not take at once. Beyond
  :data:`FLUSH_CHUNK` ranks the rest is written by the flush task, a chunk per scheduler
  step, so that what ranks send meanwhile (a round start's acks) is read between chunks
  rather than behind thousands of writes;
* reading: ranks are read by one shared
  :class:`~flodl.transports.channel_reader.ChannelReader` per kind of stream, started with
  the first rank it serves (:func:`~flodl.transports.readers.reader_for` says which kind
  serves a channel): one trio wake-up serves every channel readable at that moment, where a
  reader task per rank costs a wake-up per channel for about two messages (at 1,024 ranks
  that wake-up is most of the coordinator's cost per message; the figures are in
  docs/benchmarks.md). A channel no kind serves keeps a read loop of its own. Every path
  hands the machine the same messages in the same order, at the time they were read, and
  ends a rank the same way;
* the heartbeat task, which beats every ``heartbeat_interval`` whatever else is waiting;
* the deadline task, which sleeps in a cancel scope until the machine's next deadline
  (silence deaths, the window-completion ceiling, the stall ceiling, rendezvous retries).

An observer may time every call the shell makes to its machine with a probe
(:mod:`flodl.coordinator.probe`); the probe sees, it cannot steer.

A coordinator that owns its process (``freeze_heap=True``: ``flodl run`` and ``flodl
coordinator`` pass it) moves every object alive when training starts into Python's permanent
GC generation (:func:`gc.freeze`, after one full collection). What it holds per rank is built by
then and lives as long as the run; left in the oldest generation, each full collection walked
all of it, which at 4,096 ranks stalled every task for hundreds of milliseconds. The heap is
unfrozen when the coordinator closes.

A rank that sends bad input is disconnected and handled as dead; it never takes the
coordinator down. Usage::

    async with open_coordinator("tcp://127.0.0.1:0", world_size=3, key=key) as coord:
        print(coord.url)           # give this to the ranks
        outcome = await coord.wait_finished()
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from functools import partial

import attrs
import trio

from flodl.config import CoordinatorConfig
from flodl.coordinator.admission import serve_ranks
from flodl.coordinator.probe import MachineEvent, ShellProbe, report_failed
from flodl.core.coordinator.effects import Broadcast, Send
from flodl.core.coordinator.machine import (
    CoordinatorMachine,
    Disconnect,
    Effect,
    Outcome,
    ResumeState,
    RunPhase,
)
from flodl.core.coordinator.record import RunRecord
from flodl.core.coordinator.timeline import EventKind, Timeline, TimelineEvent
from flodl.errors import (
    ChannelClosed,
    CoordinatorError,
    HandshakeError,
    ProtocolError,
    TransportError,
    WireError,
)
from flodl.supervise.exits import RankExit
from flodl.transports import open_listener
from flodl.transports.channel import Channel
from flodl.transports.channel_reader import ChannelReader
from flodl.transports.errors import STREAM_ERRORS
from flodl.transports.readers import reader_for
from flodl.wire.codec import EncodedMessage, encode_message
from flodl.wire.fields import MAX_TEXT
from flodl.wire.handshake import check_session_key
from flodl.wire.messages import Abort, CoordHeartbeat, Message, RunSettings

_Outgoing = Message | EncodedMessage
"""What a rank's queue holds: a message, or one whose payload a broadcast encoded once."""

log = logging.getLogger("flodl.coordinator")

EventSink = Callable[[int, TimelineEvent], None]
"""Takes each timeline event with its sequence number (:meth:`Coordinator.add_event_sink`)."""

# What ends one rank's connection. Anything else (a CoordinatorError from the machine, say)
# is a bug of ours: it propagates and stops the coordinator rather than blaming the rank.
# A Channel maps stream errors to TransportError itself; a stream error that reaches here
# all the same still only ends the rank it came from.
_CONNECTION_ERRORS: tuple[type[Exception], ...] = (
    WireError,
    HandshakeError,
    TransportError,
    *STREAM_ERRORS,
)

OUTBOX_LIMIT = 4096
"""Messages queued for one rank before it is judged too slow to keep up and disconnected."""

ABORT_GRACE = 1.0
"""Seconds a rank being let go (Disconnect) has to take its Abort before its connection ends."""

HEARTBEAT_SLOTS = 16
"""The heartbeat interval is cut into this many slots; each rank beats in one of them."""

FLUSH_CHUNK = 256
"""Links written in one scheduler step (a few ms of writes); a round start's writes to more
ranks are spread over steps (:meth:`Coordinator.flush_loop`)."""


@attrs.define(eq=False)
class _RankLink:
    rank: int
    channel: Channel
    scope: trio.CancelScope
    errors: list[BaseException] = attrs.field(factory=list)
    pending: list[_Outgoing] = attrs.field(factory=list)
    """Messages for the rank not yet handed to its channel, in order."""
    writer_busy: bool = False
    """The writer task owns the channel's sending side (nothing is written around it)."""
    wake: trio.Event = attrs.field(factory=trio.Event)
    """Set when the writer has something to send."""
    closed: bool = False
    aborting: bool = False
    """Being let go: its Abort is queued, nothing more is sent or read, it ends once sent."""


class Coordinator:
    """A running coordinator; obtained from :func:`open_coordinator`."""

    def __init__(
        self,
        machine: CoordinatorMachine,
        config: CoordinatorConfig,
        url: str,
        *,
        freeze_heap: bool = False,
        probe: ShellProbe | None = None,
    ) -> None:
        self._machine = machine
        self._probe = probe
        self._config = config
        self._freeze_heap = freeze_heap
        self.heap_frozen = False
        """The heap was frozen when training started (module docstring)."""
        self.url = url
        """The address ranks connect to (port 0 resolved)."""
        self._links: dict[int, _RankLink] = {}
        self._finished = trio.Event()
        self._deadline_scope: trio.CancelScope | None = None
        self._link_closed = trio.Event()
        self._dirty: list[_RankLink] = []
        """Links with pending messages, to be written once the current effects are done."""
        self._backlog: deque[_RankLink] = deque()
        """Links left for the flush task (:meth:`flush_loop`), in the order they were dirty."""
        self._backlog_wake = trio.Event()
        self.rank_errors: list[tuple[int | None, BaseException]] = []
        """Every connection that ended in an error, in order (rank None: before the handshake)."""
        self._tasks: trio.Nursery | None = None
        """Where the shared readers' tasks run (the coordinator's nursery)."""
        self._readers: dict[type[ChannelReader], ChannelReader] = {}
        self.run_settings = RunSettings(
            policy=config.policy.value,
            seed=machine.seed,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_timeout=config.heartbeat_timeout,
            backend=config.backend,
            keep_checkpoints=config.keep_checkpoints or 0,
        )
        """Sent to each rank first: the settings a worker takes from its coordinator."""
        self._sinks: list[EventSink] = []
        self._published = 0
        """Sequence number of the first timeline event no sink has been handed yet."""

    # --- public ---------------------------------------------------------------------------

    @property
    def machine(self) -> CoordinatorMachine:
        return self._machine

    @property
    def started_at(self) -> float:
        """Trio time the run's clock starts from: the machine's creation, which its deadlines
        (the join timeout first) count from."""
        return self._machine.created_at

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

    def add_event_sink(self, sink: EventSink) -> None:
        """Hand ``sink`` every timeline event, with its sequence number: the ones so far at
        once, then each as the machine records it, right after the effects that made it.

        A sink must not block or raise (queue and return): it is called inside the machine's
        effect loop, so whatever it does delays every round.
        """
        for seq, event in self._machine.timeline.since(0):
            if seq < self._published:
                sink(seq, event)
        self._sinks.append(sink)

    @property
    def record(self) -> RunRecord:
        """What the machine publishes about the run (read-only; final once it finished)."""
        return self._machine

    @property
    def run_ended(self) -> bool:
        """The run is over (:class:`~flodl.supervise.exits.ExitSink`)."""
        return self._machine.finished

    def rank_exited(self, exit: RankExit) -> list[str]:
        """A supervisor saw a rank's process exit (:class:`~flodl.supervise.exits.ExitSink`):
        the machine hears of it at once (no heartbeat wait). Returns what a person should hear
        of it (the run going on without a rank that died before joining)."""
        timeline, now = self._machine.timeline, trio.current_time()
        before = len(timeline)
        effects = self._call(
            "exit_reported",
            exit.rank,
            now,
            lambda: self._machine.on_exit_reported(
                exit.rank, exit.returncode, now, restarting=exit.restarting
            ),
        )
        self._perform(effects)
        return [
            f"{event.detail['why']}; the run goes on with ranks {event.detail['ranks']}"
            for event in list(timeline)[before:]
            if event.kind is EventKind.GOING_ON_WITHOUT
        ]

    def request_stop(self, save: bool = True) -> None:
        """End the run: save first (ShutdownWithSave(GRACEFUL)) or just shut down."""
        now = trio.current_time()
        self._perform(
            self._call("stop", None, now, lambda: self._machine.request_stop(now, save=save))
        )

    def set_probe(self, probe: ShellProbe | None) -> None:
        """Report every machine call from now on to ``probe`` (None: to nobody); what it is
        told and why it cannot change the run: :mod:`flodl.coordinator.probe`."""
        self._probe = probe

    # --- tasks ----------------------------------------------------------------------------

    async def serve_rank(self, rank: int, channel: Channel) -> None:
        """Run one admitted rank's connection until it closes; errors end only this rank.

        A bad frame, a broken stream or a rank that cannot keep up ends this connection: the
        machine hears of the disconnect at once, and the error is re-raised (unwrapped) for
        the admission server to report. On return the channel is no longer read.
        """
        scope = trio.CancelScope()
        link = _RankLink(rank, channel, scope)
        self._links[rank] = link
        errors = link.errors
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write_loop, link)
                    self._enqueue(link, self.run_settings)
                    now = trio.current_time()
                    connect = partial(self._machine.on_connect, rank, now)
                    self._perform(self._call("connect", rank, now, connect))
                    reader = self._shared_reader(channel)
                    if reader is not None:
                        try:
                            reader.add(channel, *self._reader_handlers(link, reader))
                            await trio.sleep_forever()  # until the reader or anyone ends it
                        finally:
                            reader.discard(channel)
                    else:
                        try:
                            await self._read_loop(rank, channel)
                        except _CONNECTION_ERRORS as err:
                            errors.append(err)
                        nursery.cancel_scope.cancel()
        finally:
            if self._links.get(rank) is link:
                del self._links[rank]
            link.closed = True
            link.pending.clear()
            self._link_closed.set()
            self._link_closed = trio.Event()
            reason = f"{type(errors[0]).__name__}: {errors[0]}" if errors else "connection closed"
            now = trio.current_time()
            self._perform(
                self._call(
                    "disconnect", rank, now, lambda: self._machine.on_disconnect(rank, now, reason)
                )
            )
        if errors:
            raise errors[0]

    def _shared_reader(self, channel: Channel) -> ChannelReader | None:
        """The shared reader for ``channel``'s kind of stream, started on first use; None if
        no kind of shared reader serves it."""
        kind = reader_for(channel)
        if kind is None or self._tasks is None:
            return None
        reader = self._readers.get(kind)
        if reader is None:
            reader = self._readers[kind] = kind()
            self._tasks.start_soon(reader.run, self._after_effects)
        return reader

    def _reader_handlers(
        self, link: _RankLink, reader: ChannelReader
    ) -> tuple[Callable[[list[Message], float], None], Callable[[Exception | None], None]]:
        """What the shared reader calls for ``link``'s messages and for the end of its channel
        (both end the connection as :meth:`_read_loop` would)."""

        def ended(error: Exception | None) -> None:
            if error is not None:
                link.errors.append(error)
            link.scope.cancel()

        def on_messages(batch: list[Message], now: float) -> None:
            if link.scope.cancel_called:
                # Ended (disconnected, too slow) but its task has not run yet: a read loop
                # would read nothing more either.
                reader.discard(link.channel)
                return
            try:
                self._handle_batch(link.rank, batch, now)
            except ProtocolError as err:
                reader.discard(link.channel)
                ended(err)

        return on_messages, ended

    async def _read_loop(self, rank: int, channel: Channel) -> None:
        # Every message already buffered is handled in one go: one clock read and one
        # deadline check per wake-up rather than per message (they arrived together).
        while True:
            try:
                batch = await channel.receive_batch()
            except ChannelClosed:
                return
            try:
                self._handle_batch(rank, batch, trio.current_time())
            finally:
                self._after_effects()

    def _handle_batch(self, rank: int, batch: list[Message], now: float) -> None:
        """Feed ``rank``'s messages to the machine in order, all at ``now``; ProtocolError
        (the rest not handled) if one claims another rank."""
        machine = self._machine
        link = self._links.get(rank)
        for message in batch:
            if link is not None and link.aborting:
                return  # being let go: what it says no longer counts
            claimed = getattr(message, "rank", rank)
            if claimed != rank:
                raise ProtocolError(
                    f"rank {rank} sent {type(message).__name__} claiming to be rank {claimed}"
                )
            if self._probe is None:
                self._apply(machine.on_message(rank, message, now))
            else:
                self._apply(self._probed_message(self._probe, rank, message, now))

    async def _write_loop(self, link: _RankLink) -> None:
        # Sends what the direct writes of _flush could not: the rest of a partly written
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
        except _CONNECTION_ERRORS as err:
            link.errors.append(err)
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
            self._flush()
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
            if self._probe is None:
                self._perform(self._machine.on_tick(now))
            else:
                self._perform(self._probed_tick(self._probe, now, scope.deadline))
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

    # --- probe ----------------------------------------------------------------------------

    def _probed_message(
        self, probe: ShellProbe, rank: int, message: Message, now: float
    ) -> list[Effect]:
        """The machine's effects for ``message``, the call timed and told to ``probe``."""
        started = time.thread_time()
        effects = self._machine.on_message(rank, message, now)
        took = time.thread_time() - started
        try:
            probe.message_handled(rank, message, now, took)
        except Exception as err:
            self._probe_failed(probe, err)
        return effects

    def _probed_tick(self, probe: ShellProbe, now: float, deadline: float) -> list[Effect]:
        """The machine's effects for a tick of the deadline task armed for ``deadline``."""
        started = time.thread_time()
        effects = self._machine.on_tick(now)
        took = time.thread_time() - started
        try:
            probe.ticked(now, deadline, took)
        except Exception as err:
            self._probe_failed(probe, err)
        return effects

    def _call(
        self, event: MachineEvent, rank: int | None, now: float, call: Callable[[], list[Effect]]
    ) -> list[Effect]:
        """``call()``'s effects; timed and told to the probe, if one is set."""
        probe = self._probe
        if probe is None:
            return call()
        started = time.thread_time()
        effects = call()
        took = time.thread_time() - started
        try:
            probe.event_handled(event, rank, now, took)
        except Exception as err:
            self._probe_failed(probe, err)
        return effects

    def _probe_failed(self, probe: ShellProbe, error: Exception) -> None:
        report_failed(probe, error)
        if self._probe is probe:
            self._probe = None

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
                    self._let_go(link, effect.reason)

    def _let_go(self, link: _RankLink, reason: str) -> None:
        """Tell ``link``'s rank why it is let go (``Abort``, best effort), then end its
        connection: once the Abort is written, or after :data:`ABORT_GRACE` seconds."""
        if link.closed or link.aborting or link.scope.cancel_called:
            return
        self._enqueue(link, Abort(reason=reason[:MAX_TEXT]))
        link.aborting = True
        # Written by _flush or the writer, which then end the link; this bounds the wait.
        link.scope.deadline = min(link.scope.deadline, trio.current_time() + ABORT_GRACE)

    def _after_effects(self) -> None:
        """Write what the effects queued, notice the end of the run, and pull the deadline
        loop's wake-up earlier if needed."""
        if self._dirty:
            self._flush()
        timeline = self._machine.timeline
        if self._published != timeline.added:
            fresh = timeline.since(self._published)
            self._published = timeline.added
            for sink in self._sinks:
                for seq, event in fresh:
                    sink(seq, event)
        if self._machine.finished and not self._finished.is_set():
            self._finished.set()
        if self._freeze_heap and not self.heap_frozen:
            if self._machine.phase is RunPhase.TRAINING:
                gc.collect()  # what is garbage now would otherwise never be collected
                gc.freeze()
                self.heap_frozen = True
        scope = self._deadline_scope
        if scope is not None:
            deadline = self._machine.next_deadline()
            if deadline < scope.deadline:
                scope.deadline = deadline

    def _enqueue(self, link: _RankLink, message: _Outgoing) -> None:
        """Queue ``message`` for ``link``'s rank (written by :meth:`_flush` or the writer)."""
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

    def _flush(self) -> None:
        """Write each queued link's messages now where its stream takes them without waiting
        (the first :data:`FLUSH_CHUNK` links; the flush task writes the others), and hand the
        rest to the link's writer task. Never waits."""
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
        """Write the links :meth:`_flush` left, :data:`FLUSH_CHUNK` per scheduler step."""
        while True:
            await self._backlog_wake.wait()
            self._backlog_wake = trio.Event()
            while self._backlog:
                await trio.lowlevel.checkpoint()  # what was read meanwhile goes first
                backlog = self._backlog
                chunk = [backlog.popleft() for _ in range(min(FLUSH_CHUNK, len(backlog)))]
                self._write_now(chunk)

    def _write_now(self, dirty: Iterable[_RankLink]) -> None:
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
            except _CONNECTION_ERRORS as err:
                link.errors.append(err)
                link.scope.cancel()
                continue
            link.wake.set()


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
    freeze_heap: bool = False,
    probe: ShellProbe | None = None,
) -> AsyncIterator[Coordinator]:
    """Listen on ``url`` and coordinate ``world_size`` ranks until the block exits.

    On exit from the block the coordinator waits up to ``linger`` seconds for ranks to hang up
    after the run ended, then cancels every task and closes the listener. Cancellation of the
    enclosing scope closes everything at once. ``freeze_heap``: the coordinator owns its
    process and freezes the heap once training starts (module docstring); it is unfrozen
    on exit, however the block ends. ``probe``: told of every call to the machine from the
    first on (:mod:`flodl.coordinator.probe`; :meth:`Coordinator.set_probe` changes it).
    """
    config = config or CoordinatorConfig()
    check_session_key(key)
    listener = await open_listener(url)
    machine = CoordinatorMachine(
        world_size,
        config.machine_settings(),
        now=trio.current_time(),
        local_ranks=frozenset(range(world_size)) if local_ranks is None else local_ranks,
        seed=seed,
        resume=resume,
    )
    coordinator = Coordinator(machine, config, listener.url, freeze_heap=freeze_heap, probe=probe)
    try:
        async with trio.open_nursery() as nursery:
            coordinator._tasks = nursery
            nursery.start_soon(coordinator.deadline_loop)
            nursery.start_soon(coordinator.heartbeat_loop)
            nursery.start_soon(coordinator.flush_loop)
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
        coordinator._tasks = None
        if coordinator.heap_frozen:
            gc.unfreeze()  # back to the oldest generation: collectable again
        for reader in coordinator._readers.values():
            reader.close()
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
