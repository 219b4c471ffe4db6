"""What a run that ended with a save really saved: each rank's bundle, checked on disk.

The coordinator's outcome says a save was asked for; only the files say whether it happened. A
rank counts as saved when its newest complete bundle (:func:`flodl.checkpoint.find_latest`)
was written in this run (not before its rank's first start), carries the save's reason (or says
the rank saved it on losing the coordinator, as each rank does once its coordinator was silent
for the heartbeat timeout), and every file in its manifest has the size and sha256 it records.
The ranks that had to save are those in the group when the save was asked for. The summary's
status follows:

* ``saved``: every one of them saved;
* ``partially_saved``: some did (``--resume`` goes on from the newest), the others are named;
* ``not_saved``: none did.

A completed run's account is of its final bundles, the trained model, which every rank it ended
with saves at the run's last global step: the status stays ``completed``, and the message names
the ranks that did not save theirs (a full disk, say) with the error each reported; when none
did, the model is lost and the run did not do its work (:mod:`flodl.launch.exit_status`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from flodl.checkpoint import CheckpointMeta, find_latest
from flodl.checkpoint.meta import LOSS_REASON
from flodl.checkpoint.resume import checkpoints_dir
from flodl.coordinator.signals import StopSignals
from flodl.core.coordinator.ending import Status
from flodl.core.coordinator.timeline import EventKind
from flodl.errors import CheckpointError
from flodl.wire.messages import SaveReason

if TYPE_CHECKING:
    from flodl.core.coordinator.record import RunRecord
    from flodl.supervise.ranks import RankProcess

__all__ = ["SaveAccount", "account_saves", "verified_bundle"]


def verified_bundle(
    run_dir: Path, rank: int, since: float, reason: str | None, step: int | None = None
) -> Path | None:
    """Rank ``rank``'s newest complete bundle if written at or after ``since`` (unix, less a
    second of slack for file times) with ``save_reason`` ``reason`` (at global step ``step``,
    when given) and intact files."""
    stem = find_latest(checkpoints_dir(run_dir) / f"rank{rank}")
    if stem is None:
        return None
    try:
        raw = json.loads((stem.parent / f"{stem.name}.meta.json").read_bytes())
        meta = CheckpointMeta.from_json(raw)
        if meta.created_unix < since - 1 or meta.save_reason != reason:
            return None
        if step is not None and meta.global_step != step:
            return None
        for entry in raw["files"].values():
            data = (stem.parent / str(entry["file"])).read_bytes()
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, CheckpointError):
        return None
    return stem


def members_at_save(record: RunRecord) -> set[int]:
    """The ranks in the group when the (first) save was asked for (a loss that caused it is
    not in it)."""
    asked = [e.time for e in record.timeline.of_kind(EventKind.SAVE_REQUESTED)]
    if not asked:
        return set()
    at = asked[0]
    members = set()
    for rank, stats in enumerate(record.stats):
        joined, lost = stats.joined_at, stats.lost_at
        if joined is None or joined > at:
            continue
        if lost is None or lost < joined or lost > at:
            members.add(rank)
    return members


@attrs.frozen
class SaveAccount:
    """The summary's truth about a save: status, message, the bundle of each rank."""

    status: str
    message: str
    bundles: dict[int, str | None]
    missing: dict[int, str]
    """Each rank that had to save and did not, with why (as far as the launcher knows)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "ranks": sorted(r for r, b in self.bundles.items() if b is not None),
            "missing": [{"rank": r, "why": why} for r, why in sorted(self.missing.items())],
        }


def _why_not(item: RankProcess | None, stops: StopSignals) -> str:
    if item is None or item.exit_code is None:
        return "no bundle written"
    if item.exit_code < 0 and stops.killed:
        return f"killed by the launcher after a second {stops.received[-1]}"
    return f"no bundle written (exit code {item.exit_code})"


def _ranks(ranks: Sequence[int]) -> str:
    numbers = ", ".join(str(r) for r in ranks)
    return f"rank {numbers}" if len(ranks) == 1 else f"ranks {numbers}"


def account_saves(
    record: RunRecord,
    spawned: Sequence[RankProcess],
    run_dir: Path,
    stops: StopSignals,
) -> SaveAccount:
    """Check every rank's bundle on disk and say what the run's status may claim."""
    outcome = record.outcome
    status, message = outcome.status.value, outcome.message
    if stops.received:
        message = f"{message} ({stops.received[0]})"
    reason = None if outcome.save_reason is None else outcome.save_reason.name
    bundles: dict[int, str | None] = {}
    missing: dict[int, str] = {}
    if outcome.status is Status.COMPLETED:
        return _final_bundles(record, spawned, run_dir, message)
    if outcome.status is not Status.SAVED:
        return SaveAccount(status, message, {item.rank: None for item in spawned}, missing)
    by_rank = {item.rank: item for item in spawned}
    on_their_own: list[int] = []
    for item in spawned:
        path = verified_bundle(run_dir, item.rank, item.started_unix, reason)
        if path is None:  # it may have given up on a silent coordinator and saved all the same
            path = verified_bundle(run_dir, item.rank, item.started_unix, LOSS_REASON)
            on_their_own += [] if path is None else [item.rank]
        bundles[item.rank] = None if path is None else str(path)
    for rank in sorted(members_at_save(record)):
        if bundles.get(rank) is None:
            missing[rank] = _why_not(by_rank.get(rank), stops)
    saved = sorted(r for r, b in bundles.items() if b is not None)
    if not saved:
        status = "not_saved"
    elif missing:
        status = "partially_saved"
    parts = [message]
    if saved:
        parts.append(f"saved: {_ranks(saved)}")
    if on_their_own:
        parts[-1] += f" ({_ranks(on_their_own)} on losing the coordinator)"
    if missing:
        parts.append("not saved: " + ", ".join(f"rank {r} ({w})" for r, w in missing.items()))
    elif not saved:
        parts.append("no rank saved a bundle")
    return SaveAccount(status, "; ".join(parts), bundles, missing)


def _final_bundles(
    record: RunRecord, spawned: Sequence[RankProcess], run_dir: Path, message: str
) -> SaveAccount:
    """A completed run's account: the final bundle (the trained model, at the run's last global
    step) of each rank it ended with. The message names the ranks that did not save it, with
    the error each reported. A run that never trained (a script that does not join flodl) owes
    none."""
    trained = bool(record.timeline.of_kind(EventKind.TRAINING_STARTED))
    owed = set(record.members) - record.lost_ranks() if trained else set()
    errors = {
        int(e.detail["rank"]): str(e.detail["error"])
        for e in record.timeline.of_kind(EventKind.CHECKPOINT_SAVED)
        if e.detail.get("error")
    }
    bundles: dict[int, str | None] = {}
    missing: dict[int, str] = {}
    for item in spawned:
        path = verified_bundle(
            run_dir, item.rank, item.started_unix, SaveReason.CHECKPOINT.name, record.global_step
        )
        bundles[item.rank] = None if path is None else str(path)
        if path is None and item.rank in owed:
            missing[item.rank] = errors.get(item.rank, "no final bundle written")
    if missing:
        saved = sorted(r for r, b in bundles.items() if b is not None)
        kept = f"saved by {_ranks(saved)}" if saved else "saved by no rank: the model is lost"
        message = f"{message}; the final bundle {kept}; not by {_ranks(sorted(missing))}"
    return SaveAccount("completed", message, bundles, missing)
