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

One helper can also serve many launchers (``flodl warm-helper SOCKET``, named in
``FLODL_WARM_HELPER``): :func:`warm_starter_if` then connects to it
(:func:`connect_shared_helper`) instead of starting one, when it would start the ranks as
they would start on their own.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from flodl.errors import FlodlError
from flodl.supervise.zygote import FD_VAR, MAX_MESSAGE, SHARED_VAR, import_environment

__all__ = [
    "COLD_START_HELP",
    "HELPER_EXIT_GRACE",
    "RankHandle",
    "WarmProcess",
    "WarmStartError",
    "WarmStarter",
    "connect_shared_helper",
    "open_warm_starter",
    "warm_starter_if",
]

COLD_START_HELP = (
    "start each rank as a fresh `python SCRIPT` instead of forking it from a helper that has "
    "torch and flodl imported already (warm: a second or more less CPU per rank and restart)"
)

HELPER_EXIT_GRACE = 5.0
"""Seconds the helper gets to exit once the launcher is done with it, before it is killed."""

GREETING_TIMEOUT = 5.0
"""Seconds a shared helper gets to answer a launcher that connects (a stopped one never does)."""


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
    try:
        async with _serving(
            WarmStarter(trio.socket.from_stdlib_socket(ours), helper.pid)
        ) as starter:
            yield starter
    finally:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(HELPER_EXIT_GRACE):
                await helper.wait()
            if helper.returncode is None:
                helper.kill()
                await helper.wait()


async def connect_shared_helper(path: str, python: str, env: dict[str, str]) -> WarmStarter:
    """A starter on the shared helper (``flodl warm-helper``) at the Unix socket ``path``.

    WarmStartError saying why when none answers there within :data:`GREETING_TIMEOUT`, or when
    it cannot start these ranks as they would start on their own: it runs another interpreter
    than ``python``, or was started with other values of the variables its imports read
    (:func:`~flodl.supervise.zygote.import_environment`) than ``env`` has."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        greeting = b""
        with trio.move_on_after(GREETING_TIMEOUT):
            try:
                await sock.connect(path)
                greeting = await sock.recv(MAX_MESSAGE)
            except OSError as err:
                raise WarmStartError(f"no warm-start helper at {path}: {err.strerror}") from None
        if not greeting:
            raise WarmStartError(f"the warm-start helper at {path} did not answer")
        hello = _greeting(greeting)
        if hello is None:
            raise WarmStartError(f"what answers at {path} is no warm-start helper")
        mismatch = _mismatch(hello, python, env)
        if mismatch:
            raise WarmStartError(f"the warm-start helper at {path} {mismatch}")
    except BaseException:
        sock.close()
        raise
    return WarmStarter(sock, int(hello["helper"]))


def _greeting(data: bytes) -> dict[str, Any] | None:
    """A helper's greeting (its pid, interpreter and import environment), or None for what is
    not one."""
    try:
        hello = json.loads(data)
    except ValueError:
        return None
    if not isinstance(hello, dict) or not isinstance(hello.get("helper"), int):
        return None
    if not isinstance(hello.get("python"), str) or not isinstance(hello.get("env"), dict):
        return None
    return hello


def _mismatch(hello: dict[str, Any], python: str, env: dict[str, str]) -> str | None:
    """How the helper that greeted with ``hello`` differs from a rank started cold, or None."""
    ranks_python = os.path.abspath(shutil.which(python) or python)
    if hello["python"] != ranks_python:
        return f"runs {hello['python']}, the ranks {ranks_python}"
    helper_env: dict[str, str] = hello["env"]
    rank_env = import_environment(env)
    differ = sorted(
        n for n in helper_env.keys() | rank_env.keys() if helper_env.get(n) != rank_env.get(n)
    )
    if differ:
        values = "; ".join(
            f"{n}: {helper_env.get(n, 'unset')} there, {rank_env.get(n, 'unset')} for these ranks"
            for n in differ
        )
        return f"was started in another environment ({values})"
    return None


@asynccontextmanager
async def _serving(starter: WarmStarter) -> AsyncIterator[WarmStarter]:
    """Route ``starter``'s reports while the body runs; then say no more ranks, wait until the
    helper has closed its end (exits of ranks still running count as failed once they exit),
    and close ours."""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(starter.read_loop)
            try:
                yield starter
            finally:
                starter.close()
    finally:
        starter.release()


@asynccontextmanager
async def warm_starter_if(
    enabled: bool,
    python: str,
    env: dict[str, str],
    say: Callable[[str], object] | None = None,
) -> AsyncIterator[WarmStarter | None]:
    """None when not ``enabled`` (every rank starts cold); else the shared helper that
    :data:`~flodl.supervise.zygote.SHARED_VAR` names, when it can start these ranks, or a
    helper of this run's own (:func:`open_warm_starter`; ``say`` is told why the shared one
    was not used)."""
    if not enabled:
        yield None
        return
    shared = os.environ.get(SHARED_VAR)
    if shared:
        try:
            starter = await connect_shared_helper(shared, python, env)
        except WarmStartError as err:
            if say is not None:
                say(f"flodl: {err}; this run starts a helper of its own")
        else:
            async with _serving(starter):
                yield starter
            return
    async with open_warm_starter(python, env) as starter:
        yield starter
