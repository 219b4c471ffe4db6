"""Death records: one small JSON file per rank that died, next to the bundle it belongs to."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

import attrs

from flodl.checkpoint.files import write_atomically
from flodl.checkpoint.names import check_stem
from flodl.errors import CheckpointError

__all__ = ["DeathRecord", "read_death_records", "write_death_record"]

_NAME = re.compile(r"\.rank(\d+)\.death\.json")


@attrs.frozen
class DeathRecord:
    """Rank ``rank`` of a ``world_size``-rank run died of ``error`` at ``unix_time_secs``."""

    rank: int
    world_size: int
    error: str
    unix_time_secs: float

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "error": self.error,
            "unix_time_secs": self.unix_time_secs,
        }

    @classmethod
    def from_json(cls, d: object, where: str = "death record") -> DeathRecord:
        """Check and rebuild a record written by :meth:`to_json`.

        Raises:
            CheckpointError: a field is missing, extra, or of the wrong type or range.
        """
        if not isinstance(d, dict) or set(d) != {"rank", "world_size", "error", "unix_time_secs"}:
            raise CheckpointError(
                f"{where} must be an object with rank, world_size, error and unix_time_secs; "
                f"got {d!r}"
            )
        rank, world_size, t = d["rank"], d["world_size"], d["unix_time_secs"]
        if type(world_size) is not int or world_size < 1:
            raise CheckpointError(
                f"{where}: world_size must be an integer >= 1, got {world_size!r}"
            )
        if type(rank) is not int or not 0 <= rank < world_size:
            raise CheckpointError(f"{where}: rank must be in [0, {world_size}), got {rank!r}")
        if not isinstance(d["error"], str):
            raise CheckpointError(f"{where}: error must be a string, got {d['error']!r}")
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            raise CheckpointError(f"{where}: unix_time_secs must be a finite number, got {t!r}")
        return cls(rank=rank, world_size=world_size, error=d["error"], unix_time_secs=float(t))


def death_record_path(directory: Path, stem: str, rank: int) -> Path:
    """``<directory>/<stem>.rank<rank>.death.json``."""
    return Path(directory) / f"{check_stem(stem)}.rank{rank}.death.json"


def write_death_record(
    directory: str | Path, stem: str, *, rank: int, world_size: int, error: str
) -> Path:
    """Record that ``rank`` died (wall-clock time now), atomically; returns the file's path.

    A second record for the same rank and stem replaces the first.

    Raises:
        CheckpointError: bad stem, or rank/world_size out of range.
    """
    record = DeathRecord.from_json(
        {"rank": rank, "world_size": world_size, "error": error, "unix_time_secs": time.time()},
        where=f"death record of rank {rank}",
    )
    path = death_record_path(Path(directory), stem, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(record.to_json(), indent=1).encode())
    return path


def read_death_records(directory: str | Path, stem: str) -> tuple[DeathRecord, ...]:
    """Every death record of bundle ``stem``, by rank.

    Raises:
        CheckpointError: a record is unreadable, malformed, or names another rank than its file.
    """
    found = []
    prefix = check_stem(stem)
    for path in Path(directory).glob(f"{prefix}.rank*.death.json"):
        match = _NAME.fullmatch(path.name[len(prefix) :])
        if match is None:
            continue
        try:
            raw = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"death record {path} is unreadable: {exc}") from exc
        record = DeathRecord.from_json(raw, where=f"death record {path}")
        if record.rank != int(match.group(1)):
            raise CheckpointError(f"death record {path} names rank {record.rank}")
        found.append(record)
    return tuple(sorted(found, key=lambda r: r.rank))
