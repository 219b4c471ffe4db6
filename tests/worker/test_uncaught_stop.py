"""A ``ShutdownRequested`` that a script leaves uncaught ends its process as ``sys.exit`` does:
no traceback; status 0 after a stop the run was asked for, 1 after a save the run was driven
to (a real interpreter in a subprocess, as a rank runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flodl.core.rank.effects import CancelRound, Raise, SaveAndStop
from flodl.errors import FlodlError, ShutdownRequested
from flodl.wire.messages import SaveReason, ShutdownWithSave
from tests.core.test_rank_machine import epoch_work, new_machine, train

RAISES = """\
from flodl.errors import ShutdownRequested
try:
    raise ShutdownRequested("coordinator asked to save and stop", stopped_as_asked={asked})
finally:
    print("the script's finally ran", flush=True)
"""


@pytest.mark.parametrize(("asked", "status"), [(True, 0), (False, 1)])
def test_an_uncaught_stop_exits_with_its_status_and_no_traceback(asked: bool, status: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", RAISES.format(asked=asked)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == status, done.stderr
    assert "Traceback" not in done.stderr and "ShutdownRequested" not in done.stderr
    assert done.stdout == "the script's finally ran\n"


@pytest.mark.parametrize("catch", [ShutdownRequested, FlodlError, Exception])
def test_what_a_script_catches_today_still_catches_it(catch: type[Exception]) -> None:
    try:
        raise ShutdownRequested("stop", stopped_as_asked=True)
    except catch as caught:
        assert isinstance(caught, SystemExit) and str(caught) == "stop"


@pytest.mark.parametrize(
    "reason", [reason for reason in SaveReason if reason is not SaveReason.CHECKPOINT]
)
def test_only_a_graceful_save_ends_the_rank_with_status_0(reason: SaveReason) -> None:
    machine = new_machine(rank=1)
    machine.receive(epoch_work(0, 0, 20))
    train(machine, 0.0)
    machine.receive(ShutdownWithSave(reason=reason))
    machine.enter_boundary(1.0)
    assert machine.boundary(1.0) == [CancelRound(), SaveAndStop(reason.name)]
    machine.save_finished("saved to /runs/r1", 30.0, None, "/runs/r1")
    (step,) = machine.boundary(2.0)
    assert isinstance(step, Raise) and isinstance(step.error, ShutdownRequested)
    assert step.error.exit_status == (0 if reason is SaveReason.GRACEFUL else 1)
    assert step.error.code == step.error.exit_status  # what an uncaught one exits with
