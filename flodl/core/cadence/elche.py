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

ElChe decides the counts; it composes what they rest on: the timings, the anchor rank and the
phase (:mod:`flodl.core.cadence.calibration`), and the anchor (:mod:`flodl.core.cadence.autotune`).
Pure: no clocks, no I/O. Every method either completes or raises before changing anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flodl.core.cadence.autotune import AnchorTuner
from flodl.core.cadence.calibration import (
    Calibration,
    RankWindow,
    elect_anchor,
    window_samples,
)
from flodl.core.cadence.counts import Counts, speed_targets
from flodl.core.cadence.guards import NudgeDown, Stable, Verdict
from flodl.core.cadence.phases import Phase
from flodl.core.cadence.rounding import rust_round
from flodl.errors import CheckpointError, ConfigError

__all__ = [
    "ElChe",
    "Phase",
    "RankWindow",
    "elche_for_world",
    "elect_anchor",
    "rust_round",
]

STATE_VERSION = 1


class ElChe:
    """Per-rank batch counts for the next window, from the calibration and the anchor.

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
        self._tuner = AnchorTuner(
            anchor,
            max_anchor,
            overhead_target,
            sync_policy=sync_policy,
            relax_up_on_stable=relax_up_on_stable,
        )
        self._counts = Counts(
            world_size, anchor, max_batch_diff=max_batch_diff, max_total=max_total_batches
        )
        self._calibration = Calibration(world_size)

    # --- read-only state --------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._calibration.world_size

    @property
    def anchor(self) -> int:
        """Batches the anchor rank runs per window."""
        return self._tuner.anchor

    @property
    def min_anchor(self) -> int:
        """The initial anchor: auto-tune never proposes less (nudges may go below)."""
        return self._tuner.min_anchor

    @property
    def max_anchor(self) -> int:
        """The anchor never grows above this."""
        return self._tuner.max_anchor

    @property
    def overhead_target(self) -> float:
        """Wanted share of a window spent averaging (after clamping)."""
        return self._tuner.overhead_target

    @property
    def max_batch_diff(self) -> int | None:
        """Per-recompute step bound on a count once calibrated (None: unbounded)."""
        return self._counts.max_batch_diff

    @property
    def max_total_batches(self) -> int | None:
        """The window cap (None: no cap)."""
        return self._counts.max_total

    @property
    def anchor_rank(self) -> int:
        """The rank that runs ``anchor`` batches (rank 0 until timings elect one)."""
        return self._calibration.anchor_rank

    @property
    def calibration_count(self) -> int:
        """Reports after which the anchor rank had a measured time per batch."""
        return self._calibration.count

    @property
    def calibrated(self) -> bool:
        """At least one calibration happened."""
        return self._calibration.calibrated

    @property
    def phase(self) -> Phase:
        """Probe, Warmup (>= 1 calibration), Stable (>= 5) or Mature (>= 20)."""
        return self._calibration.phase

    @property
    def batch_counts(self) -> list[int]:
        """Batches each rank runs in the next window (a copy; every entry >= 1)."""
        return self._counts.values

    @property
    def smoothed_ms(self) -> list[float | None]:
        """Each rank's time per batch (mean of its last 5 valid samples), None if unknown."""
        return self._calibration.smoothed_ms

    @property
    def slow_ms(self) -> float | None:
        """The anchor rank's time per batch, None while it has no timing."""
        return self._calibration.slow_ms

    @property
    def anchor_wall_ms(self) -> float:
        """Expected length of a window: ``anchor * slow_ms``; 0.0 until calibrated."""
        slow = self.slow_ms
        if not self.calibrated or slow is None:
            return 0.0
        return self.anchor * slow

    @property
    def recent_batch_share(self) -> list[float]:
        """Each rank's share of the batches over the last 10 reports' counts (sums to 1)."""
        return self._counts.recent_share

    @property
    def cap_binding(self) -> bool:
        """True while the window cap scaled the counts down."""
        return self._counts.cap_binding

    @property
    def staged_anchor(self) -> int | None:
        """The anchor growth proposed by the last report, awaiting a verdict (None if none)."""
        return self._tuner.staged

    @property
    def overhead(self) -> float | None:
        """The averaging overhead measured by the last report (None if it could not be)."""
        return self._tuner.overhead

    @property
    def growth_latched(self) -> bool:
        """True while a non-Stable verdict holds anchor growth off (5 Stable verdicts re-arm)."""
        return self._tuner.growth_latched

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
        if len(windows) != self.world_size:
            raise ConfigError(
                f"ElChe windows: expected {self.world_size} entries (one per rank), "
                f"got {len(windows)}"
            )
        calibration = self._calibration
        was_calibrated = calibration.calibrated
        before_ms = calibration.slow_ms
        rank_changed = calibration.ingest(window_samples(windows, use_delivered))
        after_ms = calibration.slow_ms
        if rank_changed and before_ms is not None and after_ms is not None:
            self._tuner.carry_over(before_ms, after_ms)
        self._recompute(retarget=not was_calibrated or rank_changed, step_clamp=was_calibrated)
        self._tuner.stage(
            calibration.slow_ms,
            reduce_ms,
            calibration_count=calibration.count,
            cap_binding=self._counts.cap_binding,
        )
        self._counts.record()
        return self.batch_counts

    # --- counts -----------------------------------------------------------------------------

    def _recompute(self, *, retarget: bool, step_clamp: bool) -> None:
        """Move the counts toward the targets of the current anchor and timings."""
        calibration = self._calibration
        if calibration.slow_ms is None:
            retarget, step_clamp = True, False
        anchor_rank = calibration.anchor_rank
        self._counts.move_toward(
            speed_targets(self.anchor, calibration.smoothed_ms, anchor_rank),
            retarget=retarget,
            step_clamp=step_clamp,
            anchor_rank=anchor_rank,
        )

    def set_max_total_batches(self, max_total: int | None) -> None:
        """Cap the sum of the counts (the batches left in the epoch); None removes the cap.

        Above the cap the counts are scaled to ``floor(c * cap / sum)`` (>= 1) and the remainder
        goes to the largest count; :attr:`cap_binding` tells whether that happened. A lower cap
        applies at once; counts held down by an old cap grow back at the next report.

        Raises:
            ConfigError: max_total < 1.
        """
        self._counts.set_cap(max_total)

    # --- anchor: verdicts, nudges, relax-up ---------------------------------------------------

    def apply_verdict(self, verdict: Verdict) -> None:
        """Act on a guard's verdict for the round just reported.

        * Stable: commit the staged anchor (if any), then :meth:`relax_up` if enabled; while
          growth is latched, the 5th Stable verdict in a row re-arms it.
        * SuppressGrowth: discard the staged anchor and latch growth off.
        * NudgeDown(f): discard, latch, and :meth:`nudge_down` by f.
        """
        if self._tuner.judge(verdict):
            self._anchor_moved()
        if isinstance(verdict, Stable) and self._tuner.relax_up_on_stable:
            self.relax_up()
        elif isinstance(verdict, NudgeDown):
            self.nudge_down(verdict.factor)

    def nudge_down(self, factor: float) -> int:
        """Shrink the anchor to ``max(1, min(a, ceil(a * clamp(factor, 0.1, 1))))``; return it.

        May go below ``min_anchor``. A NaN factor changes nothing. Any staged growth is dropped.
        """
        if self._tuner.nudge_down(factor):
            self._anchor_moved()
        return self.anchor

    def relax_up(self) -> bool:
        """Grow the anchor by one if below ``max_anchor`` and the spread allows; True if grown.

        With ``max_batch_diff = M`` the step needs timing and
        ``round((a + 1) * max_ms / min_ms) - (a + 1) <= M``.
        """
        if not self._tuner.relax_up(self.smoothed_ms, self.max_batch_diff):
            return False
        self._anchor_moved()
        return True

    def _anchor_moved(self) -> None:
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
            self._calibration.check_rank(rank)
        new_index = {old: new for new, old in enumerate(keep)}

        state = self.state()
        state["world_size"] = len(keep)
        for key in ("samples", "misses", "batch_counts", "smoothed_ms"):
            state[key] = [state[key][old] for old in keep]
        state["history"] = [[row[old] for old in keep] for row in state["history"]]
        state["anchor_rank"] = new_index.get(self.anchor_rank, 0)
        state["staged_anchor"] = None

        successor = ElChe.from_state(state)
        if self.anchor_rank not in new_index:
            successor._calibration.elect_afresh()
        successor._recompute(retarget=True, step_clamp=False)
        return successor

    def add_rank(self) -> int:
        """Add a rank with no timing at the end; it runs ``anchor`` batches until timed.

        Returns its index. The window cap is re-applied.
        """
        self._calibration.add_rank()
        self._counts.add(self.anchor)
        return self.world_size - 1

    # --- checkpoints ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """A JSON-able snapshot from which :meth:`from_state` rebuilds an identical ElChe."""
        return {
            "version": STATE_VERSION,
            "world_size": self.world_size,
            **self._tuner.state(),
            **self._calibration.state(),
            **self._counts.state(),
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
        elche = cls(world_size)
        elche._tuner = AnchorTuner.from_state(d)
        elche._calibration = Calibration.from_state(d, world_size)
        elche._counts = Counts.from_state(d, world_size)
        return elche


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
