"""What a run did, in one JSON-able dict (``summary.json``), and the closing text.

:func:`build_summary` reads what the coordinator publishes
(:class:`~flodl.core.coordinator.record.RunRecord`: its timeline, per-rank stats and outcome), what
each rank reported (``rank<N>.json``), what the supervisor saw of each process and what was saved on
disk.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flodl.coordinator.signals import StopSignals
from flodl.core.coordinator.ending import Status
from flodl.core.coordinator.record import RunRecord
from flodl.core.coordinator.timeline import EventKind
from flodl.launch.config import LaunchConfig
from flodl.launch.estimate import describe, training_s, versus_ddp
from flodl.launch.exit_status import describe_losses, lost_line
from flodl.launch.failure_report import add_failure_report, print_root_cause
from flodl.launch.saves import account_saves
from flodl.observe.state import RunView
from flodl.supervise.exits import exit_text
from flodl.supervise.ranks import RankProcess

SUMMARY_NAME = "summary.json"


def build_summary(
    config: LaunchConfig,
    record: RunRecord,
    spawned: Sequence[RankProcess],
    clocks: tuple[float, float],
    stops: StopSignals | None = None,
    view: RunView | None = None,
) -> dict[str, Any]:
    """What happened, per rank and per death, in one JSON-able dict.

    ``view``: the run as the live views folded it; each rank's idle and averaging shares are
    then its (the same figures the live table showed: time waiting and averaging over the
    windows and rounds the rank trained in). Without it, or for a rank it has no figures
    for, they are the rank's own totals over its time from the first batch to its exit."""
    clock_unix, trio_start = clocks
    stops = stops or StopSignals()
    saves = account_saves(record, spawned, config.run_dir, stops)

    def unix(t: float) -> float:
        return clock_unix + (t - trio_start)

    ranks = []
    final_metrics: dict[str, Any] = {}
    lost = record.lost_ranks()
    for item in spawned:
        # A report older than this rank's first start is an earlier run's (a run resumed in
        # its own folder); the second of slack covers file times lagging the clock.
        report = _read_json(config.run_dir / f"rank{item.rank}.json", since=item.started_unix - 1)
        stats = record.stats[item.rank]
        row = {} if view is None or item.rank not in view.ranks else view.ranks[item.rank].to_json()
        idle_share = row.get("idle_share")
        averaging_share = row.get("averaging_share")
        if idle_share is None or averaging_share is None:
            idle_share = _share(report.get("idle_s"), training_s(report))
            averaging_share = _share(report.get("averaging_s"), training_s(report))
        ranks.append(
            {
                "rank": item.rank,
                "pid": item.process.pid,
                "exit_code": item.exit_code,
                "restarts": item.restarts,
                "steps": report.get("steps"),
                "batches": report.get("batches", stats.batches),
                "syncs": report.get("syncs", stats.syncs),
                "idle_s": report.get("idle_s"),
                "averaging_s": report.get("averaging_s"),
                "wall_s": report.get("wall_s"),
                "startup_s": report.get("startup_s"),
                "idle_share": idle_share,
                "averaging_share": averaging_share,
                "exit_reason": report.get("exit_reason"),
                "bundle": saves.bundles.get(item.rank),
                "final_metrics": report.get("final_metrics", {}),
            }
        )
        if report.get("syncs") and item.rank not in lost:
            # A rank that never averaged (say, restarted after the run had ended) holds an
            # untrained model, and one the run lost and never took back trained outside the
            # group since: their metrics say nothing about the run's model.
            for name, value in (report.get("final_metrics") or {}).items():
                final_metrics.setdefault(name, []).append(value)
    syncs_end = [e.time for e in record.timeline if e.kind is EventKind.SYNC_END]
    started = [e.time for e in record.timeline.of_kind(EventKind.TRAINING_STARTED)]
    deaths = []
    by_rank = {item.rank: item for item in spawned}
    for event in record.timeline.of_kind(EventKind.RANK_DEAD):
        rank = int(event.detail["rank"])
        detected = unix(event.time)
        after = [t for t in syncs_end if t >= event.time]
        recovered = unix(after[0]) if after else None
        exits = by_rank[rank].exits if rank in by_rank else []
        # The exit that caused this death: the last one seen before it was declared.
        before = [t for _, t in exits if t <= detected + 1.0]
        exited = max(before) if before else None
        origin = min(exited, detected) if exited is not None else detected
        # A rank that died before training started cost no recovery: the run began without
        # it. Its figure is the wait for the others' start-up, named as such.
        before_training = not started or event.time < started[0]
        formed = unix(started[0]) if started and before_training else None
        deaths.append(
            {
                "rank": rank,
                "cause": event.detail.get("cause"),
                "process_exit_unix": exited,
                "detected_unix": detected,
                "before_training": before_training,
                "recovered_unix": None if before_training else recovered,
                "detection_s": None if exited is None else max(detected - exited, 0.0),
                "recovery_s": None if recovered is None or before_training else recovered - origin,
                "group_formed_without_s": None if formed is None else formed - origin,
            }
        )
    outcome = record.outcome
    summary = {
        "status": saves.status,
        "save_reason": None if outcome.save_reason is None else outcome.save_reason.name,
        "message": saves.message,
        "saved": saves.to_json(),
        "signals": list(stops.received),
        "policy": config.coordinator.policy.value,
        "nproc": config.nproc,
        "started_unix": clock_unix,
        "global_step": record.global_step,
        "rounds": record.round,
        "anchor": record.anchor,
        "batch_counts": record.counts(),
        "ranks": ranks,
        "deaths": deaths,
        "lost_ranks": sorted(record.lost_ranks()),
        "epochs": record.epoch_results,
        "final_metrics": {
            name: values[0] if len(set(values)) == 1 else values
            for name, values in final_metrics.items()
        },
        "timeline_events": len(record.timeline),
        # A restarted rank reports its last life only: no estimate from part of the batches.
        "versus_ddp": versus_ddp(ranks) if not deaths else None,
    }
    logs = {item.rank: item.exit_log for item in spawned}
    add_failure_report(summary, logs, record, unix, config.run_dir, stops)
    describe_losses(summary, config.nproc)
    return summary


def _read_json(path: Path, since: float) -> dict[str, Any]:
    """The JSON object in ``path`` if it was written at or after unix time ``since``, else {}."""
    try:
        if path.stat().st_mtime < since:
            return {}
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _share(idle: Any, wall: Any) -> float | None:
    if not isinstance(idle, int | float) or not isinstance(wall, int | float) or wall <= 0:
        return None
    return float(idle) / float(wall)


def _percent(share: Any) -> str:
    return "-" if share is None else f"{100 * share:5.1f}%"


def print_summary(summary: dict[str, Any], stream: Any = None) -> None:
    """A short human-readable account of a run."""
    out = stream or sys.stdout
    status = summary["status"]
    reason = summary.get("save_reason")
    asked = "saved" if status == Status.SAVED.value else "save asked for"
    lost = lost_line(summary, summary.get("nproc", len(summary["ranks"])))
    print(f"\nflodl: run {status}" + (f" ({asked}: {reason})" if reason else "") + lost, file=out)
    print(f"  {summary['message']}", file=out)
    print(
        f"  {'rank':>4} {'batches':>8} {'syncs':>6} {'idle':>7} {'averaging':>10} {'exit':>7}",
        file=out,
    )
    for rank in summary["ranks"]:
        idle, averaging = _percent(rank.get("idle_share")), _percent(rank.get("averaging_share"))
        print(
            f"  {rank['rank']:>4} {rank['batches'] or 0:>8} {rank['syncs'] or 0:>6} "
            f"{idle:>7} {averaging:>10} {exit_text(rank['exit_code']):>7}"
            + (f" (raised {rank['error'].split(':')[0]})" if rank.get("error") else "")
            + (" (killed by flodl)" if rank.get("killed_by_launcher") else ""),
            file=out,
        )
    for death in summary["deaths"]:
        print(f"  rank {death['rank']} lost ({death['cause']}), {_recovery(death)}", file=out)
    for name, value in summary.get("final_metrics", {}).items():
        print(f"  {name}: {value}", file=out)
    if summary.get("versus_ddp"):
        print(f"  {describe(summary['versus_ddp'])}", file=out)
    saved = [rank for rank in summary["ranks"] if rank.get("bundle")]
    unsaved = (summary.get("saved") or {}).get("missing", [])
    if status == Status.COMPLETED.value and saved and not unsaved:
        # Every rank saved the same trained model: one line says where.
        print(f"  final bundle: {saved[0]['bundle']} (and every other rank's)", file=out)
        saved = []
    for rank in saved:
        print(f"  rank {rank['rank']} saved {rank['bundle']}", file=out)
    for missing in unsaved:
        print(f"  rank {missing['rank']} NOT saved: {missing['why']}", file=out)
    print_root_cause(summary, out)


def _recovery(death: dict[str, Any]) -> str:
    """What a death cost the run, as the closing text says it."""
    if death.get("before_training"):
        formed = death.get("group_formed_without_s")
        if formed is None:
            return "before training started"
        return f"before training started; the group formed without it {formed:.3f}s later"
    rec = death.get("recovery_s")
    return "recovered in " + ("-" if rec is None or math.isnan(rec) else f"{rec:.3f}s")
