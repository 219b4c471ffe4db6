"""The mass rule, as tensor math on one flat scratch buffer (no collectives, no trio).

Layout of the flat buffer every rank contributes to one SUM all-reduce::

    [ mass | mover | params * mass ... | float buffers * mover ... ]

``mass = n ** gamma`` for a rank that ran ``n > 0`` batches since the last average and ``0``
for ``n == 0`` (whatever ``gamma``); ``mover`` is 1 if ``n > 0`` else 0. The average is
``sum(mass * p) / sum(mass)`` for the parameters and ``sum(mover * b) / sum(mover)`` for the
float buffers. A round whose summed mass is 0 keeps every rank's local state. Non-float
buffers (step counters) are never averaged: they keep their local value.

Two ways to reduce that buffer: a *snapshot* (:func:`pack`, the Async policy's background
round) carries ``mass * p`` and is divided by the sums once it has landed; a *pre-scaled*
round (:mod:`flodl.backends.pipeline`, Sync and Cadence) reduces the two sums first and then
carries each rank's share ``p * mass / sum(mass)``, so the all-reduce itself yields the
average. Either way every rank ends with the same reduced bytes (and the same deterministic
arithmetic after them), so the averaged values are bitwise identical across ranks;
:func:`bit_checksum` lets a caller prove it.

Norms are accumulated in float32 per tensor or block (float64 for the sum of their squares):
they feed the divergence guard, not the model, and a float64 pass would cost ~25x more.
Measured on 10.5M parameters against float64: pre/post norms within 1e-7 relative, the
divergence within 1e-5 at 5e-5 (the float32 average itself limits it below that).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from flodl.errors import BackendError

HEADER = 2
"""Elements ahead of the parameters: the summed mass, then the summed movers."""

ALIGN_ELEMENTS = 16
ALIGN_FROM = 1024
"""Members of at least ``ALIGN_FROM`` elements start on an ``ALIGN_ELEMENTS`` boundary (64
bytes of float32): the copy, norm and divide passes over them then run on aligned vectors,
about 20% faster than at the 8-byte offset the header would leave. The gaps hold zeros."""

_MASK64 = (1 << 64) - 1


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
    def mass_index(self) -> int:
        return 0

    @property
    def mover_index(self) -> int:
        return 1

    @property
    def params_start(self) -> int:
        return HEADER

    @property
    def params_end(self) -> int:
        ranges = self.param_ranges()
        return ranges[-1][1] if ranges else HEADER

    @property
    def total(self) -> int:
        ends = [span[1] for span in self.buffer_ranges() if span is not None]
        return ends[-1] if ends else self.params_end

    def param_ranges(self) -> list[tuple[int, int]]:
        """``(start, end)`` in the flat buffer of each parameter."""
        return _ranges(self.params_start, self.param_numels)

    def buffer_ranges(self) -> list[tuple[int, int] | None]:
        """``(start, end)`` of each buffer; None for one that is not averaged."""
        averaged = [n for n, a in zip(self.buffer_numels, self.averaged_buffers, strict=True) if a]
        spans = iter(_ranges(self.params_end, averaged))
        return [next(spans) if a else None for a in self.averaged_buffers]

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


def _ranges(start: int, numels: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive spans from ``start``, large members aligned (see ``ALIGN_FROM``)."""
    spans = []
    for n in numels:
        if n >= ALIGN_FROM:
            start = -(-start // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        spans.append((start, start + n))
        start += n
    return spans


def scaled_copy(source: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """``out = source * scale`` in one pass (two when the dtypes differ: cast, then scale).

    ``out`` is 1-D; ``source`` has as many elements (any shape, any strides).
    """
    flat_source = source.reshape(-1)
    if flat_source.dtype == out.dtype:
        torch.mul(flat_source, scale, out=out)
    else:  # scale in the flat dtype, as the reduction does
        out.copy_(flat_source).mul_(scale)


@torch.no_grad()
def pack(
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    layout: FlatLayout,
    batches: int,
    gamma: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's mass-weighted contribution, in ``out`` or a fresh buffer (live untouched)."""
    mass = mass_of(batches, gamma)
    mover = mover_of(batches)
    flat = (
        torch.zeros(layout.total, dtype=layout.dtype, device=layout.device) if out is None else out
    )
    if flat.shape != (layout.total,) or flat.dtype != layout.dtype:
        raise BackendError("scratch buffer does not match the layout")
    flat[layout.mass_index] = mass
    flat[layout.mover_index] = mover
    for p, (start, end) in zip(params, layout.param_ranges(), strict=True):
        scaled_copy(p, mass, flat[start:end])
    for b, span in zip(buffers, layout.buffer_ranges(), strict=True):
        if span is not None:
            scaled_copy(b, mover, flat[span[0] : span[1]])
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


def divisors(reduced: Reduced) -> tuple[float, float]:
    """What the parameters and the float buffers are divided by."""
    return reduced.total_mass, max(reduced.movers, 1.0)


@torch.no_grad()
def finish_average(flat: torch.Tensor, layout: FlatLayout, reduced: Reduced) -> None:
    """Turn a reduced flat buffer into the average, in place: params / mass, buffers / movers.

    Only meaningful when ``reduced.total_mass > 0`` (then at least one rank moved).
    """
    by_mass, by_movers = divisors(reduced)
    flat[layout.params_start : layout.params_end].div_(by_mass)
    flat[layout.params_end :].div_(by_movers)


def checksum_part(part: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a 1-D float tensor summed as int64 words (a 0-d int64 tensor).

    Sums wrap around, so adding the parts of a buffer (:func:`combine_checksums`) gives the
    same value whichever way the buffer was cut, as long as every cut starts on a whole
    8-byte word of it. An odd trailing 4-byte element counts as its signed 32-bit value.
    """
    size = part.element_size()
    if size not in (4, 8):
        raise BackendError(f"checksum needs 4- or 8-byte elements, got {part.dtype}")
    per_word = 8 // size
    whole = part.numel() - part.numel() % per_word
    total = part[:whole].view(torch.int64).sum()
    if whole < part.numel():
        total = total + part[whole:].view(torch.int32).to(torch.int64).sum()
    return total


def combine_checksums(parts: Sequence[torch.Tensor]) -> int:
    """Sum of :func:`checksum_part` values modulo 2**64, as an unsigned Python int."""
    if not parts:
        return 0
    return int(torch.stack(list(parts)).sum().item()) & _MASK64


def bit_checksum(flat: torch.Tensor) -> int:
    """Checksum of a buffer's raw bytes as a signed int64: equal bytes give equal sums."""
    unsigned = combine_checksums([checksum_part(flat.contiguous().reshape(-1))])
    return unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned


def combine_norms(norms: Sequence[torch.Tensor]) -> float:
    """``sqrt(sum(n ** 2))`` of per-part norms (0-d tensors), summed in float64, one sync."""
    if not norms:
        return 0.0
    squares = torch.stack([n.to(torch.float64) for n in norms]).square()
    return math.sqrt(float(squares.sum().item()))


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """``||t||**2`` of a 1-D tensor as a 0-d tensor, accumulated in float32 at least.

    float32/float64 go through BLAS ``dot`` (half the cost of ``vector_norm`` on a block
    already in cache; its float32 sums are good to ~1e-6 relative, ample for a guard).
    """
    if t.dtype in (torch.float32, torch.float64):
        return torch.dot(t, t)
    return norm32(t).square()


def combine_squares(squares: Sequence[torch.Tensor]) -> float:
    """``sqrt(sum(squares))`` of per-part squared norms, summed in float64, one sync."""
    if not squares:
        return 0.0
    return math.sqrt(float(torch.stack([q.to(torch.float64) for q in squares]).sum().item()))


def norm32(t: torch.Tensor) -> torch.Tensor:
    """The 2-norm of ``t``, accumulated in float32 (or wider, for float64 tensors)."""
    dtype = torch.promote_types(t.dtype, torch.float32)
    norm: torch.Tensor = torch.linalg.vector_norm(t, dtype=dtype)
    return norm


@attrs.frozen
class Applied:
    """Norms of the live parameters around one application of an average."""

    pre_norm: float
    post_norm: float
    diff_norm: float

    @property
    def divergence(self) -> float:
        return relative_divergence(self.diff_norm, self.post_norm)


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
    for p, (start, end) in zip(params, layout.param_ranges(), strict=True):
        target = averaged[start:end].view(p.shape).to(p.dtype)
        if alpha != 1.0:
            target = torch.lerp(p, target, alpha)
        pre.append(norm32(p))
        diff.append(torch.linalg.vector_norm(p - target, dtype=pre[-1].dtype))
        p.copy_(target)
        post.append(norm32(target))
    copy_buffers(averaged, layout, buffers)
    return Applied(
        pre_norm=combine_norms(pre), post_norm=combine_norms(post), diff_norm=combine_norms(diff)
    )


@torch.no_grad()
def copy_buffers(
    averaged: torch.Tensor, layout: FlatLayout, buffers: Sequence[torch.Tensor]
) -> None:
    """Overwrite each averaged float buffer with its slice of ``averaged`` (cast on write)."""
    for b, span in zip(buffers, layout.buffer_ranges(), strict=True):
        if span is not None:
            b.copy_(averaged[span[0] : span[1]].view(b.shape))


def landed_params(
    averaged: torch.Tensor, layout: FlatLayout, params: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Views of each parameter's average in ``averaged``, shaped as the parameters."""
    return [
        averaged[start:end].view(p.shape)
        for p, (start, end) in zip(params, layout.param_ranges(), strict=True)
    ]


def local_norms(params: Sequence[torch.Tensor]) -> Applied:
    """Norms for a round that keeps local state (zero mass): pre == post, no divergence."""
    norm = combine_norms([norm32(p) for p in params])
    return Applied(pre_norm=norm, post_norm=norm, diff_norm=0.0)
