"""ElChe: how many batches each rank runs between two parameter averages.

The slowest rank (the *anchor rank*) runs ``anchor`` batches per window; a rank that is k times
faster runs about ``k * anchor``, so all ranks reach the averaging barrier at about the same
time and nobody idles. Timings come in after every window (:meth:`ElChe.report_window`); the
anchor itself grows when averaging costs too much of the window (auto-tune), but only with a
convergence guard's consent (:meth:`ElChe.apply_verdict`).

One averaging round drives ElChe like this::

    elche.report_window(windows, reduce_ms)   # may stage a larger anchor
    elche.apply_verdict(guard.report(divergences, k_used, k_max))  # commit, veto or shrink
    counts = elche.batch_counts               # the next window's plan

Pure: no clocks, no I/O. Every method either completes or raises before changing anything.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from flodl.core.guards import NudgeDown, Stable, SuppressGrowth, Verdict
from flodl.core.phases import Phase, phase_for
from flodl.errors import CheckpointError, ConfigError

__all__ = [
    "ElChe",
    "Phase",
    "RankWindow",
    "elche_for_world",
    "elect_anchor",
    "rust_round",
]

TRUST_WINDOW = 5
"""A rank's time per batch is the mean of its last 5 valid samples."""
INVALID_CLEARS_AFTER = 5
"""This many invalid reports in a row clear a rank's samples."""
MAX_SPEEDUP = 64.0
"""No rank runs more than 64x the anchor's batches."""
DEAD_ZONE = 0.05
"""Timing jitter below 5% of a rank's count does not change it."""
COHORT_SHARE = 0.85
"""Ranks at >= 85% of the slowest time per batch form the slow cohort."""
DOMINANCE = 1.10
"""A challenger must be >= 10% slower than the incumbent anchor rank to unseat it."""
SHARE_HISTORY = 10
"""``recent_batch_share`` averages the last 10 count vectors."""
REARM_AFTER_STABLE = 5
"""Stable verdicts in a row that re-arm latched anchor growth."""
MAX_GROWTH = 2.0
"""One auto-tune step at most doubles the anchor."""
OVERHEAD_TARGET_RANGE = (0.01, 0.5)
"""``overhead_target`` is clamped into this range."""
NUDGE_FACTOR_RANGE = (0.1, 1.0)
"""``nudge_down`` clamps its factor into this range."""
STATE_VERSION = 1


def rust_round(x: float) -> int:
    """Round halves away from zero (Rust's ``f64::round``): 2.5 -> 3, 3.5 -> 4, -2.5 -> -3."""
    if x >= 0:
        return math.floor(x + 0.5)
    return -math.floor(-x + 0.5)


def _ceil(x: float) -> int:
    """``ceil`` that forgives float noise in a product, so that ``ceil(10 * 0.3)`` is 3, not 4."""
    return math.ceil(x - 1e-9 * max(1.0, abs(x)))


def elect_anchor(smoothed_ms: Sequence[float | None], incumbent: int | None) -> int | None:
    """The anchor rank for these smoothed times per batch (None where a rank has no timing).

    The incumbent stays unless some rank is at least 10% slower than it (or it has no timing);
    otherwise the winner is the lowest-indexed rank of the slow cohort (ranks at >= 85% of the
    slowest time). Returns None when no rank has timing.
    """
    timed = [(rank, ms) for rank, ms in enumerate(smoothed_ms) if ms is not None]
    if not timed:
        return None
    slowest = max(ms for _, ms in timed)
    if incumbent is not None and 0 <= incumbent < len(smoothed_ms):
        incumbent_ms = smoothed_ms[incumbent]
        if incumbent_ms is not None and slowest / incumbent_ms < DOMINANCE:
            return incumbent
    return min(rank for rank, ms in timed if ms / slowest >= COHORT_SHARE)


@attrs.frozen
class RankWindow:
    """What one rank measured over one window (the feed of :meth:`ElChe.report_window`).

    The window's first batch is *fill* (pipeline warm-up, data loader start); its time is
    ``fill_ms`` and it is not a sample of the rank's speed. Over batches 2..n the rank sums
    ``compute_ms`` (time in the training step) and, where it can, ``delivered_ms`` (step time plus
    time waiting for data: what the rank really delivers). ``batches`` counts all n batches.
    """

    batches: int
    fill_ms: float = 0.0
    compute_ms: float = 0.0
    delivered_ms: float | None = None

    @property
    def is_empty(self) -> bool:
        """True when the window holds no usable time (no batch after the fill, or all zero)."""
        return self.batches < 2 or (
            self.fill_ms == 0.0 and self.compute_ms == 0.0 and not self.delivered_ms
        )


def _positive_finite(x: float) -> bool:
    return math.isfinite(x) and x > 0.0


class _TrustWindow:
    """A rank's last few valid times per batch, and how many reports in a row were invalid."""

    __slots__ = ("misses", "samples")

    def __init__(self, samples: Iterable[float] = (), misses: int = 0) -> None:
        self.samples: deque[float] = deque(samples, maxlen=TRUST_WINDOW)
        self.misses = misses

    def add(self, ms: float) -> None:
        self.samples.append(ms)
        self.misses = 0

    def miss(self) -> None:
        self.misses += 1
        if self.misses >= INVALID_CLEARS_AFTER:
            self.samples.clear()

    @property
    def mean(self) -> float | None:
        if not self.samples:
            return None
        return sum(self.samples) / len(self.samples)

    @property
    def lost(self) -> bool:
        """No timing, and the rank has missed enough reports in a row to count as gone."""
        return not self.samples and self.misses >= INVALID_CLEARS_AFTER


class ElChe:
    """Per-rank batch counts for the next window, the anchor, and the phase of calibration.

    Args:
        world_size: number of ranks (>= 1; a single survivor simply runs ``anchor`` batches).
        anchor: batches the anchor rank runs per window; also the floor of auto-tune growth.
        max_anchor: the anchor never grows above this.
        overhead_target: wanted share of a window spent averaging; clamped to [0.01, 0.5].
        max_batch_diff: once calibrated, a count moves at most this far per recompute; also
            bounds :meth:`relax_up`. None: no bound.
        max_total_batches: window cap (the epoch's batches), see :meth:`set_max_total_batches`.
        sync_policy: True when the run averages after every batch (Sync policy): auto-tune then
            never grows the anchor.
        relax_up_on_stable: call :meth:`relax_up` after every Stable verdict (floDl's opt-in
            for Async; the ``relax_up`` setting).

    Raises:
        ConfigError: world_size < 1, anchor < 1, max_anchor < anchor, a NaN overhead target,
            max_batch_diff < 0 or max_total_batches < 1.
    """

    def __init__(
        self,
        world_size: int,
        anchor: int = 10,
        max_anchor: int = 1000,
        overhead_target: float = 0.05,
        max_batch_diff: int | None = None,
        *,
        max_total_batches: int | None = None,
        sync_policy: bool = False,
        relax_up_on_stable: bool = False,
    ) -> None:
        if world_size < 1:
            raise ConfigError(f"ElChe world_size must be >= 1, got {world_size}")
        if anchor < 1:
            raise ConfigError(f"ElChe anchor must be >= 1, got {anchor}")
        if max_anchor < anchor:
            raise ConfigError(f"ElChe max_anchor ({max_anchor}) must be >= anchor ({anchor})")
        if math.isnan(overhead_target):
            raise ConfigError("ElChe overhead_target must be a number, got NaN")
        if max_batch_diff is not None and max_batch_diff < 0:
            raise ConfigError(f"ElChe max_batch_diff must be >= 0, got {max_batch_diff}")
        _check_cap(max_total_batches)
        low, high = OVERHEAD_TARGET_RANGE
        self._world_size = world_size
        self._anchor = anchor
        self._min_anchor = anchor
        self._max_anchor = max_anchor
        self._overhead_target = min(max(overhead_target, low), high)
        self._max_batch_diff = max_batch_diff
        self._max_total_batches = max_total_batches
        self._sync_policy = sync_policy
        self._relax_up_on_stable = relax_up_on_stable

        self._windows = [_TrustWindow() for _ in range(world_size)]
        self._counts = [anchor] * world_size
        self._anchor_rank = 0
        self._calibration_count = 0
        self._cap_binding = False
        self._staged: int | None = None
        self._overhead: float | None = None
        self._growth_latched = False
        self._stable_streak = 0
        self._history: deque[list[int]] = deque(maxlen=SHARE_HISTORY)
        self._apply_cap()

    # --- read-only state --------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._world_size

    @property
    def anchor(self) -> int:
        """Batches the anchor rank runs per window."""
        return self._anchor

    @property
    def min_anchor(self) -> int:
        """The initial anchor: auto-tune never proposes less (nudges may go below)."""
        return self._min_anchor

    @property
    def max_anchor(self) -> int:
        """The anchor never grows above this."""
        return self._max_anchor

    @property
    def overhead_target(self) -> float:
        """Wanted share of a window spent averaging (after clamping)."""
        return self._overhead_target

    @property
    def max_batch_diff(self) -> int | None:
        """Per-recompute step bound on a count once calibrated (None: unbounded)."""
        return self._max_batch_diff

    @property
    def max_total_batches(self) -> int | None:
        """The window cap (None: no cap)."""
        return self._max_total_batches

    @property
    def anchor_rank(self) -> int:
        """The rank that runs ``anchor`` batches (rank 0 until timings elect one)."""
        return self._anchor_rank

    @property
    def calibration_count(self) -> int:
        """Reports after which the anchor rank had a measured time per batch."""
        return self._calibration_count

    @property
    def calibrated(self) -> bool:
        """At least one calibration happened."""
        return self._calibration_count >= 1

    @property
    def phase(self) -> Phase:
        """Probe, Warmup (>= 1 calibration), Stable (>= 5) or Mature (>= 20)."""
        return phase_for(self._calibration_count)

    @property
    def batch_counts(self) -> list[int]:
        """Batches each rank runs in the next window (a copy; every entry >= 1)."""
        return list(self._counts)

    @property
    def smoothed_ms(self) -> list[float | None]:
        """Each rank's time per batch (mean of its last 5 valid samples), None if unknown."""
        return [window.mean for window in self._windows]

    @property
    def slow_ms(self) -> float | None:
        """The anchor rank's time per batch, None while it has no timing."""
        return self._windows[self._anchor_rank].mean

    @property
    def anchor_wall_ms(self) -> float:
        """Expected length of a window: ``anchor * slow_ms``; 0.0 until calibrated."""
        slow = self.slow_ms
        if not self.calibrated or slow is None:
            return 0.0
        return self._anchor * slow

    @property
    def recent_batch_share(self) -> list[float]:
        """Each rank's share of the batches over the last 10 reports' counts (sums to 1)."""
        rows = list(self._history) or [self._counts]
        means = [sum(column) / len(rows) for column in zip(*rows, strict=True)]
        total = sum(means)
        return [m / total for m in means]

    @property
    def cap_binding(self) -> bool:
        """True while the window cap scaled the counts down."""
        return self._cap_binding

    @property
    def staged_anchor(self) -> int | None:
        """The anchor growth proposed by the last report, awaiting a verdict (None if none)."""
        return self._staged

    @property
    def overhead(self) -> float | None:
        """The averaging overhead measured by the last report (None if it could not be)."""
        return self._overhead

    @property
    def growth_latched(self) -> bool:
        """True while a non-Stable verdict holds anchor growth off (5 Stable verdicts re-arm)."""
        return self._growth_latched

    # --- feeds ------------------------------------------------------------------------------

    def report_window(
        self,
        windows: Sequence[RankWindow | None],
        reduce_ms: float,
        *,
        use_delivered: bool = True,
    ) -> list[int]:
        """Take one window's per-rank report; return the new counts.

        A rank's sample is its delivered time (or compute time) over batches 2..n divided by
        ``n - 1``; the fill batch is left out of the speed and counted as overhead instead.
        Delivered time is used only if ``use_delivered`` (the caller passes True for CPU
        Cadence/Async and NCCL Cadence) and every rank that moved has a delivered sample;
        otherwise every rank uses compute time, so the cohort is never mixed. None or empty
        windows (:attr:`RankWindow.is_empty`) and samples that are not finite and > 0 are
        invalid reports for that rank: ignored, and 5 in a row clear the rank's samples.
        ``reduce_ms`` is the last averaging's duration (a non-finite or negative value disables
        auto-tune for this report).

        Raises:
            ConfigError: the number of windows differs from the world size.
        """
        self._check_length("windows", windows)
        movers = [w for w in windows if w is not None and not w.is_empty]
        delivered = use_delivered and bool(movers)
        delivered = delivered and all(w.delivered_ms is not None for w in movers)
        samples: list[float | None] = []
        for window in windows:
            if window is None or window.is_empty:
                samples.append(None)
                continue
            spent = window.delivered_ms if delivered else window.compute_ms
            ms = (spent or 0.0) / (window.batches - 1)
            samples.append(ms if _positive_finite(ms) else None)
        fills = [w.fill_ms if w is not None and math.isfinite(w.fill_ms) else 0.0 for w in windows]
        return self._ingest(samples, reduce_ms, [max(f, 0.0) for f in fills])

    def _ingest(
        self, samples: Sequence[float | None], reduce_ms: float, fill_ms: Sequence[float]
    ) -> list[int]:
        was_calibrated = self.calibrated
        rank_before = self._anchor_rank
        for window, sample in zip(self._windows, samples, strict=True):
            if sample is None:
                window.miss()
            else:
                window.add(sample)

        # A lost anchor rank (5 missed reports) is replaced at once, in any phase; otherwise
        # elections wait for Stable. With no timed rank at all, rank 0 stands in.
        lost = self._windows[self._anchor_rank].lost
        if lost or self.phase >= Phase.STABLE:
            elected = elect_anchor(self.smoothed_ms, None if lost else self._anchor_rank)
            if elected is not None:
                self._anchor_rank = elected
            elif lost:
                self._anchor_rank = 0
        if self.slow_ms is not None:
            self._calibration_count += 1

        rank_changed = self._anchor_rank != rank_before
        self._recompute(retarget=not was_calibrated or rank_changed, step_clamp=was_calibrated)
        fill_b = fill_ms[self._anchor_rank]
        self._stage_growth(reduce_ms, fill_b)
        self._history.append(list(self._counts))
        return self.batch_counts

    # --- counts -----------------------------------------------------------------------------

    def _targets(self) -> list[int]:
        """Ideal counts: proportional to speed once timed, the anchor for everyone before."""
        slow = self.slow_ms
        if slow is None:
            return [self._anchor] * self._world_size
        targets = []
        for rank, ms in enumerate(self.smoothed_ms):
            if ms is None or rank == self._anchor_rank or math.isclose(ms, slow):
                targets.append(self._anchor)
            else:
                targets.append(max(1, rust_round(self._anchor * min(slow / ms, MAX_SPEEDUP))))
        return targets

    def _recompute(self, *, retarget: bool, step_clamp: bool) -> None:
        """Move counts toward their targets.

        The dead zone only filters timing jitter, so it is skipped with ``retarget`` (first
        calibration, a new anchor or anchor rank) and for the anchor rank, whose target is the
        anchor itself. ``step_clamp`` bounds each move by max_batch_diff.
        """
        if self.slow_ms is None:
            retarget, step_clamp = True, False
        new_counts = []
        for rank, (target, current) in enumerate(zip(self._targets(), self._counts, strict=True)):
            count = target
            jitter = abs(target - current) <= DEAD_ZONE * current
            if jitter and not retarget and rank != self._anchor_rank:
                count = current
            if step_clamp and self._max_batch_diff is not None:
                step = self._max_batch_diff
                count = current + max(-step, min(step, count - current))
            new_counts.append(count)
        self._counts = new_counts
        self._apply_cap()

    def _apply_cap(self) -> None:
        cap = self._max_total_batches
        if cap is None or sum(self._counts) <= cap:
            self._cap_binding = False
            return
        scaled = _scale_down(self._counts, cap)
        largest = self._counts.index(max(self._counts))
        scaled[largest] += max(0, cap - sum(scaled))
        self._counts = scaled
        self._cap_binding = True

    def set_max_total_batches(self, max_total: int | None) -> None:
        """Cap the sum of the counts (the batches left in the epoch); None removes the cap.

        Above the cap the counts are scaled to ``floor(c * cap / sum)`` (>= 1) and the remainder
        goes to the largest count; :attr:`cap_binding` tells whether that happened. A lower cap
        applies at once; counts held down by an old cap grow back at the next report.

        Raises:
            ConfigError: max_total < 1.
        """
        _check_cap(max_total)
        self._max_total_batches = max_total
        self._apply_cap()

    # --- anchor: auto-tune and verdicts -----------------------------------------------------

    def _stage_growth(self, reduce_ms: float, fill_ms: float) -> None:
        """Measure the overhead and stage a larger anchor if averaging costs too much."""
        self._staged = None
        self._overhead = None
        slow = self.slow_ms
        if slow is None or not (math.isfinite(reduce_ms) and reduce_ms >= 0.0):
            return
        spent = reduce_ms + fill_ms
        self._overhead = overhead = spent / (self._anchor * slow + spent)
        if self._sync_policy or self._cap_binding or self._growth_latched:
            return
        phase = self.phase
        target = self._overhead_target
        if phase >= Phase.STABLE:
            fires = overhead > target
        elif phase == Phase.WARMUP and self._calibration_count >= 2:
            fires = overhead > 2.0 * target
        else:
            fires = False
        if not fires:
            return
        grown = _ceil(self._anchor * min(overhead / target, MAX_GROWTH))
        proposal = min(max(grown, self._min_anchor), self._max_anchor)
        if proposal > self._anchor:
            self._staged = proposal

    def apply_verdict(self, verdict: Verdict) -> None:
        """Act on a guard's verdict for the round just reported.

        * Stable: commit the staged anchor (if any), then :meth:`relax_up` if enabled; while
          growth is latched, the 5th Stable verdict in a row re-arms it.
        * SuppressGrowth: discard the staged anchor and latch growth off.
        * NudgeDown(f): discard, latch, and :meth:`nudge_down` by f.
        """
        if isinstance(verdict, Stable):
            staged, self._staged = self._staged, None
            if self._growth_latched:
                self._stable_streak += 1
                if self._stable_streak >= REARM_AFTER_STABLE:
                    self._growth_latched = False
                    self._stable_streak = 0
            if staged is not None and staged > self._anchor:
                self._set_anchor(staged)
            if self._relax_up_on_stable:
                self.relax_up()
        elif isinstance(verdict, SuppressGrowth):
            self._staged = None
            self._latch_growth()
        elif isinstance(verdict, NudgeDown):
            self._staged = None
            self._latch_growth()
            self.nudge_down(verdict.factor)
        else:
            raise ConfigError(f"not a guard verdict: {verdict!r}")

    def _latch_growth(self) -> None:
        self._growth_latched = True
        self._stable_streak = 0

    def nudge_down(self, factor: float) -> int:
        """Shrink the anchor to ``max(1, min(a, ceil(a * clamp(factor, 0.1, 1))))``; return it.

        May go below ``min_anchor``. A NaN factor changes nothing. Any staged growth is dropped.
        """
        if math.isnan(factor):
            return self._anchor
        self._staged = None
        low, high = NUDGE_FACTOR_RANGE
        factor = min(max(factor, low), high)
        shrunk = max(1, min(self._anchor, _ceil(self._anchor * factor)))
        if shrunk != self._anchor:
            self._set_anchor(shrunk)
        return self._anchor

    def relax_up(self) -> bool:
        """Grow the anchor by one if below ``max_anchor`` and the spread allows; True if grown.

        With ``max_batch_diff = M`` the step needs timing and
        ``round((a + 1) * max_ms / min_ms) - (a + 1) <= M``.
        """
        grown = self._anchor + 1
        if grown > self._max_anchor:
            return False
        if self._max_batch_diff is not None:
            timed = [ms for ms in self.smoothed_ms if ms is not None]
            if not timed:
                return False
            if rust_round(grown * max(timed) / min(timed)) - grown > self._max_batch_diff:
                return False
        self._set_anchor(grown)
        return True

    def _set_anchor(self, anchor: int) -> None:
        self._anchor = anchor
        self._recompute(retarget=True, step_clamp=self.calibrated)

    # --- membership -------------------------------------------------------------------------

    def for_survivors(self, survivors: Sequence[int]) -> ElChe:
        """A new ElChe over the surviving ranks, renumbered 0.. in ascending old-index order.

        Survivors keep their timings, the anchor, phase and latch. If the anchor rank died, a
        new one is elected among the timed survivors (rank 0 if none has timing). Counts are
        recomputed at once, without dead zone or step clamp. Any staged growth is dropped. This
        instance is not changed.

        Raises:
            ConfigError: no survivors, a duplicate, or an index out of range.
        """
        keep = sorted(survivors)
        if not keep:
            raise ConfigError("for_survivors needs at least one surviving rank")
        if len(set(keep)) != len(keep):
            raise ConfigError(f"for_survivors got duplicate ranks: {list(survivors)}")
        for rank in keep:
            self._check_rank(rank)
        new_index = {old: new for new, old in enumerate(keep)}

        state = self.state()
        state["world_size"] = len(keep)
        for key in ("samples", "misses", "batch_counts", "smoothed_ms"):
            state[key] = [state[key][old] for old in keep]
        state["history"] = [[row[old] for old in keep] for row in state["history"]]
        state["anchor_rank"] = new_index.get(self._anchor_rank, 0)
        state["staged_anchor"] = None

        successor = ElChe.from_state(state)
        if self._anchor_rank not in new_index:
            elected = elect_anchor(successor.smoothed_ms, None)
            successor._anchor_rank = 0 if elected is None else elected
        successor._recompute(retarget=True, step_clamp=False)
        return successor

    def add_rank(self) -> int:
        """Add a rank with no timing at the end; it runs ``anchor`` batches until timed.

        Returns its index. The window cap is re-applied.
        """
        self._world_size += 1
        self._windows.append(_TrustWindow())
        self._counts.append(self._anchor)
        for row in self._history:
            row.append(self._anchor)
        self._apply_cap()
        return self._world_size - 1

    # --- checkpoints ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """A JSON-able snapshot from which :meth:`from_state` rebuilds an identical ElChe."""
        return {
            "version": STATE_VERSION,
            "world_size": self._world_size,
            "anchor": self._anchor,
            "min_anchor": self._min_anchor,
            "max_anchor": self._max_anchor,
            "overhead_target": self._overhead_target,
            "max_batch_diff": self._max_batch_diff,
            "max_total_batches": self._max_total_batches,
            "sync_policy": self._sync_policy,
            "relax_up_on_stable": self._relax_up_on_stable,
            "anchor_rank": self._anchor_rank,
            "phase": self.phase.name,
            "calibration_count": self._calibration_count,
            "smoothed_ms": self.smoothed_ms,
            "samples": [list(window.samples) for window in self._windows],
            "misses": [window.misses for window in self._windows],
            "batch_counts": list(self._counts),
            "cap_binding": self._cap_binding,
            "staged_anchor": self._staged,
            "overhead": self._overhead,
            "growth_latched": self._growth_latched,
            "stable_streak": self._stable_streak,
            "history": [list(row) for row in self._history],
        }

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> ElChe:
        """Rebuild an ElChe from :meth:`state` (``phase`` and ``smoothed_ms`` are derived).

        Keys it does not read are ignored (a state saved by an earlier flodl also carries
        ``speed_pin`` and ``partition_ratios``, None in every run).

        Raises:
            CheckpointError: the dict is malformed, inconsistent, or from a newer version.
        """
        try:
            return cls._from_state(d)
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"malformed ElChe state: {exc!r}") from exc

    @classmethod
    def _from_state(cls, d: Mapping[str, Any]) -> ElChe:
        version = int(d["version"])
        if version > STATE_VERSION:
            raise CheckpointError(f"ElChe state version {version} is newer than {STATE_VERSION}")
        world_size = int(d["world_size"])
        elche = cls(
            world_size,
            anchor=int(d["min_anchor"]),
            max_anchor=int(d["max_anchor"]),
            overhead_target=float(d["overhead_target"]),
            max_batch_diff=_opt_int(d["max_batch_diff"]),
            sync_policy=bool(d["sync_policy"]),
            relax_up_on_stable=bool(d["relax_up_on_stable"]),
        )
        anchor = int(d["anchor"])
        if not 1 <= anchor <= elche._max_anchor:
            raise CheckpointError(f"ElChe state anchor {anchor} outside [1, max_anchor]")
        elche._anchor = anchor
        elche._max_total_batches = _opt_int(d["max_total_batches"])
        _check_cap(elche._max_total_batches)

        samples = [[float(ms) for ms in row] for row in d["samples"]]
        misses = [int(m) for m in d["misses"]]
        counts = [int(c) for c in d["batch_counts"]]
        history = [[int(c) for c in row] for row in d["history"]]
        for name, seq in (("samples", samples), ("misses", misses), ("batch_counts", counts)):
            if len(seq) != world_size:
                raise CheckpointError(
                    f"ElChe state {name} has {len(seq)} entries, not {world_size}"
                )
        if any(len(row) > TRUST_WINDOW or not all(map(_positive_finite, row)) for row in samples):
            raise CheckpointError("ElChe state holds an invalid timing sample")
        if any(c < 1 for c in counts) or any(m < 0 for m in misses):
            raise CheckpointError("ElChe state holds a count < 1 or a negative miss count")
        if len(history) > SHARE_HISTORY or any(len(row) != world_size for row in history):
            raise CheckpointError("ElChe state history does not match the world size")
        elche._windows = [_TrustWindow(s, m) for s, m in zip(samples, misses, strict=True)]
        elche._counts = counts
        elche._history = deque(history, maxlen=SHARE_HISTORY)

        anchor_rank = int(d["anchor_rank"])
        elche._check_rank(anchor_rank)
        elche._anchor_rank = anchor_rank
        elche._calibration_count = int(d["calibration_count"])
        elche._cap_binding = bool(d["cap_binding"])
        elche._staged = _opt_int(d["staged_anchor"])
        overhead = d["overhead"]
        elche._overhead = None if overhead is None else float(overhead)
        elche._growth_latched = bool(d["growth_latched"])
        elche._stable_streak = int(d["stable_streak"])
        return elche

    # --- checks -----------------------------------------------------------------------------

    def _check_length(self, name: str, seq: Sequence[object]) -> None:
        if len(seq) != self._world_size:
            raise ConfigError(
                f"ElChe {name}: expected {self._world_size} entries (one per rank), got {len(seq)}"
            )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self._world_size:
            raise ConfigError(f"ElChe rank {rank} out of range for world size {self._world_size}")


def _check_cap(max_total: int | None) -> None:
    if max_total is not None and max_total < 1:
        raise ConfigError(f"ElChe max_total_batches must be >= 1, got {max_total}")


def _scale_down(counts: Sequence[int], limit: int) -> list[int]:
    """Counts scaled by ``limit / sum(counts)``, floored, each at least 1 (exact integers).

    Where raising a count to 1 overshoots ``limit``, the overshoot is taken from the largest
    counts, so the sum is at most ``max(limit, len(counts))``.
    """
    total = sum(counts)
    scaled = [max(1, c * limit // total) for c in counts]
    for _ in range(sum(scaled) - limit):
        largest = scaled.index(max(scaled))
        if scaled[largest] == 1:
            break
        scaled[largest] -= 1
    return scaled


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def elche_for_world(state: Mapping[str, Any], world_size: int) -> ElChe:
    """The saved ElChe, fitted to ``world_size`` ranks.

    Ranks are matched by index: rank ``i`` of the resumed run inherits rank ``i``'s timings.
    The anchor, its bounds, the calibration count (hence the phase) and the growth latch are
    kept in every case.

    - Same size: exactly the saved ElChe.
    - Fewer ranks: ranks ``world_size..`` are dropped as by :meth:`ElChe.for_survivors`; if the
      anchor rank was among them, the slowest timed survivor becomes the anchor rank, and the
      counts are recomputed from the kept timings.
    - More ranks: new ranks are appended as by :meth:`ElChe.add_rank`; they have no timing and
      run ``anchor`` batches until their first report.

    Raises:
        CheckpointError: ``state`` is malformed or from a newer ElChe.
        ConfigError: ``world_size`` < 1.
    """
    if world_size < 1:
        raise ConfigError(f"cannot resume with world size {world_size}; it must be >= 1")
    elche = ElChe.from_state(state)
    if world_size < elche.world_size:
        return elche.for_survivors(range(world_size))
    while elche.world_size < world_size:
        elche.add_rank()
    return elche
