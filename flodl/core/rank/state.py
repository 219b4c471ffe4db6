"""A rank's lifecycle: one state, and the moves between states written as a table.

Modelled on h11's ``_state.py``: the legal moves are data, so a move that the protocol does
not allow is a typed error instead of a combination of flags nobody thought of::

    JOINED --announce--> TRAINING
    JOINED | TRAINING --shutdown--> ENDING --goodbye--> EXITED
    JOINED | TRAINING --shutdown_with_save--> SAVE_PENDING --start_save--> SAVING
                                                            --save_finished--> STOPPED
    JOINED | TRAINING --lose--> LOST  (the first boundary after saves the rank's own bundle)
    JOINED | TRAINING --abort--> ABORTED  (Abort: the coordinator let the rank go, no save)

EXITED, STOPPED, LOST and ABORTED are terminal. Once a rank is ending it no longer needs the
coordinator (it says goodbye and closes), so losing the connection then changes nothing:
those moves are in :data:`IGNORED`, as is a second Shutdown, an Abort once ending, and the
connection the coordinator closes after an Abort. :class:`Lifecycle` holds one
rank's state together with why its run ended (the error later calls raise, the exit reason
for its report, the save reason).
"""

from __future__ import annotations

import enum

from flodl.errors import CoordinatorError, FlodlError, OutOfTurn, RunAborted, ShutdownRequested
from flodl.wire.messages import SaveReason

__all__ = ["IGNORED", "MOVES", "TERMINAL", "Lifecycle", "Move", "RankState", "next_state"]


class RankState(enum.Enum):
    JOINED = "joined"
    """Connected; the job is not announced yet (no work can arrive)."""
    TRAINING = "training"
    """Announced: taking work, training, averaging."""
    ENDING = "ending"
    """Shutdown arrived: the next batch boundary says goodbye."""
    SAVE_PENDING = "save_pending"
    """ShutdownWithSave arrived: the next batch boundary saves the bundle."""
    SAVING = "saving"
    """The bundle for ShutdownWithSave is being written."""
    EXITED = "exited"
    """Goodbye sent after Shutdown: the run completed for this rank."""
    STOPPED = "stopped"
    """Goodbye sent after ShutdownWithSave (saved, or the save failed and the report says so)."""
    LOST = "lost"
    """The coordinator is lost (silent or disconnected): every later call raises."""
    ABORTED = "aborted"
    """Abort arrived: the coordinator let this rank go unsaved; every later call raises."""


class Move(enum.Enum):
    ANNOUNCE = "announce"
    SHUTDOWN = "shutdown"
    SHUTDOWN_WITH_SAVE = "shutdown_with_save"
    GOODBYE = "goodbye"
    START_SAVE = "start_save"
    SAVE_FINISHED = "save_finished"
    LOSE = "lose"
    ABORT = "abort"


S, M = RankState, Move

MOVES: dict[tuple[RankState, Move], RankState] = {
    (S.JOINED, M.ANNOUNCE): S.TRAINING,
    (S.JOINED, M.SHUTDOWN): S.ENDING,
    (S.TRAINING, M.SHUTDOWN): S.ENDING,
    (S.JOINED, M.SHUTDOWN_WITH_SAVE): S.SAVE_PENDING,
    (S.TRAINING, M.SHUTDOWN_WITH_SAVE): S.SAVE_PENDING,
    (S.ENDING, M.GOODBYE): S.EXITED,
    (S.SAVE_PENDING, M.START_SAVE): S.SAVING,
    (S.SAVING, M.SAVE_FINISHED): S.STOPPED,
    (S.JOINED, M.LOSE): S.LOST,
    (S.TRAINING, M.LOSE): S.LOST,
    (S.JOINED, M.ABORT): S.ABORTED,
    (S.TRAINING, M.ABORT): S.ABORTED,
}
"""Every legal move that changes the state."""

ENDING_STATES = frozenset({S.ENDING, S.SAVE_PENDING, S.SAVING})
TERMINAL = frozenset({S.EXITED, S.STOPPED, S.LOST, S.ABORTED})

IGNORED: frozenset[tuple[RankState, Move]] = frozenset(
    {(state, M.LOSE) for state in ENDING_STATES | TERMINAL}
    | {(state, M.ABORT) for state in ENDING_STATES | TERMINAL}
    | {(state, move) for state in ENDING_STATES | TERMINAL for move in (M.SHUTDOWN,)}
    | {(state, M.SHUTDOWN_WITH_SAVE) for state in ENDING_STATES | TERMINAL}
)
"""Moves that are legal but leave the state as it is (see the module docstring)."""

del S, M


def next_state(state: RankState, move: Move) -> RankState:
    """The state after ``move``; OutOfTurn when the table does not allow it in ``state``."""
    after = MOVES.get((state, move))
    if after is not None:
        return after
    if (state, move) in IGNORED:
        return state
    raise OutOfTurn(f"a rank in state {state.value} cannot {move.value}")


class Lifecycle:
    """One rank's state, moved only through :data:`MOVES`, and why it ended."""

    def __init__(self) -> None:
        self.state = RankState.JOINED
        self.error: FlodlError | None = None
        """Why the rank is LOST or STOPPED: what every later boundary raises."""
        self.exit_reason: str | None = None
        self.save_reason: SaveReason | None = None
        """Why the coordinator asked to save and stop (ShutdownWithSave)."""
        self.loss_save_due = False
        """LOST with the rank's own bundle not saved yet (the next boundary saves it)."""

    def move(self, move: Move) -> None:
        self.state = next_state(self.state, move)

    @property
    def ending(self) -> bool:
        """Shutdown or ShutdownWithSave arrived (or was carried out)."""
        return self.state in ENDING_STATES or self.state in (RankState.EXITED, RankState.STOPPED)

    @property
    def done(self) -> bool:
        """In a terminal state: nothing more will be sent or trained."""
        return self.state in TERMINAL

    @property
    def takes_rounds(self) -> bool:
        """A round may still start (not ending, not lost): worth waiting for a group."""
        return self.state is RankState.TRAINING

    def raise_if_lost(self) -> None:
        """Raise why the rank is LOST or ABORTED (nothing in any other state)."""
        if self.state is RankState.LOST or self.state is RankState.ABORTED:
            assert self.error is not None
            raise self.error

    def note_exit(self, reason: str) -> None:
        """Why the rank's run ended, unless that was already said."""
        if self.exit_reason is None:
            self.exit_reason = reason

    def lose(self, error: FlodlError) -> bool:
        """The coordinator is lost; False (nothing changes) once ending or ended."""
        if self.state not in (RankState.JOINED, RankState.TRAINING):
            return False
        self.move(Move.LOSE)
        self.error = error
        self.loss_save_due = True
        self.note_exit(f"coordinator_lost: {error}")
        return True

    def abort(self, reason: str) -> bool:
        """Abort arrived: ABORTED, with RunAborted for later calls; False (nothing changes)
        once ending or ended."""
        if self.state not in (RankState.JOINED, RankState.TRAINING):
            return False
        self.move(Move.ABORT)
        self.error = RunAborted(f"the coordinator ended this rank's run: {reason}")
        self.note_exit(f"aborted: {reason}")
        return True

    def saved_after_loss(self, outcome: str) -> None:
        """The bundle saved because the coordinator is lost was written (or not: ``outcome``
        says): the error later boundaries raise says so."""
        self.loss_save_due = False
        self.error = CoordinatorError(f"{self.error}; {outcome}")

    def shut_down(self, reason: SaveReason | None) -> bool:
        """Shutdown (``reason`` None) or ShutdownWithSave arrived; False when already ending."""
        if self.ending or self.done:
            return False
        self.move(Move.SHUTDOWN if reason is None else Move.SHUTDOWN_WITH_SAVE)
        self.save_reason = reason
        return True

    def saved(self, outcome: str) -> SaveReason:
        """The bundle for ShutdownWithSave was written (or not: ``outcome`` says): STOPPED,
        and the error later boundaries raise. OutOfTurn unless saving."""
        reason = self.save_reason
        if reason is None or self.state is not RankState.SAVING:
            raise OutOfTurn(f"save_finished() in state {self.state.value}")
        self.move(Move.SAVE_FINISHED)
        message = f"coordinator asked to save and stop: {reason.name} ({outcome})"
        self.error = ShutdownRequested(
            message, reason, stopped_as_asked=reason is SaveReason.GRACEFUL
        )
        self.note_exit(f"shutdown_with_save:{reason.name}")
        return reason
