"""The coordinator owns the run's settings: a worker takes them where it was told nothing.

The coordinator's first message to a rank is :class:`~flodl.wire.messages.RunSettings`.
:func:`adopt` fills a worker's unset settings from it, so ``flodl worker`` needs only the
coordinator's address and the key, and refuses a setting the worker was given that says
otherwise, naming both values, rather than run with two policies in one group.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from flodl.averaging.dtypes import AVERAGE_DTYPE_NAMES
from flodl.averaging.outer import OuterSettings
from flodl.core.common.policy import Policy
from flodl.errors import ConfigError, CoordinatorError
from flodl.host import environment as names
from flodl.transports.channel import Channel
from flodl.wire.messages import RunSettings
from flodl.worker.config import WorkerConfig

__all__ = ["adopt", "receive_settings"]

_VARIABLES = {
    "policy": names.POLICY,
    "seed": names.SEED,
    "heartbeat_interval": names.HEARTBEAT_INTERVAL,
    "heartbeat_timeout": names.HEARTBEAT_TIMEOUT,
    "backend": names.BACKEND,
    "keep_checkpoints": names.KEEP_CHECKPOINTS,
}


def _theirs(settings: RunSettings) -> dict[str, Any]:
    try:
        policy = Policy(settings.policy)
    except ValueError:
        raise CoordinatorError(
            f"the coordinator sent an unknown policy {settings.policy!r}"
        ) from None
    values: dict[str, Any] = {
        "policy": policy,
        "seed": settings.seed,
        "heartbeat_interval": settings.heartbeat_interval,
        "heartbeat_timeout": settings.heartbeat_timeout,
    }
    if settings.average_dtype not in AVERAGE_DTYPE_NAMES:
        raise CoordinatorError(
            f"the coordinator sent an unknown average dtype {settings.average_dtype!r}"
        )
    values["average_dtype"] = settings.average_dtype
    try:
        values["outer"] = OuterSettings(settings.outer, settings.outer_lr, settings.outer_momentum)
    except (ConfigError, ValueError) as err:
        raise CoordinatorError(f"the coordinator sent an unusable outer optimizer: {err}") from None
    if settings.backend is not None:
        values["backend"] = settings.backend
    if settings.keep_checkpoints:
        values["keep_checkpoints"] = settings.keep_checkpoints
    return values


def _shown(value: Any) -> str:
    return (
        value.value
        if isinstance(value, Policy)
        else f"{value:g}"
        if isinstance(value, float)
        else str(value)
    )


def adopt(config: WorkerConfig, settings: RunSettings) -> WorkerConfig:
    """``config`` with the coordinator's settings where its environment set none.

    Raises ConfigError naming the variable and both values when the environment set one to
    something else (``FLODL_POLICY=sync (this rank) but the coordinator runs policy async``).
    """
    given = config.given if config.given is not None else frozenset(_VARIABLES)
    changes: dict[str, Any] = {}
    for name, value in _theirs(settings).items():
        mine = getattr(config, name)
        if name not in given:
            changes[name] = value
        elif mine != value:
            raise ConfigError(
                f"{_VARIABLES[name]}={_shown(mine)} (this rank) but the coordinator runs "
                f"{name} {_shown(value)}: leave it unset to take the coordinator's"
            )
    try:
        return attrs.evolve(config, **changes)
    except ConfigError as err:
        raise ConfigError(f"with the coordinator's settings: {err}") from None


async def receive_settings(channel: Channel, config: WorkerConfig) -> WorkerConfig:
    """Wait (up to the heartbeat timeout) for the coordinator's first message, RunSettings,
    and :func:`adopt` it. The outer optimizer is always the coordinator's (no variable sets
    it). A config built in code (``given`` None) asks for nothing and is returned as it is.
    CoordinatorError when the first message is something else or none comes in time."""
    if config.given is None:
        return config
    with trio.move_on_after(config.heartbeat_timeout):
        first = await channel.receive()
        if not isinstance(first, RunSettings):
            raise CoordinatorError(
                f"rank {config.rank}: the coordinator's first message was "
                f"{type(first).__name__}, not RunSettings (a coordinator of another version?)"
            )
        return adopt(config, first)
    raise CoordinatorError(
        f"rank {config.rank}: no RunSettings from the coordinator within "
        f"{config.heartbeat_timeout:g} s of the handshake"
    )
