"""A probe on the coordinator's shell: what it tells an observer about each call to its machine.

A :class:`ShellProbe` given to :func:`~flodl.coordinator.server.open_coordinator` (``probe=``)
or to :meth:`~flodl.coordinator.server.Coordinator.set_probe` is called by the shell right
after each call it makes to its :class:`~flodl.core.coordinator.machine.CoordinatorMachine`
and before the effects of that call are carried out:

* :meth:`ShellProbe.message_handled` for every message a rank sent that the machine handled
  (``on_message``), with the rank, the message, the ``now`` the machine was given and the CPU
  seconds the call took. A message the shell does not hand to the machine (from a rank being
  let go, or one claiming another rank's id) is not reported;
* :meth:`ShellProbe.ticked` for every wake of the deadline task (``on_tick``), with the
  ``now`` it passed, the deadline the task had been sleeping for (the earliest deadline the
  machine gave since the previous tick, so ``now - deadline`` is how late the wake was) and
  the CPU seconds;
* :meth:`ShellProbe.event_handled` for the other calls (a rank connected or disconnected, a
  supervisor reported an exit, a stop was requested): which one, the rank (None for a stop),
  ``now`` and the CPU seconds.

CPU seconds are :func:`time.thread_time` differences (the coordinator's thread only, so other
processes on a shared machine do not inflate them). They are read only while a probe is set
and are never handed to the machine: they decide nothing, which is why the shell may read a
clock other than trio's here. Without a probe the shell's only cost is a None check per call.

The shell gives a probe no way to change what it does: it is handed values (messages are
frozen), never the machine or its effects, and what it returns is ignored. It is called
synchronously inside the shell's step, with no checkpoint around it (so no cancellation cuts
it short), and whatever time it takes delays every rank: it must not block (record and
return). An exception from a callback is logged (``flodl.coordinator``) and the probe is
detached; the run goes on as if it had never been set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal, Protocol

from flodl.core.coordinator.machine import CoordinatorMachine, Effect
from flodl.wire.messages import Message

log = logging.getLogger("flodl.coordinator")

MachineEvent = Literal["connect", "disconnect", "exit_reported", "stop"]
"""The machine calls reported by :meth:`ShellProbe.event_handled`: ``on_connect``,
``on_disconnect``, ``on_exit_reported`` and ``request_stop``."""


class ShellProbe(Protocol):
    """Callbacks the coordinator's shell calls around its machine calls (module docstring).

    Any object with these three methods will do; a class that subclasses this one inherits
    callbacks that do nothing, and need only define the ones it wants.
    """

    def message_handled(self, rank: int, message: Message, now: float, cpu_s: float) -> None:
        """The machine handled ``message`` from ``rank`` at trio time ``now`` in ``cpu_s``."""
        return None

    def ticked(self, now: float, deadline: float, cpu_s: float) -> None:
        """The deadline task, armed for trio time ``deadline``, woke and the machine's tick at
        ``now`` (``>= deadline``) took ``cpu_s``."""
        return None

    def event_handled(
        self, event: MachineEvent, rank: int | None, now: float, cpu_s: float
    ) -> None:
        """The machine handled ``event`` (of ``rank``; None for a stop) at ``now`` in ``cpu_s``."""
        return None


class Probing:
    """The shell's side of its probe: the probe set (:attr:`probe`; None: none), the timing of
    the machine calls it is told of, and the detaching of a probe that raises.

    The shell checks :attr:`probe` for None before calling on a hot path (a message, a tick),
    so an unset probe costs it nothing more.
    """

    def __init__(self, probe: ShellProbe | None = None) -> None:
        self.probe = probe

    def message(
        self, machine: CoordinatorMachine, rank: int, message: Message, now: float
    ) -> list[Effect]:
        """``machine.on_message(rank, message, now)``, timed and told to the probe."""
        started = time.thread_time()
        effects = machine.on_message(rank, message, now)
        took = time.thread_time() - started
        probe = self.probe
        if probe is not None:
            try:
                probe.message_handled(rank, message, now, took)
            except Exception as err:
                self._failed(probe, err)
        return effects

    def tick(self, machine: CoordinatorMachine, now: float, deadline: float) -> list[Effect]:
        """``machine.on_tick(now)`` for a deadline task armed for ``deadline``, timed and told
        to the probe."""
        started = time.thread_time()
        effects = machine.on_tick(now)
        took = time.thread_time() - started
        probe = self.probe
        if probe is not None:
            try:
                probe.ticked(now, deadline, took)
            except Exception as err:
                self._failed(probe, err)
        return effects

    def call(
        self,
        event: MachineEvent,
        rank: int | None,
        now: float,
        call: Callable[[], list[Effect]],
    ) -> list[Effect]:
        """``call()`` (the machine's call for ``event``); timed and told to the probe if one
        is set."""
        probe = self.probe
        if probe is None:
            return call()
        started = time.thread_time()
        effects = call()
        took = time.thread_time() - started
        try:
            probe.event_handled(event, rank, now, took)
        except Exception as err:
            self._failed(probe, err)
        return effects

    def _failed(self, probe: ShellProbe, error: Exception) -> None:
        log.error(
            "probe %r raised %s: %s; it is detached, the run goes on",
            probe,
            type(error).__name__,
            error,
            exc_info=error,
        )
        if self.probe is probe:
            self.probe = None


__all__ = ["MachineEvent", "Probing", "ShellProbe"]
