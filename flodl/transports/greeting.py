"""Introductions: the handshake over a fresh stream, after which both sides hold a Channel.

A rank (:func:`connect_rank`) or a node agent (:func:`connect_agent`) introduces itself; the
coordinator (:func:`accept_peer`, or :func:`accept_rank` where only ranks are taken) checks the
hello (:mod:`flodl.wire.handshake`) and answers. Each direction of the session then has its own
frame key, and each side's Channel accepts only the messages its peer may send it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import trio

from flodl.errors import (
    DuplicateRank,
    HandshakeError,
    HandshakeVersionMismatch,
    ProtocolError,
    ReplayedHello,
)
from flodl.transports.channel import Channel
from flodl.transports.errors import STREAM_ERRORS, map_exceptions
from flodl.wire.codec import DEFAULT_MAX_PAYLOAD
from flodl.wire.handshake import (
    CLIENT_HELLO_SIZE,
    NONCE_SIZE,
    PREFIX_CHECK_SIZE,
    SERVER_HELLO_SIZE,
    ClientState,
    Hello,
    HelloStatus,
    check_client_hello,
    check_client_prefix,
    check_server_hello,
    check_session_key,
    check_signature,
    derive_keys,
    hello_nonce,
    make_client_hello,
    make_server_hello,
    status_for,
)
from flodl.wire.messages import FROM_AGENT_TAGS, TO_AGENT_TAGS, TO_COORDINATOR_TAGS, TO_RANK_TAGS

__all__ = ["SpentNonces", "accept_peer", "accept_rank", "connect_agent", "connect_rank"]

_HANDSHAKING = map_exceptions(STREAM_ERRORS, "stream broke during the handshake")


class SpentNonces:
    """The ``replayed`` check of :func:`accept_peer`: remembers every nonce it is asked about
    (32 bytes each) and says True for one asked about before, a recorded hello sent again."""

    def __init__(self) -> None:
        self._spent: set[bytes] = set()

    def __call__(self, nonce: bytes) -> bool:
        if nonce in self._spent:
            return True
        self._spent.add(nonce)
        return False


async def _receive_exactly(
    stream: trio.abc.Stream,
    size: int,
    what: str,
    check: Callable[[bytes], None] | None = None,
    *,
    already: int = 0,
) -> bytes:
    # Reads never go past ``size``: the bytes after a hello belong to the channel.
    buffer = bytearray()
    while len(buffer) < size:
        with _HANDSHAKING:
            data = await stream.receive_some(size - len(buffer))
        if not data:
            raise HandshakeError(
                f"the peer closed the connection during the handshake "
                f"({already + len(buffer)} of {already + size} bytes of its {what})"
            )
        buffer += data
        if check is not None:
            check(bytes(buffer))
    return bytes(buffer)


async def _send_handshake(stream: trio.abc.Stream, data: bytes) -> None:
    with _HANDSHAKING:
        await stream.send_all(data)


async def connect_rank(
    stream: trio.abc.Stream,
    key: bytes,
    rank: int,
    world_size: int,
    signature: bytes | None = None,
    *,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> Channel:
    """Introduce this rank to the coordinator over ``stream``; the accepted Channel.

    Raises the typed handshake error if the coordinator refuses (WorldSizeMismatch,
    RankOutOfRange, DuplicateRank, SignatureMismatch, WrongKey, HandshakeVersionMismatch),
    WrongKey if its reply does not verify, HandshakeError if it hangs up, BrokenChannel if the
    stream breaks. No deadline of its own: the caller bounds it with a cancel scope. The
    stream is not closed on failure (the caller owns it).
    """
    hello, state = make_client_hello(key, rank, world_size, signature)
    return await _introduce(stream, hello, state, TO_RANK_TAGS, max_payload)


async def connect_agent(
    stream: trio.abc.Stream,
    key: bytes,
    node_rank: int,
    world_size: int = 0,
    *,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> Channel:
    """Introduce node ``node_rank``'s agent to the coordinator; the accepted Channel (it
    receives only what a coordinator sends an agent). ``world_size`` 0: the coordinator's.
    Raises as :func:`connect_rank` does (DuplicateRank: another live agent speaks for this
    node)."""
    hello, state = make_client_hello(key, node_rank, world_size, agent=True)
    return await _introduce(stream, hello, state, TO_AGENT_TAGS, max_payload)


async def _introduce(
    stream: trio.abc.Stream,
    hello: bytes,
    state: ClientState,
    receive_tags: frozenset[int],
    max_payload: int,
) -> Channel:
    """Send ``hello``, check the coordinator's reply: the channel, receiving ``receive_tags``."""
    await _send_handshake(stream, hello)
    reply = await _receive_exactly(stream, SERVER_HELLO_SIZE, "reply")
    keys = check_server_hello(reply, state)
    return Channel(
        stream,
        send_key=keys.to_coordinator,
        receive_key=keys.to_rank,
        receive_tags=receive_tags,
        max_payload=max_payload,
    )


async def accept_rank(
    stream: trio.abc.Stream,
    key: bytes,
    world_size: int,
    signature: bytes | None = None,
    *,
    taken: Callable[[int], bool],
    replayed: Callable[[bytes], bool] | None = None,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> tuple[int, Channel]:
    """:func:`accept_peer` for a rank only: an agent's hello is refused (ProtocolError)."""
    hello, channel = await accept_peer(
        stream,
        key,
        world_size,
        signature,
        taken=taken,
        replayed=replayed,
        max_payload=max_payload,
    )
    return hello.rank, channel


async def accept_peer(
    stream: trio.abc.Stream,
    key: bytes,
    world_size: int,
    signature: bytes | None = None,
    *,
    taken: Callable[[int], bool],
    agent_taken: Callable[[int], bool] | None = None,
    replayed: Callable[[bytes], bool] | None = None,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> tuple[Hello, Channel]:
    """Run the coordinator's side of the handshake; the verified hello and its Channel.

    ``taken(rank)`` is called once, synchronously, after a rank's hello verified; True refuses
    the rank as DuplicateRank. Nothing awaits between that call and the decision, so a caller
    that reserves the rank inside ``taken`` keeps ranks unique under concurrency (serve_ranks
    does). ``agent_taken(node_rank)`` does the same for a node agent's hello
    (:data:`~flodl.wire.handshake.HELLO_AGENT`); without it an agent is refused with
    ProtocolError. An agent's Channel receives only what an agent sends. ``replayed(nonce)``,
    called first, says whether the hello's nonce was seen before: True refuses it as
    ReplayedHello, without a reply (serve_ranks remembers every nonce it accepted; a genuine
    peer draws a fresh one for each connection).

    A refused peer is told why before the error is raised (WrongKey, HandshakeVersionMismatch,
    WorldSizeMismatch, RankOutOfRange, DuplicateRank, SignatureMismatch); a non-flodl peer
    (ProtocolError) gets no reply. No deadline of its own: the caller bounds it with a cancel
    scope. The stream is not closed on failure (the caller owns it).
    """
    check_session_key(key)
    signature = check_signature(signature)
    try:
        prefix = await _receive_exactly(stream, PREFIX_CHECK_SIZE, "hello", check_client_prefix)
    except HandshakeVersionMismatch as err:
        # The rest of a hello of another version may be laid out differently: do not read it.
        await _refuse(stream, key, bytes(NONCE_SIZE), HelloStatus.VERSION_MISMATCH, 0, err)
        raise
    rest = await _receive_exactly(
        stream, CLIENT_HELLO_SIZE - PREFIX_CHECK_SIZE, "hello", already=PREFIX_CHECK_SIZE
    )
    data = prefix + rest
    try:
        hello = check_client_hello(data, key, world_size, signature)
        who = f"node {hello.rank}'s agent" if hello.agent else f"rank {hello.rank}"
        if replayed is not None and replayed(hello.nonce):
            raise ReplayedHello(f"a hello for {who} was replayed (its nonce is spent)")
        if hello.agent and agent_taken is None:
            raise ProtocolError(f"{who} reached an endpoint that takes ranks only")
        if (agent_taken if hello.agent and agent_taken else taken)(hello.rank):
            raise DuplicateRank(f"{who} is already held by a live connection")
    except HandshakeError as err:
        status = status_for(err)
        if status is not None:
            await _refuse(stream, key, hello_nonce(data), status, world_size, err)
        raise
    reply, server_nonce = make_server_hello(key, hello.nonce)
    await _send_handshake(stream, reply)
    keys = derive_keys(key, hello.nonce, server_nonce)
    return hello, Channel(
        stream,
        send_key=keys.to_rank,
        receive_key=keys.to_coordinator,
        receive_tags=FROM_AGENT_TAGS if hello.agent else TO_COORDINATOR_TAGS,
        max_payload=max_payload,
    )


async def _refuse(
    stream: trio.abc.Stream,
    key: bytes,
    client_nonce: bytes,
    status: HelloStatus,
    world_size: int,
    reason: BaseException,
) -> None:
    """Tell the rank why it is refused; best effort (a broken stream must not hide ``reason``)."""
    detail = world_size if status == HelloStatus.WORLD_SIZE_MISMATCH else 0
    reply, _ = make_server_hello(key, client_nonce, status, detail)
    with contextlib.suppress(*STREAM_ERRORS):
        await stream.send_all(reply)
