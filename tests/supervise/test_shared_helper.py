"""The shared warm-start helper (``flodl warm-helper SOCKET``): one process that forks the ranks
of every launcher that names it in ``FLODL_WARM_HELPER``, and the launchers that must not use it.

Real processes throughout: each test starts its own helper with the `flodl` command (not the
suite's) and leaves it gone, its socket file removed and every rank reaped.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from flodl.supervise.warm import WarmProcess, WarmStarter, warm_starter_if
from flodl.supervise.zygote import SHARED_VAR

# One worker runs the module, so that its tests share one helper.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("shared_helper")]

EXITS_WITH = "import os, sys\nprint(os.getppid(), flush=True)\nsys.exit(int(sys.argv[1]))\n"
"""A rank that prints its parent's pid and exits with the code it is given."""

HELPER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
"""The environment the helpers of these tests import in (and the ranks' unless a test says)."""


class Helper:
    """A ``flodl warm-helper`` process of a test's own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        env = {k: v for k, v in HELPER_ENV.items() if k != SHARED_VAR}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flodl.cli", "warm-helper", str(path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        self.ready_line = self.process.stdout.readline()

    def stop(self) -> int:
        """SIGTERM, then the exit code."""
        self.process.send_signal(signal.SIGTERM)
        self.process.communicate()
        return self.process.returncode


@pytest.fixture(scope="module")
def module_helper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Helper]:
    """One helper for the tests that leave it running (its start costs seconds of CPU)."""
    started = Helper(tmp_path_factory.mktemp("shared") / "helper.sock")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
def helper(module_helper: Helper, monkeypatch: pytest.MonkeyPatch) -> Helper:
    """The module's helper, named in ``FLODL_WARM_HELPER`` for the test."""
    assert module_helper.process.poll() is None
    monkeypatch.setenv(SHARED_VAR, str(module_helper.path))
    return module_helper


async def run_rank(starter: WarmStarter, script: Path, code: int) -> tuple[int, int, WarmProcess]:
    """Start ``script`` with ``code``; its exit code as the helper reported it, the parent pid
    it printed, and the process."""
    rank = await starter.start([sys.executable, str(script), str(code)], HELPER_ENV)
    assert rank.stdout is not None
    parent = int(b"".join([chunk async for chunk in rank.stdout]).decode())
    return await rank.wait(), parent, rank


async def own_helper_instead() -> tuple[int, str]:
    """Open a warm starter for ranks of ``HELPER_ENV`` that starts a helper of its own: that
    helper's pid, and the one line the launcher said of the shared one."""
    said: list[str] = []
    async with warm_starter_if(True, sys.executable, HELPER_ENV, said.append) as own:
        assert own is not None
        (line,) = said
        return own.helper_pid, line


async def test_two_launchers_fork_their_ranks_from_the_one_helper_which_outlives_them(
    helper: Helper, tmp_path: Path
) -> None:
    script = tmp_path / "exits.py"
    script.write_text(EXITS_WITH)
    assert f"export {SHARED_VAR}={helper.path}" in helper.ready_line
    assert oct(helper.path.stat().st_mode & 0o777) == "0o600"  # this user's only
    said: list[str] = []
    async with (
        warm_starter_if(True, sys.executable, HELPER_ENV, said.append) as first,
        warm_starter_if(True, sys.executable, HELPER_ENV, said.append) as second,
    ):
        assert first is not None and second is not None
        assert first.helper_pid == second.helper_pid == helper.process.pid
        results = {}

        async def one(name: str, starter: WarmStarter, code: int) -> None:
            results[name] = await run_rank(starter, script, code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "first", first, 3)
            nursery.start_soon(one, "second", second, 4)
    assert said == []
    # Each launcher was told of its own rank's exit; both ranks were the helper's children.
    assert [results[n][:2] for n in ("first", "second")] == [
        (3, helper.process.pid),
        (4, helper.process.pid),
    ]
    # The launchers are gone; the helper serves a third.
    async with warm_starter_if(True, sys.executable, HELPER_ENV) as third:
        assert third is not None
        assert (await run_rank(third, script, 0))[:2] == (0, helper.process.pid)


async def test_ranks_that_would_import_in_another_environment_get_a_helper_of_their_own(
    helper: Helper, tmp_path: Path
) -> None:
    script = tmp_path / "exits.py"
    script.write_text(EXITS_WITH)
    said: list[str] = []
    other = {**HELPER_ENV, "OMP_NUM_THREADS": "2"}
    async with warm_starter_if(True, sys.executable, other, said.append) as own:
        assert own is not None and own.helper_pid != helper.process.pid
        code, parent, _ = await run_rank(own, script, 5)
        assert (code, parent) == (5, own.helper_pid)
    assert said == [
        f"flodl: the warm-start helper at {helper.path} was started in another environment "
        "(OMP_NUM_THREADS: 1 there, 2 for these ranks); this run starts a helper of its own"
    ]
    said.clear()
    python = tmp_path / "python"  # another interpreter (the same one, started otherwise)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    async with warm_starter_if(True, str(python), HELPER_ENV, said.append) as own:
        assert own is not None and own.helper_pid != helper.process.pid
    assert f"runs {sys.executable}, the ranks {python};" in said[0]


async def test_no_helper_at_the_named_path_means_a_helper_of_the_runs_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SHARED_VAR, str(tmp_path / "nobody.sock"))
    _, said = await own_helper_instead()
    assert said == (
        f"flodl: no warm-start helper at {tmp_path / 'nobody.sock'}: No such file or directory; "
        "this run starts a helper of its own"
    )


async def test_something_else_at_the_path_is_no_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "other.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as other:
        other.bind(str(path))
        other.listen(1)
        monkeypatch.setenv(SHARED_VAR, str(path))

        async def greet_wrongly() -> None:
            await trio.lowlevel.wait_readable(other)
            connection, _ = other.accept()
            with connection:
                connection.send(b'{"hello": "world"}')
                await trio.lowlevel.wait_readable(connection)  # until the launcher hangs up

        async with trio.open_nursery() as nursery:
            nursery.start_soon(greet_wrongly)
            _, said = await own_helper_instead()
    assert said == (
        f"flodl: what answers at {path} is no warm-start helper; "
        "this run starts a helper of its own"
    )


async def test_a_helper_that_does_not_answer_is_given_up_on_at_once(
    helper: Helper, autojump_clock: MockClock
) -> None:
    # A stopped helper's socket still accepts (the kernel queues the connection) but no
    # greeting comes: the launcher waits GREETING_TIMEOUT of trio's clock, then starts its own.
    os.kill(helper.process.pid, signal.SIGSTOP)
    try:
        own, said = await own_helper_instead()
        assert own != helper.process.pid
        assert said == (
            f"flodl: the warm-start helper at {helper.path} did not answer; "
            "this run starts a helper of its own"
        )
    finally:
        os.kill(helper.process.pid, signal.SIGCONT)


async def test_what_is_not_a_request_closes_that_connection_and_the_helper_serves_on(
    helper: Helper, tmp_path: Path
) -> None:
    script = tmp_path / "exits.py"
    script.write_text(EXITS_WITH)
    for garbage in (b"\xff\x00 not json", b'{"argv": "x"}', b'{"argv": [], "env": {}, "cwd": "/"}'):
        # The last is well formed but came without the descriptor for the rank's output.
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as liar:
            liar.connect(str(helper.path))
            assert b'"helper"' in liar.recv(1 << 16)  # the greeting
            liar.send(garbage)
            assert liar.recv(1 << 16) == b""  # closed by the helper
    async with warm_starter_if(True, sys.executable, HELPER_ENV) as honest:
        assert honest is not None
        assert (await run_rank(honest, script, 0))[:2] == (0, helper.process.pid)


def test_a_second_helper_on_a_served_path_refuses_a_stale_socket_is_replaced_and_sigterm_ends_it(
    tmp_path: Path,
) -> None:
    first = Helper(tmp_path / "helper.sock")
    try:
        second = Helper(first.path)
        assert second.process.wait() == 1
        _, error = second.process.communicate()
        assert f"flodl: a warm-start helper serves {first.path} already" in error
        assert first.process.poll() is None
    finally:
        # A helper killed outright leaves its socket file; the next one takes the path over.
        first.process.kill()
        first.process.communicate()
    assert first.path.exists()
    third = Helper(first.path)
    assert "ready" in third.ready_line
    assert third.stop() == 0
    assert not first.path.exists()  # SIGTERM: the helper removed its socket on the way out
