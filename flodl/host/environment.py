"""The environment a rank is started with: every variable's name, how it is written, how it is read.

``flodl run`` (:mod:`flodl.launch.launcher`) and ``flodl worker`` (:mod:`flodl.cli`) write it with
:meth:`RankEnv.variables`; the rank reads it with :meth:`RankEnv.from_env` (through
:meth:`flodl.worker.config.WorkerConfig.from_env`, which also reads the session key with
:func:`session_key_from_env`). A script started by hand must set the same variables:

============================ =============================================================
``FLODL_COORDINATOR``        where the coordinator listens (``tcp://host:port``, ``unix:///p``)
``FLODL_SESSION_KEY``        session key, hex (or ``FLODL_SESSION_KEY_FILE``: a file holding it)
``RANK``, ``WORLD_SIZE``     this rank's id and the number of ranks (torchrun style)
``LOCAL_RANK``               rank on this host (default: ``RANK``); nccl uses GPU ``LOCAL_RANK``
``LOCAL_WORLD_SIZE``         ranks on this host (default: ``WORLD_SIZE``)
``MASTER_ADDR``,             torchrun's rendezvous address, written by ``flodl run`` for
``MASTER_PORT``              scripts that read it (flodl does not read them back)
``FLODL_BACKEND``            ``auto`` (default), ``gloo`` or ``nccl``
``FLODL_POLICY``             ``sync``, ``cadence`` (default) or ``async``
``FLODL_HEARTBEAT_TIMEOUT``  seconds of coordinator silence before this rank gives up (10)
``FLODL_HEARTBEAT_INTERVAL`` seconds between this rank's heartbeats (1)
``FLODL_RUN_DIR``            directory for this rank's files (default: the working directory)
``FLODL_SEED``               seed of the shared epoch order (0)
``FLODL_HOST``               address other ranks reach this one at (default: this host's
                             address on its connection to the coordinator)
``FLODL_JOIN_TIMEOUT``       seconds to keep trying to reach the coordinator at the start (300)
``FLODL_OP_TIMEOUT``         seconds after which a collective gives up by itself
                             (default: ``max(30, 2 x heartbeat timeout)``)
``FLODL_RESUME``             a checkpoint bundle to resume from (optional)
``FLODL_DEBUG_PARAM_HASHES`` ``1``: record a sha256 of the parameters after every average
``FLODL_KEEP_CHECKPOINTS``   bundles this rank keeps in its checkpoint folder (2)
============================ =============================================================

Reading strips white space and treats an empty variable as unset. Every malformed value
raises :class:`~flodl.errors.ConfigError` naming its variable. The defaults in the table are
:class:`~flodl.worker.config.WorkerConfig`'s: :class:`RankEnv` holds None for what the
environment leaves unset, and writes only what is set.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from flodl.backends import BACKEND_NAMES
from flodl.core.common.policy import Policy
from flodl.errors import ConfigError
from flodl.wire.handshake import check_session_key

if TYPE_CHECKING:
    from flodl.host.torchrun_env import TorchrunLayout

__all__ = [
    "BACKEND",
    "COORDINATOR",
    "DEBUG_PARAM_HASHES",
    "HEARTBEAT_INTERVAL",
    "HEARTBEAT_TIMEOUT",
    "HOST",
    "JOIN_TIMEOUT",
    "KEEP_CHECKPOINTS",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OP_TIMEOUT",
    "POLICY",
    "RANK",
    "RESUME",
    "RUN_DIR",
    "SEED",
    "SESSION_KEY",
    "SESSION_KEY_FILE",
    "WORLD_SIZE",
    "RankEnv",
    "session_key_from_env",
]

COORDINATOR = "FLODL_COORDINATOR"
SESSION_KEY = "FLODL_SESSION_KEY"
SESSION_KEY_FILE = "FLODL_SESSION_KEY_FILE"
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
BACKEND = "FLODL_BACKEND"
POLICY = "FLODL_POLICY"
HEARTBEAT_TIMEOUT = "FLODL_HEARTBEAT_TIMEOUT"
HEARTBEAT_INTERVAL = "FLODL_HEARTBEAT_INTERVAL"
RUN_DIR = "FLODL_RUN_DIR"
SEED = "FLODL_SEED"
HOST = "FLODL_HOST"
JOIN_TIMEOUT = "FLODL_JOIN_TIMEOUT"
OP_TIMEOUT = "FLODL_OP_TIMEOUT"
RESUME = "FLODL_RESUME"
DEBUG_PARAM_HASHES = "FLODL_DEBUG_PARAM_HASHES"
KEEP_CHECKPOINTS = "FLODL_KEEP_CHECKPOINTS"

_LAUNCHER_HINT = "start the script with `flodl run`, which sets it"


@attrs.frozen(kw_only=True)
class RankEnv:
    """What a rank's environment says (None: the variable is unset)."""

    coordinator: str
    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    session_key_file: Path | None = None
    """Written by the launcher (the key itself never is); read by :func:`session_key_from_env`."""
    master_addr: str | None = None
    """Written only (for scripts that read torchrun's variables); :meth:`from_env` leaves it."""
    master_port: int | None = None
    """Written only, as ``master_addr``."""
    backend: str | None = None
    policy: Policy | None = None
    heartbeat_timeout: float | None = None
    heartbeat_interval: float | None = None
    run_dir: Path | None = None
    seed: int | None = None
    host: str | None = None
    join_timeout: float | None = None
    op_timeout: float | None = None
    resume: Path | None = None
    debug_param_hashes: bool = False
    keep_checkpoints: int | None = None

    def variables(self) -> dict[str, str]:
        """The variables to set for this rank: one per field that is set."""
        values: dict[str, object] = {
            COORDINATOR: self.coordinator,
            RANK: self.rank,
            WORLD_SIZE: self.world_size,
            LOCAL_RANK: self.local_rank,
            LOCAL_WORLD_SIZE: self.local_world_size,
            SESSION_KEY_FILE: self.session_key_file,
            MASTER_ADDR: self.master_addr,
            MASTER_PORT: self.master_port,
            BACKEND: self.backend,
            POLICY: None if self.policy is None else self.policy.value,
            HEARTBEAT_TIMEOUT: self.heartbeat_timeout,
            HEARTBEAT_INTERVAL: self.heartbeat_interval,
            RUN_DIR: self.run_dir,
            SEED: self.seed,
            HOST: self.host,
            JOIN_TIMEOUT: self.join_timeout,
            OP_TIMEOUT: self.op_timeout,
            RESUME: self.resume,
            DEBUG_PARAM_HASHES: "1" if self.debug_param_hashes else None,
            KEEP_CHECKPOINTS: self.keep_checkpoints,
        }
        return {name: str(value) for name, value in values.items() if value is not None}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RankEnv:
        """Parse ``env``; ConfigError naming the variable that is missing or malformed."""
        coordinator = _text(env, COORDINATOR)
        if coordinator is None:
            raise ConfigError(f"{COORDINATOR} is not set; {_LAUNCHER_HINT}")
        policy = _choice(env, POLICY, tuple(p.value for p in Policy))
        return cls(
            coordinator=coordinator,
            rank=_required_int(env, RANK),
            world_size=_required_int(env, WORLD_SIZE),
            local_rank=_int(env, LOCAL_RANK),
            local_world_size=_int(env, LOCAL_WORLD_SIZE),
            session_key_file=_path(env, SESSION_KEY_FILE),
            backend=_choice(env, BACKEND, BACKEND_NAMES),
            policy=None if policy is None else Policy(policy),
            heartbeat_timeout=_seconds(env, HEARTBEAT_TIMEOUT),
            heartbeat_interval=_seconds(env, HEARTBEAT_INTERVAL),
            run_dir=_path(env, RUN_DIR),
            seed=_int(env, SEED),
            host=_text(env, HOST),
            join_timeout=_seconds(env, JOIN_TIMEOUT),
            op_timeout=_seconds(env, OP_TIMEOUT),
            resume=_path(env, RESUME),
            debug_param_hashes=_flag(env, DEBUG_PARAM_HASHES),
            keep_checkpoints=_int(env, KEEP_CHECKPOINTS),
        )


def session_key_from_env(environ: Mapping[str, str] | None = None) -> bytes:
    """The session key from ``FLODL_SESSION_KEY`` (hex) or the file ``FLODL_SESSION_KEY_FILE``.

    Keys never travel on a command line, where other users could read them from the process
    table. Raises ConfigError if neither is set or the key is malformed or too short.
    """
    env = os.environ if environ is None else environ
    if SESSION_KEY in env:
        try:
            key = bytes.fromhex(env[SESSION_KEY].strip())
        except ValueError:
            raise ConfigError(f"{SESSION_KEY} must be hex") from None
        return check_session_key(key)
    if SESSION_KEY_FILE in env:
        path = Path(env[SESSION_KEY_FILE])
        try:
            raw = path.read_bytes().strip()
        except OSError as err:
            raise ConfigError(f"cannot read session key file {path}: {err}") from None
        try:
            key = bytes.fromhex(raw.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            key = raw
        return check_session_key(key)
    raise ConfigError(f"no session key: set {SESSION_KEY} (hex) or {SESSION_KEY_FILE}")


def _text(env: Mapping[str, str], name: str) -> str | None:
    return env.get(name, "").strip() or None


def _path(env: Mapping[str, str], name: str) -> Path | None:
    raw = _text(env, name)
    return None if raw is None else Path(raw)


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = _text(env, name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def _required_int(env: Mapping[str, str], name: str) -> int:
    value = _int(env, name)
    if value is None:
        raise ConfigError(f"{name} is not set; {_LAUNCHER_HINT}")
    return value


def _seconds(env: Mapping[str, str], name: str) -> float | None:
    raw = _text(env, name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be > 0 seconds, got {raw!r}")
    return value


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str | None:
    raw = _text(env, name)
    if raw is None:
        return None
    value = raw.lower()
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = (_text(env, name) or "").lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name} must be 0 or 1, got {raw!r}")


KEY_FILE_NAME = "session.key"


def write_session_key(run_dir: Path, key: bytes) -> Path:
    """Write ``key`` (hex) to ``run_dir/session.key`` readable by this user only."""
    path = run_dir / KEY_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(key.hex())
    os.chmod(path, 0o600)
    return path


def rank_process_environment(layout: TorchrunLayout, rank_env: RankEnv) -> dict[str, str]:
    """The environment a supervisor starts a rank's process with: its own, less any session key
    it holds (a rank reads its key from ``rank_env``'s file: an inherited one would be the
    wrong one), plus torchrun's variables for ``layout``, what the rank reads (``rank_env``)
    and unbuffered output (relayed as it is written)."""
    env = dict(os.environ)
    env.pop(SESSION_KEY, None)
    env.update(layout.variables(env))
    env.update(rank_env.variables())
    env["PYTHONUNBUFFERED"] = "1"
    return env
