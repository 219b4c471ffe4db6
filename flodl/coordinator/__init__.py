"""The coordinator's trio shell: the server around its machine (:func:`open_coordinator`), the
admission of ranks, its signals and its process (``flodl coordinator``).

Rule: never imports ``flodl.launch``; it feeds exits from ``flodl.supervise`` to its machine
through :class:`~flodl.supervise.exits.ExitSink`.
"""

from flodl.coordinator.server import Coordinator, EventSink, open_coordinator

__all__ = ["Coordinator", "EventSink", "open_coordinator"]
