"""The mass rule, as tensor math on one flat scratch buffer (no collectives, no trio).

Layout of the flat buffer every rank contributes to one SUM all-reduce::

    [ params * mass ... | mass | mover | float buffers * mover ... ]

``mass = n ** gamma`` for a rank that ran ``n > 0`` batches since the last average and ``0``
for ``n == 0`` (whatever ``gamma``); ``mover`` is 1 if ``n > 0`` else 0. After the sum, the
parameters are divided once by the summed mass and the float buffers by the summed movers. A
round whose summed mass is 0 keeps every rank's local state. Non-float buffers (step counters)
are never averaged: they keep their local value.

Every rank runs the same deterministic arithmetic on the same reduced bytes, so the averaged
values are bitwise identical across ranks; :func:`bit_checksum` lets a caller prove it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from flodl.errors import BackendError

_CHECKSUM_VIEW: dict[int, torch.dtype] = {
    1: torch.int8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}


def mass_of(batches: int, gamma: float) -> float:
    """A rank's parameter mass: ``batches ** gamma``, and 0 when it ran no batch."""
    if batches < 0:
        raise BackendError(f"batches must be >= 0, got {batches}")
    if batches == 0:
        return 0.0
    return float(float(batches) ** gamma)


def mover_of(batches: int) -> float:
    """A rank's buffer mass: 1 when it ran at least one batch since the last average, else 0."""
    return 1.0 if batches > 0 else 0.0


def relative_divergence(diff_norm: float, post_norm: float) -> float:
    """``||pre - post|| / ||post||``, or 0 when ``||post|| < 1e-10``."""
    return 0.0 if post_norm < 1e-10 else diff_norm / post_norm


def easgd_blend(local: float, average: float, alpha: float) -> float:
    """Scalar form of the EASGD pull: ``(1 - alpha) * local + alpha * average``."""
    return (1.0 - alpha) * local + alpha * average


@attrs.frozen
class FlatLayout:
    """Where each tensor lives in the flat buffer; built from the shapes, equal on all ranks."""

    dtype: torch.dtype
    device: torch.device
    param_numels: tuple[int, ...]
    buffer_numels: tuple[int, ...]
    averaged_buffers: tuple[bool, ...]  # False: not a float buffer, keeps its local value

    @property
    def params_end(self) -> int:
        return sum(self.param_numels)

    @property
    def mass_index(self) -> int:
        return self.params_end

    @property
    def mover_index(self) -> int:
        return self.params_end + 1

    @property
    def total(self) -> int:
        averaged = sum(
            n for n, a in zip(self.buffer_numels, self.averaged_buffers, strict=True) if a
        )
        return self.params_end + 2 + averaged

    @staticmethod
    def of(params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> FlatLayout:
        """The layout for these tensors (floating dtypes promoted, at least float32)."""
        for p in params:
            if not p.is_floating_point():
                raise BackendError(f"parameters must be floating point, got {p.dtype}")
        averaged = tuple(b.is_floating_point() for b in buffers)
        members = [*params, *(b for b, a in zip(buffers, averaged, strict=True) if a)]
        dtype = torch.float32
        for t in members:
            dtype = torch.promote_types(dtype, t.dtype)
        devices = {t.device for t in [*params, *buffers]}
        if len(devices) > 1:
            raise BackendError(
                f"all tensors must be on one device, got {sorted(map(str, devices))}"
            )
        device = devices.pop() if devices else torch.device("cpu")
        return FlatLayout(
            dtype=dtype,
            device=device,
            param_numels=tuple(p.numel() for p in params),
            buffer_numels=tuple(b.numel() for b in buffers),
            averaged_buffers=averaged,
        )


@torch.no_grad()
def pack(
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    layout: FlatLayout,
    batches: int,
    gamma: float,
) -> torch.Tensor:
    """A fresh flat buffer with this rank's mass-weighted contribution (live tensors untouched)."""
    mass = mass_of(batches, gamma)
    mover = mover_of(batches)
    flat = torch.empty(layout.total, dtype=layout.dtype, device=layout.device)
    offset = 0
    for p, n in zip(params, layout.param_numels, strict=True):
        flat[offset : offset + n].copy_(p.reshape(-1)).mul_(mass)
        offset += n
    flat[offset] = mass
    flat[offset + 1] = mover
    offset += 2
    for b, n, averaged in zip(buffers, layout.buffer_numels, layout.averaged_buffers, strict=True):
        if averaged:
            flat[offset : offset + n].copy_(b.reshape(-1)).mul_(mover)
            offset += n
    return flat


@attrs.frozen
class Reduced:
    """The sums read back from a reduced flat buffer."""

    total_mass: float
    movers: float


def read_sums(flat: torch.Tensor, layout: FlatLayout) -> Reduced:
    """Summed mass and mover count of a reduced flat buffer."""
    sums = flat[layout.mass_index : layout.mover_index + 1].tolist()
    return Reduced(total_mass=float(sums[0]), movers=float(sums[1]))


@torch.no_grad()
def finish_average(flat: torch.Tensor, layout: FlatLayout, reduced: Reduced) -> None:
    """Turn a reduced flat buffer into the average, in place: params / mass, buffers / movers.

    Only meaningful when ``reduced.total_mass > 0`` (then at least one rank moved).
    """
    flat[: layout.params_end].div_(reduced.total_mass)
    flat[layout.mover_index + 1 :].div_(max(reduced.movers, 1.0))


def bit_checksum(flat: torch.Tensor) -> int:
    """Sum of the raw bit patterns of ``flat`` (int64, wrapping): equal bytes give equal sums."""
    view = flat.contiguous().view(_CHECKSUM_VIEW[flat.element_size()])
    return int(view.to(torch.int64).sum().item())


def _param_views(flat: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    views = []
    offset = 0
    for n in layout.param_numels:
        views.append(flat[offset : offset + n])
        offset += n
    return views


def _buffer_views(flat: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor | None]:
    views: list[torch.Tensor | None] = []
    offset = layout.mover_index + 1
    for n, averaged in zip(layout.buffer_numels, layout.averaged_buffers, strict=True):
        if averaged:
            views.append(flat[offset : offset + n])
            offset += n
        else:
            views.append(None)
    return views


@attrs.frozen
class Applied:
    """Norms of the live parameters around one application of an average."""

    pre_norm: float
    post_norm: float
    diff_norm: float

    @property
    def divergence(self) -> float:
        return relative_divergence(self.diff_norm, self.post_norm)


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float64).item())


def _combine(norms: Sequence[float]) -> float:
    return math.sqrt(sum(n * n for n in norms))


@torch.no_grad()
def apply_average(
    averaged: torch.Tensor,
    layout: FlatLayout,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    alpha: float = 1.0,
) -> Applied:
    """Write a finished average into the live tensors and report the parameter norms.

    ``alpha == 1`` overwrites (Sync, Cadence); ``alpha < 1`` is the EASGD blend
    ``p <- (1 - alpha) * p + alpha * avg``. Float buffers are always overwritten.
    """
    if not 0.0 < alpha <= 1.0:
        raise BackendError(f"alpha must be in (0, 1], got {alpha}")
    pre, post, diff = [], [], []
    for p, avg in zip(params, _param_views(averaged, layout), strict=True):
        target = avg.reshape(p.shape).to(p.dtype)
        if alpha != 1.0:
            target = torch.lerp(p, target, alpha)
        pre.append(_norm(p))
        diff.append(_norm(p - target))
        p.copy_(target)
        post.append(_norm(p))
    for b, avg_b in zip(buffers, _buffer_views(averaged, layout), strict=True):
        if avg_b is not None:
            b.copy_(avg_b.reshape(b.shape))
    return Applied(pre_norm=_combine(pre), post_norm=_combine(post), diff_norm=_combine(diff))


def local_norms(params: Sequence[torch.Tensor]) -> Applied:
    """Norms for a round that keeps local state (zero mass): pre == post, no divergence."""
    norm = _combine([_norm(p) for p in params])
    return Applied(pre_norm=norm, post_norm=norm, diff_norm=0.0)
