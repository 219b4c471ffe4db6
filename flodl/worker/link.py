"""The rank's link to its coordinator: the handshake, the receiver and the heartbeat.

Each is a plain function the worker runs (the receiver and the heartbeat as tasks of its
nursery); what a message means is the rank machine's business, not theirs.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from flodl.errors import CoordinatorError, FlodlError
from flodl.transports.channel import Channel
from flodl.transports.greeting import connect_rank
from flodl.transports.reach import local_address, reach_patiently
from flodl.wire.messages import Message
from flodl.worker.config import WorkerConfig
from flodl.worker.outbox import Outbox

__all__ = ["beat", "local_address", "open_channel", "receive_until_lost"]


async def connect_patiently(config: WorkerConfig) -> trio.abc.Stream:
    """A stream to ``config.coordinator``, tried for up to ``config.join_timeout`` seconds
    (:func:`reach_patiently`)."""
    return await reach_patiently(config.coordinator, config.join_timeout, f"rank {config.rank}")


async def open_channel(config: WorkerConfig) -> Channel:
    """Connect to ``config.coordinator`` (:func:`connect_patiently`) and complete the
    handshake as ``config.rank``.

    CoordinatorError when the coordinator cannot be reached within the join timeout, or there
    is no handshake within the heartbeat timeout once connected; the handshake's typed error
    when the coordinator refuses. Nothing is left open on failure.
    """
    stream = await connect_patiently(config)
    try:
        with trio.fail_after(config.heartbeat_timeout):
            try:
                return await connect_rank(
                    stream, config.session_key, config.rank, config.world_size
                )
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
    except trio.TooSlowError:
        raise CoordinatorError(
            f"rank {config.rank}: no handshake with the coordinator at {config.coordinator} "
            f"within {config.heartbeat_timeout:g} s"
        ) from None


async def receive_until_lost(
    channel: Channel,
    timeout: float,
    on_message: Callable[[Message], None],
    on_lost: Callable[[FlodlError], None],
) -> None:
    """Hand every message to ``on_message`` until no frame arrives for ``timeout`` seconds or
    the connection ends; then ``on_lost`` says why, once, and this returns. An error raised by
    ``on_message`` (a message the protocol does not allow) also counts as losing the link."""
    try:
        while True:
            with trio.move_on_after(timeout) as scope:
                message = await channel.receive()
            if scope.cancelled_caught:
                on_lost(
                    CoordinatorError(
                        f"the coordinator has been silent for {timeout:g} s "
                        "(FLODL_HEARTBEAT_TIMEOUT); giving up on it"
                    )
                )
                return
            on_message(message)
    except FlodlError as err:  # the channel maps stream errors to ours
        on_lost(CoordinatorError(f"lost the connection to the coordinator: {err}"))


async def beat(outbox: Outbox, interval: float, heartbeat: Callable[[], Message | None]) -> None:
    """Every ``interval`` seconds, on a fixed grid, send what ``heartbeat()`` gives (a
    Heartbeat, the rank's held batch reports, or nothing), until the outbox is closed (the
    coordinator is lost) or this task is cancelled. It goes out behind what the outbox holds,
    so held reports never overtake a message the machine produced before them."""
    next_beat = trio.current_time()
    while not outbox.closed:
        next_beat += interval
        await trio.sleep_until(next_beat)
        message = heartbeat()
        if message is not None:
            outbox.put(message)
            await outbox.flush()
