"""Why a run did not complete: the root cause, named as a person would (``SIGKILL``, not ``-9``).

The launcher records every exit of a rank's process as it happens (:class:`ExitLog`: pid,
return code, time, and whether the launcher itself had killed it), and this module turns those
facts, the coordinator's record of which rank it lost first, and the last traceback in each
rank's log into one ``root_cause`` dict for ``summary.json`` and a "Root cause" block for the
closing text:

* a rank whose log ends with a Python traceback, or whose report (``rank<N>.json``) says it
  ended on an error, **raised** (``kind: "raised"``), even when the launcher had to kill its
  process afterwards (a rank that raised may hang in its teardown);
* a rank killed by a signal the launcher did not send was **killed** (``signal: "SIGKILL"``);
* a rank that exited non-zero with no traceback **exited** (``exit_code``);
* a rank the launcher killed at teardown, with no traceback, is never blamed
  (``killed_by_launcher: true`` in its row), nor is a rank that only stopped because the
  coordinator stopped the run (its error is ``ShutdownRequested``, or its report says it exited
  on the coordinator's shutdown).

The first failure is the one that happened first: the earliest of the rank's own exit, the
moment the coordinator declared it dead, and (for a rank that raised and was then killed) the
time its log was last written. ``flodl coordinator`` sees no processes: its root cause is the
first rank it lost, and why (:func:`coordinator_summary`).
"""

from __future__ import annotations

import datetime
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import attrs

from flodl.checkpoint.files import write_atomically
from flodl.core.coordinator.timeline import EventKind
from flodl.launch.tracebacks import read_tail, traceback_tail, tracebacks
from flodl.supervise.exits import ExitFact, ExitLog, describe_exit, signal_name

if TYPE_CHECKING:
    from flodl.coordinator.signals import StopSignals
    from flodl.core.coordinator.record import RunRecord
    from flodl.wire.messages import RankExited

__all__ = [
    "add_failure_report",
    "coordinator_summary",
    "did_its_work",
    "print_root_cause",
    "write_summary",
]

_CONSEQUENCES = ("ShutdownRequested", "CoordinatorError")
"""Errors a rank raises because of its coordinator (it stopped the run, or the rank gave up on
it: silent, gone, never there): never a root cause."""
_CONSEQUENT_EXITS = ("shutdown", "coordinator_lost")
"""How a rank's report says it ended because of the coordinator: it stopped the run, or the rank
gave up on it (its silence is the cause, not the rank)."""


def iso_time(unix: float) -> str:
    """``unix`` as UTC ISO 8601 to the millisecond, ``Z``-suffixed."""
    moment = datetime.datetime.fromtimestamp(unix, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _is_consequence(error: str | None, exit_reason: Any) -> bool:
    """The rank stopped because the run was stopped around it."""
    if error is not None and any(name in error.split(":", 1)[0] for name in _CONSEQUENCES):
        return True
    return isinstance(exit_reason, str) and exit_reason.startswith(_CONSEQUENT_EXITS)


def _death_times(record: RunRecord, unix: Any) -> dict[int, float]:
    """When the coordinator first declared each rank dead for a failure (not a clean exit)."""
    first: dict[int, float] = {}
    for event in record.timeline.of_kind(EventKind.RANK_DEAD):
        if event.detail.get("cause") == "exited":
            continue
        first.setdefault(int(event.detail["rank"]), unix(event.time))
    return first


@attrs.frozen
class _Candidate:
    order: tuple[bool, float]
    """(a consequence of the run being stopped, when it failed)"""
    cause: dict[str, Any]


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _rank_failures(
    rank: int,
    facts: Sequence[ExitFact],
    run_dir: Path,
    dead_at: float | None,
    exit_reason: Any,
) -> list[_Candidate]:
    """The failures of one rank (one per failed life). The log's last traceback is the last
    failed life's (the log goes on across restarts, and a life that ended well wrote none); the
    rank's report, ``exit_reason`` ``error: ...``, names what the last life raised when the log
    holds no traceback, as when the rank hung before Python printed it."""
    found = []
    log = run_dir / f"rank{rank}.log"
    written = _mtime(log)  # the traceback was the last thing written
    failed = [i for i, fact in enumerate(facts) if fact.returncode != 0]
    raised = tracebacks(read_tail(log))
    if not raised and isinstance(exit_reason, str) and exit_reason.startswith("error: "):
        raised = [(exit_reason.removeprefix("error: "), [])]
        written = _mtime(run_dir / f"rank{rank}.json")  # written as the error left join()
    # A life that ended well wrote no traceback: the log's last one is the last failed life's,
    # and so on back (the oldest may have been cut with the log's head).
    by_life = dict(zip(reversed(failed), reversed(raised), strict=False))
    for index, fact in enumerate(facts):
        tb = by_life.get(index)
        if fact.returncode == 0 or (fact.killed_by_launcher and tb is None):
            continue
        error, tail = tb if tb is not None else (None, [])
        if tb is not None:
            kind = "raised"
        elif fact.returncode < 0:
            kind = "killed"
        else:
            kind = "exited"
        times = [] if fact.killed_by_launcher else [fact.exited_unix]
        if dead_at is not None and index == failed[0]:  # the coordinator's first death of it
            times.append(dead_at)
        if fact.killed_by_launcher and written is not None:
            times.append(written)
        when = min(times) if times else fact.exited_unix
        cause = {
            "rank": rank,
            "pid": fact.pid,
            "kind": kind,
            **describe_exit(fact.returncode),
            "killed_by_launcher": fact.killed_by_launcher,
            "time_unix": when,
            "time": iso_time(when),
            "error": error,
            "traceback_tail": tail,
            "log": str(log),
        }
        last = index == len(facts) - 1  # the life the rank's report is of
        consequence = _is_consequence(error, exit_reason if last else None)
        found.append(_Candidate((consequence, when), cause))
    return found


def _pauses(record: RunRecord, unix: Any) -> list[_Candidate]:
    """Each time the coordinator's process did not run for as long as the ranks' heartbeat
    timeout: they gave up on it, so it comes before what they did then."""
    found = []
    for event in record.timeline.of_kind(EventKind.COORDINATOR_PAUSED):
        seconds, timeout = event.detail["seconds"], event.detail["heartbeat_timeout"]
        if seconds >= timeout:
            error = (
                f"the coordinator did not run for {seconds:.1f} s (its process was paused or "
                f"starved: SIGSTOP, a suspended machine), past the ranks' heartbeat timeout "
                f"({timeout:g} s): they gave up on it"
            )
            cause = {"rank": None, "kind": "coordinator", "error": error}
            found.append(_Candidate((False, unix(event.time - seconds)), cause))
    return found


def _fallback(summary: dict[str, Any], stops: StopSignals | None) -> dict[str, Any]:
    """A run that did not succeed with no rank to blame: a stop signal, or the coordinator."""
    received = [] if stops is None else stops.received
    if received:
        return {
            "rank": None,
            "kind": "signal",
            "signal": received[-1],
            "error": summary.get("message"),
        }
    return {"rank": None, "kind": "coordinator", "error": summary.get("message")}


def did_its_work(summary: Mapping[str, Any]) -> bool:
    """The run completed and some rank saved the trained model (its final bundle; all hold the
    same), or a stop asked for (save_reason GRACEFUL) ended it with every bundle saved."""
    status, reason = summary.get("status"), summary.get("save_reason")
    if status == "completed":
        saved = summary.get("saved") or {}
        return bool(saved.get("ranks")) or not saved.get("missing")
    return status == "saved" and reason == "GRACEFUL"


def add_failure_report(
    summary: dict[str, Any],
    logs: dict[int, ExitLog],
    record: RunRecord,
    unix: Any,
    run_dir: Path,
    stops: StopSignals | None = None,
) -> None:
    """Add ``signal``, ``killed_by_launcher`` and ``error`` (the exception line of a rank that
    failed with a traceback) to each row of ``summary["ranks"]``, and the run's
    ``root_cause`` (None when the run succeeded)."""
    deaths = _death_times(record, unix)
    candidates: list[_Candidate] = []
    for row in summary["ranks"]:
        rank = int(row["rank"])
        log = logs.get(rank, ExitLog())
        facts = log.facts
        row["signal"] = signal_name(row.get("exit_code"))
        row["killed_by_launcher"] = bool(facts) and facts[-1].killed_by_launcher
        found = _rank_failures(rank, facts, run_dir, deaths.get(rank), row.get("exit_reason"))
        last = found[-1].cause if found and found[-1].cause["pid"] == row.get("pid") else None
        row["error"] = None if last is None else last["error"]
        candidates += found
    ok = did_its_work(summary) and all(r.get("exit_code") == 0 for r in summary["ranks"])
    blamed = [c for c in candidates if not c.order[0]]  # never a rank the run stopped
    blamed += [] if ok else _pauses(record, unix)
    if blamed:  # also a failure the run recovered from (a rank restarted, or gone)
        summary["root_cause"] = min(blamed, key=lambda c: c.order).cause
    elif not ok:
        summary["root_cause"] = _fallback(summary, stops)
    else:
        summary["root_cause"] = None


def print_root_cause(summary: dict[str, Any], out: TextIO) -> None:
    """The "Root cause" block of the closing text (nothing when there is none)."""
    cause = summary.get("root_cause")
    if not cause:
        return
    print("  Root cause (first failure):", file=out)
    if cause.get("rank") is None:
        what = f"{cause['signal']} to flodl" if cause.get("kind") == "signal" else "coordinator"
        print(f"    {what}: {cause.get('error')}", file=out)
        return
    if cause.get("kind") == "lost":  # flodl coordinator: no process to see
        how = f"lost ({cause.get('cause')})"
    elif cause.get("signal"):
        how = f"signal {cause['signal']}"
    else:
        how = f"exit code {cause.get('exit_code')}"
    if cause.get("killed_by_launcher"):
        how += " (killed by flodl after it raised)"
    fields = [
        ("rank", cause["rank"]),
        ("pid", cause.get("pid")),
        ("kind", cause["kind"]),
        ("exit", how),
        ("time", cause.get("time")),
        ("error", cause.get("error")),
        ("log", cause.get("log")),
    ]
    for name, value in fields:
        if value is not None:
            print(f"    {name + ':':<7}{value}", file=out)
    if cause.get("traceback_tail"):
        print("    traceback (last lines):", file=out)
        for line in cause["traceback_tail"]:
            print(f"      {line}", file=out)


# --- flodl coordinator ----------------------------------------------------------------------


def _reported_save(reports: Mapping[int, Any], rank: int) -> dict[str, Any]:
    """What ``rank`` reported of the bundle a save asked of it (nothing when none was asked):
    ``bundle`` (its stem's path on the rank's host) and ``save_error``."""
    if rank not in reports:
        return {}
    report = reports[rank]
    if report is None:
        return {"bundle": None, "save_error": "no report (the rank left or was lost first)"}
    return {"bundle": report.path, "save_error": report.error}


def coordinator_summary(
    record: RunRecord,
    stops: StopSignals,
    clocks: tuple[float, float],
    *,
    world_size: int,
    policy: str,
    run_dir: Path,
    exits: Sequence[RankExited] = (),
) -> dict[str, Any]:
    """``flodl coordinator``'s ``summary.json``: the run as the coordinator saw it (it sees no
    other host's disk): status, the ranks it knew, who it lost first. ``exits``: what node
    agents reported of their ranks' processes; a death they explain carries the exit code or
    signal, the pid and the traceback's tail, and is named in the root cause as ``flodl run``
    names it (``raised``, ``killed``, ``exited``)."""
    clock_unix, trio_start = clocks

    def unix(t: float | None) -> float | None:
        return None if t is None else clock_unix + (t - trio_start)

    outcome = record.outcome
    message = outcome.message + (f" ({stops.received[0]})" if stops.received else "")
    ranks = []
    for rank, stats in enumerate(record.stats):
        ranks.append(
            {
                "rank": rank,
                "joined": stats.joined_at is not None,
                "joined_unix": unix(stats.joined_at),
                "batches": stats.batches,
                "syncs": stats.syncs,
                "lost_unix": unix(stats.lost_at),
                "loss_cause": stats.loss_cause,
                **_reported_save(record.stop_saves, rank),
            }
        )
    deaths = [
        {
            "rank": int(e.detail["rank"]),
            "cause": e.detail.get("cause"),
            "why": e.detail.get("why"),
            "detected_unix": unix(e.time),
        }
        for e in record.timeline.of_kind(EventKind.RANK_DEAD)
    ]
    _explain_deaths(deaths, exits)
    summary: dict[str, Any] = {
        "status": outcome.status.value,
        "save_reason": None if outcome.save_reason is None else outcome.save_reason.name,
        "message": message,
        "signals": list(stops.received),
        "stopped_at_once": stops.killed,
        "policy": policy,
        "world_size": world_size,
        "started_unix": clock_unix,
        "run_dir": str(run_dir),
        "global_step": record.global_step,
        "rounds": record.round,
        "ranks": ranks,
        "deaths": deaths,
        "lost_ranks": sorted(record.lost_ranks()),
    }
    cause = _coordinator_root_cause(summary, deaths, stops)
    paused = _pauses(record, unix)
    if cause is not None and paused:
        at = cause.get("time_unix")
        if cause["rank"] is None or at is None or paused[0].order[1] <= at:
            cause = paused[0].cause  # the ranks it lost then had given up on it
    summary["root_cause"] = cause
    return summary


def _coordinator_root_cause(
    summary: dict[str, Any], deaths: Iterable[dict[str, Any]], stops: StopSignals
) -> dict[str, Any] | None:
    if coordinator_succeeded(summary):
        return None
    for death in deaths:
        if "pid" in death:  # a node agent saw the process end
            if _is_consequence(death["error"], None):
                continue
            when = min(t for t in (death["exited_unix"], death["detected_unix"]) if t is not None)
            kind = "raised" if death["error"] else "killed" if death["signal"] else "exited"
            fields = ("rank", "pid", "exit_code", "signal", "error", "traceback_tail")
            return {
                **{name: death[name] for name in fields},
                "kind": kind,
                "time_unix": when,
                "time": iso_time(when),
            }
        if death["cause"] != "exited":
            when = death["detected_unix"]
            return {
                "rank": death["rank"],
                "kind": "lost",
                "cause": death["cause"],
                "error": death["why"],
                "time_unix": when,
                "time": None if when is None else iso_time(when),
            }
    return _fallback(summary, stops)


EXIT_MATCH_S = 30.0
"""An agent's report of an exit explains a death detected this close to it (either way)."""


def _explain_deaths(deaths: list[dict[str, Any]], exits: Sequence[RankExited]) -> None:
    """Add to each death the agent's report of the exit it came from, if there is one: the
    failed exit of that rank nearest in time (each report explains one death)."""
    used: set[int] = set()
    for death in deaths:
        detected = death["detected_unix"]
        near = [
            (abs(exit.exited_unix - detected), index)
            for index, exit in enumerate(exits)
            if index not in used
            and exit.rank == death["rank"]
            and exit.returncode != 0
            and detected is not None
            and abs(exit.exited_unix - detected) <= EXIT_MATCH_S
        ]
        if not near:
            continue
        _, index = min(near)
        used.add(index)
        exit = exits[index]
        parsed = traceback_tail(exit.tail)
        death.update(
            pid=exit.pid,
            exited_unix=exit.exited_unix,
            **describe_exit(exit.returncode),
            error=None if parsed is None else parsed[0],
            traceback_tail=[] if parsed is None else parsed[1],
        )


def coordinator_succeeded(summary: dict[str, Any]) -> bool:
    """Completed, or stopped on request (a first signal, or a rank asked to stop) with every
    rank asked to save; not after a second signal stopped it at once."""
    return did_its_work(summary) and not summary.get("stopped_at_once")


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Write ``summary`` to ``path``; a disk that refuses it (full, gone) is said on stderr,
    never raised: the closing text printed next is then all the run leaves of it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(summary, indent=2, default=str).encode())
    except OSError as err:
        print(f"flodl: {path} not written ({err})", file=sys.stderr, flush=True)
