"""unix:// listeners: owner-only socket files, stale files replaced, live ones refused."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from flodl.errors import AddressInUse, TransportError
from flodl.transports import Listener, connect, open_listener
from flodl.transports.unix import UnixListener


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "flodl.sock"


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


async def _round_trip(url: str, listener: Listener) -> None:
    assert isinstance(listener, UnixListener)
    client = await connect(url)
    server = await listener.accept()
    async with client, server:
        await client.send_all(b"hello")
        assert await server.receive_some() == b"hello"


@pytest.mark.usefixtures("permissive_umask")
async def test_socket_file_is_owner_only_even_under_umask_zero(sock_path: Path) -> None:
    url = f"unix://{sock_path}"
    async with await open_listener(url) as listener:
        assert listener.url == url
        info = os.stat(sock_path)
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        await _round_trip(url, listener)


async def test_close_removes_the_socket_file(sock_path: Path) -> None:
    listener = await open_listener(f"unix://{sock_path}")
    assert sock_path.exists()
    await listener.aclose()
    assert not sock_path.exists()
    await listener.aclose()  # idempotent


async def test_stale_file_of_a_dead_process_is_replaced(sock_path: Path) -> None:
    # A real process binds and listens, then dies without cleaning up.
    script = (
        "import os, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "s.bind(sys.argv[1]); s.listen(1)\n"
        "os._exit(0)\n"
    )
    await trio.run_process([sys.executable, "-c", script, str(sock_path)])
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
    url = f"unix://{sock_path}"
    with pytest.raises(TransportError, match=f"cannot connect to {url}"):
        await connect(url)  # refused: the stale file has no listener
    async with await open_listener(url) as listener:
        # The stale file refused connections; this one is ours and answers.
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        await _round_trip(url, listener)


async def test_a_live_listener_is_refused_and_keeps_working(sock_path: Path) -> None:
    url = f"unix://{sock_path}"
    async with await open_listener(url) as first:
        inode = os.stat(sock_path).st_ino
        with pytest.raises(AddressInUse, match="a live listener holds"):
            await open_listener(url)
        assert os.stat(sock_path).st_ino == inode
        # The refused attempt probed the live listener once: that connection ends at once.
        probe = await first.accept()
        async with probe:
            assert await probe.receive_some() == b""
        await _round_trip(url, first)


async def test_a_path_that_is_not_a_socket_is_never_removed(sock_path: Path) -> None:
    sock_path.write_text("precious")
    with pytest.raises(AddressInUse, match="exists and is not a socket"):
        await open_listener(f"unix://{sock_path}")
    assert sock_path.read_text() == "precious"


async def test_close_leaves_a_socket_file_that_another_listener_now_owns(sock_path: Path) -> None:
    url = f"unix://{sock_path}"
    old = await open_listener(url)
    os.unlink(sock_path)  # someone removed our file and a new listener took the path
    async with await open_listener(url) as new:
        await old.aclose()
        assert sock_path.exists()
        await _round_trip(url, new)
    assert not sock_path.exists()


async def test_connecting_to_a_missing_path_is_a_transport_error(sock_path: Path) -> None:
    url = f"unix://{sock_path}"
    with pytest.raises(TransportError, match=f"cannot connect to {url}"):
        await connect(url)


async def test_listening_in_a_missing_directory_is_a_transport_error(tmp_path: Path) -> None:
    url = f"unix://{tmp_path}/no/such/dir/flodl.sock"
    with pytest.raises(TransportError, match=f"cannot listen on {url}"):
        await open_listener(url)


async def test_streams_support_half_close(sock_path: Path) -> None:
    url = f"unix://{sock_path}"
    async with await open_listener(url) as listener:
        client = await connect(url)
        server = await listener.accept()
        async with client, server:
            assert isinstance(client, trio.abc.HalfCloseableStream)
            await client.send_eof()
            assert await server.receive_some() == b""
            await server.send_all(b"still open")
            assert await client.receive_some() == b"still open"


async def test_listening_takes_no_time_on_the_autojumping_clock(
    autojump_clock: trio.testing.MockClock, sock_path: Path
) -> None:
    """No worker thread in a listener's start: on this clock a thread's run lets the clock
    jump to the next deadline (here 300 s, a coordinator's join timeout in the agent tests)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep, 300)
        started = trio.current_time()
        for attempt in range(20):
            async with await open_listener(f"unix://{sock_path}{attempt}"):
                pass
        assert trio.current_time() == started
        nursery.cancel_scope.cancel()
