"""The base of every control message (:mod:`flodl.wire.messages` is the catalogue)."""

from __future__ import annotations

from typing import ClassVar

import attrs

__all__ = ["Message"]


@attrs.frozen
class Message:
    """Base of all control messages. ``TAG`` is the stable wire tag of the concrete class."""

    TAG: ClassVar[int] = 0
