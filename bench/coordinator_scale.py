"""Coordinator scale benchmark: how many ranks one coordinator serves on one core.

Writes bench/results/coordinator.json and prints a short table.

Setup (one trio process, one thread, real clock): a real coordinator
(:func:`flodl.coordinator.open_coordinator` on a fresh ``memory://`` name, default
:class:`~flodl.config.CoordinatorConfig`) and N simulated ranks. The split mode (``--mode``)
puts the ranks in load-generator processes on unix or tcp sockets instead, leaving the
coordinator's process to it alone. Each simulated rank is a
:class:`~flodl.core.rank.machine.RankMachine` (the rank's side of the protocol, the machine a real
worker drives) with a lean loop around it in place of training (:class:`RankLoop`). It connects with
a real handshake and announces a job too large to end (``Ready``: 10**9 samples, batch size 1); the
machine keeps the work protocol (work queue, ``Metrics`` completion frames, step counts,
``Throttle``, ``SyncAck``, the goodbye) and the loop supplies time:

* its batches finish on a 10 Hz grid with a random phase per rank (so the ranks do not all
  report at once): at each grid tick the batch handed out is done and the rank asks its
  machine for the next step; when its work runs out the machine sends the ``Metrics``
  completion frame and the rank waits for more. A batch handed out when work arrives finishes
  at the next grid tick, so it reports the time since it was handed out (under 100 ms);
* the machine coalesces, as the worker's does: it holds its batch reports and sends them as
  one ``Batches`` frame before anything else it sends (so a chunk's reports go just before
  its Metrics) or in place of a heartbeat; the loop therefore runs a rank's batches (each at
  its own grid time) only when something can be seen: a message arrives, a heartbeat is due,
  or the work runs dry;
* averaging takes no time (there is no backend): where the machine says ``Average`` the rank
  acks at once. A rank waiting at the barrier asks again as soon as a message wakes it, so it
  acks ``SyncNow`` on receipt; one in the middle of a batch acts on it at its next tick.
  ``RequestNewGroup`` is answered ``NewGroupReady``;
* its heartbeat interval is one second, on a random phase of its own: the machine then sends
  its held reports, or a ``Heartbeat``, or nothing when another frame went out since the last.

The training load is therefore 10 batches/s per rank and a heartbeat interval of 1 s, as
before the reports were coalesced (then: 10 Batch + 1 Heartbeat frames/s per rank); the
frames are now about one Batches per second plus, per averaging window, a Batches, a Metrics
and a SyncAck. Ranks that wait for the averaging barrier at the end of a window train nothing
meanwhile, so even an instant coordinator sees about 9 batch reports/s per rank; a slow
coordinator stretches the barrier and the rate falls further (that is the back-pressure a
real run would feel).

After the measured window (split mode, 4 ranks or more) one rank is killed (its generator
closes its socket) and the membership change is timed: ``membership_change.decision_s`` is
the machine's ``took_s`` from the death detected (RANK_DEAD) to the next generation of the
group committed (GROUP_REFORMED).

Measurement, after a warm-up (all ranks joined, the group formed, two averaging rounds
started), for ``--seconds`` per rank count:

* **Message latency** (the tick loop's latency for an event): for every message a rank sends,
  the trio time just before the rank hands it to its Channel (queueing behind the rank's own
  earlier frames, the memory stream, framing, HMAC and decoding all count) to the trio time the
  coordinator passes as ``now`` to ``CoordinatorMachine.on_message`` for it. Frames of one
  connection are decoded in order, so send times are matched per rank in FIFO order. (Split
  mode: the send time travels in the message itself, see ``SPLIT_LATENCY``.)
* **Timer lateness**: a probe task sleeps in a cancel scope until a deadline 50 ms ahead, as
  the coordinator's deadline loop does, and records wake time minus deadline; the deadline
  loop's own wakes are recorded the same way (actual ``on_tick`` time minus the deadline its
  cancel scope held), though in steady state it rarely wakes.
* The target is met when p99 of both latencies is under 50 ms and the ranks still deliver at
  least 90% of the nominal batch rate (9 batch reports/s per rank).
* **CPU**: ``time.process_time`` over the window per rank per second (``cpu_us_per_rank_s``:
  what a rank costs the coordinator, independent of how its reports are framed) and divided
  by the messages the coordinator received (``cpu_us_per_message``; in-process, ranks and
  coordinator share the core, so this includes the ranks' own machines and encoding), and
  the coordinator's share: the CPU time of trio task steps of ``flodl.*`` tasks (the
  coordinator's readers, writers, heartbeat and deadline loops), measured with a trio
  instrument; ``machine`` is the part spent inside the decision machine's calls.

The library's one-clock rule is for flodl/; this bench also reads time.perf_counter (wall),
time.process_time and time.thread_time (CPU). The machine may be shared: other processes
stretch latencies (not the CPU figures); each row records the load average after it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import heapq
import itertools
import json
import math
import os
import pstats
import random
import select
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import benchenv
import cbor2
import trio
import trio.lowlevel

from flodl.config import CoordinatorConfig
from flodl.coordinator.server import open_coordinator
from flodl.core.common.job import Job
from flodl.core.coordinator.machine import CoordinatorMachine, Effect
from flodl.core.coordinator.timeline import EventKind, TimelineEvent
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
from flodl.transports.channel import RECEIVE_CHUNK, Channel, connect_rank
from flodl.transports.memory_reader import MemoryReader
from flodl.transports.socket_stream import SocketStream
from flodl.wire.codec import EncodedMessage, FrameDecoder, FrameEncoder
from flodl.wire.handshake import (
    SERVER_HELLO_SIZE,
    SessionKeys,
    check_server_hello,
    make_client_hello,
)
from flodl.wire.messages import (
    TO_RANK_TAGS,
    Batch,
    Batches,
    Heartbeat,
    Message,
    Metrics,
    NewGroupReady,
    SyncAck,
    to_payload,
)

KEY = b"coordinator-scale-bench-key-0123"
RESULTS = Path(__file__).resolve().parent / "results" / "coordinator.json"

BATCH_PERIOD_S = 0.1
"""Each rank finishes a batch every 100 ms while it holds work (10 Batch/s)."""
HEARTBEAT_PERIOD_S = 1.0
DATASET_SIZE = 10**9
"""Samples per epoch: far more than a run of minutes can consume, so the run never ends."""
TARGET_P99_S = 0.050
TARGET_RANKS = 4096
MIN_BATCH_RATE_SHARE = 0.9
"""The target also needs >= 90% of the nominal Batch rate: a coordinator that only keeps its
latency low by slowing every window down does not sustain the load."""
PROBE_AHEAD_S = 0.050
WARMUP_ROUNDS = 2
WARMUP_LIMIT_S = 120.0
DEFAULT_COUNTS = (64, 128, 256, 512, 1024, 1536, 2048, 4096)
QUICK_COUNTS = (16, 64)

INPROCESS_LATENCY = (
    "message latency: trio time just before a simulated rank hands a message to its Channel, "
    "to the trio time the coordinator passes as `now` to CoordinatorMachine.on_message for it "
    "(matched per rank in FIFO order; includes the rank's own send queue, the memory stream, "
    "framing, HMAC and decoding, and every wait for the one shared core)."
)
SPLIT_LATENCY = (
    "message latency: CLOCK_MONOTONIC (time.perf_counter) in the generator process just before "
    "a simulated rank frames a message for its socket, carried in the message itself (Batch."
    "batch_loss, Heartbeat.step_count in us, Metrics.avg_loss, SyncAck.pre_norm), to the `now` "
    "the coordinator passes to CoordinatorMachine.on_message for it, converted to "
    "CLOCK_MONOTONIC (trio's clock is perf_counter plus a fixed offset). Includes the rank's "
    "send queue, the socket, framing, HMAC and decoding; Ready and NewGroupReady carry no "
    "stamp (they only occur during warm-up). The generator's own lag (metronome action start "
    "minus its scheduled time) is reported separately."
)
LATENCY_DEFINITION = (
    "message latency is send time to the `now` CoordinatorMachine.on_message receives (see each "
    "mode's latency_definition). timer lateness: wake time minus deadline of a probe task in the "
    "coordinator's process that sleeps in a cancel scope 50 ms ahead, as the coordinator's "
    "deadline loop does, plus the deadline loop's own wakes (on_tick time minus its cancel "
    "scope's deadline). Quantiles are nearest-rank over the measured window. The target is met "
    "when p99 of both is below 50 ms and ranks deliver >= 90% of 10 Batch/s."
)


# --- measurement ------------------------------------------------------------------------------


def quantile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of an ascending sequence (``nan`` when empty)."""
    if not ordered:
        return math.nan
    index = max(0, math.ceil(q * len(ordered)) - 1)
    return ordered[min(index, len(ordered) - 1)]


def summarize_ms(samples: Sequence[float]) -> dict[str, float | int]:
    """Count, p50, p99 and max of ``samples`` (seconds), in milliseconds."""
    ordered = sorted(samples)
    return {
        "count": len(ordered),
        "p50_ms": round(quantile(ordered, 0.50) * 1000.0, 3),
        "p99_ms": round(quantile(ordered, 0.99) * 1000.0, 3),
        "max_ms": round(ordered[-1] * 1000.0, 3) if ordered else math.nan,
    }


class Recorder:
    """Everything one run measures; recording is on only inside the measured window."""

    def __init__(self, ranks: int, clock_offset: float | None = None) -> None:
        self.sent_at: list[deque[float]] = [deque() for _ in range(ranks)]
        self.clock_offset = clock_offset
        """Split mode: trio time minus CLOCK_MONOTONIC in this process; send times then come
        from the stamps the messages carry (see :func:`stamp_of`), not from ``sent_at``."""
        self.measuring = False
        self.latency = array("d")
        self.latency_by_kind: dict[str, array[float]] = {}
        self.received = Counter[str]()
        """Messages the coordinator's machine processed in the window, by kind."""
        self.batch_reports = 0
        """Batch reports among them: one per Batch, one per entry of a Batches."""
        self.delivered = Counter[str]()
        """Messages ranks received from the coordinator in the window, by kind."""
        self.unstamped = 0
        """Split mode: messages processed in the window that carry no send stamp."""
        self.sent = Counter[str]()
        """Messages the simulated ranks sent in the window, by kind."""
        self.rank_lag = array("d")
        """How late the ranks' metronome ran each action (start time minus scheduled time)."""
        self.timer_lateness = array("d")
        self.deadline_lateness = array("d")
        self.machine_s = 0.0
        self.late_rank_ticks = 0
        self.unmatched = 0
        self.warm = trio.Event()
        self.all_connected_at: float | None = None
        self.first_round_at: float | None = None

    def count_sent(self, messages: Sequence[Message]) -> None:
        """A rank sent ``messages`` (counted inside the window)."""
        if self.measuring:
            sent = self.sent
            for message in messages:
                sent[type(message).__name__] += 1

    def sending(self, rank: int, messages: Sequence[Message], at: float) -> None:
        """``rank`` handed ``messages`` to its Channel at trio time ``at`` (in-process mode:
        their send times, matched in FIFO order by :meth:`processed`)."""
        self.count_sent(messages)
        self.sent_at[rank].extend(itertools.repeat(at, len(messages)))

    def processed(self, rank: int, message: Message, now: float) -> None:
        if self.clock_offset is not None:
            self._processed_stamped(message, now - self.clock_offset)
            return
        queue = self.sent_at[rank]
        if not queue:
            self.unmatched += 1
            return
        sent = queue.popleft()
        if self.measuring:
            kind = type(message).__name__
            self.received[kind] += 1
            self.batch_reports += _reports_in(message)
            self.latency.append(now - sent)
            self.latency_by_kind.setdefault(kind, array("d")).append(now - sent)

    def _processed_stamped(self, message: Message, monotonic_now: float) -> None:
        if not self.measuring:
            return
        kind = type(message).__name__
        self.received[kind] += 1
        self.batch_reports += _reports_in(message)
        sent = stamp_of(message)
        if sent is None:
            self.unstamped += 1
            return
        self.latency.append(monotonic_now - sent)
        self.latency_by_kind.setdefault(kind, array("d")).append(monotonic_now - sent)


def _reports_in(message: Message) -> int:
    """Batch reports ``message`` carries."""
    if isinstance(message, Batches):
        return len(message.batch_ms)
    return 1 if isinstance(message, Batch) else 0


# --- send stamps (split mode) -------------------------------------------------------------------
#
# Across processes the send time travels in the message itself, in a field the coordinator's
# machine never acts on for these synthetic ranks: Batch.batch_loss (the machine only sums it
# into an epoch's mean loss, and these epochs never end), Heartbeat.step_count (ignored by the
# machine; whole microseconds), Metrics.avg_loss (unread: the epoch loss comes from the Batch
# reports) and SyncAck.pre_norm (unread). CLOCK_MONOTONIC is one clock for every process of a
# Linux machine, and time.perf_counter reads it too (checked in `clock_check`).


_STAMP_FIELD: dict[type[Message], str] = {
    Batch: "batch_loss",
    Batches: "batch_loss",
    Heartbeat: "step_count",
    Metrics: "avg_loss",
    SyncAck: "pre_norm",
}
"""The field each kind carries its send time in (seconds; Heartbeat: whole microseconds)."""


def stamped_payload(message: Message, at: float) -> dict[str, Any]:
    """``message``'s fields as they go on the wire, carrying send time ``at`` (CLOCK_MONOTONIC
    seconds) where its kind has room for it."""
    fields = to_payload(message)
    name = _STAMP_FIELD.get(type(message))
    if isinstance(message, Batches):
        fields["batch_loss"] = [*message.batch_loss[:-1], at]  # the last entry's loss
    elif name is not None:
        fields[name] = round(at * 1e6) if name == "step_count" else at
    return fields


def stamped_frames(encoder: FrameEncoder, messages: Iterable[Message], at: float) -> bytes:
    """The frames of ``messages``, each stamped with ``at``: the library's framing around the
    stamped fields, so what the coordinator decodes is the stamped message (same tag)."""
    encode, dumps = encoder.encode, cbor2.dumps
    return b"".join(
        [
            encode(EncodedMessage(message, dumps(stamped_payload(message, at))))
            for message in messages
        ]
    )


def stamp_of(message: Message) -> float | None:
    """The send time :func:`stamped_payload` put into ``message`` (None: a kind it leaves
    alone)."""
    if isinstance(message, Batch):
        return message.batch_loss
    if isinstance(message, Batches):
        return message.batch_loss[-1]
    if isinstance(message, Heartbeat):
        return message.step_count / 1e6
    if isinstance(message, Metrics):
        return message.avg_loss
    if isinstance(message, SyncAck):
        return message.pre_norm
    return None


def clock_check() -> dict[str, str]:
    """How time.perf_counter and time.monotonic are implemented here (the same clock on Linux)."""
    return {
        name: time.get_clock_info(name).implementation for name in ("perf_counter", "monotonic")
    }


def trio_clock_offset() -> float:
    """trio.current_time() minus time.perf_counter() in this run, to within half a microsecond.

    trio's system clock is perf_counter plus a random offset fixed for the run.
    """
    best = math.inf
    offset = 0.0
    for _ in range(5):
        before = time.perf_counter()
        now = trio.current_time()
        after = time.perf_counter()
        if after - before < best:
            best = after - before
            offset = now - (before + after) / 2.0
    return offset


def instrument_machine(machine: CoordinatorMachine, recorder: Recorder) -> None:
    """Wrap the machine's entry points to time messages and the deadline loop's wakes.

    The shell calls these methods through the instance, so wrappers installed here see every
    call; behaviour is unchanged (each wrapper returns what the original returns).
    """
    on_message = machine.on_message
    on_tick = machine.on_tick
    next_deadline = machine.next_deadline
    cpu_clock = time.thread_time
    armed = [math.inf]  # the deadline loop's cancel-scope deadline: min of next_deadline() since

    def timed_on_message(rank: int, message: Message, now: float) -> list[Effect]:
        recorder.processed(rank, message, now)
        started = cpu_clock()
        effects = on_message(rank, message, now)
        if recorder.measuring:
            recorder.machine_s += cpu_clock() - started
        elif not recorder.warm.is_set() and machine.cycle.round >= WARMUP_ROUNDS:
            recorder.warm.set()
        if recorder.first_round_at is None and machine.cycle.round >= 1:
            recorder.first_round_at = now
        return effects

    def timed_on_tick(now: float) -> list[Effect]:
        if recorder.measuring and math.isfinite(armed[0]):
            recorder.deadline_lateness.append(now - armed[0])
        armed[0] = math.inf
        started = cpu_clock()
        effects = on_tick(now)
        if recorder.measuring:
            recorder.machine_s += cpu_clock() - started
        return effects

    def watched_next_deadline() -> float:
        deadline = next_deadline()
        armed[0] = min(armed[0], deadline)
        return deadline

    machine.on_message = timed_on_message  # type: ignore[method-assign]
    machine.on_tick = timed_on_tick  # type: ignore[method-assign]
    machine.next_deadline = watched_next_deadline  # type: ignore[method-assign]


class CpuSplit(trio.abc.Instrument):
    """CPU time of trio task steps, split into coordinator (``flodl.*``), ranks and the rest.

    Thread CPU time (not wall time), so other processes on a shared machine do not inflate
    it. What no task step covers (trio's scheduler, I/O polling, this instrument's own clock
    reads of about 1 us per step) is the process CPU time minus the sum of the steps.
    """

    CATEGORIES = ("coordinator", "ranks", "probe", "trio")

    def __init__(self) -> None:
        self.totals = dict.fromkeys(self.CATEGORIES, 0.0)
        self._category: dict[trio.lowlevel.Task, str] = {}
        self._started = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._started = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        took = time.thread_time() - self._started
        category = self._category.get(task)
        if category is None:
            category = self._category[task] = _category_of(task.name)
        self.totals[category] += took

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self._category.pop(task, None)

    def snapshot(self) -> dict[str, float]:
        return dict(self.totals)


def _category_of(name: str) -> str:
    if name.startswith("flodl."):
        return "coordinator"
    if "timer_probe" in name:
        return "probe"
    if "LeanRank" in name or "Metronome" in name:
        return "ranks"
    return "trio"


async def timer_probe(recorder: Recorder) -> None:
    """Sleep in a cancel scope until 50 ms ahead, again and again; record the lateness."""
    while True:
        deadline = trio.current_time() + PROBE_AHEAD_S
        with trio.CancelScope(deadline=deadline):
            await trio.sleep_forever()
        if recorder.measuring:
            recorder.timer_lateness.append(trio.current_time() - deadline)


# --- the simulated ranks: a RankMachine each, on a shared metronome ---------------------------


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

    def __init__(self, recorder: Recorder) -> None:
        self._pending: list[tuple[int, int, float, Callable[[float], None]]] = []
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


async def warm_up(recorder: Recorder, machine: CoordinatorMachine, ranks: int) -> None:
    """Wait for the warm-up (round ``WARMUP_ROUNDS`` started); RuntimeError saying where it
    stood after ``WARMUP_LIMIT_S``."""
    with trio.move_on_after(WARMUP_LIMIT_S):
        await recorder.warm.wait()
        return
    raise RuntimeError(
        f"{ranks} ranks: no warm-up within {WARMUP_LIMIT_S:g} s (phase {machine.phase.value}, "
        f"{len(machine.alive)} connected, {len(machine.members)} members, "
        f"round {machine.cycle.round})"
    )


def _next_grid_tick(now: float, phase: float, period: float) -> float:
    """The first time ``phase + k * period`` (k integer) strictly after ``now``."""
    tick = phase + (math.floor((now - phase) / period) + 1) * period
    # ``now`` on a tick can divide to just under k: that tick is not after it, the next is.
    return tick if tick > now else tick + period


# --- rows ---------------------------------------------------------------------------------------


def _base_row(
    ranks: int,
    recorder: Recorder,
    cpu: float,
    wall: float,
    sent: Counter[str],
    warmup_s: float,
    rounds: int,
    anchor: int,
    load_before: float,
) -> dict[str, Any]:
    """The figures both modes report (``sent``: what the ranks sent in the window)."""
    received = sum(recorder.received.values())
    latency = summarize_ms(recorder.latency)
    timer = summarize_ms(list(recorder.timer_lateness) + list(recorder.deadline_lateness))
    batch_rate = recorder.batch_reports / wall / ranks
    p99_worst = max(latency["p99_ms"], timer["p99_ms"])
    meets = (
        received > 0
        and p99_worst < TARGET_P99_S * 1000.0
        and batch_rate >= MIN_BATCH_RATE_SHARE / BATCH_PERIOD_S
    )
    return {
        "ranks": ranks,
        "seconds": round(wall, 3),
        "warmup_s": round(warmup_s, 3),
        "nominal_messages_per_s": round(ranks * (1 / BATCH_PERIOD_S + 1 / HEARTBEAT_PERIOD_S)),
        "offered_messages_per_s": round(sum(sent.values()) / wall, 1),
        "offered_by_kind": dict(sorted(sent.items())),
        "messages": received,
        "messages_per_s": round(received / wall, 1),
        "messages_by_kind": dict(sorted(recorder.received.items())),
        "sent_to_ranks_by_kind": dict(sorted(recorder.delivered.items())),
        "batch_per_rank_s": round(batch_rate, 3),
        "latency": latency,
        "latency_p99_ms_by_kind": {
            kind: summarize_ms(values)["p99_ms"]
            for kind, values in sorted(recorder.latency_by_kind.items())
        },
        "timer_lateness": timer,
        "deadline_loop_wakes": len(recorder.deadline_lateness),
        "rounds_started": rounds,
        "anchor": anchor,
        "cpu_s": round(cpu, 3),
        "cpu_share_of_wall": round(cpu / wall, 3),
        "cpu_us_per_message": round(cpu / received * 1e6, 2) if received else None,
        "cpu_us_per_rank_s": round(cpu / wall / ranks * 1e6, 2),
        "batch_reports": recorder.batch_reports,
        "meets_target": meets,
        "load_average_1m_before": round(load_before, 2),
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }


def _share(part: float, whole: float) -> float:
    return round(part / whole, 3) if whole > 0 else math.nan


def max_ranks_meeting_target(rows: Sequence[dict[str, Any]]) -> int:
    """The largest rank count that met the target (0 if none did)."""
    return max((row["ranks"] for row in rows if row["meets_target"]), default=0)


# --- in-process mode: coordinator and ranks share one trio run over memory:// -----------------

_run_names = itertools.count()


async def measure(ranks: int, seconds: float, seed: int, split: CpuSplit) -> dict[str, Any]:
    """Serve ``ranks`` lean ranks with one real coordinator; measure ``seconds`` after warm-up."""
    recorder = Recorder(ranks)
    rng = random.Random(seed)
    url = f"memory://coordinator-scale-{os.getpid()}-{next(_run_names)}"
    load_before = os.getloadavg()[0]
    started = trio.current_time()
    with trio.CancelScope() as everything:
        async with open_coordinator(
            url, ranks, KEY, CoordinatorConfig(), linger=0.0, freeze_heap=True
        ) as coord:
            machine = coord.machine
            instrument_machine(machine, recorder)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(timer_probe, recorder)
                metronome = Metronome(recorder)
                nursery.start_soon(metronome.run)
                rank_reader = MemoryReader()  # one task reads every simulated rank
                nursery.start_soon(rank_reader.run, name="LeanRank.reader")
                for rank in range(ranks):
                    lean = LeanRank(rank, ranks, recorder, metronome, rng)
                    nursery.start_soon(lean.run, coord.url, KEY, rank_reader)
                await warm_up(recorder, coord.machine, ranks)
                warm_at = trio.current_time()
                cpu_before, wall_before = time.process_time(), time.perf_counter()
                split_before = split.snapshot()
                recorder.measuring = True
                await trio.sleep(seconds)
                recorder.measuring = False
                cpu = time.process_time() - cpu_before
                wall = time.perf_counter() - wall_before
                split_after = split.snapshot()
                rounds = machine.cycle.round
                anchor = machine.elche.anchor
                # End the run first (hang-ups after the end are not deaths), then cancel the
                # coordinator and the ranks together, so no connection ends in an error.
                coord.request_stop(save=True)
                everything.cancel()
    steps = {k: split_after[k] - split_before[k] for k in split.CATEGORIES}
    row = _base_row(
        ranks, recorder, cpu, wall, recorder.sent, warm_at - started, rounds, anchor, load_before
    )
    received = row["messages"]
    coordinator_s = steps["coordinator"]
    row.update(
        {
            "unmatched_messages": recorder.unmatched,
            "rank_lag": summarize_ms(recorder.rank_lag),
            "late_rank_ticks": recorder.late_rank_ticks,
            "coordinator_cpu_us_per_message": round(coordinator_s / received * 1e6, 2)
            if received
            else None,
            "cpu_split_share": {
                "coordinator": _share(coordinator_s, cpu),
                "coordinator_machine": _share(recorder.machine_s, cpu),
                "ranks": _share(steps["ranks"], cpu),
                "probe": _share(steps["probe"], cpu),
                "other_tasks": _share(steps["trio"], cpu),
                "scheduler_and_io": _share(cpu - sum(steps.values()), cpu),
            },
        }
    )
    return row


def run_inprocess(ranks: int, seconds: float, seed: int) -> dict[str, Any]:
    """One rank count in a fresh trio run (with the CPU-split instrument installed)."""
    split = CpuSplit()
    gc.collect()
    row: dict[str, Any] = trio.run(measure, ranks, seconds, seed, split, instruments=[split])
    return row


# --- split mode: the coordinator alone in this process, the ranks in generator processes -------

GENERATOR_FLAG = "--generator-child"
CONNECT_AT_ONCE = 32
"""Ranks of one generator that connect and handshake at the same time (listener backlogs are
finite; a unix socket with a full backlog refuses rather than queues)."""
GENERATOR_REPLY_LIMIT_S = 30.0
GENERATOR_EXIT_GRACE_S = 10.0
GENERATOR_LAG_LIMIT_S = 0.050
"""A generator whose metronome runs this late at p99 is not keeping up with its schedule."""


@attrs.frozen
class CpuPlan:
    """Which cores the coordinator and the generators are pinned to (None: not pinned)."""

    coordinator: frozenset[int] | None
    generators: frozenset[int] | None

    def describe(self) -> str:
        if self.coordinator is None or self.generators is None:
            return "not pinned (--no-pin, no os.sched_setaffinity, or fewer than 2 usable cores)"
        return (
            f"os.sched_setaffinity: coordinator process on cores {sorted(self.coordinator)}, "
            f"load generators on cores {sorted(self.generators)}"
        )


def cpu_plan(pin: bool = True) -> CpuPlan:
    """The first usable core for the coordinator, the others for the generators."""
    if not pin or not hasattr(os, "sched_setaffinity"):
        return CpuPlan(None, None)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return CpuPlan(None, None)
    return CpuPlan(frozenset(cores[:1]), frozenset(cores[1:]))


class LineReader:
    """Newline-ended lines from a byte stream (the bench <-> generator control pipes)."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def next_line(self) -> bytes | None:
        """The next line without its newline; None at the end of the stream."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line = bytes(self._buffer[:end])
                del self._buffer[: end + 1]
                return line
            data = await self._stream.receive_some(65536)
            if not data:
                return None
            self._buffer += data


def partition_ranks(ranks: int, generators: int) -> list[range]:
    """``range(ranks)`` cut into ``generators`` contiguous parts of near-equal size."""
    bounds = [ranks * part // generators for part in range(generators + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(generators) if bounds[i + 1] > bounds[i]]


class GeneratorProcess:
    """One load-generator child process, driven over its stdin/stdout."""

    def __init__(self, process: trio.Process, ranks: range) -> None:
        self.process = process
        self.ranks = ranks
        self.finishing = False
        assert process.stdin is not None and process.stdout is not None
        self._stdin = process.stdin
        self._lines = LineReader(process.stdout)

    def __str__(self) -> str:
        return f"load generator for ranks {self.ranks.start}..{self.ranks.stop - 1}"

    async def command(self, word: str) -> None:
        await self._stdin.send_all(word.encode() + b"\n")

    async def stop(self) -> dict[str, Any]:
        """End its measured window; its figures for the window."""
        await self.command("stop")
        with trio.fail_after(GENERATOR_REPLY_LIMIT_S):
            line = await self._lines.next_line()
        if line is None:
            raise RuntimeError(f"{self} closed its output without reporting")
        stats: dict[str, Any] = json.loads(line)
        return stats

    async def watch(self) -> None:
        """Raise if the process exits before the bench lets it go."""
        returncode = await self.process.wait()
        if not self.finishing:
            raise RuntimeError(f"{self} exited early with code {returncode}")

    async def finish(self) -> None:
        """Close its stdin (it exits then) and wait up to the grace period for the exit."""
        self.finishing = True
        await self._stdin.aclose()
        with trio.move_on_after(GENERATOR_EXIT_GRACE_S):
            await self.process.wait()


@contextlib.asynccontextmanager
async def open_generators(
    url: str, world_size: int, seed: int, generators: int, cores: frozenset[int] | None
) -> AsyncIterator[list[GeneratorProcess]]:
    """Start ``generators`` child processes that together run ranks 0..world_size-1 at ``url``.

    On exit every child has exited: those that do not exit within the grace period after their
    stdin closed, and all of them when the block is cancelled or raises, are killed and reaped.
    A child that exits early, or with an error, raises RuntimeError.
    """
    started: list[GeneratorProcess] = []
    try:
        async with trio.open_nursery() as nursery:
            for part in partition_ranks(world_size, generators):
                command = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    GENERATOR_FLAG,
                    url,
                    f"--first={part.start}",
                    f"--count={len(part)}",
                    f"--world={world_size}",
                    f"--seed={seed}",
                ]
                if cores is not None:
                    command.append("--cores=" + ",".join(str(core) for core in sorted(cores)))
                process = await trio.lowlevel.open_process(
                    command, stdin=subprocess.PIPE, stdout=subprocess.PIPE
                )
                generator = GeneratorProcess(process, part)
                started.append(generator)
                nursery.start_soon(generator.watch)
            yield started
            for generator in started:
                await generator.finish()
            failed = [g for g in started if g.process.returncode != 0]
            if failed:
                codes = ", ".join(f"{g}: {g.process.returncode}" for g in failed)
                raise RuntimeError(f"load generators did not exit cleanly ({codes})")
    finally:
        with trio.CancelScope(shield=True):
            for generator in started:
                if generator.process.returncode is None:
                    generator.process.kill()
                await generator.process.wait()


async def measure_split(
    ranks: int, seconds: float, seed: int, transport: str, generators: int, plan: CpuPlan
) -> dict[str, Any]:
    """Serve ``ranks`` ranks run by generator processes; measure ``seconds`` after warm-up."""
    recorder = Recorder(ranks, clock_offset=trio_clock_offset())
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="flodl-scale-") as folder:
        url = f"unix://{folder}/coordinator.sock" if transport == "unix" else "tcp://127.0.0.1:0"
        started = trio.current_time()
        with trio.CancelScope() as everything:
            async with open_coordinator(
                url, ranks, KEY, CoordinatorConfig(), linger=0.0, freeze_heap=True
            ) as coord:
                machine = coord.machine
                instrument_machine(machine, recorder)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(timer_probe, recorder)
                    async with open_generators(
                        coord.url, ranks, seed, generators, plan.generators
                    ) as children:
                        await warm_up(recorder, machine, ranks)
                        warm_at = trio.current_time()
                        # The generators' windows open first (a pipe write each), so that the
                        # acks of the round whose start ended the warm-up fall in both windows.
                        for child in children:
                            await child.command("start")
                        cpu_before, wall_before = time.process_time(), time.perf_counter()
                        recorder.measuring = True
                        await trio.sleep(seconds)
                        recorder.measuring = False
                        cpu = time.process_time() - cpu_before
                        wall = time.perf_counter() - wall_before
                        reports = [await child.stop() for child in children]
                        rounds = machine.cycle.round
                        anchor = machine.elche.anchor
                        regroup = (
                            await membership_change(machine, children, ranks // 2)
                            if ranks >= MIN_RANKS_FOR_REGROUP
                            else None
                        )
                        # The ranks leave on the shutdown (closing a socket with unread data
                        # would reset it: let them read it all); then their processes exit.
                        coord.request_stop(save=True)
                        with trio.move_on_after(GENERATOR_EXIT_GRACE_S):
                            await coord.wait_all_hung_up()
                    everything.cancel()
    sent = Counter[str]()
    for part in reports:
        sent.update(part["sent_by_kind"])
    row = _base_row(
        ranks, recorder, cpu, wall, sent, warm_at - started, rounds, anchor, load_before
    )
    lag_p99 = max(part["lag"]["p99_ms"] for part in reports)
    kept_up = lag_p99 < GENERATOR_LAG_LIMIT_S * 1000.0
    row.update(
        {
            "membership_change": regroup,
            "transport": transport,
            "unstamped_messages": recorder.unstamped,
            "coordinator_machine_share": _share(recorder.machine_s, cpu),
            "generator_lag_p99_ms": lag_p99,
            "generator_cpu_share_of_wall": max(part["cpu_share_of_wall"] for part in reports),
            "generator_kept_up": kept_up,
            "verdict": "meets"
            if row["meets_target"]
            else ("misses" if kept_up else "generator_limited"),
            "generators": reports,
        }
    )
    return row


MIN_RANKS_FOR_REGROUP = 4
REGROUP_LIMIT_S = 30.0
REGROUP_POLL_S = 0.002


async def membership_change(
    machine: CoordinatorMachine, children: Sequence[GeneratorProcess], victim: int
) -> dict[str, Any]:
    """Kill simulated rank ``victim`` (its generator closes its socket) and time the
    coordinator's decision: the death detected (``RANK_DEAD``) to the next generation of the
    group committed (``GROUP_REFORMED``: the survivors' generator answered and every survivor
    was sent its NewGroupSession), in trio time, as the machine's own ``took_s`` records it.
    Also the wall time from the kill command to the commit, and the coordinator's CPU time
    over it (timeline polled every 2 ms, so the wall figures are up to that late)."""
    seq = machine.timeline.added
    child = next(c for c in children if victim in c.ranks)
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    killed_at = trio.current_time()
    await child.command(f"kill {victim}")
    dead_at: float | None = None
    formed: TimelineEvent | None = None
    with trio.move_on_after(REGROUP_LIMIT_S):
        while formed is None:
            await trio.sleep(REGROUP_POLL_S)
            for _, event in machine.timeline.since(seq):
                if event.kind is EventKind.RANK_DEAD and event.detail.get("rank") == victim:
                    dead_at = event.time
                elif event.kind is EventKind.GROUP_REFORMED:
                    formed = event
                    break
    wall = time.perf_counter() - wall_before
    cpu = time.process_time() - cpu_before
    took = None if formed is None else formed.detail.get("took_s")
    return {
        "killed_rank": victim,
        "committed": formed is not None,
        "decision_s": None if took is None else round(took, 4),
        "decision_is": "RANK_DEAD to GROUP_REFORMED (trio time, the machine's took_s)",
        "kill_to_dead_s": None if dead_at is None else round(dead_at - killed_at, 4),
        "kill_to_commit_wall_s": round(wall, 4) if formed is not None else None,
        "coordinator_cpu_s": round(cpu, 4),
        "generation": None if formed is None else formed.detail.get("generation"),
        "members_after": None if formed is None else len(formed.detail.get("members", [])),
    }


def run_split(
    ranks: int, seconds: float, seed: int, transport: str, generators: int, plan: CpuPlan
) -> dict[str, Any]:
    """One rank count in a fresh trio run, this process pinned to the coordinator's core."""
    before = os.sched_getaffinity(0) if plan.coordinator is not None else None
    if plan.coordinator is not None:
        os.sched_setaffinity(0, plan.coordinator)
    try:
        gc.collect()
        row: dict[str, Any] = trio.run(
            measure_split, ranks, seconds, seed, transport, generators, plan
        )
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
    return row


def profile(run: Callable[[], object], top: int) -> None:
    """Run one count under cProfile and print the hottest functions of this process (own time);
    in split mode that is the coordinator alone."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats(pstats.SortKey.TIME).print_stats(top)
    stats.sort_stats(pstats.SortKey.CUMULATIVE).print_stats("flodl", top)


# --- the split mode's load generator: simulated ranks on raw non-blocking sockets --------------
#
# The generator is the load, not the system under test: it must keep its schedule at 1,024
# ranks on one core, or the coordinator sees bursts a real cluster would not send. So its ranks
# skip the parts of a real worker that the coordinator cannot see: after the handshake each
# rank's socket is a plain non-blocking socket; one task waits on an epoll set of all of them,
# and a rank's frames are written at once with a plain send. Framing is the library's own
# (FrameEncoder, FrameDecoder) and every rank is a RankLoop around a RankMachine, as in the
# in-process mode.

RECEIVE_AT_ONCE = 16
"""Sockets the generator reads before it lets its metronome run (a checkpoint). When a window
ends every rank has messages at once, and each costs its machine tens of microseconds: 16
keep the metronome's wait to about a millisecond, so the ranks' ticks stay on schedule."""


class WireRank:
    """One simulated rank of the generator: its :class:`RankLoop` over a raw socket. Frames
    from the coordinator are decoded into messages for the machine; what the machine sends
    is stamped with its send time and framed as it is written (:func:`stamped_frames`)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        hub: WireGenerator,
        sock: socket.socket,
        keys: SessionKeys,
        batch_phase: float,
        heartbeat_phase: float,
    ) -> None:
        self.rank = rank
        self.hub = hub
        self.sock = sock
        self.encoder = FrameEncoder(keys.to_coordinator)
        self.decoder = FrameDecoder(keys.to_rank, allowed_tags=TO_RANK_TAGS)
        self.unsent = bytearray()
        """Bytes the socket did not take yet (written when it is writable again)."""
        self.open = True
        self.heartbeat_phase = heartbeat_phase
        self.loop = RankLoop(rank, world_size, batch_phase, hub.recorder, self._schedule)

    def _schedule(self, when: float) -> None:
        self.hub.metronome.at(when, self.tick)

    def start(self) -> None:
        """Announce the job; heartbeats from the rank's phase on."""
        now = trio.current_time()
        self.send(self.loop.start(now))
        self.hub.metronome.at(now + self.heartbeat_phase, self.heartbeat)

    def tick(self, now: float) -> None:
        if self.open:
            self.send(self.loop.tick(now))

    def heartbeat(self, now: float) -> None:
        if not self.open or self.loop.over:
            return
        self.hub.metronome.at(now + HEARTBEAT_PERIOD_S, self.heartbeat)
        self.send(self.loop.heartbeat(now))

    def received(self, data: bytes, now: float) -> None:
        """Act on the bytes that arrived, message by message."""
        self.decoder.feed(data)
        messages: list[Message] = []
        self.decoder.read_into(messages)
        recorder, loop = self.hub.recorder, self.loop
        for message in messages:
            if recorder.measuring:
                recorder.delivered[type(message).__name__] += 1
            self.send(loop.receive(message, now))
            if not self.open:
                return

    def send(self, messages: Sequence[Message]) -> None:
        """Write ``messages``, stamped now; after the goodbye, hang up once it is written."""
        if not self.open:
            return
        if messages:
            self.hub.write(self, stamped_frames(self.encoder, messages, time.perf_counter()))
            self.hub.recorder.count_sent(messages)
        if self.loop.over:
            self.hub.hang_up(self)


class WireGenerator:
    """The generator's ranks, their sockets (one epoll set) and their metronome."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.metronome = Metronome(recorder)
        self._epoll = select.epoll()
        self._by_fd: dict[int, WireRank] = {}
        self._hanging_up: set[WireRank] = set()
        """Ranks that said goodbye and close once their unsent bytes are written."""

    def add(self, rank: WireRank) -> None:
        self._by_fd[rank.sock.fileno()] = rank
        self._epoll.register(rank.sock.fileno(), select.EPOLLIN)

    def write(self, rank: WireRank, data: bytes) -> None:
        """Write ``data`` now, or queue it behind bytes the socket has not taken yet."""
        if rank.unsent:
            rank.unsent += data
            return
        try:
            sent = rank.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self.close(rank)
            return
        if sent < len(data):
            rank.unsent += data[sent:]
            self._epoll.modify(rank.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)

    def _flush(self, rank: WireRank) -> None:
        try:
            sent = rank.sock.send(rank.unsent)
        except BlockingIOError:
            return
        except OSError:
            self.close(rank)
            return
        del rank.unsent[:sent]
        if not rank.unsent:
            if rank in self._hanging_up:
                self.close(rank)
            else:
                self._epoll.modify(rank.sock.fileno(), select.EPOLLIN)

    def hang_up(self, rank: WireRank) -> None:
        """Close ``rank``'s socket once everything it sent is written."""
        if not rank.unsent:
            self.close(rank)
        else:
            self._hanging_up.add(rank)

    def close(self, rank: WireRank) -> None:
        self._hanging_up.discard(rank)
        if rank.open:
            rank.open = False
            del self._by_fd[rank.sock.fileno()]
            self._epoll.unregister(rank.sock.fileno())
            rank.sock.close()

    def close_all(self) -> None:
        for rank in list(self._by_fd.values()):
            self.close(rank)
        self._epoll.close()

    async def serve(self) -> None:
        """Read every socket that is ready, a few dozen between checkpoints; until cancelled."""
        epoll = self._epoll
        while True:
            await trio.lowlevel.wait_readable(epoll.fileno())
            events = epoll.poll(0)
            for start in range(0, len(events), RECEIVE_AT_ONCE):
                if start:
                    await trio.lowlevel.checkpoint()
                now = trio.current_time()
                for fd, flags in events[start : start + RECEIVE_AT_ONCE]:
                    rank = self._by_fd.get(fd)
                    if rank is not None:
                        self._ready(rank, flags, now)

    def _ready(self, rank: WireRank, flags: int, now: float) -> None:
        if flags & select.EPOLLOUT and rank.unsent:
            self._flush(rank)
        if not flags & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) or not rank.open:
            return
        try:
            data = rank.sock.recv(RECEIVE_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close(rank)
            return
        rank.received(data, now)


async def open_wire_rank(
    url: str, key: bytes, rank: int, world_size: int
) -> tuple[socket.socket, SessionKeys]:
    """Connect and complete the handshake for ``rank``; its socket (non-blocking) and keys."""
    stream = await connect(url)
    try:
        hello, state = make_client_hello(key, rank, world_size)
        await stream.send_all(hello)
        reply = b""
        while len(reply) < SERVER_HELLO_SIZE:
            data = await stream.receive_some(SERVER_HELLO_SIZE - len(reply))
            if not data:
                raise RuntimeError(f"rank {rank}: the coordinator hung up during the handshake")
            reply += data
        keys = check_server_hello(reply, state)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    assert isinstance(stream, SocketStream)
    return stream.socket, keys


# --- the generator child process --------------------------------------------------------------


async def run_generator(url: str, ranks: range, world_size: int, seed: int) -> None:
    """Run ``ranks`` (stamping their messages) until stdin ends; answer start/stop on stdio.

    ``start`` opens the measured window; ``stop`` closes it and prints one JSON line with the
    generator's figures for it. Phases are drawn for all ranks in order, as the in-process
    mode does, so a rank has the same phases in both modes.
    """
    recorder = Recorder(world_size)
    hub = WireGenerator(recorder)
    rng = random.Random(seed)
    phases = [
        (rng.uniform(0.0, BATCH_PERIOD_S), rng.uniform(0.0, HEARTBEAT_PERIOD_S))
        for _ in range(world_size)
    ]
    limiter = trio.CapacityLimiter(CONNECT_AT_ONCE)
    wires: dict[int, WireRank] = {}
    control = LineReader(trio.lowlevel.FdStream(os.dup(sys.stdin.fileno())))

    async def join(rank: int) -> None:
        async with limiter:
            sock, keys = await open_wire_rank(url, KEY, rank, world_size)
        wire = WireRank(rank, world_size, hub, sock, keys, *phases[rank])
        wires[rank] = wire
        hub.add(wire)
        wire.start()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.metronome.run)
            nursery.start_soon(hub.serve)
            for rank in ranks:
                nursery.start_soon(join, rank)
            cpu_before = wall_before = 0.0
            while (line := await control.next_line()) is not None:
                if line == b"start":
                    cpu_before, wall_before = time.process_time(), time.perf_counter()
                    recorder.measuring = True
                elif line.startswith(b"kill "):
                    # The rank's process dies: its socket closes with no goodbye.
                    hub.close(wires[int(line.split()[1])])
                elif line == b"stop":
                    recorder.measuring = False
                    cpu = time.process_time() - cpu_before
                    wall = time.perf_counter() - wall_before
                    stats = {
                        "pid": os.getpid(),
                        "first_rank": ranks.start,
                        "ranks": len(ranks),
                        "cores": sorted(os.sched_getaffinity(0)),
                        "seconds": round(wall, 3),
                        "cpu_s": round(cpu, 3),
                        "cpu_share_of_wall": round(cpu / wall, 3),
                        "sent_per_s": round(sum(recorder.sent.values()) / wall, 1),
                        "sent_by_kind": dict(sorted(recorder.sent.items())),
                        "received_by_kind": dict(sorted(recorder.delivered.items())),
                        "lag": summarize_ms(recorder.rank_lag),
                        "late_rank_ticks": recorder.late_rank_ticks,
                    }
                    print(json.dumps(stats), flush=True)
            nursery.cancel_scope.cancel()
    finally:
        hub.close_all()


def generator_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description="load generator of the coordinator scale bench")
    parser.add_argument("url")
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--cores", help="comma-separated cores to pin this process to")
    args = parser.parse_args(argv)
    if args.cores:
        os.sched_setaffinity(0, {int(core) for core in args.cores.split(",")})
    gc.collect()
    ranks = range(args.first, args.first + args.count)
    trio.run(run_generator, args.url, ranks, args.world, args.seed)
    return 0


# --- report -------------------------------------------------------------------------------------


def environment() -> dict[str, object]:
    return benchenv.environment(
        ("trio", "cbor2", "attrs", "flodl"),
        usable_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        clocks=clock_check(),
    )


def _at_target(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return next((r for r in rows if r["ranks"] == TARGET_RANKS), rows[-1])


def mode_section(
    mode: str, rows: Sequence[dict[str, Any]], seconds: float, seed: int, **extra: Any
) -> dict[str, Any]:
    """One mode's results, with how and when they were taken."""
    reference = _at_target(rows)
    return {
        "max_ranks_meeting_target": max_ranks_meeting_target(rows),
        "cpu_us_per_message": reference["cpu_us_per_message"],
        "cpu_us_per_message_at_ranks": reference["ranks"],
        "latency_definition": SPLIT_LATENCY if mode == "split" else INPROCESS_LATENCY,
        "seconds_per_count": seconds,
        "seed": seed,
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
        "counts": list(rows),
        "environment": environment(),
    }


def report(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON document: headline keys from the split mode (the coordinator alone on its core)
    and the in-process mode, then each mode's section."""
    split = modes.get("split")
    inprocess = modes.get("inprocess")
    inprocess_reference = _at_target(inprocess["counts"]) if inprocess else None
    met = split is not None and split["max_ranks_meeting_target"] >= TARGET_RANKS
    return {
        "max_ranks_meeting_target": split["max_ranks_meeting_target"] if split else None,
        "cpu_us_per_message": split["cpu_us_per_message"] if split else None,
        "cpu_us_per_message_at_ranks": split["cpu_us_per_message_at_ranks"] if split else None,
        "cpu_us_per_message_is": "the coordinator process alone (split mode): "
        "time.process_time / messages its machine processed",
        "inprocess_max_ranks_meeting_target": inprocess["max_ranks_meeting_target"]
        if inprocess
        else None,
        "inprocess_cpu_us_per_message": inprocess["cpu_us_per_message"] if inprocess else None,
        "inprocess_coordinator_cpu_us_per_message": inprocess_reference[
            "coordinator_cpu_us_per_message"
        ]
        if inprocess_reference
        else None,
        "target": {
            "ranks": TARGET_RANKS,
            "p99_ms_below": TARGET_P99_S * 1000.0,
            "min_batch_per_rank_s": MIN_BATCH_RATE_SHARE / BATCH_PERIOD_S,
            "met_at_target_ranks": met,
        },
        "latency_definition": LATENCY_DEFINITION,
        "load": {
            "batch_per_rank_s": 1 / BATCH_PERIOD_S,
            "heartbeat_per_rank_s": 1 / HEARTBEAT_PERIOD_S,
            "config": "CoordinatorConfig() defaults (cadence policy, anchor 10)",
            "warmup": f"until all ranks joined and round {WARMUP_ROUNDS} started",
        },
        "modes": modes,
    }


def print_table(mode: str, rows: Sequence[dict[str, Any]], header: bool = True) -> None:
    extra = "gen lag99 gen cpu" if mode == "split" else "  coord share"
    if header:
        print(
            f"[{mode}] {'ranks':>6} {'offered':>8} {'msg/s':>8} {'B/rank/s':>8} {'p50 ms':>7}"
            f" {'p99 ms':>7} {'max ms':>8} {'timer p99':>9} {'cpu us/msg':>10} {extra} ok"
        )
    for r in rows:
        lat, timer = r["latency"], r["timer_lateness"]
        if mode == "split":
            tail = f"{r['generator_lag_p99_ms']:>9.1f} {r['generator_cpu_share_of_wall']:>7.2f}"
            ok = r["verdict"]
        else:
            tail = f"{r['cpu_split_share']['coordinator']:>13.2f}"
            ok = "yes" if r["meets_target"] else "no"
        print(
            f"[{mode}] {r['ranks']:>6} {r['offered_messages_per_s']:>8.0f}"
            f" {r['messages_per_s']:>8.0f} {r['batch_per_rank_s']:>8.2f}"
            f" {lat['p50_ms']:>7.2f} {lat['p99_ms']:>7.2f} {lat['max_ms']:>8.2f}"
            f" {timer['p99_ms']:>9.2f} {r['cpu_us_per_message']:>10.1f} {tail} {ok}",
            flush=True,
        )


def previous_modes(path: Path) -> dict[str, dict[str, Any]]:
    """The mode sections of an earlier result file (kept for modes this run does not redo)."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    modes = earlier.get("modes") if isinstance(earlier, dict) else None
    return dict(modes) if isinstance(modes, dict) else {}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [GENERATOR_FLAG]:
        return generator_main(argv[1:])
    parser = argparse.ArgumentParser(description="flodl coordinator scale benchmark")
    parser.add_argument(
        "--mode",
        choices=("both", "split", "inprocess"),
        default="both",
        help="split: coordinator alone in this process, ranks in generator processes; "
        "inprocess: both in one trio run over memory:// (default: both, split first)",
    )
    parser.add_argument("--ranks", type=int, nargs="+", help="rank counts to sweep")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per count")
    parser.add_argument("--quick", action="store_true", help=f"counts {QUICK_COUNTS}, 2 s each")
    parser.add_argument("--seed", type=int, default=0, help="phases of the simulated ranks")
    parser.add_argument("--transport", choices=("unix", "tcp"), default="unix", help="split mode")
    parser.add_argument(
        "--generators", type=int, default=1, help="split mode: load-generator processes"
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="split mode: leave core placement to the OS"
    )
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--profile",
        type=int,
        metavar="RANKS",
        help="cProfile one count instead (split mode unless --mode inprocess)",
    )
    parser.add_argument("--top", type=int, default=30, help="functions to print with --profile")
    args = parser.parse_args(argv)
    seconds = 2.0 if args.quick and args.seconds == 10.0 else args.seconds
    plan = cpu_plan(pin=not args.no_pin)
    if args.profile:
        if args.mode == "inprocess":
            profile(
                lambda: trio.run(measure, args.profile, seconds, args.seed, CpuSplit()), args.top
            )
        else:
            split_args = (args.seed, args.transport, args.generators, plan)
            profile(lambda: run_split(args.profile, seconds, *split_args), args.top)
        return 0
    counts = args.ranks or (QUICK_COUNTS if args.quick else DEFAULT_COUNTS)
    modes = previous_modes(args.output)
    if args.mode in ("both", "split"):
        rows: list[dict[str, Any]] = []
        for ranks in counts:
            rows.append(run_split(ranks, seconds, args.seed, args.transport, args.generators, plan))
            print_table("split", rows[-1:], header=len(rows) == 1)
        modes["split"] = mode_section(
            "split",
            rows,
            seconds,
            args.seed,
            transport=f"{args.transport}://" + (" (127.0.0.1)" if args.transport == "tcp" else ""),
            generators=args.generators,
            pinning=plan.describe(),
        )
    if args.mode in ("both", "inprocess"):
        rows = []
        for ranks in counts:
            rows.append(run_inprocess(ranks, seconds, args.seed))
            print_table("inprocess", rows[-1:], header=len(rows) == 1)
        modes["inprocess"] = mode_section(
            "inprocess",
            rows,
            seconds,
            args.seed,
            transport="memory://",
            pinning="not pinned (one thread: at most one core)",
            cpu="time.process_time over the measured window (coordinator and ranks together); "
            "cpu_split_share from a trio instrument timing task steps (time.thread_time)",
        )
    result = report(dict(sorted(modes.items(), key=lambda item: item[0] != "split")))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"split: max_ranks_meeting_target={result['max_ranks_meeting_target']}, "
        f"cpu_us_per_message={result['cpu_us_per_message']} "
        f"(at {result['cpu_us_per_message_at_ranks']} ranks); in-process: "
        f"{result['inprocess_max_ranks_meeting_target']} ranks, "
        f"{result['inprocess_cpu_us_per_message']} us/msg; "
        f"load average {os.getloadavg()[0]:.2f}; wrote {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
