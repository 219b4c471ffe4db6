"""Send stamps of the split mode: the send time carried in the message itself.

Across processes the send time travels in the message itself, in a field the coordinator's
machine never acts on for these synthetic ranks: Batch.batch_loss (the machine only sums it
into an epoch's mean loss, and these epochs never end), Heartbeat.step_count (ignored by the
machine; whole microseconds), Metrics.avg_loss (unread: the epoch loss comes from the Batch
reports) and SyncAck.pre_norm (unread). CLOCK_MONOTONIC is one clock for every process of a
Linux machine, and time.perf_counter reads it too (checked in :func:`clock_check`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import cbor2
import trio
import trio.lowlevel

from flodl.wire.codec import EncodedMessage, FrameEncoder
from flodl.wire.messages import Batch, Batches, Heartbeat, Message, Metrics, SyncAck, to_payload

_STAMP_FIELD: dict[type[Message], str] = {
    Batch: "batch_loss",
    Batches: "batch_loss",
    Heartbeat: "step_count",
    Metrics: "avg_loss",
    SyncAck: "pre_norm",
}
"""The field each kind carries its send time in (seconds; Heartbeat: whole microseconds)."""


def stamped_payload(message: Message, at: float) -> dict[str, Any]:
    """``message``'s fields as they go on the wire, carrying send time ``at`` (CLOCK_MONOTONIC
    seconds) where its kind has room for it."""
    fields = to_payload(message)
    name = _STAMP_FIELD.get(type(message))
    if isinstance(message, Batches):
        fields["batch_loss"] = [*message.batch_loss[:-1], at]  # the last entry's loss
    elif name is not None:
        fields[name] = round(at * 1e6) if name == "step_count" else at
    return fields


def stamped_frames(encoder: FrameEncoder, messages: Iterable[Message], at: float) -> bytes:
    """The frames of ``messages``, each stamped with ``at``: the library's framing around the
    stamped fields, so what the coordinator decodes is the stamped message (same tag)."""
    encode, dumps = encoder.encode, cbor2.dumps
    return b"".join(
        [
            encode(EncodedMessage(message, dumps(stamped_payload(message, at))))
            for message in messages
        ]
    )


def stamp_of(message: Message) -> float | None:
    """The send time :func:`stamped_payload` put into ``message`` (None: a kind it leaves
    alone)."""
    if isinstance(message, Batch):
        return message.batch_loss
    if isinstance(message, Batches):
        return message.batch_loss[-1]
    if isinstance(message, Heartbeat):
        return message.step_count / 1e6
    if isinstance(message, Metrics):
        return message.avg_loss
    if isinstance(message, SyncAck):
        return message.pre_norm
    return None


def clock_check() -> dict[str, str]:
    """How time.perf_counter and time.monotonic are implemented here (the same clock on Linux)."""
    return {
        name: time.get_clock_info(name).implementation for name in ("perf_counter", "monotonic")
    }


def trio_clock_offset() -> float:
    """trio.current_time() minus time.perf_counter() in this run, to within half a microsecond.

    trio's system clock is perf_counter plus a random offset fixed for the run.
    """
    best = math.inf
    offset = 0.0
    for _ in range(5):
        before = time.perf_counter()
        now = trio.current_time()
        after = time.perf_counter()
        if after - before < best:
            best = after - before
            offset = now - (before + after) / 2.0
    return offset
