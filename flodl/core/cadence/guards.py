"""Convergence guards: after each averaging round, may ElChe lengthen its windows?

A guard watches how far the ranks' parameters drifted apart during a window and returns a
:data:`Verdict`:

* :class:`Stable` - no sign of trouble; a staged anchor growth may be committed.
* :class:`SuppressGrowth` - veto growth (ElChe latches growth off until 5 Stable verdicts).
* :class:`NudgeDown` - shrink the anchor by ``factor`` (and veto growth).

Every guard takes the same inputs (:class:`Guard`). Guards are pure and deterministic; their
``state()`` is a plain JSON-able dict, and :func:`guard_from_state` rebuilds the right guard from
it, so a resumed run continues exactly where the checkpoint left off.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias

import attrs

from flodl.errors import CheckpointError, ConfigError

__all__ = [
    "Guard",
    "GuardKind",
    "MsfGuard",
    "NoGuard",
    "NudgeDown",
    "Stable",
    "SuppressGrowth",
    "TrendGuard",
    "Verdict",
    "guard_from_state",
    "make_guard",
    "round_divergence",
]


@attrs.frozen
class Stable:
    """No sign of trouble: ElChe may commit a staged anchor growth."""


@attrs.frozen
class SuppressGrowth:
    """Divergence is trending up: do not grow the anchor (ElChe latches growth off)."""


@attrs.frozen
class NudgeDown:
    """Divergence is growing fast: shrink the anchor to ``ceil(anchor * factor)``.

    ElChe clamps ``factor`` to [0.1, 1] and ignores a NaN factor.
    """

    factor: float


Verdict: TypeAlias = Stable | SuppressGrowth | NudgeDown


def round_divergence(divergences: Sequence[float]) -> float | None:
    """The round's divergence: the largest finite, non-negative entry (None if there is none)."""
    usable = [d for d in divergences if math.isfinite(d) and d >= 0.0]
    return max(usable) if usable else None


class Guard(Protocol):
    """What every guard offers.

    ``report(divergences, k_used, k_max)`` is called once per averaging round, with:

    * ``divergences``: one entry per rank that acknowledged the round, each the rank's relative
      parameter drift ``||pre - post|| / ||post||`` (0 when ``||post||`` is tiny). Entries that
      are NaN, infinite or negative are ignored; a round with no usable entry is Stable and leaves
      the guard's state unchanged.
    * ``k_used``: the batches all ranks ran together in the window (sum of their steps).
    * ``k_max``: the most batches any one rank ran in the window.
    """

    def report(self, divergences: Sequence[float], k_used: int, k_max: int) -> Verdict:
        """Take one round's divergences and return the verdict for it."""
        ...

    def state(self) -> dict[str, Any]:
        """A JSON-able snapshot; :func:`guard_from_state` rebuilds an identical guard."""
        ...


class NoGuard:
    """Never objects: every round is :class:`Stable`."""

    def report(self, divergences: Sequence[float], k_used: int, k_max: int) -> Verdict:
        """Always :class:`Stable`."""
        return Stable()

    def state(self) -> dict[str, Any]:
        """``{"kind": "none"}``."""
        return {"kind": "none"}

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> NoGuard:
        """Rebuild from :meth:`state` (raises CheckpointError if the kind is wrong)."""
        _expect_kind(d, "none")
        return cls()


TREND_RING = 5
"""How many past round divergences TrendGuard keeps."""
TREND_RISING = 3
"""How many strictly rising values in a row count as a trend."""


class TrendGuard:
    """Suppresses growth while the round divergence keeps rising; never nudges.

    Each round's divergence (:func:`round_divergence`) goes into a ring of the last 5. When the
    last three are strictly rising and the last is above ``threshold``, the verdict is
    :class:`SuppressGrowth`; otherwise :class:`Stable`. ``k_used`` and ``k_max`` are not used.
    """

    def __init__(self, threshold: float = 0.05) -> None:
        if not (math.isfinite(threshold) and threshold >= 0.0):
            raise ConfigError(f"TrendGuard threshold must be finite and >= 0, got {threshold!r}")
        self._threshold = threshold
        self._ring: deque[float] = deque(maxlen=TREND_RING)

    @property
    def threshold(self) -> float:
        """The divergence above which a rising trend suppresses growth."""
        return self._threshold

    @property
    def history(self) -> list[float]:
        """The ring of recent round divergences, oldest first."""
        return list(self._ring)

    def report(self, divergences: Sequence[float], k_used: int, k_max: int) -> Verdict:
        """Record the round's divergence; SuppressGrowth on three strictly rising values."""
        value = round_divergence(divergences)
        if value is None:
            return Stable()
        self._ring.append(value)
        if len(self._ring) < TREND_RISING:
            return Stable()
        last = list(self._ring)[-TREND_RISING:]
        rising = all(a < b for a, b in itertools.pairwise(last))
        if rising and last[-1] > self._threshold:
            return SuppressGrowth()
        return Stable()

    def state(self) -> dict[str, Any]:
        """Threshold and ring, JSON-able."""
        return {"kind": "trend", "threshold": self._threshold, "ring": list(self._ring)}

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> TrendGuard:
        """Rebuild from :meth:`state` (raises CheckpointError on a malformed dict)."""
        _expect_kind(d, "trend")
        try:
            guard = cls(float(d["threshold"]))
            ring = [float(x) for x in d["ring"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed TrendGuard state: {exc!r}") from exc
        if len(ring) > TREND_RING:
            raise CheckpointError(f"TrendGuard ring holds {len(ring)} values, at most {TREND_RING}")
        guard._ring.extend(ring)
        return guard


MSF_ALPHA = 0.9
"""Decay of MsfGuard's exponential moving average of the divergence growth rate."""
MSF_FLOOR = 1e-8
"""Divergences below this carry no usable rate; they reset MsfGuard."""
MSF_STREAK = 3
"""Rounds in a row above a threshold before MsfGuard acts."""


class MsfGuard:
    """Watches the growth rate of divergence per batch (a finite-time Lyapunov estimate).

    For each round, ``D_t`` is the round divergence (:func:`round_divergence`) and
    ``lambda_t = ln(D_t / D_{t-1}) / k_max``. An exponential moving average (alpha 0.9) with
    bias correction smooths lambda. When the smoothed lambda exceeds ``suppress_above`` (1e-3)
    three rounds in a row the verdict is :class:`SuppressGrowth` (again every round while it
    stays above); when it exceeds ``nudge_above`` (1e-2) three rounds in a row the verdict is
    ``NudgeDown(nudge_factor)`` (0.5) and that streak restarts, so the next nudge needs three
    more rounds. A nudge wins over a suppression.

    A round divergence below 1e-8 resets the guard (no previous value, no average, no streaks).
    The first round after a reset only records ``D``. A round with ``k_max < 1`` records ``D``
    without a rate.
    """

    def __init__(
        self,
        suppress_above: float = 1e-3,
        nudge_above: float = 1e-2,
        nudge_factor: float = 0.5,
    ) -> None:
        for name, value in (("suppress_above", suppress_above), ("nudge_above", nudge_above)):
            if not (math.isfinite(value) and value >= 0.0):
                raise ConfigError(f"MsfGuard {name} must be finite and >= 0, got {value!r}")
        if not (math.isfinite(nudge_factor) and 0.0 < nudge_factor <= 1.0):
            raise ConfigError(f"MsfGuard nudge_factor must be in (0, 1], got {nudge_factor!r}")
        self._suppress_above = suppress_above
        self._nudge_above = nudge_above
        self._nudge_factor = nudge_factor
        self._previous: float | None = None
        self._ema = 0.0
        self._samples = 0
        self._suppress_streak = 0
        self._nudge_streak = 0

    @property
    def rate(self) -> float | None:
        """The bias-corrected smoothed lambda, or None before the first rate."""
        if self._samples == 0:
            return None
        return self._ema / (1.0 - MSF_ALPHA**self._samples)

    def _reset(self) -> None:
        self._previous = None
        self._ema = 0.0
        self._samples = 0
        self._suppress_streak = 0
        self._nudge_streak = 0

    def report(self, divergences: Sequence[float], k_used: int, k_max: int) -> Verdict:
        """Update the smoothed rate with this round and return the verdict (see the class)."""
        value = round_divergence(divergences)
        if value is None:
            return Stable()
        if value < MSF_FLOOR:
            self._reset()
            return Stable()
        previous, self._previous = self._previous, value
        if previous is None or k_max < 1:
            return Stable()
        lam = math.log(value / previous) / k_max
        self._ema = MSF_ALPHA * self._ema + (1.0 - MSF_ALPHA) * lam
        self._samples += 1
        smoothed = self._ema / (1.0 - MSF_ALPHA**self._samples)
        self._suppress_streak = self._suppress_streak + 1 if smoothed > self._suppress_above else 0
        self._nudge_streak = self._nudge_streak + 1 if smoothed > self._nudge_above else 0
        if self._nudge_streak >= MSF_STREAK:
            self._nudge_streak = 0
            return NudgeDown(self._nudge_factor)
        if self._suppress_streak >= MSF_STREAK:
            return SuppressGrowth()
        return Stable()

    def state(self) -> dict[str, Any]:
        """Thresholds, previous divergence, moving average and streaks, JSON-able."""
        return {
            "kind": "msf",
            "suppress_above": self._suppress_above,
            "nudge_above": self._nudge_above,
            "nudge_factor": self._nudge_factor,
            "previous": self._previous,
            "ema": self._ema,
            "samples": self._samples,
            "suppress_streak": self._suppress_streak,
            "nudge_streak": self._nudge_streak,
        }

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> MsfGuard:
        """Rebuild from :meth:`state` (raises CheckpointError on a malformed dict)."""
        _expect_kind(d, "msf")
        try:
            guard = cls(
                float(d["suppress_above"]), float(d["nudge_above"]), float(d["nudge_factor"])
            )
            previous = d["previous"]
            guard._previous = None if previous is None else float(previous)
            guard._ema = float(d["ema"])
            guard._samples = int(d["samples"])
            guard._suppress_streak = int(d["suppress_streak"])
            guard._nudge_streak = int(d["nudge_streak"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed MsfGuard state: {exc!r}") from exc
        if guard._samples < 0 or guard._suppress_streak < 0 or guard._nudge_streak < 0:
            raise CheckpointError("MsfGuard state holds a negative counter")
        return guard


class GuardKind(enum.Enum):
    """Which convergence guard judges each averaging round."""

    TREND = "trend"
    NONE = "none"
    MSF = "msf"


def make_guard(kind: GuardKind | str, threshold: float = 0.05) -> Guard:
    """A fresh guard of ``kind`` (or its name): TREND (TrendGuard(threshold)), NONE or MSF.

    Raises:
        ConfigError: an unknown name.
    """
    try:
        kind = GuardKind(kind)
    except ValueError:
        raise ConfigError(f"unknown guard {kind!r} (expected 'trend', 'none' or 'msf')") from None
    if kind is GuardKind.TREND:
        return TrendGuard(threshold)
    if kind is GuardKind.NONE:
        return NoGuard()
    return MsfGuard()


def guard_from_state(d: Mapping[str, Any]) -> Guard:
    """Rebuild whichever guard wrote ``d`` (by its ``kind``: "none", "trend" or "msf")."""
    kind = d.get("kind")
    if kind == "none":
        return NoGuard.from_state(d)
    if kind == "trend":
        return TrendGuard.from_state(d)
    if kind == "msf":
        return MsfGuard.from_state(d)
    raise CheckpointError(f"unknown guard kind {kind!r} (expected 'none', 'trend' or 'msf')")


def _expect_kind(d: Mapping[str, Any], kind: str) -> None:
    if d.get("kind") != kind:
        raise CheckpointError(f"guard state of kind {d.get('kind')!r}, expected {kind!r}")
