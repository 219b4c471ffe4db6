"""A :class:`Channel` carries authenticated control messages over any ``trio.abc.Stream``.

The handshakes that open one are in :mod:`flodl.transports.greeting`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Self

import trio

from flodl.errors import (
    BrokenChannel,
    ChannelClosed,
    FrameTooLarge,
)
from flodl.transports.base import NowaitStream
from flodl.transports.errors import STREAM_ERRORS, map_exceptions
from flodl.wire.codec import DEFAULT_MAX_PAYLOAD, EncodedMessage, FrameDecoder, FrameEncoder
from flodl.wire.messages import (
    Message,
)

RECEIVE_CHUNK = 64 * 1024
"""Most bytes read from the stream at once; the decoder never holds more than one frame + this."""

_BROKEN = tuple(STREAM_ERRORS)
_RECEIVING = map_exceptions(STREAM_ERRORS, "stream broke while receiving")


class Channel:
    """Sends and receives messages over one stream, under one direction key each way.

    One task may receive at a time; any number may send (a lock keeps frames whole and in
    sequence order). After the peer closes cleanly :meth:`receive` raises
    :class:`ChannelClosed` (and ``async for`` ends); a stream cut mid-frame raises
    :class:`TruncatedFrame`; a broken stream, or any use after a wire error, raises
    :class:`BrokenChannel`. Wire errors (authentication, sequence, size, validation) surface with
    their own types the first time.

    Any ``trio.abc.Stream`` will do. One that is also a
    :class:`~flodl.transports.base.NowaitStream` can be written and read without waiting
    (:meth:`send_nowait`, :meth:`receive_batch_nowait`); over any other those two raise
    ``trio.WouldBlock`` and the waiting calls do all the work.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        send_key: bytes,
        receive_key: bytes,
        receive_tags: frozenset[int],
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        self._stream = stream
        self._nowait: NowaitStream | None = stream if isinstance(stream, NowaitStream) else None
        self._encoder = FrameEncoder(send_key, max_payload=max_payload)
        self._decoder = FrameDecoder(
            receive_key, max_payload=max_payload, allowed_tags=receive_tags
        )
        self._send_lock = trio.Lock()
        self._send_broken: BaseException | None = None
        self._unsent = b""
        """The tail of frames :meth:`send_nowait` could not write at once (:meth:`flush`)."""
        self._receiving = False
        self._peer_closed = False
        self._ready: deque[Message] = deque()
        """Messages decoded by a batch read but not yet returned by :meth:`receive`."""
        self._pending_error: Exception | None = None
        """A wire error found behind good frames, raised once those are delivered."""

    @property
    def stream(self) -> trio.abc.Stream:
        """The underlying stream (for transport-specific options)."""
        return self._stream

    async def send(self, message: Message | EncodedMessage) -> None:
        """Send one message; frames of concurrent senders never interleave.

        An :class:`~flodl.wire.codec.EncodedMessage` goes out exactly as its message would.
        Raises FrameTooLarge (nothing sent, channel still usable) or BrokenChannel. If the
        send is cancelled or fails midway, part of a frame may be on the wire, so every later
        send raises BrokenChannel.
        """
        await self.send_many((message,))

    async def send_many(self, messages: Sequence[Message | EncodedMessage]) -> None:
        """Send ``messages`` in order with one write to the stream (one checkpoint).

        Same guarantees as :meth:`send`. If one is too large, the ones before it are sent
        and FrameTooLarge is raised (the ones after it are not sent; the channel stays
        usable).
        """
        lock = self._send_lock
        try:
            lock.acquire_nowait()  # uncontended: skip the extra trip through the scheduler
        except trio.WouldBlock:
            await lock.acquire()  # trio's Lock is fair: waiters are served in order
        try:
            if self._send_broken is not None:
                raise BrokenChannel(f"cannot send: an earlier send failed ({self._send_broken!r})")
            data, too_large = self._encode(messages)
            if self._unsent:
                data, self._unsent = self._unsent + data, b""
            if data:
                with map_exceptions(STREAM_ERRORS, lambda: _cannot_send(messages)):
                    try:
                        await self._stream.send_all(data)
                    except BaseException as err:
                        self._send_broken = err
                        raise
            if too_large is not None:
                raise too_large
        finally:
            lock.release()

    async def flush(self) -> None:
        """Write what :meth:`send_nowait` left unsent (nothing to do if it left nothing).

        Same guarantees as :meth:`send`.
        """
        await self.send_many(())

    def send_nowait(self, messages: Sequence[Message | EncodedMessage]) -> bool:
        """Send ``messages`` in order without waiting, if the stream allows it.

        True: every byte is written. False: the frames are numbered and partly written; the
        rest goes out with the next :meth:`send_many` or :meth:`flush`, before anything sent
        later. Raises ``trio.WouldBlock`` (nothing encoded or sent) when an async send holds
        the channel or the stream cannot write without waiting (it is not a
        :class:`~flodl.transports.base.NowaitStream`); BrokenChannel and FrameTooLarge as
        :meth:`send_many` (frames before a too-large one are still sent).
        """
        stream = self._nowait
        if stream is None or not self.writes_now:
            raise trio.WouldBlock
        if self._send_broken is not None:
            raise BrokenChannel(f"cannot send: an earlier send failed ({self._send_broken!r})")
        data, too_large = self._encode(messages)
        if data:
            with map_exceptions(STREAM_ERRORS, lambda: _cannot_send(messages)):
                try:
                    written = stream.send_nowait(data)
                except _BROKEN as err:  # nothing is half-written by anything else it raises
                    self._send_broken = err
                    raise
            self._unsent = data[written:]
        if too_large is not None:
            raise too_large
        return not self._unsent

    @property
    def writes_now(self) -> bool:
        """Whether :meth:`send_nowait` may write now: False exactly when it would raise
        ``trio.WouldBlock`` (an async send holds the channel, bytes of an earlier write wait,
        or the stream cannot write without waiting)."""
        return self._nowait is not None and not self._send_lock.locked() and not self._unsent

    def _encode(
        self, messages: Sequence[Message | EncodedMessage]
    ) -> tuple[bytes, FrameTooLarge | None]:
        """The frames of ``messages`` up to a too-large one (and that error, if any)."""
        encode = self._encoder.encode
        if len(messages) == 1:
            return encode(messages[0]), None
        frames = []
        for message in messages:
            try:
                frames.append(encode(message))
            except FrameTooLarge as err:
                return b"".join(frames), err
        return b"".join(frames), None

    async def send_eof(self) -> None:
        """Say "no more messages from this side" and keep receiving (half-closeable streams).

        Raises BrokenChannel if the stream cannot half-close or is broken.
        """
        if not isinstance(self._stream, trio.abc.HalfCloseableStream):
            raise BrokenChannel(f"{type(self._stream).__name__} cannot half-close")
        async with self._send_lock:
            with map_exceptions(STREAM_ERRORS, "cannot send end of stream"):
                await self._stream.send_eof()
            self._send_broken = ChannelClosed("end of stream already sent")

    async def receive(self) -> Message:
        """The next message from the peer.

        Raises ChannelClosed on a clean end of stream at a frame boundary (and again on every
        later call), TruncatedFrame on an end of stream mid-frame, BrokenChannel if the stream
        broke or an earlier error poisoned the channel, and the decoder's wire errors. Safe to
        cancel: bytes already read stay buffered for the next call.
        """
        ready = self._ready
        if not ready:
            ready.extend(await self.receive_batch())
        return ready.popleft()

    async def receive_batch(self) -> list[Message]:
        """Every complete message buffered from the peer, after reading the stream once if
        none was (never an empty list).

        Errors as :meth:`receive`; a wire error found after some good frames is raised by the
        next call, so the good frames ahead of it are delivered first and in order. Safe to
        cancel: bytes already read stay buffered for the next call.
        """
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this channel")
        self._receiving = True
        try:
            held = self._take_held()
            if held:
                return held
            while True:
                batch = self._decode()
                if batch:
                    return batch
                if self._peer_closed:
                    raise ChannelClosed("the peer closed the channel")
                with _RECEIVING:
                    data = await self._stream.receive_some(RECEIVE_CHUNK)
                self._feed(data)
        finally:
            self._receiving = False

    def receive_batch_nowait(self, max_bytes: int = RECEIVE_CHUNK) -> list[Message]:
        """Like :meth:`receive_batch`, but reads the stream at most once, at most ``max_bytes``,
        and never waits: [] when no complete message has arrived yet.

        Not a checkpoint. Needs a :class:`~flodl.transports.base.NowaitStream`; over another
        stream it raises ``trio.WouldBlock`` unless a result is held. Errors and
        their order as :meth:`receive_batch`; after a call that returned messages,
        :attr:`holds_result` says whether the next call answers without reading (a wire error
        found behind them): a caller waiting for readability must call again then.
        """
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this channel")
        held = self._take_held()
        if held:
            return held
        if self._decoder.buffered:  # (every read is decoded at once: usually nothing here)
            batch = self._decode()
            if batch:
                return batch
        if self._peer_closed:
            raise ChannelClosed("the peer closed the channel")
        stream = self._nowait
        if stream is None:
            raise trio.WouldBlock
        try:
            with _RECEIVING:
                data = stream.receive_nowait(max_bytes)
        except trio.WouldBlock:
            return []
        self._feed(data)
        return self._decode()

    @property
    def holds_result(self) -> bool:
        """True when the next receive answers without reading the stream (messages, or a wire
        error found behind earlier ones)."""
        return bool(self._ready) or self._pending_error is not None

    def _take_held(self) -> list[Message]:
        """Messages held back by :meth:`receive`, else raise a held wire error, else []."""
        if self._ready:
            held = list(self._ready)
            self._ready.clear()
            return held
        pending_error = self._pending_error
        if pending_error is not None:
            self._pending_error = None  # from now on the poisoned decoder answers
            raise pending_error
        return []

    def _decode(self) -> list[Message]:
        """Every complete message fed so far; a wire error behind some is held for later."""
        batch: list[Message] = []
        try:
            self._decoder.read_into(batch)
        except Exception as err:
            if not batch:
                raise
            self._pending_error = err
        return batch

    def _feed(self, data: bytes | bytearray) -> None:
        """Give ``data`` read from the stream to the decoder; b"" is the end of the stream
        (ChannelClosed, or TruncatedFrame mid-frame)."""
        if not data:
            self._decoder.end_of_stream()
            self._peer_closed = True
            raise ChannelClosed("the peer closed the channel")
        self._decoder.feed(data)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Message:
        """The next message; iteration ends when the peer closes cleanly."""
        try:
            return await self.receive()
        except ChannelClosed:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Close the stream (idempotent; closes even when cancelled, as trio streams do)."""
        await self._stream.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def _name_of(message: Message | EncodedMessage) -> str:
    plain = message.message if isinstance(message, EncodedMessage) else message
    return type(plain).__name__


def _cannot_send(messages: Sequence[Message | EncodedMessage]) -> str:
    return "cannot send " + ", ".join(_name_of(m) for m in messages)
