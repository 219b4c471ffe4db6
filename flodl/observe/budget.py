"""How much of the coordinator's time the dashboard may take: a request rate over all clients.

The dashboard shares its process (and its event loop) with the coordinator, and parsing and
answering one HTTP request costs about 0.7 ms of CPU there whatever the route (measured:
bench/dashboard_bench.py). So the rate of requests served, not their size, is what must be
bounded: beyond the budget a request waits its turn before it is answered, and its client,
waiting for the answer, sends nothing more on that connection. With connections capped too,
nothing a client does makes the coordinator spend more than the budget on the dashboard.
"""

from __future__ import annotations

import trio

__all__ = ["RequestBudget"]


class RequestBudget:
    """At most ``rate`` requests a second over all clients, in bursts of up to ``burst``."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._at: float | None = None

    async def take(self) -> None:
        """Return once this request's turn has come (at once while within the budget).

        Turns are handed out in the order asked for. Cancellable while waiting; a cancelled
        wait gives its turn back.
        """
        now = trio.current_time()
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= 1.0
        if self._tokens >= 0:
            return
        try:
            await trio.sleep(-self._tokens / self.rate)
        except trio.Cancelled:
            self._tokens += 1.0
            raise
