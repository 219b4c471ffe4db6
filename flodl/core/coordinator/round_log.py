"""What each averaging round was made of, per rank: the facts the event log and the views show.

A *window* is the training between two rounds; the round that closes it averages. For every
member the log keeps, for the window: batches run, time spent computing them, when its last
report of the window arrived (from then until the round started it idled), and, for the
round: when its ack arrived (averaging time), its divergence and norms. The record is handed
out once the round settles (:meth:`RoundLog.settled`), as the ``SyncEnd`` timeline event's
detail. The record holds durations only (``window_s``, ``duration_s``, per rank ``idle_ms`` and
``averaging_ms``): the event's own time is when the round settled, so it started
``duration_s`` before, and its window ``window_s`` before that (a window opens as the round
before it starts, when its work is handed out). Pure: times are the
coordinator's clock, passed in; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from flodl.wire.messages import SyncAck

__all__ = ["RankWindowFacts", "RoundLog"]


@attrs.define
class RankWindowFacts:
    """One member's window and round (times in seconds of the coordinator's clock)."""

    batches: int = 0
    compute_ms: float = 0.0
    """Wall time of its batches (compute and data loading) as it reported them."""
    last_report: float | None = None
    """When its last batch or completion frame of the window arrived."""
    loss_sum: float = 0.0
    losses: int = 0
    """The finite batch losses of the window: their sum and count."""


class RoundLog:
    """Per-rank facts of the window in progress and of the round that closes it."""

    def __init__(self, batch_size: int = 0) -> None:
        self.batch_size = batch_size
        """Samples per batch (the job's; 0 until it is known)."""
        self._opened = 0.0
        self._facts: dict[int, RankWindowFacts] = {}
        self._round: dict[str, Any] | None = None
        """The round in flight: what was known when it started."""
        self._started = 0.0
        """When the round in flight (or its redo) started."""

    def open_window(self, now: float) -> None:
        """A window starts at ``now`` (training began, or a round settled its predecessor)."""
        self._opened = now
        self._facts = {}

    def _of(self, rank: int) -> RankWindowFacts:
        facts = self._facts.get(rank)
        if facts is None:
            facts = self._facts[rank] = RankWindowFacts()
        return facts

    def on_batch(self, rank: int, wall_ms: float, loss: float, now: float) -> None:
        self.on_batches(rank, (wall_ms,), (loss,), now)

    def on_batches(
        self, rank: int, walls_ms: Sequence[float], losses: Sequence[float], now: float
    ) -> None:
        """:meth:`on_batch` for each of ``walls_ms`` (and its loss), in order, all at ``now``."""
        facts = self._of(rank)
        facts.batches += len(walls_ms)
        compute_ms = facts.compute_ms
        for wall_ms in walls_ms:  # in order: the same float sum as one report at a time
            compute_ms += wall_ms
        facts.compute_ms = compute_ms
        finite = [loss for loss in losses if math.isfinite(loss)]
        facts.loss_sum += sum(finite)
        facts.losses += len(finite)
        facts.last_report = now

    def on_report(self, rank: int, now: float) -> None:
        """A completion frame or other end-of-work report from ``rank``."""
        self._of(rank).last_report = now

    def start(
        self,
        now: float,
        *,
        round: int,
        generation: int,
        members: Sequence[int],
        redo: bool,
        global_step: int,
        anchor: int | None = None,
        next_counts: Mapping[int, int] | None = None,
        verdict: str | None = None,
    ) -> None:
        """A round started at ``now``: the window's facts are frozen into it.

        The next window opens at once (its work is handed out as the round starts). A redone
        round keeps the window of the round it redoes (that window's training is what it
        averages) under its own round number, naming the one it redoes (``redoes``): only its
        number, start time and generation change, and the dead leave it.
        """
        self._started = now
        if redo and self._round is not None:
            redoes = self._round["round"]
            self._round.update(round=round, generation=generation, redo=True, redoes=redoes)
            for rank in list(self._round["ranks"]):
                if rank not in members:
                    del self._round["ranks"][rank]
            return
        window_s = max(now - self._opened, 0.0)
        ranks: dict[int, dict[str, Any]] = {}
        for rank in members:
            f = self._of(rank)
            idle_ms = 0.0 if f.last_report is None else max(now - f.last_report, 0.0) * 1000.0
            if f.batches == 0:
                idle_ms = window_s * 1000.0
            ms_per_batch = f.compute_ms / f.batches if f.batches else None
            # While it trains (idle time left out): what its hardware delivers.
            rate = self.batch_size * 1000.0 / ms_per_batch if ms_per_batch else None
            ranks[rank] = {
                "batches": f.batches,
                "ms_per_batch": ms_per_batch,
                "samples_per_s": rate,
                "idle_ms": idle_ms,
                "loss": f.loss_sum / f.losses if f.losses else None,
            }
        self._round = {
            "round": round,
            "generation": generation,
            "redo": redo,
            "global_step": global_step,
            "window_s": window_s,
            "anchor": anchor,
            "next_counts": None if next_counts is None else dict(next_counts),
            "verdict": verdict,
            "ranks": ranks,
        }
        self.open_window(now)

    def set_plan(
        self, anchor: int | None, next_counts: Mapping[int, int], verdict: str | None
    ) -> None:
        """ElChe's decision for the next window, made as the round started."""
        if self._round is not None:
            self._round.update(anchor=anchor, next_counts=dict(next_counts), verdict=verdict)

    def on_ack(self, ack: SyncAck, now: float) -> None:
        if self._round is None or ack.round != self._round["round"]:
            return
        row = self._round["ranks"].get(ack.rank)
        if row is None:
            return
        row.update(
            averaging_ms=max(now - self._started, 0.0) * 1000.0,
            divergence=ack.divergence,
            pre_norm=ack.pre_norm,
            post_norm=ack.post_norm,
        )

    def settled(self, now: float) -> dict[str, Any]:
        """The round in flight settled at ``now``: its whole record, JSON-ready."""
        record = self._round or {"ranks": {}}
        self._round = None
        record["duration_s"] = max(now - self._started, 0.0)
        record["ranks"] = {str(rank): row for rank, row in sorted(record["ranks"].items())}
        if record.get("next_counts") is not None:
            record["next_counts"] = {str(r): c for r, c in sorted(record["next_counts"].items())}
        return record
