"""The base of every control message (:mod:`flodl.wire.messages` is the catalogue)."""

from __future__ import annotations

from typing import ClassVar

import attrs

__all__ = ["Message"]


@attrs.frozen
class Message:
    """Base of all control messages. ``TAG`` is the stable wire tag of the concrete class."""

    TAG: ClassVar[int] = 0

    @property
    def carried(self) -> int:
        """How many messages this frame hands on: 1, or, for one that carries others (a node
        agent's ``RanksUp``), how many it carries. A shared reader caps its passes by these."""
        return 1
