"""Coordinator scale benchmark: how many ranks one coordinator serves on one core.

Run from the repository root: ``python -m bench.scale`` (``--help`` for the options). Writes
bench/results/coordinator.json and prints a short table. The parts: :mod:`.record` (what is
measured, and the probe that times the coordinator's machine), :mod:`.stamps` (send times
across processes), :mod:`.ranks` (the simulated ranks), :mod:`.sockets` and :mod:`.generator`
(the split mode's load generators), :mod:`.hosts` (the agents layout: the generator's ranks
behind simulated node agents, one connection per host), :mod:`.modes` (the measurements),
:mod:`.report` (rows, targets, JSON) and :mod:`.__main__` (the command line).

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
  cancel scope held, as the coordinator's probe reports them), though in steady state it
  rarely wakes.
* The target is met when p99 of both latencies is under 50 ms and the ranks still deliver at
  least 90% of the nominal batch rate (9 batch reports/s per rank).
* **CPU**: ``time.process_time`` over the window per rank per second (``cpu_us_per_rank_s``:
  what a rank costs the coordinator, independent of how its reports are framed) and divided
  by the messages the coordinator received (``cpu_us_per_message``; in-process, ranks and
  coordinator share the core, so this includes the ranks' own machines and encoding), and
  the coordinator's share: the CPU time of trio task steps of ``flodl.*`` tasks (the
  coordinator's readers, writers, heartbeat and deadline loops), measured with a trio
  instrument; ``machine`` is the part spent inside the decision machine's calls (``on_message``
  and ``on_tick``, as the coordinator's probe times them: :class:`.record.MachineTimer`).

The library's one-clock rule is for flodl/; this bench also reads time.perf_counter (wall),
time.process_time and time.thread_time (CPU). The machine may be shared: other processes
stretch latencies (not the CPU figures); each row records the load average after it.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The benches share helpers (bench/benchenv.py) as top-level modules next to their scripts:
# bench/ is no package, so a script run as a file sees them and this package needs the folder
# on the path.
_BENCH = str(Path(__file__).resolve().parents[1])
if _BENCH not in sys.path:
    sys.path.append(_BENCH)
