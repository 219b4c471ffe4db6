"""Deaths while the world joins (the coordinator machine's JOINING phase), pure.

A rank whose process dies before the run started is a death like any other: restarted, it is
waited for; not restarted, the run starts with the others while enough remain (``min_ranks``,
else the SingleSurvivor rule), and otherwise fails, telling every connected rank why
(``Abort``). A world whose every rank died unjoined has a broken script: it ends at once.
"""

from __future__ import annotations

import math

import attrs

from flodl.config import CoordinatorConfig
from flodl.core.coordinator.effects import Broadcast, Send
from flodl.core.coordinator.ending import Ending
from flodl.core.coordinator.machine import CoordinatorMachine, Disconnect, Effect, RunPhase, Status
from flodl.core.coordinator.rounds import ResumeState
from flodl.core.coordinator.timeline import EventKind
from flodl.wire.messages import Abort, Ready, RequestNewGroup, Shutdown

SETTINGS = CoordinatorConfig(join_timeout=5.0).machine_settings()
"""Ranks join at 1 s, well within the heartbeat timeout (10 s) at the join deadline."""


def machine(world: int, *, min_ranks: int | None = None) -> CoordinatorMachine:
    settings = attrs.evolve(SETTINGS, min_ranks=min_ranks)
    return CoordinatorMachine(world, settings, now=0.0)


def phase(m: CoordinatorMachine) -> RunPhase:
    """The machine's phase, read afresh (mypy narrows ``m.phase`` across calls otherwise)."""
    return m.phase


def ready(rank: int, batch_size: int = 8) -> Ready:
    return Ready(rank=rank, dataset_size=64, batch_size=batch_size, epochs=1)


def join(m: CoordinatorMachine, rank: int, now: float = 1.0) -> list[Effect]:
    assert m.on_connect(rank, now) == []
    return m.on_message(rank, ready(rank), now)


def aborts(effects: list[Effect]) -> list[str]:
    return [
        e.message.reason
        for e in effects
        if isinstance(e, Broadcast | Send) and isinstance(e.message, Abort)
    ]


def group_request(effects: list[Effect]) -> RequestNewGroup:
    (request,) = [
        e.message
        for e in effects
        if isinstance(e, Send | Broadcast) and isinstance(e.message, RequestNewGroup)
    ]
    return request


def test_without_a_restart_the_run_starts_with_the_ranks_that_remain() -> None:
    m = machine(3)
    join(m, 0)
    assert m.on_exit_reported(1, -9, 2.0) == []  # rank 2 has not joined yet
    assert m.phase is RunPhase.JOINING
    (going_on,) = m.timeline.of_kind(EventKind.GOING_ON_WITHOUT)
    assert going_on.detail == {
        "rank": 1,
        "why": "rank 1 exited with code -9 before joining",
        "ranks": [0, 2],
    }
    (death,) = m.timeline.of_kind(EventKind.RANK_DEAD)
    assert (death.detail["rank"], death.detail["cause"]) == (1, "exited")
    assert m.membership.missing() == [2]
    effects = join(m, 2, 3.0)
    assert phase(m) is RunPhase.FORMING
    assert group_request(effects).world_size == 2  # generation 0 of ranks 0 and 2
    assert m.stats[1].lost_at == 2.0


def test_the_last_rank_to_join_may_be_the_one_that_died() -> None:
    m = machine(3)
    join(m, 0)
    join(m, 2)
    effects = m.on_exit_reported(1, 1, 2.0)
    assert phase(m) is RunPhase.FORMING
    assert group_request(effects).world_size == 2


def test_a_rank_that_joined_then_died_is_one_death() -> None:
    m = machine(3)
    join(m, 0)
    join(m, 1)
    assert m.on_disconnect(1, 2.0, "connection closed") == []
    assert m.on_exit_reported(1, -9, 2.5) == []
    assert len(m.timeline.of_kind(EventKind.RANK_DEAD)) == 1
    assert m.membership.missing() == [2]
    assert m.phase is RunPhase.JOINING


def test_by_default_a_collective_needs_two_ranks_so_a_world_of_two_fails() -> None:
    m = machine(2)
    join(m, 0)
    effects = m.on_exit_reported(1, 3, 2.0)
    why = "rank 1 exited with code 3 before joining; 1 ranks remain (SINGLE_SURVIVOR)"
    assert aborts(effects) == [why]
    assert (m.outcome.status, m.outcome.message) == (Status.FAILED, why)
    assert effects == [Broadcast(Abort(reason=why))]  # to every rank connected


def test_min_ranks_above_the_ranks_that_remain_ends_the_run() -> None:
    m = machine(3, min_ranks=3)
    join(m, 0)
    join(m, 2)
    effects = m.on_exit_reported(1, -9, 2.0)
    why = "rank 1 exited with code -9 before joining; 2 ranks remain, fewer than min_ranks 3"
    assert aborts(effects) == [why] and m.outcome.status is Status.FAILED
    assert not m.timeline.of_kind(EventKind.GOING_ON_WITHOUT)


def test_min_ranks_at_or_below_the_ranks_that_remain_goes_on() -> None:
    m = machine(4, min_ranks=2)
    join(m, 0)
    join(m, 1)
    assert m.on_exit_reported(2, -9, 2.0) == []
    effects = m.on_exit_reported(3, -9, 2.5)
    assert phase(m) is RunPhase.FORMING and not aborts(effects)
    assert group_request(effects).world_size == 2
    assert len(m.timeline.of_kind(EventKind.GOING_ON_WITHOUT)) == 2


def test_a_restarted_rank_is_waited_for_and_joins_the_world() -> None:
    m = machine(2)
    join(m, 0)
    assert m.on_exit_reported(1, -9, 2.0, restarting=True) == []
    assert m.phase is RunPhase.JOINING and not m.finished
    assert m.membership.missing() == [1]
    assert not m.timeline.of_kind(EventKind.GOING_ON_WITHOUT)
    effects = join(m, 1, 4.0)
    assert phase(m) is RunPhase.FORMING
    assert group_request(effects).world_size == 2


def test_every_rank_dying_unjoined_ends_the_run_at_once_even_with_restarts() -> None:
    m = machine(3)
    assert m.on_exit_reported(0, 3, 1.0, restarting=True) == []
    assert m.on_exit_reported(1, 3, 1.1, restarting=True) == []
    effects = m.on_exit_reported(2, 3, 1.2, restarting=True)
    assert m.outcome.status is Status.FAILED
    assert m.outcome.message == "rank 2 exited with code 3 before joining"
    assert aborts(effects) == ["rank 2 exited with code 3 before joining"]


def test_a_refused_rank_is_disconnected_with_the_reason() -> None:
    m = machine(2)
    join(m, 0)
    m.on_connect(1, 1.0)
    (refused,) = m.on_message(1, ready(1, batch_size=4), 1.0)
    assert isinstance(refused, Disconnect) and refused.rank == 1
    assert refused.reason.startswith("rank 1 describes job Job(")


def test_a_run_resumed_past_the_epochs_its_ranks_train_refuses_them_with_why() -> None:
    """--resume of a run that had reached epoch 3, by a script that now trains 1 epoch: each
    rank is refused with the reason, before any group forms (the workload could not be built)."""
    m = CoordinatorMachine(2, SETTINGS, now=0.0, resume=ResumeState(epoch=3))
    m.on_connect(0, 1.0)
    (refused,) = m.on_message(0, ready(0), 1.0)
    assert isinstance(refused, Disconnect) and refused.rank == 0
    assert refused.reason == (
        "rank 0 described a job that cannot run: it trains 1 epochs, and the run it resumes "
        "had reached epoch 3 (resume with at least that many epochs)"
    )
    assert phase(m) is RunPhase.JOINING
    # Resuming at the very end is no error: nothing is left to train, and the run ends.
    done = CoordinatorMachine(1, SETTINGS, now=0.0, resume=ResumeState(epoch=1))
    assert not any(isinstance(e, Disconnect) for e in join(done, 0))


TIMED_OUT = "ranks [1] did not join within the join timeout (5 s)"


def test_the_join_deadline_aborts_every_rank_connected_when_too_few_joined() -> None:
    m = machine(2)
    join(m, 0)
    assert m.on_tick(4.9) == []
    effects = m.on_tick(5.0)
    why = TIMED_OUT + "; 1 joined, fewer than min_ranks 2"
    assert effects == [Broadcast(Abort(reason=why))]
    assert m.outcome.status is Status.FAILED
    assert m.outcome.message == why


def test_at_the_join_deadline_the_run_starts_with_the_ranks_that_joined() -> None:
    m = machine(3)
    join(m, 0)
    join(m, 2)
    effects = m.on_tick(5.0)
    assert phase(m) is RunPhase.FORMING  # generation 0 of ranks 0 and 2
    assert [type(e.message) for e in effects if hasattr(e, "message")] == [RequestNewGroup]
    (going_on,) = m.timeline.of_kind(EventKind.GOING_ON_WITHOUT)
    assert going_on.detail["ranks"] == [0, 2]
    assert going_on.detail["why"] == TIMED_OUT
    # Rank 1 turns up late: it is taken in as a rank that rejoins, not refused.
    m.on_connect(1, 6.0)
    effects = m.on_message(1, ready(1), 6.0)
    assert not any(isinstance(e, Disconnect) for e in effects)
    (late,) = [e for e in m.timeline.of_kind(EventKind.RANK_JOINED) if e.detail.get("rejoin")]
    assert late.detail["rank"] == 1


def test_min_ranks_decides_whether_a_short_world_may_start_at_the_deadline() -> None:
    m = machine(3, min_ranks=3)
    join(m, 0)
    join(m, 2)
    (abort,) = m.on_tick(5.0)
    assert isinstance(abort, Broadcast) and isinstance(abort.message, Abort)
    assert abort.message.reason == TIMED_OUT + "; 2 joined, fewer than min_ranks 3"
    m = machine(3, min_ranks=2)
    join(m, 0)
    join(m, 1)
    m.on_tick(5.0)
    assert phase(m) is RunPhase.FORMING and m.outcome.status is Status.RUNNING


def test_a_rank_connecting_after_the_run_failed_is_told_why() -> None:
    m = machine(2)
    join(m, 0)
    m.on_exit_reported(1, 3, 2.0)
    (sent,) = m.on_connect(1, 3.0)
    assert isinstance(sent, Send) and isinstance(sent.message, Abort)
    assert sent.message.reason.startswith("the run has ended: rank 1 exited with code 3")


def test_a_rank_connecting_after_the_run_completed_is_shut_down() -> None:
    m = machine(2)
    join(m, 0)
    join(m, 1)
    m.request_stop(2.0, save=False)
    assert m.outcome.status is Status.COMPLETED
    m.on_disconnect(1, 2.5)
    assert m.on_connect(1, 3.0) == [Send(1, Shutdown())]


def test_ending_fail_broadcasts_abort_with_the_reason() -> None:
    m = machine(2)
    ending: Ending = m.ending
    assert ending.fail(5.0, "no luck") == [Broadcast(Abort(reason="no luck"))]
    assert (m.outcome.status, m.outcome.message) == (Status.FAILED, "no luck")
    long = "x" * 5000
    m2 = machine(2)
    (broadcast,) = m2.ending.fail(5.0, long)
    assert isinstance(broadcast.message, Abort) and len(broadcast.message.reason) == 4096


def test_a_launchers_ranks_that_never_join_run_as_a_plain_script() -> None:
    m = machine(2)  # every rank local: the launcher reports their exits
    assert m.next_deadline() == 5.0  # the join timeout, while no rank connected...
    m2 = CoordinatorMachine(2, SETTINGS, now=0.0, local_ranks=frozenset({0, 1}))
    assert m2.on_tick(10.0) == []  # ...does not end a launcher's run nobody joined
    assert m2.next_deadline() == math.inf
    assert m2.on_exit_reported(1, 0, 11.0) == []
    (shutdown,) = m2.on_exit_reported(0, 0, 12.0)
    assert isinstance(shutdown, Broadcast) and isinstance(shutdown.message, Shutdown)
    assert m2.outcome.status is Status.COMPLETED
    assert "never calls flodl.worker.join" in m2.outcome.message


def test_an_early_exit_0_is_a_death_once_another_rank_joins() -> None:
    m = CoordinatorMachine(3, SETTINGS, now=0.0, local_ranks=frozenset({0, 1, 2}))
    assert m.on_exit_reported(1, 0, 0.5) == []
    join(m, 0)  # a flodl run after all: rank 1 died before joining
    (dead,) = m.timeline.of_kind(EventKind.RANK_DEAD)
    assert dead.detail["rank"] == 1 and "exited with code 0 before joining" in dead.detail["why"]
    (going_on,) = m.timeline.of_kind(EventKind.GOING_ON_WITHOUT)
    assert going_on.detail["ranks"] == [0, 2]
