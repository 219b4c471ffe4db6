"""The rank's lifecycle table (flodl.core.rank.state): every move, every ignored move, the rest."""

from __future__ import annotations

import enum
import itertools

import pytest

from flodl.core.rank.state import IGNORED, MOVES, TERMINAL, Move, RankState, next_state
from flodl.errors import ConfigError, OutOfTurn

ALL_PAIRS = list(itertools.product(RankState, Move))
ENDING = {RankState.ENDING, RankState.SAVE_PENDING, RankState.SAVING}


def name(value: object) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else str(value)


def test_the_table_is_exactly_the_documented_lifecycle() -> None:
    S, M = RankState, Move
    assert MOVES == {
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
    assert {S.EXITED, S.STOPPED, S.LOST, S.ABORTED} == TERMINAL


@pytest.mark.parametrize(("state", "move"), sorted(MOVES, key=str), ids=name)
def test_every_move_of_the_table_goes_where_the_table_says(state: RankState, move: Move) -> None:
    after = next_state(state, move)
    assert after is MOVES[(state, move)]
    assert after is not state  # a move in MOVES always changes the state


@pytest.mark.parametrize(("state", "move"), sorted(IGNORED, key=str), ids=name)
def test_every_ignored_move_keeps_the_state(state: RankState, move: Move) -> None:
    assert next_state(state, move) is state


def test_ignored_moves_are_losing_aborting_or_a_second_shutdown_once_ending_or_done() -> None:
    expected = {
        (state, move)
        for state in ENDING | TERMINAL
        for move in (Move.LOSE, Move.ABORT, Move.SHUTDOWN, Move.SHUTDOWN_WITH_SAVE)
    }
    assert expected == IGNORED
    assert not set(MOVES) & IGNORED


ILLEGAL = [pair for pair in ALL_PAIRS if pair not in MOVES and pair not in IGNORED]


@pytest.mark.parametrize(("state", "move"), ILLEGAL, ids=name)
def test_every_other_move_is_out_of_turn(state: RankState, move: Move) -> None:
    with pytest.raises(OutOfTurn, match=rf"state {state.value} cannot {move.value}"):
        next_state(state, move)


def test_the_illegal_moves_include_the_ones_that_matter() -> None:
    illegal = set(ILLEGAL)
    # No second announce, no goodbye or save before a shutdown, no save without ShutdownWithSave.
    assert (RankState.TRAINING, Move.ANNOUNCE) in illegal
    assert (RankState.TRAINING, Move.GOODBYE) in illegal
    assert (RankState.TRAINING, Move.START_SAVE) in illegal
    assert (RankState.ENDING, Move.START_SAVE) in illegal
    assert (RankState.SAVE_PENDING, Move.SAVE_FINISHED) in illegal
    assert (RankState.SAVING, Move.GOODBYE) in illegal
    assert (RankState.ENDING, Move.ANNOUNCE) in illegal
    # An abort after the run ended for the rank is not a second ending.
    assert next_state(RankState.ABORTED, Move.LOSE) is RankState.ABORTED
    assert (RankState.ABORTED, Move.ANNOUNCE) in illegal
    # 9 states x 8 moves, 12 moves, 28 ignored.
    assert len(ILLEGAL) == 9 * 8 - 12 - 28


@pytest.mark.parametrize("state", sorted(TERMINAL, key=str), ids=name)
def test_terminal_states_have_no_way_out(state: RankState) -> None:
    for move in Move:
        try:
            after = next_state(state, move)
        except OutOfTurn:
            continue
        assert after is state, f"{state} --{move}--> {after}"
    assert not [pair for pair in MOVES if pair[0] is state]


def test_every_state_is_reachable_from_joined() -> None:
    reached = {RankState.JOINED}
    frontier = [RankState.JOINED]
    while frontier:
        state = frontier.pop()
        for move in Move:
            try:
                after = next_state(state, move)
            except OutOfTurn:
                continue
            if after not in reached:
                reached.add(after)
                frontier.append(after)
    assert reached == set(RankState)


def test_every_non_terminal_state_can_reach_a_terminal_one() -> None:
    for start in set(RankState) - TERMINAL:
        state, seen = start, set()
        # Follow the documented happy path out of each state.
        path = {
            RankState.JOINED: Move.ANNOUNCE,
            RankState.TRAINING: Move.SHUTDOWN,
            RankState.ENDING: Move.GOODBYE,
            RankState.SAVE_PENDING: Move.START_SAVE,
            RankState.SAVING: Move.SAVE_FINISHED,
        }
        while state not in TERMINAL:
            assert state not in seen
            seen.add(state)
            state = next_state(state, path[state])
        assert state in TERMINAL


def test_out_of_turn_is_a_config_error() -> None:
    # Callers catching flodl's ConfigError (or ValueError) also catch a call out of turn.
    with pytest.raises(ConfigError):
        next_state(RankState.EXITED, Move.ANNOUNCE)
    with pytest.raises(ValueError):
        next_state(RankState.LOST, Move.GOODBYE)
