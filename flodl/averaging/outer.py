"""The outer optimizer: a step on each round's pseudo-gradient, the same on every rank.

Plain averaging sets every rank's parameters to the round's average ``a``. With an outer
optimizer each rank also keeps the *global* weights ``g`` of the last round; the round's
pseudo-gradient is ``d = g - a`` (how far the ranks moved together since then), and an SGD
step on it gives the next global weights:

- ``sgd`` (the run default, lr 1.5): ``g <- g - lr * d``. With ``lr > 1`` the ranks continue
  from a point past the average, along the direction they moved together; measured the best
  of the kinds on both benchmark workloads (docs/benchmarks.md).
- ``nesterov`` (DiLoCo, Douillard et al. 2023; lr 0.7, momentum 0.9)::

      m <- mu * m + d
      g <- g - lr * (d + mu * m)

after which every rank trains on from ``g``. With ``lr = 1`` and ``mu = 0`` that is ``g = a``,
plain averaging: :attr:`OuterSettings.is_identity` is then true and no arithmetic is done at
all, so the result is bitwise today's average. The inner optimizer (the user's) is untouched.

Every rank starts from the same bytes (the round's average is bitwise equal on every rank, see
:mod:`flodl.averaging.mass`) and does the same elementwise arithmetic, so ``g`` and ``m`` stay
bitwise equal on every rank of a group built from one kind of device. A rank that holds no
state, or an older one (a joiner, a resumed rank), is given the newest state by the group
(:meth:`OuterOptimizer.shared_tensors`, shared by the backend at the first round of each group
generation). The first round of a run, when no rank holds state yet, is a plain average that
sets ``g``.

Memory: ``g`` in float32 (or the parameters' dtype, when wider), and ``m`` as much again only
when the momentum is above 0: one copy of the parameters for ``sgd``, two for ``nesterov``
(:meth:`OuterOptimizer.state_bytes`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from flodl.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "KIND_DEFAULTS",
    "NO_STATE",
    "OuterKind",
    "OuterOptimizer",
    "OuterSettings",
    "check_outer",
]

NO_STATE = -1
"""The version of a rank that holds no outer state yet."""


class OuterKind(enum.Enum):
    """Which outer optimizer a round's average goes through."""

    NONE = "none"
    """Plain averaging: the ranks continue from the round's average."""
    SGD = "sgd"
    """SGD on the pseudo-gradient ``g - a`` (no momentum)."""
    NESTEROV = "nesterov"
    """DiLoCo: Nesterov SGD on the pseudo-gradient ``g - a``."""


KIND_DEFAULTS: dict[OuterKind, tuple[float, float]] = {
    OuterKind.NONE: (1.0, 0.0),
    OuterKind.SGD: (1.5, 0.0),
    OuterKind.NESTEROV: (0.7, 0.9),
}
"""Each kind's (lr, momentum) where none is given."""


def check_outer(kind: str, lr: float, momentum: float, names: tuple[str, str, str]) -> None:
    """ConfigError naming the offending one of ``names`` (kind, lr, momentum) unless the three
    make an outer optimizer: a known kind, a finite ``lr > 0``, ``0 <= momentum < 1``."""
    kinds = tuple(k.value for k in OuterKind)
    if kind not in kinds:
        raise ConfigError(f"{names[0]} must be one of {', '.join(kinds)}, got {kind!r}")
    if not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
        raise ConfigError(f"{names[1]} must be a finite number > 0, got {lr!r}")
    if not (isinstance(momentum, int | float) and 0.0 <= momentum < 1.0):
        raise ConfigError(f"{names[2]} must be a number in [0, 1), got {momentum!r}")
    if kind == OuterKind.SGD.value and momentum != 0.0:
        raise ConfigError(
            f"{names[2]} must be 0 with {names[0]} sgd (nesterov takes a momentum), "
            f"got {momentum!r}"
        )


def _kind(value: OuterKind | str) -> OuterKind:
    try:
        return OuterKind(value)
    except ValueError:
        kinds = ", ".join(k.value for k in OuterKind)
        raise ConfigError(f"outer must be one of {kinds}, got {value!r}") from None


@attrs.frozen
class OuterSettings:
    """The outer optimizer of a run (the coordinator owns it and sends it in RunSettings)."""

    kind: OuterKind = attrs.field(default=OuterKind.NONE, converter=_kind)
    lr: float = attrs.field(
        default=attrs.Factory(lambda self: KIND_DEFAULTS[self.kind][0], takes_self=True)
    )
    """None given: the kind's (:data:`KIND_DEFAULTS`)."""
    momentum: float = attrs.field(
        default=attrs.Factory(lambda self: KIND_DEFAULTS[self.kind][1], takes_self=True)
    )

    def __attrs_post_init__(self) -> None:
        names = ("outer", "outer_lr", "outer_momentum")
        check_outer(self.kind.value, self.lr, self.momentum, names)

    @property
    def is_identity(self) -> bool:
        """True when the outer step is plain averaging (``none``, or lr 1 with momentum 0)."""
        return self.kind is OuterKind.NONE or (self.lr == 1.0 and self.momentum == 0.0)

    @property
    def keeps_momentum(self) -> bool:
        """True when the state holds a momentum ``m`` beside ``g`` (momentum above 0)."""
        return not self.is_identity and self.momentum > 0.0

    @classmethod
    def of(cls, kind: OuterKind | str, lr: float | None, momentum: float | None) -> OuterSettings:
        """The settings for ``kind``, taking its defaults for a None ``lr`` or ``momentum``."""
        kind = _kind(kind)
        default_lr, default_momentum = KIND_DEFAULTS[kind]
        return cls(
            kind,
            default_lr if lr is None else lr,
            default_momentum if momentum is None else momentum,
        )


class OuterOptimizer:
    """One rank's outer state (``g``, ``m`` where the momentum is above 0, and the number of
    outer steps taken) and its step.

    Not thread-safe: one round at a time, as the rank's round runner guarantees.
    """

    def __init__(self, settings: OuterSettings) -> None:
        self.settings = settings
        self._global: list[torch.Tensor] | None = None
        self._momentum: list[torch.Tensor] = []
        """Empty unless :attr:`OuterSettings.keeps_momentum`."""
        self.version = NO_STATE
        """Outer steps this state has seen (0 after the first round set ``g``); NO_STATE while
        there is none. Ranks holding the same version hold the same bytes."""

    @property
    def active(self) -> bool:
        """False when every round is plain averaging (nothing is kept, nothing is shared)."""
        return not self.settings.is_identity

    def state_bytes(self, params: Sequence[torch.Tensor]) -> int:
        """Bytes the state takes for these parameters: ``g``, and ``m`` where the momentum is
        above 0, each float32 or wider; 0 when :attr:`active` is false."""
        import torch

        copies = 0 if not self.active else 2 if self.settings.keeps_momentum else 1
        return sum(
            copies * p.numel() * torch.promote_types(p.dtype, torch.float32).itemsize
            for p in params
        )

    def step(self, averaged: Sequence[torch.Tensor]) -> None:
        """Turn ``averaged`` (this round's average, in place) into the next global weights.

        The first round with no state keeps the average and makes it ``g`` (``m`` zero). When
        :attr:`active` is false, does nothing. ``averaged`` must have the same shapes at every
        call (the model's parameters, or views of them).
        """
        if not self.active:
            return
        import torch

        with torch.no_grad():
            if self._global is None or self.version == NO_STATE:
                self._global = [_wide_copy(a) for a in averaged]
                self._momentum = self._zero_momentum(self._global)
                self.version = 0
                return
            lr, mu = self.settings.lr, self.settings.momentum
            if self.settings.keeps_momentum:
                for a, g, m in zip(averaged, self._global, self._momentum, strict=True):
                    delta = g - a.to(g.dtype)
                    m.mul_(mu).add_(delta)
                    g.sub_(delta.add_(m, alpha=mu), alpha=lr)
                    a.copy_(g)
            else:
                for a, g in zip(averaged, self._global, strict=True):
                    g.sub_(g - a.to(g.dtype), alpha=lr)
                    a.copy_(g)
            self.version += 1

    def shared_tensors(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``g`` then ``m``, for the group to make equal on every rank (a rank with no state
        gets zeros of the right shapes first, to be overwritten)."""
        import torch

        if self._global is None:
            self._global = [torch.zeros_like(_wide_copy(p)) for p in params]
            self._momentum = self._zero_momentum(self._global)
        return [*self._global, *self._momentum]

    def adopt_shared(self, version: int) -> None:
        """The group made :meth:`shared_tensors` equal on every rank, at ``version``."""
        self.version = version
        if version == NO_STATE:  # nobody had any: the next round sets g
            self._global, self._momentum = None, []

    def tensors(self) -> list[torch.Tensor]:
        """``g`` then ``m`` as they are now (empty while there is no state)."""
        if self._global is None or self.version == NO_STATE:
            return []
        return [*self._global, *self._momentum]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The state as named tensors for a bundle (empty when there is none)."""
        import torch

        if self._global is None or self.version == NO_STATE:
            return {}
        state = {"version": torch.tensor(self.version, dtype=torch.int64)}
        for i, g in enumerate(self._global):
            state[f"global.{i}"] = g.detach().cpu()
        for i, m in enumerate(self._momentum):
            state[f"momentum.{i}"] = m.detach().cpu()
        return state

    def load_state_dict(
        self, state: Mapping[str, torch.Tensor], params: Sequence[torch.Tensor]
    ) -> None:
        """Restore :meth:`state_dict`'s output (empty: no state); ConfigError when it does not
        fit ``params``.

        The settings may differ from the saving run's: a momentum saved where none is kept
        now is dropped, and one missing where it is kept now starts at zero.
        """
        if not state:
            self._global, self._momentum = None, []
            self.version = NO_STATE
            return
        globals_ = {f"global.{i}" for i in range(len(params))}
        momenta = {f"momentum.{i}" for i in range(len(params))}
        names = set(state) - {"version"}
        if "version" not in state or not globals_ <= names or not names <= globals_ | momenta:
            raise ConfigError(
                f"the saved outer state holds {len(state)} tensors, which do not fit the "
                f"{len(params)} parameters of this model"
            )
        restored = [self._restored(state, "global", i, p) for i, p in enumerate(params)]
        self._global = restored
        if not self.settings.keeps_momentum:
            self._momentum = []
        elif momenta <= names:
            self._momentum = [self._restored(state, "momentum", i, p) for i, p in enumerate(params)]
        else:
            self._momentum = self._zero_momentum(restored)
        self.version = int(state["version"].item())

    def _zero_momentum(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        import torch

        return [torch.zeros_like(g) for g in like] if self.settings.keeps_momentum else []

    @staticmethod
    def _restored(
        state: Mapping[str, torch.Tensor], kind: str, i: int, param: torch.Tensor
    ) -> torch.Tensor:
        saved = state[f"{kind}.{i}"]
        wanted = _wide_copy(param)
        if saved.shape != wanted.shape or saved.dtype != wanted.dtype:
            raise ConfigError(
                f"the saved outer {kind} tensor {i} is {tuple(saved.shape)} "
                f"{saved.dtype}, the parameter needs {tuple(wanted.shape)} {wanted.dtype}"
            )
        return saved.to(param.device).clone()


def _wide_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` in float32, or ``t``'s dtype when wider."""
    import torch

    return t.detach().to(torch.promote_types(t.dtype, torch.float32), copy=True)
