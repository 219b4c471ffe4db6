"""The simulated ranks: a RankMachine each, on a shared metronome.

:class:`RankLoop` is a rank's training loop around its
:class:`~flodl.core.rank.machine.RankMachine` (no I/O); :class:`LeanRank` runs one over a real
Channel in the coordinator's process (in-process mode); the split mode's generator runs them
over raw sockets (:mod:`.sockets`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Sequence

import trio
import trio.lowlevel

from flodl.config import CoordinatorConfig
from flodl.core.common.job import Job
from flodl.core.rank.effects import (
    Average,
    Finish,
    HandOut,
    JoinGroup,
    PrepareGroup,
    Raise,
    RankEffect,
    SaveAndStop,
    SaveCheckpoint,
    Send,
    Wait,
    Wake,
)
from flodl.core.rank.machine import MeasuredRound, RankMachine
from flodl.errors import FlodlError, ShutdownRequested
from flodl.transports import connect
from flodl.transports.channel import Channel
from flodl.transports.greeting import connect_rank
from flodl.transports.memory_reader import MemoryReader
from flodl.wire.messages import JoinResult, Message, NewGroupReady

from .record import Recorder

KEY = b"coordinator-scale-bench-key-0123"


BATCH_PERIOD_S = 0.1
"""Each rank finishes a batch every 100 ms while it holds work (10 Batch/s)."""
HEARTBEAT_PERIOD_S = 1.0
DATASET_SIZE = 10**9
"""Samples per epoch: far more than a run of minutes can consume, so the run never ends."""


class Metronome:
    """Actions due at given times, run by one timer task at the first 2 ms slot at or after
    each action's time.

    A task per rank per timer would spend much of the shared core waking tasks and sleeping
    (a cancel scope and a Cancelled exception per sleep), which real ranks (each on its own
    machine) never charge to the coordinator. Actions of one slot run in the order they were
    registered, all in one go: none waits (a rank queues what its connection cannot take at
    once behind it, see :class:`LeanRank` and :class:`WireGenerator`), so a slot's sends land
    together, as sends from many machines would. While the recorder measures, each action's
    lag (its start time minus the time it was scheduled for; up to one slot even when nothing
    is late) goes to ``rank_lag``.
    """

    SLOT_S = 0.002

    def __init__(self, recorder: Recorder, after_slot: Callable[[], None] | None = None) -> None:
        self._pending: list[tuple[int, int, float, Callable[[float], None]]] = []
        self._after_slot = after_slot
        """Called once a slot's actions ran (the agents layout sends what they queued)."""
        self._order = itertools.count()
        self._fired_through = math.floor(trio.current_time() / self.SLOT_S)
        self._recorder = recorder

    def at(self, when: float, action: Callable[[float], None]) -> None:
        """Run ``action(now)`` in the first slot at or after ``when`` (the next slot if that
        one has already fired)."""
        slot = max(math.ceil(when / self.SLOT_S), self._fired_through + 1)
        heapq.heappush(self._pending, (slot, next(self._order), when, action))

    async def run(self) -> None:
        """Fire the slots as their time comes (late slots all at once); runs until cancelled."""
        pending, recorder = self._pending, self._recorder
        while True:
            await trio.sleep_until((self._fired_through + 1) * self.SLOT_S)
            now = trio.current_time()
            self._fired_through = math.floor(now / self.SLOT_S)
            while pending and pending[0][0] <= self._fired_through:
                _, _, when, action = heapq.heappop(pending)
                if recorder.measuring:
                    recorder.rank_lag.append(trio.current_time() - when)
                action(now)
            if self._after_slot is not None:
                self._after_slot()


JOB = Job(dataset_size=DATASET_SIZE, batch_size=1, epochs=1)
"""What every simulated rank announces (``Ready``)."""
RANK_POLICY = CoordinatorConfig().policy
"""The ranks' policy is the coordinator's (its default configuration)."""
LOSS = 1.0
"""The loss every simulated batch reports."""


NO_FIGURES = MeasuredRound()
"""What an instant, simulated average reports: nothing measured, so the SyncAck carries no
divergence or norms (split mode writes its send stamp into ``pre_norm``)."""


class RankLoop:
    """A simulated rank's training loop around its :class:`~flodl.core.rank.machine.RankMachine`.

    No I/O: each call takes the time and returns the messages to send, in order; the shell
    (:class:`LeanRank`, :class:`WireRank`) sends them. The machine keeps the protocol (the
    work queue, the chunks and their Metrics frames, step counts, throttling, acks, the
    goodbye); the loop only decides when things happen:

    * a batch handed out finishes at the rank's next grid tick (``batch_phase + k *
      BATCH_PERIOD_S``); the rank is then at its batch boundary and asks the machine for the
      next step. The machine holds its reports (coalescing, as the worker does), so the loop
      runs its batches only when something can be seen: when a message arrives, at a
      heartbeat, or at a wake it asks the shell for (``schedule``, then :meth:`tick`) at the
      last batch of its work or at a boundary with something to act on. Each batch is still
      finished at its own grid time, so the machine sees the same times;
    * an average takes no time (there is no backend): the machine's step is answered at once
      and the SyncAck goes out. A group to prepare is answered ``NewGroupReady`` (info
      ``b"sim"``); once one is announced the rank is a member of it;
    * ``Wait``: the rank idles in its boundary until a reaction wakes it, then asks again at
      once, so a rank waiting at the barrier acks a SyncNow on receipt. A rank in the middle
      of a batch acts on what arrived at its next boundary, as a real one does;
    * after the goodbye (``Finish``, or ``Raise`` of the ShutdownRequested that follows a
      ShutdownWithSave) the run is over for the rank: :attr:`over`.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        batch_phase: float,
        recorder: Recorder,
        schedule: Callable[[float], None],
    ) -> None:
        self.rank = rank
        # The worker's protocol: reports coalesced (flodl.core.rank.machine).
        self.machine = RankMachine(rank, world_size, RANK_POLICY, coalesce=True)
        self.batch_phase = batch_phase
        self.recorder = recorder
        self._schedule = schedule
        self._armed: float | None = None
        """The earliest wake asked of the shell and not yet run (None: none)."""
        self.due: float | None = None
        """The grid time at which the batch handed out finishes (None: none is out)."""
        self.waiting = False
        """In a boundary whose step was Wait."""
        self.over = False
        self.group_rank = rank

    def start(self, now: float) -> list[Message]:
        """Announce the job (``Ready``) and wait at the first boundary for work."""
        out: list[Message] = []
        self._react(self.machine.announce(JOB), out)
        self.machine.enter_boundary(now)
        self._boundary(now, out)
        return out

    def receive(self, message: Message, now: float) -> list[Message]:
        out = self._catch_up(now)
        if not self.over and self._react(self.machine.receive(message), out) and self.waiting:
            self._boundary(now, out)
        self._arm()
        return out

    def tick(self, now: float) -> list[Message]:
        """A wake the loop asked for came: every batch due by ``now`` is done."""
        armed = self._armed
        if armed is not None and now >= armed:
            self._armed = None
            if now >= armed + BATCH_PERIOD_S and self.recorder.measuring:
                self.recorder.late_rank_ticks += 1  # a whole period behind schedule
        out = self._catch_up(now)
        self._arm()
        return out

    def heartbeat(self, now: float) -> list[Message]:
        """The heartbeat interval came: every batch due by ``now`` is done, then what the
        machine sends at a heartbeat (its held reports, a Heartbeat, or nothing)."""
        if self.over:
            return []
        out = self._catch_up(now)
        self._arm()
        beat = self.machine.heartbeat()
        if beat is not None:
            out.append(beat)
        return out

    def _catch_up(self, now: float) -> list[Message]:
        """Finish, in order and each at its own grid time, every batch due by ``now``.

        Between two of them the coordinator sees nothing (the machine holds the reports), so
        the loop runs them when something can be seen: a message arrives, a heartbeat is due,
        or the work runs dry (see :meth:`_arm`). The machine gets each batch's own time.
        """
        out: list[Message] = []
        machine = self.machine
        while self.due is not None and self.due <= now and not self.over:
            due, self.due = self.due, None
            self._react(machine.batch_done(LOSS, 0.0, due), out)
            machine.enter_boundary(due)
            self._boundary(due, out)
        return out

    def _arm(self) -> None:
        """Ask the shell to wake the loop when the coordinator could next see something
        without a message or heartbeat: the last batch of the queued work (the completion
        frame follows it), or the next boundary when it has something to act on (a queued
        message, a throttle)."""
        due = self.due
        if due is None or self.over:
            return
        machine = self.machine
        work = machine.work
        if machine.queued or machine.throttled or work is None:
            wake = due
        else:
            wake = due + (work.queue.queued_samples // JOB.batch_size) * BATCH_PERIOD_S
        if self._armed is None or wake < self._armed:
            self._armed = wake
            self._schedule(wake)

    def _react(self, effects: Sequence[RankEffect], out: list[Message]) -> bool:
        """Perform reactions (sends into ``out``); True if one asks to wake the boundary.

        DoomGroup, CancelRound and GiveUp find no group, round or record to act on, and
        Ignored needs no log here.
        """
        woken = False
        for effect in effects:
            if isinstance(effect, Send):
                out.append(effect.message)
            elif isinstance(effect, Wake):
                woken = True
            elif isinstance(effect, PrepareGroup):
                generation = effect.request.generation
                out.append(NewGroupReady(rank=self.rank, generation=generation, info=b"sim"))
            elif isinstance(effect, JoinGroup):
                self.group_rank = effect.session.new_rank
                out.append(JoinResult(self.rank, effect.session.generation, joined=True))
        return woken

    def _boundary(self, now: float, out: list[Message]) -> None:
        """Perform the machine's boundary steps until one hands out a batch, waits or ends."""
        machine = self.machine
        while True:
            effects = machine.boundary(now)
            step = effects.pop()
            self._react(effects, out)
            if isinstance(step, Wait):
                self.waiting = True
                return
            if isinstance(step, Average):
                machine.round_weight(step.sync, self.group_rank)  # what a backend would take
                after = machine.average_finished(step.sync, NO_FIGURES, 0.0)
            elif isinstance(step, SaveCheckpoint):
                after = machine.checkpoint_finished(step.request, 0.0, None)
            elif isinstance(step, SaveAndStop):
                after = machine.save_finished(
                    "a simulated rank has nothing to save", 0.0, "simulated"
                )
            else:
                machine.leave_boundary(now)
                self.waiting = False
                if isinstance(step, HandOut):
                    self.due = _next_grid_tick(now, self.batch_phase, BATCH_PERIOD_S)
                elif isinstance(step, Finish) or (
                    isinstance(step, Raise) and isinstance(step.error, ShutdownRequested)
                ):
                    self.over = True
                elif isinstance(step, Raise):
                    raise step.error
                else:
                    raise AssertionError(f"rank {self.rank}: no simulation of {step}")
                return
            self._react(after, out)


class LeanRank:
    """An in-process simulated rank: its :class:`RankLoop` over a real Channel.

    Its messages are handled by the shared reader's task (one MemoryReader for every rank);
    its batches and heartbeats are actions of the shared :class:`Metronome`. What the rank
    sends goes out at once where the stream takes it, otherwise behind what is queued, from a
    writer task of its own (64 KiB of buffer per connection: only a coordinator far behind
    the target gets there).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        recorder: Recorder,
        metronome: Metronome,
        rng: random.Random,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.recorder = recorder
        self.metronome = metronome
        batch_phase = rng.uniform(0.0, BATCH_PERIOD_S)
        self.heartbeat_phase = rng.uniform(0.0, HEARTBEAT_PERIOD_S)
        self.loop = RankLoop(rank, world_size, batch_phase, recorder, self._schedule)
        self.channel: Channel | None = None
        """Set while connected; None once the connection ended (actions then stop)."""
        self.outbox: list[Message] = []
        """Messages waiting for the writer (the stream did not take them at once)."""
        self._written = trio.Event()
        """Set when the writer has something to write."""
        self.ended = trio.Event()
        """The run is over for this rank and its last message is written, or the connection
        ended."""

    def _schedule(self, when: float) -> None:
        self.metronome.at(when, self._tick)

    async def run(self, url: str, key: bytes, reader: MemoryReader) -> None:
        """Connect, announce, then serve until the rank's goodbye, the end of the connection,
        or cancellation. ``reader`` hands this rank its messages."""
        stream = await connect(url)
        try:
            channel = await connect_rank(stream, key, self.rank, self.world_size)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        async with stream:
            ready = self.loop.start(trio.current_time())
            self._sending(ready, trio.current_time())
            await channel.send_many(ready)
            self.channel = channel
            self.metronome.at(trio.current_time() + self.heartbeat_phase, self._heartbeat)
            reader.add(channel, self._on_messages, lambda error: self.ended.set())
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._writer, channel)
                    await self.ended.wait()
                    nursery.cancel_scope.cancel()
            except (FlodlError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                self.channel = None
                reader.discard(channel)

    def _on_messages(self, messages: list[Message], now: float) -> None:
        recorder, loop = self.recorder, self.loop
        for message in messages:
            if recorder.measuring:
                recorder.delivered[type(message).__name__] += 1
            self._send(loop.receive(message, now))

    def _tick(self, now: float) -> None:
        if self.channel is not None:
            self._send(self.loop.tick(now))

    def _heartbeat(self, now: float) -> None:
        if self.channel is None or self.loop.over:
            return
        self.metronome.at(now + HEARTBEAT_PERIOD_S, self._heartbeat)
        self._send(self.loop.heartbeat(now))

    def _sending(self, messages: Sequence[Message], at: float) -> None:
        """``messages`` were handed to the Channel at ``at`` (no await in between)."""
        self.recorder.sending(self.rank, messages, at)

    def _send(self, messages: list[Message]) -> None:
        """Write ``messages`` now if the stream takes them, else queue them for the writer."""
        channel = self.channel
        if channel is None:
            return
        if messages and not self.outbox:
            at = trio.current_time()
            try:
                written = channel.send_nowait(messages)
            except trio.WouldBlock:  # the writer holds the channel, or bytes are left over
                pass
            except (FlodlError, trio.BrokenResourceError, trio.ClosedResourceError):
                self.channel = None
                self.ended.set()
                return
            else:
                self._sending(messages, at)
                if not written:
                    self._written.set()  # part of it is left in the channel: flush it
                messages = []
        self.outbox += messages
        if self.outbox or self.loop.over:
            self._written.set()  # after a goodbye the writer ends the rank once it is out

    async def _writer(self, channel: Channel) -> None:
        while True:
            await self._written.wait()
            self._written = trio.Event()
            await channel.flush()
            while self.outbox:
                batch, self.outbox = self.outbox, []
                self._sending(batch, trio.current_time())
                await channel.send_many(batch)
            if self.loop.over:
                self.ended.set()
                return


def _next_grid_tick(now: float, phase: float, period: float) -> float:
    """The first time ``phase + k * period`` (k integer) strictly after ``now``."""
    tick = phase + (math.floor((now - phase) / period) + 1) * period
    # ``now`` on a tick can divide to just under k: that tick is not after it, the next is.
    return tick if tick > now else tick + period
