"""What the soak bench watches while a run trains: its event log, its rank processes, the
coordinator's /metrics and each process's memory.

Everything here reads files and /proc the run writes anyway (``events.jsonl``, the soak ranks'
``soak/ranks/rank<R>.<pid>`` files) or the dashboard the run serves; none of it changes the run.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from quality_procs import alive
from soak_rank import read_counters, soak_dir

MEMBERSHIP_KINDS = ("RankJoined", "RankDead", "GroupReformed")


class EventLog:
    """``events.jsonl`` as it grows: :meth:`read` parses the lines written since the last call
    (a line still being written waits for the next call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def read(self) -> None:
        try:
            with self.path.open("rb") as source:
                source.seek(self._offset)
                data = source.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line.strip():
                self.events.append(json.loads(line))

    def of(self, kind: str, rank: int | None = None) -> Iterator[dict[str, Any]]:
        for event in self.events:
            if event["kind"] == kind and (rank is None or event.get("rank") == rank):
                yield event

    @property
    def last_seq(self) -> int:
        """The sequence number of the last event read (-1 before any)."""
        return int(self.events[-1]["seq"]) if self.events else -1

    def first(self, kind: str, after_seq: int, rank: int | None = None) -> dict[str, Any] | None:
        """The first ``kind`` event (of ``rank``) logged after the event numbered ``after_seq``.

        Ordered by the log's sequence numbers, never by comparing this process's clock with
        the log's ``unix``: that is the coordinator's start time plus its monotonic clock, so
        a wall-clock step or slew between them (a machine syncing its clock) would misplace
        events by as much as the step.
        """
        return next((e for e in self.of(kind, rank) if e["seq"] > after_seq), None)

    def members(self) -> set[int]:
        """The ranks joined and not declared dead since, by the log so far."""
        members: set[int] = set()
        for event in self.events:
            if event["kind"] == "RankJoined":
                members.add(int(event["rank"]))
            elif event["kind"] == "RankDead":
                members.discard(int(event["rank"]))
        return members

    def trained_since_membership_changed(self) -> bool:
        """A round settled after the last join, death or re-formation (training goes on)."""
        last_change = max(
            (e["seq"] for e in self.events if e["kind"] in MEMBERSHIP_KINDS), default=-1
        )
        return any(e["kind"] == "SyncEnd" and e["seq"] > last_change for e in self.events)


class RankProcesses:
    """The soak ranks' processes, from the files each one writes when it starts."""

    def __init__(self, run_dir: Path) -> None:
        self.folder = soak_dir(run_dir) / "ranks"

    def files(self) -> list[tuple[int, int, Path]]:
        """(rank, pid, counters file) of every process any rank ever ran, oldest first."""
        found = []
        for path in self.folder.glob("rank*.*") if self.folder.exists() else []:
            rank, _, pid = path.name.removeprefix("rank").partition(".")
            found.append((path.stat().st_mtime, int(rank), int(pid), path))
        return [(rank, pid, path) for _, rank, pid, path in sorted(found)]

    def live(self) -> dict[int, list[int]]:
        """Each rank's live processes (a zombie is not live)."""
        table: dict[int, list[int]] = {}
        for rank, pid, _ in self.files():
            if alive(pid):
                table.setdefault(rank, []).append(pid)
        return table

    def every_pid(self) -> list[int]:
        return [pid for _, pid, _ in self.files()]

    def samples_lost(self, rank: int, pid: int, batch_size: int) -> int | None:
        """Samples ``pid`` trained since its last round (what killing it now throws away)."""
        counters = read_counters(self.folder / f"rank{rank}.{pid}")
        return None if counters is None else (counters[0] - counters[1]) * batch_size


def scrape(url: str) -> dict[str, float]:
    """The coordinator's process figures from its dashboard's /metrics (blocking)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    wanted = {
        "flodl_coordinator_tasks": "tasks",
        "process_open_fds": "open_fds",
        "process_resident_memory_bytes": "rss_bytes",
        "process_cpu_seconds_total": "cpu_s",
    }
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found[wanted[sample.name]] = float(sample.value)
    return found


def rss_mb(pid: int) -> float | None:
    """``pid``'s resident memory in MB (VmRSS), or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return None
