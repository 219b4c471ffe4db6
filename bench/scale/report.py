"""The bench's results: a row per rank count, the targets, each mode's section, the JSON
document (bench/results/coordinator.json) and the printed table."""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import benchenv

from .ranks import BATCH_PERIOD_S, HEARTBEAT_PERIOD_S
from .record import WARMUP_ROUNDS, Recorder, summarize_ms
from .stamps import clock_check

RESULTS = Path(__file__).resolve().parents[1] / "results" / "coordinator.json"
"""Where the results go unless ``--output`` says otherwise (the committed figures)."""


TARGET_P99_S = 0.050
TARGET_RANKS = 4096
MIN_BATCH_RATE_SHARE = 0.9
"""The target also needs >= 90% of the nominal Batch rate: a coordinator that only keeps its
latency low by slowing every window down does not sustain the load."""


INPROCESS_LATENCY = (
    "message latency: trio time just before a simulated rank hands a message to its Channel, "
    "to the trio time the coordinator passes as `now` to CoordinatorMachine.on_message for it "
    "(matched per rank in FIFO order; includes the rank's own send queue, the memory stream, "
    "framing, HMAC and decoding, and every wait for the one shared core)."
)
SPLIT_LATENCY = (
    "message latency: CLOCK_MONOTONIC (time.perf_counter) in the generator process just before "
    "a simulated rank frames a message for its socket, carried in the message itself (Batch."
    "batch_loss, Heartbeat.step_count in us, Metrics.avg_loss, SyncAck.pre_norm), to the `now` "
    "the coordinator passes to CoordinatorMachine.on_message for it, converted to "
    "CLOCK_MONOTONIC (trio's clock is perf_counter plus a fixed offset). Includes the rank's "
    "send queue, the socket, framing, HMAC and decoding; Ready and NewGroupReady carry no "
    "stamp (they only occur during warm-up). The generator's own lag (metronome action start "
    "minus its scheduled time) is reported separately."
)
LATENCY_DEFINITION = (
    "message latency is send time to the `now` CoordinatorMachine.on_message receives (see each "
    "mode's latency_definition). timer lateness: wake time minus deadline of a probe task in the "
    "coordinator's process that sleeps in a cancel scope 50 ms ahead, as the coordinator's "
    "deadline loop does, plus the deadline loop's own wakes (on_tick time minus its cancel "
    "scope's deadline). Quantiles are nearest-rank over the measured window. The target is met "
    "when p99 of both is below 50 ms and ranks deliver >= 90% of 10 Batch/s."
)


def base_row(
    ranks: int,
    recorder: Recorder,
    cpu: float,
    wall: float,
    sent: Counter[str],
    warmup_s: float,
    rounds: int,
    anchor: int,
    load_before: float,
) -> dict[str, Any]:
    """The figures both modes report (``sent``: what the ranks sent in the window)."""
    received = sum(recorder.received.values())
    latency = summarize_ms(recorder.latency)
    timer = summarize_ms(list(recorder.timer_lateness) + list(recorder.deadline_lateness))
    batch_rate = recorder.batch_reports / wall / ranks
    p99_worst = max(latency["p99_ms"], timer["p99_ms"])
    meets = (
        received > 0
        and p99_worst < TARGET_P99_S * 1000.0
        and batch_rate >= MIN_BATCH_RATE_SHARE / BATCH_PERIOD_S
    )
    return {
        "ranks": ranks,
        "seconds": round(wall, 3),
        "warmup_s": round(warmup_s, 3),
        "nominal_messages_per_s": round(ranks * (1 / BATCH_PERIOD_S + 1 / HEARTBEAT_PERIOD_S)),
        "offered_messages_per_s": round(sum(sent.values()) / wall, 1),
        "offered_by_kind": dict(sorted(sent.items())),
        "messages": received,
        "messages_per_s": round(received / wall, 1),
        "messages_by_kind": dict(sorted(recorder.received.items())),
        "sent_to_ranks_by_kind": dict(sorted(recorder.delivered.items())),
        "batch_per_rank_s": round(batch_rate, 3),
        "latency": latency,
        "latency_p99_ms_by_kind": {
            kind: summarize_ms(values)["p99_ms"]
            for kind, values in sorted(recorder.latency_by_kind.items())
        },
        "timer_lateness": timer,
        "deadline_loop_wakes": len(recorder.deadline_lateness),
        "rounds_started": rounds,
        "anchor": anchor,
        "cpu_s": round(cpu, 3),
        "cpu_share_of_wall": round(cpu / wall, 3),
        "cpu_us_per_message": round(cpu / received * 1e6, 2) if received else None,
        "cpu_us_per_rank_s": round(cpu / wall / ranks * 1e6, 2),
        "batch_reports": recorder.batch_reports,
        "meets_target": meets,
        "load_average_1m_before": round(load_before, 2),
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }


def failed_row(ranks: int, error: BaseException) -> dict[str, Any]:
    """A count that could not be measured: no warm-up (its ranks did not all join and start
    averaging in time), with what the error said of how far it got."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return {
        "ranks": ranks,
        "verdict": "no_warmup",
        "meets_target": False,
        "error": f"{type(error).__name__}: {error}",
        "cpu_us_per_message": None,
        "load_average_1m_after": round(os.getloadavg()[0], 2),
    }


def share(part: float, whole: float) -> float:
    return round(part / whole, 3) if whole > 0 else math.nan


def max_ranks_meeting_target(rows: Sequence[dict[str, Any]]) -> int:
    """The largest rank count that met the target (0 if none did)."""
    return max((row["ranks"] for row in rows if row["meets_target"]), default=0)


def environment() -> dict[str, object]:
    return benchenv.environment(
        ("trio", "cbor2", "attrs", "flodl"),
        usable_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        clocks=clock_check(),
    )


def _at_target(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return next((r for r in rows if r["ranks"] == TARGET_RANKS), rows[-1])


def mode_section(
    mode: str, rows: Sequence[dict[str, Any]], seconds: float, seed: int, **extra: Any
) -> dict[str, Any]:
    """One mode's results, with how and when they were taken."""
    reference = _at_target(rows)
    return {
        "max_ranks_meeting_target": max_ranks_meeting_target(rows),
        "cpu_us_per_message": reference["cpu_us_per_message"],
        "cpu_us_per_message_at_ranks": reference["ranks"],
        "latency_definition": INPROCESS_LATENCY if mode == "inprocess" else SPLIT_LATENCY,
        "seconds_per_count": seconds,
        "seed": seed,
        "taken_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **extra,
        "counts": list(rows),
        "environment": environment(),
    }


def report(modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON document: headline keys from the split mode (the coordinator alone on its core)
    and the in-process mode, then each mode's section."""
    split = modes.get("split")
    inprocess = modes.get("inprocess")
    inprocess_reference = _at_target(inprocess["counts"]) if inprocess else None
    met = split is not None and split["max_ranks_meeting_target"] >= TARGET_RANKS
    return {
        "max_ranks_meeting_target": split["max_ranks_meeting_target"] if split else None,
        "cpu_us_per_message": split["cpu_us_per_message"] if split else None,
        "cpu_us_per_message_at_ranks": split["cpu_us_per_message_at_ranks"] if split else None,
        "cpu_us_per_message_is": "the coordinator process alone (split mode): "
        "time.process_time / messages its machine processed",
        "inprocess_max_ranks_meeting_target": inprocess["max_ranks_meeting_target"]
        if inprocess
        else None,
        "inprocess_cpu_us_per_message": inprocess["cpu_us_per_message"] if inprocess else None,
        "inprocess_coordinator_cpu_us_per_message": inprocess_reference[
            "coordinator_cpu_us_per_message"
        ]
        if inprocess_reference
        else None,
        "target": {
            "ranks": TARGET_RANKS,
            "p99_ms_below": TARGET_P99_S * 1000.0,
            "min_batch_per_rank_s": MIN_BATCH_RATE_SHARE / BATCH_PERIOD_S,
            "met_at_target_ranks": met,
        },
        "agents_vs_split": _agents_vs_split(split, modes.get("agents")),
        "latency_definition": LATENCY_DEFINITION,
        "load": {
            "batch_per_rank_s": 1 / BATCH_PERIOD_S,
            "heartbeat_per_rank_s": 1 / HEARTBEAT_PERIOD_S,
            "config": "CoordinatorConfig() defaults (cadence policy, anchor 10)",
            "warmup": f"until all ranks joined and round {WARMUP_ROUNDS} started",
        },
        "modes": modes,
    }


AGENT_TARGETS = {
    "p99_ms_below": TARGET_P99_S * 1000.0,
    "rank_death_decided_s_at_most": 1.0,
    "host_loss_decided_s_at_most": 1.0,
    "cpu_us_per_rank_s_over_split_at_most": 0.25,
}
"""The agents layout's targets at :data:`TARGET_RANKS` (512 agents of 8)."""


def _agents_vs_split(
    split: dict[str, Any] | None, agents: dict[str, Any] | None
) -> dict[str, Any] | None:
    """At :data:`TARGET_RANKS` ranks: the agents layout beside one connection per rank, when
    this file holds both (measured in one run when their ``taken_at`` are minutes apart)."""
    if split is None or agents is None:
        return None
    rows = [
        next((r for r in m["counts"] if r["ranks"] == TARGET_RANKS and "error" not in r), None)
        for m in (split, agents)
    ]
    direct, through = rows
    if direct is None or through is None:
        return None
    cpu_ratio = through["cpu_us_per_rank_s"] / direct["cpu_us_per_rank_s"]
    p99 = max(through["latency"]["p99_ms"], through["timer_lateness"]["p99_ms"])
    # "Decided" as the split mode's membership change: the machine's time from the death
    # detected to the regroup committed (the wall time from the kill is reported beside it).
    changed, lost = through.get("membership_change") or {}, through.get("host_loss") or {}
    death, host = changed.get("decision_s"), lost.get("decision_s")
    return {
        "ranks": TARGET_RANKS,
        "layout": through.get("layout"),
        "p99_ms": p99,
        "split_p99_ms": max(direct["latency"]["p99_ms"], direct["timer_lateness"]["p99_ms"]),
        "rank_death_decision_s": death,
        "rank_death_kill_to_commit_s": changed.get("kill_to_commit_wall_s"),
        "host_loss_decision_s": host,
        "host_loss_kill_to_commit_s": lost.get("kill_to_commit_wall_s"),
        "cpu_us_per_rank_s": through["cpu_us_per_rank_s"],
        "split_cpu_us_per_rank_s": direct["cpu_us_per_rank_s"],
        "cpu_over_split": round(cpu_ratio, 3),
        "targets": AGENT_TARGETS,
        "met": {
            "p99": p99 < AGENT_TARGETS["p99_ms_below"],
            "rank_death": death is not None and death <= 1.0,
            "host_loss": host is not None and host <= 1.0,
            "cpu": cpu_ratio <= AGENT_TARGETS["cpu_us_per_rank_s_over_split_at_most"],
        },
        "taken_at": {"split": split.get("taken_at"), "agents": agents.get("taken_at")},
    }


def print_table(mode: str, rows: Sequence[dict[str, Any]], header: bool = True) -> None:
    extra = "gen lag99 gen cpu" if mode != "inprocess" else "  coord share"
    if header:
        print(
            f"[{mode}] {'ranks':>6} {'offered':>8} {'msg/s':>8} {'B/rank/s':>8} {'p50 ms':>7}"
            f" {'p99 ms':>7} {'max ms':>8} {'timer p99':>9} {'cpu us/msg':>10} {extra} ok"
        )
    for r in rows:
        if "error" in r:
            print(f"[{mode}] {r['ranks']:>6} not measured: {r['error']}", flush=True)
            continue
        lat, timer = r["latency"], r["timer_lateness"]
        if mode != "inprocess":
            tail = f"{r['generator_lag_p99_ms']:>9.1f} {r['generator_cpu_share_of_wall']:>7.2f}"
            ok = r["verdict"]
        else:
            tail = f"{r['cpu_split_share']['coordinator']:>13.2f}"
            ok = "yes" if r["meets_target"] else "no"
        print(
            f"[{mode}] {r['ranks']:>6} {r['offered_messages_per_s']:>8.0f}"
            f" {r['messages_per_s']:>8.0f} {r['batch_per_rank_s']:>8.2f}"
            f" {lat['p50_ms']:>7.2f} {lat['p99_ms']:>7.2f} {lat['max_ms']:>8.2f}"
            f" {timer['p99_ms']:>9.2f} {r['cpu_us_per_message']:>10.1f} {tail} {ok}",
            flush=True,
        )


def previous_modes(path: Path) -> dict[str, dict[str, Any]]:
    """The mode sections of an earlier result file (kept for modes this run does not redo)."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    modes = earlier.get("modes") if isinstance(earlier, dict) else None
    return dict(modes) if isinstance(modes, dict) else {}
