"""What a rank reads from its environment: :class:`WorkerConfig` and :meth:`WorkerConfig.from_env`.

The launcher (``flodl run``) sets these variables; a script started by hand must set them too:

=========================== ==============================================================
``FLODL_COORDINATOR``       where the coordinator listens (``tcp://host:port``, ``unix:///p``)
``FLODL_SESSION_KEY``       session key, hex (or ``FLODL_SESSION_KEY_FILE``: a file holding it)
``RANK``, ``WORLD_SIZE``    this rank's id and the number of ranks (torchrun style)
``LOCAL_RANK``              rank on this host (default: ``RANK``); nccl uses GPU ``LOCAL_RANK``
``LOCAL_WORLD_SIZE``        ranks on this host (default: ``WORLD_SIZE``)
``FLODL_BACKEND``           ``auto`` (default), ``gloo`` or ``nccl``
``FLODL_POLICY``            ``sync``, ``cadence`` (default) or ``async``
``FLODL_HEARTBEAT_TIMEOUT`` seconds of coordinator silence before this rank gives up (10)
``FLODL_HEARTBEAT_INTERVAL`` seconds between this rank's heartbeats (1)
``FLODL_RUN_DIR``           directory for this rank's files (default: the working directory)
``FLODL_SEED``              seed of the shared epoch order (0)
``FLODL_HOST``              address other ranks reach this one at (``127.0.0.1``)
``FLODL_OP_TIMEOUT``        seconds after which a collective gives up by itself
                            (default: ``max(30, 2 x heartbeat timeout)``)
``FLODL_RESUME``            a checkpoint bundle to resume from (optional)
``FLODL_DEBUG_PARAM_HASHES`` ``1``: record a sha256 of the parameters after every average
=========================== ==============================================================
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

import attrs

from flodl.backends import BACKEND_NAMES
from flodl.config import session_key_from_env
from flodl.core.cycle import Policy
from flodl.errors import ConfigError

_LAUNCHER_HINT = "start the script with `flodl run`, which sets it"


def _require(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise ConfigError(f"{name} is not set; {_LAUNCHER_HINT}")
    return value


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        if default is None:
            raise ConfigError(f"{name} is not set; {_LAUNCHER_HINT}")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be > 0 seconds, got {raw!r}")
    return value


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = env.get(name, "").strip().lower() or default
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name} must be 0 or 1, got {raw!r}")


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
    host: str = "127.0.0.1"
    op_timeout: float | None = None
    """None: ``max(30, 2 x heartbeat_timeout)`` (see :attr:`collective_timeout`)."""
    resume: Path | None = None
    debug_param_hashes: bool = False

    def __attrs_post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"WORLD_SIZE must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK {self.rank} is not in range(WORLD_SIZE={self.world_size})")
        if self.backend not in BACKEND_NAMES:
            raise ConfigError(f"backend must be one of {BACKEND_NAMES}, got {self.backend!r}")
        if not self.heartbeat_timeout > 0 or not self.heartbeat_interval > 0:
            raise ConfigError("heartbeat interval and timeout must be > 0")
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ConfigError(
                f"FLODL_HEARTBEAT_INTERVAL ({self.heartbeat_interval} s) must be below "
                f"FLODL_HEARTBEAT_TIMEOUT ({self.heartbeat_timeout} s)"
            )
        if self.op_timeout is not None and not self.op_timeout > 0:
            raise ConfigError(f"op_timeout must be > 0, got {self.op_timeout}")
        if self.seed < 0:
            raise ConfigError(f"FLODL_SEED must be >= 0, got {self.seed}")

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
        coordinator = _require(env, "FLODL_COORDINATOR")
        key = session_key_from_env(dict(env))
        rank = _int(env, "RANK")
        world_size = _int(env, "WORLD_SIZE")
        resume = env.get("FLODL_RESUME", "").strip()
        op_timeout = env.get("FLODL_OP_TIMEOUT", "").strip()
        return cls(
            coordinator=coordinator,
            session_key=key,
            rank=rank,
            world_size=world_size,
            local_rank=_int(env, "LOCAL_RANK", rank),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world_size),
            backend=_choice(env, "FLODL_BACKEND", "auto", BACKEND_NAMES),
            policy=Policy(_choice(env, "FLODL_POLICY", "cadence", tuple(p.value for p in Policy))),
            heartbeat_timeout=_seconds(env, "FLODL_HEARTBEAT_TIMEOUT", 10.0),
            heartbeat_interval=_seconds(env, "FLODL_HEARTBEAT_INTERVAL", 1.0),
            run_dir=Path(env.get("FLODL_RUN_DIR", "").strip() or "."),
            seed=_int(env, "FLODL_SEED", 0),
            host=env.get("FLODL_HOST", "").strip() or "127.0.0.1",
            op_timeout=_seconds(env, "FLODL_OP_TIMEOUT", 1.0) if op_timeout else None,
            resume=Path(resume) if resume else None,
            debug_param_hashes=_flag(env, "FLODL_DEBUG_PARAM_HASHES"),
        )
