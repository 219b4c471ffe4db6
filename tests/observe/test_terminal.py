"""What a run prints while it trains: the live table on a terminal, plain lines elsewhere.

Fast tests render the table from a hand-made state and drive both views in-process around a
scripted cluster (virtual time); the slow ones run ``flodl run`` for real, its output on a
pseudo-terminal or a pipe.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from rich.console import Console
from trio.testing import MockClock

from flodl.host.console import say
from flodl.observe import terminal_live
from flodl.observe.hub import open_observer
from flodl.observe.terminal import show, wants_live
from flodl.observe.terminal_lines import EventLines, prints_line
from flodl.observe.terminal_table import COLUMNS, eta_text, render
from flodl.observe.view_config import ViewConfig
from flodl.testing import RankScript, open_cluster
from tests.observe.cli_run import (
    ANSI,
    CHAOS_RANK,
    DIGITS,
    Finished,
    assert_no_rank_left,
    run_on_pipe,
    run_on_terminal,
)

# --- the table, from a hand-made state -----------------------------------------------------


def a_state(**changes: Any) -> dict[str, Any]:
    state: dict[str, Any] = {
        "status": "training",
        "policy": "cadence",
        "round": 12,
        "generation": 1,
        "epoch": 2,
        "epochs": 8,
        "progress": 0.375,
        "eta_s": 83.4,
        "samples_per_s": 2345.6,
        "last_loss": 0.1234,
        "ranks": [
            {
                "rank": 0,
                "state": "training",
                "batches": 410,
                "samples_per_s": 1500.2,
                "window_batches": 31,
                "idle_share": 0.021,
                "averaging_share": 0.083,
                "heartbeat_age_s": 0.4,
            },
            {
                "rank": 1,
                "state": "training",
                "batches": 123,
                "samples_per_s": 845.4,
                "window_batches": 9,
                "idle_share": 0.05,
                "averaging_share": 0.1,
                "heartbeat_age_s": 4.2,
            },
            {
                "rank": 2,
                "state": "dead",
                "batches": 60,
                "samples_per_s": None,
                "window_batches": None,
                "idle_share": None,
                "averaging_share": None,
                "heartbeat_age_s": 30.0,
            },
        ],
    }
    state.update(changes)
    return state


def text_of(state: dict[str, Any], events: list[str] | None = None, width: int = 110) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(render(state, events or [], width=width))
    return console.export_text()


def row_of(text: str, rank: int) -> list[str]:
    (line,) = [line for line in text.splitlines() if line.startswith(f"rank {rank} ")]
    return line.split()[2:]


def test_the_table_has_a_row_per_rank_under_its_column_headers() -> None:
    text = text_of(a_state())
    headers = [line for line in text.splitlines() if "samples/s" in line and "heartbeat" in line]
    assert len(headers) == 1 and headers[0].split() == list(COLUMNS)
    assert row_of(text, 0) == ["training", "410", "1,500", "31", "2.1%", "8.3%", "0.4s", "ago"]
    assert row_of(text, 1) == ["training", "123", "845", "9", "5.0%", "10.0%", "4.2s", "ago"]
    # A dead rank has no rate, window or heartbeat to show.
    assert row_of(text, 2) == ["dead", "60", "-", "-", "-", "-", "-"]


def test_the_header_and_progress_say_where_the_run_is() -> None:
    text = text_of(a_state())
    (header,) = [line for line in text.splitlines() if line.startswith("flodl")]
    for part in ("training", "round 12", "generation 1", "epoch 3/8", "policy cadence"):
        assert part in header
    assert " 37.5%  ETA 1:23  2,346 samples/s  loss 0.1234" in text
    assert "━" in text  # the bar


def test_the_last_events_are_shown_below_the_table() -> None:
    events = ["flodl: 9.8s rank 2 dead: process exited", "flodl: 9.9s group re-formed in 0.01 s"]
    lines = text_of(a_state(), events).splitlines()
    last_row = max(i for i, line in enumerate(lines) if line.startswith("rank "))
    assert [line.strip() for line in lines[last_row + 1 :] if line.strip()] == events


def test_an_ended_run_shows_no_rank_training() -> None:
    completed = text_of(a_state(status="completed", progress=1.0, eta_s=None))
    assert row_of(completed, 0)[0] == "done" and row_of(completed, 0)[-1] == "-"
    assert "100.0%  ETA 0:00" in completed
    stopped = text_of(a_state(status="saved"))
    assert row_of(stopped, 1)[0] == "stopped" and row_of(stopped, 2)[0] == "dead"
    assert "ETA -" in stopped


def test_a_state_before_training_renders() -> None:
    state = {"status": "joining", "round": 0, "generation": 0, "epoch": None, "epochs": None}
    state["ranks"] = [{"rank": 0, "state": "joining", "batches": 0}]
    text = text_of(state)
    assert "epoch -" in text and "ETA -" in text and "  0.0%" in text
    assert row_of(text, 0)[:2] == ["joining", "0"]


def test_ranks_that_do_not_fit_the_terminal_are_counted_by_state() -> None:
    state = a_state()
    state["ranks"] = [dict(state["ranks"][rank % 3], rank=rank) for rank in range(20)]
    console = Console(record=True, width=80, height=12, color_system=None)
    console.print(render(state, ["flodl: 9.8s rank 2 dead"], width=80, height=12))
    lines = console.export_text().splitlines()
    assert len(lines) < 12
    assert [line.split()[1] for line in lines if line.startswith("rank ")] == list("012345")
    assert "+14 more ranks: 4 dead, 10 training" in lines
    assert lines[-1] == "flodl: 9.8s rank 2 dead"


def test_eta_text() -> None:
    assert eta_text({"eta_s": 59.6}) == "1:00"
    assert eta_text({"eta_s": 3725}) == "1:02:05"
    assert eta_text({"eta_s": None}) == "-"


def test_the_table_fits_an_80_column_terminal() -> None:
    text = text_of(a_state(), width=80)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert row_of(text, 0)[-2:] == ["0.4s", "ago"]


# --- the event lines ----------------------------------------------------------------------


def saved(rank: int, t: float, ms: float, error: str | None = None) -> dict[str, Any]:
    return {"kind": "CheckpointSaved", "t": t, "rank": rank, "elapsed_ms": ms, "error": error}


def test_one_line_per_save_for_every_rank_that_saved() -> None:
    lines = EventLines()
    assert lines.take(saved(1, 9.07, 73.4), now=100.0) == []
    assert lines.take(saved(0, 9.08, 71.0), now=100.1) == []
    assert lines.due == pytest.approx(100.5)
    shutdown = {"kind": "Shutdown", "t": 9.1, "why": "all epochs done"}
    assert lines.take(shutdown, now=100.2) == [
        "flodl: 9.1s ranks 0, 1 saved in 71-73 ms",
        "flodl: 9.1s shutdown: all epochs done",
    ]
    assert lines.due is None and lines.flush() == []


def test_a_single_save_and_a_failed_one() -> None:
    lines = EventLines()
    assert lines.take(saved(0, 4.0, 12.0), now=0.0) == []
    assert lines.flush() == ["flodl: 4.0s rank 0 saved in 12 ms"]
    assert lines.take(saved(2, 5.0, 3.0, error="disk full"), now=1.0) == [
        "flodl: 5.0s rank 2 failed to save: disk full"
    ]


def test_which_events_get_a_line() -> None:
    assert prints_line({"kind": "RankDead"}) and prints_line({"kind": "GroupReformed"})
    assert prints_line({"kind": "SaveRequested"}) and prints_line({"kind": "GoingOnWithout"})
    assert prints_line({"kind": "RankJoined", "rejoin": True})
    assert not prints_line({"kind": "RankJoined", "rejoin": False})
    assert prints_line({"kind": "SyncStart", "redo": True})
    for kind in ("SyncStart", "SyncEnd", "AnchorChanged", "EpochAggregated", "Throttle"):
        assert not prints_line({"kind": kind})
    dead = {"kind": "RankDead", "t": 9.84, "rank": 2, "why": "process exited with code -9"}
    assert EventLines().take(dead, now=0.0) == [
        "flodl: 9.8s rank 2 dead: process exited with code -9"
    ]
    failed = {"kind": "JoinFailed", "t": 65.24, "rank": 2, "generation": 1}
    assert EventLines().take(failed, now=0.0) == ["flodl: 65.2s rank 2 could not join group 1"]


def test_wants_live() -> None:
    assert not wants_live(ViewConfig(live=False))
    assert not wants_live(ViewConfig(quiet=True))
    assert wants_live(ViewConfig(live=True))
    assert wants_live(ViewConfig()) == sys.stdout.isatty()  # pytest's capture: not a terminal


# --- both views in-process, around a scripted run (virtual time) --------------------------

DYING = [
    RankScript(ms_per_batch=10),
    RankScript(ms_per_batch=17),
    RankScript(ms_per_batch=30, collective_ms=50, die_in_round=3),
]


async def shown(
    tmp_path: Path, views: ViewConfig, scripts: list[RankScript], burst: int = 0
) -> None:
    """Run ``scripts`` to the end with ``views`` up; a rank-output line is printed through
    :func:`say` before the run (``burst`` more after it), and another once the views have
    gone."""
    async with open_cluster(scripts, dataset_size=2000) as cluster:
        coordinator = cluster.coordinator
        async with open_observer(coordinator, tmp_path) as observer:
            async with trio.open_nursery() as nursery:
                await nursery.start(show, observer, views)
                assert say("[rank 0] hello from rank 0")
                for number in range(burst):
                    say(f"[rank 1] line {number}")
                await coordinator.wait_finished()
                await cluster.wait_ranks_done()
                nursery.cancel_scope.cancel()
    assert say("[rank 0] after the view")


def flodl_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("flodl: ")]


async def test_plain_lines_of_a_run_with_a_death(
    autojump_clock: MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await shown(tmp_path, ViewConfig(live=False), DYING)
    out = capsys.readouterr().out
    assert ANSI.search(out) is None
    lines = flodl_lines(out)
    kinds = [
        next(w for w in (" dead:", "group re-formed", "redo", "saved in", "shutdown:") if w in line)
        for line in lines
    ]
    assert kinds == [" dead:", "group re-formed", "redo", "saved in", "shutdown:"], lines
    assert "rank 2 dead" in lines[0] and "ranks [0, 1]" in lines[1]
    assert "ranks 0, 1 saved in" in lines[3]  # the final save: one line for both
    assert out.splitlines()[0] == "[rank 0] hello from rank 0"
    assert out.splitlines()[-1] == "[rank 0] after the view"


async def test_quiet_prints_nothing(
    autojump_clock: MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await shown(tmp_path, ViewConfig(quiet=True, live=False), DYING)
    # The launcher relays no rank output under --quiet; the view adds nothing of its own.
    assert flodl_lines(capsys.readouterr().out) == []


async def test_the_live_view_prints_lines_above_the_table_and_gives_the_terminal_back(
    autojump_clock: MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await shown(tmp_path, ViewConfig(live=True), DYING)
    out = capsys.readouterr().out
    assert "\x1b[?25l" in out and out.rindex("\x1b[?25h") > out.rindex("\x1b[?25l")
    plain = ANSI.sub("", out)
    assert "heartbeat" in plain and "rank 2" in plain and "ETA" in plain
    assert "hello from rank 0" in plain and "rank 2 dead" in plain
    # The table's last frame comes after every line printed while it was up; the line printed
    # once it had gone is plain and last.
    last_frame = plain.rindex("heartbeat")
    assert plain.index("shutdown: all epochs done") < last_frame  # printed above the table
    assert "shutdown: all epochs done" in plain[last_frame:]  # and among the last events
    assert out.endswith("[rank 0] after the view\n")
    assert "dead" in plain[last_frame:] and "done" in plain[last_frame:]


async def test_a_burst_of_output_is_printed_whole_and_in_order(
    autojump_clock: MockClock, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    burst = 2 * terminal_live.LINES_PER_DRAW + 10  # over several redraws
    await shown(tmp_path, ViewConfig(live=True), DYING, burst=burst)
    plain = ANSI.sub("", capsys.readouterr().out)
    numbers = [int(line.split()[-1]) for line in plain.splitlines() if "[rank 1] line" in line]
    assert numbers == list(range(burst))


async def test_a_live_view_that_cannot_draw_goes_on_as_plain_lines(
    autojump_clock: MockClock,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault injected into the drawing: the run is not disturbed."""
    draws = 0

    def failing_render(*args: Any, **kwargs: Any) -> Any:
        nonlocal draws
        draws += 1
        if draws > 3:
            raise ValueError("cannot draw")
        return render(*args, **kwargs)

    monkeypatch.setattr(terminal_live, "render", failing_render)
    await shown(tmp_path, ViewConfig(live=True), DYING)
    out = capsys.readouterr().out
    stopped = out.index("flodl: live view stopped (ValueError('cannot draw'))")
    after = out[stopped:]
    assert ANSI.search(after) is None
    assert "rank 2 dead" in after and "shutdown: all epochs done" in after


# --- `flodl run` for real -----------------------------------------------------------------

SMALL = ("--nproc", "2", str(DIGITS), "--epochs", "2")
EVENT_LINE = re.compile(r"flodl: \d+\.\ds ")
SAVED_LINE = re.compile(r"flodl: \d+\.\ds ranks? (?P<ranks>[\d, ]+) saved in \d+(-\d+)? ms$")


def assert_summary(run: Finished) -> None:
    assert "flodl: run completed" in run.plain
    assert "test_accuracy:" in run.plain and "summary: " in run.plain
    assert_no_rank_left(run)


@pytest.mark.slow
def test_on_a_terminal_the_live_table_shows_above_the_summary(tmp_path: Path) -> None:
    run = run_on_terminal(tmp_path / "run", *SMALL)
    assert run.code == 0, run.plain
    assert_summary(run)
    plain = run.plain
    assert "\x1b[?25l" in run.output and "\x1b[?25h" in run.output  # cursor hidden, then shown
    for marker in ("samples/s", "heartbeat", "averaging", "rank 0 ", "rank 1 ", "ETA", "━"):
        assert marker in plain, marker
    assert "round " in plain and "epoch 2/2" in plain and "policy cadence" in plain
    assert "[rank 0] rank 0: test accuracy" in plain and "[rank 1] rank 1: epoch 0 started" in plain
    # The terminal is given back before the summary: nothing is drawn after it.
    summary_at = run.output.index("flodl: run completed")
    assert ANSI.search(run.output[summary_at:]) is None
    assert plain.rindex("heartbeat") < plain.index("flodl: run completed")


@pytest.mark.slow
def test_ctrl_c_under_the_live_table_saves_and_gives_the_terminal_back(tmp_path: Path) -> None:
    args = ("--nproc", "2", str(DIGITS), "--epochs", "200", "--slow", "1:3")
    run = run_on_terminal(tmp_path / "run", *args, interrupt_at=re.compile(r"round [2-9]"))
    assert run.code == 0, run.plain  # stopped on request, every bundle saved
    assert "flodl: SIGINT: every rank saves its bundle, then stops" in run.plain
    assert "flodl: run saved (saved: GRACEFUL)" in run.plain
    assert_no_rank_left(run)
    assert run.output.rindex("\x1b[?25h") > run.output.rindex("\x1b[?25l")
    summary_at = run.output.index("flodl: run saved")
    assert ANSI.search(run.output[summary_at:]) is None
    assert "stopped" in run.plain[run.plain.rindex("heartbeat") : run.plain.index("run saved")]


@pytest.mark.slow
def test_on_a_pipe_plain_lines(tmp_path: Path) -> None:
    run = run_on_pipe(tmp_path / "run", *SMALL)
    assert run.code == 0, run.output
    assert ANSI.search(run.output) is None and "heartbeat" not in run.output
    assert_summary(run)
    lines = run.output.splitlines()
    assert (
        "[rank 0] rank 0: epoch 0 started" in lines and "[rank 1] rank 1: epoch 0 started" in lines
    )
    events = [line for line in lines if EVENT_LINE.match(line)]
    assert events[-1].endswith(" shutdown: all epochs done"), events
    # The final save: one line for both ranks (two if their saves came far apart).
    saves = [SAVED_LINE.match(line) for line in events[:-1]]
    assert saves and all(saves), events
    assert sorted(r for m in saves if m for r in m["ranks"].split(", ")) == ["0", "1"]


@pytest.mark.slow
def test_quiet_prints_only_the_summary(tmp_path: Path) -> None:
    run = run_on_terminal(tmp_path / "run", "--quiet", *SMALL)
    assert run.code == 0, run.output
    assert ANSI.search(run.output) is None
    assert_summary(run)
    assert run.output.lstrip().startswith("flodl: run completed"), run.output
    assert "[rank" not in run.output and "shutdown" not in run.output


@pytest.mark.slow
def test_a_death_on_a_pipe_prints_the_death_and_the_recovery(tmp_path: Path) -> None:
    # Killed after 5 batches: early, so the others train on after it. After 20 it died at
    # 7.0 s of a run that ended at 7.1 s, and a loaded CI run ended before rank 2 reached
    # its 20th batch: nobody died, and the line below said "run completed" alone.
    chaos = (str(CHAOS_RANK), "--epochs", "2", "--fault", "2:kill-compute:5")
    run = run_on_pipe(
        tmp_path / "run", "--nproc", "3", "--backend", "gloo", "--heartbeat-timeout", "5", *chaos
    )
    assert run.code == 0, run.output  # a rank was SIGKILLed, and the run recovered and completed
    assert_summary(run)
    assert "flodl: run completed with ranks [0, 1] of 3; rank 2 killed by SIGKILL at " in run.output
    lines = [line for line in run.output.splitlines() if line.startswith("flodl: ")]
    (dead,) = [line for line in lines if " dead: " in line]
    (reformed,) = [line for line in lines if "group re-formed in " in line]
    assert "rank 2 dead: " in dead  # its exit or its closed connection, whichever came first
    assert "generation 1, ranks [0, 1]" in reformed
    assert lines.index(dead) < lines.index(reformed)
    assert "rank 2 lost (disconnected), recovered in" in run.output  # the summary
