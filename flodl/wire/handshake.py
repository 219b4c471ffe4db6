"""Sans-IO handshake: a rank proves it holds the session key and both sides agree on frame keys.

Two fixed binary messages (little-endian, no CBOR)::

    ClientHello (rank -> coordinator, 112 bytes)
        magic       u32   0xF10D5C11
        version     u16   PROTOCOL_VERSION
        flags       u16   0, or HELLO_AGENT (a node agent: ``rank`` is its node rank, and
                          ``world_size`` 0 takes the coordinator's)
        rank        u32
        world_size  u32
        signature   32 B  model/dataset signature, all zero = none
        nonce_c     32 B  fresh random
        mac         32 B  HMAC-SHA256(session_key, b"flodl-hello" + the 80 bytes above)

    ServerHello (coordinator -> rank, 76 bytes)
        magic       u32   0xF10D5C12
        version     u16   PROTOCOL_VERSION
        status      u16   HelloStatus (0 = accepted)
        detail      u32   for WORLD_SIZE_MISMATCH the coordinator's world size, else 0
        nonce_s     32 B  fresh random
        mac         32 B  HMAC-SHA256(session_key, b"flodl-accept" + nonce_c + the 44 bytes above)

The reply's MAC covers the client's nonce, so it answers this hello and no other. Each direction
of the session then uses its own frame key (:func:`derive_keys`), mixed from both nonces: frames
recorded in one session fail authentication in any other, even if the hello itself is replayed.

Checks run in a fixed order: magic (a non-flodl peer gets :class:`ProtocolError`), version, MAC
(:class:`WrongKey`), then the fields. Nothing here does I/O; time and randomness are not
parameters (nonces come from :mod:`secrets`).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct

import attrs

from flodl.errors import (
    ConfigError,
    DuplicateRank,
    HandshakeError,
    HandshakeVersionMismatch,
    ProtocolError,
    RankOutOfRange,
    RejectedByCoordinator,
    SignatureMismatch,
    WorldSizeMismatch,
    WrongKey,
)
from flodl.wire.codec import MIN_KEY_BYTES, PROTOCOL_VERSION

CLIENT_HELLO_MAGIC = 0xF10D5C11
SERVER_HELLO_MAGIC = 0xF10D5C12
SIGNATURE_SIZE = 32
NONCE_SIZE = 32
MAC_SIZE = 32
NO_SIGNATURE = bytes(SIGNATURE_SIZE)

_CLIENT_FIXED = struct.Struct("<IHHII")  # magic, version, flags, rank, world_size
_SERVER_FIXED = struct.Struct("<IHHI")  # magic, version, status, detail
_MAGIC_VERSION = struct.Struct("<IH")
CLIENT_HELLO_SIZE = _CLIENT_FIXED.size + SIGNATURE_SIZE + NONCE_SIZE + MAC_SIZE
SERVER_HELLO_SIZE = _SERVER_FIXED.size + NONCE_SIZE + MAC_SIZE
PREFIX_CHECK_SIZE = _MAGIC_VERSION.size
"""Bytes of a hello that :func:`check_client_prefix` needs to judge magic and version."""

HELLO_AGENT = 0x0001
"""ClientHello flag: the peer is a node agent (:mod:`flodl.agent`), and the hello's rank field
is its node rank. Every other flag bit is reserved."""

_HELLO_LABEL = b"flodl-hello"
_ACCEPT_LABEL = b"flodl-accept"
_C2S_LABEL = b"flodl-c2s"
_S2C_LABEL = b"flodl-s2c"
_U32_MAX = (1 << 32) - 1


class HelloStatus(enum.IntEnum):
    """The coordinator's answer to a ClientHello."""

    ACCEPTED = 0
    WRONG_KEY = 1
    VERSION_MISMATCH = 2
    WORLD_SIZE_MISMATCH = 3
    RANK_OUT_OF_RANGE = 4
    DUPLICATE_RANK = 5
    SIGNATURE_MISMATCH = 6


_STATUS_OF_ERROR: tuple[tuple[type[HandshakeError], HelloStatus], ...] = (
    (WrongKey, HelloStatus.WRONG_KEY),
    (HandshakeVersionMismatch, HelloStatus.VERSION_MISMATCH),
    (WorldSizeMismatch, HelloStatus.WORLD_SIZE_MISMATCH),
    (RankOutOfRange, HelloStatus.RANK_OUT_OF_RANGE),
    (DuplicateRank, HelloStatus.DUPLICATE_RANK),
    (SignatureMismatch, HelloStatus.SIGNATURE_MISMATCH),
)


@attrs.frozen
class SessionKeys:
    """The two frame keys of one session: rank -> coordinator and coordinator -> rank."""

    to_coordinator: bytes = attrs.field(repr=False)
    to_rank: bytes = attrs.field(repr=False)


@attrs.frozen
class Hello:
    """A verified ClientHello, as the coordinator sees it."""

    rank: int
    """The rank, or an agent's node rank."""
    world_size: int
    signature: bytes | None
    nonce: bytes = attrs.field(repr=False)
    agent: bool = False
    """A node agent's hello (:data:`HELLO_AGENT`)."""


@attrs.frozen
class ClientState:
    """What the rank keeps between sending its hello and checking the reply."""

    key: bytes = attrs.field(repr=False)
    rank: int
    world_size: int
    nonce: bytes = attrs.field(repr=False)
    agent: bool = False


def check_session_key(key: bytes) -> bytes:
    """Return ``key`` if it is bytes of at least 16 bytes; raise ConfigError otherwise."""
    if not isinstance(key, bytes) or len(key) < MIN_KEY_BYTES:
        shown = f"{len(key)} bytes" if isinstance(key, bytes) else type(key).__name__
        raise ConfigError(f"the session key must be at least {MIN_KEY_BYTES} bytes, got {shown}")
    return key


def check_signature(signature: bytes | None) -> bytes | None:
    """Return a valid signature (exactly 32 bytes, not all zero) or None; ConfigError otherwise."""
    if signature is None:
        return None
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_SIZE:
        raise ConfigError(
            f"a model/dataset signature must be {SIGNATURE_SIZE} bytes (e.g. a SHA-256 digest)"
        )
    if signature == NO_SIGNATURE:
        raise ConfigError("an all-zero signature means 'none' on the wire: pass None instead")
    return signature


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def derive_keys(key: bytes, client_nonce: bytes, server_nonce: bytes) -> SessionKeys:
    """Both frame keys of the session identified by the two nonces."""
    check_session_key(key)
    return SessionKeys(
        to_coordinator=_mac(key, _C2S_LABEL, client_nonce, server_nonce),
        to_rank=_mac(key, _S2C_LABEL, client_nonce, server_nonce),
    )


def make_client_hello(
    key: bytes,
    rank: int,
    world_size: int,
    signature: bytes | None = None,
    *,
    agent: bool = False,
) -> tuple[bytes, ClientState]:
    """The rank's hello (with a fresh nonce) and the state needed to check the reply;
    ``agent``: a node agent's, ``rank`` its node rank, and ``world_size`` may be 0 (the
    coordinator's, whatever it is)."""
    check_session_key(key)
    signature = check_signature(signature)
    # Only what the layout cannot carry is refused here; whether the rank fits the world is
    # the coordinator's call, so the rank hears it as a typed refusal.
    lowest = 0 if agent else 1  # an agent may leave the world size to the coordinator
    if type(world_size) is not int or not lowest <= world_size <= _U32_MAX:
        raise ConfigError(f"world size must be an integer in [{lowest}, 2**32), got {world_size!r}")
    if type(rank) is not int or not 0 <= rank <= _U32_MAX:
        raise ConfigError(f"rank must be an integer in [0, 2**32), got {rank!r}")
    nonce = secrets.token_bytes(NONCE_SIZE)
    body = (
        _CLIENT_FIXED.pack(
            CLIENT_HELLO_MAGIC, PROTOCOL_VERSION, HELLO_AGENT if agent else 0, rank, world_size
        )
        + (signature or NO_SIGNATURE)
        + nonce
    )
    hello = body + _mac(key, _HELLO_LABEL, body)
    return hello, ClientState(key=key, rank=rank, world_size=world_size, nonce=nonce, agent=agent)


def check_client_prefix(data: bytes) -> None:
    """Judge magic and version from the first bytes of a hello, as soon as they arrive.

    Raises ProtocolError ("not a flodl peer") for a wrong magic and HandshakeVersionMismatch
    for another version; returns quietly while fewer bytes than needed are given.
    """
    if len(data) >= 4:
        (magic,) = struct.unpack_from("<I", data)
        if magic != CLIENT_HELLO_MAGIC:
            raise ProtocolError(
                f"not a flodl peer: first bytes {bytes(data[:8])!r} are not a flodl hello"
            )
    if len(data) >= PREFIX_CHECK_SIZE:
        _, version = _MAGIC_VERSION.unpack_from(data)
        if version != PROTOCOL_VERSION:
            raise HandshakeVersionMismatch(
                f"rank speaks handshake version {version}, this coordinator {PROTOCOL_VERSION}"
            )


def check_client_hello(
    data: bytes, key: bytes, world_size: int, signature: bytes | None = None
) -> Hello:
    """Verify a complete ClientHello against the coordinator's settings.

    Raises, in this order: ProtocolError (not a flodl peer, or wrong length),
    HandshakeVersionMismatch, WrongKey (MAC fails), ProtocolError (reserved flags set),
    WorldSizeMismatch, RankOutOfRange, SignatureMismatch. A coordinator with a signature
    requires the same one from every rank; one without accepts any.
    """
    check_session_key(key)
    signature = check_signature(signature)
    check_client_prefix(data)
    if len(data) != CLIENT_HELLO_SIZE:
        raise ProtocolError(f"flodl hello has {len(data)} bytes, expected {CLIENT_HELLO_SIZE}")
    body, mac = data[:-MAC_SIZE], data[-MAC_SIZE:]
    if not hmac.compare_digest(_mac(key, _HELLO_LABEL, body), mac):
        raise WrongKey("the rank's hello does not verify: it holds another session key")
    _, _, flags, rank, their_world = _CLIENT_FIXED.unpack_from(data)
    offset = _CLIENT_FIXED.size
    their_signature = bytes(data[offset : offset + SIGNATURE_SIZE])
    nonce = bytes(data[offset + SIGNATURE_SIZE : offset + SIGNATURE_SIZE + NONCE_SIZE])
    if flags & ~HELLO_AGENT:
        raise ProtocolError(f"hello sets reserved flags 0x{flags:04X}")
    agent = bool(flags & HELLO_AGENT)
    who = f"node {rank}'s agent" if agent else f"rank {rank}"
    if their_world != world_size and not (agent and their_world == 0):
        raise WorldSizeMismatch(
            f"{who} expects world size {their_world}, the coordinator runs {world_size}"
        )
    if rank >= world_size:
        # Every node runs at least one rank: there are never more nodes than ranks.
        what = "node rank" if agent else "rank"
        raise RankOutOfRange(f"{what} {rank} is not in range({world_size})")
    sent = None if their_signature == NO_SIGNATURE else their_signature
    if signature is not None and (sent is None or not hmac.compare_digest(sent, signature)):
        what = "sent no signature" if sent is None else f"sent signature {sent.hex()[:16]}..."
        raise SignatureMismatch(f"{who} {what}; the coordinator expects {signature.hex()[:16]}...")
    return Hello(rank=rank, world_size=their_world, signature=sent, nonce=nonce, agent=agent)


def hello_nonce(data: bytes) -> bytes:
    """The client nonce of a complete ClientHello (verified or not), to bind a refusal to it."""
    start = _CLIENT_FIXED.size + SIGNATURE_SIZE
    return bytes(data[start : start + NONCE_SIZE])


def status_for(error: BaseException) -> HelloStatus | None:
    """The rejection status that tells a rank about ``error`` (None: no reply is due)."""
    for kind, status in _STATUS_OF_ERROR:
        if isinstance(error, kind):
            return status
    return None


def make_server_hello(
    key: bytes,
    client_nonce: bytes,
    status: HelloStatus = HelloStatus.ACCEPTED,
    detail: int = 0,
) -> tuple[bytes, bytes]:
    """The coordinator's reply to the hello carrying ``client_nonce``, and its own nonce.

    ``client_nonce`` may be 32 zero bytes when the hello could not be read far enough (a
    version mismatch); the rank judges the version before the MAC.
    """
    check_session_key(key)
    nonce = secrets.token_bytes(NONCE_SIZE)
    body = _SERVER_FIXED.pack(SERVER_HELLO_MAGIC, PROTOCOL_VERSION, status, detail) + nonce
    return body + _mac(key, _ACCEPT_LABEL, client_nonce, body), nonce


def check_server_hello(data: bytes, state: ClientState) -> SessionKeys:
    """Verify the coordinator's reply; return the session's frame keys if it accepted.

    Raises ProtocolError (not a flodl coordinator, wrong length), HandshakeVersionMismatch,
    WrongKey (the reply does not verify under this rank's key), or, when the coordinator
    refused, the error class of its reason (WorldSizeMismatch, RankOutOfRange, DuplicateRank,
    SignatureMismatch, WrongKey, HandshakeVersionMismatch; RejectedByCoordinator for a reason
    this version does not know), with a message saying the coordinator refused and why.
    """
    if len(data) >= 4:
        (magic,) = struct.unpack_from("<I", data)
        if magic != SERVER_HELLO_MAGIC:
            raise ProtocolError(f"not a flodl coordinator: reply starts {bytes(data[:8])!r}")
    if len(data) >= PREFIX_CHECK_SIZE:
        _, version = _MAGIC_VERSION.unpack_from(data)
        if version != PROTOCOL_VERSION:
            raise HandshakeVersionMismatch(
                f"the coordinator speaks handshake version {version}, this rank {PROTOCOL_VERSION}"
            )
    if len(data) != SERVER_HELLO_SIZE:
        raise ProtocolError(
            f"coordinator reply has {len(data)} bytes, expected {SERVER_HELLO_SIZE}"
        )
    body, mac = data[:-MAC_SIZE], data[-MAC_SIZE:]
    if not hmac.compare_digest(_mac(state.key, _ACCEPT_LABEL, state.nonce, body), mac):
        raise WrongKey(
            "the coordinator's reply does not verify: the coordinator holds another session key"
        )
    _, _, status, detail = _SERVER_FIXED.unpack_from(data)
    server_nonce = bytes(data[_SERVER_FIXED.size : _SERVER_FIXED.size + NONCE_SIZE])
    if status == HelloStatus.ACCEPTED:
        return derive_keys(state.key, state.nonce, server_nonce)
    raise _refusal(status, detail, state)


def _refusal(status: int, detail: int, state: ClientState) -> HandshakeError:
    who = f"the coordinator refused {'node' if state.agent else 'rank'} {state.rank}"
    if status == HelloStatus.WRONG_KEY:
        return WrongKey(f"{who}: its hello did not verify under the coordinator's key")
    if status == HelloStatus.VERSION_MISMATCH:
        return HandshakeVersionMismatch(f"{who}: protocol version {PROTOCOL_VERSION} unsupported")
    if status == HelloStatus.WORLD_SIZE_MISMATCH:
        return WorldSizeMismatch(
            f"{who}: world size {state.world_size} does not match the coordinator's {detail}"
        )
    if status == HelloStatus.RANK_OUT_OF_RANGE:
        return RankOutOfRange(f"{who}: rank out of the coordinator's range")
    if status == HelloStatus.DUPLICATE_RANK:
        held = "an agent for that node" if state.agent else "that rank"
        return DuplicateRank(f"{who}: another live connection already holds {held}")
    if status == HelloStatus.SIGNATURE_MISMATCH:
        return SignatureMismatch(f"{who}: model/dataset signature does not match")
    return RejectedByCoordinator(f"{who} for a reason this version does not know (status {status})")
