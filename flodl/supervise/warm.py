"""Warm starts: ranks forked from a helper that has torch and flodl imported already.

A rank started cold (``python script.py``) spends a second or more of CPU importing torch
before its first line runs, and a rank restarted after a failure spends it again while the
group waits for it. :func:`open_warm_starter` starts one helper process per host
(:mod:`flodl.supervise.zygote`) that imports them once; :meth:`WarmStarter.start` then has it
fork each rank, which begins with all of that imported. The rank it gives is a
:class:`WarmProcess`: what the supervisor needs of a process (``pid``, ``returncode``,
``stdout``, ``wait``, ``kill``, ``send_signal``), with the helper reporting its exit.

A helper that cannot start (an interpreter without flodl) or is gone makes
:meth:`WarmStarter.start` raise :class:`WarmStartError`; the caller then starts the rank cold.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from flodl.errors import FlodlError
from flodl.supervise.zygote import FD_VAR, MAX_MESSAGE

__all__ = [
    "COLD_START_HELP",
    "HELPER_EXIT_GRACE",
    "RankHandle",
    "WarmProcess",
    "WarmStartError",
    "WarmStarter",
    "open_warm_starter",
    "warm_starter_if",
]

COLD_START_HELP = (
    "start each rank as a fresh `python SCRIPT` instead of forking it from a helper that has "
    "torch and flodl imported already (warm: a second or more less CPU per rank and restart)"
)

HELPER_EXIT_GRACE = 5.0
"""Seconds the helper gets to exit once the launcher is done with it, before it is killed."""


class WarmStartError(FlodlError):
    """The warm-start helper could not start a rank (it failed to start, or is gone)."""


class WarmProcess:
    """A rank forked by the helper, as the supervisor sees a process.

    Signals go through a pidfd, so they never reach another process that reused the pid; the
    exit status is the helper's report (it is the parent)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        """The exit code once the helper reported it; ``-N`` for death by signal ``N``."""
        self.stdout: trio.abc.ReceiveStream | None = None
        """The rank's output (stdout and stderr together)."""
        self._pidfd = pidfd
        self._exited = trio.Event()

    async def wait(self) -> int:
        """Wait until the process has exited; its exit code. Safe to cancel."""
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the process (nothing once it has exited)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def exited(self, code: int) -> None:
        """The helper reaped the process: it exited with ``code``."""
        if self.returncode is None:
            self.returncode = code
            os.close(self._pidfd)
            self._exited.set()

    async def orphaned(self) -> None:
        """The helper is gone, so no exit status will come: wait until the pidfd says the
        process has exited and count it as failed (1). Safe to cancel."""
        if self.returncode is None:
            with contextlib.suppress(OSError):
                await trio.lowlevel.wait_readable(self._pidfd)
            self.exited(1)


RankHandle = trio.Process | WarmProcess
"""A rank's process: started cold (:func:`~flodl.supervise.ranks.open_rank_process`) or forked
warm (:class:`WarmStarter`)."""


class WarmStarter:
    """Starts ranks through one helper process (built by :func:`open_warm_starter`)."""

    def __init__(self, sock: trio.socket.SocketType, helper_pid: int) -> None:
        self.helper_pid = helper_pid
        """The helper's process id (the parent of every rank it starts)."""
        self._sock = sock
        self._lock = trio.Lock()
        self._started_send, self._started = trio.open_memory_channel[WarmProcess](1)
        self._by_pid: dict[int, WarmProcess] = {}
        self._gone: str | None = None

    async def start(
        self, argv: Sequence[str], env: dict[str, str], cwd: str | None = None
    ) -> WarmProcess:
        """Fork a rank running ``argv`` (``[python, script, *args]``) with ``env`` in ``cwd``
        (this process's by default), in a session of its own, its output on
        :attr:`WarmProcess.stdout`. WarmStartError when the helper is gone."""
        if self._gone is not None:
            raise WarmStartError(self._gone)
        if len(argv) < 2 or argv[1].startswith("-"):
            raise WarmStartError(f"a warm start runs a script file, not {list(argv[1:2])}")
        request = json.dumps({"argv": list(argv), "env": env, "cwd": cwd or os.getcwd()})
        read_end, write_end = os.pipe()
        try:
            async with self._lock:  # the helper answers requests in the order they came
                try:
                    fds = array.array("i", [write_end])
                    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
                    await self._sock.sendmsg([request.encode()], ancillary)
                except OSError as err:
                    raise WarmStartError(f"the warm-start helper is gone: {err}") from None
                finally:
                    os.close(write_end)
                try:
                    process = await self._started.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    raise WarmStartError(self._gone or "the warm-start helper is gone") from None
        except BaseException:
            os.close(read_end)
            raise
        process.stdout = trio.lowlevel.FdStream(read_end)
        return process

    async def read_loop(self) -> None:
        """Route the helper's reports (a start, an exit) until it closes its end."""
        try:
            while True:
                message, ancillary, _, _ = await self._sock.recvmsg(
                    MAX_MESSAGE, socket.CMSG_SPACE(array.array("i").itemsize)
                )
                if not message:
                    break
                report = json.loads(message)
                if "pid" in report:
                    (pidfd,) = _received_fds(ancillary)
                    process = WarmProcess(int(report["pid"]), pidfd)
                    self._by_pid[process.pid] = process
                    await self._started_send.send(process)
                elif "exited" in report:
                    process = self._by_pid.pop(int(report["exited"]))
                    process.exited(int(report["code"]))
        except (OSError, trio.ClosedResourceError) as err:
            self._gone = f"the warm-start helper is gone: {err}"
        finally:
            self._gone = self._gone or "the warm-start helper is gone"
            self._started_send.close()
            await self._orphaned()

    async def _orphaned(self) -> None:
        """The helper is gone with ranks still running: their exit statuses are lost, so each
        counts as failed (1) once its pidfd says it has exited."""
        async with trio.open_nursery() as nursery:
            for process in list(self._by_pid.values()):
                nursery.start_soon(process.orphaned)
        self._by_pid.clear()

    def close(self) -> None:
        """No more ranks: the helper reads the end of the requests and exits (the ranks it
        started run on); :meth:`read_loop` then ends."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)

    def release(self) -> None:
        """Close this end of the socket (after :meth:`read_loop` ended)."""
        self._sock.close()


def _received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return list(fds)


@asynccontextmanager
async def open_warm_starter(python: str, env: dict[str, str]) -> AsyncIterator[WarmStarter]:
    """A helper started with ``python`` in ``env`` (the ranks' common environment: what torch
    reads when it is imported, ``OMP_NUM_THREADS`` first, must be theirs).

    Guarantees: on exit the helper is gone (asked to exit, killed after
    :data:`HELPER_EXIT_GRACE`); ranks it started run on, but their exits are reported only
    while it lives, so leave this only once they have exited."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        helper = await trio.lowlevel.open_process(
            [python, "-m", "flodl.supervise.zygote"],
            env={**env, FD_VAR: str(theirs.fileno())},
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C is the launcher's to handle
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    starter = WarmStarter(trio.socket.from_stdlib_socket(ours), helper.pid)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(starter.read_loop)
            try:
                yield starter
            finally:
                starter.close()
    finally:
        starter.release()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(HELPER_EXIT_GRACE):
                await helper.wait()
            if helper.returncode is None:
                helper.kill()
                await helper.wait()


@asynccontextmanager
async def warm_starter_if(
    enabled: bool, python: str, env: dict[str, str]
) -> AsyncIterator[WarmStarter | None]:
    """:func:`open_warm_starter` when ``enabled``, else None (every rank starts cold)."""
    if not enabled:
        yield None
        return
    async with open_warm_starter(python, env) as starter:
        yield starter
