"""Run settings: attrs classes with floDl's defaults, validated on construction.

Every setting has a default a user can run with; a value out of range raises
:class:`~flodl.errors.ConfigError` naming the setting. :meth:`CoordinatorConfig.machine_settings`
turns a config into the :class:`~flodl.core.coordinator.settings.MachineSettings` the coordinator
machine takes (core defines them and never imports this module). :func:`session_key_from_env` reads
the session key from the environment or a file, never from the command line.

The ``check_*`` functions validate what a user typed on the command line; their errors name the
flag, so ``flodl`` can refuse a bad value before any rank starts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs

from flodl.core.cadence.guards import GuardKind
from flodl.core.common.policy import Policy
from flodl.core.coordinator.cycle import default_reduce_stall_ceiling
from flodl.core.coordinator.liveness import MaxFailure
from flodl.core.coordinator.settings import (
    CadenceSettings,
    CheckpointSettings,
    MachineSettings,
    Timeouts,
)
from flodl.errors import ConfigError
from flodl.host.environment import session_key_from_env
from flodl.wire.handshake import check_session_key

__all__ = [
    "CoordinatorConfig",
    "check_at_least",
    "check_script",
    "check_seconds",
    "GuardKind",
    "MaxFailure",
    "Policy",
    "check_session_key",
    "session_key_from_env",
]


def _positive(_inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value!r}")


def _optional_positive(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"{attribute.name} must be > 0 or None, got {value!r}")


def _at_least_one(_inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{attribute.name} must be an integer >= 1, got {value!r}")


def _optional_at_least_one(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{attribute.name} must be an integer >= 1 or None, got {value!r}")


def _optional_non_negative_int(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ConfigError(f"{attribute.name} must be an integer >= 0 or None, got {value!r}")


def check_at_least(flag: str, value: int, low: int) -> int:
    """``value`` if it is an integer >= ``low``; ConfigError naming ``flag`` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{flag} must be an integer >= {low}, got {value!r}")
    return value


def check_seconds(flag: str, value: float) -> float:
    """``value`` if it is a finite number of seconds > 0; ConfigError naming ``flag``."""
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ConfigError(f"{flag} must be a number of seconds > 0, got {value!r}")
    return float(value)


def check_script(script: str | Path) -> Path:
    """The training script's path if it names an existing file; ConfigError otherwise."""
    path = Path(script)
    if not path.exists():
        raise ConfigError(f"script {str(script)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"script {str(script)!r} is not a file")
    return path


@attrs.frozen
class CoordinatorConfig:
    """Everything the coordinator decides by. Defaults follow floDl v0.7+ unless noted."""

    policy: Policy = attrs.field(default=Policy.CADENCE, converter=Policy)
    heartbeat_interval: float = attrs.field(default=1.0, validator=_positive)
    heartbeat_timeout: float = attrs.field(default=10.0, validator=_positive)
    """Seconds of silence after which a rank is dead (floDl: 30 s; 10 s here)."""
    handshake_timeout: float = attrs.field(default=10.0, validator=_positive)
    reduce_stall_ceiling: float | None = attrs.field(default=None, validator=_optional_positive)
    """None means ``max(10 x heartbeat_timeout, 300 s)``."""
    rendezvous_retry: float = attrs.field(default=5.0, validator=_positive)
    backend: str | None = attrs.field(default=None)
    """The ranks' backend (``auto``, ``gloo``, ``nccl``) sent to each worker; None: each rank's
    own (``flodl run`` tells its ranks itself)."""
    keep_checkpoints: int | None = attrs.field(default=None, validator=_optional_at_least_one)
    """Bundles each rank keeps, sent to each worker; None: each rank's own."""
    join_timeout: float = attrs.field(default=300.0, validator=_positive)
    """Seconds the coordinator waits for every rank to join; then it starts with those that
    did while ``min_ranks`` allows, else fails naming the missing ones. A worker retries
    connecting for as long (``flodl worker --join-timeout``)."""
    anchor: int = attrs.field(default=10, validator=_at_least_one)
    max_anchor: int = attrs.field(default=1000, validator=_at_least_one)
    overhead_target: float = attrs.field(default=0.05, validator=_positive)
    relax_up: bool = False
    """Cadence/Async: after every round the guard judges stable, grow the anchor by one batch
    (within ``max_anchor`` and, with ``max_batch_diff``, while the fastest rank's count stays
    within that of the anchor's), so windows lengthen while averaging keeps converging
    (floDl's opt-in for Async; off by default, as there). Not with ``policy="sync"``."""
    max_batch_diff: int | None = attrs.field(default=None, validator=_optional_non_negative_int)
    guard: GuardKind = attrs.field(default=GuardKind.TREND, converter=GuardKind)
    trend_threshold: float = attrs.field(default=0.05, validator=_positive)
    window_cap_epochs: float | None = attrs.field(default=1.0, validator=_optional_positive)
    """A window holds at most this many epochs' batches (floDl: 1). None: no cap. Raise it for
    small data sets, where one epoch is too short to amortise an averaging round."""
    fill_idle_ranks: bool = True
    """Cadence: a rank that has run its count while others still work is given the batches that
    fit in the time they still need, rather than waiting at the barrier (beyond floDl, whose
    fast ranks wait; see flodl/core/coordinator/fill.py). Not with ``max_batch_diff``."""
    max_failure: MaxFailure | None = None
    collective: bool = True
    """True for gloo/nccl groups: fewer than 2 survivors cannot average (SingleSurvivor)."""
    min_ranks: int | None = attrs.field(default=None, validator=_optional_at_least_one)
    """A rank that dies before the world joined (and is not restarted): the run starts with
    the others while at least this many remain (None: 2 for a collective group, else 1)."""
    checkpoint_every: int | None = attrs.field(default=None, validator=_optional_at_least_one)
    """The lowest live rank saves a bundle every this many averaging rounds (None: never)."""
    checkpoint_every_epochs: int | None = attrs.field(
        default=None, validator=_optional_at_least_one
    )
    """The lowest live rank saves a bundle once this many more epochs are done (None: never)."""

    def __attrs_post_init__(self) -> None:
        if self.max_anchor < self.anchor:
            raise ConfigError(f"max_anchor ({self.max_anchor}) < anchor ({self.anchor})")
        if self.relax_up and self.policy is Policy.SYNC:
            raise ConfigError("relax_up grows cadence windows; policy sync has none")
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ConfigError(
                f"heartbeat_interval ({self.heartbeat_interval} s) must be below "
                f"heartbeat_timeout ({self.heartbeat_timeout} s)"
            )

    @property
    def stall_ceiling(self) -> float:
        """The reduce-stall ceiling in force (the setting, or its default)."""
        if self.reduce_stall_ceiling is not None:
            return self.reduce_stall_ceiling
        return default_reduce_stall_ceiling(self.heartbeat_timeout)

    @property
    def window_wait_ceiling(self) -> float:
        """Ceiling of the window-completion wait: heartbeat timeout + 2 s."""
        return self.heartbeat_timeout + 2.0

    def machine_settings(self) -> MachineSettings:
        """What the coordinator machine decides by, with every default resolved."""
        return MachineSettings(
            policy=self.policy,
            cadence=CadenceSettings(
                anchor=self.anchor,
                max_anchor=self.max_anchor,
                overhead_target=self.overhead_target,
                max_batch_diff=self.max_batch_diff,
                relax_up=self.relax_up,
                window_cap_epochs=self.window_cap_epochs,
                fill_idle_ranks=self.fill_idle_ranks,
            ),
            timeouts=Timeouts(
                heartbeat=self.heartbeat_timeout,
                reduce_stall=self.stall_ceiling,
                rendezvous_retry=self.rendezvous_retry,
                window_wait=self.window_wait_ceiling,
                join=self.join_timeout,
            ),
            checkpoints=CheckpointSettings(
                every_rounds=self.checkpoint_every, every_epochs=self.checkpoint_every_epochs
            ),
            guard=self.guard,
            trend_threshold=self.trend_threshold,
            max_failure=self.max_failure,
            collective=self.collective,
            min_ranks=self.min_ranks,
        )
