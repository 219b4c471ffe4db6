"""The backend interface: how a rank averages its parameters with the other ranks.

Importing this module does not import torch (tensor types appear only in annotations), so the
coordinator and ``import flodl`` stay light.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:
    import torch
    import trio

DEFAULT_ALPHA = 0.5
"""EASGD pull strength for the Async policy (floDl's default)."""


@attrs.frozen
class AverageResult:
    """What one averaging round did to this rank's parameters (feeds ``SyncAck``).

    ``divergence`` is ``||pre - post|| / ||post||`` over the parameters (0 when ``||post||`` is
    below 1e-10); ``skipped`` is True when the round's summed mass was 0 and every rank kept
    its local state. ``total_mass`` and ``movers`` are the round's sums over all ranks.
    """

    divergence: float
    pre_norm: float
    post_norm: float
    skipped: bool
    total_mass: float
    movers: int


class PendingAverage(Protocol):
    """An averaging round running in the background on a snapshot (Async policy)."""

    @property
    def landed(self) -> bool:
        """True once the collective has finished, successfully or not."""
        ...

    async def wait(self) -> None:
        """Block until the round has landed (success or failure; never raises for failure)."""
        ...

    def blend_into(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        alpha: float = DEFAULT_ALPHA,
        outer: Callable[[Sequence[torch.Tensor]], None] | None = None,
    ) -> AverageResult:
        """Blend the landed average into the live tensors (EASGD; buffers overwritten); with
        ``outer``, the average's parameters go through ``outer`` (in place) first.

        Raises :class:`~flodl.errors.CollectiveAborted` if the round failed or was abandoned
        (live tensors untouched), :class:`~flodl.errors.BackendError` if it has not landed.
        """
        ...

    def abandon(self) -> None:
        """Give up on the round: the collective is abandoned and the group marked broken."""
        ...


class Backend(Protocol):
    """A parameter-averaging backend over one re-formable group of ranks.

    A group is identified by its ``generation``. The coordinator asks one rank (the generator)
    to :meth:`prepare_group`; the opaque bytes it returns travel to every member
    (``NewGroupReady`` -> ``NewGroupSession``) and each member calls :meth:`join_group`.
    """

    name: str

    @property
    def generation(self) -> int | None:
        """The generation of the group currently joined, or None before the first join."""
        ...

    @property
    def broken(self) -> bool:
        """True when the current group failed or had a collective abandoned; join a new one."""
        ...

    def prepare_group(self, generation: int, host: str) -> bytes:
        """On the generator: host what members need for ``generation``; return its info bytes."""
        ...

    async def join_group(
        self, info: bytes, rank: int, world_size: int, generation: int, host: str
    ) -> None:
        """Build and join group ``generation`` as ``rank`` of ``world_size``; ``host`` is this
        rank's address for its peers (gloo listens there)."""
        ...

    async def average(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        batches: int,
        gamma: float = 1.0,
    ) -> AverageResult:
        """Average with every member now, overwriting the live tensors on success."""
        ...

    async def average_moves(
        self,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        reference: Sequence[torch.Tensor],
        batches: int,
        dtype: torch.dtype,
    ) -> AverageResult:
        """Average with every member through the moves from ``reference`` (which every
        member holds bit for bit), reduced in ``dtype``; live tensors overwritten on success."""
        ...

    async def share_newest(self, tensors: Sequence[torch.Tensor], version: int) -> int:
        """Make ``tensors`` equal on every member to those of the member holding the highest
        ``version``; return that version (every member calls it at the same point)."""
        ...

    async def start_background_average(
        self,
        nursery: trio.Nursery,
        params: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        batches: int,
        gamma: float = 1.0,
    ) -> PendingAverage:
        """Snapshot the tensors, then run the collective in ``nursery`` while training goes on."""
        ...

    async def close(self) -> None:
        """Tear down every group this backend built (required before the process exits)."""
        ...
