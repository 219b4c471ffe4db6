"""The settings the coordinator machine decides by: :class:`MachineSettings`.

These are the machine's inputs, not the user's: every value is already checked and every
default already resolved (the reduce-stall ceiling is a number of seconds, not "default").
Users set them through :class:`flodl.config.CoordinatorConfig`, which validates what it is
given and builds these with ``CoordinatorConfig.machine_settings()``; the coordinator shell
hands them to :class:`~flodl.core.coordinator.machine.CoordinatorMachine`. Core defines them so that
it depends on nothing outside itself (the arrows point from the shells and the config into core,
never back).

All three are frozen attrs classes with keyword-only fields and no defaults, so a value can
only come from the one place that chooses it.
"""

from __future__ import annotations

import attrs

from flodl.core.cadence.guards import GuardKind
from flodl.core.common.policy import Policy
from flodl.core.coordinator.liveness import MaxFailure

__all__ = ["CadenceSettings", "CheckpointSettings", "MachineSettings", "Timeouts"]


@attrs.frozen(kw_only=True)
class CadenceSettings:
    """How ElChe sizes the windows between two averages (see :mod:`flodl.core.cadence.elche`)."""

    anchor: int
    """Batches the slowest rank runs per window to begin with (and auto-tune's floor)."""
    max_anchor: int
    """The anchor never grows above this."""
    overhead_target: float
    """Share of a window spent averaging above which auto-tune proposes a larger anchor."""
    max_batch_diff: int | None
    """Throttle ranks this many batches ahead of the slowest; bound on a count's step."""
    relax_up: bool
    """Grow the anchor by one after every Stable verdict."""
    window_cap_epochs: float | None
    """A window holds at most this many epochs' batches (None: no cap)."""
    window_cap_s: float | None
    """A window takes each rank at most this many seconds at its measured speed (None: no
    cap)."""
    fill_idle_ranks: bool
    """Cadence: hand a rank that ran its count the batches that fit while others still work."""


@attrs.frozen(kw_only=True)
class Timeouts:
    """How long the machine waits for each thing before it acts, in seconds."""

    heartbeat: float
    """Silence after which a rank is dead."""
    reduce_stall: float
    """An unacknowledged round past this saves the run (ShutdownWithSave(REDUCE_STALL))."""
    rendezvous_retry: float
    """A silent group generator is replaced after this."""
    window_wait: float
    """Cadence: longest wait for the completion frames of a window before the round starts."""
    join: float = 300.0
    """The world must have joined this long after the coordinator started: then the run
    starts with the ranks that did, if ``min_ranks`` allows, or fails naming the missing."""


@attrs.frozen(kw_only=True)
class CheckpointSettings:
    """When ranks save during the run (see :mod:`flodl.core.coordinator.saves`); None: never on a
    schedule."""

    every_rounds: int | None
    """The lowest live member saves every this many settled averaging rounds."""
    every_epochs: int | None
    """The lowest live member saves once this many more epochs are done."""


@attrs.frozen(kw_only=True)
class MachineSettings:
    """Everything :class:`~flodl.core.coordinator.machine.CoordinatorMachine` reads besides its
    events."""

    policy: Policy
    cadence: CadenceSettings
    timeouts: Timeouts
    checkpoints: CheckpointSettings
    guard: GuardKind
    trend_threshold: float
    """TrendGuard's threshold (read by the trend guard only)."""
    max_failure: MaxFailure | None
    """Failures that end the run with a save (None: only the backend's limits)."""
    collective: bool
    """True for gloo/nccl groups: fewer than 2 survivors cannot average (SingleSurvivor)."""
    min_ranks: int | None
    """Ranks dying before the world joined: the run starts without them while at least this
    many can still join (None: the SingleSurvivor rule, 2 for a collective group, else 1)."""
    max_time: float | None
    """Seconds of training (from the first group formed) after which the training stops and
    the run ends after a last round (None: no budget)."""
