"""What a shared channel reader hands over, as both reader test files record it."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from flodl.wire.messages import Message

WAIT = 5.0


@attrs.define(eq=False)
class ReaderLog:
    """Messages and ends per channel index, with the pass and time of each batch."""

    messages: dict[int, list[Message]] = attrs.field(factory=dict)
    batches: list[tuple[int, int, int, float]] = attrs.field(factory=list)
    """(index, batch size, pass number, now) per on_messages call."""
    ends: dict[int, list[Exception | None]] = attrs.field(factory=dict)
    passes: int = 0
    changed: trio.Event = attrs.field(factory=trio.Event)

    def handlers(
        self, index: int
    ) -> tuple[Callable[[list[Message], float], None], Callable[[Exception | None], None]]:
        def on_messages(batch: list[Message], now: float) -> None:
            assert batch
            self.messages.setdefault(index, []).extend(batch)
            self.batches.append((index, len(batch), self.passes, now))
            self._changed()

        def on_end(error: Exception | None) -> None:
            self.ends.setdefault(index, []).append(error)
            self._changed()

        return on_messages, on_end

    def after_pass(self) -> None:
        self.passes += 1

    @property
    def times(self) -> list[float]:
        return [now for *_, now in self.batches]

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Wait (at most ``WAIT`` s) until ``condition()`` holds after some handover."""
        with trio.fail_after(WAIT):
            while not condition():
                await self.changed.wait()
