"""The failure report's parts: naming exits, reading a log's last traceback, picking the root
cause from the launcher's exit facts (no process started here)."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from flodl.coordinator.signals import StopSignals
from flodl.core.coordinator.ending import Outcome, Status
from flodl.core.coordinator.timeline import EventKind, Timeline
from flodl.launch.failure_report import (
    add_failure_report,
    coordinator_summary,
    print_root_cause,
)
from flodl.launch.tracebacks import traceback_tail, tracebacks
from flodl.supervise.exits import ExitLog, describe_exit, exit_text, signal_name
from flodl.wire.messages import RankExited, SaveReason

RAISED = """\
[flodl] rank 1 joined
Traceback (most recent call last):
  File "/tmp/train.py", line 17, in <module>
    step(i)
  File "/tmp/train.py", line 11, in step
    raise ValueError("bad batch 5")
ValueError: bad batch 5
"""


@pytest.mark.parametrize(
    ("code", "name", "text"),
    [
        *((-9, "SIGKILL", "SIGKILL"), (-15, "SIGTERM", "SIGTERM"), (-11, "SIGSEGV", "SIGSEGV")),
        *((0, None, "0"), (3, None, "3"), (None, None, "-")),
    ],
)
def test_exits_are_named_by_signal(code: int | None, name: str | None, text: str) -> None:
    assert signal_name(code) == name
    assert exit_text(code) == text


def test_describe_exit_gives_a_code_or_a_signal() -> None:
    assert describe_exit(-signal.SIGKILL) == {"exit_code": None, "signal": "SIGKILL"}
    assert describe_exit(1) == {"exit_code": 1, "signal": None}
    assert signal_name(-200) == "signal 200"  # no such signal: still not a bare number


def test_the_last_traceback_gives_its_exception_line_and_tail() -> None:
    error, tail = traceback_tail(RAISED + "more output after it\n") or ("", [])
    assert error == "ValueError: bad batch 5"
    assert tail[0] == "Traceback (most recent call last):"
    assert tail[-1] == "ValueError: bad batch 5"
    assert '    raise ValueError("bad batch 5")' in tail


def test_no_traceback_is_none() -> None:
    assert traceback_tail("starting\nall good\n") is None
    assert traceback_tail("Traceback (most recent call last):\n  File 'x'\n") is None


def test_the_tail_is_bounded_and_a_later_traceback_wins() -> None:
    frames = "".join(f'  File "f.py", line {i}, in f{i}\n    f{i + 1}()\n' for i in range(40))
    text = RAISED + "Traceback (most recent call last):\n" + frames + "RecursionError: deep\n"
    error, tail = traceback_tail(text, lines=15) or ("", [])
    assert error == "RecursionError: deep"
    assert len(tail) == 15 and tail[-1] == error


def test_a_chained_traceback_is_one_block_ending_in_the_last_exception() -> None:
    chained = (
        RAISED
        + "\nDuring handling of the above exception, another exception occurred:\n\n"
        + "Traceback (most recent call last):\n"
        + '  File "/tmp/train.py", line 20, in <module>\n'
        + "    cleanup()\n"
        + "RuntimeError: cleanup failed\n"
    )
    error, tail = traceback_tail(chained, lines=100) or ("", [])
    assert error == "RuntimeError: cleanup failed"
    assert tail[0] == "Traceback (most recent call last):" and "ValueError: bad batch 5" in tail


def test_an_exception_group_is_read_through_its_margins() -> None:
    group = (
        "  + Exception Group Traceback (most recent call last):\n"
        '  |   File "/tmp/t.py", line 3, in <module>\n'
        "  | ExceptionGroup: boom (1 sub-exception)\n"
        "  +-+---------------- 1 ----------------\n"
        "    | Traceback (most recent call last):\n"
        '    |   File "/tmp/t.py", line 2, in f\n'
        "    | KeyError: 'x'\n"
        "    +------------------------------------\n"
    )
    found = traceback_tail(group)
    assert found is not None and found[0] == "KeyError: 'x'"


def test_a_kill_the_launcher_sent_is_told_from_an_exit_that_raced_it() -> None:
    """Only a kill sent to a process still running is the launcher's: one that had died
    already (a zombie, not yet reaped) died of something else."""
    alive = subprocess.Popen([sys.executable, "-c", "input()"], stdin=subprocess.PIPE)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        os.waitid(os.P_PID, dead.pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped
        process: Any = attrs.make_class("P", {"pid": attrs.field(), "returncode": attrs.field()})
        log = ExitLog()
        log.killing(process(alive.pid, None))
        log.killing(process(dead.pid, None))
        log.killing(process(alive.pid + 10**6, 0))  # exited and reaped: not ours to claim
        assert list(log.killed) == [alive.pid]
        assert log.exited(0, alive.pid, -9, 1.0).killed_by_launcher
        assert not log.exited(0, alive.pid, 1, 2.0).killed_by_launcher  # it exited first
        assert not log.exited(0, dead.pid, -9, 3.0).killed_by_launcher  # someone else's
    finally:
        alive.kill()
        alive.communicate()
        dead.wait()


# --- picking the root cause ------------------------------------------------------------------


@attrs.define
class FakeMachine:
    """What the report reads of the coordinator's machine: its timeline."""

    timeline: Timeline = attrs.field(factory=Timeline)


def _machine() -> Any:
    return FakeMachine()


def _summary(status: str, rows: list[dict[str, Any]], reason: str | None = None) -> dict[str, Any]:
    return {"status": status, "save_reason": reason, "message": "connection closed", "ranks": rows}


def _row(rank: int, pid: int, code: int, exit_reason: str | None = None) -> dict[str, Any]:
    return {"rank": rank, "pid": pid, "exit_code": code, "exit_reason": exit_reason}


def test_a_rank_that_raised_and_was_killed_after_is_the_root_cause(tmp_path: Path) -> None:
    (tmp_path / "rank1.log").write_text(RAISED)
    (tmp_path / "rank0.log").write_text(
        "Traceback (most recent call last):\n  File 'x'\n"
        "flodl.errors.ShutdownRequested: coordinator asked to save and stop\n"
    )
    machine = _machine()
    machine.timeline.add(5.0, EventKind.RANK_DEAD, rank=1, cause="disconnected", why="closed")
    logs = {0: ExitLog(), 1: ExitLog(killed={101: 9.0})}
    logs[0].exited(0, 100, 1, 1006.0)  # rank 0 stopped because the run was stopped
    logs[1].exited(1, 101, -9, 1009.0)  # rank 1 hung after raising; the launcher killed it
    rows = [_row(0, 100, 1, "shutdown_with_save:SINGLE_SURVIVOR"), _row(1, 101, -9)]
    summary = _summary("saved", rows, "SINGLE_SURVIVOR")
    add_failure_report(summary, logs, machine, lambda t: 1000.0 + t, tmp_path)
    cause = summary["root_cause"]
    assert (cause["rank"], cause["pid"], cause["kind"]) == (1, 101, "raised")
    assert cause["error"] == "ValueError: bad batch 5"
    assert cause["signal"] == "SIGKILL" and cause["killed_by_launcher"]
    assert cause["time_unix"] <= 1005.0  # declared dead before it was killed
    assert cause["traceback_tail"][-1] == "ValueError: bad batch 5"
    assert summary["ranks"][1]["killed_by_launcher"] and summary["ranks"][1]["signal"] == "SIGKILL"
    assert not summary["ranks"][0]["killed_by_launcher"]
    out = io.StringIO()
    print_root_cause(summary, out)
    assert "Root cause" in out.getvalue() and "kind:  raised" in out.getvalue()
    assert "ValueError: bad batch 5" in out.getvalue()


def test_a_signal_not_sent_by_the_launcher_is_a_kill(tmp_path: Path) -> None:
    logs = {0: ExitLog(), 1: ExitLog()}
    logs[0].exited(0, 100, 0, 1010.0)
    logs[1].exited(1, 101, -9, 1004.0)
    summary = _summary("completed", [_row(0, 100, 0), _row(1, 101, -9)])
    add_failure_report(summary, logs, _machine(), lambda t: t, tmp_path)
    cause = summary["root_cause"]
    assert (cause["rank"], cause["kind"], cause["signal"]) == (1, "killed", "SIGKILL")
    assert cause["exit_code"] is None and not cause["killed_by_launcher"]
    assert cause["time_unix"] == 1004.0 and cause["error"] is None


def test_the_earliest_failure_is_the_root_cause(tmp_path: Path) -> None:
    logs = {0: ExitLog(), 1: ExitLog()}
    logs[0].exited(0, 100, 2, 1008.0)
    logs[1].exited(1, 101, 3, 1003.0)
    summary = _summary("failed", [_row(0, 100, 2), _row(1, 101, 3)])
    add_failure_report(summary, logs, _machine(), lambda t: t, tmp_path)
    assert summary["root_cause"]["rank"] == 1
    assert (summary["root_cause"]["kind"], summary["root_cause"]["exit_code"]) == ("exited", 3)


def test_a_completed_run_has_no_root_cause(tmp_path: Path) -> None:
    logs = {0: ExitLog()}
    logs[0].exited(0, 100, 0, 1.0)
    summary = _summary("completed", [_row(0, 100, 0)])
    add_failure_report(summary, logs, _machine(), lambda t: t, tmp_path)
    assert summary["root_cause"] is None
    out = io.StringIO()
    print_root_cause(summary, out)
    assert out.getvalue() == ""


def test_ranks_the_launcher_killed_are_never_blamed(tmp_path: Path) -> None:
    """A second Ctrl-C killed the rank: the cause is the signal, not the rank."""
    logs = {0: ExitLog(), 1: ExitLog(killed={101: 1.0})}
    logs[0].exited(0, 100, 0, 1.0)
    logs[1].exited(1, 101, -9, 2.0)
    stops: Any = attrs.make_class("S", {"received": attrs.field()})(["SIGINT", "SIGINT"])
    summary = _summary("partially_saved", [_row(0, 100, 0), _row(1, 101, -9)], "GRACEFUL")
    add_failure_report(summary, logs, _machine(), lambda t: t, tmp_path, stops)
    assert summary["root_cause"] == {
        "rank": None,
        "kind": "signal",
        "signal": "SIGINT",
        "error": "connection closed",
    }
    assert summary["ranks"][1]["killed_by_launcher"]


def test_a_rank_that_hung_before_printing_its_traceback_raised_by_its_report(
    tmp_path: Path,
) -> None:
    (tmp_path / "rank1.log").write_text("")
    (tmp_path / "rank1.json").write_text("{}")
    logs = {1: ExitLog(killed={101: 9.0})}
    logs[1].exited(1, 101, -9, 1e12)
    summary = _summary("saved", [_row(1, 101, -9, "error: ValueError: bad batch 5")], "X")
    add_failure_report(summary, logs, _machine(), lambda t: t, tmp_path)
    cause = summary["root_cause"]
    assert (cause["kind"], cause["error"], cause["traceback_tail"]) == (
        "raised",
        "ValueError: bad batch 5",
        [],
    )
    assert cause["time_unix"] == (tmp_path / "rank1.json").stat().st_mtime


# --- flodl coordinator, with node agents -----------------------------------------------------


@attrs.define
class FakeRecord:
    """What coordinator_summary reads of the coordinator's machine."""

    outcome: Outcome
    timeline: Timeline = attrs.field(factory=Timeline)
    stats: list[Any] = attrs.field(factory=list)
    stop_saves: dict[int, Any] = attrs.field(factory=dict)
    global_step: int = 0
    round: int = 0

    def lost_ranks(self) -> frozenset[int]:
        return frozenset(int(e.detail["rank"]) for e in self.timeline.of_kind(EventKind.RANK_DEAD))


def _coordinator_summary(
    record: FakeRecord, run_dir: Path, exits: Sequence[RankExited] = ()
) -> dict[str, Any]:
    """``flodl coordinator``'s summary of ``record`` for 3 ranks; unix 1000 is trio time 0."""
    return coordinator_summary(
        record,  # type: ignore[arg-type]
        StopSignals(),
        (1000.0, 0.0),
        world_size=3,
        policy="cadence",
        run_dir=run_dir,
        exits=exits,
    )


def test_a_coordinator_summary_of_a_long_run_still_has_its_first_deaths(tmp_path: Path) -> None:
    record = FakeRecord(
        Outcome(Status.COMPLETED, None, "all epochs done"), timeline=Timeline(max_events=10)
    )
    record.timeline.add(5.0, EventKind.RANK_DEAD, rank=2, cause="disconnected", why="closed")
    for step in range(1000):  # days of rounds later
        record.timeline.add(6.0 + step, EventKind.SYNC_END, round=step)
    summary = _coordinator_summary(record, tmp_path)
    assert [(d["rank"], d["detected_unix"]) for d in summary["deaths"]] == [(2, 1005.0)]
    assert summary["lost_ranks"] == [2]


def test_an_agents_report_names_the_coordinators_root_cause_as_flodl_run_would(
    tmp_path: Path,
) -> None:
    """The coordinator only saw rank 2's connection close; rank 2's agent reported that it
    raised (with its traceback), and rank 1's that it was killed later: rank 2 is the cause."""
    record = FakeRecord(Outcome(Status.SAVED, SaveReason.SINGLE_SURVIVOR, "too few ranks"))
    record.timeline.add(5.0, EventKind.RANK_DEAD, rank=2, cause="disconnected", why="closed")
    record.timeline.add(9.0, EventKind.RANK_DEAD, rank=1, cause="exited", why="exited -9")
    exits = [
        RankExited(1, 501, -9, 1009.2, False, "rank 1: epoch 3 started\n"),
        RankExited(2, 502, 1, 1004.9, False, RAISED),
        RankExited(2, 999, 1, 1200.0, False, RAISED),  # much later: explains nothing here
    ]
    summary = _coordinator_summary(record, tmp_path, exits)
    two, one = summary["deaths"]
    assert (two["pid"], two["exit_code"], two["signal"]) == (502, 1, None)
    assert two["error"] == "ValueError: bad batch 5"
    assert (one["pid"], one["exit_code"], one["signal"], one["error"]) == (
        501,
        None,
        "SIGKILL",
        None,
    )
    cause = summary["root_cause"]
    assert (cause["rank"], cause["pid"], cause["kind"]) == (2, 502, "raised")
    assert cause["time_unix"] == 1004.9  # the exit, before the coordinator noticed
    assert cause["traceback_tail"][-1] == "ValueError: bad batch 5"
    out = io.StringIO()
    print_root_cause(summary, out)
    assert "kind:  raised" in out.getvalue() and "exit code 1" in out.getvalue()


def test_without_agents_the_coordinator_names_the_first_rank_it_lost(tmp_path: Path) -> None:
    record = FakeRecord(Outcome(Status.SAVED, SaveReason.SINGLE_SURVIVOR, "too few ranks"))
    record.timeline.add(5.0, EventKind.RANK_DEAD, rank=2, cause="silent", why="no heartbeat")
    summary = _coordinator_summary(record, tmp_path)
    assert "pid" not in summary["deaths"][0]
    assert summary["root_cause"]["kind"] == "lost" and summary["root_cause"]["cause"] == "silent"


COORDINATOR_GONE = (
    "Traceback (most recent call last):\n  File 'x'\n"
    "flodl.errors.CoordinatorError: the coordinator has been silent for 10 s; giving up on it\n"
)


def test_ranks_that_gave_up_on_a_paused_coordinator_blame_the_pause(tmp_path: Path) -> None:
    """SIGSTOP to the launcher for 22 s: both ranks gave up on it (a traceback each, exit 1);
    the root cause is the coordinator's pause, not the first rank to give up."""
    machine = _machine()
    machine.timeline.add(31.8, EventKind.RANK_DEAD, rank=0, cause="silent", why="silent")
    machine.timeline.add(31.8, EventKind.COORDINATOR_PAUSED, seconds=22.0, heartbeat_timeout=10.0)
    logs = {0: ExitLog(), 1: ExitLog()}
    for rank in (0, 1):
        (tmp_path / f"rank{rank}.log").write_text(COORDINATOR_GONE)
        logs[rank].exited(rank, 100 + rank, 1, 1020.0 + rank)
    lost = "coordinator_lost: the coordinator has been silent for 10 s"
    rows = [_row(0, 100, 1, lost), _row(1, 101, 1, lost)]
    summary = _summary("saved", rows, "SINGLE_SURVIVOR")
    add_failure_report(summary, logs, machine, lambda t: 1000.0 + t, tmp_path)
    cause = summary["root_cause"]
    assert (cause["rank"], cause["kind"]) == (None, "coordinator"), cause
    assert cause["error"].startswith("the coordinator did not run for 22.0 s")
    assert "heartbeat timeout (10 s): they gave up on it" in cause["error"]


def test_a_short_pause_or_a_rank_that_gave_up_alone_is_not_blamed_on_a_pause(
    tmp_path: Path,
) -> None:
    machine = _machine()
    machine.timeline.add(9.0, EventKind.COORDINATOR_PAUSED, seconds=6.0, heartbeat_timeout=10.0)
    (tmp_path / "rank0.log").write_text(COORDINATOR_GONE)
    logs = {0: ExitLog()}
    logs[0].exited(0, 100, 1, 1030.0)
    lost = "coordinator_lost: the coordinator has been silent for 10 s"
    summary = _summary("saved", [_row(0, 100, 1, lost)], "SINGLE_SURVIVOR")
    add_failure_report(summary, logs, machine, lambda t: 1000.0 + t, tmp_path)
    # Not the pause (shorter than the timeout), and not the rank (it only gave up): the outcome.
    assert summary["root_cause"] == {
        "rank": None,
        "kind": "coordinator",
        "error": "connection closed",
    }


def test_a_coordinator_paused_past_the_timeout_is_its_own_root_cause(tmp_path: Path) -> None:
    """flodl coordinator under SIGSTOP: the ranks it then declared dead for silence had given up
    on it; the pause before those deaths is the cause."""
    record = FakeRecord(Outcome(Status.SAVED, SaveReason.ALL_RANKS_LOST, "every rank lost"))
    record.timeline.add(30.0, EventKind.RANK_DEAD, rank=2, cause="silent", why="no heartbeat")
    record.timeline.add(30.1, EventKind.COORDINATOR_PAUSED, seconds=20.0, heartbeat_timeout=10.0)
    cause = _coordinator_summary(record, tmp_path)["root_cause"]
    assert (cause["rank"], cause["kind"]) == (None, "coordinator")
    assert cause["error"].startswith("the coordinator did not run for 20.0 s")
    # A death before the pause began is still the root cause.
    early = FakeRecord(record.outcome)
    early.timeline.add(5.0, EventKind.RANK_DEAD, rank=1, cause="disconnected", why="reset")
    early.timeline.add(30.1, EventKind.COORDINATOR_PAUSED, seconds=20.0, heartbeat_timeout=10.0)
    assert _coordinator_summary(early, tmp_path)["root_cause"]["rank"] == 1


def test_a_failure_the_run_recovered_from_is_still_its_root_cause(tmp_path: Path) -> None:
    """Rank 1 raised, was restarted, and its new life ended well with the run: the run
    completed, and its root cause is the first life's error, from the log both lives wrote."""
    (tmp_path / "rank1.log").write_text(RAISED)
    machine = _machine()
    machine.timeline.add(5.0, EventKind.RANK_DEAD, rank=1, cause="disconnected", why="closed")
    logs = {0: ExitLog(), 1: ExitLog()}
    logs[1].exited(1, 101, 1, 1005.8)  # the first life raised
    logs[1].exited(1, 102, 0, 1020.0)  # the restart ended with the run
    logs[0].exited(0, 100, 0, 1020.0)
    summary = _summary("completed", [_row(0, 100, 0), _row(1, 102, 0, "completed")])
    add_failure_report(summary, logs, machine, lambda t: 1000.0 + t, tmp_path)
    cause = summary["root_cause"]
    assert (cause["rank"], cause["pid"], cause["kind"]) == (1, 101, "raised"), cause
    assert cause["error"] == "ValueError: bad batch 5"
    assert cause["time_unix"] == 1005.0  # declared dead as it closed, before it exited
    assert summary["ranks"][1]["error"] is None  # its last life did not fail


def test_each_life_that_raised_is_named_with_its_own_traceback(tmp_path: Path) -> None:
    """A rank that raised in each of its two lives (a bug a restart does not fix): the root
    cause is the first life, with the first traceback of the log the two lives wrote."""
    first_life = RAISED.replace("bad batch 5", "bad batch 30")
    (tmp_path / "rank1.log").write_text(first_life + RAISED)
    logs = {1: ExitLog()}
    logs[1].exited(1, 101, 1, 1005.0)
    logs[1].exited(1, 102, 1, 1009.0)
    summary = _summary("completed", [_row(1, 102, 1)])
    add_failure_report(summary, logs, _machine(), lambda t: t, tmp_path)
    cause = summary["root_cause"]
    assert (cause["pid"], cause["kind"], cause["error"]) == (
        101,
        "raised",
        "ValueError: bad batch 30",
    )
    assert summary["ranks"][0]["error"] == "ValueError: bad batch 5"  # its last life's
    assert [error for error, _ in tracebacks(first_life + "noise\n" + RAISED)] == [
        "ValueError: bad batch 30",
        "ValueError: bad batch 5",
    ]
