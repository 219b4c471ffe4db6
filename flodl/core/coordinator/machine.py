"""The coordinator's decisions, composed: one pure state machine driven by events and time.

:class:`CoordinatorMachine` wires its parts into the behaviour of a floDl coordinator:
:class:`~flodl.core.coordinator.membership.Membership` (the job, the members, the joiners),
:class:`~flodl.core.coordinator.rendezvous.Rendezvous` (forming each generation of the group),
:class:`~flodl.core.coordinator.rounds.Rounds` (the averaging rounds, with ElChe's pacing and each
window's work), :class:`~flodl.core.coordinator.liveness.Liveness` (dead ranks) and
:class:`~flodl.core.coordinator.ending.Ending` (how the run ends). The machine decides the order of
things: which part hears of an event, whether a round may start, what a loss or a new group does to
each part. The trio shell (:mod:`flodl.coordinator`) feeds it events with the current
time and performs the effects it returns; the machine never waits, sleeps or sends. That makes
every rule testable with plain calls, and lets one process simulate thousands of ranks.

Lifecycle (:class:`RunPhase`): JOINING (every rank connects and sends
:class:`~flodl.wire.messages.Ready`; a rank whose process dies first is waited for when it is
restarted, else the run starts without it while enough ranks remain) -> FORMING (generation 0
of the group: RequestNewGroup / NewGroupReady / NewGroupSession) -> TRAINING (windows of ElChe
counts; a round averages them) <-> REFORMING (after a death the survivors form the next
generation, then redo the interrupted round) -> FINISHED (all epochs done, the final
checkpoint saved and Shutdown sent, or a ShutdownWithSave because the run cannot go on).

Work protocol (what ranks must do, see also :mod:`flodl.core.coordinator.partitions`): a rank works
through the sample ranges it is given (StartEpoch, ExtendPartition) in order, one ``Batch`` report
per finished batch (or several in one ``Batches`` frame, taken exactly as that many ``Batch``
reports arriving together; a rank that coalesces sends them before anything else it sends);
when it has nothing left it sends one ``Metrics`` report for the chunk it just
finished (its *completion frame*, carrying the chunk's delivered wall time) and waits. After a
collective it bumps its step count, so its next report acknowledges the round.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import attrs

from flodl.core.cadence.elche import ElChe
from flodl.core.coordinator.effects import Broadcast, Send
from flodl.core.coordinator.ending import Ending, Outcome, Status, record_save
from flodl.core.coordinator.liveness import Liveness, LossCause, RankLost
from flodl.core.coordinator.membership import Membership
from flodl.core.coordinator.rendezvous import Rendezvous
from flodl.core.coordinator.rounds import Due, ResumeState, Rounds
from flodl.core.coordinator.settings import MachineSettings
from flodl.core.coordinator.timeline import EventKind, Timeline
from flodl.wire.messages import (
    STOP_SAVE_VERSION,
    Batch,
    Batches,
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
    ShutdownWithSave,
    SyncAck,
)

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
    :class:`flodl.core.cadence.phases.Phase`."""

    JOINING = "joining"
    FORMING = "forming"
    TRAINING = "training"
    REFORMING = "reforming"
    FINISHED = "finished"


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
        resume: ResumeState | None = None,
    ) -> None:
        self.world_size = world_size
        self.settings = settings
        self.seed = seed
        self.timeline = Timeline()
        self._lost_since: float | None = None
        """When the first death the next re-formed group answers was detected."""
        self._supervised = local_ranks == frozenset(range(world_size))
        """Every rank's process is the launcher's (``flodl run``): it reports their exits."""
        self._unjoined_exits: set[int] = set()
        """Ranks whose process exited 0 before any rank connected: a script that may never
        join flodl (a plain torchrun script), or ranks that are deaths once another joins."""
        self._phase = RunPhase.JOINING
        self.stats = [RankStats() for _ in range(world_size)]
        self._any_joined = False
        """Some rank connected (a stats entry has ``joined_at``): kept as a flag because
        next_deadline() asks after every report, and a scan of 4,096 entries there made
        the joining phase quadratic."""
        timeouts = settings.timeouts
        self.created_at = now
        """When the machine was created (its deadlines count from here)."""
        self.liveness = Liveness(world_size, heartbeat_timeout=timeouts.heartbeat, now=now)
        self.rendezvous = Rendezvous(
            world_size, local_ranks=local_ranks, retry_timeout=timeouts.rendezvous_retry
        )
        self.membership = Membership(world_size, join_deadline=now + timeouts.join)
        self.rounds = Rounds(
            settings, self.timeline, self.membership, self.liveness, resume or ResumeState()
        )
        self.cycle = self.rounds.cycle
        self.pacing = self.rounds.pacing
        self.ending = Ending(settings, self.timeline, self.cycle, self.liveness)

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
    def stop_saves(self) -> dict[int, CheckpointResult | None]:
        """After a save went out: each rank asked -> the bundle it reported (None: not yet)."""
        return self.ending.stop_saves

    @property
    def members(self) -> tuple[int, ...]:
        return self.membership.members

    @property
    def elche(self) -> ElChe:
        return self.pacing.elche

    @property
    def epoch_results(self) -> list[dict[str, Any]]:
        return self.rounds.dispatch.epoch_results

    @property
    def alive(self) -> frozenset[int]:
        return self.liveness.alive

    @property
    def global_step(self) -> int:
        return self.cycle.global_step

    @property
    def round(self) -> int:
        return self.cycle.round

    @property
    def anchor(self) -> int:
        return self.elche.anchor

    def lost_ranks(self) -> frozenset[int]:
        """Ranks declared dead that did not join again since."""
        return frozenset(
            rank
            for rank, stats in enumerate(self.stats)
            if stats.lost_at is not None
            and (stats.joined_at is None or stats.joined_at <= stats.lost_at)
        )

    def counts(self) -> dict[int, int]:
        """ElChe's batch count per member (global rank -> batches per window)."""
        return self.pacing.counts(self.members)

    def next_deadline(self) -> float:
        """The latest time at which :meth:`on_tick` must run (``inf`` when nothing is due).

        Called after every batch of reports, so it avoids building lists.
        """
        if self.finished:
            return math.inf
        best = math.inf
        join_deadline = self.membership.join_deadline
        for deadline in (
            self.liveness.next_deadline(),
            self.rounds.next_deadline(),
            self.rendezvous.next_deadline(),
            self.ending.held_until,
            join_deadline if join_deadline is None or self._awaits_joins() else None,
        ):
            if deadline is not None and deadline < best:
                best = deadline
        return best

    def checkpoint_meta(self) -> dict[str, Any]:
        """The coordinator's part of a checkpoint (spec §6 CheckpointMeta, schema 3)."""
        save_reason = self.outcome.save_reason
        return {
            "schema_version": 3,
            **self.rounds.position(),
            "world_size_at_save": len(self.members) or self.world_size,
            "save_reason": None if save_reason is None else save_reason.name,
            "elche_state": self.elche.state(),
            "guard_state": self.pacing.guard.state(),
        }

    # --- events: connections ----------------------------------------------------------------

    def on_connect(self, rank: int, now: float) -> list[Effect]:
        """``rank`` completed its handshake."""
        if self.finished:
            return [Send(rank, self.ending.farewell())]
        self.liveness.admit(rank, now)
        self.stats[rank].joined_at = now
        self._any_joined = True
        self.timeline.add(now, EventKind.RANK_JOINED, rank=rank)
        effects: list[Effect] = []
        while self._unjoined_exits and not self.finished:  # this is a flodl run after all
            gone = self._unjoined_exits.pop()
            effects += self._died_joining(gone, "exited with code 0", now, False)
        return effects

    def on_disconnect(self, rank: int, now: float, reason: str = "") -> list[Effect]:
        """``rank``'s connection closed or broke: it is lost at once."""
        self.membership.forget(rank)
        return self._lose(rank, now, reason)

    def on_exit_reported(
        self, rank: int, returncode: int, now: float, *, restarting: bool = False
    ) -> list[Effect]:
        """The launcher saw ``rank``'s process exit; ``restarting``: it starts it again."""
        if self.finished or (returncode == 0 and self.liveness.is_exiting(rank)):
            return []
        if self.phase is RunPhase.JOINING:
            if returncode == 0 and not restarting and self.stats[rank].joined_at is None:
                return self._exited_unjoined(rank, now)
            return self._died_joining(rank, f"exited with code {returncode}", now, restarting)
        return self._lose(rank, now, f"process exited with code {returncode}")

    def request_stop(self, now: float, save: bool = True) -> list[Effect]:
        """End the run now: with a save (ShutdownWithSave(GRACEFUL)) or a plain Shutdown."""
        if self.finished:
            return []
        if save:
            return list(self.ending.save_when_settled(SaveReason.GRACEFUL, now, "stop requested"))
        return self._shutdown(now, "stop requested")

    # --- events: messages -------------------------------------------------------------------

    def on_message(self, rank: int, message: Message, now: float) -> list[Effect]:
        """One message from ``rank`` (whose identity the shell verified)."""
        self.liveness.on_frame(rank, now)
        if self.finished:
            if isinstance(message, CheckpointResult) and message.version == STOP_SAVE_VERSION:
                self.ending.on_stop_save(rank, message, now)
            return []
        if isinstance(message, Batch):
            return self._on_batch(rank, message, now)
        if isinstance(message, Batches):
            return self._on_batches(rank, message, now)
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
                self.rounds.request_checkpoint(rank)
            if message.kind is IntentKind.SAVE_AND_STOP:
                why = f"rank {rank} asked to stop"
                return list(self.ending.save_when_settled(SaveReason.GRACEFUL, now, why))
            return []
        if isinstance(message, CheckpointResult):
            record_save(self.timeline, now, rank, message)
            return self._maybe_trigger(now) if self.rounds.on_checkpoint_result(message) else []
        if isinstance(message, Note):
            return []
        return [Disconnect(rank, f"unexpected {type(message).__name__} from a rank")]

    def on_tick(self, now: float) -> list[Effect]:
        """Act on every deadline that has passed by ``now``."""
        if self.finished:
            return []
        effects: list[Effect] = []
        join_deadline = self.membership.join_deadline
        if join_deadline is not None and now >= join_deadline and self._awaits_joins():
            return self._join_timed_out(now)
        losses = self.liveness.check(now)
        if losses:
            effects += self._handle_losses(losses, now, "silent past the heartbeat timeout")
            if self.finished:
                return effects
        if self.cycle.check_stall(now):
            why = "averaging round unacknowledged past the ceiling"
            return effects + self.ending.save(SaveReason.REDUCE_STALL, now, why)
        held_until = self.ending.held_until
        if held_until is not None and now >= held_until:
            return effects + self.ending.release_save(now, settled=False)
        effects += self._regroup(self.rendezvous.poll(now, self._eligible()), now)
        wait_until = self.rounds.wait_until
        if wait_until is not None and now >= wait_until:
            effects += self.rounds.start(now, self._generation(), delivered=False)
        final_until = self.rounds.saves.final_until
        if final_until is not None and now >= final_until:
            effects += self._maybe_trigger(now)
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
        return self._form_if_joined(now)

    def _form_if_joined(self, now: float) -> list[Effect]:
        """Every rank the run waits for has joined: form generation 0 with them."""
        if not self.membership.all_joined(self.liveness.alive_view):
            return []
        self._phase = RunPhase.FORMING
        ranks = sorted(self.membership.expected())
        return self._regroup(self.rendezvous.form_initial(now, ranks), now)

    def _awaits_joins(self) -> bool:
        """Whether the join timeout applies: not to a launcher's ranks none of which connected
        yet (a plain torchrun script runs as long as it needs; their exits end the run)."""
        return not self._supervised or self._any_joined

    def _exited_unjoined(self, rank: int, now: float) -> list[Effect]:
        """``rank`` exited 0 without connecting. Before any rank connected, that may be a script
        that never joins flodl: when every rank does so, the run is complete (flodl run as a
        plain launcher). Once one connected, it is a death before joining."""
        if any(stats.joined_at is not None for stats in self.stats):
            return self._died_joining(rank, "exited with code 0", now, False)
        self._unjoined_exits.add(rank)
        if len(self._unjoined_exits) < self.world_size:
            return []
        why = "every rank exited 0 without joining flodl (the script never calls flodl.worker.join)"
        return list(self.ending.shutdown(now, why))

    def _join_timed_out(self, now: float) -> list[Effect]:
        """The join timeout passed with ranks missing: start without them, or fail."""
        missing = self.membership.missing()
        timeout = self.settings.timeouts.join
        why = f"ranks {missing} did not join within the join timeout ({timeout:g} s)"
        fails = self.membership.give_up_on(missing, self.settings)
        if fails is not None:
            return list(self.ending.fail(now, why + fails))
        remaining = sorted(self.membership.expected())
        self.timeline.add(now, EventKind.GOING_ON_WITHOUT, ranks=remaining, why=why, rank=None)
        return self._form_if_joined(now)

    def _died_joining(self, rank: int, how: str, now: float, restarting: bool) -> list[Effect]:
        """``rank``'s process died before the world joined (:meth:`Membership.died_joining`)."""
        why = f"rank {rank} {how} before joining"
        if self.liveness.is_alive(rank):
            self._lose(rank, now, why)  # the connection's end is not read yet
        if rank not in self.membership.left:  # else recorded when it hung up
            self.stats[rank].lost_at = now
            self.timeline.add(now, EventKind.RANK_DEAD, rank=rank, cause="exited", why=why)
        fails = self.membership.died_joining(rank, restarting, self.settings)
        if fails is not None:
            return list(self.ending.fail(now, why + fails))
        if restarting:
            return []
        remaining = sorted(self.membership.expected())
        self.timeline.add(now, EventKind.GOING_ON_WITHOUT, rank=rank, why=why, ranks=remaining)
        return self._form_if_joined(now)

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
            self._phase = RunPhase.TRAINING
            job = self.membership.job
            assert job is not None
            return list(self.rounds.begin(job, now, generation))
        self.rounds.carry_over(members)
        self.membership.adopt(members, welcome=True)
        self._phase = RunPhase.TRAINING
        took = None if self._lost_since is None else now - self._lost_since
        self._lost_since = None
        self.timeline.add(
            now,
            EventKind.GROUP_REFORMED,
            generation=generation,
            members=list(members),
            took_s=took,
        )
        if self.cycle.settled:
            return self._maybe_trigger(now)
        return list(self.rounds.redo(now, generation))

    # --- training ---------------------------------------------------------------------------

    def _generation(self) -> int:
        return self.rendezvous.generation or 0

    def _on_batch(self, rank: int, batch: Batch, now: float) -> list[Effect]:
        stats = self.stats[rank]
        stats.batches += 1
        stats.last_loss = batch.batch_loss
        if rank not in self.membership.member_set or self.rounds.dispatch.work is None:
            return []
        seen = self.rounds.on_batch(rank, batch, now)
        effects: list[Effect] = list(seen.effects)
        if seen.may_be_due:
            round_before = self.cycle.round
            effects += self._maybe_trigger(now)
            if seen.out_of_work and self.cycle.round == round_before and self._rounds_run():
                effects += self.rounds.fill(rank, now)
        return effects

    def _on_batches(self, rank: int, batches: Batches, now: float) -> list[Effect]:
        """Coalesced reports: each entry is taken as its own ``Batch``, in order, all at
        ``now``, so every decision is the one a burst of those reports would give.

        Runs of entries that cannot lead to a decision (:meth:`Rounds.quiet_reports`) are
        taken in one step; only the others go through :meth:`_on_batch` one by one, so a
        frame costs about as much as one report, however many it carries.
        """
        effects: list[Effect] = []
        stats = self.stats[rank]
        total = len(batches.batch_ms)
        if rank not in self.membership.member_set or self.rounds.dispatch.work is None:
            stats.batches += total  # not training with the group: only counted
            stats.last_loss = batches.batch_loss[-1]
            return effects
        index = 0
        while index < total and not self.finished:
            # (when the run ended on one of them, the rest would be ignored anyway)
            quiet = self.rounds.quiet_reports(rank, total - index)
            if quiet:
                self.rounds.absorb(rank, batches, index, quiet, now)
                index += quiet
                stats.batches += quiet
                stats.last_loss = batches.batch_loss[index - 1]
                continue
            effects += self._on_batch(rank, batches.report(index), now)
            index += 1
        return effects

    def _on_metrics(self, rank: int, metrics: Metrics, now: float) -> list[Effect]:
        if rank not in self.membership.member_set:
            return []
        waited_enough = self.rounds.on_completion(rank, metrics, now)
        effects: list[Effect] = list(self.rounds.close_epochs(now))
        if waited_enough:
            effects += self.rounds.start(now, self._generation(), delivered=True)
        else:
            effects += self._maybe_trigger(now)
        return effects

    def _on_ack(self, rank: int, ack: SyncAck, now: float) -> list[Effect]:
        if ack.round == self.cycle.round:
            self.stats[rank].syncs += 1
        effects: list[Effect] = []
        if self.rounds.on_ack(ack, now):
            effects += self._round_settled(now)
        effects += self._maybe_trigger(now)
        return effects

    def _rounds_run(self) -> bool:
        """Rounds may start and work be handed out: training, and no group is forming."""
        return self.phase is RunPhase.TRAINING and not self.rendezvous.pending

    def _maybe_trigger(self, now: float) -> list[Effect]:
        if not self._rounds_run():
            return []
        due = self.rounds.due()
        if due is Due.ALL_DONE:
            # The trained model is saved before the ranks are let go.
            effects: list[Effect] = list(self.rounds.close_epochs(now))
            saving = self.rounds.final_saves(now)
            if saving is not None:
                return effects + saving
            return effects + self._shutdown(now, "all epochs done")
        if due is not Due.NOW:
            return []
        joiners = self.membership.joiners & self.alive
        if joiners:
            # Grow the group first; the round then runs with the joiners in it (their mass is
            # zero, so they receive the survivors' average and contribute nothing to it).
            return self._reform(tuple(sorted(set(self.members) | joiners)), now)
        return list(self.rounds.start_or_wait(now, self._generation()))

    def _round_settled(self, now: float) -> list[Effect]:
        effects: list[Effect] = list(self.rounds.settled(now))
        if self.ending.held_save is not None:
            return effects + self.ending.release_save(now, settled=True)
        if self.ending.pending:
            return effects + self._shutdown(now, "stop requested")
        return effects + self.rounds.close_epochs(now)

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
        if self.phase is not RunPhase.JOINING and self._lost_since is None:
            self._lost_since = now
        if self.phase is RunPhase.JOINING:
            self.membership.left.update(loss.rank for loss in losses)
            return effects
        self.membership.drop_joiners(loss.rank for loss in losses)
        lost = [loss.rank for loss in losses if loss.rank in self.membership.member_set]
        survivors = tuple(r for r in self.members if self.liveness.is_alive(r))
        if self.phase is RunPhase.FORMING:
            if unrecoverable := self.ending.unrecoverable():
                return list(self.ending.save(unrecoverable, now, why))
            return self._regroup(self.rendezvous.poll(now, self.alive), now)
        for rank in lost:
            effects.append(Broadcast(DeclareDead(rank=rank), survivors))
            effects += self.rounds.drop(rank, survivors, now)
        if unrecoverable := self.ending.unrecoverable():
            return effects + self.ending.save(unrecoverable, now, why)
        if not lost:
            return effects
        if not self.settings.collective or (all_exited(losses) and self.rounds.all_work_done()):
            # Without a collective group there is nothing to re-form: the survivors go on.
            return effects + self._maybe_trigger(now)
        self.rounds.abandon()
        if self.rendezvous.pending:
            self._phase = RunPhase.REFORMING
            return effects + self._regroup(self.rendezvous.poll(now, self._eligible()), now)
        return effects + self._reform(survivors, now)

    def _lose(self, rank: int, now: float, why: str) -> list[Effect]:
        loss = self.liveness.on_disconnect(rank, now)
        return [] if loss is None else self._handle_losses([loss], now, why)

    def _reform(self, members: tuple[int, ...], now: float) -> list[Effect]:
        """Form the next generation of the group with ``members``."""
        self._phase = RunPhase.REFORMING
        ms_per_batch = self.pacing.ms_per_batch()
        return self._regroup(self.rendezvous.begin(now, members, ms_per_batch=ms_per_batch), now)

    def _shutdown(self, now: float, why: str) -> list[Effect]:
        return list(self.ending.shutdown(now, why))


def all_exited(losses: Sequence[RankLost]) -> bool:
    return all(loss.cause is LossCause.EXITED for loss in losses)
