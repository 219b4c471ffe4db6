"""A run's exit status, and the line that says who it lost.

A scheduler reads the exit status alone: a run that did its work exits 0 even when it lost
ranks on the way (it recovered from them: that is what flodl is for), and the summary and its
first line say who was lost and why. ``--strict`` makes any lost rank a failure (exit 1), for
those who want to hear of every death from the status.

"Did its work": the run completed (and a rank saved the trained model), or a stop asked for (a
signal, a rank's ``stop``) ended it with a save. A rank is *lost* when the run ended without it
(declared dead and not rejoined: ``lost_ranks``); the rule also needs every rank still in the
run at its end to have exited 0, since a rank that failed after the last round loses its report.
``--strict`` fails a run on any death (``deaths``), even one a restart recovered from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flodl.launch.failure_report import did_its_work, iso_time

__all__ = [
    "describe_losses",
    "lost_line",
    "run_succeeded",
    "strict_failure",
    "with_losses",
]


def strict_failure(summary: Mapping[str, Any]) -> bool:
    """Whether ``--strict`` fails a run that otherwise succeeded: it lost a rank."""
    return bool(summary.get("deaths"))


def run_succeeded(summary: Mapping[str, Any], *, strict: bool = False) -> bool:
    """``flodl run``'s verdict: the run did its work and every rank still in it at its end
    exited 0; with ``strict``, also no rank was lost on the way."""
    if not did_its_work(summary) or (strict and strict_failure(summary)):
        return False
    gone = set(summary.get("lost_ranks") or ())
    return all(r.get("exit_code") == 0 for r in summary["ranks"] if r["rank"] not in gone)


def describe_losses(summary: dict[str, Any], world_size: int) -> None:
    """Add ``lost`` to ``summary``: for each rank the run ended without (``lost_ranks``), why
    and when, from what the supervisor or an agent saw of its process (``signal``, ``error``,
    ``exit_code`` of its row or death) or else how the coordinator lost it; and
    ``ranks_at_end``, the ranks the run ended with."""
    gone = set(summary.get("lost_ranks") or ())
    rows = {r["rank"]: r for r in summary.get("ranks", ())}
    last_death = {d["rank"]: d for d in summary.get("deaths", ())}
    lost = []
    for rank in sorted(gone):
        death = last_death.get(rank, {})
        row = rows.get(rank, {})
        when = death.get("detected_unix")
        lost.append(
            {
                "rank": rank,
                "why": _why({**death, **{k: v for k, v in row.items() if v is not None}}),
                "time_unix": when,
                "time": None if when is None else iso_time(when),
            }
        )
    summary["lost"] = lost
    summary["ranks_at_end"] = [rank for rank in range(world_size) if rank not in gone]


def lost_line(summary: Mapping[str, Any], world_size: int) -> str:
    """What follows "run completed" when ranks were lost (empty otherwise): ``with ranks [0, 2]
    of 3; rank 1 killed by SIGKILL at 2026-12-05T21:50:03.120Z``."""
    lost: Sequence[Mapping[str, Any]] = summary.get("lost") or ()
    if not lost:
        return ""
    whys = "; ".join(
        f"rank {item['rank']} {item['why']}" + (f" at {item['time']}" if item.get("time") else "")
        for item in lost
    )
    return f" with ranks {summary.get('ranks_at_end')} of {world_size}; {whys}"


def with_losses(line: str, summary: Mapping[str, Any], world_size: int) -> str:
    """``line`` (``flodl: run completed ...``) with :func:`lost_line` after its status."""
    marker = f"run {summary.get('status')}"
    lost = lost_line(summary, world_size)
    return line.replace(marker, marker + lost, 1) if lost and marker in line else line


def _gave_up(error: str) -> bool:
    """``error`` (an exception line) is a rank's CoordinatorError: it gave up on its coordinator
    (silent, gone, or never there within the join timeout)."""
    return error.split(":", 1)[0].endswith("CoordinatorError")


def _why(seen: Mapping[str, Any]) -> str:
    error = str(seen.get("error"))
    if str(seen.get("exit_reason")).startswith("coordinator_lost") or _gave_up(error):
        return "gave up on its coordinator"  # and said so; its long error says only that
    if seen.get("signal"):
        return f"killed by {seen['signal']}"
    if seen.get("error"):
        return f"raised {seen['error']}"
    code = seen.get("exit_code")
    if isinstance(code, int) and code != 0:
        return f"exited with code {code}"
    cause = seen.get("cause") or seen.get("loss_cause")
    detail = seen.get("why")  # what the coordinator saw: "ChannelClosed: node 1's agent is gone"
    if cause and detail:
        return f"lost ({cause}: {detail})"
    return f"lost ({cause})" if cause else "lost"
