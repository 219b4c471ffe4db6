"""What one run measures: the recorder, nearest-rank quantiles, the machine's timer (the
coordinator's probe), the CPU split of trio task steps and the timer probe task."""

from __future__ import annotations

import itertools
import math
import time
from array import array
from collections import Counter, deque
from collections.abc import Sequence

import trio
import trio.lowlevel

from flodl.coordinator.probe import ShellProbe
from flodl.core.coordinator.machine import CoordinatorMachine
from flodl.wire.messages import Batch, Batches, Message

from .stamps import stamp_of

PROBE_AHEAD_S = 0.050
WARMUP_ROUNDS = 2


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


class MachineTimer(ShellProbe):
    """Times the coordinator's machine calls for ``recorder``: the shell's probe
    (:mod:`flodl.coordinator.probe`), set on the coordinator serving the measured ranks.

    Each message the machine handled is matched to its send time (:meth:`Recorder.processed`)
    and, in the window, its CPU time counted; the deadline task's wakes are recorded as the
    tick's ``now`` minus the deadline the task slept for. It also notices the warm-up's end
    (round :data:`WARMUP_ROUNDS` started) and the first round.
    """

    def __init__(self, recorder: Recorder, machine: CoordinatorMachine) -> None:
        self.recorder = recorder
        self.machine = machine

    def message_handled(self, rank: int, message: Message, now: float, cpu_s: float) -> None:
        recorder, cycle = self.recorder, self.machine.cycle
        recorder.processed(rank, message, now)
        if recorder.measuring:
            recorder.machine_s += cpu_s
        elif not recorder.warm.is_set() and cycle.round >= WARMUP_ROUNDS:
            recorder.warm.set()
        if recorder.first_round_at is None and cycle.round >= 1:
            recorder.first_round_at = now

    def ticked(self, now: float, deadline: float, cpu_s: float) -> None:
        recorder = self.recorder
        if recorder.measuring:
            recorder.deadline_lateness.append(now - deadline)
            recorder.machine_s += cpu_s


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
