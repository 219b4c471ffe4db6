"""Every rank state against every coordinator message, and local calls out of turn.

Each state is reached through the machine's public API only (:func:`machine_in`); then each
message of :data:`flodl.wire.messages.TO_RANK` is delivered and what it did is checked: the
reactions, the state after, and what it changed (inbox, throttle, global step, last epoch).
"""

from __future__ import annotations

import attrs
import pytest

from flodl.core.common.policy import Policy
from flodl.core.common.work import BatchSlice
from flodl.core.rank.effects import (
    Average,
    CancelRound,
    DoomGroup,
    Finish,
    HandOut,
    Ignored,
    JoinGroup,
    PrepareGroup,
    Raise,
    RankEffect,
    SaveAndStop,
    SaveCheckpoint,
    Wait,
    Wake,
)
from flodl.core.rank.machine import RankMachine
from flodl.core.rank.state import RankState
from flodl.errors import (
    CoordinatorError,
    OutOfTurn,
    RunAborted,
    ShutdownRequested,
    UnexpectedMessage,
)
from flodl.wire.messages import (
    TO_RANK,
    Abort,
    Batch,
    Checkpoint,
    CheckpointResult,
    CoordHeartbeat,
    DeclareDead,
    EpochAggregated,
    Exiting,
    Message,
    NewGroupSession,
    Note,
    RequestNewGroup,
    RunSettings,
    SaveConsensusModel,
    SaveReason,
    SetGlobalStep,
    Shutdown,
    ShutdownWithSave,
    SyncNow,
    Throttle,
)
from tests.core.test_rank_machine import (
    FIGURES,
    JOB,
    epoch_work,
    extend,
    new_machine,
    next_batch,
    sent,
    state_of,
)

S = RankState
ENDING_STATES = (S.ENDING, S.SAVE_PENDING, S.SAVING)
TERMINAL_STATES = (S.EXITED, S.STOPPED, S.LOST, S.ABORTED)


def machine_in(state: RankState, policy: Policy = Policy.CADENCE) -> RankMachine:
    """A rank-0 machine driven into ``state`` through its public API, with no batch out,
    nothing queued and not throttled."""
    if state is S.JOINED:
        machine = new_machine(policy, job=None)
    else:
        machine = new_machine(policy)
    if state in (S.ENDING, S.EXITED):
        machine.receive(Shutdown())
    elif state in (S.SAVE_PENDING, S.SAVING, S.STOPPED):
        machine.receive(ShutdownWithSave(reason=SaveReason.MAX_FAILURE))
    elif state is S.LOST:
        machine.connection_lost(CoordinatorError("the coordinator went away"))
    elif state is S.ABORTED:
        machine.receive(Abort(reason="rank 1 describes another job"))
    if state in (S.EXITED, S.SAVING, S.STOPPED):
        machine.enter_boundary(1.0)
        machine.boundary(1.0)  # goodbye, or the save begins
        if state is S.STOPPED:
            machine.save_finished("saved to /runs/bundle", 1.0, None, "/runs/bundle")
        machine.leave_boundary(1.0)
    assert state_of(machine) is state
    assert machine.current is None and machine.queued == 0 and not machine.throttled
    return machine


SUMMARY = EpochAggregated(epoch=0, avg_loss=0.5, samples=20, epoch_ms=100.0)
REQUEST = RequestNewGroup(generation=1, world_size=2)
SESSION = NewGroupSession(generation=1, new_rank=0, new_world_size=2, info=b"store")
SAVE_CONSENSUS = SaveConsensusModel(target_rank=0)
MESSAGES: dict[str, Message] = {
    "CoordHeartbeat": CoordHeartbeat(),
    "StartEpoch": epoch_work(0, 0, 8),
    "ExtendPartition": extend(0, 8, 4),
    "SyncNow": SyncNow(round=1, generation=0),
    "Checkpoint": Checkpoint(version=1, target_rank=0),
    "SaveConsensusModel": SAVE_CONSENSUS,
    "SetGlobalStep": SetGlobalStep(global_step=9),
    "Throttle": Throttle(),
    "DeclareDead": DeclareDead(rank=1),
    "RequestNewGroup": REQUEST,
    "NewGroupSession": SESSION,
    "EpochAggregated": SUMMARY,
    "Shutdown": Shutdown(),
    "ShutdownWithSave": ShutdownWithSave(reason=SaveReason.GRACEFUL),
    "Abort": Abort(reason="the run could not start"),
    "RunSettings": RunSettings(
        policy="cadence", seed=0, heartbeat_interval=1.0, heartbeat_timeout=10.0
    ),
}


def test_the_messages_are_every_coordinator_to_rank_message() -> None:
    assert {type(m) for m in MESSAGES.values()} == set(TO_RANK)
    assert all(type(m).__name__ == name for name, m in MESSAGES.items())


@attrs.frozen
class Seen:
    """What a machine shows after a message (besides the reactions)."""

    state: RankState
    queued: int = 0
    throttled: bool = False
    global_step: int = 0
    last_epoch: EpochAggregated | None = None


def seen(machine: RankMachine) -> Seen:
    return Seen(
        machine.life.state,
        machine.queued,
        machine.throttled,
        machine.global_step,
        machine.last_epoch,
    )


def deliver(machine: RankMachine, message: Message) -> tuple[list[RankEffect], Seen]:
    reactions: list[RankEffect] = list(machine.receive(message))
    return reactions, seen(machine)


# What each message does to a rank that is taking part in the run (JOINED or TRAINING), where
# both agree. The state-specific ones follow.
GROUP_REACTIONS: dict[str, list[RankEffect]] = {
    "DeclareDead": [DoomGroup(1), CancelRound(), Wake()],
    "RequestNewGroup": [PrepareGroup(REQUEST), Wake()],
    "NewGroupSession": [JoinGroup(SESSION), Wake()],
}


def common(state: RankState, name: str) -> tuple[list[RankEffect], Seen] | None:
    """The outcome shared by JOINED and TRAINING, or None for a state-specific message."""
    if name in GROUP_REACTIONS:
        return GROUP_REACTIONS[name], Seen(state)
    outcomes: dict[str, tuple[list[RankEffect], Seen]] = {
        "CoordHeartbeat": ([], Seen(state)),
        "RunSettings": ([], Seen(state)),  # the shell's: applied before the machine exists
        "SetGlobalStep": ([], Seen(state, global_step=9)),
        "Throttle": ([Wake()], Seen(state, throttled=True)),
        "EpochAggregated": ([], Seen(state, last_epoch=SUMMARY)),
        "Shutdown": ([CancelRound(), Wake()], Seen(S.ENDING)),
        "ShutdownWithSave": ([CancelRound(), Wake()], Seen(S.SAVE_PENDING)),
        "Abort": ([CancelRound(), Wake()], Seen(S.ABORTED)),
    }
    return outcomes.get(name)


NEEDS_JOB = ["StartEpoch", "ExtendPartition", "SyncNow", "Checkpoint", "SaveConsensusModel"]


@pytest.mark.parametrize("name", list(MESSAGES))
def test_each_message_before_the_job_is_announced(name: str) -> None:
    machine = machine_in(S.JOINED)
    if name in NEEDS_JOB:
        with pytest.raises(UnexpectedMessage, match=rf"{name} before the job was announced"):
            machine.receive(MESSAGES[name])
        assert seen(machine) == Seen(S.JOINED)  # nothing changed
        return
    assert deliver(machine, MESSAGES[name]) == common(S.JOINED, name)


TRAINING_ONLY: dict[str, tuple[list[RankEffect], Seen]] = {
    "StartEpoch": ([Wake(boundary=False)], Seen(S.TRAINING)),
    "ExtendPartition": ([Wake(boundary=False)], Seen(S.TRAINING)),
    "SyncNow": ([Wake()], Seen(S.TRAINING, queued=1)),
    "Checkpoint": ([Wake()], Seen(S.TRAINING, queued=1)),
}


@pytest.mark.parametrize("name", list(MESSAGES))
def test_each_message_while_training(name: str) -> None:
    machine = machine_in(S.TRAINING)
    reactions, after = deliver(machine, MESSAGES[name])
    if name == "SaveConsensusModel":
        (ignored,) = reactions
        assert isinstance(ignored, Ignored) and ignored.message == SAVE_CONSENSUS
        assert "not supported" in ignored.why
        assert after == Seen(S.TRAINING)
        return
    expected = TRAINING_ONLY.get(name) or common(S.TRAINING, name)
    assert (reactions, after) == expected
    # What the boundary then does with it.
    steps = next_batch(machine, 5.0).steps
    if name in ("StartEpoch", "ExtendPartition"):
        assert steps == [
            HandOut(BatchSlice(0, 0, 4) if name == "StartEpoch" else BatchSlice(0, 8, 12))
        ]
    elif name == "SyncNow":
        assert steps[0] == Average(SyncNow(round=1, generation=0))
    elif name == "Checkpoint":
        assert steps[0] == SaveCheckpoint(Checkpoint(version=1, target_rank=0))
    elif name == "Shutdown":
        assert steps == [Finish()]
    elif name == "ShutdownWithSave":
        assert steps[0] == SaveAndStop("GRACEFUL")
    elif name == "Abort":
        (raised,) = steps
        assert isinstance(raised, Raise) and isinstance(raised.error, RunAborted)
        assert "ended this rank's run: the run could not start" in str(raised.error)
    else:
        assert steps == [Wait()]


@pytest.mark.parametrize("state", ENDING_STATES, ids=lambda s: s.value)
@pytest.mark.parametrize("name", list(MESSAGES))
def test_each_message_while_ending(state: RankState, name: str) -> None:
    machine = machine_in(state)
    reactions, after = deliver(machine, MESSAGES[name])
    if name in GROUP_REACTIONS:
        # Group messages still reach the shell (a collective in flight must be abandoned).
        assert (reactions, after) == (GROUP_REACTIONS[name], Seen(state))
    elif name == "EpochAggregated":
        assert (reactions, after) == ([], Seen(state, last_epoch=SUMMARY))
    else:
        # Work, rounds, throttles, checkpoints and further shutdowns no longer matter.
        assert (reactions, after) == ([], Seen(state))
    # And the way out is the same as without the message.
    if state is S.SAVING:
        bye = sent(machine.save_finished("saved", 1.0, None, "/runs/bundle"))
        assert [type(m) for m in bye] == [CheckpointResult, Note, Exiting]
        assert state_of(machine) is S.STOPPED
        return
    steps = next_batch(machine, 5.0).steps
    if state is S.ENDING:
        assert steps == [Finish()] and state_of(machine) is S.EXITED
    else:
        assert steps[0] == SaveAndStop("MAX_FAILURE") and isinstance(steps[1], Raise)
        assert state_of(machine) is S.STOPPED


@pytest.mark.parametrize("state", TERMINAL_STATES, ids=lambda s: s.value)
@pytest.mark.parametrize("name", list(MESSAGES))
def test_each_message_once_done_is_dropped(state: RankState, name: str) -> None:
    machine = machine_in(state)
    before = seen(machine)
    assert deliver(machine, MESSAGES[name]) == ([], before)
    assert machine.life.done


@pytest.mark.parametrize("name", NEEDS_JOB)
def test_work_after_a_rank_was_lost_before_its_job_is_dropped_not_unexpected(name: str) -> None:
    machine = new_machine(job=None)
    machine.connection_lost(CoordinatorError("gone"))
    assert machine.receive(MESSAGES[name]) == []


def test_a_message_for_the_coordinator_is_ignored_with_a_reason() -> None:
    machine = machine_in(S.TRAINING)
    stray = Batch(rank=1, batch_ms=1.0, data_ms=0.0, step_count=1, batch_loss=0.1)
    (ignored,) = machine.receive(stray)
    assert isinstance(ignored, Ignored) and ignored.message == stray
    assert seen(machine) == Seen(S.TRAINING)


# --- what the next boundary does in each state -----------------------------------------------


def test_the_next_boundary_in_each_state() -> None:
    with pytest.raises(OutOfTurn, match="announce"):
        machine_in(S.JOINED).enter_boundary(0.0)
    assert next_batch(machine_in(S.TRAINING), 5.0).effects == [Wait()]
    ending = machine_in(S.ENDING)
    assert [type(m) for m in next_batch(ending, 5.0).sent] == [Note, Exiting]
    assert state_of(ending) is S.EXITED
    pending = machine_in(S.SAVE_PENDING)
    pending.enter_boundary(5.0)
    assert pending.boundary(5.0) == [CancelRound(), SaveAndStop("MAX_FAILURE")]
    assert state_of(pending) is S.SAVING
    saving = machine_in(S.SAVING)
    saving.enter_boundary(5.0)
    with pytest.raises(OutOfTurn, match="SaveAndStop"):
        saving.boundary(5.0)
    assert next_batch(machine_in(S.EXITED), 5.0).effects == [Finish()]
    (stopped,) = next_batch(machine_in(S.STOPPED), 5.0).effects
    assert isinstance(stopped, Raise) and isinstance(stopped.error, ShutdownRequested)
    assert stopped.error.reason is SaveReason.MAX_FAILURE
    (lost,) = next_batch(machine_in(S.LOST), 5.0).effects
    assert isinstance(lost, Raise) and isinstance(lost.error, CoordinatorError)
    aborted = machine_in(S.ABORTED)
    (raised,) = next_batch(aborted, 5.0).effects
    assert isinstance(raised, Raise) and isinstance(raised.error, RunAborted)
    assert "rank 1 describes another job" in str(raised.error)
    assert aborted.tallies()["exit_reason"] == "aborted: rank 1 describes another job"


def test_an_abort_before_the_job_is_announced_is_raised_by_the_announce() -> None:
    machine = machine_in(S.JOINED)
    assert machine.receive(
        Abort(reason="ranks [1] did not join within the join timeout (300 s)")
    ) == [
        CancelRound(),
        Wake(),
    ]
    with pytest.raises(RunAborted, match=r"did not join within the join timeout"):
        machine.announce(JOB)
    assert (
        machine.tallies()["exit_reason"]
        == "aborted: ranks [1] did not join within the join timeout (300 s)"
    )


def test_losing_the_connection_after_an_abort_changes_nothing() -> None:
    machine = machine_in(S.ABORTED)
    assert machine.connection_lost(CoordinatorError("closed")) == []
    assert state_of(machine) is S.ABORTED
    assert machine.tallies()["exit_reason"] == "aborted: rank 1 describes another job"
    (raised,) = next_batch(machine, 5.0).effects
    assert isinstance(raised, Raise) and isinstance(raised.error, RunAborted)


# --- local calls out of turn -----------------------------------------------------------------

ALL_STATES = list(RankState)


@pytest.mark.parametrize("state", ALL_STATES, ids=lambda s: s.value)
def test_batch_done_with_no_batch_out_is_out_of_turn(state: RankState) -> None:
    machine = machine_in(state)
    with pytest.raises(OutOfTurn, match="batch_done"):
        machine.batch_done(0.5, 0.0, 9.0)
    assert machine.batches == 0


@pytest.mark.parametrize("state", ALL_STATES, ids=lambda s: s.value)
def test_boundary_outside_enter_and_leave_is_out_of_turn(state: RankState) -> None:
    machine = machine_in(state)
    with pytest.raises(OutOfTurn, match="enter_boundary"):
        machine.boundary(9.0)
    if machine.job is not None:
        machine.enter_boundary(9.0)
        machine.leave_boundary(9.5)
        with pytest.raises(OutOfTurn, match="enter_boundary"):
            machine.boundary(9.5)  # left again


@pytest.mark.parametrize(
    "state", [s for s in ALL_STATES if s is not S.SAVING], ids=lambda s: s.value
)
def test_save_finished_when_not_saving_is_out_of_turn(state: RankState) -> None:
    machine = machine_in(state)
    with pytest.raises(OutOfTurn, match="save_finished"):
        machine.save_finished("saved", 1.0, None, "/runs/bundle")
    assert state_of(machine) is state


@pytest.mark.parametrize("state", ALL_STATES, ids=lambda s: s.value)
def test_blend_finished_with_nothing_landed_is_out_of_turn(state: RankState) -> None:
    machine = machine_in(state, Policy.ASYNC)
    with pytest.raises(OutOfTurn, match="blend_finished"):
        machine.blend_finished(FIGURES, 0.0)
    with pytest.raises(OutOfTurn, match="blend_finished"):
        machine.blend_finished(None, 0.0)


@pytest.mark.parametrize("state", ALL_STATES, ids=lambda s: s.value)
def test_take_reserved_with_nothing_reserved_is_out_of_turn(state: RankState) -> None:
    machine = machine_in(state)
    with pytest.raises(OutOfTurn, match="take_reserved"):
        machine.take_reserved(9.0)
    assert machine.current is None


def test_enter_boundary_before_the_job_is_out_of_turn_even_after_a_shutdown() -> None:
    machine = new_machine(job=None)
    machine.receive(Shutdown())
    with pytest.raises(OutOfTurn, match="announce"):
        machine.enter_boundary(0.0)
    machine.announce(JOB)
    assert [type(m) for m in next_batch(machine, 1.0).sent] == [Note, Exiting]
