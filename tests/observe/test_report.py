"""``flodl report``: the page and its plots from hand-written event logs (fast), and from a
real three-rank run in which one rank is SIGKILLed inside an averaging round (slow; its event
log is checked too)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from flodl.cli import main
from flodl.errors import ConfigError
from flodl.observe.events import read_events
from flodl.observe.report import write_report
from flodl.observe.report_plots import PLOTS
from tests.observe.sample_log import records, write_log
from tests.worker.procs import pid_alive

PLOT_FILES = [f"{plot.name}.svg" for plot in PLOTS]
EXPECTED_PLOTS = {
    "timeline",
    "samples_per_s",
    "batches",
    "shares",
    "round_time",
    "divergence",
    "loss",
}


def assert_page_links_every_plot(index: Path) -> str:
    page = index.read_text(encoding="utf-8")
    assert {plot.name for plot in PLOTS} == EXPECTED_PLOTS
    for name in PLOT_FILES:
        image = index.parent / name
        assert image.is_file() and image.stat().st_size > 1000, name
        assert image.read_text(encoding="utf-8").lstrip().startswith("<?xml")
        assert f'<img src="{name}"' in page and f'<a href="{name}"' in page
    # Stands on its own: nothing fetched from elsewhere.
    assert not re.search(r"(src|href)=\"(https?:)?//", page)
    assert "<script" not in page
    return page


# --- hand-written logs ----------------------------------------------------------------------


def test_a_missing_event_log_is_a_config_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "events.jsonl"))):
        write_report(tmp_path)
    assert not (tmp_path / "report").exists()


def test_an_empty_event_log_is_a_config_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="is empty") as raised:
        write_report(tmp_path)
    assert str(tmp_path / "events.jsonl") in str(raised.value)


def test_a_malformed_line_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "events.jsonl").write_text('{"kind": "SyncStart", "t": 1}\nnot json\n{}\n')
    with pytest.raises(ConfigError, match=r"events\.jsonl:2: not a JSON line"):
        write_report(tmp_path)


def test_a_record_missing_a_key_is_a_config_error_naming_it(tmp_path: Path) -> None:
    log = records(death=False)
    (end,) = [r for r in log if r["kind"] == "SyncEnd" and r["round"] == 2]
    del end["unix"]
    write_log(tmp_path, log)
    with pytest.raises(ConfigError, match=rf"the SyncEnd event \(seq {end['seq']}\) is not as"):
        write_report(tmp_path)


def test_flodl_report_on_a_folder_without_a_log_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert f"no event log at {tmp_path / 'events.jsonl'}" in capsys.readouterr().err


def test_without_summary_json_the_page_says_so_and_reads_the_log(tmp_path: Path) -> None:
    write_log(tmp_path, records(death=True))
    index = write_report(tmp_path)
    assert index == tmp_path / "report" / "index.html"
    page = assert_page_links_every_plot(index)
    assert "No summary.json in the run folder" in page
    assert "unknown (no summary.json)" in page
    assert "4 settled, 1 redone, 1 never settled (round 3)" in page
    assert "1: rank 2 at 2.7 s (disconnected: process exited with code -9)" in page
    assert "3.4 s to the last event" in page
    assert "2.8s round 4 redoes round 3 on the re-formed group" in page  # the events table
    timeline = (index.parent / "timeline.svg").read_text()
    for label in ("gen 1 [0,1]", "round 4", "PERIODIC", "deaths (1)", "rejoins (1)", "saved (1)"):
        assert label in timeline, label
    assert "rank 2" in timeline and "rank 0" in timeline


def test_a_run_without_deaths_with_its_summary(tmp_path: Path) -> None:
    write_log(tmp_path, records(death=False, divergence=False))
    summary = {
        "status": "completed",
        "message": "all epochs done",
        "root_cause": None,
        "wall_s": 12.25,
        "final_metrics": {"test_accuracy": 0.951234},
        "ranks": [{"rank": 0}, {"rank": 1}, {"rank": 2}],
        "deaths": [],
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = assert_page_links_every_plot(write_report(tmp_path))
    assert "No summary.json" not in page
    assert "<td>completed: all epochs done</td>" in page
    assert "<tr><th>root cause</th><td>none</td></tr>" in page
    assert "<tr><th>wall time</th><td>12.2 s</td></tr>" in page
    assert "test_accuracy 0.9512" in page
    assert "<tr><th>ranks</th><td>3 (0, 1, 2)</td></tr>" in page
    assert "<tr><th>rounds</th><td>3 settled; global step 65</td></tr>" in page
    assert "<tr><th>deaths</th><td>none</td></tr>" in page
    # No rank reported a divergence: the plot says so instead of failing.
    assert (
        "no data: no rank reported a divergence" in (tmp_path / "report/divergence.svg").read_text()
    )
    assert "no data" not in (tmp_path / "report/loss.svg").read_text()


def test_a_failed_run_shows_its_root_cause(tmp_path: Path) -> None:
    write_log(tmp_path, records(death=True))
    summary = {
        "status": "failed",
        "message": "too few ranks left",
        "root_cause": {
            "rank": 2,
            "pid": 4242,
            "kind": "raised",
            "exit_code": 1,
            "signal": None,
            "time": "2026-12-02T01:55:33.073Z",
            "error": "ValueError: bad <batch>",
            "log": "/runs/x/rank2.log",
        },
        "deaths": [{"rank": 2, "recovery_s": 0.5}],
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    page = write_report(tmp_path).read_text()
    assert '<td class="failed">failed: too few ranks left</td>' in page
    assert "rank 2 (pid 4242) raised with exit code 1 at 2026-12-02T01:55:33.073Z" in page
    assert "<code>ValueError: bad &lt;batch&gt;</code>" in page  # escaped
    assert "recovered in 0.50 s" in page


def test_a_log_with_only_the_start_still_gives_every_plot(tmp_path: Path) -> None:
    write_log(tmp_path, records(death=False)[:5])  # joined, training started, round 1 started
    page = assert_page_links_every_plot(write_report(tmp_path))
    assert "0 settled" in page and "1 never settled (round 1)" in page
    for name in ("samples_per_s", "batches", "shares", "round_time", "divergence", "loss"):
        assert "no data" in (tmp_path / "report" / f"{name}.svg").read_text(), name


# --- a real run with a death ----------------------------------------------------------------

CHAOS_RANK = Path(__file__).parents[1] / "e2e" / "chaos_rank.py"
FLODL = [sys.executable, "-m", "flodl.cli"]
VICTIM = 2


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a session of its own; whatever is left of it is SIGKILLed after."""
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = process.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    return subprocess.CompletedProcess(argv, process.returncode, out, None)


def _rank_pids(run_dir: Path) -> set[int]:
    """Every rank process the run started (chaos_rank.py notes each one as it starts)."""
    folder = run_dir / "chaos" / "pids"
    return {int(p.name.split(".")[1]) for p in folder.iterdir()} if folder.is_dir() else set()


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 3-rank digits run whose rank 2 SIGKILLs itself 0.3 s into its third averaging round
    (the peers are inside the all-reduce), then ``flodl report`` on it. Once per module."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    argv = [*FLODL, "run", "--nproc", "3", "--run-dir", str(run_dir), "--no-live"]
    argv += ["--heartbeat-timeout", "5", str(CHAOS_RANK), "--epochs", "4"]
    argv += ["--fault", f"{VICTIM}:kill-collective:3"]
    try:
        ran = _run(argv, timeout=90)
        summary = json.loads((run_dir / "summary.json").read_text())
        # Every epoch done by the survivors: the run recovered, so it exits 0 and says whom it
        # lost.
        assert (ran.returncode, summary["status"]) == (0, "completed"), ran.stdout
        assert summary["lost_ranks"] == [VICTIM], summary["lost"]
        pids = {int(r["pid"]) for r in summary["ranks"]} | _rank_pids(run_dir)
        assert len(pids) == 3 and not [pid for pid in pids if pid_alive(pid)]
    finally:
        for pid in _rank_pids(run_dir):  # a failed run's ranks live in sessions of their own
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    report = _run([*FLODL, "report", str(run_dir), "--tensorboard", str(run_dir / "tb")], 60)
    assert report.returncode == 0, report.stdout
    (run_dir / "report.out").write_text(report.stdout)
    yield run_dir


@pytest.mark.xdist_group("killed_run")  # one worker runs the shared run once
@pytest.mark.slow
def test_the_report_of_a_run_with_a_death(killed_run: Path) -> None:
    index = killed_run / "report" / "index.html"
    assert f"report: {index}" in (killed_run / "report.out").read_text()
    page = assert_page_links_every_plot(index)
    assert "<td>completed: all epochs done</td>" in page
    assert f"rank {VICTIM} (pid" in page and "killed by SIGKILL" in page  # root cause
    assert re.search(rf"1: rank {VICTIM} at [\d.]+ s \(disconnected: [^)]*\), recovered in", page)
    assert "1 redone" in page
    timeline = (index.parent / "timeline.svg").read_text()
    assert "deaths (1)" in timeline and f"rank {VICTIM}" in timeline
    assert "gen 1 [0,1]" in timeline and "regroups (1)" in timeline


@pytest.mark.xdist_group("killed_run")  # one worker runs the shared run once
@pytest.mark.slow
def test_the_event_log_of_a_run_with_a_death(killed_run: Path) -> None:
    log = read_events(killed_run / "events.jsonl")
    assert [r["seq"] for r in log] == list(range(len(log)))  # nothing dropped
    times = [r["t"] for r in log]
    assert times == sorted(times)
    kinds = [r["kind"] for r in log]
    assert "EventsDropped" not in kinds

    (dead,) = [r for r in log if r["kind"] == "RankDead"]
    assert dead["rank"] == VICTIM and dead["cause"] == "disconnected"
    (started,) = [r for r in log if r["kind"] == "TrainingStarted"]
    (reformed,) = [r for r in log if r["kind"] == "GroupReformed"]
    assert reformed["seq"] > dead["seq"]
    assert reformed["generation"] == started["generation"] + 1
    assert reformed["members"] == [0, 1] and reformed["took_s"] >= 0
    members = {started["generation"]: started["members"], reformed["generation"]: [0, 1]}

    # Every round started has a number of its own, 1..R; the one the death hit never settles
    # (the group that ran it is gone) and is redone, under the next number, on the new group.
    starts = [r for r in log if r["kind"] == "SyncStart"]
    ends = [r for r in log if r["kind"] == "SyncEnd"]
    assert [r["round"] for r in starts] == list(range(1, len(starts) + 1))
    hit = max(r["round"] for r in starts if r["seq"] < dead["seq"])
    assert [r["round"] for r in ends] == [n for n in range(1, len(starts) + 1) if n != hit]
    (redo,) = [r for r in starts if r.get("redo")]
    assert redo["round"] == hit + 1 and redo["seq"] > reformed["seq"]
    summary = json.loads((killed_run / "summary.json").read_text())
    assert summary["rounds"] == len(starts)

    start_of = {r["round"]: r for r in starts}
    previous_end = 0.0
    for end in ends:
        assert end["redo"] is (end["round"] == redo["round"])
        assert end["generation"] == (0 if end["round"] < hit else reformed["generation"])
        assert sorted(int(rank) for rank in end["ranks"]) == members[end["generation"]]
        for row in end["ranks"].values():
            assert row["averaging_ms"] >= 0 and row["idle_ms"] >= 0 and row["batches"] >= 0
        began = end["t"] - end["duration_s"]
        assert began == pytest.approx(start_of[end["round"]]["t"], abs=1e-5)
        assert began >= previous_end - 1e-5
        previous_end = end["t"]
    # The run went on without the dead rank and finished every epoch.
    epochs = [r["epoch"] for r in log if r["kind"] == "EpochAggregated"]
    assert epochs == list(range(started["epochs"]))
    assert ends[-1]["global_step"] == summary["global_step"]


@pytest.mark.xdist_group("killed_run")  # one worker runs the shared run once
@pytest.mark.slow
def test_the_tensorboard_export_of_a_run_with_a_death(killed_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    match = re.search(r"tensorboard: (\d+) scalars in", (killed_run / "report.out").read_text())
    assert match is not None
    accumulator = EventAccumulator(str(killed_run / "tb"))
    accumulator.Reload()
    tags: list[str] = accumulator.Tags()["scalars"]
    assert sum(len(accumulator.Scalars(tag)) for tag in tags) == int(match.group(1))
    ends = [r for r in read_events(killed_run / "events.jsonl") if r["kind"] == "SyncEnd"]
    durations = accumulator.Scalars("round/duration_ms")
    assert [e.step for e in durations] == [r["round"] for r in ends]
    assert [e.wall_time for e in durations] == pytest.approx([r["unix"] for r in ends])
    last_of_victim = max(e.step for e in accumulator.Scalars(f"batches/rank{VICTIM}"))
    assert last_of_victim < max(e.step for e in accumulator.Scalars("batches/rank0"))


def test_each_rounds_training_loss_is_the_batch_weighted_mean_over_its_ranks(
    tmp_path: Path,
) -> None:
    from flodl.observe.history import load_history

    write_log(tmp_path, records(death=False))
    rounds = load_history(tmp_path).rounds
    assert rounds[0].loss is None  # the first round trains nothing
    # Round 2: ranks ran 10, 20 and 5 batches at mean losses 3/11, 3/21 and 3/6.
    expected = (10 * 3 / 11 + 20 * 3 / 21 + 5 * 3 / 6) / 35
    assert rounds[1].loss == pytest.approx(expected)
