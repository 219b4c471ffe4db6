"""A rank's lifecycle: one state, and the moves between states written as a table.

Modelled on h11's ``_state.py``: the legal moves are data, so a move that the protocol does
not allow is a typed error instead of a combination of flags nobody thought of::

    JOINED --announce--> TRAINING
    JOINED | TRAINING --shutdown--> ENDING --goodbye--> EXITED
    JOINED | TRAINING --shutdown_with_save--> SAVE_PENDING --start_save--> SAVING
                                                            --save_finished--> STOPPED
    JOINED | TRAINING --lose--> LOST

EXITED, STOPPED and LOST are terminal. Once a rank is ending it no longer needs the
coordinator (it says goodbye and closes), so losing the connection then changes nothing:
those moves are in :data:`IGNORED`, as is a second Shutdown.
"""

from __future__ import annotations

import enum

from flodl.errors import OutOfTurn

__all__ = ["IGNORED", "MOVES", "TERMINAL", "Move", "RankState", "next_state"]


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


class Move(enum.Enum):
    ANNOUNCE = "announce"
    SHUTDOWN = "shutdown"
    SHUTDOWN_WITH_SAVE = "shutdown_with_save"
    GOODBYE = "goodbye"
    START_SAVE = "start_save"
    SAVE_FINISHED = "save_finished"
    LOSE = "lose"


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
}
"""Every legal move that changes the state."""

ENDING_STATES = frozenset({S.ENDING, S.SAVE_PENDING, S.SAVING})
TERMINAL = frozenset({S.EXITED, S.STOPPED, S.LOST})

IGNORED: frozenset[tuple[RankState, Move]] = frozenset(
    {(state, M.LOSE) for state in ENDING_STATES | {S.EXITED, S.STOPPED, S.LOST}}
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
