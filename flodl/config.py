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

import functools
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from flodl.averaging.dtypes import AVERAGE_DTYPE_NAMES
from flodl.averaging.outer import OuterKind, OuterSettings, check_outer
from flodl.core.cadence.guards import GuardKind
from flodl.core.common.policy import Policy
from flodl.core.coordinator.liveness import MaxFailure
from flodl.core.coordinator.settings import (
    CadenceSettings,
    CheckpointSettings,
    MachineSettings,
    Timeouts,
)
from flodl.core.coordinator.stall import default_reduce_stall_ceiling
from flodl.errors import ConfigError, FlodlError
from flodl.host.environment import session_key_from_env
from flodl.transports.url import parse_url
from flodl.wire.handshake import check_session_key

__all__ = [
    "CoordinatorConfig",
    "Flag",
    "at_least",
    "check_positive",
    "coordinator_config_from",
    "described",
    "flagged_settings",
    "optional",
    "setting",
    "check_at_least",
    "check_script",
    "check_seconds",
    "GuardKind",
    "MaxFailure",
    "Policy",
    "check_session_key",
    "session_key_from_env",
]


Check = Callable[[str, Any], object]
"""A rule for one setting's value: takes the name to blame (the setting's, or the flag a user
typed) and the value; raises ConfigError naming it when the value breaks the rule."""


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


def check_positive(flag: str, value: float) -> float:
    """``value`` if it is a finite number > 0; ConfigError naming ``flag``."""
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ConfigError(f"{flag} must be a number > 0, got {value!r}")
    return float(value)


def at_least(low: int) -> Check:
    """The rule "an integer >= ``low``"."""
    return functools.partial(_at_least, low=low)


def _at_least(flag: str, value: int, low: int) -> int:
    return check_at_least(flag, value, low)


def optional(check: Check) -> Check:
    """``check``, with None (the setting's "not set") allowed."""

    def check_unless_none(flag: str, value: Any) -> None:
        if value is not None:
            check(flag, value)

    return check_unless_none


def check_fraction(flag: str, value: float) -> float:
    """``value`` if it is a number in [0, 1); ConfigError naming ``flag``."""
    if not (isinstance(value, int | float) and 0.0 <= value < 1.0):
        raise ConfigError(f"{flag} must be a number in [0, 1), got {value!r}")
    return float(value)


OUTER_KINDS = tuple(kind.value for kind in OuterKind)


def check_outer_kind(flag: str, value: str) -> str:
    """``value`` if it names an outer optimizer; ConfigError naming ``flag``."""
    if value not in OUTER_KINDS:
        raise ConfigError(f"{flag} must be one of {', '.join(OUTER_KINDS)}, got {value!r}")
    return value


def check_average_dtype(flag: str, value: str) -> str:
    """``value`` if it names a dtype rounds can reduce in; ConfigError naming ``flag``."""
    if value not in AVERAGE_DTYPE_NAMES:
        names = ", ".join(AVERAGE_DTYPE_NAMES)
        raise ConfigError(f"{flag} must be one of {names}, got {value!r}")
    return value


def check_url(flag: str, url: str) -> None:
    """ConfigError naming ``flag`` unless ``url`` is an address flodl can listen on or reach."""
    try:
        parse_url(url)
    except FlodlError as err:
        raise ConfigError(f"{flag}: {err}") from None


def check_port(flag: str, value: int) -> int:
    """``value`` if it is a TCP port (1..65535); ConfigError naming ``flag``."""
    if not 1 <= value <= 65535:
        raise ConfigError(f"{flag} must be 1..65535, got {value}")
    return value


def check_host(flag: str, value: str | None) -> None:
    """ConfigError naming ``flag`` for an address given but empty (None: not given)."""
    if value is not None and not value.strip():
        raise ConfigError(f"{flag} must not be empty")


def check_script(script: str | Path) -> Path:
    """The training script's path if it names an existing file; ConfigError otherwise."""
    path = Path(script)
    if not path.exists():
        raise ConfigError(f"script {str(script)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"script {str(script)!r} is not a file")
    return path


@attrs.frozen
class Flag:
    """How a setting is typed on the command line of ``flodl run`` and ``flodl coordinator``.

    The flag, its parsing, its check and its default come from the one declaration of the
    setting in :class:`CoordinatorConfig` (:func:`setting`); ``flodl.cli`` adds every flagged
    setting to its parsers and builds the config from what was typed
    (:func:`coordinator_config_from`), so a setting is written down once.
    """

    name: str
    parse: Callable[[str], Any] | None = float
    """Turns the typed text into the value; None: a switch (``store_true``)."""
    metavar: str | None = None
    help: str | None = None
    choices: tuple[str, ...] | None = None


FLAG = "flodl.flag"
CHECK = "flodl.check"


def described(check: Check | None = None, flag: Flag | None = None) -> dict[str, Any]:
    """The metadata of a setting: its rule and its flag."""
    return {CHECK: check, FLAG: flag}


def setting(default: Any, check: Check | None = None, *, flag: Flag | None = None) -> Any:
    """A field of :class:`CoordinatorConfig`: its default, the rule its value must keep
    (checked on construction, naming the setting), and its flag if users type it."""

    def validate(_inst: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if check is not None:
            check(attribute.name, value)

    return attrs.field(default=default, validator=validate, metadata=described(check, flag))


@attrs.frozen
class CoordinatorConfig:
    """Everything the coordinator decides by. Defaults follow floDl v0.7+ unless noted."""

    # A converter must reach attrs.field directly for type checkers to see it.
    policy: Policy = attrs.field(
        default=Policy.CADENCE,
        converter=Policy,
        metadata=described(flag=Flag("--policy", str, choices=tuple(p.value for p in Policy))),
    )
    heartbeat_interval: float = setting(1.0, check_seconds)
    """Seconds between heartbeats each way (``flodl`` derives it: min(1 s, timeout / 4))."""
    heartbeat_timeout: float = setting(
        10.0, check_seconds, flag=Flag("--heartbeat-timeout", metavar="S")
    )
    """Seconds of silence after which a rank is dead (floDl: 30 s; 10 s here)."""
    handshake_timeout: float = setting(10.0, check_seconds)
    reduce_stall_ceiling: float | None = setting(
        None,
        optional(check_seconds),
        flag=Flag(
            "--stall-ceiling",
            metavar="S",
            help="save the run when an averaging round is unacknowledged this long after "
            "every member joined its group (default: max(10 x heartbeat timeout, 300 s))",
        ),
    )
    """None means ``max(10 x heartbeat_timeout, 300 s)``; counted from when every member joined
    the round's group generation."""
    rendezvous_retry: float = setting(5.0, check_seconds)
    backend: str | None = setting(None)
    """The ranks' backend (``auto``, ``gloo``, ``nccl``) sent to each worker; None: each rank's
    own (``flodl run`` tells its ranks itself)."""
    keep_checkpoints: int | None = setting(None, optional(at_least(1)))
    """Bundles each rank keeps, sent to each worker; None: each rank's own."""
    join_timeout: float = setting(
        300.0,
        check_seconds,
        flag=Flag(
            "--join-timeout",
            metavar="S",
            help="wait this long for every rank to join; then start with those that did while "
            "--min-ranks allows, else fail naming the missing ranks (default 300)",
        ),
    )
    """Seconds the coordinator waits for every rank to join; then it starts with those that
    did while ``min_ranks`` allows, else fails naming the missing ones. A worker retries
    connecting for as long (``flodl worker --join-timeout``)."""
    anchor: int = setting(10, at_least(1), flag=Flag("--anchor", int))
    max_anchor: int = setting(
        1000,
        at_least(1),
        flag=Flag(
            "--max-anchor",
            int,
            metavar="N",
            help="cadence/async: the anchor (the slowest rank's batches per window) never grows "
            "above N (default: 1000, or --anchor when that is larger)",
        ),
    )
    """The anchor never grows above this (``flodl`` with no ``--max-anchor``: max(1000,
    anchor))."""
    overhead_target: float = setting(0.05, check_positive)
    relax_up: bool = setting(
        False,
        flag=Flag(
            "--relax-up",
            None,
            help="cadence/async: grow the anchor by one after every round the guard finds stable",
        ),
    )
    """Cadence/Async: after every round the guard judges stable, grow the anchor by one batch
    (within ``max_anchor`` and, with ``max_batch_diff``, while the fastest rank's count stays
    within that of the anchor's), so windows lengthen while averaging keeps converging
    (floDl's opt-in for Async; off by default, as there). Not with ``policy="sync"``."""
    max_batch_diff: int | None = setting(
        None, optional(at_least(0)), flag=Flag("--max-batch-diff", int)
    )
    guard: GuardKind = attrs.field(
        default=GuardKind.TREND, converter=GuardKind, metadata=described()
    )
    trend_threshold: float = setting(0.05, check_positive)
    window_cap_epochs: float | None = setting(
        1.0,
        optional(check_positive),
        flag=Flag(
            "--window-cap-epochs",
            help="a window holds at most this many epochs' batches (default 1, as floDl)",
        ),
    )
    """A window holds at most this many epochs' batches (floDl: 1). None: no cap. Raise it for
    small data sets, where one epoch is too short to amortise an averaging round."""
    window_cap_s: float | None = setting(
        None,
        optional(check_seconds),
        flag=Flag(
            "--window-cap-s",
            float,
            metavar="S",
            help="cadence/async: no rank's window takes longer than S seconds at its measured "
            "speed (its count is trimmed), so rounds come at least every S seconds",
        ),
    )
    """Each rank's count is trimmed so its window takes at most this many seconds at its
    measured speed (None: no cap): a bound on how long ranks train apart."""
    fill_idle_ranks: bool = setting(True)
    """Cadence: a rank that has run its count while others still work is given the batches that
    fit in the time they still need, rather than waiting at the barrier (beyond floDl, whose
    fast ranks wait; see flodl/core/coordinator/fill.py). Not with ``max_batch_diff``."""
    max_failure: MaxFailure | None = setting(None)
    collective: bool = setting(True)
    """True for gloo/nccl groups: fewer than 2 survivors cannot average (SingleSurvivor)."""
    min_ranks: int | None = setting(
        None,
        optional(at_least(1)),
        flag=Flag(
            "--min-ranks",
            int,
            metavar="N",
            help="ranks that die before joining (not restarted): start without them while N "
            "remain (default: 2 with a collective group, the SingleSurvivor rule)",
        ),
    )
    """A rank that dies before the world joined (and is not restarted): the run starts with
    the others while at least this many remain (None: 2 for a collective group, else 1)."""
    checkpoint_every: int | None = setting(
        None,
        optional(at_least(1)),
        flag=Flag(
            "--checkpoint-every",
            int,
            metavar="N",
            help="rank 0 (the lowest live rank) saves a bundle every N averaging rounds",
        ),
    )
    """The lowest live rank saves a bundle every this many averaging rounds (None: never)."""
    checkpoint_every_epochs: int | None = setting(
        None,
        optional(at_least(1)),
        flag=Flag(
            "--checkpoint-every-epochs",
            int,
            metavar="N",
            help="rank 0 (the lowest live rank) saves a bundle every N epochs",
        ),
    )
    """The lowest live rank saves a bundle once this many more epochs are done (None: never)."""
    max_time: float | None = setting(
        None,
        optional(check_seconds),
        flag=Flag(
            "--max-time",
            float,
            metavar="S",
            help="stop the training after S seconds of it (from the first group formed): "
            "nothing more is handed out, a last round averages what was trained, and the run "
            "completes with one model",
        ),
    )
    """Seconds of training after which the run stops as ``rank.stop()`` does (None: none)."""
    average_dtype: str = setting(
        "fp32",
        check_average_dtype,
        flag=Flag(
            "--average-dtype",
            str,
            metavar="{" + ",".join(AVERAGE_DTYPE_NAMES) + "}",
            help="reduce each round's moves in 16 bits (bf16, fp16: half the bytes of a "
            "round) or in full precision (fp32, the default); sync and cadence only",
        ),
    )
    """``bf16``/``fp16``: a round sends each rank's moves since the last round in 16 bits
    (:mod:`flodl.backends.compressed`); costs one more copy of the parameters per rank."""
    outer: str = setting(
        "sgd",
        check_outer_kind,
        flag=Flag(
            "--outer",
            str,
            metavar="{" + ",".join(OUTER_KINDS) + "}",
            help="the outer optimizer each round's average goes through: sgd (a step of "
            "--outer-lr along the ranks' common move, the default), nesterov (DiLoCo) or none "
            "(plain averaging)",
        ),
    )
    """The outer optimizer (:mod:`flodl.averaging.outer`): ``sgd`` continues from a point
    ``outer_lr`` times the ranks' common move since the last round (1.5: past the average;
    one copy of the parameters per rank); ``nesterov`` applies Nesterov SGD to that move
    (DiLoCo; two copies); ``none`` continues from each round's average."""
    outer_lr: float | None = setting(
        None,
        optional(check_positive),
        flag=Flag(
            "--outer-lr",
            metavar="LR",
            help="the outer optimizer's learning rate (sgd 1.5, nesterov 0.7)",
        ),
    )
    """None: the kind's (:data:`flodl.averaging.outer.KIND_DEFAULTS`)."""
    outer_momentum: float | None = setting(
        None,
        optional(check_fraction),
        flag=Flag(
            "--outer-momentum",
            metavar="MU",
            help="the outer optimizer's momentum, in [0, 1) (nesterov 0.9; sgd takes none)",
        ),
    )
    """None: the kind's (:data:`flodl.averaging.outer.KIND_DEFAULTS`)."""

    def __attrs_post_init__(self) -> None:
        self.outer_settings()  # refuses a kind, lr and momentum that do not go together
        if self.average_dtype != "fp32" and self.policy is Policy.ASYNC:
            raise ConfigError(
                f"average_dtype {self.average_dtype} needs policy sync or cadence (async "
                "rounds blend a snapshot, which compressed rounds do not take)"
            )
        if self.max_anchor < self.anchor:
            raise ConfigError(f"max_anchor ({self.max_anchor}) < anchor ({self.anchor})")
        if self.relax_up and self.policy is Policy.SYNC:
            raise ConfigError("relax_up grows cadence windows; policy sync has none")
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ConfigError(
                f"heartbeat_interval ({self.heartbeat_interval} s) must be below "
                f"heartbeat_timeout ({self.heartbeat_timeout} s)"
            )

    def outer_settings(self) -> OuterSettings:
        """The outer optimizer in force, with the kind's defaults where none was given."""
        return OuterSettings.of(self.outer, self.outer_lr, self.outer_momentum)

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
        """What the coordinator machine decides by, with every default resolved.

        Fields the machine's settings share with this class by name are copied by name; the
        timeouts and checkpoint schedule are named for what the machine does with them.
        """
        return MachineSettings(
            **self._same_named(MachineSettings, skip=("cadence", "timeouts", "checkpoints")),
            cadence=CadenceSettings(**self._same_named(CadenceSettings)),
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
        )

    def _same_named(self, target: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        names = [field.name for field in attrs.fields(target) if field.name not in skip]
        return {name: getattr(self, name) for name in names}


def flagged_settings() -> list[tuple[attrs.Attribute[Any], Flag]]:
    """The settings of :class:`CoordinatorConfig` a user types as flags, in declaration order."""
    fields = attrs.fields(CoordinatorConfig)
    return [(field, field.metadata[FLAG]) for field in fields if field.metadata.get(FLAG)]


def coordinator_config_from(options: Mapping[str, Any], **others: Any) -> CoordinatorConfig:
    """A :class:`CoordinatorConfig` from typed flags: ``options`` maps each flagged setting's
    name to its value (an argparse namespace's ``vars``). Each value is checked first, so a
    bad one is refused by the flag's name; ``heartbeat_interval`` and ``max_anchor`` are
    derived from what was typed; ``others`` are further settings as they are."""
    values: dict[str, Any] = {}
    for field, flag in flagged_settings():
        value = options[field.name]
        check = field.metadata[CHECK]
        if check is not None:
            check(flag.name, value)
        values[field.name] = value
    outer = OuterSettings.of(values["outer"], None, None)
    check_outer(
        outer.kind.value,
        outer.lr if values["outer_lr"] is None else values["outer_lr"],
        outer.momentum if values["outer_momentum"] is None else values["outer_momentum"],
        ("--outer", "--outer-lr", "--outer-momentum"),
    )
    timeout, anchor = values["heartbeat_timeout"], values["anchor"]
    default_max = attrs.fields(CoordinatorConfig).max_anchor.default
    if values["max_anchor"] == default_max:
        values["max_anchor"] = max(default_max, anchor)
    elif values["max_anchor"] < anchor:
        raise ConfigError(f"--max-anchor ({values['max_anchor']}) must be >= --anchor ({anchor})")
    return CoordinatorConfig(**values, heartbeat_interval=min(1.0, timeout / 4), **others)
