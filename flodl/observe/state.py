"""The run as the views show it, folded from event-log records: pure, no clocks, no I/O.

:class:`RunView` takes the records of ``events.jsonl`` one by one (:meth:`RunView.apply`) and
keeps what a person watching wants at a glance: per rank its state, batches, throughput, the
batch count ElChe gave it for this window, its idle and averaging shares; the round, epoch,
progress and an ETA; and the last few events that matter, as sentences. The terminal view, the
dashboard and the metrics all read :meth:`RunView.snapshot`, whose shape is documented in
docs/observability.md ("State").
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["NOTABLE", "RankRow", "RunView", "describe", "window_loss"]

NOTABLE = frozenset(
    {
        "RankDead",
        "GroupReformed",
        "GoingOnWithout",
        "JoinFailed",
        "SaveRequested",
        "CheckpointSaved",
        "Shutdown",
        "AnchorChanged",
        "StopRequested",
        "CoordinatorPaused",
    }
)
"""Kinds of events the views print as a line of their own (also when stdout is no terminal).
A rejoin (``RankJoined`` with ``rejoin``) and a redone round (``SyncStart`` with ``redo``) are
notable too."""


def window_loss(ranks: Mapping[Any, Mapping[str, Any]]) -> float | None:
    """A window's mean training loss over every rank's batches, from a ``SyncEnd`` record's
    ``ranks``: each rank's mean ``loss`` weighted by its ``batches`` (None: none had one)."""
    weighted = [
        (float(facts["loss"]), int(facts.get("batches") or 0))
        for facts in ranks.values()
        if facts.get("loss") is not None
    ]
    batches = sum(n for _, n in weighted)
    return sum(loss * n for loss, n in weighted) / batches if batches else None


def is_notable(record: Mapping[str, Any]) -> bool:
    kind = record.get("kind")
    if kind in NOTABLE:
        return True
    return (kind == "RankJoined" and bool(record.get("rejoin"))) or (
        kind == "SyncStart" and bool(record.get("redo"))
    )


def describe(record: Mapping[str, Any]) -> str:
    """One sentence for a notable event (its time first), e.g. ``12.3s rank 2 dead (...)``."""
    kind = record.get("kind")
    at = f"{record.get('t', 0.0):.1f}s"
    if kind == "RankDead":
        why = str(record.get("why") or record.get("cause"))
        rank = f"rank {record.get('rank')}"
        return f"{at} {rank} dead: {why.removeprefix(rank + ' ')}"
    if kind == "GroupReformed":
        took = record.get("took_s")
        took_text = "" if took is None else f" in {took:.2f} s"
        return (
            f"{at} group re-formed{took_text}: generation {record.get('generation')}, "
            f"ranks {record.get('members')}"
        )
    if kind == "JoinFailed":
        return f"{at} rank {record.get('rank')} could not join group {record.get('generation')}"
    if kind == "GoingOnWithout":
        return f"{at} {record.get('why')}; going on with ranks {record.get('ranks')}"
    if kind == "SaveRequested":
        return f"{at} save requested ({record.get('reason')}): {record.get('why')}"
    if kind == "CheckpointSaved":
        error = record.get("error")
        if error:
            return f"{at} rank {record.get('rank')} failed to save: {error}"
        return f"{at} rank {record.get('rank')} saved in {record.get('elapsed_ms', 0.0):.0f} ms"
    if kind == "StopRequested":
        then = "every rank saves" if record.get("save") else "the run ends"
        return f"{at} {record.get('why')}: a last round, then {then}"
    if kind == "Shutdown":
        return f"{at} shutdown: {record.get('why')}"
    if kind == "CoordinatorPaused":
        seconds, timeout = record.get("seconds", 0.0), record.get("heartbeat_timeout", math.inf)
        gave_up = "; the ranks gave up on it" if seconds >= timeout else ""
        return f"{at} the coordinator did not run for {seconds:.1f} s (paused?){gave_up}"
    if kind == "AnchorChanged":
        return f"{at} anchor {record.get('before')} -> {record.get('after')}"
    if kind == "RankJoined":
        return f"{at} rank {record.get('rank')} rejoined"
    if kind == "SyncStart":
        redoes = record.get("redoes")
        again = "" if redoes is None else f" redoes round {redoes}"
        return f"{at} round {record.get('round')}{again} on the re-formed group"
    return f"{at} {kind}"


@attrs.define
class RankRow:
    """One rank as the views show it."""

    rank: int
    state: str = "joining"
    """joining, training, dead, left (exited on its own) or done."""
    batches: int = 0
    samples_per_s: float | None = None
    """Over the last window it ran in."""
    window_batches: int | None = None
    """Batches ElChe gave it for the window in progress."""
    idle_s: float = 0.0
    averaging_s: float = 0.0
    busy_s: float = 0.0
    """Time covered by its windows and rounds (idle and averaging shares are of this)."""
    divergence: float | None = None
    ms_per_batch: float | None = None

    def to_json(self) -> dict[str, Any]:
        covered = self.busy_s
        return {
            "rank": self.rank,
            "state": self.state,
            "batches": self.batches,
            "samples_per_s": self.samples_per_s,
            "window_batches": self.window_batches,
            "ms_per_batch": self.ms_per_batch,
            "idle_share": self.idle_s / covered if covered > 0 else None,
            "averaging_share": self.averaging_s / covered if covered > 0 else None,
            "divergence": self.divergence,
        }


class RunView:
    """The run folded from its event records (module docstring)."""

    def __init__(self, world_size: int, *, recent: int = 8) -> None:
        self.world_size = world_size
        self.ranks = {rank: RankRow(rank) for rank in range(world_size)}
        self.status = "joining"
        self.saving = False
        """A save was asked for (``SaveRequested``): the run ends short of its epochs."""
        self.t = 0.0
        """Time of the latest record (seconds since the coordinator started)."""
        self.round = 0
        self.generation = 0
        self.global_step = 0
        self.epoch: int | None = None
        self.epochs: int | None = None
        self.first_epoch = 0
        self.epoch_batches: int | None = None
        self.batch_size: int | None = None
        self.policy: str | None = None
        self.training_started: float | None = None
        self.last_loss: float | None = None
        self.window_loss: float | None = None
        """The latest window's mean training loss over every rank's batches."""
        self.epoch_results: list[dict[str, Any]] = []
        self.recent: deque[str] = deque(maxlen=recent)
        self.records = 0

    # --- folding ----------------------------------------------------------------------------

    def apply(self, record: Mapping[str, Any]) -> None:
        """Take one event-log record into account (unknown kinds are only counted)."""
        self.records += 1
        self.t = max(self.t, float(record.get("t", self.t)))
        kind = record.get("kind")
        handler = _HANDLERS.get(str(kind))
        if handler is not None:
            handler(self, record)
        if is_notable(record):
            self.recent.append(describe(record))

    def _row(self, rank: Any) -> RankRow | None:
        if not isinstance(rank, int):
            return None
        row = self.ranks.get(rank)
        if row is None:
            row = self.ranks[rank] = RankRow(rank)
        return row

    def _joined(self, record: Mapping[str, Any]) -> None:
        row = self._row(record.get("rank"))
        if row is not None:
            row.state = "training" if self.status == "training" else "joined"

    def _started(self, record: Mapping[str, Any]) -> None:
        self.status = "training"
        self.training_started = float(record.get("t", 0.0))
        self.epochs = record.get("epochs")
        self.first_epoch = int(record.get("first_epoch", 0))
        self.epoch = self.first_epoch
        self.epoch_batches = record.get("epoch_batches")
        self.batch_size = record.get("batch_size")
        self.policy = record.get("policy")
        for rank in record.get("members", []):
            row = self._row(rank)
            if row is not None:
                row.state = "training"

    def _round_end(self, record: Mapping[str, Any]) -> None:
        self.round = int(record.get("round", self.round))
        self.generation = int(record.get("generation", self.generation))
        self.global_step = int(record.get("global_step", self.global_step))
        window_s = float(record.get("window_s") or 0.0)
        round_s = float(record.get("duration_s") or 0.0)
        counts = record.get("next_counts") or {}
        ranks = record.get("ranks") or {}
        # A window that trained nothing (the first round, which also waits for the first
        # group to form) says nothing of idling or averaging between batches.
        trained = any(facts.get("batches") for facts in ranks.values())
        loss = window_loss(ranks)
        if loss is not None:
            self.window_loss = loss
        for key, facts in ranks.items():
            row = self._row(int(key))
            if row is None:
                continue
            row.batches += int(facts.get("batches") or 0)
            if facts.get("batches"):
                row.samples_per_s = facts.get("samples_per_s")
                row.ms_per_batch = facts.get("ms_per_batch")
            if trained:
                row.idle_s += float(facts.get("idle_ms") or 0.0) / 1000.0
                row.averaging_s += float(facts.get("averaging_ms") or 0.0) / 1000.0
                row.busy_s += window_s + round_s
            if facts.get("divergence") is not None:
                row.divergence = facts.get("divergence")
        for key, count in counts.items():
            row = self._row(int(key))
            if row is not None:
                row.window_batches = count

    def _dead(self, record: Mapping[str, Any]) -> None:
        row = self._row(record.get("rank"))
        if row is not None:
            row.state = "left" if record.get("cause") == "exited" else "dead"
            row.samples_per_s = None
            row.window_batches = None

    def _regrouped(self, record: Mapping[str, Any]) -> None:
        self.generation = int(record.get("generation", self.generation))
        for rank in record.get("members", []):
            row = self._row(rank)
            if row is not None:
                row.state = "training"

    def _epoch(self, record: Mapping[str, Any]) -> None:
        self.epoch_results.append(dict(record))
        epoch = record.get("epoch")
        if isinstance(epoch, int):
            self.epoch = epoch + 1
        loss = record.get("avg_loss")
        if isinstance(loss, int | float):
            self.last_loss = float(loss)

    def _save_requested(self, record: Mapping[str, Any]) -> None:
        self.saving = True

    def _shutdown(self, record: Mapping[str, Any]) -> None:
        self.status = "finished"
        if self.saving:  # stopped short with a save: the ranks are not done with their epochs
            return
        for row in self.ranks.values():
            if row.state == "training":
                row.state = "done"

    # --- reading ----------------------------------------------------------------------------

    @property
    def total_batches(self) -> int | None:
        """Batches the run trains in all (from the epoch it started at), once known."""
        if self.epochs is None or self.epoch_batches is None:
            return None
        return (self.epochs - self.first_epoch) * self.epoch_batches

    def progress(self) -> float | None:
        """Share of the run's batches done, 0..1 (None before training starts)."""
        total = self.total_batches
        if not total:
            return None
        done = sum(row.batches for row in self.ranks.values())
        # Batches a rank ran just before it died are never averaged in, so the closed epochs
        # say more once they are all closed.
        epochs = self.epochs - self.first_epoch if self.epochs is not None else 0
        closed = len(self.epoch_results) / epochs if epochs > 0 else 0.0
        return min(max(done / total, closed), 1.0)

    def eta_s(self) -> float | None:
        """Seconds left at the pace so far (None until there is a pace)."""
        progress = self.progress()
        if progress is None or progress <= 0 or self.training_started is None:
            return None
        elapsed = self.t - self.training_started
        return max(elapsed * (1.0 - progress) / progress, 0.0)

    def snapshot(
        self, *, now_t: float | None = None, heartbeat_age: Mapping[int, float] | None = None
    ) -> dict[str, Any]:
        """The state as JSON (docs/observability.md, "State"). ``now_t``: the current time
        in seconds since the coordinator started; ``heartbeat_age``: seconds since each live
        rank was last heard from."""
        ages = heartbeat_age or {}
        rows = []
        for rank in sorted(self.ranks):
            row = self.ranks[rank].to_json()
            age = ages.get(rank)
            row["heartbeat_age_s"] = None if age is None else round(age, 3)
            rows.append(row)
        live = [r for r in self.ranks.values() if r.state in ("training", "joined")]
        rates = [r.samples_per_s for r in live if r.samples_per_s is not None]
        return {
            "v": 1,
            "t": self.t if now_t is None else now_t,
            "status": self.status,
            "policy": self.policy,
            "world_size": self.world_size,
            "round": self.round,
            "generation": self.generation,
            "global_step": self.global_step,
            "epoch": self.epoch,
            "epochs": self.epochs,
            "progress": self.progress(),
            "eta_s": self.eta_s(),
            "samples_per_s": sum(rates) if rates else None,
            "last_loss": self.last_loss,
            "window_loss": self.window_loss,
            "ranks": rows,
            "recent": list(self.recent),
            "events": self.records,
        }


_HANDLERS = {
    "RankJoined": RunView._joined,
    "TrainingStarted": RunView._started,
    "SyncEnd": RunView._round_end,
    "RankDead": RunView._dead,
    "GroupReformed": RunView._regrouped,
    "EpochAggregated": RunView._epoch,
    "SaveRequested": RunView._save_requested,
    "Shutdown": RunView._shutdown,
}
