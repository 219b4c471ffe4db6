"""What a rank reads from its environment: :class:`WorkerConfig` and :meth:`WorkerConfig.from_env`.

The launcher (``flodl run``) sets the variables; a script started by hand must set them too.
Their names, defaults and parsing are :mod:`flodl.host.environment`'s (the one description of the
contract, shared with the launcher and ``flodl worker``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from flodl.averaging.dtypes import AVERAGE_DTYPE_NAMES
from flodl.averaging.outer import OuterSettings
from flodl.backends import BACKEND_NAMES
from flodl.core.common.policy import Policy
from flodl.errors import ConfigError
from flodl.host import environment as names
from flodl.host.environment import RankEnv, session_key_from_env


@attrs.frozen
class WorkerConfig:
    """Everything a rank needs to join a run. Validated on construction (ConfigError)."""

    coordinator: str
    session_key: bytes = attrs.field(repr=False)
    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    backend: str = "auto"
    policy: Policy = attrs.field(default=Policy.CADENCE, converter=Policy)
    heartbeat_timeout: float = 10.0
    heartbeat_interval: float = 1.0
    run_dir: Path = attrs.field(default=Path("."), converter=Path)
    seed: int = 0
    host: str | None = None
    """The address other ranks reach this one at; None: this host's address on its connection
    to the coordinator."""
    join_timeout: float = 300.0
    """Seconds to keep trying to reach the coordinator at the start (it may start later)."""
    op_timeout: float | None = None
    """None: ``max(30, 2 x heartbeat_timeout)`` (see :attr:`collective_timeout`)."""
    resume: Path | None = None
    debug_param_hashes: bool = False
    average_dtype: str = "fp32"
    """What rounds reduce in (``fp32``, ``bf16``, ``fp16``; :mod:`flodl.backends.compressed`);
    always the coordinator's, from its RunSettings, when the config was read from an
    environment."""
    outer: OuterSettings = attrs.field(factory=OuterSettings)
    """The outer optimizer (:mod:`flodl.averaging.outer`); always the coordinator's, from its
    RunSettings, when the config was read from an environment."""
    keep_checkpoints: int = 2
    """Bundles this rank keeps under ``<run_dir>/checkpoints/rank<N>/`` (older ones are pruned)."""
    given: frozenset[str] | None = None
    """Read from an environment (:meth:`from_env`): the settings it set. The coordinator's
    :class:`~flodl.wire.messages.RunSettings` fill in the others, and contradicting one is an
    error (:func:`flodl.worker.settings.adopt`). None (a config built in code): every value is
    the caller's and the coordinator's settings are not asked for."""

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"{names.WORLD_SIZE} must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"{names.RANK} {self.rank} is not in range({names.WORLD_SIZE}={self.world_size})"
            )
        if self.backend not in BACKEND_NAMES:
            raise ConfigError(f"backend must be one of {BACKEND_NAMES}, got {self.backend!r}")
        if self.average_dtype not in AVERAGE_DTYPE_NAMES:
            raise ConfigError(
                f"average_dtype must be one of {AVERAGE_DTYPE_NAMES}, got {self.average_dtype!r}"
            )
        if not self.heartbeat_timeout > 0 or not self.heartbeat_interval > 0:
            raise ConfigError("heartbeat interval and timeout must be > 0")
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ConfigError(
                f"{names.HEARTBEAT_INTERVAL} ({self.heartbeat_interval} s) must be below "
                f"{names.HEARTBEAT_TIMEOUT} ({self.heartbeat_timeout} s)"
            )
        if self.op_timeout is not None and not self.op_timeout > 0:
            raise ConfigError(f"op_timeout must be > 0, got {self.op_timeout}")
        if self.seed < 0:
            raise ConfigError(f"{names.SEED} must be >= 0, got {self.seed}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"{names.KEEP_CHECKPOINTS} must be >= 1, got {self.keep_checkpoints}")

    @property
    def collective_timeout(self) -> float:
        """Seconds after which a collective gives up by itself (the backend's per-op timeout)."""
        if self.op_timeout is not None:
            return self.op_timeout
        return max(30.0, 2.0 * self.heartbeat_timeout)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerConfig:
        """Read the configuration the launcher put in the environment (see the module doc).

        Raises ConfigError naming the variable that is missing or malformed.
        """
        env = os.environ if environ is None else environ
        given = RankEnv.from_env(env)
        key = session_key_from_env(env)
        # Unset variables leave this class's defaults in force.
        set_here: dict[str, Any] = {
            name: value
            for name, value in (
                ("backend", given.backend),
                ("policy", given.policy),
                ("heartbeat_timeout", given.heartbeat_timeout),
                ("heartbeat_interval", given.heartbeat_interval),
                ("run_dir", given.run_dir),
                ("seed", given.seed),
                ("host", given.host),
                ("join_timeout", given.join_timeout),
                ("keep_checkpoints", given.keep_checkpoints),
            )
            if value is not None
        }
        return cls(
            coordinator=given.coordinator,
            session_key=key,
            rank=given.rank,
            world_size=given.world_size,
            local_rank=given.rank if given.local_rank is None else given.local_rank,
            local_world_size=(
                given.world_size if given.local_world_size is None else given.local_world_size
            ),
            op_timeout=given.op_timeout,
            resume=given.resume,
            debug_param_hashes=given.debug_param_hashes,
            given=frozenset(set_here),
            **set_here,
        )
