"""The coordinator's decisions, composed: one pure state machine driven by events and time.

:class:`CoordinatorMachine` wires its parts into the behaviour of a floDl coordinator:
:class:`~flodl.core.coordinator.membership.Membership` (the job, the members, the joiners),
:class:`~flodl.core.coordinator.joining.Joining` (who joins, and when the run starts without the
ranks missing), :class:`~flodl.core.coordinator.formation.Formation` (the run's phase and each
generation of the group, formed by the :class:`~flodl.core.coordinator.rendezvous.Rendezvous`),
:class:`~flodl.core.coordinator.rounds.Rounds` (the averaging rounds, with ElChe's pacing and each
window's work), :class:`~flodl.core.coordinator.liveness.Liveness` (dead ranks),
:class:`~flodl.core.coordinator.losses.Losses` (what a loss does to the group) and
:class:`~flodl.core.coordinator.ending.Ending` (how the run ends). The machine decides the order of
things: which part hears of an event, and whether a round may start after what a part did (a
part answers with its effects and whether one may be due,
:class:`~flodl.core.coordinator.formation.Answer`). The trio shell (:mod:`flodl.coordinator`) feeds
it events with the current time and performs the effects it returns; the machine never waits,
sleeps or sends. That makes every rule testable with plain calls, and lets one process simulate
thousands of ranks.

Lifecycle (:class:`~flodl.core.coordinator.formation.RunPhase`): JOINING (every rank connects
and sends :class:`~flodl.wire.messages.Ready`; a rank whose process dies first is waited for
when it is restarted, else the run starts without it while enough ranks remain) -> FORMING
(generation 0 of the group: RequestNewGroup / NewGroupReady / NewGroupSession) -> TRAINING
(windows of ElChe counts; a round averages them) <-> REFORMING (after a death the survivors
form the next generation, then redo the interrupted round) -> FINISHED (all epochs done, the
final checkpoint saved and Shutdown sent, or a ShutdownWithSave because the run cannot go on).

Work protocol (what ranks must do, see also :mod:`flodl.core.coordinator.partitions`): a rank works
through the sample ranges it is given (StartEpoch, ExtendPartition) in order, one ``Batch`` report
per finished batch (or several in one ``Batches`` frame, taken exactly as that many ``Batch``
reports arriving together; a rank that coalesces sends them before anything else it sends);
when it has nothing left it sends one ``Metrics`` report for the chunk it just
finished (its *completion frame*, carrying the chunk's delivered wall time) and waits. After a
collective it bumps its step count, so its next report acknowledges the round.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from flodl.core.cadence.elche import ElChe
from flodl.core.coordinator.effects import Broadcast, Send
from flodl.core.coordinator.ending import Ending, Outcome, Status, record_save
from flodl.core.coordinator.formation import Answer, Formation, RunPhase
from flodl.core.coordinator.joining import Joining
from flodl.core.coordinator.liveness import Liveness
from flodl.core.coordinator.losses import Losses
from flodl.core.coordinator.membership import Membership
from flodl.core.coordinator.rendezvous import Rendezvous
from flodl.core.coordinator.requests import ScriptRequests
from flodl.core.coordinator.rounds import Due, ResumeState, Rounds
from flodl.core.coordinator.settings import MachineSettings
from flodl.core.coordinator.stats import RankStats
from flodl.core.coordinator.timeline import Timeline
from flodl.wire.messages import (
    STOP_SAVE_VERSION,
    Batch,
    Batches,
    CheckpointResult,
    Exiting,
    Heartbeat,
    Intent,
    JoinResult,
    LrUpdate,
    Message,
    Metrics,
    NewGroupReady,
    Note,
    Ready,
    SaveReason,
    SyncAck,
)

__all__ = [
    "CoordinatorMachine",
    "Disconnect",
    "Effect",
    "Outcome",
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
        self.stats = [RankStats() for _ in range(world_size)]
        timeouts = settings.timeouts
        self.created_at = now
        """When the machine was created (its deadlines count from here)."""
        self.liveness = Liveness(world_size, heartbeat_timeout=timeouts.heartbeat, now=now)
        self.rendezvous = Rendezvous(
            world_size, local_ranks=local_ranks, retry_timeout=timeouts.rendezvous_retry
        )
        resume = resume or ResumeState()
        join_deadline = now + timeouts.join
        self.membership = Membership(world_size, join_deadline, first_epoch=resume.epoch)
        self.rounds = Rounds(settings, self.timeline, self.membership, self.liveness, resume)
        self.cycle = self.rounds.cycle
        self.pacing = self.rounds.pacing
        self.ending = Ending(settings, self.timeline, self.cycle, self.liveness)
        self.formation = Formation(
            self.rendezvous, self.membership, self.liveness, self.rounds, self.ending, self.timeline
        )
        self.joining = Joining(
            world_size,
            settings,
            self.membership,
            self.liveness,
            self.ending,
            self.timeline,
            self.stats,
            supervised=local_ranks == frozenset(range(world_size)),
        )
        parts = (self.rounds, self.ending, self.membership, self.liveness, self.timeline)
        self.requests = ScriptRequests(settings.max_time, *parts)
        self.losses = Losses(
            settings,
            self.formation,
            self.membership,
            self.liveness,
            self.rounds,
            self.ending,
            self.timeline,
            self.stats,
        )

    # --- queries --------------------------------------------------------------------------

    @property
    def phase(self) -> RunPhase:
        return RunPhase.FINISHED if self.ending.over else self.formation.phase

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
        return self.losses.lost_ranks()

    def counts(self) -> dict[int, int]:
        """ElChe's batch count per member (global rank -> batches per window)."""
        return self.pacing.counts(self.members)

    def next_deadline(self) -> float:
        """The latest time at which :meth:`on_tick` must run (``inf`` when nothing is due);
        called after every batch of reports, so it builds no list."""
        if self.finished:
            return math.inf
        best = math.inf
        for deadline in (
            self.liveness.next_deadline(),
            self.rounds.next_deadline(),
            self.rendezvous.next_deadline(),
            self.ending.held_until,
            self.joining.deadline,
            self.requests.deadline,
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
        self.joining.connected(rank, now)
        effects: list[Effect] = []
        # This is a flodl run after all: the exits held back are deaths before joining.
        while not self.finished and (gone := self.joining.held_back_exit()) is not None:
            effects += self._died_joining(gone, "exited with code 0", now, restarting=False)
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
                held = self.joining.exited_unjoined(rank, now)
                if held is not None:
                    return list(held)
            how = f"exited with code {returncode}"
            return self._died_joining(rank, how, now, restarting=restarting)
        return self._lose(rank, now, f"process exited with code {returncode}")

    def request_stop(self, now: float, save: bool = True) -> list[Effect]:
        """End the run now: with a save (ShutdownWithSave(GRACEFUL)) or a plain Shutdown."""
        if self.finished:
            return []
        if save:
            return self._carry_out(self.requests.save_and_stop(now, "stop requested"), now)
        return list(self.ending.shutdown(now, "stop requested"))

    # --- events: messages -------------------------------------------------------------------

    def on_message(self, rank: int, message: Message, now: float) -> list[Effect]:
        """One message from ``rank`` (identity verified by the shell); ignored once it is dead."""
        if not self.liveness.on_frame(rank, now):
            return []
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
        if isinstance(message, Heartbeat | Note):
            return []
        if isinstance(message, JoinResult):
            self.rounds.on_join_result(now, message)
            return []
        if isinstance(message, Ready):
            return self._on_ready(rank, message, now)
        if isinstance(message, NewGroupReady):
            return self._carry_out(self.formation.on_ready(now, message), now)
        if isinstance(message, Exiting):
            self.liveness.on_exiting(rank, now)
            return []
        if isinstance(message, LrUpdate):
            self.stats[rank].lr = message.lr
            return []
        if isinstance(message, Intent):
            return self._carry_out(self.requests.on_intent(rank, message, now), now)
        if isinstance(message, CheckpointResult):
            record_save(self.timeline, now, rank, message)
            return self._maybe_trigger(now) if self.rounds.on_checkpoint_result(message) else []
        return [Disconnect(rank, f"unexpected {type(message).__name__} from a rank")]

    def on_tick(self, now: float) -> list[Effect]:
        """Act on every deadline that has passed by ``now``."""
        if self.finished:
            return []
        effects: list[Effect] = []
        join_deadline = self.joining.deadline
        if join_deadline is not None and now >= join_deadline:
            ended = self.joining.timed_out(now)
            return self._form_if_joined(now) if ended is None else list(ended)
        losses = self.liveness.check(now)
        if losses:
            why = "silent past the heartbeat timeout"
            # It may only be paused (SIGSTOP): let go, it ends when it wakes (or is restarted)
            # instead of training on outside the group and reporting a stale model at the end.
            effects += [Disconnect(loss.rank, f"declared dead: {why}") for loss in losses]
            effects += self._carry_out(self.losses.lose(losses, now, why), now)
            if self.finished:
                return effects
        if self.cycle.check_stall(now):
            why = "averaging round unacknowledged past the ceiling"
            return effects + self.ending.save(SaveReason.REDUCE_STALL, now, why)
        held_until = self.ending.held_until
        if held_until is not None and now >= held_until:
            return effects + self.ending.release_save(now, settled=False)
        effects += self._carry_out(self.formation.poll(now), now)
        wait_until = self.rounds.wait_until
        if wait_until is not None and now >= wait_until:
            effects += self.rounds.start(now, self.formation.generation, delivered=False)
        final_until = self.rounds.saves.final_until
        if final_until is not None and now >= final_until:
            effects += self._maybe_trigger(now)
        return effects + self._carry_out(self.requests.on_tick(now), now)

    # --- joining and forming ----------------------------------------------------------------

    def _on_ready(self, rank: int, ready: Ready, now: float) -> list[Effect]:
        running = self.phase is not RunPhase.JOINING
        refused = self.joining.ready(rank, ready, now, running=running)
        if refused is not None:
            return [Disconnect(rank, refused)]
        # A rank (re)connected to a running job joins the group at the next round.
        return self._maybe_trigger(now) if running else self._form_if_joined(now)

    def _form_if_joined(self, now: float) -> list[Effect]:
        """Every rank the run waits for has joined: form generation 0 with them."""
        ranks = self.joining.world_joined()
        if ranks is None:
            return []
        return self._carry_out(self.formation.form_initial(now, ranks), now)

    def _died_joining(self, rank: int, how: str, now: float, *, restarting: bool) -> list[Effect]:
        """``rank``'s process died before the world joined (:meth:`Joining.died`)."""
        why = f"rank {rank} {how} before joining"
        if self.liveness.is_alive(rank):
            self._lose(rank, now, why)  # the connection's end is not read yet
        ended = self.joining.died(rank, why, now, restarting=restarting)
        return self._form_if_joined(now) if ended is None else list(ended)

    def _carry_out(self, answer: Answer, now: float) -> list[Effect]:
        """A part's answer: its effects, then, when it says a round may be due, what
        :meth:`_maybe_trigger` decides."""
        effects: list[Effect] = list(answer.effects)
        if answer.may_be_due:
            effects += self._maybe_trigger(now)
        return effects

    # --- training ---------------------------------------------------------------------------

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
            if seen.out_of_work and self.cycle.round == round_before and self.formation.running:
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
            effects += self.rounds.start(now, self.formation.generation, delivered=True)
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

    def _maybe_trigger(self, now: float) -> list[Effect]:
        if not self.formation.running:
            return []
        due = self.rounds.due()
        if due is Due.ALL_DONE:
            # The trained model is saved before the ranks are let go.
            effects: list[Effect] = list(self.rounds.close_epochs(now))
            if self.ending.held_for_last_round:  # a stop with a save: every rank saves now
                return effects + self.ending.release_save(now, settled=True)
            saving = self.rounds.final_saves(now)
            if saving is not None:
                return effects + saving
            return effects + self.ending.shutdown(now, self.requests.why or "all epochs done")
        if due is not Due.NOW:
            return []
        joiners = self.membership.joiners & self.alive
        if joiners:
            # Grow the group first; the round then runs with the joiners in it (their mass is
            # zero, so they receive the survivors' average and contribute nothing to it).
            members = tuple(sorted(set(self.members) | joiners))
            return self._carry_out(self.formation.reform(now, members), now)
        return list(self.rounds.start_or_wait(now, self.formation.generation))

    def _round_settled(self, now: float) -> list[Effect]:
        effects: list[Effect] = list(self.rounds.settled(now))
        if self.ending.held_save is not None and not self.ending.held_for_last_round:
            return effects + self.ending.release_save(now, settled=True)
        if self.ending.pending:
            return effects + self.ending.shutdown(now, "stop requested")
        return effects + self.rounds.close_epochs(now)

    # --- losses -----------------------------------------------------------------------------

    def _lose(self, rank: int, now: float, why: str) -> list[Effect]:
        """``rank``'s connection is gone: it is lost now (nothing if it was not alive)."""
        loss = self.liveness.on_disconnect(rank, now)
        return [] if loss is None else self._carry_out(self.losses.lose([loss], now, why), now)
