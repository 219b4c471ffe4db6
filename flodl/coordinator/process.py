"""``flodl coordinator``: serve one run in this process until it ends, and say how it ended."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import trio

from flodl.coordinator.signals import StopSignals, watch_signals
from flodl.core.coordinator.ending import listed_ranks

if TYPE_CHECKING:
    from flodl.coordinator.server import Coordinator
    from flodl.wire.messages import CheckpointResult


SAVE_REPORTS_WAIT_S = 60.0
"""How long ``flodl coordinator`` waits, after a save went out, for every rank to report its
bundle and hang up (a second signal stops the wait)."""


async def coordinate(coordinator: Coordinator, stops: StopSignals | None = None) -> tuple[str, int]:
    """``flodl coordinator``: serve until the run ends, SIGINT/SIGTERM handled as by ``flodl
    run`` except that a second one stops the coordinator at once (its ranks, on other hosts,
    then see it gone). Returns the line to print and the exit status: 0 when the run completed
    or was stopped on request (save_reason GRACEFUL), 1 when it did not complete; ``stops``
    receives the signals."""
    stops = StopSignals() if stops is None else stops
    async with trio.open_nursery() as nursery:
        says = ("stop at once", "stopping at once; ranks still saving lose their work")
        await nursery.start(watch_signals, coordinator, stops, nursery.cancel_scope.cancel, says)
        await coordinator.wait_finished()
        if coordinator.record.outcome.save_reason is not None:
            # Each rank reports its bundle before it hangs up: wait for the reports.
            with trio.move_on_after(SAVE_REPORTS_WAIT_S):
                await coordinator.wait_all_hung_up()
        nursery.cancel_scope.cancel()
    outcome = coordinator.record.outcome
    why = outcome.message + (f" ({stops.received[0]})" if stops.received else "")
    if stops.killed:
        return f"flodl: run stopped at once by a second {stops.received[-1]}: {why}", 1
    if outcome.save_reason is not None:
        # The bundles are on the ranks' hosts: what each rank reported (its output says more).
        return (
            f"flodl: run stopped, every rank asked to save (save_reason "
            f"{outcome.save_reason.name}): {why}; {_reported(coordinator.record.stop_saves)}",
            0 if outcome.save_reason.name == "GRACEFUL" else 1,
        )
    return (
        f"flodl: run {outcome.status.value} {why}",
        0 if outcome.status.value == "completed" else 1,
    )


def _reported(reports: Mapping[int, CheckpointResult | None]) -> str:
    """What the ranks asked to save reported, in words."""
    saved = [rank for rank, report in reports.items() if report and report.error is None]
    failed = [rank for rank, report in reports.items() if report and report.error]
    silent = [rank for rank, report in reports.items() if report is None]
    parts = [f"ranks {listed_ranks(saved)} saved on their own hosts"] if saved else []
    parts += [f"ranks {listed_ranks(failed)} could not save (see their output)"] if failed else []
    parts += [f"ranks {listed_ranks(silent)} did not report a save"] if silent else []
    return "; ".join(parts) or "no rank was connected to save"
