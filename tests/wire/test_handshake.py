"""The sans-IO handshake: layouts, check order, typed refusals, key derivation."""

from __future__ import annotations

import struct

import pytest

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
from flodl.wire import handshake as hs
from flodl.wire.codec import PROTOCOL_VERSION
from flodl.wire.handshake import (
    CLIENT_HELLO_SIZE,
    SERVER_HELLO_SIZE,
    HelloStatus,
    check_client_hello,
    check_client_prefix,
    check_server_hello,
    derive_keys,
    make_client_hello,
    make_server_hello,
)

KEY = b"handshake-test-key-0123456789abc"
OTHER_KEY = b"some-other-key-0123456789abcdefg"
SIG = bytes(range(1, 33))


def forged_hello(version: int = PROTOCOL_VERSION, flags: int = 0, rank: int = 1) -> bytes:
    """A correctly MACed hello with chosen header fields."""
    body = struct.pack("<IHHII", hs.CLIENT_HELLO_MAGIC, version, flags, rank, 3)
    body += bytes(32) + bytes(range(32))
    return body + hs._mac(KEY, b"flodl-hello", body)


def test_layout_sizes() -> None:
    hello, _ = make_client_hello(KEY, 0, 2)
    reply, nonce = make_server_hello(KEY, bytes(32))
    assert len(hello) == CLIENT_HELLO_SIZE == 112
    assert len(reply) == SERVER_HELLO_SIZE == 76
    assert len(nonce) == 32


def test_accepted_handshake_gives_both_sides_the_same_two_keys() -> None:
    hello_bytes, state = make_client_hello(KEY, 2, 4, SIG)
    hello = check_client_hello(hello_bytes, KEY, 4, SIG)
    assert (hello.rank, hello.world_size, hello.signature) == (2, 4, SIG)
    reply, server_nonce = make_server_hello(KEY, hello.nonce)
    rank_keys = check_server_hello(reply, state)
    coord_keys = derive_keys(KEY, hello.nonce, server_nonce)
    assert rank_keys == coord_keys
    assert rank_keys.to_coordinator != rank_keys.to_rank
    assert len(rank_keys.to_rank) == 32


def test_every_session_has_fresh_nonces_and_keys() -> None:
    first, _ = make_client_hello(KEY, 0, 2)
    second, _ = make_client_hello(KEY, 0, 2)
    assert first[:16] == second[:16]  # same header
    assert hs.hello_nonce(first) != hs.hello_nonce(second)
    a = derive_keys(KEY, b"c" * 32, b"s" * 32)
    b = derive_keys(KEY, b"c" * 32, b"t" * 32)
    assert a.to_coordinator != b.to_coordinator and a.to_rank != b.to_rank


def test_non_flodl_peer_is_refused_from_its_first_four_bytes() -> None:
    with pytest.raises(ProtocolError, match="not a flodl peer") as info:
        check_client_prefix(b"GET ")
    assert type(info.value) is ProtocolError
    check_client_prefix(b"\x11\x5c")  # too short to judge: no verdict yet
    with pytest.raises(ProtocolError, match="not a flodl peer"):
        check_client_hello(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", KEY, 3)


def test_version_is_checked_before_the_mac() -> None:
    hello = forged_hello(version=PROTOCOL_VERSION + 1)
    with pytest.raises(HandshakeVersionMismatch):
        check_client_prefix(hello[:6])
    with pytest.raises(HandshakeVersionMismatch):
        check_client_hello(hello, OTHER_KEY, 3)  # wrong key too: version wins


def test_wrong_key_is_checked_before_the_fields() -> None:
    hello, _ = make_client_hello(OTHER_KEY, 9, 5, SIG)  # everything else wrong as well
    with pytest.raises(WrongKey):
        check_client_hello(hello, KEY, 3)


def test_reserved_flags_and_wrong_length_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="reserved flags"):
        check_client_hello(forged_hello(flags=2), KEY, 3)
    hello, _ = make_client_hello(KEY, 0, 3)
    with pytest.raises(ProtocolError, match="expected 112"):
        check_client_hello(hello + b"\0", KEY, 3)


@pytest.mark.parametrize(
    ("rank", "world", "signature", "error"),
    [
        (1, 4, None, WorldSizeMismatch),
        (3, 3, None, RankOutOfRange),
        (1, 3, None, SignatureMismatch),  # coordinator requires one, rank sent none
        (1, 3, bytes(range(2, 34)), SignatureMismatch),
    ],
)
def test_field_checks(
    rank: int, world: int, signature: bytes | None, error: type[HandshakeError]
) -> None:
    hello, _ = make_client_hello(KEY, rank, world, signature)
    with pytest.raises(error) as info:
        check_client_hello(hello, KEY, 3, SIG)
    assert type(info.value) is error


def test_coordinator_without_signature_accepts_a_rank_with_one() -> None:
    hello, _ = make_client_hello(KEY, 1, 3, SIG)
    assert check_client_hello(hello, KEY, 3).signature == SIG


@pytest.mark.parametrize(
    ("status", "error", "words"),
    [
        (HelloStatus.WRONG_KEY, WrongKey, "did not verify"),
        (HelloStatus.VERSION_MISMATCH, HandshakeVersionMismatch, "version"),
        (HelloStatus.WORLD_SIZE_MISMATCH, WorldSizeMismatch, "world size 4 does not match"),
        (HelloStatus.RANK_OUT_OF_RANGE, RankOutOfRange, "out of"),
        (HelloStatus.DUPLICATE_RANK, DuplicateRank, "already holds"),
        (HelloStatus.SIGNATURE_MISMATCH, SignatureMismatch, "signature"),
        (99, RejectedByCoordinator, "status 99"),
    ],
)
def test_rank_turns_a_refusal_into_the_same_error_class(
    status: int, error: type[HandshakeError], words: str
) -> None:
    hello, state = make_client_hello(KEY, 1, 4)
    reply, _ = make_server_hello(KEY, hs.hello_nonce(hello), status, 3)  # type: ignore[arg-type]
    with pytest.raises(error, match="the coordinator refused rank 1") as info:
        check_server_hello(reply, state)
    assert type(info.value) is error
    assert words in str(info.value)


def test_world_size_refusal_names_the_coordinators_world_size() -> None:
    hello, state = make_client_hello(KEY, 1, 4)
    reply, _ = make_server_hello(KEY, hs.hello_nonce(hello), HelloStatus.WORLD_SIZE_MISMATCH, 3)
    with pytest.raises(WorldSizeMismatch, match="coordinator's 3"):
        check_server_hello(reply, state)


def test_reply_under_another_key_or_to_another_hello_is_wrong_key() -> None:
    hello, state = make_client_hello(KEY, 1, 3)
    reply, _ = make_server_hello(OTHER_KEY, hs.hello_nonce(hello))
    with pytest.raises(WrongKey):
        check_server_hello(reply, state)
    other_hello, _ = make_client_hello(KEY, 1, 3)
    reply_to_other, _ = make_server_hello(KEY, hs.hello_nonce(other_hello))
    with pytest.raises(WrongKey):
        check_server_hello(reply_to_other, state)
    # A refusal that does not verify is WrongKey, whatever status it claims.
    forged, _ = make_server_hello(OTHER_KEY, hs.hello_nonce(hello), HelloStatus.DUPLICATE_RANK)
    with pytest.raises(WrongKey):
        check_server_hello(forged, state)


def test_reply_checks_magic_then_version() -> None:
    _, state = make_client_hello(KEY, 1, 3)
    with pytest.raises(ProtocolError, match="not a flodl coordinator"):
        check_server_hello(b"HTTP/1.1 400 Bad Request\r\n", state)
    body = struct.pack("<IHHI", hs.SERVER_HELLO_MAGIC, PROTOCOL_VERSION + 1, 0, 0)
    with pytest.raises(HandshakeVersionMismatch, match="coordinator speaks"):
        check_server_hello(body + bytes(64), state)


@pytest.mark.parametrize("key", [b"", b"short", b"x" * 15])
def test_short_session_key_is_a_config_error(key: bytes) -> None:
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        make_client_hello(key, 0, 1)
    with pytest.raises(ConfigError):
        check_client_hello(bytes(112), key, 1)


@pytest.mark.parametrize("signature", [b"abc", bytes(32), bytes(33)])
def test_bad_signature_is_a_config_error(signature: bytes) -> None:
    with pytest.raises(ConfigError):
        make_client_hello(KEY, 0, 1, signature)


@pytest.mark.parametrize(("rank", "world"), [(-1, 2), (0, 0), (1 << 32, 2), (0, 1 << 32)])
def test_unencodable_rank_or_world_is_a_config_error(rank: int, world: int) -> None:
    with pytest.raises(ConfigError):
        make_client_hello(KEY, rank, world)
