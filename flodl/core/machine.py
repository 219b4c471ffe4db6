"""The coordinator's decisions, composed: one pure state machine driven by events and time.

:class:`CoordinatorMachine` wires its parts into the behaviour of a floDl coordinator:
:class:`~flodl.core.membership.Membership` (the job, the members, the joiners),
:class:`~flodl.core.rendezvous.Rendezvous` (forming each generation of the group),
:class:`~flodl.core.pacing.Pacing` (ElChe's counts and the guard's verdicts),
:class:`~flodl.core.dispatch.Dispatch` (each window's work, the idle fill, epochs),
:class:`~flodl.core.cycle.Cycle` (the averaging round), :class:`~flodl.core.liveness.Liveness`
(dead ranks) and :class:`~flodl.core.ending.Ending` (how the run ends). The machine decides the
order of things: which part hears of an event, when a round starts, what a loss or a new group
does to each part. The trio shell (:mod:`flodl.coordinator`) feeds it events with the current
time and performs the effects it returns; the machine never waits, sleeps or sends. That makes
every rule testable with plain calls, and lets one process simulate thousands of ranks.

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
from flodl.core.dispatch import Dispatch
from flodl.core.effects import Broadcast, Send
from flodl.core.elche import ElChe
from flodl.core.ending import Ending, Outcome, Status
from flodl.core.guards import Guard
from flodl.core.job import Job
from flodl.core.liveness import Liveness, LossCause, RankLost, unrecoverable_reason
from flodl.core.membership import Membership
from flodl.core.pacing import Pacing
from flodl.core.rendezvous import Rendezvous
from flodl.core.settings import MachineSettings
from flodl.core.timeline import EventKind, Timeline
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

__all__ = [
    "CoordinatorMachine",
    "Disconnect",
    "Effect",
    "Outcome",
    "RankStats",
    "ResumeState",
    "RunPhase",
    "Status",
]


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
        self._phase = RunPhase.JOINING
        self.stats = [RankStats() for _ in range(world_size)]
        policy = settings.policy
        timeouts = settings.timeouts
        cadence = settings.cadence
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
            max_batch_diff=cadence.max_batch_diff,
        )
        self.liveness = Liveness(world_size, heartbeat_timeout=timeouts.heartbeat, now=now)
        self.rendezvous = Rendezvous(
            world_size, local_ranks=local_ranks, retry_timeout=timeouts.rendezvous_retry
        )
        self.membership = Membership(world_size, join_deadline=now + join_timeout)
        saved = None if resume is None else resume.elche_state
        self.pacing = Pacing(settings, self.timeline, world_size, saved=saved)
        fills = cadence.fill_idle_ranks and policy is Policy.CADENCE
        # A throttled rank would not run an extra batch, so throttling turns the fill off.
        self.dispatch = Dispatch(
            world_size, self.timeline, fills=fills and cadence.max_batch_diff is None
        )
        self.ending = Ending(self.timeline)
        self._first_epoch = 0 if resume is None else resume.epoch
        self._window_wait_until: float | None = None
        self._checkpoint_requests: set[int] = set()
        self._checkpoint_version = 0

    # --- queries --------------------------------------------------------------------------

    @property
    def phase(self) -> RunPhase:
        return RunPhase.FINISHED if self.ending.over else self._phase

    @property
    def finished(self) -> bool:
        return self.ending.over

    @property
    def outcome(self) -> Outcome:
        return self.ending.outcome

    @property
    def job(self) -> Job | None:
        return self.membership.job

    @property
    def members(self) -> tuple[int, ...]:
        return self.membership.members

    @property
    def elche(self) -> ElChe:
        return self.pacing.elche

    @property
    def guard(self) -> Guard:
        return self.pacing.guard

    @property
    def epoch_results(self) -> list[dict[str, Any]]:
        return self.dispatch.epoch_results

    @property
    def alive(self) -> frozenset[int]:
        return self.liveness.alive

    def counts(self) -> dict[int, int]:
        """ElChe's batch count per member (global rank -> batches per window)."""
        return self.pacing.counts(self.members)

    def ms_per_batch(self) -> dict[int, float]:
        return self.pacing.ms_per_batch()

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
            self.membership.join_deadline,
        ):
            if deadline is not None and deadline < best:
                best = deadline
        return best

    def checkpoint_meta(self) -> dict[str, Any]:
        """The coordinator's part of a checkpoint (spec §6 CheckpointMeta, schema 3)."""
        work = self.dispatch.work
        save_reason = self.outcome.save_reason
        return {
            "schema_version": 3,
            "epoch": work.current_epoch if work is not None else 0,
            "global_step": self.cycle.global_step,
            "sync_round": self.cycle.round,
            "world_size_at_save": len(self.members) or self.world_size,
            "save_reason": None if save_reason is None else save_reason.name,
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
        self.membership.forget(rank)
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
            why = f"rank {rank} exited with code {returncode} before joining"
            return list(self.ending.fail(now, why))
        loss = self.liveness.on_disconnect(rank, now)
        if loss is None:
            return []
        return self._handle_losses([loss], now, f"process exited with code {returncode}")

    def request_stop(self, now: float, save: bool = True) -> list[Effect]:
        """End the run now: with a save (ShutdownWithSave(GRACEFUL)) or a plain Shutdown."""
        if self.finished:
            return []
        if save:
            return list(self.ending.save(SaveReason.GRACEFUL, now, "stop requested"))
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
            return self._regroup(self.rendezvous.on_ready(now, message, self._eligible()), now)
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
        join_deadline = self.membership.join_deadline
        if join_deadline is not None and now >= join_deadline:
            why = f"ranks {self.membership.missing()} did not join in time"
            return list(self.ending.fail(now, why))
        losses = self.liveness.check(now)
        if losses:
            effects += self._handle_losses(losses, now, "silent past the heartbeat timeout")
            if self.finished:
                return effects
        if self.cycle.check_stall(now):
            why = "averaging round unacknowledged past the ceiling"
            return effects + self.ending.save(SaveReason.REDUCE_STALL, now, why)
        effects += self._regroup(self.rendezvous.poll(now, self._eligible()), now)
        if self._window_wait_until is not None and now >= self._window_wait_until:
            effects += self._start_round(now, delivered=False)
        return effects

    # --- joining and forming ----------------------------------------------------------------

    def _on_ready(self, rank: int, ready: Ready, now: float) -> list[Effect]:
        if self.phase is not RunPhase.JOINING:
            # A rank (re)connected to a running job: it joins the group at the next round.
            refused = self.membership.rejoin(rank, ready)
            if refused is not None:
                return [Disconnect(rank, refused)]
            self.timeline.add(now, EventKind.RANK_JOINED, rank=rank, rejoin=True)
            return self._maybe_trigger(now)
        refused = self.membership.join(rank, ready)
        if refused is not None:
            return [Disconnect(rank, refused)]
        if not self.membership.all_joined(self.alive):
            return []
        self._phase = RunPhase.FORMING
        return self._regroup(self.rendezvous.form_initial(now), now)

    def _eligible(self) -> frozenset[int]:
        forming = self.phase is RunPhase.FORMING
        return self.membership.eligible(self.alive, forming=forming)

    def _regroup(self, effects: Sequence[Any], now: float) -> list[Effect]:
        """Pass on rendezvous effects; notice a finished formation or an exhausted one."""
        out: list[Effect] = []
        for effect in effects:
            if isinstance(effect, Broadcast) and isinstance(effect.message, ShutdownWithSave):
                reason = effect.message.reason
                return out + self.ending.save(reason, now, "no group could be formed")
            out.append(effect)
        if not self.finished and self.membership.newly_formed(self.rendezvous):
            out += self._group_formed(now)
        return out

    def _group_formed(self, now: float) -> list[Effect]:
        members = self.rendezvous.members
        generation = self.rendezvous.generation
        assert generation is not None
        if self.phase is RunPhase.FORMING:
            self.membership.adopt(members, welcome=False)
            for rank in set(range(self.world_size)) - set(members):
                self.cycle.drop_rank(now, rank)
            self.pacing.form(members)
            self._phase = RunPhase.TRAINING
            return self._begin_training(now)
        for rank in self.pacing.carry_over(members):
            self.cycle.add_rank(rank)
            self.dispatch.readmit(rank)
        self.membership.adopt(members, welcome=True)
        self._phase = RunPhase.TRAINING
        self.timeline.add(
            now, EventKind.GROUP_REFORMED, generation=generation, members=list(members)
        )
        if self.cycle.settled:
            return self._maybe_trigger(now)
        started = self.cycle.redo_round(now, generation)
        self.timeline.add(now, EventKind.SYNC_START, round=started.round, redo=True)
        return list(started.effects)

    # --- training ---------------------------------------------------------------------------

    def _begin_training(self, now: float) -> list[Effect]:
        """Open the run's work and start round 1 at once, before any batch: with no steps
        anywhere it makes every rank start from the same parameters (the ranks give group
        rank 0's copy all the mass in that round, as DDP broadcasts from rank 0)."""
        assert self.job is not None
        self.dispatch.open(self.job, self._first_epoch)
        return self._start_round(now, delivered=False)

    def _working(self, rank: int) -> bool:
        """``rank`` is a live member of the group."""
        return rank in self.membership.member_set and self.liveness.is_alive(rank)

    def _on_batch(self, rank: int, batch: Batch, now: float) -> list[Effect]:
        stats = self.stats[rank]
        stats.batches += 1
        stats.last_loss = batch.batch_loss
        if rank not in self.membership.member_set or self.dispatch.work is None:
            return []
        idle_now = self.dispatch.on_batch(rank, batch, now)
        # A Batch never settles a round (only SyncAcks do), so there is nothing to settle here.
        self.cycle.on_batch(now, batch)
        effects: list[Effect] = list(self.cycle.throttle())
        # The count trigger can only turn true when this rank reaches its planned count, runs
        # out of work, or a rank was just throttled (throttled ranks are exempt); every other
        # report leaves it false, so most reports skip the check.
        if idle_now or effects or self.cycle.steps_of(rank) >= self.dispatch.plan[rank]:
            round_before = self.cycle.round
            effects += self._maybe_trigger(now)
            if idle_now and self.cycle.round == round_before:
                effects += self._fill(rank, now)
        return effects

    def _fill(self, rank: int, now: float) -> list[Effect]:
        """Cadence: the batches ``rank``, out of work before the round triggered, gets now."""
        if (
            self.phase is not RunPhase.TRAINING
            or self._window_wait_until is not None
            or self.rendezvous.pending
        ):
            return []
        return list(
            self.dispatch.fill(rank, now, steps_of=self.cycle.steps_of, working=self._working)
        )

    def _on_metrics(self, rank: int, metrics: Metrics, now: float) -> list[Effect]:
        if rank not in self.membership.member_set:
            return []
        self.dispatch.on_completion(rank, metrics)
        effects = self._close_epochs(now)
        if self._window_wait_until is not None and not self.dispatch.awaits(self._working):
            effects += self._start_round(now, delivered=True)
        else:
            effects += self._maybe_trigger(now)
        return effects

    def _on_ack(self, rank: int, ack: SyncAck, now: float) -> list[Effect]:
        if ack.round == self.cycle.round:
            self.stats[rank].syncs += 1
            if ack.divergence is not None:
                self.pacing.on_divergence(ack.divergence)
        effects: list[Effect] = []
        if self.cycle.on_sync_ack(now, ack):
            effects += self._round_settled(now)
        effects += self._maybe_trigger(now)
        return effects

    def _maybe_trigger(self, now: float) -> list[Effect]:
        work = self.dispatch.work
        if (
            self.phase is not RunPhase.TRAINING
            or work is None
            or self.rendezvous.pending
            or self._window_wait_until is not None
            or not self.cycle.settled
        ):
            return []
        if not self.cycle.ready(self.dispatch.plan, work.quiesced(self.members)):
            if self._all_work_done() and self.cycle.settled:
                return self._close_epochs(now) + self._shutdown(now, "all epochs done")
            return []
        joiners = self.membership.joiners & self.alive
        if joiners:
            # Grow the group first; the round then runs with the joiners in it (their mass is
            # zero, so they receive the survivors' average and contribute nothing to it).
            self._phase = RunPhase.REFORMING
            grown = tuple(sorted(set(self.members) | joiners))
            return self._regroup(
                self.rendezvous.begin(now, grown, ms_per_batch=self.ms_per_batch()), now
            )
        if self.settings.policy is Policy.CADENCE and self.dispatch.awaits(self._working):
            self._window_wait_until = now + self.settings.timeouts.window_wait
            return []
        return self._start_round(now, delivered=self._progressive)

    def _all_work_done(self) -> bool:
        work = self.dispatch.work
        return work is not None and work.done and not any(self.cycle.steps)

    def _start_round(self, now: float, *, delivered: bool) -> list[Effect]:
        self._window_wait_until = None
        started = self.cycle.start_round(now, self.rendezvous.generation or 0)
        effects: list[Effect] = list(started.effects)
        self.timeline.add(now, EventKind.SYNC_START, round=started.round, steps=list(started.steps))
        steps = started.steps
        if self.pacing.feeds and any(steps):
            reduce_ms = (self.cycle.last_sync_duration or 0.0) * 1000.0
            windows = self.dispatch.reports(self.members, steps, delivered)
            self.pacing.close_window(windows, steps, reduce_ms, delivered=delivered, now=now)
        self.dispatch.new_window()
        work = self.dispatch.work
        assert work is not None
        if work.exhausted:
            return effects
        counts = self.pacing.window_counts(self.members, work.epoch_batches)
        return effects + self.dispatch.hand_out(counts, self.ms_per_batch(), now)

    def _round_settled(self, now: float) -> list[Effect]:
        duration = self.cycle.last_sync_duration or 0.0
        self.timeline.add(now, EventKind.SYNC_END, round=self.cycle.round, duration_s=duration)
        effects: list[Effect] = []
        for rank in sorted(self._checkpoint_requests & self.membership.member_set):
            self._checkpoint_version += 1
            effects.append(
                Send(rank, CheckpointRequest(version=self._checkpoint_version, target_rank=rank))
            )
        self._checkpoint_requests.clear()
        if self.ending.pending:
            return effects + self._shutdown(now, "stop requested")
        return effects + self._close_epochs(now)

    def _close_epochs(self, now: float) -> list[Effect]:
        """EpochAggregated for every epoch whose batches are all done (and reported)."""
        if self.dispatch.awaits(self._working):
            return []
        return list(self.dispatch.close_epochs(self.members, now))

    # --- losses -----------------------------------------------------------------------------

    def _handle_losses(self, losses: Sequence[RankLost], now: float, why: str) -> list[Effect]:
        effects: list[Effect] = []
        if self.finished:
            return effects  # ranks hanging up after the end are not deaths
        for loss in losses:
            stats = self.stats[loss.rank]
            stats.lost_at = now
            stats.loss_cause = loss.cause.value
            self.membership.forget(loss.rank)
            self.timeline.add(
                now, EventKind.RANK_DEAD, rank=loss.rank, cause=loss.cause.value, why=why
            )
        if self.phase is RunPhase.JOINING:
            return effects
        self.membership.drop_joiners(loss.rank for loss in losses)
        lost = [loss.rank for loss in losses if loss.rank in self.membership.member_set]
        survivors = tuple(r for r in self.members if self.liveness.is_alive(r))
        if self.phase is RunPhase.FORMING:
            if unrecoverable := self._unrecoverable():
                return list(self.ending.save(unrecoverable, now, why))
            return self._regroup(self.rendezvous.poll(now, self.alive), now)
        for rank in lost:
            effects.append(Broadcast(DeclareDead(rank=rank), survivors))
            self.cycle.drop_rank(now, rank)
            effects += self.dispatch.reassign(rank, survivors)
        if unrecoverable := self._unrecoverable():
            return effects + self.ending.save(unrecoverable, now, why)
        if not lost:
            return effects
        if not self.settings.collective or (all_exited(losses) and self._all_work_done()):
            # Without a collective group there is nothing to re-form: the survivors go on.
            return effects + self._maybe_trigger(now)
        self.cycle.abandon_round()
        self._phase = RunPhase.REFORMING
        self._window_wait_until = None
        if self.rendezvous.pending:
            retried = self.rendezvous.poll(now, self._eligible())
            return effects + self._regroup(retried, now)
        return effects + self._regroup(
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

    def _shutdown(self, now: float, why: str) -> list[Effect]:
        round_in_flight = not self.cycle.may_shutdown()
        return list(self.ending.shutdown(now, why, round_in_flight=round_in_flight))


def all_exited(losses: Sequence[RankLost]) -> bool:
    return all(loss.cause is LossCause.EXITED for loss in losses)
