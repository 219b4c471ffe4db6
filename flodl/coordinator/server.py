"""The coordinator's trio shell: listener, one task per rank, heartbeat, deadlines, effects.

All decisions are made by :class:`flodl.core.coordinator.machine.CoordinatorMachine`; this module
only moves bytes and time into it and carries its effects out. One nursery owns every task:

* the admission server (handshake under a deadline, unique ranks;
  :mod:`flodl.coordinator.admission`);
* per rank: a task that owns the connection (its cancel scope ends it) with a writer, so a
  slow rank never blocks a broadcast to the others; what the machine sends is queued per rank
  and written once the effects of an event are carried out, by the flush task beyond a chunk
  of ranks (:mod:`flodl.coordinator.links`);
* reading: ranks are read by one shared
  :class:`~flodl.transports.channel_reader.ChannelReader` per kind of stream, started with
  the first rank it serves (:func:`~flodl.transports.readers.reader_for` says which kind
  serves a channel): one trio wake-up serves every channel readable at that moment, where a
  reader task per rank costs a wake-up per channel for about two messages (at 1,024 ranks
  that wake-up is most of the coordinator's cost per message; the figures are in
  docs/benchmarks.md). A channel no kind serves keeps a read loop of its own; a rank its node
  agent carries is handed its messages by the agents' desk (:mod:`flodl.coordinator.carried`),
  one agent frame holding many ranks' messages, settled once. Every path
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
coordinator down. Cancelling the scope around :func:`open_coordinator` ends every task at
once: each rank's task still tells the machine of its disconnect on the way out (carrying out
effects never waits, so nothing there can be cut short), the readers and the listener are
closed and a frozen heap is unfrozen. Usage::

    async with open_coordinator("tcp://127.0.0.1:0", world_size=3, key=key) as coord:
        print(coord.url)           # give this to the ranks
        outcome = await coord.wait_finished()
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from functools import partial

import trio

from flodl.config import CoordinatorConfig
from flodl.coordinator.admission import Carried, serve_ranks
from flodl.coordinator.agents import AgentDesk
from flodl.coordinator.beats import beat_ranks
from flodl.coordinator.carried import CarriedRank
from flodl.coordinator.links import CONNECTION_ERRORS, Links, link_handlers
from flodl.coordinator.probe import Probing, ShellProbe
from flodl.core.coordinator.machine import (
    CoordinatorMachine,
    Effect,
    Outcome,
    ResumeState,
    RunPhase,
)
from flodl.core.coordinator.record import RunRecord
from flodl.core.coordinator.timeline import EventKind, Timeline, TimelineEvent
from flodl.errors import ChannelClosed, CoordinatorError, ProtocolError
from flodl.supervise.exits import RankExit
from flodl.transports import open_listener
from flodl.transports.channel import Channel
from flodl.transports.channel_reader import ChannelReader
from flodl.transports.readers import reader_for
from flodl.wire.handshake import check_session_key
from flodl.wire.messages import Message, RunSettings

log = logging.getLogger("flodl.coordinator")

EventSink = Callable[[int, TimelineEvent], None]
"""Takes each timeline event with its sequence number (:meth:`Coordinator.add_event_sink`)."""


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
        self._probing = Probing(probe)
        self._config = config
        self._freeze_heap = freeze_heap
        self.heap_frozen = False
        """The heap was frozen when training started (module docstring)."""
        self.url = url
        """The address ranks connect to (port 0 resolved)."""
        self._links = Links()
        self._finished = trio.Event()
        self._deadline_scope: trio.CancelScope | None = None
        self.rank_errors: list[tuple[int | None, BaseException]] = []
        """Every connection that ended in an error, in order (rank None: before the handshake)."""
        self._tasks: trio.Nursery | None = None
        """Where the shared readers' tasks run (the coordinator's nursery)."""
        self._readers: dict[type[ChannelReader], ChannelReader] = {}
        self.agents: AgentDesk | None = None
        """The node agents' desk (:mod:`flodl.coordinator.agents`), once serving."""
        outer = config.outer_settings()
        self.run_settings = RunSettings(
            policy=config.policy.value,
            seed=machine.seed,
            heartbeat_interval=config.heartbeat_interval,
            heartbeat_timeout=config.heartbeat_timeout,
            backend=config.backend,
            keep_checkpoints=config.keep_checkpoints or 0,
            outer=outer.kind.value,
            outer_lr=outer.lr,
            outer_momentum=outer.momentum,
            average_dtype=config.average_dtype,
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
        return frozenset(self._links.by_rank)

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

    async def wait_ended(self) -> None:
        """:meth:`wait_finished`, as the host's ranks wait for it under ``flodl run``."""
        await self._finished.wait()

    def lost_ranks(self) -> frozenset[int]:
        """The ranks the run lost and that did not rejoin (final once it finished)."""
        return self._machine.lost_ranks()

    def rank_exited(self, exit: RankExit) -> list[str]:
        """A supervisor saw a rank's process exit (:class:`~flodl.supervise.exits.ExitSink`):
        the machine hears of it at once (no heartbeat wait). Returns what a person should hear
        of it (the run going on without a rank that died before joining)."""
        timeline, now = self._machine.timeline, trio.current_time()
        before = timeline.added
        effects = self._probing.call(
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
            for _, event in timeline.since(before)
            if event.kind is EventKind.GOING_ON_WITHOUT
        ]

    def request_stop(self, save: bool = True) -> None:
        """End the run: save first (ShutdownWithSave(GRACEFUL)) or just shut down."""
        now = trio.current_time()
        stop = partial(self._machine.request_stop, now, save=save)
        self._perform(self._probing.call("stop", None, now, stop))

    def set_probe(self, probe: ShellProbe | None) -> None:
        """Report every machine call from now on to ``probe`` (None: to nobody); what it is
        told and why it cannot change the run: :mod:`flodl.coordinator.probe`."""
        self._probing.probe = probe

    # --- tasks ----------------------------------------------------------------------------

    async def serve_rank(self, rank: int, channel: Channel | CarriedRank) -> None:
        """Run one admitted rank's connection until it closes; errors end only this rank.

        A bad frame, a broken stream or a rank that cannot keep up ends this connection: the
        machine hears of the disconnect at once, and the error is re-raised (unwrapped) for
        the admission server to report. On return the channel is no longer read.
        """
        scope = trio.CancelScope()
        link = self._links.open(rank, channel, scope)
        errors = link.errors
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._links.write_loop, link)
                    self._links.enqueue(link, self.run_settings)
                    now = trio.current_time()
                    connect = partial(self._machine.on_connect, rank, now)
                    self._perform(self._probing.call("connect", rank, now, connect))
                    if isinstance(channel, CarriedRank):  # its agent's desk hands it over
                        channel.attach(*link_handlers(link, self._handle_batch, channel.detach))
                        self._after_effects()
                        await trio.sleep_forever()  # until the desk or anyone ends it
                    elif (reader := self._shared_reader(channel)) is not None:
                        try:
                            stop = partial(reader.discard, channel)
                            reader.add(channel, *link_handlers(link, self._handle_batch, stop))
                            await trio.sleep_forever()  # until the reader or anyone ends it
                        finally:
                            reader.discard(channel)
                    else:
                        try:
                            await self._read_loop(rank, channel)
                        except CONNECTION_ERRORS as err:
                            errors.append(err)
                        nursery.cancel_scope.cancel()
        finally:
            self._links.close(link)
            reason = f"{type(errors[0]).__name__}: {errors[0]}" if errors else "connection closed"
            now = trio.current_time()
            self._perform(
                self._probing.call(
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
        machine, probing = self._machine, self._probing
        link = self._links.by_rank.get(rank)
        for message in batch:
            if link is not None and link.aborting:
                return  # being let go: what it says no longer counts
            claimed = getattr(message, "rank", rank)
            if claimed != rank:
                raise ProtocolError(
                    f"rank {rank} sent {type(message).__name__} claiming to be rank {claimed}"
                )
            if probing.probe is None:
                self._links.apply(machine.on_message(rank, message, now))
            else:
                self._links.apply(probing.message(machine, rank, message, now))

    async def heartbeat_loop(self) -> None:
        """Beat every rank until the run ends (:func:`~flodl.coordinator.beats.beat_ranks`),
        and put each pause of this process on the run's record."""
        node_of = self.agents.table.owner if self.agents is not None else lambda _r: None
        config = self._config
        beats = partial(beat_ranks, self._links, node_of, config.heartbeat_interval)
        async with trio.open_nursery() as nursery:
            pause_after = config.heartbeat_timeout / 2  # half way to the ranks giving up
            nursery.start_soon(partial(beats, pause_after=pause_after, on_paused=self._paused))
            await self._finished.wait()
            nursery.cancel_scope.cancel()

    def _paused(self, seconds: float) -> None:
        """This process did not run for ``seconds``: on the record (and to the views)."""
        timeline, timeout = self._machine.timeline, self._config.heartbeat_timeout
        now = trio.current_time()
        timeline.add(now, EventKind.COORDINATOR_PAUSED, seconds=seconds, heartbeat_timeout=timeout)
        self._after_effects()

    async def deadline_loop(self) -> None:
        """Sleep until the machine's next deadline (moved earlier as events arrive), then tick."""
        while not self._finished.is_set():
            with trio.CancelScope(deadline=self._machine.next_deadline()) as scope:
                self._deadline_scope = scope
                await trio.sleep_forever()
            self._deadline_scope = None
            now = trio.current_time()
            if self._probing.probe is None:
                self._perform(self._machine.on_tick(now))
            else:
                self._perform(self._probing.tick(self._machine, now, scope.deadline))
            if self._machine.next_deadline() <= now and not self._finished.is_set():
                # A deadline the machine did not act on would spin this loop forever.
                raise CoordinatorError(
                    f"coordinator bug: deadline {self._machine.next_deadline()} not handled "
                    f"at {now}"
                )

    async def wait_all_hung_up(self) -> None:
        """Wait until no rank connection is open."""
        await self._links.wait_all_closed()

    def on_rank_error(self, rank: int | None, error: BaseException) -> None:
        # rank None: a node agent's link, or a peer that failed before its hello named a rank.
        who = f"rank {rank}" if rank is not None else "a peer holding no rank (agent or handshake)"
        log.warning("%s disconnected: %s: %s", who, type(error).__name__, error)
        self.rank_errors.append((rank, error))

    # --- effects --------------------------------------------------------------------------

    def _perform(self, effects: Iterable[Effect]) -> None:
        self._links.apply(effects)
        self._after_effects()

    def _after_effects(self) -> None:
        """Write what the effects queued, notice the end of the run, and pull the deadline
        loop's wake-up earlier if needed."""
        self._links.flush()
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
    carried_in, carried_out = trio.open_memory_channel[Carried](math.inf)
    coordinator.agents = AgentDesk(
        world_size,
        rank_exited=coordinator.rank_exited,
        request_stop=coordinator.request_stop,
        run_over=coordinator._finished,
        join_timeout=config.handshake_timeout,
        carried=carried_in,
        settle=coordinator._after_effects,
        reader_for=coordinator._shared_reader,
    )
    coordinator.add_event_sink(coordinator.agents.on_event)
    try:
        async with trio.open_nursery() as nursery:
            coordinator._tasks = nursery
            nursery.start_soon(coordinator.deadline_loop)
            nursery.start_soon(coordinator.heartbeat_loop)
            nursery.start_soon(coordinator._links.flush_loop)
            nursery.start_soon(coordinator.agents.downlinks.run)
            serving = partial(
                serve_ranks,
                listener,
                key,
                world_size,
                coordinator.serve_rank,
                signature=signature,
                handshake_timeout=config.handshake_timeout,
                on_rank_error=coordinator.on_rank_error,
                agent_handler=coordinator.agents.serve,
                carried=carried_out,
                carried_handler=coordinator.serve_rank,
            )
            await nursery.start(serving)
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


__all__ = ["Coordinator", "open_coordinator"]
