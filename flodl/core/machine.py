"""The coordinator's decisions, composed: one pure state machine driven by events and time.

:class:`CoordinatorMachine` wires ElChe (cadence), a guard, the averaging cycle, liveness,
rendezvous and the epoch chunk pools into the behaviour of a floDl coordinator. The trio shell
(:mod:`flodl.coordinator`) feeds it events with the current time and performs the effects it
returns; the machine never waits, sleeps or sends. That makes every rule testable with plain
calls, and lets one process simulate thousands of ranks.

Lifecycle (:class:`RunPhase`): JOINING (every rank connects and sends
:class:`~flodl.wire.messages.Ready`) -> FORMING (generation 0 of the group: RequestNewGroup /
NewGroupReady / NewGroupSession) -> TRAINING (windows of ElChe counts; a round averages them)
<-> REFORMING (after a death the survivors form the next generation, then redo the interrupted
round) -> FINISHED (all epochs done and Shutdown sent, or a ShutdownWithSave because the run
cannot go on).

Work protocol (what ranks must do, see also :mod:`flodl.core.partitions`): a rank works through
the sample ranges it is given (StartEpoch, ExtendPartition) in order, one ``Batch`` report per
finished batch; when it has nothing left it sends one ``Metrics`` report for the chunk it just
finished (its *completion frame*, carrying the chunk's delivered wall time) and waits. After a
collective it bumps its step count, so its next report acknowledges the round.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from flodl.core.cycle import Cycle, Policy
from flodl.core.effects import Broadcast, Send
from flodl.core.elche import ElChe, RankWindow, elche_for_world
from flodl.core.epochs import EpochTallies
from flodl.core.fill import IdleFill
from flodl.core.guards import Guard, make_guard
from flodl.core.job import Job
from flodl.core.liveness import Liveness, LossCause, RankLost, unrecoverable_reason
from flodl.core.partitions import ChunkPool
from flodl.core.rendezvous import Rendezvous
from flodl.core.settings import MachineSettings
from flodl.core.timeline import EventKind, Timeline
from flodl.core.workload import Workload, span_batches
from flodl.wire.messages import (
    Batch,
    CheckpointResult,
    DeclareDead,
    Exiting,
    Heartbeat,
    Intent,
    IntentKind,
    LrUpdate,
    Message,
    Metrics,
    NewGroupReady,
    Note,
    Ready,
    SaveReason,
    Shutdown,
    ShutdownWithSave,
    SyncAck,
)
from flodl.wire.messages import Checkpoint as CheckpointRequest


@attrs.frozen
class Disconnect:
    """Close ``rank``'s connection (it misbehaved); the shell then reports the disconnect."""

    rank: int
    reason: str


Effect = Send | Broadcast | Disconnect


class RunPhase(enum.Enum):
    """Where the run is (see the module docstring); ElChe's calibration phase is another thing,
    :class:`flodl.core.phases.Phase`."""

    JOINING = "joining"
    FORMING = "forming"
    TRAINING = "training"
    REFORMING = "reforming"
    FINISHED = "finished"


class Status(enum.Enum):
    RUNNING = "running"
    COMPLETED = "completed"
    SAVED = "saved"
    FAILED = "failed"


@attrs.frozen
class Outcome:
    """How the run ended (``status`` RUNNING until it has)."""

    status: Status
    save_reason: SaveReason | None = None
    message: str = ""


@attrs.frozen
class ResumeState:
    """Where a resumed run starts: from a checkpoint's meta (see flodl.checkpoint)."""

    epoch: int = 0
    global_step: int = 0
    sync_round: int = 0
    elche_state: Mapping[str, Any] | None = None


@attrs.define
class RankStats:
    """Per-rank counters kept for summaries."""

    batches: int = 0
    syncs: int = 0
    last_loss: float = math.nan
    lr: float | None = None
    joined_at: float | None = None
    lost_at: float | None = None
    loss_cause: str | None = None


@attrs.define
class _Window:
    """What one rank did in the current window (reset at each round)."""

    batches: int = 0
    fill_ms: float = 0.0
    compute_ms: float = 0.0
    delivered_ms: float = 0.0
    chunk_reports: int = 0


class CoordinatorMachine:
    """All of the coordinator's decisions for a run of ``world_size`` ranks.

    Every ``on_*`` method takes the current time and returns the effects to perform, in order.
    ``next_deadline()`` says when :meth:`on_tick` must be called at the latest if nothing else
    happens. Misbehaving ranks are answered with a :class:`Disconnect` effect, never an
    exception: the machine keeps serving the honest ranks.
    """

    def __init__(
        self,
        world_size: int,
        settings: MachineSettings,
        *,
        now: float,
        local_ranks: frozenset[int] = frozenset(),
        seed: int = 0,
        join_timeout: float = 300.0,
        resume: ResumeState | None = None,
    ) -> None:
        self.world_size = world_size
        self.settings = settings
        self.seed = seed
        self.timeline = Timeline()
        self.phase = RunPhase.JOINING
        self.outcome = Outcome(Status.RUNNING)
        self.job: Job | None = None
        self.stats = [RankStats() for _ in range(world_size)]
        self.epoch_results: list[dict[str, Any]] = []
        policy = settings.policy
        timeouts = settings.timeouts
        self._progressive = policy is not Policy.SYNC
        # Sync runs windows of exactly one batch per rank through the count trigger, so the
        # epoch's tail (where some ranks get no batch) is handled by the quiesced exemption.
        self.cycle = Cycle(
            world_size,
            Policy.ASYNC if policy is Policy.ASYNC else Policy.CADENCE,
            global_step=0 if resume is None else resume.global_step,
            round=0 if resume is None else resume.sync_round,
            reduce_stall_ceiling=timeouts.reduce_stall,
            heartbeat_timeout=timeouts.heartbeat,
            max_batch_diff=settings.cadence.max_batch_diff,
        )
        self.liveness = Liveness(world_size, heartbeat_timeout=timeouts.heartbeat, now=now)
        self.rendezvous = Rendezvous(
            world_size, local_ranks=local_ranks, retry_timeout=timeouts.rendezvous_retry
        )
        self.guard: Guard = make_guard(settings.guard, settings.trend_threshold)
        self.elche = self._new_elche(world_size)
        self.members: tuple[int, ...] = ()
        self._member_set: frozenset[int] = frozenset()
        """``members`` as a set: membership tests run on every report."""
        self._elche_ranks: list[int] = []
        """Global rank of each ElChe index (survivors keep their order; joiners are appended)."""
        self._joiners: set[int] = set()
        """Ranks that reconnected after a death and wait for the next round to rejoin."""
        self._resume = resume
        self.work: Workload | None = None
        self._ready: set[int] = set()
        self._plan = [0] * world_size
        self._windows = [_Window() for _ in range(world_size)]
        self._awaiting_completion: set[int] = set()
        self._filling: set[int] = set()
        """Ranks running an extra batch of the idle fill: the round waits for it."""
        self._window_wait_until: float | None = None
        self._idle_fill = IdleFill()
        self._divergences: list[float] = []
        self._tallies = EpochTallies()
        self._join_deadline: float | None = now + join_timeout
        self._shutdown_pending = False
        self._checkpoint_requests: set[int] = set()
        self._checkpoint_version = 0
        self._formed_generation: int | None = None

    # --- construction helpers -------------------------------------------------------------

    def _initial_elche(self, size: int) -> ElChe:
        if self._resume is not None and self._resume.elche_state is not None:
            return elche_for_world(self._resume.elche_state, size)
        return self._new_elche(size)

    def _new_elche(self, size: int) -> ElChe:
        c = self.settings.cadence
        return ElChe(
            max(size, 1),
            anchor=c.anchor,
            max_anchor=c.max_anchor,
            overhead_target=c.overhead_target,
            max_batch_diff=c.max_batch_diff,
            sync_policy=self.settings.policy is Policy.SYNC,
            relax_up_on_stable=c.relax_up,
        )

    # --- queries --------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.phase is RunPhase.FINISHED

    @property
    def alive(self) -> frozenset[int]:
        return self.liveness.alive

    def counts(self) -> dict[int, int]:
        """ElChe's batch count per member (global rank -> batches per window)."""
        if self.settings.policy is Policy.SYNC:
            return dict.fromkeys(self.members, 1)
        counts = self.elche.batch_counts
        return {rank: counts[i] for i, rank in enumerate(self._elche_ranks)}

    def ms_per_batch(self) -> dict[int, float]:
        smoothed = self.elche.smoothed_ms
        return {
            rank: ms for rank, ms in zip(self._elche_ranks, smoothed, strict=True) if ms is not None
        }

    def next_deadline(self) -> float:
        """The latest time at which :meth:`on_tick` must run (``inf`` when nothing is due).

        Called after every batch of reports, so it avoids building lists.
        """
        if self.finished:
            return math.inf
        best = math.inf
        for deadline in (
            self.liveness.next_deadline(),
            self.cycle.next_deadline(),
            self.rendezvous.next_deadline(),
            self._window_wait_until,
            self._join_deadline,
        ):
            if deadline is not None and deadline < best:
                best = deadline
        return best

    def checkpoint_meta(self) -> dict[str, Any]:
        """The coordinator's part of a checkpoint (spec §6 CheckpointMeta, schema 3)."""
        return {
            "schema_version": 3,
            "epoch": self.work.current_epoch if self.work is not None else 0,
            "global_step": self.cycle.global_step,
            "sync_round": self.cycle.round,
            "world_size_at_save": len(self.members) or self.world_size,
            "save_reason": None
            if self.outcome.save_reason is None
            else self.outcome.save_reason.name,
            "elche_state": self.elche.state(),
            "guard_state": self.guard.state(),
        }

    # --- events: connections ----------------------------------------------------------------

    def on_connect(self, rank: int, now: float) -> list[Effect]:
        """``rank`` completed its handshake."""
        if self.finished:
            return [Send(rank, Shutdown())]
        self.liveness.admit(rank, now)
        self.stats[rank].joined_at = now
        self.timeline.add(now, EventKind.RANK_JOINED, rank=rank)
        return []

    def on_disconnect(self, rank: int, now: float, reason: str = "") -> list[Effect]:
        """``rank``'s connection closed or broke: it is lost at once."""
        self._ready.discard(rank)
        loss = self.liveness.on_disconnect(rank, now)
        if loss is None:
            return []
        return self._handle_losses([loss], now, reason)

    def on_exit_reported(self, rank: int, returncode: int, now: float) -> list[Effect]:
        """The launcher saw ``rank``'s process exit."""
        if self.finished or (returncode == 0 and self.liveness.is_exiting(rank)):
            return []
        if self.phase is RunPhase.JOINING:
            # The world cannot form without this rank: stop now instead of at the join timeout.
            return self._fail(now, f"rank {rank} exited with code {returncode} before joining")
        loss = self.liveness.on_disconnect(rank, now)
        if loss is None:
            return []
        return self._handle_losses([loss], now, f"process exited with code {returncode}")

    def request_stop(self, now: float, save: bool = True) -> list[Effect]:
        """End the run now: with a save (ShutdownWithSave(GRACEFUL)) or a plain Shutdown."""
        if self.finished:
            return []
        if save:
            return self._save(SaveReason.GRACEFUL, now, "stop requested")
        return self._shutdown(now, "stop requested")

    # --- events: messages -------------------------------------------------------------------

    def on_message(self, rank: int, message: Message, now: float) -> list[Effect]:
        """One message from ``rank`` (whose identity the shell verified)."""
        self.liveness.on_frame(rank, now)
        if self.finished:
            return []
        if isinstance(message, Batch):
            return self._on_batch(rank, message, now)
        if isinstance(message, SyncAck):
            return self._on_ack(rank, message, now)
        if isinstance(message, Metrics):
            return self._on_metrics(rank, message, now)
        if isinstance(message, Heartbeat):
            return []
        if isinstance(message, Ready):
            return self._on_ready(rank, message, now)
        if isinstance(message, NewGroupReady):
            return self._on_group_ready(message, now)
        if isinstance(message, Exiting):
            self.liveness.on_exiting(rank, now)
            return []
        if isinstance(message, LrUpdate):
            self.stats[rank].lr = message.lr
            return []
        if isinstance(message, Intent):
            if message.kind is IntentKind.CHECKPOINT_NOW:
                self._checkpoint_requests.add(rank)
            return []
        if isinstance(message, CheckpointResult | Note):
            return []
        return [Disconnect(rank, f"unexpected {type(message).__name__} from a rank")]

    def on_tick(self, now: float) -> list[Effect]:
        """Act on every deadline that has passed by ``now``."""
        if self.finished:
            return []
        effects: list[Effect] = []
        if self._join_deadline is not None and now >= self._join_deadline:
            missing = sorted(set(range(self.world_size)) - self._ready)
            return self._fail(now, f"ranks {missing} did not join in time")
        losses = self.liveness.check(now)
        if losses:
            effects += self._handle_losses(losses, now, "silent past the heartbeat timeout")
            if self.finished:
                return effects
        if self.cycle.check_stall(now):
            return effects + self._save(
                SaveReason.REDUCE_STALL, now, "averaging round unacknowledged past the ceiling"
            )
        effects += self._after_rendezvous(self.rendezvous.poll(now, self._eligible()), now)
        if self._window_wait_until is not None and now >= self._window_wait_until:
            effects += self._start_round(now, delivered=False)
        return effects

    # --- joining and forming ----------------------------------------------------------------

    def _on_ready(self, rank: int, ready: Ready, now: float) -> list[Effect]:
        if self.phase is not RunPhase.JOINING:
            return self._on_rejoin(rank, ready, now)
        job = Job(ready.dataset_size, ready.batch_size, ready.epochs)
        problem = job.problem()
        if problem is not None:
            return [Disconnect(rank, f"rank {rank} described a job that cannot run: {problem}")]
        if self.job is None:
            self.job = job
        elif job != self.job:
            return [Disconnect(rank, f"rank {rank} describes job {job}, others {self.job}")]
        self._ready.add(rank)
        if len(self._ready & self.alive) < self.world_size:
            return []
        self._join_deadline = None
        self.phase = RunPhase.FORMING
        return self._after_rendezvous(self.rendezvous.form_initial(now), now)

    def _on_rejoin(self, rank: int, ready: Ready, now: float) -> list[Effect]:
        """A rank (re)connected to a running job: it joins the group at the next round."""
        job = Job(ready.dataset_size, ready.batch_size, ready.epochs)
        if job != self.job:
            return [Disconnect(rank, f"rank {rank} describes job {job}, the run is {self.job}")]
        if rank in self._member_set:
            return [Disconnect(rank, f"rank {rank} is already a member of the group")]
        self._joiners.add(rank)
        self.timeline.add(now, EventKind.RANK_JOINED, rank=rank, rejoin=True)
        return self._maybe_trigger(now)

    def _eligible(self) -> frozenset[int]:
        """Ranks that may be in the next group: alive and (once training) already members."""
        if self.phase is RunPhase.FORMING:
            return self.alive
        return self.alive & (self._member_set | self._joiners)

    def _on_group_ready(self, reply: NewGroupReady, now: float) -> list[Effect]:
        return self._after_rendezvous(self.rendezvous.on_ready(now, reply, self._eligible()), now)

    def _after_rendezvous(self, effects: Sequence[Any], now: float) -> list[Effect]:
        """Pass on rendezvous effects; notice a finished formation or an exhausted one."""
        out: list[Effect] = []
        for effect in effects:
            if isinstance(effect, Broadcast) and isinstance(effect.message, ShutdownWithSave):
                return out + self._save(effect.message.reason, now, "no group could be formed")
            out.append(effect)
        generation = self.rendezvous.generation
        if (
            generation is not None
            and generation != self._formed_generation
            and not self.rendezvous.pending
            and not self.finished
        ):
            self._formed_generation = generation
            out += self._group_formed(now)
        return out

    def _group_formed(self, now: float) -> list[Effect]:
        new_members = self.rendezvous.members
        generation = self.rendezvous.generation
        assert generation is not None
        effects: list[Effect] = []
        if self.phase is RunPhase.FORMING:
            self.members = new_members
            self._member_set = frozenset(new_members)
            for rank in set(range(self.world_size)) - set(new_members):
                self.cycle.drop_rank(now, rank)
            self._elche_ranks = list(new_members)
            self.elche = self._initial_elche(len(new_members))
            self.phase = RunPhase.TRAINING
            first_epoch = 0 if self._resume is None else self._resume.epoch
            return effects + self._begin_training(first_epoch, now)
        old_index = {rank: i for i, rank in enumerate(self._elche_ranks)}
        kept = [rank for rank in self._elche_ranks if rank in new_members]
        self.elche = self.elche.for_survivors([old_index[r] for r in kept])
        self._elche_ranks = kept
        for rank in new_members:
            if rank not in old_index:
                self.elche.add_rank()
                self._elche_ranks.append(rank)
                self.cycle.add_rank(rank)
                if self.work is not None:
                    self.work.readmit(rank)
        self._joiners -= set(new_members)
        self.members = new_members
        self._member_set = frozenset(new_members)
        self.phase = RunPhase.TRAINING
        self.timeline.add(
            now, EventKind.GROUP_REFORMED, generation=generation, members=list(new_members)
        )
        if not self.cycle.settled:
            started = self.cycle.redo_round(now, generation)
            self.timeline.add(now, EventKind.SYNC_START, round=started.round, redo=True)
            effects += list(started.effects)
        else:
            effects += self._maybe_trigger(now)
        return effects

    # --- training ---------------------------------------------------------------------------

    def _begin_training(self, first_epoch: int, now: float) -> list[Effect]:
        """Open the run's work and start round 1 at once, before any batch: with no steps
        anywhere it makes every rank start from the same parameters (the ranks give group
        rank 0's copy all the mass in that round, as DDP broadcasts from rank 0)."""
        assert self.job is not None
        self.work = Workload(
            self.job.dataset_size, self.job.batch_size, self.job.epochs, first_epoch=first_epoch
        )
        return self._start_round(now, delivered=False)

    def _dispatch_window(self) -> list[Effect]:
        assert self.work is not None
        cap_epochs = self.settings.cadence.window_cap_epochs
        if self._progressive and cap_epochs is not None:
            # floDl's window cap: a window holds at most an epoch's batches (by default).
            self.elche.set_max_total_batches(max(int(self.work.epoch_batches * cap_epochs), 1))
        self._plan = [0] * self.world_size
        effects: list[Effect] = []
        for rank, message in self.work.dispatch_window(self.counts()):
            self._plan[rank] += span_batches(message, self.work.batch_size)
            effects.append(Send(rank, message))
        return effects

    def _on_batch(self, rank: int, batch: Batch, now: float) -> list[Effect]:
        stats = self.stats[rank]
        stats.batches += 1
        stats.last_loss = batch.batch_loss
        if rank not in self._member_set or self.work is None:
            return []
        window = self._windows[rank]
        wall = batch.batch_ms + batch.data_ms
        if window.batches == 0:
            window.fill_ms = wall
        else:
            window.compute_ms += batch.batch_ms
        window.batches += 1
        self._idle_fill.on_batch(rank, now, wall)
        epoch, left = self.work.complete(rank)
        idle_now = False
        if epoch is not None:
            self._tallies.on_batch(epoch, batch.batch_loss)
            if left == 0:
                self._awaiting_completion.add(rank)
                self._filling.discard(rank)
                idle_now = True
        # A Batch never settles a round (only SyncAcks do), so there is nothing to settle here.
        self.cycle.on_batch(now, batch)
        effects: list[Effect] = list(self.cycle.throttle())
        # The count trigger can only turn true when this rank reaches its planned count, runs
        # out of work, or a rank was just throttled (throttled ranks are exempt); every other
        # report leaves it false, so most reports skip the check.
        if idle_now or effects or self.cycle.steps_of(rank) >= self._plan[rank]:
            round_before = self.cycle.round
            effects += self._maybe_trigger(now)
            if idle_now and self.cycle.round == round_before:
                effects += self._fill(rank, self._extra_batches(rank, now))
        return effects

    def _extra_batches(self, rank: int, now: float) -> int:
        """Cadence: how many batches ``rank``, out of work before the round triggered, should
        get now (see :mod:`flodl.core.fill`)."""
        if (
            not self.settings.cadence.fill_idle_ranks
            or self.settings.policy is not Policy.CADENCE
            or self.settings.cadence.max_batch_diff is not None  # a throttled rank would not run it
            or self.phase is not RunPhase.TRAINING
            or self._window_wait_until is not None
            or self.rendezvous.pending
            or self.work is None
            or self.work.exhausted
        ):
            return 0
        alive = self.alive
        return self._idle_fill.extra_batches(
            rank,
            now,
            steps_of=self.cycle.steps_of,
            working=lambda r: r in self._member_set and r in alive,
        )

    def _fill(self, rank: int, batches: int) -> list[Effect]:
        if batches <= 0 or self.work is None:
            return []
        sends: list[Effect] = [
            Send(r, message) for r, message in self.work.dispatch_window({rank: batches})
        ]
        if sends:
            self._filling.add(rank)  # a round triggered meanwhile waits for this batch
        return sends

    def _on_metrics(self, rank: int, metrics: Metrics, now: float) -> list[Effect]:
        if rank not in self._member_set:
            return []
        window = self._windows[rank]
        window.delivered_ms += metrics.epoch_ms
        window.chunk_reports += 1
        self._awaiting_completion.discard(rank)
        self._tallies.on_metrics(rank, metrics)
        effects = self._maybe_aggregate(now)
        if self._window_wait_until is not None and not self._movers_awaited():
            effects += self._start_round(now, delivered=True)
        else:
            effects += self._maybe_trigger(now)
        return effects

    def _on_ack(self, rank: int, ack: SyncAck, now: float) -> list[Effect]:
        if ack.round == self.cycle.round and ack.divergence is not None:
            self._divergences.append(ack.divergence)
        if ack.round == self.cycle.round:
            self.stats[rank].syncs += 1
        effects: list[Effect] = []
        if self.cycle.on_sync_ack(now, ack):
            effects += self._round_settled(now)
        effects += self._maybe_trigger(now)
        return effects

    def _movers_awaited(self) -> bool:
        if not self._awaiting_completion and not self._filling:
            return False  # the usual case: skip building O(world) sets
        awaited = self._awaiting_completion | self._filling
        return bool(awaited & self.alive & self._member_set)

    def _quiesced(self) -> frozenset[int]:
        """Members the trigger exempts: nothing in flight once no work is left anywhere."""
        if self.work is None:
            return frozenset()
        return self.work.quiesced(self.members)

    def _maybe_trigger(self, now: float) -> list[Effect]:
        if (
            self.phase is not RunPhase.TRAINING
            or self.work is None
            or self.rendezvous.pending
            or self._window_wait_until is not None
            or not self.cycle.settled
        ):
            return []
        if not self.cycle.ready(self._plan, self._quiesced()):
            if self._all_work_done() and self.cycle.settled:
                return self._maybe_aggregate(now) + self._shutdown(now, "all epochs done")
            return []
        joiners = self._joiners & self.alive
        if joiners:
            # Grow the group first; the round then runs with the joiners in it (their mass is
            # zero, so they receive the survivors' average and contribute nothing to it).
            self.phase = RunPhase.REFORMING
            grown = tuple(sorted(set(self.members) | joiners))
            return self._after_rendezvous(
                self.rendezvous.begin(now, grown, ms_per_batch=self.ms_per_batch()), now
            )
        if self.settings.policy is Policy.CADENCE and self._movers_awaited():
            self._window_wait_until = now + self.settings.timeouts.window_wait
            return []
        return self._start_round(now, delivered=self._progressive)

    def _all_work_done(self) -> bool:
        return self.work is not None and self.work.done and not any(self.cycle.steps)

    def _start_round(self, now: float, *, delivered: bool) -> list[Effect]:
        self._window_wait_until = None
        generation = self.rendezvous.generation or 0
        started = self.cycle.start_round(now, generation)
        effects: list[Effect] = list(started.effects)
        self.timeline.add(now, EventKind.SYNC_START, round=started.round, steps=list(started.steps))
        self._feed_elche(started.steps, delivered, now)
        self._windows = [_Window() for _ in range(self.world_size)]
        self._awaiting_completion.clear()
        self._filling.clear()
        assert self.work is not None
        if self.work.exhausted:
            return effects
        effects += self._dispatch_window()
        self._idle_fill.begin_window(self._plan, self.ms_per_batch(), now)
        return effects

    def _feed_elche(self, steps: Sequence[int], delivered: bool, now: float) -> None:
        if self.settings.policy is Policy.SYNC or not any(steps):
            return
        windows: list[RankWindow | None] = []
        for rank in self.members:
            w = self._windows[rank]
            if steps[rank] == 0:
                windows.append(None)
                continue
            delivered_ms = w.delivered_ms - w.fill_ms if w.chunk_reports and delivered else None
            if delivered_ms is not None and delivered_ms <= 0:
                delivered_ms = None
            windows.append(RankWindow(w.batches, w.fill_ms, w.compute_ms, delivered_ms))
        anchor_before = self.elche.anchor
        reduce_ms = (self.cycle.last_sync_duration or 0.0) * 1000.0
        self.elche.report_window(windows, reduce_ms, use_delivered=delivered)
        verdict = self.guard.report(
            self._divergences, k_used=sum(steps), k_max=max(steps, default=0)
        )
        self._divergences = []
        self.elche.apply_verdict(verdict)
        if self.elche.anchor != anchor_before:
            self.timeline.add(
                now,
                EventKind.ANCHOR_CHANGED,
                before=anchor_before,
                after=self.elche.anchor,
            )

    def _round_settled(self, now: float) -> list[Effect]:
        duration = self.cycle.last_sync_duration or 0.0
        self.timeline.add(now, EventKind.SYNC_END, round=self.cycle.round, duration_s=duration)
        effects: list[Effect] = []
        for rank in sorted(self._checkpoint_requests & self._member_set):
            self._checkpoint_version += 1
            effects.append(
                Send(rank, CheckpointRequest(version=self._checkpoint_version, target_rank=rank))
            )
        self._checkpoint_requests.clear()
        if self._shutdown_pending:
            return effects + self._shutdown(now, "stop requested")
        return effects + self._maybe_aggregate(now)

    def _maybe_aggregate(self, now: float) -> list[Effect]:
        """EpochAggregated for every epoch whose batches are all done (and reported)."""
        if self.work is None or self._movers_awaited():
            return []
        effects: list[Effect] = []
        for pool in self.work.pop_finished():
            effects += self._aggregate(pool, now)
        return effects

    def _aggregate(self, pool: ChunkPool, now: float) -> list[Effect]:
        result, message = self._tallies.aggregate(pool, self.members, self.world_size)
        self.epoch_results.append(result)
        self.timeline.add(now, EventKind.EPOCH_AGGREGATED, **result)
        return [Broadcast(message, self.members)]

    # --- losses -----------------------------------------------------------------------------

    def _handle_losses(self, losses: Sequence[RankLost], now: float, why: str) -> list[Effect]:
        effects: list[Effect] = []
        if self.finished:
            return effects  # ranks hanging up after the end are not deaths
        for loss in losses:
            stats = self.stats[loss.rank]
            stats.lost_at = now
            stats.loss_cause = loss.cause.value
            self._ready.discard(loss.rank)
            self.timeline.add(
                now, EventKind.RANK_DEAD, rank=loss.rank, cause=loss.cause.value, why=why
            )
        if self.phase is RunPhase.JOINING:
            return effects
        self._joiners -= {loss.rank for loss in losses}
        lost = [loss.rank for loss in losses if loss.rank in self._member_set]
        survivors = tuple(r for r in self.members if self.liveness.is_alive(r))
        if self.phase is RunPhase.FORMING:
            if unrecoverable := self._unrecoverable():
                return self._save(unrecoverable, now, why)
            return self._after_rendezvous(self.rendezvous.poll(now, self.alive), now)
        for rank in lost:
            effects.append(Broadcast(DeclareDead(rank=rank), survivors))
            self.cycle.drop_rank(now, rank)
            if self.work is not None and survivors:
                for target, extension in self.work.reassign(rank, survivors):
                    self._plan[target] += span_batches(extension, self.work.batch_size)
                    effects.append(Send(target, extension))
            self._awaiting_completion.discard(rank)
            self._filling.discard(rank)
        if unrecoverable := self._unrecoverable():
            return effects + self._save(unrecoverable, now, why)
        if not lost:
            return effects
        if not self.settings.collective or (all_exited(losses) and self._all_work_done()):
            # Without a collective group there is nothing to re-form: the survivors go on.
            return effects + self._maybe_trigger(now)
        self.cycle.abandon_round()
        self.phase = RunPhase.REFORMING
        self._window_wait_until = None
        if self.rendezvous.pending:
            retried = self.rendezvous.poll(now, self._eligible())
            return effects + self._after_rendezvous(retried, now)
        return effects + self._after_rendezvous(
            self.rendezvous.begin(now, survivors, ms_per_batch=self.ms_per_batch()), now
        )

    def _unrecoverable(self) -> SaveReason | None:
        return unrecoverable_reason(
            world_size=self.world_size,
            alive=len(self.alive),
            failures=self.liveness.failures,
            max_failure=self.settings.max_failure,
            collective=self.settings.collective,
        )

    # --- endings ----------------------------------------------------------------------------

    def _save(self, reason: SaveReason, now: float, why: str) -> list[Effect]:
        self.phase = RunPhase.FINISHED
        self._window_wait_until = None
        self.outcome = Outcome(Status.SAVED, reason, why)
        self.timeline.add(now, EventKind.SAVE_REQUESTED, reason=reason.name, why=why)
        return [Broadcast(ShutdownWithSave(reason=reason))]

    def _shutdown(self, now: float, why: str) -> list[Effect]:
        if not self.cycle.may_shutdown():
            self._shutdown_pending = True
            return []
        self.phase = RunPhase.FINISHED
        self.outcome = Outcome(Status.COMPLETED, None, why)
        self.timeline.add(now, EventKind.SHUTDOWN, why=why)
        return [Broadcast(Shutdown())]

    def _fail(self, now: float, why: str) -> list[Effect]:
        self.phase = RunPhase.FINISHED
        self.outcome = Outcome(Status.FAILED, None, why)
        self.timeline.add(now, EventKind.SHUTDOWN, why=why)
        return [Broadcast(Shutdown())]


def all_exited(losses: Sequence[RankLost]) -> bool:
    return all(loss.cause is LossCause.EXITED for loss in losses)
