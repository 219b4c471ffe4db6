"""A run's exit status and the line that names the ranks it lost
(:mod:`flodl.launch.exit_status`)."""

from __future__ import annotations

import io
from typing import Any

from flodl.launch.exit_status import (
    describe_losses,
    lost_line,
    run_succeeded,
    strict_failure,
    with_losses,
)
from flodl.launch.summary import print_summary

T = 1796505086.5  # 2026-12-05T21:51:26.500Z


def summary_of(
    status: str, codes: list[int | None], lost: list[int], *, reason: str | None = None
) -> dict[str, Any]:
    return {
        "status": status,
        "save_reason": reason,
        "ranks": [{"rank": rank, "exit_code": code} for rank, code in enumerate(codes)],
        "deaths": [{"rank": rank, "cause": "exited", "detected_unix": T} for rank in lost],
        "lost_ranks": lost,
    }


def test_a_run_that_did_its_work_succeeds_whatever_ranks_it_lost() -> None:
    recovered = summary_of("completed", [0, -9, 0], lost=[1])
    assert run_succeeded(recovered)
    assert not run_succeeded(recovered, strict=True) and strict_failure(recovered)
    clean = summary_of("completed", [0, 0, 0], lost=[])
    assert run_succeeded(clean, strict=True) and not strict_failure(clean)
    # A stop asked for, with the save, did its work too; a save forced by losses did not.
    assert run_succeeded(summary_of("saved", [0, 0], lost=[], reason="GRACEFUL"))
    assert not run_succeeded(summary_of("saved", [0, -9], lost=[1], reason="SINGLE_SURVIVOR"))
    assert not run_succeeded(summary_of("failed", [0, 0], lost=[]))


def test_a_rank_still_in_the_run_that_failed_at_its_end_fails_it() -> None:
    # Rank 2 was not lost (it was there at the end) but its process exited 1: its report is gone.
    assert not run_succeeded(summary_of("completed", [0, 0, 1], lost=[]))
    # A rank that died and rejoined after a restart is no longer lost: its last exit counts.
    rejoined = summary_of("completed", [0, 0, 0], lost=[])
    rejoined["deaths"] = [{"rank": 1, "cause": "exited", "detected_unix": T}]
    assert run_succeeded(rejoined) and not run_succeeded(rejoined, strict=True)


def test_each_lost_rank_is_named_with_why_and_when() -> None:
    summary = summary_of("completed", [0, -9, 1, 0, 0], lost=[1, 2, 3])
    summary["ranks"][1]["signal"] = "SIGKILL"
    summary["ranks"][2]["error"] = "ValueError: bad batch"
    summary["deaths"][2] = {"rank": 3, "cause": "heartbeat", "detected_unix": None}
    describe_losses(summary, 5)
    assert [(item["rank"], item["why"]) for item in summary["lost"]] == [
        (1, "killed by SIGKILL"),
        (2, "raised ValueError: bad batch"),
        (3, "lost (heartbeat)"),
    ]
    assert summary["ranks_at_end"] == [0, 4]
    line = lost_line(summary, 5)
    assert line.startswith(" with ranks [0, 4] of 5; rank 1 killed by SIGKILL at 2026-12-05T")
    assert "Z; rank 2 raised ValueError: bad batch at " in line
    assert line.endswith("; rank 3 lost (heartbeat)")  # no time known
    assert with_losses("flodl: run completed (all epochs done)", summary, 5) == (
        "flodl: run completed" + line + " (all epochs done)"
    )


def test_a_rank_lost_with_its_agent_is_named_with_what_the_coordinator_saw() -> None:
    summary = summary_of("completed", [0, None], lost=[1])
    summary["deaths"][0].update(cause="disconnected", why="ChannelClosed: node 1's agent is gone")
    describe_losses(summary, 2)
    (lost,) = summary["lost"]
    assert lost["why"] == "lost (disconnected: ChannelClosed: node 1's agent is gone)"


def test_a_rank_that_gave_up_on_its_coordinator_says_so_rather_than_its_error() -> None:
    summary = summary_of("saved", [1], lost=[0], reason="SINGLE_SURVIVOR")
    summary["ranks"][0].update(
        error="flodl.errors.CoordinatorError: the coordinator has been silent for 10 s; ...",
        exit_reason="coordinator_lost: the coordinator has been silent for 10 s",
    )
    describe_losses(summary, 1)
    assert summary["lost"][0]["why"] == "gave up on its coordinator"
    # What an agent reported of such a rank on another host: its exception line only.
    summary["ranks"][0]["exit_reason"] = None
    describe_losses(summary, 1)
    assert summary["lost"][0]["why"] == "gave up on its coordinator"


def test_nothing_is_added_when_no_rank_was_lost() -> None:
    summary = summary_of("completed", [0, 0], lost=[])
    describe_losses(summary, 2)
    assert summary["lost"] == [] and summary["ranks_at_end"] == [0, 1]
    assert lost_line(summary, 2) == ""
    assert with_losses("flodl: run completed", summary, 2) == "flodl: run completed"
    exited = summary_of("completed", [0, 3], lost=[1])
    describe_losses(exited, 2)
    assert exited["lost"][0]["why"] == "exited with code 3"


def test_the_closing_text_names_the_lost_rank_and_what_each_death_cost() -> None:
    summary = summary_of("completed", [0, -9, 0, 3], lost=[1, 3])
    summary.update(message="all epochs done", nproc=4, final_metrics={}, saved=None)
    for row in summary["ranks"]:
        row.update(batches=10, syncs=2)
    summary["ranks"][1]["signal"] = "SIGKILL"
    summary["deaths"] = [
        {"rank": 1, "cause": "exited", "recovery_s": 0.25, "detected_unix": T},
        {
            "rank": 3,
            "cause": "exited",
            "before_training": True,
            "recovery_s": None,
            "group_formed_without_s": 7.5,
            "detected_unix": T,
        },
    ]
    describe_losses(summary, 4)
    out = io.StringIO()
    print_summary(summary, out)
    text = out.getvalue()
    assert "flodl: run completed with ranks [0, 2] of 4; rank 1 killed by SIGKILL at " in text
    assert "rank 3 exited with code 3 at " in text
    assert "rank 1 lost (exited), recovered in 0.250s" in text
    assert "rank 3 lost (exited), before training started; the group formed without it " in text
    assert "recovered in 7.5" not in text
