"""Sans-IO framing: authenticated, sequenced, size-capped frames around CBOR payloads.

Frame layout (little-endian)::

    magic   u32   0xF10D5F01
    version u16   PROTOCOL_VERSION
    tag     u16   message tag (flodl.wire.messages)
    length  u32   payload length in bytes (checked against the limit before anything is read)
    seq     u64   per-direction sequence number, 0, 1, 2, ...
    mac     32 B  HMAC-SHA256 under the direction key over the 20 header bytes and the payload
    payload       CBOR map of the message's fields

The MAC covers the sequence number, so a replayed, reordered or dropped frame is detected
(:class:`~flodl.errors.SequenceError`), and a frame from one direction or one session cannot be
spliced into another (each direction of each session has its own key, see
:mod:`flodl.wire.handshake`). Nothing here does I/O: :class:`FrameEncoder` returns bytes and
:class:`FrameDecoder` is fed bytes and yields messages.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import struct
from collections.abc import Iterator
from typing import Any

import attrs
import cbor2

from flodl.errors import (
    AuthenticationError,
    BrokenChannel,
    FrameTooLarge,
    ProtocolError,
    SequenceError,
    TruncatedFrame,
    VersionMismatch,
)
from flodl.wire.messages import Message, from_payload, to_payload

FRAME_MAGIC = 0xF10D5F01
PROTOCOL_VERSION = 2
DEFAULT_MAX_PAYLOAD = 16 * 1024 * 1024
MAX_CBOR_DEPTH = 8
"""Messages nest at most two levels (a map holding a map); 8 leaves room and stops bombs."""

_HEADER = struct.Struct("<IHHIQ")
HEADER_SIZE = _HEADER.size
MAC_SIZE = 32
PREFIX_SIZE = HEADER_SIZE + MAC_SIZE
MIN_KEY_BYTES = 16


_compare_digest = hmac.compare_digest
_Bytes = bytes | bytearray | memoryview


def _reject_tag(*_args: object) -> Any:
    raise ValueError("CBOR tags are not allowed in flodl payloads")


# Every CBOR tag is refused: flodl payloads never use them, and cbor2's built-in ones build
# rich objects (regexes, MIME messages, shared references). Unknown tags reach the tag hook;
# the built-in range is overridden explicitly.
_NO_SEMANTIC_TAGS: dict[int, Any] = {t: _reject_tag for t in (*range(0, 1100), 55799)}


class _Mac:
    """HMAC-SHA256 with the key schedule done once (the inner and outer pads are pre-hashed)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"frame key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        if len(key) > 64:
            key = hashlib.sha256(key).digest()
        key = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key)).copy
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key)).copy

    def digest(self, header: _Bytes, payload: _Bytes) -> bytes:
        inner = self._inner()
        inner.update(header)
        inner.update(payload)
        outer = self._outer()
        outer.update(inner.digest())
        return outer.digest()


@attrs.frozen
class EncodedMessage:
    """A message together with its CBOR payload, encoded once to be framed for many peers.

    Build it with :func:`encode_message`; a :class:`FrameEncoder` frames it exactly as it
    frames ``message`` (only the header and the MAC are computed per frame).
    """

    message: Message
    payload: bytes


def encode_message(message: Message) -> EncodedMessage:
    """``message`` with its payload encoded (size limits are checked when it is framed)."""
    return EncodedMessage(message, cbor2.dumps(to_payload(message)))


def encode_frame(message: Message, *, key: bytes, seq: int) -> bytes:
    """One complete frame for ``message`` with sequence number ``seq`` under ``key``."""
    return FrameEncoder(key, first_seq=seq).encode(message)


class FrameEncoder:
    """Turns messages into frames for one direction, numbering them 0, 1, 2, ..."""

    __slots__ = ("_mac", "_max_payload", "_seq")

    def __init__(
        self, key: bytes, *, first_seq: int = 0, max_payload: int = DEFAULT_MAX_PAYLOAD
    ) -> None:
        self._mac = _Mac(key)
        self._seq = first_seq
        self._max_payload = max_payload

    @property
    def next_seq(self) -> int:
        """The sequence number the next frame will carry."""
        return self._seq

    def encode(self, message: Message | EncodedMessage) -> bytes:
        """Frame ``message``; raises FrameTooLarge (and consumes no sequence number) if too big.

        An :class:`EncodedMessage` is framed with its ready payload (same bytes on the wire).
        """
        if isinstance(message, EncodedMessage):
            payload = message.payload
            plain = message.message
        else:
            payload = cbor2.dumps(to_payload(message))
            plain = message
        if len(payload) > self._max_payload:
            raise FrameTooLarge(
                f"{type(plain).__name__} payload is {len(payload)} bytes, "
                f"above the limit of {self._max_payload}"
            )
        header = _HEADER.pack(FRAME_MAGIC, PROTOCOL_VERSION, plain.TAG, len(payload), self._seq)
        self._seq += 1
        return b"".join((header, self._mac.digest(header, payload), payload))


class FrameDecoder:
    """Feed it bytes; pull authenticated, in-order, validated messages out.

    Guarantees: a payload length above ``max_payload`` raises :class:`FrameTooLarge` as soon as
    the header is complete, before any payload is buffered beyond what was fed; the MAC is
    verified before the payload is parsed; after any error the decoder is poisoned and every
    later call raises :class:`BrokenChannel` (a stream that lied once is never trusted again).
    """

    __slots__ = (
        "_allowed",
        "_buffer",
        "_error",
        "_mac",
        "_max_payload",
        "_payloads",
        "_seq",
        "_start",
    )

    def __init__(
        self,
        key: bytes,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        allowed_tags: frozenset[int] | None = None,
        first_seq: int = 0,
    ) -> None:
        self._mac = _Mac(key)
        self._max_payload = max_payload
        self._allowed = allowed_tags
        self._seq = first_seq
        # Unconsumed bytes are self._buffer[self._start:]. A buffer that holds whole frames is
        # the bytes object as fed (frames are sliced out of it, no copy of the rest); it
        # becomes a bytearray only while a frame arrives in pieces.
        self._buffer: bytes | bytearray = b""
        self._start = 0
        self._error: Exception | None = None
        self._payloads = PayloadDecoder()

    @property
    def buffered(self) -> int:
        """Bytes fed but not yet consumed by a complete frame."""
        return len(self._buffer) - self._start

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes received from the peer (copied unless ``data`` is immutable bytes)."""
        if self._error is not None:
            self._check_usable()
        buffer = self._buffer
        if self._start:
            buffer = buffer[self._start :]
            self._start = 0
        if not buffer:
            self._buffer = bytes(data)
        elif type(buffer) is bytearray:
            buffer += data
            self._buffer = buffer
        else:
            self._buffer = bytearray(buffer) + data

    def next_message(self) -> Message | None:
        """The next complete message, or None if more bytes are needed."""
        if self._error is not None:
            self._check_usable()
        try:
            return self._next()
        except Exception as err:
            self._error = err
            raise

    def read_into(self, out: list[Message]) -> None:
        """Append every message complete in the bytes fed so far to ``out``, in order.

        On a wire error the messages before the bad frame stay appended, the error is raised
        and the decoder is poisoned (as :meth:`next_message`).
        """
        if self._error is not None:
            self._check_usable()
        next_message = self._next
        try:
            while (message := next_message()) is not None:
                out.append(message)
        except Exception as err:
            self._error = err
            raise

    def __iter__(self) -> Iterator[Message]:
        """Every message that is complete in the bytes fed so far."""
        while (message := self.next_message()) is not None:
            yield message

    def end_of_stream(self) -> None:
        """Say the peer closed its side; raises TruncatedFrame if a frame was cut short."""
        self._check_usable()
        if self.buffered:
            err = TruncatedFrame(
                f"stream ended inside a frame ({self.buffered} bytes of an incomplete frame)"
            )
            self._error = err
            raise err

    def _check_usable(self) -> None:
        if self._error is not None:
            raise BrokenChannel(f"channel unusable after an earlier error: {self._error}")

    def _next(self) -> Message | None:
        buffer = self._buffer
        start = self._start
        available = len(buffer) - start
        if available < HEADER_SIZE:
            return None
        magic, version, tag, length, seq = _HEADER.unpack_from(buffer, start)
        if magic != FRAME_MAGIC or version != PROTOCOL_VERSION or length > self._max_payload:
            raise self._header_error(magic, version, length)
        payload_at = start + PREFIX_SIZE
        end = payload_at + length
        if len(buffer) < end:
            return None
        # Plain slices: for control-sized frames they are cheaper than memoryviews.
        header = buffer[start : start + HEADER_SIZE]
        mac = buffer[start + HEADER_SIZE : payload_at]
        payload = buffer[payload_at:end]
        if end == len(buffer):
            self._buffer = b""
            self._start = 0
        else:
            self._start = end
        if not _compare_digest(self._mac.digest(header, payload), mac):
            raise AuthenticationError(
                f"frame {seq} (tag {tag}, {length} bytes) failed authentication: "
                "forged, corrupted, or sent under another key"
            )
        if seq != self._seq:
            what = "replayed or reordered" if seq < self._seq else "out of order (frames lost)"
            raise SequenceError(f"frame {what}: sequence {seq}, expected {self._seq}")
        self._seq = seq + 1
        return from_payload(tag, self._payloads.decode(payload), self._allowed)

    def _header_error(self, magic: int, version: int, length: int) -> ProtocolError:
        if magic != FRAME_MAGIC:
            return ProtocolError(f"bad frame magic 0x{magic:08X} (expected 0x{FRAME_MAGIC:08X})")
        if version != PROTOCOL_VERSION:
            return VersionMismatch(
                f"peer speaks wire protocol version {version}, this side {PROTOCOL_VERSION}"
            )
        return FrameTooLarge(
            f"frame announces a {length}-byte payload, above the limit of {self._max_payload}"
        )


def decode_payload(payload: bytes | memoryview) -> object:
    """Decode exactly one CBOR item: every tag refused, nesting capped, no trailing bytes."""
    return PayloadDecoder().decode(payload)


def _new_cbor_decoder() -> Any:
    return cbor2.CBORDecoder(
        io.BytesIO(b""),
        tag_hook=_reject_tag,
        semantic_decoders=_NO_SEMANTIC_TAGS,
        max_depth=MAX_CBOR_DEPTH,
        allow_indefinite=False,
        allow_duplicate_keys=False,
        strict_hashable_types=True,
    )


class PayloadDecoder:
    """Hardened single-item CBOR decoding with one reusable cbor2 decoder.

    Building a cbor2 decoder with these options costs more than decoding a typical message
    (the table of refused tags is converted each time), so one is built up front and pointed
    at each payload in turn. After an error it is replaced, so no state survives a bad input.
    """

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = _new_cbor_decoder()

    def decode(self, payload: _Bytes) -> object:
        """Exactly one CBOR item; ProtocolError for anything else (see :func:`decode_payload`)."""
        stream = io.BytesIO(payload)
        decoder = self._decoder
        decoder.fp = stream
        try:
            value = decoder.decode()
        except (cbor2.CBORDecodeError, ValueError, TypeError, OverflowError, RecursionError) as err:
            self._decoder = _new_cbor_decoder()
            raise ProtocolError(f"payload is not valid flodl CBOR: {err}") from None
        if stream.tell() != len(payload):
            self._decoder = _new_cbor_decoder()
            raise ProtocolError(
                f"payload has {len(payload) - stream.tell()} trailing bytes after its CBOR item"
            )
        return value
