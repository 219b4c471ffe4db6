"""One task that reads every rank channel carried through node agents: :class:`TunnelReader`.

A :class:`~flodl.transports.channel_reader.ChannelReader` whose readiness comes from the tunnel
streams themselves (:class:`~flodl.transports.tunnel_stream.TunnelStream`,
:mod:`flodl.transports.hooked_readiness`): when the agent's connection delivers bytes for a
rank, the stream's hook marks it. So a frame of an agent carrying the bytes of many ranks costs
the coordinator one wake-up, not one per rank.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from flodl.transports.channel_reader import ChannelReader
from flodl.transports.hooked_readiness import HookedReadiness
from flodl.transports.tunnel_stream import TunnelStream

__all__ = ["TunnelReadiness", "TunnelReader"]


class TunnelReadiness(HookedReadiness):
    """Readiness of tunnelled channels (keys: the streams)."""

    stream_type = TunnelStream
    name = "tunnel stream"

    def _holds_something(self, stream: Any) -> bool:
        readable: bool = stream.readable
        return readable

    def after_read(self, key: Hashable) -> None:
        assert isinstance(key, TunnelStream)
        if key.readable:
            self._ready[key] = None  # a read takes at most so many bytes: the rest next pass


class TunnelReader(ChannelReader):
    """A :class:`ChannelReader` for channels over tunnel streams."""

    readiness_type = TunnelReadiness
