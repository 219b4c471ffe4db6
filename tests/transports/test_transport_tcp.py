"""tcp:// listeners and connections over real loopback sockets."""

from __future__ import annotations

import socket

import pytest
import trio

from flodl.errors import AddressInUse, TransportError, UnsupportedURL
from flodl.transports import connect, open_listener, parse_url
from flodl.transports.socket_stream import SocketStream
from flodl.transports.tcp import TcpListener


async def test_port_zero_reports_the_bound_port_and_it_accepts() -> None:
    async with await open_listener("tcp://127.0.0.1:0") as listener:
        assert isinstance(listener, TcpListener)
        parsed = parse_url(listener.url)
        assert parsed.host == "127.0.0.1"
        assert parsed.port == listener.port
        assert parsed.port not in (None, 0)
        client = await connect(listener.url)
        server = await listener.accept()
        async with client, server:
            await client.send_all(b"ping")
            assert await server.receive_some() == b"ping"
            await server.send_all(b"pong")
            assert await client.receive_some() == b"pong"


async def test_both_ends_have_nagle_off() -> None:
    async with await open_listener("tcp://127.0.0.1:0") as listener:
        client = await connect(listener.url)
        server = await listener.accept()
        async with client, server:
            for stream in (client, server):
                assert isinstance(stream, SocketStream)
                assert stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


async def test_connection_refused_is_a_transport_error_naming_the_url() -> None:
    listener = await open_listener("tcp://127.0.0.1:0")
    url = listener.url
    await listener.aclose()  # the port is now free: nobody listens there
    with pytest.raises(TransportError, match=f"cannot connect to {url}") as caught:
        await connect(url)
    assert isinstance(caught.value.__cause__, OSError)


async def test_a_port_held_by_a_live_listener_raises_address_in_use() -> None:
    async with await open_listener("tcp://127.0.0.1:0") as listener:
        with pytest.raises(AddressInUse, match=listener.url):
            await open_listener(listener.url)


async def test_an_unresolvable_host_is_a_transport_error() -> None:
    with pytest.raises(TransportError, match=r"cannot connect to tcp://no-such-host\.invalid:1"):
        await connect("tcp://no-such-host.invalid:1")


async def test_connecting_to_port_zero_is_refused_before_any_io() -> None:
    with pytest.raises(UnsupportedURL, match="port 0"):
        await connect("tcp://127.0.0.1:0")


async def test_accept_after_close_raises_closed_resource_error() -> None:
    listener = await open_listener("tcp://127.0.0.1:0")
    await listener.aclose()
    await listener.aclose()  # idempotent
    with pytest.raises(trio.ClosedResourceError):
        await listener.accept()


async def test_half_close_lets_the_peer_answer_after_eof() -> None:
    async with await open_listener("tcp://127.0.0.1:0") as listener:
        client = await connect(listener.url)
        server = await listener.accept()
        async with client, server:
            assert isinstance(client, trio.abc.HalfCloseableStream)
            await client.send_all(b"question")
            await client.send_eof()
            received = b""
            while chunk := await server.receive_some():
                received += chunk
            assert received == b"question"
            await server.send_all(b"answer")
            assert await client.receive_some() == b"answer"
