"""A finished (or interrupted) run read back from ``run_dir/events.jsonl``, for the report and
the TensorBoard export: its settled rounds, its epochs and the moments worth marking on a
timeline. Pure reading: no plotting, nothing written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from flodl.errors import ConfigError
from flodl.observe.events import EVENTS_NAME, read_events
from flodl.observe.state import window_loss

__all__ = ["Mark", "RoundRow", "RunHistory", "load_history", "load_summary"]

SUMMARY_NAME = "summary.json"


@attrs.frozen
class RoundRow:
    """One settled averaging round (a ``SyncEnd`` record); times in seconds since the
    coordinator started."""

    round: int
    generation: int
    redo: bool
    global_step: int
    end: float
    """When it settled (the record's ``t``)."""
    unix: float
    duration_s: float
    window_s: float
    ranks: Mapping[int, Mapping[str, Any]]
    """Per member: batches, ms_per_batch, samples_per_s, idle_ms, averaging_ms, divergence..."""

    @property
    def start(self) -> float:
        """When the round (its SyncNow) started."""
        return self.end - self.duration_s

    def value(self, rank: int, key: str) -> float | None:
        """``ranks[rank][key]`` as a float, None where the rank or the value is missing."""
        raw = self.ranks.get(rank, {}).get(key)
        return None if raw is None else float(raw)

    @property
    def loss(self) -> float | None:
        """The window's mean training loss over every rank's batches (None: none reported
        one), as :func:`~flodl.observe.state.window_loss` gives it."""
        return window_loss(self.ranks)


@attrs.frozen
class Mark:
    """A moment on the timeline strip: ``row`` names what it is, ``label`` which."""

    t: float
    row: str
    label: str


ROWS = ("deaths", "regroups", "rejoins", "redo rounds", "save asked", "saved")
"""The timeline strip's rows, top to bottom (settled rounds are drawn above them)."""


@attrs.frozen
class RunHistory:
    """What the report and the TensorBoard export read from one event log."""

    path: Path
    records: list[dict[str, Any]]
    rounds: list[RoundRow]
    epochs: list[tuple[int, float, float, float]]
    """(epoch, avg_loss, t, unix) per ``EpochAggregated`` record with a loss."""
    marks: list[Mark]
    ranks: list[int]
    """Every rank a round record names, ascending."""
    dropped: int
    """Events the run could not write (an ``EventsDropped`` tail), 0 when none."""
    unsettled: list[int]
    """Rounds started (``SyncStart``) that never settled: abandoned when a member died in
    them (the redo takes the next number), or in flight when the run ended."""

    @property
    def end(self) -> float:
        """The last event's time (seconds since the coordinator started)."""
        return max((float(r["t"]) for r in self.records if "t" in r), default=0.0)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == kind]


def load_history(run_dir: Path) -> RunHistory:
    """Read ``run_dir/events.jsonl``. Raises ConfigError naming the path when the file is
    missing, empty or not an event log (a line that is not JSON, a record missing a key the
    report needs)."""
    path = run_dir / EVENTS_NAME
    if not path.is_file():
        raise ConfigError(f"no event log at {path} (is {run_dir} a flodl run folder?)")
    try:
        records = read_events(path)
    except (ValueError, OSError) as err:
        raise ConfigError(f"cannot read the event log {path}: {err}") from None
    records = [r for r in records if "kind" in r]
    if not records:
        raise ConfigError(f"the event log {path} is empty: the run recorded no events")
    rounds: list[RoundRow] = []
    epochs: list[tuple[int, float, float, float]] = []
    marks: list[Mark] = []
    started: list[int] = []
    dropped = 0
    for record in records:
        kind = record["kind"]
        try:
            if kind == "SyncEnd" and "round" in record:
                rounds.append(_round(record))
            elif kind == "SyncStart" and "round" in record:
                started.append(int(record["round"]))
            elif kind == "EpochAggregated" and record.get("avg_loss") is not None:
                t, unix = float(record["t"]), float(record["unix"])
                epochs.append((int(record["epoch"]), float(record["avg_loss"]), t, unix))
            elif kind == "EventsDropped":
                dropped += int(record.get("count", 0))
            if (mark := _mark(record)) is not None:
                marks.append(mark)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            where = f"seq {record.get('seq')}"
            raise ConfigError(
                f"{path}: the {kind} event ({where}) is not as flodl writes it: "
                f"{type(err).__name__}: {err}"
            ) from None
    ranks = sorted({rank for row in rounds for rank in row.ranks})
    settled = {row.round for row in rounds}
    unsettled = [n for n in started if n not in settled]
    return RunHistory(path, records, rounds, epochs, marks, ranks, dropped, unsettled)


def _round(record: Mapping[str, Any]) -> RoundRow:
    return RoundRow(
        round=int(record["round"]),
        generation=int(record.get("generation") or 0),
        redo=bool(record.get("redo")),
        global_step=int(record.get("global_step") or 0),
        end=float(record["t"]),
        unix=float(record["unix"]),
        duration_s=float(record.get("duration_s") or 0.0),
        window_s=float(record.get("window_s") or 0.0),
        ranks={int(rank): row for rank, row in (record.get("ranks") or {}).items()},
    )


def _mark(record: Mapping[str, Any]) -> Mark | None:
    kind, t = record["kind"], float(record.get("t", 0.0))
    if kind == "RankDead":
        return Mark(t, "deaths", f"rank {record.get('rank')}")
    if kind == "GroupReformed":
        members = ",".join(str(m) for m in record.get("members") or [])
        return Mark(t, "regroups", f"gen {record.get('generation')} [{members}]")
    if kind == "RankJoined" and record.get("rejoin"):
        return Mark(t, "rejoins", f"rank {record.get('rank')}")
    if kind == "SyncStart" and record.get("redo"):
        return Mark(t, "redo rounds", f"round {record.get('round')}")
    if kind == "SaveRequested":
        return Mark(t, "save asked", str(record.get("reason")))
    if kind == "CheckpointSaved":
        failed = " failed" if record.get("error") else ""
        return Mark(t, "saved", f"rank {record.get('rank')}{failed}")
    return None


def load_summary(run_dir: Path) -> dict[str, Any] | None:
    """``run_dir/summary.json``, or None when it is missing or unreadable (a run still going,
    or one whose launcher was killed)."""
    try:
        data = json.loads((run_dir / SUMMARY_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
