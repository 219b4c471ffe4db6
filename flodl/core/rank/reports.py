"""What a rank tells the coordinator, and in which frames.

Part of the rank machine (:mod:`flodl.core.rank.machine`), pure like it. The machine decides
*what* happened and counts it (``step_count``: batches plus averages finished); this class
turns it into messages and keeps the order they go out in:

* one ``Batch`` per finished batch, or, built with ``coalesce=True``, the reports held and sent
  together as one ``Batches`` frame: before anything else the rank sends (so the coordinator
  sees every report in order, and a chunk's reports before its ``Metrics``), in place of the
  next heartbeat, or once :data:`MAX_COALESCED` are held;
* a coalescing rank also skips a heartbeat when it sent another frame since the last one (any
  frame is a sign of life to the coordinator), so it sends a frame at least every two
  heartbeat intervals;
* ``SyncAck`` after each average, with the round's figures (:class:`RoundFigures`);
  ``CheckpointResult`` after each save; ``Note`` then ``Exiting`` when the run ends for this
  rank.
"""

from __future__ import annotations

import math
from typing import Protocol

import attrs

from flodl.core.rank.effects import RankEffect, Send
from flodl.wire.messages import (
    Batch,
    Batches,
    CheckpointResult,
    Exiting,
    Heartbeat,
    Message,
    Note,
    SyncAck,
    SyncNow,
)

__all__ = ["MAX_COALESCED", "MeasuredRound", "RankReports", "RoundFigures"]

MAX_COALESCED = 1024
"""A coalescing rank sends its held reports once it holds this many (a frame's size bound)."""


class RoundFigures(Protocol):
    """What a finished average reports (the backend's result has these attributes)."""

    @property
    def divergence(self) -> float: ...
    @property
    def post_norm(self) -> float: ...
    @property
    def pre_norm(self) -> float: ...


@attrs.frozen
class MeasuredRound:
    """Figures of an average for a shell with no backend result to hand (a simulation, a
    test). NaN: not measured (the SyncAck then carries None)."""

    divergence: float = math.nan
    post_norm: float = math.nan
    pre_norm: float = math.nan


class RankReports:
    """See the module docstring. Methods return at once; every message the rank sends goes
    through :meth:`send` or :meth:`out`, so held reports always go out first."""

    def __init__(self, rank: int, coalesce: bool) -> None:
        self.rank = rank
        self.coalesce = coalesce
        self._ms: list[float] = []
        self._data_ms: list[float] = []
        self._loss: list[float] = []
        """Coalescing: the reports not sent yet, oldest first (one entry per batch)."""
        self._step = 0
        """Coalescing: the step count right after the last held batch."""
        self._sent_since_beat = False
        """Coalescing: a frame went out since the last :meth:`heartbeat`."""

    @property
    def held(self) -> int:
        """Batch reports held back for the next ``Batches`` frame (coalescing only)."""
        return len(self._ms)

    def heartbeat(self, step_count: int) -> Heartbeat | Batches | None:
        """What to send at the heartbeat interval: a ``Heartbeat``; when coalescing, the held
        reports instead, or nothing when another frame went out since the last call."""
        if not self.coalesce:
            return Heartbeat(rank=self.rank, step_count=step_count)
        sent, self._sent_since_beat = self._sent_since_beat, False
        if self._ms:
            return self._take_held()
        return None if sent else Heartbeat(rank=self.rank, step_count=step_count)

    def batch(
        self, step_count: int, batch_ms: float, data_ms: float, loss: float
    ) -> list[RankEffect]:
        """A batch finished, ``step_count`` counting it: its ``Batch``, or held when coalescing
        (nothing is sent unless that makes :data:`MAX_COALESCED`)."""
        data_ms = max(float(data_ms), 0.0)
        if not self.coalesce:
            report = Batch(
                rank=self.rank,
                batch_ms=batch_ms,
                data_ms=data_ms,
                step_count=step_count,
                batch_loss=float(loss),
            )
            return [Send(report)]
        self._ms.append(batch_ms)
        self._data_ms.append(data_ms)
        self._loss.append(float(loss))
        self._step = step_count
        if len(self._ms) < MAX_COALESCED:
            return []
        self._sent_since_beat = True
        return [Send(self._take_held())]

    def ack(self, sync: SyncNow, step_count: int, figures: RoundFigures) -> list[RankEffect]:
        """The round for ``sync`` finished, ``step_count`` counting it: its ``SyncAck`` (a
        figure that is not finite goes as None)."""
        ack = SyncAck(
            rank=self.rank,
            round=sync.round,
            step_count=step_count,
            divergence=_finite(figures.divergence),
            post_norm=_finite(figures.post_norm),
            pre_norm=_finite(figures.pre_norm),
        )
        return self.send(ack)

    def saved(
        self, version: int, elapsed_ms: float, error: str | None, path: str | None
    ) -> CheckpointResult:
        """The result of saving bundle ``version`` to ``path`` (or not: ``error``), to send."""
        return CheckpointResult(
            rank=self.rank, version=version, elapsed_ms=elapsed_ms, error=error, path=path
        )

    def goodbye(self, why: str, *first: Message) -> list[RankEffect]:
        """``first``, then Note(why) and Exiting."""
        return self.send(*first, Note(rank=self.rank, detail=why), Exiting(rank=self.rank))

    def send(self, *messages: Message) -> list[RankEffect]:
        """``messages`` to send in order (after the held reports, if any)."""
        return self.out([Send(message) for message in messages])

    def out(self, effects: list[RankEffect]) -> list[RankEffect]:
        """``effects`` with the held reports sent just before its first message (if any)."""
        if self.coalesce:
            for at, effect in enumerate(effects):
                if isinstance(effect, Send):
                    self._sent_since_beat = True
                    if self._ms:
                        effects.insert(at, Send(self._take_held()))
                    break
        return effects

    def _take_held(self) -> Batches:
        """The held reports as one frame (they are no longer held)."""
        batches = Batches(
            rank=self.rank,
            step_count=self._step,
            batch_ms=tuple(self._ms),
            data_ms=tuple(self._data_ms),
            batch_loss=tuple(self._loss),
        )
        self._ms.clear()
        self._data_ms.clear()
        self._loss.clear()
        return batches


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
