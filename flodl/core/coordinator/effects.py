"""What the pure state machines ask the coordinator shell to do.

Core code never sends anything: it returns effects, and the shell performs them in order.
An effect is either a message for one rank (:class:`Send`) or a message for several
(:class:`Broadcast`). Both are frozen, so a list of effects can be compared in tests.
"""

from __future__ import annotations

import attrs

from flodl.wire.messages import Message


@attrs.frozen
class Send:
    """Send ``message`` to rank ``rank`` (global rank id)."""

    rank: int
    message: Message


@attrs.frozen
class Broadcast:
    """Send ``message`` to each rank in ``ranks`` (ascending global ids).

    ``ranks=None`` means every rank the shell still holds a connection to; core uses it for
    messages that end the run (ShutdownWithSave), which must reach everyone still listening.
    """

    message: Message
    ranks: tuple[int, ...] | None = None


Effect = Send | Broadcast
"""One thing for the shell to do."""
