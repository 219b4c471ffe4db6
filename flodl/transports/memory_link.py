"""The fault plan of ``memory://`` connections and the link that shares it among them.

A :class:`FaultPlan` says how a link misbehaves (latency, a byte budget, a partition); a
:class:`Link` holds the plan in force for every connection made through one name, so a new
plan applies at once to existing connections too. What each fault does to the bytes of a
connection is specified in :mod:`flodl.transports.memory_stream`.
"""

from __future__ import annotations

import math
from typing import Protocol

import attrs
import trio

from flodl.errors import ConfigError


def _non_negative_finite(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"FaultPlan.{attribute.name} must be a finite number >= 0, got {value!r}")


def _optional_byte_count(
    instance: object, attribute: attrs.Attribute[int | None], value: int | None
) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(f"FaultPlan.{attribute.name} must be None or an int >= 0, got {value!r}")


@attrs.frozen
class FaultPlan:
    """How a memory link misbehaves: added latency, a byte budget, a partition.

    Exact semantics: :mod:`flodl.transports.memory_stream`. The default plan is a perfect
    link.
    """

    latency: float = attrs.field(default=0.0, validator=_non_negative_finite)
    cut_after_bytes: int | None = attrs.field(default=None, validator=_optional_byte_count)
    partitioned: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


class Wakeable(Protocol):
    """A reader's wait point: :meth:`wake` makes its reader re-check what it waits for."""

    def wake(self) -> None: ...


class Link:
    """The fault plan shared by a group of connections (those made through one listener name).

    :meth:`set_plan` applies at once to every connection of the link, existing and future.
    """

    __slots__ = ("_healed", "_held", "_hooked", "_plan")

    def __init__(self, plan: FaultPlan | None = None) -> None:
        self._plan = plan if plan is not None else FaultPlan()
        self._held: set[Wakeable] = set()  # readers waiting for a partition to heal
        self._hooked: set[Wakeable] = set()  # readers with a readable hook (told of every plan)
        self._healed = trio.lowlevel.ParkingLot()

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    def set_plan(self, plan: FaultPlan) -> None:
        """Replace the plan now; readers held by a partition re-check it (no checkpoint)."""
        self._plan = plan
        for reader in list(self._held | self._hooked):
            reader.wake()
        self._healed.unpark_all()

    def hold(self, reader: Wakeable) -> None:
        """Register a reader that waits for the partition to heal."""
        self._held.add(reader)

    def release(self, reader: Wakeable) -> None:
        self._held.discard(reader)

    def hook(self, reader: Wakeable, hooked: bool) -> None:
        """Tell (or stop telling) a reader's readable hook of every plan change."""
        if hooked:
            self._hooked.add(reader)
        else:
            self._hooked.discard(reader)

    async def wait_until_flowing(self) -> None:
        """Return once the link is not partitioned. Always a checkpoint."""
        if not self._plan.partitioned:
            await trio.lowlevel.checkpoint()
        while self._plan.partitioned:
            await self._healed.park()
